"""The ONNX Runtime CUDA backend: the portable graph (export/portable.py) on onnxruntime-gpu's CUDA execution
provider, with one CUDA graph per (pass width, cache capacity).

Where this onnxruntime has no CUDA provider (plain `onnxruntime`), or its CUDA provider does not load (ORT then
falls back to the CPU with a warning), opening an engine is a one-line SpecrtError. Where the CUDA EP refuses
graph capture for this graph (a node placed on the CPU, say), the engine runs without graphs and says why in
its description.

More: docs/runtime-notes.md, "Module notes: runtime/backends/onnxruntime_cuda.py".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import SpecrtError, first_line
from ...interface import (ATTENTION_MASK, EAGLE_FEATURES, GREEDY_TOKENS, HEADS_CANDIDATES, HEADS_HIDDEN, HEADS_TOKEN,
                          HIDDEN_STATES, INPUT_IDS, KV_KINDS, LOGITS, LOGITS_INDICES, POSITION_IDS, WRITE_INDICES,
                          past_name, present_name)
from ..engine import EngineOptions
from ..static_shapes import Buckets
from .cuda_batch import DeviceBatchEngine
from .cuda_engine import Geometry, graphs_wanted
from .cuda_memory import CudaMemory, Memory, require_device
from .device_eagle import OUTPUTS, DeviceEagleHead

MAX_PASS_TOKENS = 64
EAGLE_ROWS = 2048  # rows of one EAGLE head call, as TensorRT's prefill profile (pipeline/portable.py): more in chunks
CUDA_EP = "CUDAExecutionProvider"
NO_CUDA = ("onnxruntime-cuda: this onnxruntime runs on the CPU only ({}); pip install onnxruntime-gpu on a machine "
           "with CUDA, or build with --backend onnxruntime-portable")


def require_cuda_provider(providers: list[str]) -> None:
    """Refuse in one line unless `providers` (ort.get_available_providers(), or a session's get_providers())
    include the CUDA execution provider."""
    if CUDA_EP not in providers:
        raise SpecrtError(NO_CUDA.format("providers: " + ", ".join(providers)))


def open_session(onnx_path: Path, stream: int, threads: int = 0, graphs: bool = True):
    """(an InferenceSession of onnx_path on the CUDA EP, enqueueing on `stream`; why graphs are off, or None).
    A CUDA EP that will not capture this graph (ORT refuses at session creation) gives a session without graphs."""
    import onnxruntime as ort

    require_cuda_provider(ort.get_available_providers())
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime-gpu >= 1.21: CUDA and cuDNN from torch or nvidia-*
    if preload is not None:                       # wheels, which the loader would not find on its own
        try:
            preload()
        except Exception:  # noqa: BLE001 -- best effort: a missing library fails the session below, in one line
            pass
    def session(capture: bool):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads
        so.enable_mem_pattern = not capture  # memory patterns allocate per shape, which a replay cannot
        options = {"device_id": "0", "user_compute_stream": str(stream), "enable_cuda_graph": str(int(capture))}
        # enable_fallback=0: a CUDA EP that fails to load raises here instead of ORT rebuilding the session on
        # the CPU, so a failure tied to graphs gets its retry without them
        return ort.InferenceSession(str(onnx_path), so, providers=[(CUDA_EP, options)], enable_fallback=0)

    note = None
    try:
        try:
            s = session(graphs)
        except MemoryError:
            raise
        except Exception as e:
            if not graphs:
                raise
            note = f"the CUDA EP would not capture this graph: {first_line(e)}"
            s = session(False)
    except MemoryError:
        raise
    except Exception as e:
        raise SpecrtError(f"cannot load engine '{onnx_path}' on the CUDA EP ({first_line(e)}); "
                          "rebuild the engine set with `specrt engines --backend onnxruntime-cuda`") from None
    require_cuda_provider(s.get_providers())
    return s, note


def open_engine(root: Path, entry, options: EngineOptions = EngineOptions()):
    """The portable decoder engine of a manifest entry on the CUDA EP (engine.open_engine's CUDA half): a single
    stream, slot 0 of a batch engine of one slot whose passes run at once (batch.DeviceSoloEngine)."""
    from ..batch import solo

    return solo(open_batch(root, entry, options, 1))


def open_batch(root: Path, entry, options: EngineOptions, slots: int) -> "OrtCudaBatchEngine":
    """`slots` sequences of a manifest entry's portable decoder on the CUDA EP (runtime/batch.py's batch engine)."""
    return _open(root, entry, options, lambda *a, **kw: OrtCudaBatchEngine(*a, slots=slots, **kw))


def _open(root: Path, entry, options: EngineOptions, make):
    """make(session, memory, geometry, buckets, name=, width_exact=, graphs=, graphs_note=) over a session of the
    entry's graph on the CUDA EP, after the checks that it runs here; the device memory freed if it fails."""
    import onnxruntime as ort

    require_cuda_provider(ort.get_available_providers())
    require_device("onnxruntime-cuda")
    geometry = Geometry.of(entry)
    memory = CudaMemory()
    graphs, note = graphs_wanted()
    try:
        session, refused = open_session(Path(root) / entry.file, memory.stream, options.threads, graphs)
        max_width = int((entry.build or {}).get("max_width", MAX_PASS_TOKENS))
        buckets = Buckets.for_engine(entry.max_context, max_width, geometric=True, pad_logits=True)
        return make(session, memory, geometry, buckets, name=entry.name, width_exact=entry.width_exact,
                    graphs=graphs and refused is None, graphs_note=note or refused)
    except BaseException:
        memory.close()
        raise


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtCudaHeads":
    """Medusa heads on the CUDA EP beside the target (OrtCudaHeads): the hidden row read where the target left it,
    only the candidates back to the host, as TensorRT's heads (tensorrt_heads.TrtHeads)."""
    import onnxruntime as ort

    from .onnxruntime_cpu import open_session as open_cpu_session

    require_cuda_provider(ort.get_available_providers())
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    for key, value in (entry.session_config or {}).items():  # a Q/DQ heads graph runs as written
        so.add_session_config_entry(key, value)
    session = open_cpu_session(Path(root) / entry.file, so, providers=(CUDA_EP,))
    require_cuda_provider(session.get_providers())  # ORT falls back to the CPU with only a warning
    return OrtCudaHeads(session)


class OrtCudaHeads:
    """runtime/engine.py's Heads over a heads graph on the CUDA EP, through one IOBinding: the hidden row bound by its
    device address (a target's row on this GPU, batch.DeviceSlotEngine.hidden_address, read in place: ORT's
    IOBinding takes a raw buffer pointer, onnxruntime.ai/docs/api/python/api_summary.html "IOBinding") or from the
    host array given, the token from the host, and the candidates bound to a host buffer, which ORT fills as a run's
    last step. The target's pass ended in a sync and ORT's run syncs its own stream, so the row is read before the
    next pass writes it. device: "cuda", or "cpu" with a CPU session (the tests)."""

    on_device = True  # takes hidden rows by device address (proposers/medusa.py)

    def __init__(self, session, device: str = "cuda"):
        self.session, self.device = session, device
        shape = next(o.shape for o in session.get_outputs() if o.name == HEADS_CANDIDATES)  # [rows, K, topk]
        self.heads, self.topk = int(shape[1]), int(shape[2])
        inputs = {i.name: i for i in session.get_inputs()}
        self.hidden_size = int(inputs[HEADS_HIDDEN].shape[1])
        self._token = HEADS_TOKEN in inputs
        self._h, self._t = np.zeros((1, self.hidden_size), np.float32), np.zeros(1, np.int64)
        self._out = np.zeros((1, self.heads, self.topk), np.int64)
        self._io = session.io_binding()
        self._io.bind_output(HEADS_CANDIDATES, "cpu", 0, np.int64, list(self._out.shape), self._out.ctypes.data)

    def __call__(self, hidden: np.ndarray | int, token: int) -> np.ndarray:
        io = self._io
        if isinstance(hidden, (int, np.integer)):
            io.bind_input(HEADS_HIDDEN, self.device, 0, np.float32, [1, self.hidden_size], int(hidden))
        else:
            self._h[0] = hidden
            io.bind_cpu_input(HEADS_HIDDEN, self._h)
        if self._token:
            self._t[0] = token
            io.bind_cpu_input(HEADS_TOKEN, self._t)
        self.session.run_with_iobinding(io)
        return self._out[0].copy()


def open_eagle(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtCudaEagleHead":
    """The EAGLE head (eagle-fp32) on the CUDA EP beside the target (OrtCudaEagleHead), on a stream and memory of
    its own, at the entry's capacity."""
    import onnxruntime as ort

    require_cuda_provider(ort.get_available_providers())
    require_device("onnxruntime-cuda")
    memory = CudaMemory()
    try:
        session, _ = open_session(Path(root) / entry.file, memory.stream, threads=1, graphs=False)
        e = entry.eagle or {}
        return OrtCudaEagleHead(session, memory, name=entry.name, hidden=entry.hidden_size,
                                kv_heads=entry.num_kv_heads, head_dim=entry.head_dim, topk=int(e["topk"]),
                                capacity=int(e["capacity"]))
    except BaseException:
        memory.close()
        raise


class OrtCudaEagleHead(DeviceEagleHead):
    """device_eagle.DeviceEagleHead over the EAGLE head's graph on the CUDA EP: one IOBinding binds every input,
    output and cache buffer by its device address (rebound when a call's row count changes), and ORT runs on the
    memory's stream without a sync of its own (`user_compute_stream`, onnxruntime.ai/docs/execution-providers/
    CUDA-ExecutionProvider.html), so uploads, run and downloads are ordered on one stream and a call ends in one
    sync. One static capacity (the entry's): the buffers and masks are allocated once. device: "cuda", or "cpu"
    with HostMemory and a CPU session (the tests)."""

    def __init__(self, session, memory: Memory, *, name: str, hidden: int, kv_heads: int, head_dim: int, topk: int,
                 capacity: int, max_rows: int = EAGLE_ROWS, device: str = "cuda"):
        import onnxruntime as ort

        inputs = [i.name for i in session.get_inputs()]
        if EAGLE_FEATURES not in inputs:
            raise SpecrtError(f"engine '{name}' is not an EAGLE head graph (its inputs: {', '.join(inputs)}); "
                              "rebuild the engine set with `specrt engines --eagle-head`")
        self.session, self.device = session, device
        self._addresses = self._setup(memory, name=name, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim,
                                      topk=topk, capacity=capacity, max_rows=min(max_rows, capacity))
        self._io, self._rows = session.io_binding(), 0
        self._run_options = ort.RunOptions()
        if device == "cuda":  # the call syncs once after its downloads, on the same stream
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def _launch(self, W: int) -> None:
        if self._rows != W:
            io, dev, addresses = self._io, self.device, self._addresses
            for name, shape in self._shapes(W).items():
                io.bind_input(name, dev, 0, self._dtype(name), list(shape), addresses[name])
            for name in OUTPUTS:
                shape = [1, W, self._host[name].shape[1]]
                io.bind_output(name, dev, 0, self._host[name].dtype, shape, addresses[name])
            for kind in KV_KINDS:  # in place: the past buffer is the present one
                io.bind_output(present_name(0, kind), dev, 0, np.float32, list(self._cache_shape),
                               addresses[present_name(0, kind)])
            self._rows = W
        try:
            self.session.run_with_iobinding(self._io, self._run_options)
        except MemoryError:
            raise
        except Exception as e:
            raise SpecrtError(f"onnxruntime-cuda failed EAGLE head '{self.name}' on {W} rows ({first_line(e)})") \
                from None

    def _dtype(self, name: str):
        return self._host[name].dtype if name in self._host else np.float32  # the cache is float32

    def close(self) -> None:
        self._io, self.session = None, None  # before the device memory they are bound to
        super().close()


class _Bindings:
    """One IOBinding and RunOptions per pass shape over a device batch engine's buffers (cuda_batch's
    DeviceBatchEngine), every one bound by address, a gpu_graph_id per (rows, width, capacity); the runs on one worker
    thread while graphs are on (the module docstring)."""

    def _start(self, session, device: str) -> None:
        self.session, self.device = session, device
        self._bound: dict[tuple, tuple[object, object]] = {}  # pass shape -> (IOBinding, RunOptions)
        self._graph_ids: dict[tuple[int, int, int], int] = {}
        self._warm: set[tuple[int, int, int]] = set()  # (rows, width, capacity) run uncaptured once
        self._worker, self._capturing = None, self.graphs  # the session was made with enable_cuda_graph
        if self.graphs:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"specrt-cuda-{self.name}")

    def _binding(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None, graph: bool):
        import onnxruntime as ort

        key = (rows, width, capacity, logits_rows, slot, graph)
        if key in self._bound:
            return self._bound[key]
        g, io, dev = self.geometry, self.session.io_binding(), self.device
        for name, dtype, shape, ptr in (
                (INPUT_IDS, np.int64, [rows, width], self.tokens),
                (POSITION_IDS, np.int64, [rows, width], self.positions),
                (ATTENTION_MASK, np.float32, [rows, 1, width, capacity], self.mask),
                (WRITE_INDICES, np.int64, [rows], self.write), (LOGITS_INDICES, np.int64, [logits_rows], self.rows)):
            io.bind_input(name, dev, 0, dtype, shape, ptr)
        cache = [rows, g.num_kv_heads, capacity, g.head_dim]
        for i, layer in enumerate(self.cache.ptrs):  # slot None: slots [0, rows); else that slot's part alone
            for kind, ptr in zip(KV_KINDS, layer):
                at = ptr if slot is None else self.cache.slot_ptr(ptr, slot)
                io.bind_input(past_name(i, kind), dev, 0, g.cache_dtype.type, cache, at)
                io.bind_output(present_name(i, kind), dev, 0, g.cache_dtype.type, cache, at)
        io.bind_output(LOGITS, dev, 0, np.float32, [rows, logits_rows, g.vocab_size], self.out_logits)
        io.bind_output(GREEDY_TOKENS, dev, 0, np.int64, [rows, logits_rows], self.out_greedy)
        io.bind_output(HIDDEN_STATES, dev, 0, np.float32, [rows, width, g.hidden_size], self.out_hidden)
        run = ort.RunOptions()
        if self._capturing:  # ids from 1 (ORT takes a run without one as id 0); -1: this run uncaptured
            gid = self._graph_ids.setdefault((rows, width, capacity), len(self._graph_ids) + 1) if graph else -1
            run.add_run_config_entry("gpu_graph_id", str(gid))
        if dev == "cuda":  # we sync once after the downloads, on the same stream
            run.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if width <= self.max_pass_tokens:  # a wide prefill's binding is not kept (once per request)
            self._bound[key] = (io, run)
        return io, run

    def _call(self, io, run) -> None:
        if self._worker is None:
            self.session.run_with_iobinding(io, run)
        else:  # the thread ORT keeps this engine's graphs on
            self._worker.submit(self.session.run_with_iobinding, io, run).result()

    def _run_pass(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None,
                  graph: bool) -> None:
        graph = graph and self.graphs  # off once a capture failed
        shape = f"width {width}" if rows == 1 else f"{rows} x {width} tokens"
        try:
            if graph and (rows, width, capacity) not in self._warm:  # uncaptured once: the arena grows to it
                self._call(*self._binding(rows, width, capacity, logits_rows, slot, False))
                self._warm.add((rows, width, capacity))
            try:
                self._call(*self._binding(rows, width, capacity, logits_rows, slot, graph))
            except MemoryError:
                raise
            except Exception as e:  # ORT's own exception types; a capture fails on its run, not at load
                if not graph:
                    raise
                self.graphs, self.graphs_note = False, f"capture failed at {shape}, capacity {capacity} " \
                    f"({first_line(e)})"
                self._call(*self._binding(rows, width, capacity, logits_rows, slot, False))
        except MemoryError:
            raise
        except Exception as e:
            raise SpecrtError(f"onnxruntime-cuda failed a pass of {shape} over capacity {capacity} "
                              f"({first_line(e)})") from None

    def close(self) -> None:
        """The session, its bindings and the worker go before the device memory and stream they use."""
        if self._worker is not None:
            self._worker.shutdown()
        self._bound, self.session = {}, None
        super().close()


class OrtCudaBatchEngine(_Bindings, DeviceBatchEngine):
    """cuda_batch.DeviceBatchEngine over an ORT session of the portable graph: one IOBinding and RunOptions per
    pass shape, every buffer bound by address, a gpu_graph_id per (rows, width, capacity). device: where `memory`'s
    addresses live as ORT names it ("cuda"; "cpu" with cuda_memory.HostMemory and a CPU session, which is how the
    tests run this class without a GPU). max_prompt: the widest pass (default max_context)."""

    backend = "onnxruntime-cuda"

    def __init__(self, session, memory: Memory, geometry: Geometry, buckets: Buckets, *, slots: int, name: str,
                 width_exact: bool = True, graphs: bool = True, graphs_note: str | None = None, device: str = "cuda",
                 max_prompt: int | None = None, batch_width: int | None = None):
        super().__init__(memory, geometry, buckets, slots=slots, name=name, width_exact=width_exact,
                         graphs=graphs and device == "cuda",
                         graphs_note=graphs_note or (None if device == "cuda" else f"device {device}"),
                         max_prompt=max_prompt, batch_width=batch_width)
        self._start(session, device)

    def _launch(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None,
                graph: bool) -> None:
        self._run_pass(rows, width, capacity, logits_rows, slot, graph)
