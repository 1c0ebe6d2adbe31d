"""The ONNX Runtime portable backend: the portable graph (export/portable.py) on ONNX Runtime's CPU provider,
through the same padded static-shape protocol the GPU backends capture as CUDA graphs (runtime/static_shapes.py).

It is the parity reference of the GPU backends: the graph TensorRT and the CUDA EP compile, run here on the
CPU, pass for pass as they run it (same widths, capacities, masks and padding). Each (layer, key|value) cache
buffer is allocated once and bound as both the graph's past input and its present output, so TensorScatter
writes in place; logits, greedy tokens and hidden states land in reused buffers; one host sync per pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import SpecrtError
from ...interface import (ATTENTION_MASK, GREEDY_TOKENS, HIDDEN_STATES, INPUT_IDS, KV_KINDS, LOGITS, LOGITS_INDICES,
                          PORTABLE_DTYPES, POSITION_IDS, WRITE_INDICES)
from ..engine import EngineOptions, KVSnapshot, check_pass, restore_views, snapshot_views, tree_moves
from ..hugepages import advise_huge_pages, anonymous_mappings
from ..static_shapes import Buckets, PassInputs, relayout
from .onnxruntime_cpu import TAKING_TURNS, OrtHeads, bind_in_place, open_session, session_options

MAX_PASS_TOKENS = 64


def open_engine(root: Path, entry, options: EngineOptions = EngineOptions()) -> "PortableEngine":
    """The portable decoder engine a manifest entry describes."""
    config = {**(entry.session_config or {}), **(TAKING_TURNS if options.taking_turns else {})}
    return PortableEngine(Path(root) / entry.file, num_layers=entry.num_layers, num_kv_heads=entry.num_kv_heads,
                          head_dim=entry.head_dim, vocab_size=entry.vocab_size, hidden_size=entry.hidden_size,
                          max_context=entry.max_context, precision=entry.precision, threads=options.threads,
                          session_config=config, huge_pages=options.huge_pages, width_exact=entry.width_exact,
                          name=entry.name)


def open_batch(root: Path, entry, options: EngineOptions, slots: int):
    """Several streams at once over the portable graph (runtime/backends/onnxruntime_portable_batch.py)."""
    from .onnxruntime_portable_batch import open_batch as _open

    return _open(root, entry, options, slots)


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()) -> OrtHeads:
    """Medusa heads: their graph is standard ops already, the same on every backend."""
    return OrtHeads(Path(root) / entry.file, threads=1, session_config=entry.session_config)


class PortableEngine:
    """runtime/engine.py's Engine over the portable graph. buckets: the widths and capacities passes run at
    (default: widths 1, 2, 4, ... 64 and a capacity every 256 positions)."""

    def __init__(self, onnx_path: Path, *, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                 hidden_size: int, max_context: int, precision: str = "fp32", threads: int = 0,
                 session_config: dict[str, str] | None = None, huge_pages: bool = True, width_exact: bool = True,
                 name: str | None = None, buckets: Buckets | None = None):
        if precision not in PORTABLE_DTYPES:
            raise SpecrtError(f"portable engine '{onnx_path}' has precision '{precision}'; this specrt runs "
                              f"{', '.join(PORTABLE_DTYPES)} portable engines; rebuild the set with `specrt engines`")
        before = anonymous_mappings() if huge_pages else None
        so = session_options(threads, session_config)
        self.session = open_session(onnx_path, so)
        self.max_context, self.vocab_size, self.max_pass_tokens = max_context, vocab_size, MAX_PASS_TOKENS
        self.width_exact, self.screen = width_exact, False
        self.name = name or Path(onnx_path).stem
        self.buckets = buckets or Buckets.for_engine(max_context, MAX_PASS_TOKENS)
        self._inputs = PassInputs(self.buckets)
        self._dtype = np.dtype(PORTABLE_DTYPES[precision])
        self._heads, self._head_dim = num_kv_heads, head_dim
        size = num_kv_heads * self.buckets.max_capacity * head_dim
        self._buffers = [[np.zeros(size, self._dtype) for _ in KV_KINDS] for _ in range(num_layers)]
        self.cache: list[list[np.ndarray]] = []  # [layer][kind] -> [1, kv_heads, capacity, head_dim] views
        self.length, self.capacity = 0, 0
        self._logits = np.empty((MAX_PASS_TOKENS, vocab_size), np.float32)
        self.greedy = np.empty(MAX_PASS_TOKENS, np.int64)
        self._hidden_size, self.with_hidden = hidden_size, False
        self.hidden = np.empty((0, hidden_size), np.float32)
        self._hidden_buf = self.hidden
        self._io = self.session.io_binding()
        self._layout(self.buckets.capacity(min(max_context, self.buckets.capacities[0])))
        if huge_pages:
            advise_huge_pages(since=before)

    @property
    def description(self) -> str:
        return f"onnxruntime-portable {self.name}"

    def _layout(self, capacity: int) -> None:
        """View every cache buffer for `capacity` positions (keeping the committed ones) and bind it in and out."""
        old = self.capacity
        self.cache = [[relayout(buf, self._heads, self._head_dim, old, capacity, self.length) for buf in layer]
                      for layer in self._buffers]
        self.capacity = capacity
        bind_in_place(self._io, self.cache)

    def reserve(self, positions: int) -> None:
        """Lay the cache out for the committed positions plus the widest pad, whatever `positions` asks: the CPU
        provider's Attention reads every slot of the layout, so the layout follows the context as it grows
        (docs/design-notes.md, "Capacity on the CPU"). Free while the cache is empty."""
        capacity = self.buckets.capacity(min(self.length, self.max_context) + self.buckets.widths[-1])
        if capacity != self.capacity:
            self._layout(capacity)

    def enable_hidden(self) -> None:
        if not self.with_hidden:
            self._hidden_buf = np.empty((MAX_PASS_TOKENS, self._hidden_size), np.float32)
            self.with_hidden = True

    def argmax(self, tokens: np.ndarray, positions: np.ndarray | None = None,
               tree_mask: np.ndarray | None = None, num_logits: int = 1) -> np.ndarray:
        """The greedy token of each of the last num_logits rows: the graph's own argmax, [num_logits] int64."""
        self._run(tokens, positions, tree_mask, num_logits)
        return self.greedy[:num_logits]

    def forward(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                tree_mask: np.ndarray | None = None, num_logits: int = 1) -> np.ndarray:
        """tokens [n] -> logits [num_logits, vocab] of the last num_logits tokens (a view into a reused buffer)."""
        self._run(tokens, positions, tree_mask, num_logits)
        return self._logits[:num_logits]

    def _run(self, tokens, positions, tree_mask, num_logits: int) -> None:
        n = len(tokens)
        check_pass(self, n, num_logits)
        width = self.buckets.width(n)
        if self.length + width > self.capacity:  # the next layout up (copies the committed positions once)
            self._layout(self.buckets.capacity(self.length + width))
        p = self._inputs.plan(self.length, tokens, positions, tree_mask, num_logits, self.capacity)
        io, rows = self._io, len(p.logits_rows)
        io.bind_cpu_input(INPUT_IDS, p.tokens.reshape(1, p.width))
        io.bind_cpu_input(POSITION_IDS, p.positions.reshape(1, p.width))
        io.bind_cpu_input(ATTENTION_MASK, p.mask.reshape(1, 1, p.width, p.capacity))
        io.bind_cpu_input(WRITE_INDICES, np.array([p.write_index], np.int64))
        io.bind_cpu_input(LOGITS_INDICES, p.logits_rows)
        io.bind_output(LOGITS, "cpu", 0, np.float32, [1, rows, self.vocab_size], self._logits.ctypes.data)
        io.bind_output(GREEDY_TOKENS, "cpu", 0, np.int64, [1, rows], self.greedy.ctypes.data)
        if self.with_hidden:
            hidden = self._hidden_buf if p.width <= MAX_PASS_TOKENS else np.empty((p.width, self._hidden_size),
                                                                                    np.float32)
            io.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, [1, p.width, self._hidden_size], hidden.ctypes.data)
            self.hidden = hidden[:n]
        self.session.run_with_iobinding(io)

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Accept n tokens of the last pass; path [n]: their indices in that pass (trees)."""
        moves = None if path is None else tree_moves(self.length, n, path)
        if moves is not None:
            src, dst = moves
            for layer in self.cache:
                for view in layer:
                    view[:, :, dst] = view[:, :, src]
        self.length += n

    def rewind(self, length: int = 0) -> None:
        self.length = length

    def save_prefix(self, length: int) -> KVSnapshot:
        return snapshot_views([v for layer in self.cache for v in layer], min(length, self.length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.length = 0  # nothing to keep across the relayout
        capacity = self.buckets.capacity(min(snapshot.length, self.max_context) + self.buckets.widths[-1])
        if capacity != self.capacity:
            self._layout(capacity)
        restore_views([v for layer in self.cache for v in layer], snapshot)
        self.length = snapshot.length
