"""The EAGLE head compiled by a TensorRT compiler (export/eagle.py's fp32 graph: RotaryEmbedding, TensorScatter into
its own cache, Attention; build/tensorrt.py's prefill and decode profiles), on the GPU beside the target.

TrtEagleHead has onnxruntime_cpu.OrtEagleHead's interface (runtime/proposers/eagle.py drives either). Its cache
stays on the device at the engine's one static capacity (TensorRT's KV-cache update wants a static sequence
dimension; the masks are that wide), written in place (each buffer bound as past input and present output). A
call uploads its rows' features, tokens, positions and mask and downloads the next features and the top-k tokens
with their log-probabilities; the target's features come from the host (the Engine contract's `hidden`), so a
round moves a few rows of H floats each way.
"""

from __future__ import annotations

import numpy as np

from ...errors import SpecrtError
from ...interface import (ATTENTION_MASK, EAGLE_FEATURES, EAGLE_LOGPROBS, EAGLE_TOKENS, HIDDEN_STATES, INPUT_IDS,
                          KV_KINDS, POSITION_IDS, WRITE_INDICES, past_name, present_name)
from ..engine import KVSnapshot, restore_views, snapshot_views
from .tensorrt import DECODE, PREFILL, TrtContexts


class TrtEagleHead:
    """OrtEagleHead's interface over a compiled EAGLE head. keep, strategy, runtime_config: tensorrt._load's."""

    def __init__(self, engine, memory, *, name: str, hidden: int, kv_heads: int, head_dim: int, topk: int,
                 keep: tuple = (), strategy=None, runtime_config=None):
        self.engine, self.memory, self.name = engine, memory, name
        tensors = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        if EAGLE_FEATURES not in tensors or EAGLE_TOKENS not in tensors:
            raise SpecrtError(f"engine '{name}' is not an EAGLE head engine (its tensors: {', '.join(tensors)}); "
                              "rebuild the engine set with `specrt engines --eagle-head`")
        if engine.num_optimization_profiles != 2:
            raise SpecrtError(f"engine '{name}' has {engine.num_optimization_profiles} optimization profiles, not "
                              "the prefill and decode ones build/tensorrt.py makes; rebuild the engine set")
        self.max_rows = int(engine.get_tensor_profile_shape(INPUT_IDS, PREFILL)[2][1])
        self.max_width = int(engine.get_tensor_profile_shape(INPUT_IDS, DECODE)[2][1])
        cap = int(engine.get_tensor_shape(past_name(0, "key"))[2])
        if cap <= 0:
            raise SpecrtError(f"engine '{name}' has a dynamic cache capacity, which TensorRT's KV-cache update "
                              "cannot take; rebuild the engine set")
        self.hidden_size, self.topk = hidden, topk
        self.capacity = self.max_capacity = cap
        self.length = 0  # real positions the cache holds (slots [0, length))
        R = self.max_rows
        self._host = {EAGLE_FEATURES: memory.host((R, hidden), np.float32), INPUT_IDS: memory.host((R,), np.int64),
                      POSITION_IDS: memory.host((R,), np.int64), ATTENTION_MASK: memory.host((R, cap), np.float32),
                      WRITE_INDICES: memory.host((1,), np.int64), HIDDEN_STATES: memory.host((R, hidden), np.float32),
                      EAGLE_TOKENS: memory.host((R, topk), np.int64),
                      EAGLE_LOGPROBS: memory.host((R, topk), np.float32)}
        self._device = {t: memory.alloc(a.nbytes) for t, a in self._host.items()}
        self._cache_shape = (1, kv_heads, cap, head_dim)
        self._cache_host = [memory.host(self._cache_shape, np.float32) for _ in KV_KINDS]  # save/load_prefix
        self._cache = [memory.alloc(a.nbytes) for a in self._cache_host]
        for ptr, a in zip(self._cache, self._cache_host):
            memory.upload(ptr, a)  # zeros: slots a mask hides are read, never NaN
        addresses = dict(self._device)
        for kind, ptr in zip(KV_KINDS, self._cache):
            addresses[past_name(0, kind)] = addresses[present_name(0, kind)] = ptr
        self._trt = TrtContexts(engine, memory, name, addresses, np.float32, strategy, runtime_config, keep)

    def reserve(self, slots: int, keep: int | None = None) -> None:
        """The layout is the engine's one capacity: refuse what does not fit it."""
        if slots > self.capacity:
            raise SpecrtError(f"EAGLE head '{self.name}': {slots} slots do not fit its {self.capacity}; rebuild the "
                              "engine set with a larger --max-context")

    def run(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, slot: int,
            mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As OrtEagleHead.run; rows past the prefill profile's widest run in chunks (row r's mask says what it
        sees, so a chunk reads what earlier chunks wrote)."""
        W = len(tokens)
        if slot + W > self.capacity or mask.shape[-1] != self.capacity:
            raise ValueError(f"EAGLE head: slots {slot}..{slot + W} with a mask of {mask.shape[-1]} do not fit its "
                             f"layout of {self.capacity}")
        features = np.asarray(features, np.float32).reshape(W, -1)
        out = [np.empty((W, self.hidden_size), np.float32), np.empty((W, self.topk), np.int64),
               np.empty((W, self.topk), np.float32)]
        for lo in range(0, W, self.max_rows):
            hi = min(W, lo + self.max_rows)
            got = self._run(features[lo:hi], tokens[lo:hi], positions[lo:hi], slot + lo, mask[lo:hi])
            for o, g in zip(out, got):
                o[lo:hi] = g
        return out[0], out[1], out[2]

    def _run(self, features, tokens, positions, slot: int, mask):
        W, h, m = len(tokens), self._host, self.memory
        h[EAGLE_FEATURES][:W] = features
        h[INPUT_IDS][:W] = tokens
        h[POSITION_IDS][:W] = positions
        h[ATTENTION_MASK][:W] = mask
        h[WRITE_INDICES][0] = slot
        for t in (EAGLE_FEATURES, INPUT_IDS, POSITION_IDS, ATTENTION_MASK):
            m.upload(self._device[t], h[t][:W])
        m.upload(self._device[WRITE_INDICES], h[WRITE_INDICES])
        shapes = {EAGLE_FEATURES: (1, W, self.hidden_size), INPUT_IDS: (1, W), POSITION_IDS: (1, W),
                  ATTENTION_MASK: (1, 1, W, self.capacity), WRITE_INDICES: (1,)}
        shapes.update({past_name(0, kind): self._cache_shape for kind in KV_KINDS})
        self._trt.run(DECODE if W <= self.max_width else PREFILL, shapes, (W,), graph=False)
        for t in (HIDDEN_STATES, EAGLE_TOKENS, EAGLE_LOGPROBS):
            m.download(h[t][:W], self._device[t])
        m.sync()
        return h[HIDDEN_STATES][:W].copy(), h[EAGLE_TOKENS][:W].copy(), h[EAGLE_LOGPROBS][:W].copy()

    def save_prefix(self, length: int) -> KVSnapshot:
        for a, ptr in zip(self._cache_host, self._cache):
            self.memory.download(a, ptr)
        self.memory.sync()
        return snapshot_views(self._cache_host, min(length, self.length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.reserve(snapshot.length + 1)
        restore_views(self._cache_host, snapshot)
        for a, ptr in zip(self._cache_host, self._cache):
            self.memory.upload(ptr, a)
        self.length = snapshot.length

    def close(self) -> None:
        self._trt.close()
        self.memory.close()
