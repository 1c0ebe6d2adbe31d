"""The static-shape protocol of portable engines, backend-neutral: which pass widths and cache capacities an
engine runs at, and the padded inputs of one pass. The ONNX Runtime portable backend runs it on the CPU; the
GPU backends capture one CUDA graph per (width, capacity) and replay it, which is why every shape is fixed here.

Cache layout: each (layer, key|value) buffer is allocated once for the largest capacity and viewed as a
contiguous [batch, kv_heads, C, head_dim] tensor for the current C, so its address never changes (what CUDA
graphs need). A longer context moves to a larger capacity by copying the committed rows into the new layout
once (`relayout`); an empty cache changes layout for free.

More: docs/runtime-notes.md, "Module notes: runtime/static_shapes.py".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

CAPACITY_STEP = 256


@dataclass(frozen=True)
class Buckets:
    """widths: the pass widths an engine runs at, ascending (a wider prefill runs at its own width, uncaptured).
    capacities: the cache layouts, ascending; the last one holds max_context plus the widest pad.
    pad_logits: logits rows are padded to the width too (a CUDA graph fixes the logits' shape as well)."""

    widths: tuple[int, ...]
    capacities: tuple[int, ...]
    pad_logits: bool = False

    @classmethod
    def for_engine(cls, max_context: int, max_width: int, *, geometric: bool = False, pad_logits: bool = False,
                   widths: tuple[int, ...] | None = None) -> "Buckets":
        """Widths 1, 2, 4, ... up to max_width (or `widths`); capacities every CAPACITY_STEP positions, or doubling
        from it (geometric: fewer layouts, hence fewer CUDA graphs, for attention over up to twice the length)."""
        if widths is None:
            widths, w = [], 1
            while w < max_width:
                widths.append(w)
                w *= 2
            widths.append(max_width)
        widths = tuple(sorted(set(widths)))
        top = max_context + widths[-1]
        caps, c = [], CAPACITY_STEP
        while c < top:
            caps.append(c)
            c = c * 2 if geometric else c + CAPACITY_STEP
        caps.append(top)
        return cls(widths, tuple(caps), pad_logits)

    @property
    def max_capacity(self) -> int:
        return self.capacities[-1]

    def width(self, n: int) -> int:
        """The width a pass of n tokens runs at."""
        for w in self.widths:
            if w >= n:
                return w
        return n

    def capacity(self, need: int) -> int:
        """The smallest capacity holding `need` positions."""
        for c in self.capacities:
            if c >= need:
                return c
        raise ValueError(f"{need} positions exceed the largest cache layout ({self.capacities[-1]})")


@dataclass
class Pass:
    """The padded inputs of one pass (views into PassInputs' buffers, valid until the next plan)."""

    tokens: np.ndarray     # [W] int64
    positions: np.ndarray  # [W] int64
    mask: np.ndarray       # [W, C] float32 additive
    write_index: int       # cache slot of row 0 (= length)
    logits_rows: np.ndarray  # [N] int64: the pass rows that get logits; the caller reads the first num_logits
    width: int
    capacity: int


class PassInputs:
    """Reused host buffers for the padded inputs; `plan` fills them for one pass (no allocation on decode passes)."""

    def __init__(self, buckets: Buckets):
        self.buckets = buckets
        w, c = buckets.widths[-1], buckets.max_capacity
        self._tokens, self._positions = np.zeros(w, np.int64), np.zeros(w, np.int64)
        self._rows = np.zeros(w, np.int64)
        self._mask = np.empty(w * c, np.float32)
        self._causal = np.triu(np.full((w, w), -np.inf, np.float32), 1)

    def plan(self, length: int, tokens: np.ndarray, positions: np.ndarray | None, tree_mask: np.ndarray | None,
             num_logits: int, capacity: int) -> Pass:
        """tokens [n] at positions [n] (default length + arange(n)), tree_mask [n, n] additive or None, over a
        cache holding `length` positions laid out for `capacity` -> the padded pass."""
        n = len(tokens)
        W = self.buckets.width(n)
        if W > len(self._tokens):  # a prefill wider than any captured width: once per request, allocate
            buf = PassInputs(Buckets((W,), (capacity,), self.buckets.pad_logits))
        else:
            buf = self
        t, p = buf._tokens[:W], buf._positions[:W]
        mask = buf._mask[: W * capacity].reshape(W, capacity)
        fill_row(length, tokens, positions, tree_mask, t, p, mask, buf._causal)
        captured = W <= self.buckets.widths[-1]  # a wider prefill is not captured: no need to pad its logits
        rows = buf._rows[: W if self.buckets.pad_logits and captured else num_logits]
        rows[:num_logits] = np.arange(n - num_logits, n)
        rows[num_logits:] = n - 1
        return Pass(t, p, mask, length, rows, W, capacity)


def fill_row(length: int, tokens: np.ndarray, positions: np.ndarray | None, tree_mask: np.ndarray | None,
             t: np.ndarray, p: np.ndarray, mask: np.ndarray, causal: np.ndarray | None = None) -> None:
    """One sequence's padded inputs in place: t [W] tokens, p [W] positions, mask [W, C] over a cache holding
    `length` positions, for the n = len(tokens) tokens (n = 0: a row of pads only, for a batch slot with no pass
    this round). causal: a [>= n, >= n] upper-triangular -inf block to copy (PassInputs keeps one)."""
    n, W = len(tokens), len(t)
    t[:n] = tokens
    t[n:] = 0
    if positions is None:
        p[:n] = np.arange(length, length + n)
    else:
        p[:n] = positions
    p[n:] = p[n - 1] if n else max(length - 1, 0)  # any position the RoPE table has
    mask.fill(-np.inf)
    mask[:n, :length] = 0.0
    block = mask[:n, length:length + n]
    np.copyto(block, causal[:n, :n] if causal is not None else np.triu(np.full((n, n), -np.inf, np.float32), 1))
    if tree_mask is not None:
        block += np.asarray(tree_mask, np.float32).reshape(n, n)
    pads = np.arange(n, W)
    mask[pads, length + pads] = 0.0


def relayout(buffer: np.ndarray, heads: int, head_dim: int, old: int, new: int, length: int,
             batch: int = 1) -> np.ndarray:
    """View a flat cache buffer as [batch, heads, new, head_dim], keeping the first `length` positions of each
    (sequence, head) from its [batch, heads, old, head_dim] layout (the buffers overlap: the rows are copied out
    first)."""
    view = buffer[: batch * heads * new * head_dim].reshape(batch, heads, new, head_dim)
    if length and old != new:
        kept = buffer[: batch * heads * old * head_dim].reshape(batch, heads, old, head_dim)[:, :, :length].copy()
        view[:, :, :length] = kept
    return view


class PaddedRuns:
    """run() of a padded batch engine (the portable CPU one and the device one): rows up to batch_width tokens in one
    call padded to the widest of them, wider rows alone, each call timed. A subclass has batch_width, _lock,
    pass_width, _fit_rows (the layout every row's pass fits), _batched and _solo_pass; _split and _seconds are
    hooks."""

    def run(self, rows) -> list[tuple[float | None, int, int]]:
        """Every row's pass (runtime/batch.py's PassRow) -> (seconds, rows, width) of each call."""
        together, alone = self._split(rows)
        ran = []
        with self._lock:
            self._fit_rows(rows, alone)
            if together:
                W = self.pass_width(max(len(r.tokens) for r in together))
                t = time.perf_counter()
                self._batched(together, W)
                ran.append((self._seconds(together, W, time.perf_counter() - t), len(together), W))
            for r in alone:
                t = time.perf_counter()
                self._solo_pass(r)
                ran.append((time.perf_counter() - t, 1, self.pass_width(len(r.tokens))))
        return ran

    def _split(self, rows) -> tuple[list, list]:
        """(the rows that share one call, the rows that run alone)."""
        return [r for r in rows if len(r.tokens) <= self.batch_width], [r for r in rows
                                                                         if len(r.tokens) > self.batch_width]

    def _seconds(self, rows, width: int, seconds: float) -> float | None:
        """What a batched call's time says about its cost (None: nothing, e.g. a CUDA graph's capture)."""
        return seconds

