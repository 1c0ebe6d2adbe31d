"""One descriptor per backend: its name (the manifest's `backend` field), the suffix of a set's default name, the
precisions `specrt engines` builds for it, the runtime module that opens its engines, whether it builds the
portable graph, and the TensorRT compiler that turns that graph into serialized engines. The manifest, the
pipeline, the CLI and the runtime's registry all read this table; a backend is added here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .interface import PORTABLE_DTYPES

PORTABLE_PRECISIONS = tuple(PORTABLE_DTYPES)  # fp32, fp16, fp8, int8, int4-awq


@dataclass(frozen=True)
class Backend:
    name: str
    help: str                          # one clause for --backend's help
    runtime: str                       # the module under specrt.runtime.backends that opens its engines
    set_suffix: str = ""               # a set's default name: <source><suffix>
    precisions: tuple[str, ...] = ()   # what `specrt engines` builds (() = not built: runtime only)
    default_precisions: tuple[str, ...] = ()
    portable: bool = False             # builds the portable graph (export/portable.py)
    compiler: str | None = None        # the portable graph compiled by this TensorRT (build/tensorrt.py COMPILERS)

    @property
    def module(self) -> str:
        return f"specrt.runtime.backends.{self.runtime}"


BACKENDS = {b.name: b for b in (
    Backend("onnxruntime", "ONNX Runtime's CPU provider with fused kernels (the fastest here)", "onnxruntime_cpu",
            precisions=("fp32", "int8", "int4", "int4-fp32"), default_precisions=("fp32", "int8", "int4")),
    Backend("onnxruntime-portable", "the standard-op graph GPUs compile, run on the CPU (their parity reference)",
            "onnxruntime_portable", "-portable", PORTABLE_PRECISIONS, ("fp32", "fp16"), portable=True),
    Backend("onnxruntime-cuda", "onnxruntime-gpu's CUDA EP with CUDA graphs", "onnxruntime_cuda", "-cuda",
            PORTABLE_PRECISIONS, ("fp16",), portable=True),
    Backend("tensorrt", "serialized TensorRT engines, built on the GPU that runs them", "tensorrt", "-tensorrt",
            PORTABLE_PRECISIONS, ("fp16",), portable=True, compiler="tensorrt"),
    Backend("tensorrt-rtx", "TensorRT for RTX engines, compiled ahead of time on any machine for --gpu-arch",
            "tensorrt", "-tensorrt-rtx", PORTABLE_PRECISIONS, ("fp16",), portable=True, compiler="tensorrt-rtx"),
    Backend("reference", "numpy, for tests: the engine contract's executable spec", "reference"),
)}
BUILT = tuple(name for name, b in BACKENDS.items() if b.precisions)  # what --backend takes


def get(name: str) -> Backend | None:
    return BACKENDS.get(name)
