"""Batched passes over the portable graph (runtime/batch.py's BatchEngine): B sequences (slots) in one session run,
each with its own cache row, write index, positions and [W, C] mask, padded to the round's widest pass.

A single stream is a batch of one slot (the package's RUNTIME.open_engine): its layout is the committed positions plus
the widest pad when a request starts (`reserve`), grown only when a pass needs more, its outputs are views into the
reused buffers, and huge pages are asked for.

More: docs/runtime-notes.md, "Module notes: runtime/backends/onnxruntime_portable/batch.py".
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from ....errors import SpecrtError
from ....interface import (ATTENTION_MASK, GREEDY_TOKENS, HIDDEN_STATES, INPUT_IDS, KV_KINDS, LOGITS, LOGITS_INDICES,
                          PORTABLE_DTYPES, POSITION_IDS, WRITE_INDICES)
from ...engine import EngineOptions, KVSnapshot, restore_views, snapshot_views
from ...hugepages import advise_huge_pages, anonymous_mappings
from ...static_shapes import Buckets, PaddedRuns, PassInputs, fill_row, relayout
from ..onnxruntime_cpu.batch import grown
from ..onnxruntime_cpu.session import TAKING_TURNS, bind_in_place, open_session, session_options

MAX_PASS_TOKENS = 64
# Rows up to this many tokens share the round's call (a draft's verification: 1 + MAX_DRAFT_TOKENS at most)
BATCH_WIDTH = 33


def open_batch(root: Path, entry, options: EngineOptions, slots: int) -> "PortableBatchEngine":
    """`slots` sequences of a portable decoder entry; one slot (a single stream) asks for huge pages as options say."""
    huge_pages = options.huge_pages and slots == 1
    config = {**(entry.session_config or {}), **(TAKING_TURNS if options.taking_turns else {})}
    return PortableBatchEngine(Path(root) / entry.file, slots=slots, num_layers=entry.num_layers,
                               num_kv_heads=entry.num_kv_heads, head_dim=entry.head_dim, vocab_size=entry.vocab_size,
                               hidden_size=entry.hidden_size, max_context=entry.max_context,
                               precision=entry.precision, threads=options.threads, session_config=config,
                               width_exact=entry.width_exact, name=entry.name, huge_pages=huge_pages)


class PortableBatchEngine(PaddedRuns):
    """`slots` sequences' caches and one portable session. buckets: the widths and capacities passes run at (default:
    widths 1, 2, 4 ... 64, a capacity every 256 positions)."""

    wide_rows_alone = False  # every row up to batch_width shares the call (the module docstring)
    rows_on_device = False  # hidden rows come to the host (PassRow.hidden)

    def __init__(self, onnx_path: Path, *, slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 vocab_size: int, hidden_size: int, max_context: int, precision: str = "fp32", threads: int = 0,
                 session_config: dict[str, str] | None = None, width_exact: bool = True, name: str | None = None,
                 buckets: Buckets | None = None, batch_width: int = BATCH_WIDTH, huge_pages: bool = False):
        if precision not in PORTABLE_DTYPES:
            raise SpecrtError(f"portable engine '{onnx_path}' has precision '{precision}'; this specrt runs "
                              f"{', '.join(PORTABLE_DTYPES)} portable engines; rebuild the set with `specrt engines`")
        before = anonymous_mappings() if huge_pages else None
        self.session = open_session(Path(onnx_path), session_options(threads, session_config))
        self.slots, self.max_context, self.vocab_size = slots, max_context, vocab_size
        self.max_pass_tokens, self.batch_width = MAX_PASS_TOKENS, batch_width
        self.width_exact, self.screen = width_exact, False
        self.name = name or Path(onnx_path).stem
        self.buckets = buckets or Buckets.for_engine(max_context, MAX_PASS_TOKENS)
        self.lengths = [0] * slots
        self._heads, self._head_dim, self._hidden_size = num_kv_heads, head_dim, hidden_size
        dtype = np.dtype(PORTABLE_DTYPES[precision])
        size = slots * num_kv_heads * self.buckets.max_capacity * head_dim
        self._buffers = [[np.zeros(size, dtype) for _ in KV_KINDS] for _ in range(num_layers)]
        self.cache: list[list[np.ndarray]] = []  # [layer][kind] -> [slots, kv_heads, capacity, head_dim]
        self.capacity = 0
        self._lock = threading.Lock()  # a relayout moves every slot's rows: not while a slot copies its own
        self._single = PassInputs(self.buckets)
        w = max(batch_width, 1)
        self._tokens = np.zeros(slots * w, np.int64)
        self._positions = np.zeros(slots * w, np.int64)
        self._mask = np.empty(slots * w * self.buckets.max_capacity, np.float32)
        self._causal = np.triu(np.full((w, w), -np.inf, np.float32), 1)
        self.with_hidden = False
        self._out = {"logits": np.empty(0, np.float32), "greedy": np.empty(0, np.int64),
                     "hidden": np.empty(0, np.float32)}  # flat output buffers reused across passes (grown)
        self._layout(self.buckets.capacities[0])
        if huge_pages:  # weights pre-packed and cache allocated: ask for huge pages (runtime/hugepages.py)
            advise_huge_pages(since=before)

    @property
    def description(self) -> str:
        if self.slots == 1:  # a single stream's engine
            return f"onnxruntime-portable {self.name}"
        return f"onnxruntime-portable {self.name}, {self.slots} slots"

    def _layout(self, capacity: int) -> None:
        """Every cache buffer viewed for `capacity` positions (each slot keeps the positions any slot holds), and
        the bindings: slots [0, b) for batched calls, slot s alone for its own."""
        keep = min(max(self.lengths), self.capacity)
        self.cache = [[relayout(buf, self._heads, self._head_dim, self.capacity, capacity, keep, self.slots)
                       for buf in layer] for layer in self._buffers]
        self.capacity = capacity
        self._ranges = [self._bind(slice(0, b)) for b in range(1, self.slots + 1)]
        self._solo = [self._bind(slice(s, s + 1)) for s in range(self.slots)] if self.slots > 1 else self._ranges

    def _bind(self, rows: slice):
        io = self.session.io_binding()
        bind_in_place(io, [[view[rows] for view in layer] for layer in self.cache])
        return io

    def _fit(self, need: int) -> None:
        """Lay the cache out for `need` positions in any slot (and every slot's committed ones, plus the widest
        pad): the smallest bucket that holds them. Called with the lock held."""
        capacity = self.buckets.capacity(max(need, min(max(self.lengths), self.max_context)
                                             + self.buckets.widths[-1]))
        if capacity != self.capacity:
            self._layout(capacity)

    def reserve(self, positions: int) -> None:
        """Lay the cache out for the committed positions plus the widest pad, whatever `positions` asks: the CPU
        provider's Attention reads every slot of the layout, so the layout follows the context as it grows
        (docs/design-notes.md, "Capacity on the CPU"). Free while the cache is empty."""
        with self._lock:
            self._fit(0)

    def pass_width(self, n: int) -> int:
        """The width a pass of n tokens runs at (what its cost is measured by: runtime/batch.py's LoadPlanner)."""
        return self.buckets.width(n)

    def enable_hidden(self) -> None:
        self.with_hidden = True

    def views(self, slot: int) -> list[np.ndarray]:
        """The slot's cache, [1, kv_heads, capacity, head_dim] per (layer, key|value), for the current layout."""
        return [view[slot:slot + 1] for layer in self.cache for view in layer]

    def snapshot(self, slot: int, length: int) -> KVSnapshot:
        with self._lock:
            return snapshot_views(self.views(slot), length)

    def restore(self, slot: int, snapshot: KVSnapshot) -> None:
        with self._lock:
            self._fit(snapshot.length + self.buckets.widths[-1])
            restore_views(self.views(slot), snapshot)

    def move(self, slot: int, src: np.ndarray, dst: np.ndarray) -> None:
        with self._lock:
            for layer in self.cache:
                for view in layer:
                    view[slot, :, dst] = view[slot, :, src]

    def _split(self, rows) -> tuple[list, list]:
        """One slot: its row alone over the layout reserve set; several: rows up to batch_width share a call, a row
        alone runs over its slot alone (no pad rows)."""
        if self.slots == 1:
            return [], list(rows)
        together, alone = super()._split(rows)
        return ([], together + alone) if len(together) == 1 else (together, alone)

    def _fit_rows(self, rows, alone) -> None:
        """One slot: the layout reserve set, grown only when its pass needs more (copying the committed positions
        once); several: the smallest that holds every slot's committed positions and each alone row's pass."""
        if self.slots == 1:
            W = self.pass_width(len(rows[0].tokens))
            if self.lengths[0] + W > self.capacity:
                self._layout(self.buckets.capacity(self.lengths[0] + W))
            return
        self._fit(max([0] + [self.lengths[r.slot] + self.pass_width(len(r.tokens)) for r in alone]))

    def _batched(self, rows, W: int) -> None:
        B, C = max(r.slot for r in rows) + 1, self.capacity
        tokens = self._tokens[:B * W].reshape(B, W)
        positions = self._positions[:B * W].reshape(B, W)
        mask = self._mask[:B * W * C].reshape(B, 1, W, C)
        by_slot = {r.slot: r for r in rows}
        empty = np.zeros(0, np.int64)
        for b in range(B):
            r = by_slot.get(b)
            if r is None:  # an idle slot: pads written past what it holds
                fill_row(self.lengths[b], empty, None, None, tokens[b], positions[b], mask[b, 0])
            else:
                fill_row(self.lengths[b], r.tokens, r.positions, r.mask, tokens[b], positions[b], mask[b, 0],
                         self._causal)
        # one range of logits rows for the batch: every row's last num_logits tokens fall in [lo, hi)
        lo = min(len(r.tokens) - r.num_logits for r in rows)
        hi = max(len(r.tokens) for r in rows)
        self._call(self._ranges[B - 1], tokens, positions, mask, np.array(self.lengths[:B], np.int64),
                   np.arange(lo, hi, dtype=np.int64))
        for r in rows:
            start = len(r.tokens) - r.num_logits - lo
            self._take(r, r.slot, start)

    def _solo_pass(self, r) -> None:
        p = self._single.plan(self.lengths[r.slot], r.tokens, r.positions, r.mask, r.num_logits, self.capacity)
        self._call(self._solo[r.slot], p.tokens.reshape(1, p.width), p.positions.reshape(1, p.width),
                   p.mask.reshape(1, 1, p.width, p.capacity), np.array([p.write_index], np.int64), p.logits_rows)
        self._take(r, 0, 0)

    def _call(self, io, tokens, positions, mask, write, logits_rows) -> None:
        B, W = tokens.shape
        N = len(logits_rows)
        io.bind_cpu_input(INPUT_IDS, tokens)
        io.bind_cpu_input(POSITION_IDS, positions)
        io.bind_cpu_input(ATTENTION_MASK, mask)
        io.bind_cpu_input(WRITE_INDICES, write)
        io.bind_cpu_input(LOGITS_INDICES, logits_rows)
        logits = grown(self._out, "logits", B * N * self.vocab_size)
        greedy = grown(self._out, "greedy", B * N)
        io.bind_output(LOGITS, "cpu", 0, np.float32, [B, N, self.vocab_size], logits.ctypes.data)
        io.bind_output(GREEDY_TOKENS, "cpu", 0, np.int64, [B, N], greedy.ctypes.data)
        if self.with_hidden:
            hidden = grown(self._out, "hidden", B * W * self._hidden_size)
            io.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, [B, W, self._hidden_size], hidden.ctypes.data)
        self._shape = (B, W, N)
        self.session.run_with_iobinding(io)

    def _take(self, r, b: int, start: int) -> None:
        """Batch row b's results into r: its num_logits logits (or greedy tokens) rows from `start` of the rows the
        call kept, and its hidden states. Several slots: copies (another stream's call may reuse the buffers before
        this one reads them); one slot: views into the buffers, valid until its next pass."""
        B, W, N = self._shape
        rows, copy = slice(start, start + r.num_logits), self.slots > 1
        if r.greedy:
            out = self._out["greedy"][:B * N].reshape(B, N)[b, rows]
        else:
            out = self._out["logits"][:B * N * self.vocab_size].reshape(B, N, self.vocab_size)[b, rows]
        r.out = out.copy() if copy else out
        if self.with_hidden:
            H = self._hidden_size
            hidden = self._out["hidden"][:B * W * H].reshape(B, W, H)[b, :len(r.tokens)]
            r.hidden = hidden.copy() if copy else hidden
