"""The engine contract: one compiled decoder plus its static KV cache. It knows nothing about text.

The cache holds `length` committed positions. `forward(tokens)` writes the K/V of the new tokens at
[length, length + n) and returns logits; it does not commit. `commit(n)` makes the first n of them part
of the context; anything written past that is garbage that the next pass overwrites, which is why
rejecting a draft costs nothing. For a token tree, `commit(n, path)` moves the accepted nodes' K/V entries
into place (a few rows per layer, never the whole cache).

The loop, the proposers, `verify` and the Generator see only this Protocol. Each backend (a package under
runtime/backends/, imported when an engine of its kind opens) implements it with its own memory;
`open_engine` picks the backend from the manifest entry's `backend` field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import SpecrtError


class ContextFullError(SpecrtError):
    pass


@dataclass(frozen=True)
class EngineOptions:
    """Backend options, one object for every engine a session opens (each backend reads what it knows).

    threads: CPU threads per session (0 = all cores). huge_pages: ask Linux for transparent huge pages
    for the engine's memory. taking_turns: another engine runs between this one's passes (a target and its
    draft model); None = the loader decides (on while a draft model speculates). logit_screen: let greedy
    passes use an fp32 engine's 8-bit lm_head screen where it was checked (False: always the full lm_head)."""

    threads: int = 0
    huge_pages: bool = True
    taking_turns: bool | None = None
    logit_screen: bool = True


class Engine(Protocol):
    length: int           # committed positions in the cache
    capacity: int         # positions the cache is laid out for now (reserve); portable engines add the widest pad
    max_context: int
    vocab_size: int
    max_pass_tokens: int  # the most tokens (and logit rows) one decode pass takes
    width_exact: bool     # a K-token pass gives the logits of K one-token passes (measured at build time)
    description: str      # backend, engine and precision, for stats (e.g. "onnxruntime-cpu target-fp32")
    screen: bool          # greedy passes (argmax) read an exact reduced-precision lm_head screen (Stats.logit_screen)
    hidden: np.ndarray    # [n, hidden] final-norm hidden states of the last pass (after enable_hidden)
    hidden_on_device: bool  # it also gives them by device address (enable_hidden's device_only: a GPU engine)

    def forward(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                tree_mask: np.ndarray | None = None, num_logits: int = 1) -> np.ndarray:
        """tokens [n] int64 -> logits [num_logits, vocab] float32 of the last num_logits tokens (a view into a
        reused buffer). positions [n] default to length + arange(n); tree_mask [n, n] additive, default causal."""

    def argmax(self, tokens: np.ndarray, positions: np.ndarray | None = None,
               tree_mask: np.ndarray | None = None, num_logits: int = 1) -> np.ndarray:
        """forward(), for the greedy token of each of the last num_logits rows only: [num_logits] int64."""

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Accept n tokens of the last pass; path [n]: their indices in that pass (trees)."""

    def rewind(self, length: int = 0) -> None:
        """Forget everything past `length`."""

    def reserve(self, positions: int) -> None:
        """Lay the cache out for about `positions` positions (a hint; a pass past it grows the layout)."""

    def enable_hidden(self) -> None:
        """Opt in to `hidden` on every pass (Medusa/EAGLE heads read it). A GPU engine (batch.DeviceSoloEngine)
        also takes device_only=True and gives hidden_address(row) / hidden_addresses(rows) and hidden_rows, which
        heads on its GPU read instead (the rows then stay on the device)."""

    def save_prefix(self, length: int) -> "KVSnapshot":
        """A host copy of the first `length` committed positions of the cache (KV reuse across sequences)."""

    def load_prefix(self, snapshot: "KVSnapshot") -> None:
        """Put a save_prefix copy back: the cache then holds its positions and `length` is its length."""


class BatchEngine(Protocol):
    """`slots` sequences' caches behind one engine (runtime/batch.py): each slot is driven through a SlotEngine, the
    Engine contract over that slot, and the scheduler runs every waiting slot's pass as one call of `run`. A
    backend whose descriptor says `batch` (specrt/backends.py) has `open_batch(root, entry, options, slots)`. A
    single stream is a batch engine of one slot (runtime/backends/protocol.py's Runtime.open_engine:
    batch.SoloEngine), which lays its cache out per request (`reserve`) and gives views into its reused output
    buffers."""

    slots: int
    lengths: list[int]    # committed positions per slot
    capacity: int         # positions a slot's cache is laid out for now
    max_context: int
    vocab_size: int
    max_pass_tokens: int
    width_exact: bool
    description: str      # one slot: the single-stream engine's (no slot count)
    screen: bool
    with_hidden: bool
    wide_rows_alone: bool  # a row wider than one token runs in a call of its own (runtime/load_k.py plans for it)
    rows_on_device: bool   # slots' hidden rows can stay on its GPU (hidden_address: batch.DeviceSlotEngine)

    def pass_width(self, n: int) -> int:
        """The width a pass of n tokens runs at (a backend that pads to its buckets: the bucket's)."""

    def enable_hidden(self) -> None:
        """Opt in to each row's hidden states on every pass (PassRow.hidden). A GPU batch engine (device/batch.py)
        also takes slot= and device_only=True: that slot's rows then stay in a device copy of its own, which heads
        on its GPU read by address (batch.DeviceSlotEngine)."""

    def run(self, rows) -> list[tuple[float, int, int]]:
        """Every PassRow's pass, fills row.out (and row.hidden), advances nothing: (seconds, rows, width) per call."""

    def snapshot(self, slot: int, length: int) -> "KVSnapshot":
        """A host copy of the slot's first `length` positions (KV reuse)."""

    def restore(self, slot: int, snapshot: "KVSnapshot") -> None:
        """Put a snapshot back into the slot."""

    def move(self, slot: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the slot's cache positions src to dst (a tree's accepted path, compacted)."""

    def reserve(self, positions: int) -> None:
        """One slot: Engine.reserve (several slots keep the layout `run` gives them)."""


@dataclass
class KVSnapshot:
    """save_prefix's copy: per (layer, key|value), a host array of `length` positions (axis -2), in the layout of
    the backend that saved it."""

    length: int
    arrays: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def snapshot_views(views, length: int) -> KVSnapshot:
    """save_prefix over host cache views ([..., capacity, head_dim] each, positions on axis -2)."""
    return KVSnapshot(length, [np.array(v[..., :length, :]) for v in views])


def restore_views(views, snapshot: KVSnapshot) -> None:
    """load_prefix's copy into host cache views laid out for at least snapshot.length positions."""
    if len(views) != len(snapshot.arrays):
        raise ValueError(f"a snapshot of {len(snapshot.arrays)} buffers does not fit an engine of {len(views)}")
    for view, arr in zip(views, snapshot.arrays):
        view[..., :snapshot.length, :] = arr


class Heads(Protocol):
    """A Medusa heads engine: the hidden state of the last accepted position (+ the token it chose) ->
    candidates [heads, topk] int64, best first."""

    heads: int
    topk: int
    on_device: bool  # takes the target's hidden row by device address (a GPU target's rows stay there)

    def __call__(self, hidden: np.ndarray, token: int) -> np.ndarray: ...


def check_pass(engine, n: int, num_logits: int) -> None:
    """A pass of n tokens returning num_logits rows fits the engine's cache and its logits buffer (backends call
    it first, before any work)."""
    if engine.length + n > engine.max_context:
        raise ContextFullError(
            f"context full: {engine.length} + {n} tokens exceed max_context {engine.max_context}; "
            "shorten the prompt or lower --max-new-tokens, or rebuild the engines with a larger --max-context")
    if not 1 <= num_logits <= min(n, engine.max_pass_tokens):
        raise ValueError(f"a pass returns 1..min(n, {engine.max_pass_tokens}) logits, asked {num_logits} of {n}")


def tree_moves(length: int, n: int, path) -> tuple[np.ndarray, np.ndarray] | None:
    """commit(n, path)'s row moves: (source slots, destination slots) of the accepted nodes not already in
    place, or None when none moves."""
    src = length + np.asarray(path, np.int64)
    dst = length + np.arange(n)
    moved = src != dst
    return (src[moved], dst[moved]) if moved.any() else None


def open_engine(root: Path, entry, options: EngineOptions = EngineOptions()) -> Engine:
    """The decoder engine a manifest entry (specrt.manifest.EngineEntry) describes, under engine-set folder root."""
    from .backends import backend

    return backend(entry).open_engine(Path(root), entry, options)


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()) -> Heads:
    """The Medusa heads engine of a manifest entry, on the entry's backend."""
    from .backends import backend

    return backend(entry).open_heads(Path(root), entry, options)


def open_eagle(root: Path, entry, options: EngineOptions = EngineOptions()):
    """The EAGLE head engine of a manifest entry, on the entry's backend (a compiled head beside a TensorRT target, the
    CUDA EP beside an onnxruntime-cuda one: on the target's GPU; ONNX Runtime's CPU provider otherwise)."""
    from .backends import backend

    return backend(entry).open_eagle(Path(root), entry, options)
