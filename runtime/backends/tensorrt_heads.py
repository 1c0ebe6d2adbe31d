"""The TensorRT backends' heads, on the GPU beside the target: compiled Medusa heads (TrtHeads) and the compiled EAGLE
head (TrtEagleHead); heads still in ONNX run on ONNX Runtime's CPU provider.

TrtEagleHead runs export/eagle.py's fp32 graph (RotaryEmbedding, TensorScatter into its own cache, Attention;
build/tensorrt.py's prefill and decode profiles) with onnxruntime_cpu.OrtEagleHead's interface
(runtime/proposers/eagle.py drives either). Its cache stays on the device at the engine's one static capacity
(TensorRT's KV-cache update wants a static sequence dimension; the masks are that wide), written in place (each
buffer bound as past input and present output). Beside a target on this GPU its features stay there too: the
target's rows of the accepted tokens are copied on the device into the head's own store by position
(keep_features), a call gathers its input rows from that store or from the previous call's outputs (DeviceRows),
and only the top-k tokens and their log-probabilities come back; tokens, positions and the mask go up. Given host
arrays (a target whose rows are on the host), a call uploads them and downloads the next features as well.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import SpecrtError
from ...interface import (ATTENTION_MASK, EAGLE_FEATURES, EAGLE_LOGPROBS, EAGLE_TOKENS, HEADS_CANDIDATES,
                          HEADS_HIDDEN, HEADS_SCORES, HEADS_TOKEN, HIDDEN_STATES, INPUT_IDS, KV_KINDS, POSITION_IDS,
                          WRITE_INDICES, past_name, present_name)
from ..engine import EngineOptions, KVSnapshot, restore_views, snapshot_views
from .cuda_memory import Copy2D, DeviceRows, rows_plan
from .tensorrt import DECODE, PREFILL, REBUILD, RuntimeCache, TrtContexts, _load, on_own_memory


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()):
    """Medusa heads: compiled heads (an .engine, as tensorrt-rtx sets hold them) on the GPU beside the target
    (TrtHeads), an ONNX graph on ONNX Runtime's CPU provider."""
    if entry.file.endswith(".engine"):
        engine, keep, strategy, config = _load(root, entry)
        return on_own_memory(lambda memory: TrtHeads(engine, memory, entry.name, keep=keep, strategy=strategy,
                                                     runtime_config=config))
    from .onnxruntime_cpu import OrtHeads

    return OrtHeads(Path(root) / entry.file, threads=1, session_config=entry.session_config)


def open_eagle(root: Path, entry, options: EngineOptions = EngineOptions()):
    """An EAGLE head: compiled (an .engine, as tensorrt-rtx sets hold it) on the GPU beside the target
    (TrtEagleHead), an ONNX graph on ONNX Runtime's CPU provider."""
    if not entry.file.endswith(".engine"):
        from .onnxruntime_cpu import open_eagle as open_onnx

        return open_onnx(root, entry, options)
    engine, keep, strategy, config = _load(root, entry)
    return on_own_memory(lambda memory: TrtEagleHead(
        engine, memory, name=entry.name, hidden=entry.hidden_size, kv_heads=entry.num_kv_heads,
        head_dim=entry.head_dim, topk=int((entry.eagle or {})["topk"]), keep=keep, strategy=strategy,
        runtime_config=config))


class TrtHeads:
    """runtime/engine.py's Heads over compiled Medusa heads: one execution context on their one profile at one row,
    every buffer allocated and every address and shape set once; a call takes the hidden row (from the host, or
    where a target on this GPU left it: a device address, copied on the device, so the row never crosses to the
    host) and uploads the pending token, runs, and downloads the candidates (K x topk token ids; the scores stay on
    the device)."""

    on_device = True  # takes hidden rows by device address (proposers/medusa.py)

    def __init__(self, engine, memory, name: str, keep: tuple = (), strategy=None, runtime_config=None):
        self.engine, self.memory, self.name, self._keep = engine, memory, name, keep
        tensors = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        if HEADS_HIDDEN not in tensors or HEADS_CANDIDATES not in tensors:
            raise SpecrtError(f"engine '{name}' is not a Medusa heads engine (its tensors: {', '.join(tensors)}); "
                              "rebuild the engine set with `specrt engines`")
        shape = tuple(engine.get_tensor_shape(HEADS_CANDIDATES))  # [rows, K, topk]
        self.heads, self.topk = int(shape[1]), int(shape[2])
        hidden = int(engine.get_tensor_shape(HEADS_HIDDEN)[1])
        host = {HEADS_HIDDEN: memory.host((1, hidden), np.float32), HEADS_TOKEN: memory.host((1,), np.int64),
                HEADS_CANDIDATES: memory.host((1, self.heads, self.topk), np.int64),
                HEADS_SCORES: memory.host((1, self.heads, self.topk), np.float32)}
        self._host = {t: host[t] for t in tensors if t in host}
        self._device = {t: memory.alloc(a.nbytes) for t, a in self._host.items()}
        if runtime_config is not None:
            ctx = engine.create_execution_context(runtime_config)
        else:
            ctx = (engine.create_execution_context(strategy) if strategy is not None
                   else engine.create_execution_context())
        size = int(getattr(engine, "device_memory_size_v2", 0) or 0) if (strategy or runtime_config) else 0
        if ctx is None or not ctx.set_optimization_profile_async(0, memory.stream):
            raise SpecrtError(f"TensorRT could not create an execution context for engine '{name}'")
        if size:
            ctx.set_device_memory(memory.alloc(size), size)
        for tensor, ptr in self._device.items():
            if not ctx.set_tensor_address(tensor, ptr):
                raise SpecrtError(f"engine '{name}' has no tensor '{tensor}'; {REBUILD}")
        for tensor in (HEADS_HIDDEN, HEADS_TOKEN):
            if tensor in self._host and not ctx.set_input_shape(tensor, self._host[tensor].shape):
                raise SpecrtError(f"engine '{name}' does not take {tensor} of one row; {REBUILD}")
        self.context = ctx

    def __call__(self, hidden: np.ndarray | int, token: int) -> np.ndarray:
        h = self._host[HEADS_HIDDEN]
        if isinstance(hidden, (int, np.integer)):  # the target's row on this GPU (DeviceEngine.hidden_address)
            self.memory.copy2d(Copy2D(self._device[HEADS_HIDDEN], h.nbytes, int(hidden), h.nbytes, h.nbytes, 1))
        else:
            h[0] = hidden
            self.memory.upload(self._device[HEADS_HIDDEN], h)
        if HEADS_TOKEN in self._host:
            self._host[HEADS_TOKEN][0] = token
            self.memory.upload(self._device[HEADS_TOKEN], self._host[HEADS_TOKEN])
        if not self.context.execute_async_v3(self.memory.stream):
            raise SpecrtError(f"TensorRT failed to run engine '{self.name}' (see its log above)")
        out = self._host[HEADS_CANDIDATES]
        self.memory.download(out, self._device[HEADS_CANDIDATES])
        self.memory.sync()
        return out[0].copy()

    def close(self) -> None:
        self.context = None
        for kept in self._keep:
            if isinstance(kept, RuntimeCache):
                kept.save()
        self.memory.close()


class TrtEagleHead:
    """OrtEagleHead's interface over a compiled EAGLE head, with its features kept on the device (the module
    docstring). keep, strategy, runtime_config: tensorrt._load's."""

    on_device = True  # takes feature rows by device address (proposers/eagle.py)

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
        self._row = hidden * 4  # bytes of one float32 feature row
        self._epoch = 0  # calls run: DeviceRows of an earlier call's outputs are refused
        R = self.max_rows
        self._host = {EAGLE_FEATURES: memory.host((R, hidden), np.float32), INPUT_IDS: memory.host((R,), np.int64),
                      POSITION_IDS: memory.host((R,), np.int64), ATTENTION_MASK: memory.host((R, cap), np.float32),
                      WRITE_INDICES: memory.host((1,), np.int64), HIDDEN_STATES: memory.host((R, hidden), np.float32),
                      EAGLE_TOKENS: memory.host((R, topk), np.int64),
                      EAGLE_LOGPROBS: memory.host((R, topk), np.float32)}
        self._device = {t: memory.alloc(a.nbytes) for t, a in self._host.items()}
        self._store = memory.alloc(cap * self._row)  # the target's features by position (keep_features)
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

    # --- the target's features, kept on the device by position ------------------------------------------------
    def keep_features(self, position: int, addresses) -> None:
        """Copy the feature rows at `addresses` (a target's hidden rows on this GPU: DeviceEngine.hidden_addresses)
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
    def run(self, features, tokens: np.ndarray, positions: np.ndarray, slot: int,
            mask: np.ndarray) -> tuple:
        """As OrtEagleHead.run; rows past the prefill profile's widest run in chunks (row r's mask says what it
        sees, so a chunk reads what earlier chunks wrote). features: host rows [W, H], or DeviceRows (stored's,
        or an earlier result's of the last call): then the next features come back as DeviceRows of this call
        (the last chunk's rows; valid until the next call) and no feature crosses to the host."""
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
        shapes = {EAGLE_FEATURES: (1, W, self.hidden_size), INPUT_IDS: (1, W), POSITION_IDS: (1, W),
                  ATTENTION_MASK: (1, 1, W, self.capacity), WRITE_INDICES: (1,)}
        shapes.update({past_name(0, kind): self._cache_shape for kind in KV_KINDS})
        self._trt.run(DECODE if W <= self.max_width else PREFILL, shapes, (W,), graph=False)
        self._epoch += 1
        back = (EAGLE_TOKENS, EAGLE_LOGPROBS) if device else (HIDDEN_STATES, EAGLE_TOKENS, EAGLE_LOGPROBS)
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
        self._trt.close()
        self.memory.close()
