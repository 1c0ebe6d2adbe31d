"""The ONNX Runtime CPU backend's heads: Medusa heads (OrtHeads) and the EAGLE head (OrtEagleHead), each its own
session on one thread (a call is a few small MatMuls between two target passes); the defaults of every backend
whose heads are still ONNX graphs (runtime/backends/protocol.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ....interface import (ATTENTION_MASK, EAGLE_FEATURES, EAGLE_LOGPROBS, EAGLE_TOKENS, HEADS_CANDIDATES,
                           HEADS_HIDDEN, HEADS_TOKEN, HIDDEN_STATES, INPUT_IDS, KV_KINDS, POSITION_IDS, WRITE_INDICES)
from ...engine import EngineOptions, KVSnapshot, restore_views, snapshot_views
from .session import bind_in_place, open_session


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtHeads":
    """A Medusa heads engine: one thread, since a call is a few small MatMuls between two target passes."""
    return OrtHeads(Path(root) / entry.file, threads=1, session_config=entry.session_config)


class OrtHeads:
    """The heads engine: hidden [H] (+ the pending token) -> candidates [K, topk] token ids, best first.
    session_config: the entry's (a Q/DQ heads graph runs as written)."""

    on_device = False  # takes host rows (proposers/medusa.py, eagle.py)

    def __init__(self, onnx_path: Path, threads: int = 1, session_config: dict[str, str] | None = None,
                 providers=("CPUExecutionProvider",)):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        for key, value in (session_config or {}).items():
            so.add_session_config_entry(key, value)
        self.session = open_session(onnx_path, so, providers=providers)
        shape = self.session.get_outputs()[0].shape   # [batch, K, topk]
        self.heads, self.topk = int(shape[1]), int(shape[2])
        self._h = np.zeros((1, self.session.get_inputs()[0].shape[1]), np.float32)
        self._t = np.zeros(1, np.int64)
        self._feed = {HEADS_HIDDEN: self._h}
        if any(i.name == HEADS_TOKEN for i in self.session.get_inputs()):
            self._feed[HEADS_TOKEN] = self._t

    def __call__(self, hidden: np.ndarray, token: int) -> np.ndarray:
        self._h[0], self._t[0] = hidden, token
        return self.session.run([HEADS_CANDIDATES], self._feed)[0][0]


def open_eagle(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtEagleHead":
    """An EAGLE head engine (export/eagle.py's graph, standard ops): one thread, like the Medusa heads."""
    e = entry.eagle or {}
    return OrtEagleHead(Path(root) / entry.file, hidden=entry.hidden_size, kv_heads=entry.num_kv_heads,
                        head_dim=entry.head_dim, capacity=int(e["capacity"]), topk=int(e["topk"]), threads=1)


class OrtEagleHead:
    """The EAGLE head: one decoder layer with its own cache, one buffer per key|value of `max_capacity` positions,
    laid out for `capacity` of them ([1, kv_heads, capacity, head_dim] views, bound as past and present): the
    layout follows the context in steps of CAPACITY_STEP (reserve), because attention reads every slot of it.
    `run` writes its rows' K/V at slots [slot, slot + W) and returns the predicted next features and the top-k next
    tokens of every row; the caller's mask says which slots each row sees, so real positions, a chain's steps and
    a tree's levels are all one call."""

    CAPACITY_STEP = 256

    on_device = False  # takes host rows (proposers/medusa.py, eagle.py)

    def __init__(self, onnx_path: Path, *, hidden: int, kv_heads: int, head_dim: int, capacity: int, topk: int,
                 threads: int = 1):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        self.session = open_session(onnx_path, so)
        self.hidden_size, self.max_capacity, self.topk = hidden, capacity, topk
        self._heads, self._head_dim = kv_heads, head_dim
        self._buffers = [np.zeros(kv_heads * capacity * head_dim, np.float32) for _ in KV_KINDS]
        self.cache: list[np.ndarray] = []
        self.capacity = 0
        self.length = 0  # real positions the cache holds (slots [0, length))
        self._io = self.session.io_binding()
        self._layout(min(self.CAPACITY_STEP, capacity), 0)  # a short --max-context holds fewer slots than a step
        # outputs land in buffers of `capacity` rows (the widest call: a whole prompt), bound by address per call
        self._hidden = np.empty((capacity, hidden), np.float32)
        self._tokens = np.empty((capacity, topk), np.int64)
        self._logp = np.empty((capacity, topk), np.float32)

    def _layout(self, capacity: int, keep: int) -> None:
        from ...static_shapes import relayout

        self.cache = [relayout(buf, self._heads, self._head_dim, self.capacity, capacity, keep)
                      for buf in self._buffers]
        self.capacity = capacity
        bind_in_place(self._io, [self.cache])

    def reserve(self, slots: int, keep: int | None = None) -> None:
        """Lay the cache out for at least `slots` slots (keeping the first `keep`, default the real positions):
        call it before building a round's masks, which are `capacity` wide."""
        step = self.CAPACITY_STEP
        capacity = min(self.max_capacity, -(-max(slots, 1) // step) * step)
        if capacity != self.capacity:
            self._layout(capacity, min(self.length if keep is None else keep, capacity, self.capacity))

    def run(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, slot: int,
            mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """features [W, H], tokens [W] (the token after each row's position), positions [W], mask [W, capacity]
        additive -> (next features [W, H], top-k tokens [W, k], their log-probabilities [W, k]), fresh arrays
        (a tree keeps the rows of several calls)."""
        W = len(tokens)
        if slot + W > self.capacity or mask.shape[-1] != self.capacity:
            raise ValueError(f"EAGLE head: slots {slot}..{slot + W} with a mask of {mask.shape[-1]} do not fit its "
                             f"layout of {self.capacity} (reserve first)")
        io = self._io
        io.bind_cpu_input(EAGLE_FEATURES, np.ascontiguousarray(features, np.float32).reshape(1, W, -1))
        io.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(tokens, np.int64).reshape(1, W))
        io.bind_cpu_input(POSITION_IDS, np.ascontiguousarray(positions, np.int64).reshape(1, W))
        io.bind_cpu_input(ATTENTION_MASK, np.ascontiguousarray(mask, np.float32).reshape(1, 1, W, self.capacity))
        io.bind_cpu_input(WRITE_INDICES, np.array([slot], np.int64))
        io.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, [1, W, self.hidden_size], self._hidden.ctypes.data)
        io.bind_output(EAGLE_TOKENS, "cpu", 0, np.int64, [1, W, self.topk], self._tokens.ctypes.data)
        io.bind_output(EAGLE_LOGPROBS, "cpu", 0, np.float32, [1, W, self.topk], self._logp.ctypes.data)
        self.session.run_with_iobinding(io)
        return self._hidden[:W].copy(), self._tokens[:W].copy(), self._logp[:W].copy()

    def save_prefix(self, length: int) -> KVSnapshot:
        return snapshot_views(self.cache, min(length, self.length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.length = 0
        self.reserve(snapshot.length + 1, keep=0)
        restore_views(self.cache, snapshot)
        self.length = snapshot.length
