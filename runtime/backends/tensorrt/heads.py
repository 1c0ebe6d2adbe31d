"""The TensorRT backends' heads, on the GPU beside the target: compiled Medusa heads (TrtHeads) and the compiled EAGLE
head (TrtEagleHead); heads still in ONNX (sets built before their heads were compiled) run on ONNX Runtime's CPU
provider.

TrtEagleHead runs export/eagle.py's fp32 graph (RotaryEmbedding, TensorScatter into its own cache, Attention;
build/tensorrt.py's prefill and decode profiles) as a device.eagle.DeviceEagleHead, which keeps its cache and, beside
a target on this GPU, its features on the device (only the top-k tokens and their log-probabilities come back). Its
one static capacity is the engine's: TensorRT's KV-cache update wants a static sequence dimension.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ....errors import SpecrtError
from ....interface import (EAGLE_FEATURES, EAGLE_TOKENS, HEADS_CANDIDATES, HEADS_HIDDEN, HEADS_SCORES, HEADS_TOKEN,
                          INPUT_IDS, past_name)
from ...engine import EngineOptions
from ..device.memory import Copy2D
from ..device.eagle import DeviceEagleHead
from .engine import DECODE, PREFILL, REBUILD, TrtContexts, load_engine, on_own_memory
from .rtx import RuntimeCache


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()):
    """Medusa heads: compiled heads (an .engine, as tensorrt-rtx sets hold them) on the GPU beside the target
    (TrtHeads), an ONNX graph on ONNX Runtime's CPU provider."""
    if entry.file.endswith(".engine"):
        engine, keep, strategy, config = load_engine(root, entry)
        return on_own_memory(lambda memory: TrtHeads(engine, memory, entry.name, keep=keep, strategy=strategy,
                                                     runtime_config=config))
    from ..onnxruntime_cpu.heads import OrtHeads

    return OrtHeads(Path(root) / entry.file, threads=1, session_config=entry.session_config)


def open_eagle(root: Path, entry, options: EngineOptions = EngineOptions()):
    """An EAGLE head: compiled (an .engine, as tensorrt-rtx sets hold it) on the GPU beside the target
    (TrtEagleHead), an ONNX graph on ONNX Runtime's CPU provider."""
    if not entry.file.endswith(".engine"):
        from ..onnxruntime_cpu.heads import open_eagle as open_onnx

        return open_onnx(root, entry, options)
    engine, keep, strategy, config = load_engine(root, entry)
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
        size = int(engine.device_memory_size_v2) if (strategy or runtime_config) else 0
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
        if isinstance(hidden, (int, np.integer)):  # the target's row on this GPU (DeviceSlotEngine.hidden_address)
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


class TrtEagleHead(DeviceEagleHead):
    """OrtEagleHead's interface over a compiled EAGLE head, with its features kept on the device (the module
    docstring): rows up to the prefill profile's widest a call (wider calls in chunks), each call on the decode
    profile's context where it fits. keep, strategy, runtime_config: tensorrt.load_engine's."""

    def __init__(self, engine, memory, *, name: str, hidden: int, kv_heads: int, head_dim: int, topk: int,
                 keep: tuple = (), strategy=None, runtime_config=None):
        self.engine = engine
        tensors = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        if EAGLE_FEATURES not in tensors or EAGLE_TOKENS not in tensors:
            raise SpecrtError(f"engine '{name}' is not an EAGLE head engine (its tensors: {', '.join(tensors)}); "
                              "rebuild the engine set with `specrt engines --eagle-head`")
        if engine.num_optimization_profiles != 2:
            raise SpecrtError(f"engine '{name}' has {engine.num_optimization_profiles} optimization profiles, not "
                              "the prefill and decode ones build/tensorrt.py makes; rebuild the engine set")
        self.max_width = int(engine.get_tensor_profile_shape(INPUT_IDS, DECODE)[2][1])
        cap = int(engine.get_tensor_shape(past_name(0, "key"))[2])
        if cap <= 0:
            raise SpecrtError(f"engine '{name}' has a dynamic cache capacity, which TensorRT's KV-cache update "
                              "cannot take; rebuild the engine set")
        addresses = self._setup(memory, name=name, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim, topk=topk,
                                capacity=cap,
                                max_rows=int(engine.get_tensor_profile_shape(INPUT_IDS, PREFILL)[2][1]))
        self._trt = TrtContexts(engine, memory, name, addresses, np.float32, strategy, runtime_config, keep)

    def _launch(self, W: int) -> None:
        self._trt.run(DECODE if W <= self.max_width else PREFILL, self._shapes(W), (W,), graph=False)

    def close(self) -> None:
        self._trt.close()
        super().close()
