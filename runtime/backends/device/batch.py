"""Batched passes on a GPU (runtime/batch.py's batch engine): the protocol of the portable batch engine
(onnxruntime_portable/batch.py, its CPU reference) over device memory, with one CUDA graph per (rows, width,
capacity).

More: docs/runtime-notes.md, "Module notes: runtime/backends/device/batch.py".
"""

from __future__ import annotations

import threading

import numpy as np

from ...engine import KVSnapshot
from ...static_shapes import Buckets, PaddedRuns, PassInputs, fill_row
from .geometry import Geometry, check_prompt
from .memory import Copy2D, DeviceCache, Memory


class DeviceBatchEngine(PaddedRuns):
    """`slots` sequences' caches in device memory and the padded batched pass; a subclass says how one pass runs
    (`_launch`). Device buffers a subclass binds: `tokens`, `positions` ([rows, W] int64), `mask` ([rows, 1, W, C]
    float32), `write` ([rows] int64), `rows` ([N] int64 logits rows); outputs `out_logits` [rows, N, V] float32,
    `out_greedy` [rows, N] int64, `out_hidden` [rows, W, H] float32; the cache's buffers (`cache.ptrs`, a solo
    pass at `cache.slot_ptr(ptr, slot)`)."""

    backend = "gpu"
    wide_rows_alone = False  # every row up to batch_width shares the call (runtime/batch.py's LoadPlanner)
    rows_on_device = True  # a slot's hidden rows can stay on the device (hidden_address: batch.DeviceSlotEngine)

    def __init__(self, memory: Memory, geometry: Geometry, buckets: Buckets, *, slots: int, name: str,
                 width_exact: bool, graphs: bool, graphs_note: str | None = None, max_prompt: int | None = None,
                 batch_width: int | None = None):
        g = self.geometry = geometry
        self.memory, self.buckets, self.slots, self.name = memory, buckets, slots, name
        self.max_context, self.vocab_size = g.max_context, g.vocab_size
        self.max_pass_tokens = buckets.widths[-1]
        self.batch_width = min(batch_width or self.max_pass_tokens, self.max_pass_tokens)
        self.max_prompt = max(max_prompt or g.max_context, self.max_pass_tokens)
        self.width_exact, self.screen = width_exact, False
        self.graphs, self.graphs_note = graphs, graphs_note
        self.lengths = [0] * slots
        S, W, P, C, V, H = slots, self.max_pass_tokens, self.max_prompt, buckets.max_capacity, g.vocab_size, \
            g.hidden_size
        n = max(S * W, P)  # a batched pass, or one prefill alone
        self.tokens, self.positions = memory.alloc(n * 8), memory.alloc(n * 8)
        self.mask, self.write, self.rows = memory.alloc(n * C * 4), memory.alloc(S * 8), memory.alloc(W * 8)
        self.out_logits = memory.alloc(S * W * V * 4)
        self.out_greedy, self.out_hidden = memory.alloc(S * W * 8), memory.alloc(n * H * 4)
        self._tokens, self._positions = memory.host((S * W,), np.int64), memory.host((S * W,), np.int64)
        self._mask = memory.host((S * W * C,), np.float32)
        self._write = memory.host((S,), np.int64)
        self._all_rows = memory.host((W,), np.int64)
        self._all_rows[:] = np.arange(W)
        self._greedy = memory.host((S * W,), np.int64)
        self._logits = memory.host((W, V), np.float32)  # one sampled row's logits at a time
        self._hidden = memory.host((n, H), np.float32)
        self._causal = np.triu(np.full((W, W), -np.inf, np.float32), 1)
        self._single = PassInputs(buckets)
        self.with_hidden = False
        self._to_host: set[int] = set()    # slots whose reader takes PassRow.hidden
        self._on_device: set[int] = set()  # slots whose reader takes hidden_address (heads on this GPU)
        self._row = H * 4  # bytes of one float32 hidden row
        self._slot_rows = max(self.max_prompt, g.max_context)  # a chunked prefill's rows, all of them
        self.slot_hidden = 0  # [slots, _slot_rows, H] float32 on the device, from the first device reader on
        self.cache = DeviceCache(memory, g.num_layers, g.num_kv_heads, g.head_dim, g.cache_dtype, C, slots)
        self._lock = threading.Lock()
        self._timed: set[tuple[int, int, int]] = set()  # (rows, width, capacity) passes run (and captured) once
        self.cache.relayout(buckets.capacities[0], 0)
        self.capacity = self.cache.capacity

    @property
    def description(self) -> str:
        graphs = "CUDA graphs" if self.graphs else f"no CUDA graphs ({self.graphs_note})"
        slots = f"{self.slots} slots, " if self.slots > 1 else ""  # one: a single stream's engine
        return f"{self.backend} {self.name}, {slots}{graphs}"

    def _launch(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None,
                graph: bool) -> None:
        """Queue one pass of `rows` x `width` tokens over the cache laid out for `capacity` (slot None: slots
        [0, rows); else that slot alone), `logits_rows` logits rows, inputs already queued for upload; graph:
        replay (or capture) the CUDA graph of (rows, width, capacity)."""
        raise NotImplementedError

    def pass_width(self, n: int) -> int:
        """The width a pass of n tokens runs at (what runtime/batch.py's LoadPlanner measures costs by)."""
        return self.buckets.width(n)

    def enable_hidden(self, slot: int | None = None, device_only: bool = False) -> None:
        """Opt in to the hidden states of `slot`'s passes (None: every slot's): to the host (PassRow.hidden), or
        with device_only kept on the device for heads there (hidden_address; the module docstring)."""
        with self._lock:  # the allocation waits for a pass in flight (a graph's capture refuses a cudaMalloc)
            self.with_hidden = True
            slots = range(self.slots) if slot is None else (slot,)
            if not device_only:
                self._to_host.update(slots)
                return
            if not self.slot_hidden and self.slots > 1:  # one slot: its rows stay where its pass left them
                self.slot_hidden = self.memory.alloc(self.slots * self._slot_rows * self._row)
            self._on_device.update(slots)

    def hidden_address(self, slot: int, row):
        """Where row `row` (an int, or an int64 array of rows) of `slot`'s last pass's hidden states lies on the
        device (float32; valid until the slot's next pass)."""
        if self.slots == 1:  # the pass's own output (its rows first, whether batched or alone)
            return self.out_hidden + row * self._row
        return self.slot_hidden + (slot * self._slot_rows + row) * self._row

    def _keep_hidden(self, r, src: int) -> None:
        """Queue the copy of row r's hidden states (at src) into its slot's own rows (at r.hidden_at on)."""
        n = len(r.tokens)
        if r.hidden_at + n > self._slot_rows:
            raise ValueError(f"hidden rows {r.hidden_at}..{r.hidden_at + n} do not fit a slot's {self._slot_rows}")
        dst = self.slot_hidden + (r.slot * self._slot_rows + r.hidden_at) * self._row
        self.memory.copy2d(Copy2D(dst, n * self._row, src, n * self._row, n * self._row, 1))

    def reserve(self, positions: int) -> None:
        """One slot: lay the cache out for `positions` positions plus the widest pad (never fewer than are committed),
        so a request's passes keep one layout (and its CUDA graphs). Several slots: their layout follows them (run)."""
        if self.slots > 1:
            return
        with self._lock:
            need = min(max(positions, self.lengths[0]), self.max_context) + self.max_pass_tokens
            self._relayout(self.buckets.capacity(min(need, self.buckets.max_capacity)))

    def _relayout(self, capacity: int) -> None:
        """The cache laid out for `capacity`, every slot keeping its committed positions (one copy on the device)."""
        if capacity != self.capacity:
            self.cache.relayout(capacity, min(max(self.lengths), self.capacity))
            self.capacity = capacity

    def _fit(self, need: int) -> None:
        """Lay the cache out for `need` positions in any slot (and every slot's committed ones, plus the widest
        pad): the smallest bucket that holds them. Called with the lock held."""
        top = min(max(self.lengths), self.max_context) + self.max_pass_tokens
        self._relayout(self.buckets.capacity(min(max(need, top), self.buckets.max_capacity)))

    def snapshot(self, slot: int, length: int) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(length, self.cache.save(length, slot))

    def restore(self, slot: int, snapshot: KVSnapshot) -> None:
        with self._lock:
            self._fit(snapshot.length + self.max_pass_tokens)
            self.cache.load(snapshot.arrays, slot)

    def move(self, slot: int, src: np.ndarray, dst: np.ndarray) -> None:
        with self._lock:
            self.cache.move(src, dst, slot)
            if self.slots > 1:  # one slot: queued before its next pass on the same stream
                self.memory.sync()

    def run(self, rows) -> list[tuple[float | None, int, int]]:
        """PaddedRuns.run, after every row's checks (seconds None: the first pass of its shape, which captured a
        graph)."""
        for r in rows:  # the buffers hold max_pass_tokens logits rows a sequence (SlotEngine checks it first)
            if not 1 <= r.num_logits <= min(len(r.tokens), self.max_pass_tokens):
                raise ValueError(f"a pass returns 1..min(n, {self.max_pass_tokens}) logits, asked {r.num_logits} "
                                 f"of {len(r.tokens)}")
            check_prompt(self, len(r.tokens))
        return super().run(rows)

    def _fit_rows(self, rows, alone) -> None:
        """One slot: the layout reserve set, grown only when its pass needs more; several: _fit."""
        if self.slots == 1:
            need = self.lengths[0] + self.pass_width(len(rows[0].tokens))
            if need > self.capacity:
                self._relayout(self.buckets.capacity(min(need, self.buckets.max_capacity)))
        else:
            self._fit(max([0] + [self.lengths[r.slot] + self.pass_width(len(r.tokens)) for r in alone]))

    def _seconds(self, rows, width: int, seconds: float) -> float | None:
        """The rows the planner asks about; a shape's first pass (its capture) is not a pass's cost."""
        key = (max(r.slot for r in rows) + 1, width, self.capacity)
        first = key not in self._timed
        self._timed.add(key)
        return None if first else seconds

    def _batched(self, rows, W: int) -> None:
        B, C, m = max(r.slot for r in rows) + 1, self.capacity, self.memory
        tokens, positions = self._tokens[:B * W].reshape(B, W), self._positions[:B * W].reshape(B, W)
        mask = self._mask[:B * W * C].reshape(B, W, C)
        by_slot = {r.slot: r for r in rows}
        empty = np.zeros(0, np.int64)
        for b in range(B):
            r = by_slot.get(b)
            if r is None:  # an idle slot: pads written past what it holds
                fill_row(self.lengths[b], empty, None, None, tokens[b], positions[b], mask[b])
            else:
                fill_row(self.lengths[b], r.tokens, r.positions, r.mask, tokens[b], positions[b], mask[b],
                         self._causal)
        self._write[:B] = self.lengths[:B]
        for ptr, host in ((self.tokens, self._tokens[:B * W]), (self.positions, self._positions[:B * W]),
                          (self.mask, self._mask[:B * W * C]), (self.write, self._write[:B]),
                          (self.rows, self._all_rows[:W])):
            m.upload(ptr, host)
        self._launch(B, W, C, W, None, self.graphs)
        if len(rows) == 1:  # a row alone: only what it reads comes back, before the one sync
            r = rows[0]
            at = r.slot * W  # its first row in the pass's outputs
            self._take_one(r, self.out_greedy + at * 8, self.out_logits + at * self.vocab_size * 4,
                           self.out_hidden + at * self._row, len(r.tokens) - r.num_logits)
            return
        m.download(self._greedy[:B * W], self.out_greedy)
        if any(r.slot in self._to_host for r in rows):
            m.download(self._hidden[:B * W], self.out_hidden)
        for r in rows:
            if r.slot in self._on_device:
                self._keep_hidden(r, self.out_hidden + r.slot * W * self._row)
        m.sync()
        greedy = self._greedy[:B * W].reshape(B, W)
        hidden = self._hidden[:B * W].reshape(B, W, -1)
        row_bytes = self.vocab_size * 4
        for r in rows:
            start, n = len(r.tokens) - r.num_logits, r.num_logits
            if r.greedy:
                r.out = greedy[r.slot, start:start + n].copy()
            else:  # only this row's logits rows come back
                m.download(self._logits[:n], self.out_logits + (r.slot * W + start) * row_bytes)
                m.sync()
                r.out = self._logits[:n].copy()
            if r.slot in self._to_host:
                r.hidden = hidden[r.slot, :len(r.tokens)].copy()

    def _solo_pass(self, r) -> None:
        """A row wider than batch_width over its own slot, uncaptured: the logits rows asked for only."""
        p = self._single.plan(self.lengths[r.slot], r.tokens, r.positions, r.mask, r.num_logits, self.capacity)
        rows, m = p.logits_rows[:r.num_logits], self.memory
        self._write[0] = p.write_index
        for ptr, host in ((self.tokens, p.tokens), (self.positions, p.positions), (self.mask, p.mask),
                          (self.write, self._write[:1]), (self.rows, rows)):
            m.upload(ptr, np.ascontiguousarray(host))
        self._launch(1, p.width, p.capacity, len(rows), r.slot, False)
        self._take_one(r, self.out_greedy, self.out_logits, self.out_hidden, 0)

    def _take_one(self, r, greedy: int, logits: int, hidden: int, start: int) -> None:
        """A pass's one row's outputs (its tokens' logits rows from `start` at the device addresses given): the greedy
        tokens or the logits asked for, and its hidden states where its reader wants them, queued before one sync.
        Several slots: copies (another stream's pass may reuse the buffers before this one reads them); one slot:
        views into the buffers, valid until its next pass."""
        m, n = self.memory, len(r.tokens)
        out = self._greedy[:r.num_logits] if r.greedy else self._logits[:r.num_logits]
        m.download(out, greedy + start * 8 if r.greedy else logits + start * self.vocab_size * 4)
        host = r.slot in self._to_host
        if host:
            m.download(self._hidden[:n], hidden)
        if r.slot in self._on_device and self.slots > 1:
            self._keep_hidden(r, hidden)
        m.sync()
        copy = self.slots > 1
        r.out = out.copy() if copy else out
        if host:
            r.hidden = self._hidden[:n].copy() if copy else self._hidden[:n]

    def close(self) -> None:
        """Free the device memory now (otherwise at exit)."""
        self.memory.close()
