"""TensorRT for RTX at run time: an engine checked against this GPU (the architectures it was compiled for, the
library's own header check), its runtime cache per GPU under engines/.cache/tensorrt-rtx, and the runtime
configuration its contexts are made from; and the one-line fix for an engine that cannot run here.
"""

from __future__ import annotations

import os
from pathlib import Path

from ....backends import BACKENDS, COMPILERS, TENSORRT
from ....errors import SpecrtError
from ..device.memory import check, cudart

REBUILD = TENSORRT.rebuild


def rebuild(entry) -> str:
    """The one-line fix for an engine of entry's compiler that cannot run here."""
    return COMPILERS[BACKENDS[entry.backend].compiler].rebuild


def check_targets(entry, here: str) -> None:
    """A TensorRT for RTX engine runs on the architectures it was compiled for (entry.build's gpu_archs); Hopper and
    data-center Blackwell are regular TensorRT's. One line naming the backend or --gpu-arch to build instead."""
    from ....backends import DEFAULT_GPU_ARCHS, GPU_ARCHS

    arch = "sm" + here.replace(".", "")
    targets = (entry.build or {}).get("gpu_archs") or list(DEFAULT_GPU_ARCHS)
    if arch not in GPU_ARCHS:
        raise SpecrtError(f"engine '{entry.name}' is a TensorRT for RTX engine, and this GPU (compute capability "
                          f"{here}) is not one TensorRT for RTX runs on (it targets {', '.join(GPU_ARCHS)}); build "
                          "the set on this machine with `specrt engines --backend tensorrt`")
    if arch not in targets:
        raise SpecrtError(f"engine '{entry.name}' was compiled for {', '.join(targets)}, and this GPU is {arch}; "
                          f"rebuild the set with `specrt engines --backend tensorrt-rtx --gpu-arch "
                          f"{','.join([*targets, arch])}`")


def check_validity(trt, runtime, blob: bytes, entry) -> None:
    """TensorRT for RTX's own check of an engine's header against this machine (Runtime.get_engine_validity),
    before deserializing: an engine it calls invalid would fail there with less to say."""
    validity, diagnostics = runtime.get_engine_validity(memoryview(blob)[:int(runtime.engine_header_size)])
    if validity != trt.EngineValidity.INVALID:
        return
    reasons = [n.lower().replace("_", " ") for n, v in trt.EngineInvalidityDiagnostics.__members__.items()
               if diagnostics & int(v)] or ["no reason given"]
    fix = ("update the NVIDIA driver" if any(r.startswith(("old cuda", "cuda error")) for r in reasons)
           else rebuild(entry))
    raise SpecrtError(f"TensorRT for RTX says engine '{entry.name}' cannot run here ({', '.join(reasons)}); {fix}")


def runtime_cache_path(root: Path, engine: str, version: str, here: str) -> Path:
    """The runtime cache of one TensorRT for RTX engine of a set on this GPU: engines/.cache/tensorrt-rtx/, one file
    per set, engine, GPU model, compute capability and TensorRT for RTX version (each engine saves its own whole
    cache at close; the library ignores a cache from another GPU or version)."""
    name = "gpu"
    try:
        prop = check(cudart().cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
        raw = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
        name = "".join(c if c.isalnum() else "-" for c in raw.strip("\x00 ").lower()).strip("-") or name
    except (SpecrtError, AttributeError):
        pass
    return (root.resolve().parent / ".cache" / "tensorrt-rtx" /
            f"{root.resolve().name}-{engine}-{name}-sm{here.replace('.', '')}-{version}.bin")


class RuntimeCache:
    """TensorRT for RTX's runtime cache (the kernels it compiles for this GPU when an engine first runs a shape),
    read from its file at open and written back, whole, at close: the second start skips that compilation
    (docs: "Work with the Runtime Cache")."""

    def __init__(self, trt, path: Path):
        self.path, self.cache = path, None
        self._trt = trt

    def attach(self, config) -> None:
        self.cache = config.create_runtime_cache()
        if self.path.is_file() and not self.cache.deserialize(self.path.read_bytes()):
            self.path.unlink(missing_ok=True)  # another driver's or a damaged file: compiled anew, saved at close
        config.set_runtime_cache(self.cache)

    def save(self) -> None:
        if self.cache is None:
            return
        data = self.cache.serialize()
        part = self.path.with_name(f"{self.path.name}.{os.getpid()}.part")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(memoryview(data))
            os.replace(part, self.path)
        except OSError:  # a read-only engines folder only costs the next start its kernel compilation
            part.unlink(missing_ok=True)


def rtx_runtime_config(trt, engine, cache: RuntimeCache):
    """TensorRT for RTX's runtime configuration for our contexts: the runtime cache; EAGER shape specialization, so
    the uncaptured warm-up pass of a new (width, capacity) compiles its specialized kernels before we capture it (a
    capture would freeze LAZY's fallback kernels); the library's own CUDA graphs off, since we capture ourselves
    (its docs: turn RTX CUDA graphs off when capturing the stream externally; every pass shape is static here, the
    cache capacity fixed in the graph); one USER_MANAGED scratch shared by the two contexts, as on TensorRT."""
    config = engine.create_runtime_config()
    cache.attach(config)
    config.dynamic_shapes_kernel_specialization_strategy = trt.DynamicShapesKernelSpecializationStrategy.EAGER
    config.cuda_graph_strategy = trt.CudaGraphStrategy.DISABLED
    config.set_execution_context_allocation_strategy(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
    return config
