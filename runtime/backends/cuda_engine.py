"""The Engine both GPU backends share: runtime/engine.py's contract over device memory and the static-shape
protocol (runtime/static_shapes.py). A subclass only says how one padded pass runs (`_launch`): TensorRT through
execution contexts and its own CUDA graphs, ONNX Runtime through IOBinding and the CUDA EP's graphs.

Per pass: plan the padded inputs on the host (PassInputs), queue their upload, the pass and the download of only
what the caller reads (a greedy pass: greedy_tokens [num_logits] int64; otherwise the logits rows asked for; the
hidden states where enabled), then sync the stream once. Every buffer is allocated at open, at the largest size
any pass needs, so addresses never change and a CUDA graph captured for a (width, capacity) pair replays as long
as the engine lives. A pass is captured only at the bucket widths (<= max_pass_tokens); a wider prefill runs
uncaptured, once per request.

SPECRT_CUDA_GRAPHS=0 in the environment (read at open) runs every pass without graphs: the GPU check compares the
two, and it is the switch to flip if a driver misbehaves with graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ...errors import SpecrtError
from ...interface import PORTABLE_DTYPES
from ..engine import KVSnapshot, check_pass
from ..static_shapes import Buckets, PassInputs
from .cuda_memory import DeviceCache, Memory

GRAPHS_ENV = "SPECRT_CUDA_GRAPHS"


def graphs_wanted() -> tuple[bool, str | None]:
    """(capture CUDA graphs, why not): off where SPECRT_CUDA_GRAPHS=0."""
    if os.environ.get(GRAPHS_ENV, "1") == "0":
        return False, f"{GRAPHS_ENV}=0"
    return True, None


def check_prompt(engine, n: int) -> None:
    """A pass of n tokens is no wider than the engine takes (its widest uncaptured prefill): else one line."""
    if n > engine.max_prompt:
        raise SpecrtError(f"a pass of {n} tokens is wider than engine '{engine.name}' takes ({engine.max_prompt}); "
                          "shorten the prompt, or rebuild the engines with a larger --max-context")


@dataclass(frozen=True)
class Geometry:
    """The sizes of a portable decoder an engine needs to lay out its buffers (from the manifest entry)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    precision: str  # fp32 | fp16: the cache's dtype (PORTABLE_DTYPES)

    @classmethod
    def of(cls, entry) -> "Geometry":
        if entry.precision not in PORTABLE_DTYPES:
            raise SpecrtError(f"engine '{entry.name}' has precision '{entry.precision}'; the GPU backends run "
                              f"{', '.join(PORTABLE_DTYPES)} portable engines; rebuild the set with `specrt engines`")
        return cls(entry.num_layers, entry.num_kv_heads, entry.head_dim, entry.hidden_size, entry.vocab_size,
                   entry.max_context, entry.precision)

    @property
    def cache_dtype(self) -> np.dtype:
        return np.dtype(PORTABLE_DTYPES[self.precision])


class DeviceEngine:
    """runtime/engine.py's Engine on a GPU. buckets: the widths and capacities passes run at (pad_logits: a
    graph fixes the logits' shape too); max_prompt: the widest pass the engine takes (an uncaptured prefill).
    The device buffers below are what a subclass binds: inputs `tokens`, `positions`, `mask` ([W, C] float32),
    `write` ([1] int64), `rows` ([N] int64); outputs `out_logits` [N, V] float32, `out_greedy` [N] int64,
    `out_hidden` [W, H] float32; the cache's per-(layer, kind) buffers, each bound as past and present."""

    backend = "gpu"

    def __init__(self, memory: Memory, geometry: Geometry, buckets: Buckets, *, max_prompt: int, name: str,
                 width_exact: bool, graphs: bool, graphs_note: str | None = None):
        g = self.geometry = geometry
        self.memory, self.buckets, self.name = memory, buckets, name
        self.max_context, self.vocab_size = g.max_context, g.vocab_size
        self.max_pass_tokens = buckets.widths[-1]
        self.max_prompt = max(max_prompt, self.max_pass_tokens)
        self.width_exact, self.screen = width_exact, False
        self.graphs, self.graphs_note = graphs, graphs_note
        self._inputs = PassInputs(buckets)
        W, P, C, V, H = self.max_pass_tokens, self.max_prompt, buckets.max_capacity, g.vocab_size, g.hidden_size
        self.tokens, self.positions = memory.alloc(P * 8), memory.alloc(P * 8)
        self.mask, self.write, self.rows = memory.alloc(P * C * 4), memory.alloc(8), memory.alloc(W * 8)
        self.out_logits, self.out_greedy, self.out_hidden = memory.alloc(W * V * 4), memory.alloc(W * 8), \
            memory.alloc(P * H * 4)
        self._write = np.zeros(1, np.int64)
        self._logits = memory.host((W, V), np.float32)
        self.greedy = memory.host((W,), np.int64)  # [num_logits] greedy tokens of the last argmax pass
        self._hidden = memory.host((P, H), np.float32)
        self.with_hidden = False
        self._hidden_to_host = False  # some reader wants `hidden` on the host (not only hidden_address)
        self.hidden = self._hidden[:0]  # [n, hidden] of the last pass (after enable_hidden), a reused buffer
        self.hidden_rows = 0  # rows of the last pass whose hidden states lie at hidden_address
        self.cache = DeviceCache(memory, g.num_layers, g.num_kv_heads, g.head_dim, g.cache_dtype, C)
        self.length = 0
        self.cache.relayout(buckets.capacities[0], 0)
        self.capacity = self.cache.capacity

    @property
    def description(self) -> str:
        graphs = "CUDA graphs" if self.graphs else f"no CUDA graphs ({self.graphs_note})"
        return f"{self.backend} {self.name}, {graphs}"

    def _launch(self, width: int, capacity: int, rows: int, graph: bool) -> None:
        """Queue one pass of `width` tokens over a cache laid out for `capacity` positions, `rows` logits rows,
        its inputs already queued for upload; graph: replay (or capture) the CUDA graph of (width, capacity)."""
        raise NotImplementedError

    def _layout(self, capacity: int) -> None:
        """Lay the cache out for `capacity` positions, keeping the committed ones (copied once, on the device)."""
        self.cache.relayout(capacity, self.length)
        self.capacity = capacity

    def reserve(self, positions: int) -> None:
        """Lay the cache out for `positions` positions plus the widest pad (never fewer than are committed)."""
        need = min(max(positions, self.length), self.max_context) + self.max_pass_tokens
        capacity = self.buckets.capacity(min(need, self.buckets.max_capacity))
        if capacity != self.capacity:
            self._layout(capacity)

    def enable_hidden(self, device_only: bool = False) -> None:
        """Opt in to the final-norm hidden states of every pass (the graph computes them anyway): copied back to
        `hidden`, or with device_only (heads compiled for this GPU read them there, hidden_address) kept on the
        device until a reader asks for the host copy."""
        self.with_hidden = True
        self._hidden_to_host = self._hidden_to_host or not device_only

    def hidden_address(self, row: int) -> int:
        """Where row `row` of the last pass's hidden states lies on the device (float32; valid until the next
        pass)."""
        return self.out_hidden + row * self.geometry.hidden_size * 4

    def hidden_addresses(self, rows: np.ndarray) -> np.ndarray:
        """hidden_address of each of `rows` (the accepted tokens' rows an EAGLE head keeps as its features)."""
        return self.out_hidden + np.asarray(rows, np.int64) * (self.geometry.hidden_size * 4)

    def argmax(self, tokens: np.ndarray, positions: np.ndarray | None = None,
               tree_mask: np.ndarray | None = None, num_logits: int = 1) -> np.ndarray:
        """The greedy token of each of the last num_logits rows, argmax taken on the device: [num_logits] int64
        (only those bytes come back)."""
        self._pass(tokens, positions, tree_mask, num_logits, greedy=True)
        return self.greedy[:num_logits]

    def forward(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                tree_mask: np.ndarray | None = None, num_logits: int = 1) -> np.ndarray:
        """tokens [n] -> logits [num_logits, vocab] float32 of the last num_logits tokens (a reused buffer)."""
        self._pass(tokens, positions, tree_mask, num_logits, greedy=False)
        return self._logits[:num_logits]

    def _pass(self, tokens, positions, tree_mask, num_logits: int, greedy: bool) -> None:
        n = len(tokens)
        check_pass(self, n, num_logits)
        check_prompt(self, n)
        width = self.buckets.width(n)
        if self.length + width > self.capacity:  # past what the request reserved: grow (one copy on the device)
            self._layout(self.buckets.capacity(min(self.length + width, self.buckets.max_capacity)))
        p = self._inputs.plan(self.length, tokens, positions, tree_mask, num_logits, self.capacity)
        captured = width <= self.max_pass_tokens
        rows = p.logits_rows if captured else p.logits_rows[:num_logits]  # an uncaptured pass: the rows asked for
        m = self.memory
        self._write[0] = p.write_index
        for ptr, host in ((self.tokens, p.tokens), (self.positions, p.positions), (self.mask, p.mask),
                          (self.write, self._write), (self.rows, rows)):
            m.upload(ptr, host)
        self._launch(width, self.capacity, len(rows), captured and self.graphs)
        if greedy:
            m.download(self.greedy[:num_logits], self.out_greedy)
        else:
            m.download(self._logits[:num_logits], self.out_logits)
        if self.with_hidden and self._hidden_to_host:
            self.hidden = self._hidden[:n]
            m.download(self.hidden, self.out_hidden)
        self.hidden_rows = n if self.with_hidden else 0
        m.sync()

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Accept n tokens of the last pass; path [n]: their indices in that pass (trees; moved on the device)."""
        if path is not None:
            self.cache.commit(self.length, np.asarray(path, np.int64)[:n])
        self.length += n

    def rewind(self, length: int = 0) -> None:
        self.length = length

    def save_prefix(self, length: int) -> KVSnapshot:
        length = min(length, self.length)
        return KVSnapshot(length, self.cache.save(length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.length = 0  # nothing to keep across the relayout
        self.reserve(snapshot.length)
        self.cache.load(snapshot.arrays)
        self.length = snapshot.length

    def close(self) -> None:
        """Free the device memory now (otherwise at exit)."""
        self.memory.close()
