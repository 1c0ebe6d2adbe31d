"""The ONNX Runtime CUDA backend: the portable graph (export/portable.py) on onnxruntime-gpu's CUDA execution
provider, with one CUDA graph per (pass width, cache capacity).

Where this onnxruntime has no CUDA provider (plain `onnxruntime`), or its CUDA provider does not load (ORT then
falls back to the CPU with a warning), opening an engine is a one-line SpecrtError. Where the CUDA EP refuses
graph capture for this graph (a node placed on the CPU, say), the engine runs without graphs and says why in
its description.

More: docs/runtime-notes.md, "Module notes: runtime/backends/onnxruntime_cuda/".
"""

from __future__ import annotations

from pathlib import Path

from ...engine import EngineOptions
from ...static_shapes import Buckets
from ..device.geometry import Geometry, graphs_wanted
from ..device.memory import CudaMemory, require_device
from ..protocol import Runtime
from .batch import OrtCudaBatchEngine
from .heads import OrtCudaEagleHead, OrtCudaHeads
from .session import CUDA_EP, MAX_PASS_TOKENS, open_session, require_cuda_provider


def open_batch(root: Path, entry, options: EngineOptions, slots: int) -> "OrtCudaBatchEngine":
    """`slots` sequences of a manifest entry's portable decoder on the CUDA EP (runtime/batch.py's batch engine)."""
    return _open(root, entry, options, lambda *a, **kw: OrtCudaBatchEngine(*a, slots=slots, **kw))


def _open(root: Path, entry, options: EngineOptions, make):
    """make(session, memory, geometry, buckets, name=, width_exact=, graphs=, graphs_note=) over a session of the
    entry's graph on the CUDA EP, after the checks that it runs here; the device memory freed if it fails."""
    import onnxruntime as ort

    require_cuda_provider(ort.get_available_providers())
    require_device(entry.backend)
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
    only the candidates back to the host, as TensorRT's heads (tensorrt.heads.TrtHeads)."""
    import onnxruntime as ort

    from ..onnxruntime_cpu.session import open_session as open_cpu_session

    require_cuda_provider(ort.get_available_providers())
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    for key, value in (entry.session_config or {}).items():  # a Q/DQ heads graph runs as written
        so.add_session_config_entry(key, value)
    session = open_cpu_session(Path(root) / entry.file, so, providers=(CUDA_EP,))
    require_cuda_provider(session.get_providers())  # ORT falls back to the CPU with only a warning
    return OrtCudaHeads(session)


def open_eagle(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtCudaEagleHead":
    """The EAGLE head (eagle-fp32) on the CUDA EP beside the target (OrtCudaEagleHead), on a stream and memory of
    its own, at the entry's capacity."""
    import onnxruntime as ort

    require_cuda_provider(ort.get_available_providers())
    require_device(entry.backend)
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


RUNTIME = Runtime(open_batch=open_batch, open_heads=open_heads, open_eagle=open_eagle)
