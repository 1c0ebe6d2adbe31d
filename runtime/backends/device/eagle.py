"""An EAGLE head on the GPU beside the target, whatever runs its graph (export/eagle.py's fp32 standard-op graph):
a compiled TensorRT engine (tensorrt.heads.TrtEagleHead) or ONNX Runtime's CUDA EP (onnxruntime_cuda.heads's
OrtCudaEagleHead).
DeviceEagleHead holds what they share, with onnxruntime_cpu.heads.OrtEagleHead's interface (runtime/proposers/eagle.py
drives any of them): every buffer allocated once at one static capacity (the masks are that wide), the cache on the
device written in place (each buffer bound as past input and present output), and the features kept there.

Beside a target on this GPU, the target's rows of the accepted tokens are copied on the device into the head's own
store by position (keep_features), a call gathers its input rows from that store or from the previous call's
outputs (DeviceRows), and only the top-k tokens and their log-probabilities come back; tokens, positions and the
mask go up. Given host arrays (a target whose rows are on the host), a call uploads them and downloads the next
features as well. A subclass runs the graph over the bound buffers on the memory's stream (_launch).
"""

from __future__ import annotations

import numpy as np

from ....errors import SpecrtError
from ....interface import (ATTENTION_MASK, EAGLE_FEATURES, EAGLE_LOGPROBS, EAGLE_TOKENS, HIDDEN_STATES, INPUT_IDS,
                          KV_KINDS, POSITION_IDS, WRITE_INDICES, past_name, present_name)
from ...engine import KVSnapshot, restore_views, snapshot_views
from .memory import DeviceRows, rows_plan

OUTPUTS = (HIDDEN_STATES, EAGLE_TOKENS, EAGLE_LOGPROBS)


class DeviceEagleHead:
    """OrtEagleHead's interface over an EAGLE head graph run on the GPU, its cache and features kept there (the
    module docstring). A subclass calls _setup, binds the addresses it returns, and implements _launch."""

    on_device = True  # takes feature rows by device address (proposers/eagle.py)

    def _setup(self, memory, *, name: str, hidden: int, kv_heads: int, head_dim: int, topk: int, capacity: int,
               max_rows: int) -> dict[str, int]:
        """Allocate every buffer (max_rows rows a call; a wider call runs in chunks) -> the device address of each
        tensor of the graph by name."""
        self.memory, self.name = memory, name
        self.hidden_size, self.topk = hidden, topk
        self.capacity = self.max_capacity = capacity
        self.max_rows = max_rows
        self.length = 0  # real positions the cache holds (slots [0, length))
        self._row = hidden * 4  # bytes of one float32 feature row
        self._epoch = 0  # calls run: DeviceRows of an earlier call's outputs are refused
        R = max_rows
        self._host = {EAGLE_FEATURES: memory.host((R, hidden), np.float32), INPUT_IDS: memory.host((R,), np.int64),
                      POSITION_IDS: memory.host((R,), np.int64), ATTENTION_MASK: memory.host((R, capacity), np.float32),
                      WRITE_INDICES: memory.host((1,), np.int64), HIDDEN_STATES: memory.host((R, hidden), np.float32),
                      EAGLE_TOKENS: memory.host((R, topk), np.int64),
                      EAGLE_LOGPROBS: memory.host((R, topk), np.float32)}
        self._device = {t: memory.alloc(a.nbytes) for t, a in self._host.items()}
        self._store = memory.alloc(capacity * self._row)  # the target's features by position (keep_features)
        self._cache_shape = (1, kv_heads, capacity, head_dim)
        self._cache_host = [memory.host(self._cache_shape, np.float32) for _ in KV_KINDS]  # save/load_prefix
        self._cache = [memory.alloc(a.nbytes) for a in self._cache_host]
        for ptr, a in zip(self._cache, self._cache_host):
            memory.upload(ptr, a)  # zeros: slots a mask hides are read, never NaN
        addresses = dict(self._device)
        for kind, ptr in zip(KV_KINDS, self._cache):
            addresses[past_name(0, kind)] = addresses[present_name(0, kind)] = ptr
        return addresses

    def _shapes(self, W: int) -> dict[str, tuple]:
        """Every input's shape for a call of W rows."""
        shapes = {EAGLE_FEATURES: (1, W, self.hidden_size), INPUT_IDS: (1, W), POSITION_IDS: (1, W),
                  ATTENTION_MASK: (1, 1, W, self.capacity), WRITE_INDICES: (1,)}
        shapes.update({past_name(0, kind): self._cache_shape for kind in KV_KINDS})
        return shapes

    def _launch(self, W: int) -> None:
        """Queue the graph on W rows of the bound buffers on the memory's stream."""
        raise NotImplementedError

    def reserve(self, slots: int, keep: int | None = None) -> None:
        """The layout is the one static capacity: refuse what does not fit it."""
        if slots > self.capacity:
            raise SpecrtError(f"EAGLE head '{self.name}': {slots} slots do not fit its {self.capacity}; rebuild the "
                              "engine set with a larger --max-context")

    # --- the target's features, kept on the device by position ------------------------------------------------
    def keep_features(self, position: int, addresses) -> None:
        """Copy the feature rows at `addresses` (a target's hidden rows on this GPU: DeviceSlotEngine.hidden_addresses)
        to positions [position, position + n) of the store, and wait for the copy: the target's next pass
        overwrites its rows, and it runs on a stream of its own."""
        if position + len(addresses) > self.capacity:
            raise ValueError(f"EAGLE head: positions {position}..{position + len(addresses)} do not fit its "
                             f"{self.capacity}")
        for c in rows_plan(self._store + position * self._row, self._row, addresses):
            self.memory.copy2d(c)
        self.memory.sync()

    def stored(self, lo: int, hi: int) -> DeviceRows:
        """The kept features of positions [lo, hi), as run's input."""
        return DeviceRows(self._store + np.arange(lo, hi, dtype=np.int64) * self._row)

    def read_features(self, n: int) -> np.ndarray:
        """The kept features of positions [0, n) on the host (a prefix kept across requests)."""
        out = np.empty((n, self.hidden_size), np.float32)
        if n:
            self.memory.download(out, self._store)
            self.memory.sync()
        return out

    def write_features(self, features: np.ndarray) -> None:
        """Put read_features' rows back at positions [0, n)."""
        if len(features):
            self.memory.upload(self._store, np.ascontiguousarray(features, np.float32))
            self.memory.sync()

    # --- a call ---------------------------------------------------------------------------------------------
    def run(self, features, tokens: np.ndarray, positions: np.ndarray, slot: int, mask: np.ndarray) -> tuple:
        """As OrtEagleHead.run; rows past max_rows run in chunks (row r's mask says what it sees, so a chunk reads
        what earlier chunks wrote). features: host rows [W, H], or DeviceRows (stored's, or an earlier result's of
        the last call): then the next features come back as DeviceRows of this call (the last chunk's rows; valid
        until the next call) and no feature crosses to the host."""
        W = len(tokens)
        if slot + W > self.capacity or mask.shape[-1] != self.capacity:
            raise ValueError(f"EAGLE head: slots {slot}..{slot + W} with a mask of {mask.shape[-1]} do not fit its "
                             f"layout of {self.capacity}")
        device = isinstance(features, DeviceRows)
        if not device:
            features = np.asarray(features, np.float32).reshape(W, -1)
        out = [None if device else np.empty((W, self.hidden_size), np.float32), np.empty((W, self.topk), np.int64),
               np.empty((W, self.topk), np.float32)]
        lo = 0
        for lo in range(0, W, self.max_rows):
            hi = min(W, lo + self.max_rows)
            got = self._run(features[lo:hi], tokens[lo:hi], positions[lo:hi], slot + lo, mask[lo:hi])
            for o, g in zip(out, got):
                if o is not None:
                    o[lo:hi] = g
        if device:  # the rows of earlier chunks were overwritten by the last one's (0: refused if fed back)
            last = np.zeros(W, np.int64)
            last[lo:] = self._device[HIDDEN_STATES] + np.arange(W - lo, dtype=np.int64) * self._row
            out[0] = DeviceRows(last, self._epoch)
        return out[0], out[1], out[2]

    def _run(self, features, tokens, positions, slot: int, mask):
        W, h, m = len(tokens), self._host, self.memory
        device = isinstance(features, DeviceRows)
        if device:  # gathered on the device (the previous call's outputs, or the target's kept rows)
            if features.epoch not in (None, self._epoch):  # a chunk too: the one before overwrote them
                raise ValueError("EAGLE head: feature rows of an earlier call's outputs, since overwritten")
            for c in rows_plan(self._device[EAGLE_FEATURES], self._row, features.addresses):
                m.copy2d(c)
        else:
            h[EAGLE_FEATURES][:W] = features
            m.upload(self._device[EAGLE_FEATURES], h[EAGLE_FEATURES][:W])
        h[INPUT_IDS][:W] = tokens
        h[POSITION_IDS][:W] = positions
        h[ATTENTION_MASK][:W] = mask
        h[WRITE_INDICES][0] = slot
        for t in (INPUT_IDS, POSITION_IDS, ATTENTION_MASK):
            m.upload(self._device[t], h[t][:W])
        m.upload(self._device[WRITE_INDICES], h[WRITE_INDICES])
        self._launch(W)
        self._epoch += 1
        back = OUTPUTS[1:] if device else OUTPUTS
        for t in back:
            m.download(h[t][:W], self._device[t])
        m.sync()
        got = [h[t][:W] for t in back]  # views: run copies them out
        return [None, *got] if device else got

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
        self.memory.close()
