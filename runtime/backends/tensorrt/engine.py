"""A serialized TensorRT engine opened after every check that it runs here (load_engine, deserialize), the two
execution contexts on its profiles (TrtContexts), and the buffers a device batch engine binds (buffer_addresses).

More: docs/runtime-notes.md, "Module notes: runtime/backends/tensorrt/".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ....errors import SpecrtError
from ....interface import (ATTENTION_MASK, GREEDY_TOKENS, HIDDEN_STATES, INPUT_IDS, KV_KINDS, LOGITS, LOGITS_INDICES,
                          POSITION_IDS, WRITE_INDICES, past_name, present_name)
from ...static_shapes import Buckets
from ..device.geometry import Geometry
from ..device.memory import CudaMemory, check, compute_capability, cudart, require_device
from .rtx import REBUILD, RuntimeCache, check_targets, check_validity, rebuild, rtx_runtime_config, runtime_cache_path

PREFILL, DECODE = 0, 1  # optimization profiles, in the order build/tensorrt.py adds them


def import_tensorrt():
    """The tensorrt module, or a one-line SpecrtError on how to install it (the same as build/tensorrt.py's)."""
    from ....backends import TENSORRT

    return TENSORRT.require()


def deserialize(root: Path, entry):
    """(engine, buckets, max_prompt, what must outlive it, the contexts' allocation strategy, TensorRT for RTX's
    runtime config or None) of a manifest entry's serialized decoder engine, after every check that it runs here
    (load_engine's) and of its profiles."""
    engine, keep, strategy, config = load_engine(root, entry)
    path = Path(root) / entry.file
    if engine.num_optimization_profiles != 2:
        raise SpecrtError(f"engine '{path}' has {engine.num_optimization_profiles} optimization profiles, not the "
                          f"prefill and decode ones build/tensorrt.py makes; {rebuild(entry)}")
    max_prompt = engine.get_tensor_profile_shape(INPUT_IDS, PREFILL)[2][1]
    max_width = engine.get_tensor_profile_shape(INPUT_IDS, DECODE)[2][1]
    buckets = trt_buckets(engine, entry.max_context, max_width, f"engine '{path}'")
    return engine, buckets, max_prompt, keep, strategy, config


def load_engine(root: Path, entry):
    """(engine, what must outlive it, the contexts' allocation strategy, TensorRT for RTX's runtime config or None)
    of a manifest entry's serialized engine, after every check that it runs here: the compiler, a GPU, the compiler
    version and the GPU architecture it was built for (TensorRT for RTX: and its own header check)."""
    from ....backends import BACKENDS, COMPILERS

    compiler = COMPILERS[BACKENDS[entry.backend].compiler]
    trt = compiler.require()
    require_device(entry.backend)
    built = entry.build or {}  # the pipeline's provisional entries (checks before the manifest) record nothing
    if built.get("compiler") not in (None, compiler.backend):  # each compiler's engines run only under it
        made = COMPILERS.get(built["compiler"], compiler).label
        raise SpecrtError(f"engine '{entry.name}' was compiled by {made}, and its entry names the {entry.backend} "
                          f"backend ({compiler.label}); {rebuild(entry)}")
    version = built.get("version", built.get("tensorrt"))
    if version not in (None, trt.__version__):
        raise SpecrtError(f"engine '{entry.name}' was built with {compiler.label} {version}, this is "
                          f"{trt.__version__}, and serialized engines run only under their own version; "
                          f"{rebuild(entry)}")
    here = compute_capability(0)
    if compiler.ahead_of_time:
        check_targets(entry, here)
    elif built.get("compute_capability") not in (None, here):
        raise SpecrtError(f"engine '{entry.name}' was built for compute capability {built['compute_capability']}, "
                          f"this GPU is {here}, and serialized engines run only on their own architecture; {REBUILD}")
    path = Path(root) / entry.file
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    blob = path.read_bytes()
    if compiler.ahead_of_time:
        check_validity(trt, runtime, blob, entry)
    engine = runtime.deserialize_cuda_engine(blob)
    if engine is None:
        raise SpecrtError(f"{compiler.label} cannot deserialize engine '{path}' (see its log above); "
                          f"{rebuild(entry)}")
    config, cache = None, None
    if compiler.ahead_of_time:
        cache = RuntimeCache(trt, runtime_cache_path(Path(root), entry.name, trt.__version__, here))
        config = rtx_runtime_config(trt, engine, cache)
    # the two contexts share one scratch buffer (USER_MANAGED): they run one after the other on one stream
    return engine, (logger, runtime, cache), trt.ExecutionContextAllocationStrategy.USER_MANAGED, config


def on_own_memory(make):
    """make(memory) on a CudaMemory of its own, which is freed if making fails."""
    memory = CudaMemory()
    try:
        return make(memory)
    except BaseException:
        memory.close()
        raise


def trt_buckets(engine, max_context: int, max_width: int, what: str) -> Buckets:
    """The widths and the one capacity an engine's decode profile allows. TensorRT's KV-cache update wants a static
    sequence dimension (its KVCacheUpdate layer's documented restriction), so build/tensorrt.py fixes the cache
    capacity in the graph: every pass attends over that capacity, the mask hiding what is not written."""
    buckets = Buckets.for_engine(max_context, max_width, geometric=True, pad_logits=True)
    static = int(engine.get_tensor_shape(past_name(0, "key"))[2])
    if static <= 0:
        raise SpecrtError(f"{what} has a dynamic cache capacity, which TensorRT's KV-cache update cannot take; "
                          f"{REBUILD}")
    if static < buckets.max_capacity:
        raise SpecrtError(f"{what} holds {static} cache positions, fewer than max_context {max_context} + the "
                          f"widest pass {max_width}; {REBUILD}")
    return Buckets(buckets.widths, (static,), pad_logits=True)


TRT_DTYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16"}  # numpy's name -> trt.DataType's


def check_io(engine, addresses: dict[str, int], cache_dtype, name: str) -> None:
    """Every input and output of the engine has a buffer, and the cache is the precision the buffers were sized
    for: a mismatch would otherwise surface only at enqueue, or as garbage."""
    tensors = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    unbound = [t for t in tensors if t not in addresses]
    if unbound:
        raise SpecrtError(f"engine '{name}' has a tensor '{unbound[0]}' this specrt does not bind; {REBUILD}")
    have = engine.get_tensor_dtype(past_name(0, "key")).name
    want = TRT_DTYPES.get(np.dtype(cache_dtype).name)
    if have != want:
        raise SpecrtError(f"engine '{name}' keeps its cache in {have}, its manifest entry says {want}; {REBUILD}")


class TrtContexts:
    """An engine's two execution contexts (prefill, decode), each kept on its own profile, every tensor address set
    at open, sharing one scratch buffer where `strategy` (USER_MANAGED) allows; the shapes each is set for, and
    the CUDA graphs captured on them by key. note: why capture stopped (None while it works). runtime_config:
    TensorRT for RTX's (rtx_runtime_config: USER_MANAGED scratch), the contexts are made from it; keep: what the
    engine must outlive, whose runtime cache (RuntimeCache) is saved at close."""

    def __init__(self, engine, memory, name: str, addresses: dict[str, int], cache_dtype, strategy=None,
                 runtime_config=None, keep: tuple = ()):
        self.engine, self.memory, self.name, self.keep = engine, memory, name, keep
        self.asks_capture = runtime_config is not None  # TensorRT for RTX's contexts say whether a stream captures
        check_io(engine, addresses, cache_dtype, name)
        shared = strategy is not None or runtime_config is not None
        size = int(engine.device_memory_size_v2) if shared else 0
        self.scratch = memory.alloc(size) if size else None  # freed with the engine's memory
        self.contexts = []
        for profile in (PREFILL, DECODE):
            if runtime_config is not None:
                ctx = engine.create_execution_context(runtime_config)
            else:
                ctx = engine.create_execution_context(strategy) if self.scratch else engine.create_execution_context()
            if ctx is None or not ctx.set_optimization_profile_async(profile, memory.stream):
                raise SpecrtError(f"TensorRT could not create an execution context for engine '{name}' (out of GPU "
                                  "memory? see its log above)")
            if self.scratch:
                ctx.set_device_memory(self.scratch, size)
            self.contexts.append(ctx)
            for tensor, ptr in addresses.items():
                self.set_address(profile, tensor, ptr)
        self.shapes: list[dict | None] = [None, None]
        self.graphs: dict[tuple, object] = {}
        self.note: str | None = None

    def set_address(self, profile: int, tensor: str, ptr: int) -> None:
        if not self.contexts[profile].set_tensor_address(tensor, ptr):
            raise SpecrtError(f"engine '{self.name}' has no tensor '{tensor}'; {REBUILD}")

    def run(self, profile: int, shapes: dict[str, tuple], key: tuple, graph: bool) -> None:
        """One pass on `profile` at `shapes`: the CUDA graph of `key` if one was captured, else executed (the
        warm-up a capture needs) and, with graph, captured. The context is set to the pass's shapes first, also
        before a replay: a graph may read state the context keeps for its shapes (TensorRT-Edge-LLM's executor
        likewise replays a graph only when the context's bindings match the ones it was captured with)."""
        if self.shapes[profile] != shapes:
            for tensor, shape in shapes.items():
                if not self.contexts[profile].set_input_shape(tensor, shape):
                    raise SpecrtError(f"engine '{self.name}' does not take {tensor} of shape {shape}; {REBUILD}")
            self.shapes[profile] = shapes
        if graph and key in self.graphs:
            check(cudart().cudaGraphLaunch(self.graphs[key], self.memory.stream), "cudaGraphLaunch")
            return
        if not self._execute(profile):
            raise SpecrtError(f"TensorRT failed to run engine '{self.name}' at {key} (see its log above)")
        if graph:
            self._capture(profile, key)

    def _execute(self, profile: int) -> bool:
        return bool(self.contexts[profile].execute_async_v3(self.memory.stream))

    def _capture(self, profile: int, key: tuple) -> None:
        """Record the pass just run as a CUDA graph (recording runs nothing: the warm-up above did the work). The
        stream is idle first, as trtexec's and TensorRT-Edge-LLM's captures have it."""
        rt, stream = cudart(), self.memory.stream
        if self.asks_capture and not self.contexts[profile].is_stream_capturable(stream):
            self.note = f"the engine cannot be captured on this stream at {key}"
            return
        self.memory.sync()
        check(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCapture")
        ran = False
        try:
            ran = self._execute(profile)
        finally:  # the stream leaves capture mode whatever happened, or every later call on it fails
            err, graph = rt.cudaStreamEndCapture(stream)
        if not ran or err != rt.cudaError_t.cudaSuccess or graph is None:
            if graph is not None:
                rt.cudaGraphDestroy(graph)
            rt.cudaGetLastError()  # clear the failed capture's error, or the next uncaptured pass reports it
            self.note = f"capture failed at {key} ({err})"
            return
        self.graphs[key] = check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        rt.cudaGraphDestroy(graph)

    def close(self) -> None:
        for exe in self.graphs.values():
            cudart().cudaGraphExecDestroy(exe)
        self.graphs, self.contexts = {}, []
        for kept in self.keep:
            if isinstance(kept, RuntimeCache):
                kept.save()


def pass_shapes(g: Geometry, rows: int, width: int, capacity: int, logits_rows: int) -> dict[str, tuple]:
    """Every input's shape for a pass of `rows` sequences x `width` tokens over `capacity` cache positions."""
    shapes = {INPUT_IDS: (rows, width), POSITION_IDS: (rows, width), ATTENTION_MASK: (rows, 1, width, capacity),
              WRITE_INDICES: (rows,), LOGITS_INDICES: (logits_rows,)}
    shapes.update({past_name(i, kind): (rows, g.num_kv_heads, capacity, g.head_dim)
                   for i in range(g.num_layers) for kind in KV_KINDS})
    return shapes


def buffer_addresses(e) -> dict[str, int]:
    """A device engine's buffers by tensor name (each cache buffer as both past input and present output)."""
    out = {INPUT_IDS: e.tokens, POSITION_IDS: e.positions, ATTENTION_MASK: e.mask, WRITE_INDICES: e.write,
           LOGITS_INDICES: e.rows, LOGITS: e.out_logits, GREEDY_TOKENS: e.out_greedy, HIDDEN_STATES: e.out_hidden}
    for i, layer in enumerate(e.cache.ptrs):
        for kind, ptr in zip(KV_KINDS, layer):
            out[past_name(i, kind)] = out[present_name(i, kind)] = ptr
    return out
