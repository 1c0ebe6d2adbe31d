"""Several streams at once: batched passes, the scheduler that gathers them, and speculation chosen by load.

Each stream runs the ordinary loop (Generator, speculative_decode, its own proposer and controller) in a thread of
its own, over a `SlotEngine`: the Engine contract over one slot (cache row) of a backend's batch engine. A slot
engine's pass does not run at once: the `Scheduler` holds it until every stream that has joined is waiting in a
pass, then runs all of them, each engine's rows as one batched call (a target's rows together, a draft model's
together), and wakes them. So streams join and leave between rounds, each keeps its own length, draft and
acceptance, and the output of each is the output it has alone: nothing in the loop knows about the batch.

More: docs/runtime-notes.md, "Module notes: runtime/batch.py".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .control import PassCost
from .engine import KVSnapshot, check_pass, tree_moves


@dataclass(eq=False)
class PassRow:
    """One stream's pass for a batch engine: it writes K/V at the slot's [length, length + n)."""

    slot: int
    tokens: np.ndarray            # [n] int64
    positions: np.ndarray         # [n] int64
    mask: np.ndarray | None       # [n, n] additive tree mask, None = causal
    num_logits: int
    greedy: bool                  # out = the greedy tokens [num_logits] int64, else the logits [num_logits, V]
    chunk: int = 0                # > 0: a chunk of a prefill, the prefill's ticket (the scheduler runs one a round)
    hidden_at: int = 0            # rows of its prefill that earlier chunks ran: where its own go in the slot's copy
    approx: bool = False          # through a CPU fp32 engine's logit screen whatever its rule (the build's checks)
    out: np.ndarray | None = None
    hidden: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False


class BatchCosts:
    """Seconds of a pass of B rows at width W (ONNX Runtime CPU: B rows of one token, or one row of W; the portable
    graph: B rows padded to W): each (B, W) cell's average once `trust` passes back it, else a line fitted over the
    passes of its kind, one row by width and one-token rows by count (control.PassCost; the two grow at different
    rates), both for a padded batch. Prefills (wider than `max_width`) are left out of the lines: their cost says
    nothing about a decode pass."""

    def __init__(self, max_width: int = 64, max_rows: int = 64, trust: int = 6, rate: float = 0.2):
        self.by_width = PassCost(0.1, max_width, trust=10 ** 9)   # B = 1, W = 1..max_width
        self.by_rows = PassCost(0.07, max_rows, trust=10 ** 9)    # W = 1, B = 1..max_rows
        self.max_width, self.trust, self.rate = max_width, trust, rate
        self.cells: dict[tuple[int, int], list[float]] = {}  # (B, W) -> [seconds, passes]

    def __call__(self, B: int, W: int) -> float:
        cell = self.cells.get((B, W))
        if cell is not None and cell[1] >= self.trust:
            return cell[0]
        if B == 1:
            return self.by_width(W)
        if W == 1:
            return self.by_rows(B)
        # a padded batch: its rows scaled as a row's width scales it, and no less than its B * W tokens as one-token
        # rows (where the pass is compute-bound every token costs about what a row does)
        return max(self.by_rows(B) * self.by_width(W) / self.by_width(1), self.by_rows(B * W))

    def observe(self, B: int, W: int, seconds: float) -> None:
        if B == 1 and W <= self.max_width:
            self.by_width.observe(W, seconds)
        if W == 1:
            self.by_rows.observe(B, seconds)
        cell = self.cells.setdefault((B, W), [seconds, 0])
        cell[0] += self.rate * (seconds - cell[0]) if cell[1] else 0.0
        cell[1] += 1


class Scheduler:
    """Gathers the passes of the streams that joined; the last one to arrive runs them all (see the module
    docstring). A stream joins before it touches its slot and leaves when it is done with it."""

    def __init__(self):
        self._cv = threading.Condition()
        self.active: set[int] = set()
        self._waiting: dict[int, tuple[object, PassRow]] = {}
        self._running = False
        self._joining = 0                      # streams waiting to join: no new pass starts until they are in
        self.costs: dict[int, BatchCosts] = {}  # id(batch engine) -> its measured pass costs
        self.passes = 0                        # backend calls run (a batch of rows, or a row alone)
        self.prefill_chunk = 0                 # > 0: a prefill longer than this runs in chunks while others decode
        self.tickets = 0                       # chunked prefills started, in order
        self.rows = 0                          # stream passes they held

    def costs_of(self, batch) -> BatchCosts:
        return self.costs.setdefault(id(batch), BatchCosts())

    def ticket(self) -> int:
        """The next chunked prefill's place in line (prefills take turns in this order)."""
        with self._cv:
            self.tickets += 1
            return self.tickets

    def join(self, member: int) -> None:
        with self._cv:
            self._joining += 1  # the streams in the batch would otherwise start the next pass before this one is in
            try:
                while self._running:  # a pass in flight may be writing this slot's idle row
                    self._cv.wait()
                self.active.add(member)
            finally:
                self._joining -= 1
            if self._ready():
                self._cv.notify_all()

    def leave(self, member: int) -> None:
        with self._cv:
            self.active.discard(member)
            self._waiting.pop(member, None)
            if self._ready():
                self._fire()

    def submit(self, member: int, batch, row: PassRow) -> PassRow:
        with self._cv:
            if member not in self.active:
                if self.active or self._running:
                    raise RuntimeError(f"slot {member} passed without joining the scheduler")
                batch.run([row])  # nothing else runs (a warm-up while the session opens): at once
                row.done = True
                return row
            self._waiting[member] = (batch, row)
            while not row.done:
                if self._ready():
                    self._fire()
                else:
                    self._cv.wait()
        if row.error is not None:
            raise row.error
        return row

    def _ready(self) -> bool:
        return (bool(self._waiting) and not self._running and not self._joining
                and len(self._waiting) >= len(self.active))

    def _fire(self) -> None:
        """Run every waiting row but the chunks of all prefills but the first (so a round holds one chunk's work
        beside the decode passes; the others wait for the next round). Called with the lock held; released while the
        passes run."""
        waiting, self._waiting, self._running = self._waiting, {}, True
        chunks = [m for m, (_, row) in waiting.items() if row.chunk]
        if len(chunks) > 1:
            first = min(chunks, key=lambda m: waiting[m][1].chunk)
            for m in chunks:
                if m != first:
                    self._waiting[m] = waiting.pop(m)
        groups: dict[int, tuple[object, list[PassRow]]] = {}
        for batch, row in waiting.values():
            groups.setdefault(id(batch), (batch, []))[1].append(row)
        self._cv.release()
        try:
            for batch, rows in groups.values():
                try:
                    ran = batch.run(rows)
                except BaseException as e:  # noqa: BLE001 -- every stream of the pass gets it
                    for r in rows:
                        r.error = e
                    continue
                for seconds, B, W in ran:  # each call the backend made (None: not a cost, e.g. a capture)
                    if seconds is not None:
                        self.costs_of(batch).observe(B, W, seconds)
                    self.passes += 1
                    self.rows += B
        finally:
            self._cv.acquire()
            self._running = False
            for _, row in waiting.values():
                row.done = True
            self._cv.notify_all()


class SlotEngine:
    """The Engine contract (runtime/engine.py) over one slot of a batch engine; passes go through the scheduler."""

    hidden_on_device = False  # hidden rows come to the host only (DeviceSlotEngine: also by device address)

    def __init__(self, batch, slot: int, scheduler: Scheduler):
        self.batch, self.slot, self.scheduler = batch, slot, scheduler
        self.max_context, self.vocab_size = batch.max_context, batch.vocab_size
        self.max_pass_tokens, self.width_exact = batch.max_pass_tokens, batch.width_exact
        self._description = f"{batch.description}, slot {slot}"
        self.screen = batch.screen
        self.hidden = np.zeros((0, 0), np.float32)
        self.hidden_rows = 0  # rows of the last pass (whose hidden states a DeviceSlotEngine gives by address)
        self._hidden = False  # the hidden states come to the host (`hidden`)

    @property
    def description(self) -> str:
        return self._description

    @property
    def capacity(self) -> int:
        return self.batch.max_context  # one layout per slot of max_context (+ the widest pad) positions

    @property
    def length(self) -> int:
        return self.batch.lengths[self.slot]

    @length.setter
    def length(self, value: int) -> None:
        self.batch.lengths[self.slot] = value

    def _pass(self, tokens, positions, tree_mask, num_logits: int, greedy: bool, approx: bool = False) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, np.int64)
        n = len(tokens)
        check_pass(self, n, num_logits)
        chunk = self.scheduler.prefill_chunk if self.scheduler is not None else 0
        if chunk and n > chunk >= num_logits and positions is None and tree_mask is None and self._others():
            return self._chunked(tokens, chunk, num_logits, greedy)
        mask = None if tree_mask is None else np.asarray(tree_mask, np.float32).reshape(n, n)
        self.hidden_rows = 0  # none valid while the pass runs (a failed one leaves none)
        row = self._submit(tokens, positions, mask, num_logits, greedy, approx=approx)
        if self._hidden:
            self.hidden = row.hidden
        self.hidden_rows = n
        return row.out

    def _submit(self, tokens, positions, mask, num_logits: int, greedy: bool, chunk: int = 0,
                hidden_at: int = 0, approx: bool = False) -> PassRow:
        """One pass of this slot (positions None: the next ones after the cache's), run by _run."""
        pos = (np.arange(self.length, self.length + len(tokens), dtype=np.int64) if positions is None
               else np.asarray(positions, np.int64))
        return self._run(PassRow(self.slot, tokens, pos, mask, num_logits, greedy, chunk=chunk, hidden_at=hidden_at,
                                 approx=approx))

    def _run(self, row: PassRow) -> PassRow:
        """The row's pass, through the scheduler (it runs with the other streams' passes of the round)."""
        return self.scheduler.submit(self.slot, self.batch, row)

    def _others(self) -> bool:
        """Another stream is in the batch (a chunk of a prefill then lets its passes run between chunks)."""
        return len(self.scheduler.active - {self.slot}) > 0

    def _chunked(self, tokens: np.ndarray, chunk: int, num_logits: int, greedy: bool) -> np.ndarray:
        """A prefill as passes of `chunk` tokens, so the batch's other streams decode between them instead of
        waiting for all of it (chunked prefill); the rest goes at once when no other stream is left. Prefills take
        turns (first come, first served): one chunk a round. The cache holds the same positions as after one
        pass; the caller commits all of them as usual."""
        start, n, done, hidden = self.length, len(tokens), 0, []
        ticket = self.scheduler.ticket()
        self.hidden_rows = 0
        try:
            while n - done > chunk and self._others():
                row = self._submit(tokens[done:done + chunk], None, None, 1, True, ticket, done)
                if self._hidden:
                    hidden.append(row.hidden)
                done += chunk
                self.length += chunk  # the next chunk attends to this one
            row = self._submit(tokens[done:], None, None, num_logits, greedy, ticket, done)
        finally:
            self.length = start
        if self._hidden:
            self.hidden = np.concatenate(hidden + [row.hidden]) if hidden else row.hidden
        self.hidden_rows = n
        return row.out

    def forward(self, tokens, positions=None, tree_mask=None, num_logits: int = 1) -> np.ndarray:
        return self._pass(tokens, positions, tree_mask, num_logits, False)

    def argmax(self, tokens, positions=None, tree_mask=None, num_logits: int = 1) -> np.ndarray:
        return self._pass(tokens, positions, tree_mask, num_logits, True)

    def commit(self, n: int, path=None) -> None:
        moves = None if path is None else tree_moves(self.length, n, path)
        if moves is not None:
            self.batch.move(self.slot, *moves)
        self.length += n

    def rewind(self, length: int = 0) -> None:
        self.length = length

    def reserve(self, positions: int) -> None:
        pass  # one layout per slot of max_context (+ the widest pad) positions

    def enable_hidden(self) -> None:
        self.batch.enable_hidden()
        self._hidden = True

    def save_prefix(self, length: int) -> KVSnapshot:
        return self.batch.snapshot(self.slot, min(length, self.length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.batch.restore(self.slot, snapshot)
        self.length = snapshot.length


class DeviceSlotEngine(SlotEngine):
    """A SlotEngine over a batch engine on a GPU (backends/device/batch.py) that offers heads on that GPU the slot's
    hidden rows on the device: enable_hidden(device_only=True), then hidden_address(row) / hidden_addresses(rows) of
    the slot's rows of its last pass (a chunked prefill's: all of it), valid until its next pass, and hidden_rows."""

    hidden_on_device = True

    def enable_hidden(self, device_only: bool = False) -> None:
        self.batch.enable_hidden(self.slot, device_only)
        self._hidden = self._hidden or not device_only

    def hidden_address(self, row: int) -> int:
        return int(self.hidden_addresses(np.array([row]))[0])

    def hidden_addresses(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        if rows.size and not (0 <= rows.min() and rows.max() < self.hidden_rows):  # an earlier pass's, or none
            raise ValueError(f"slot {self.slot}: hidden rows {rows.min()}..{rows.max()} are not of its last pass "
                             f"({self.hidden_rows} rows)")
        return self.batch.hidden_address(self.slot, rows)


class SoloEngine(SlotEngine):
    """The Engine contract over a batch engine of one slot whose passes run at once, in the caller's thread (no
    scheduler, no hand-off: docs/runtime-notes.md, "A single stream is a batch of one"): what open_engine gives. The
    batch lays its cache out as for a single stream (`reserve`: for the request; grown when a pass needs more), and its
    outputs are views into its reused buffers, as the contract allows (no other stream shares them)."""

    def __init__(self, batch):
        super().__init__(batch, 0, None)

    @property
    def description(self) -> str:
        return self.batch.description

    @property
    def capacity(self) -> int:
        return self.batch.capacity

    @property
    def with_hidden(self) -> bool:
        return self.batch.with_hidden

    def _run(self, row: PassRow) -> PassRow:
        self.batch.run([row])  # at once: no other stream (an error raises here, as the pass's own)
        return row

    def reserve(self, positions: int) -> None:
        self.batch.reserve(positions)

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.length = 0  # nothing to keep across the relayout restore may make
        self.batch.restore(0, snapshot)
        self.length = snapshot.length


class DeviceSoloEngine(SoloEngine, DeviceSlotEngine):
    """A SoloEngine over a one-slot batch engine on a GPU: heads there read its hidden rows by address (the pass's
    own output rows: backends/device/batch.py), and close() frees its device memory."""

    def hidden_address(self, row: int) -> int:
        return int(self.batch.hidden_address(0, row))

    def hidden_addresses(self, rows: np.ndarray) -> np.ndarray:
        return self.batch.hidden_address(0, np.asarray(rows, np.int64))

    def close(self) -> None:
        """Free the device memory now (otherwise at exit)."""
        self.batch.close()


def solo(batch) -> SoloEngine:
    """The single-stream engine over a one-slot batch engine: a DeviceSoloEngine where the batch keeps its hidden rows
    on a GPU."""
    return (DeviceSoloEngine if batch.rows_on_device else SoloEngine)(batch)


def slot_engine(batch, slot: int, scheduler: Scheduler) -> SlotEngine:
    """The engine of `slot` of batch: a DeviceSlotEngine where the batch keeps slots' hidden rows on a GPU."""
    return (DeviceSlotEngine if batch.rows_on_device else SlotEngine)(batch, slot, scheduler)
