"""One descriptor per backend: its name (the manifest's `backend` field), the suffix of a set's default name, the
precisions `specrt engines` builds for it, the runtime module that opens its engines, whether it builds the
portable graph, and the TensorRT compiler that turns that graph into serialized engines. The manifest, the
pipeline, the CLI and the runtime's registry all read this table; a backend is added here once. The TensorRT
compilers (regular TensorRT, built on the GPU it runs on; TensorRT for RTX, ahead of time for named architectures)
are small descriptors beside it, with the architectures TensorRT for RTX targets: the build and the runtime share
them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .errors import SpecrtError
from .interface import PORTABLE_DTYPES

PORTABLE_PRECISIONS = tuple(PORTABLE_DTYPES)  # fp32, fp16, fp8, int8, int4-awq
DEFAULT_BACKEND, DEFAULT_CONTEXT = "onnxruntime", 4096  # a build not told --backend, --max-context


@dataclass(frozen=True)
class Backend:
    name: str
    help: str                          # one clause for --backend's help
    runtime: str                       # the package under specrt.runtime.backends that opens its engines (its RUNTIME)
    set_suffix: str = ""               # a set's default name: <source><suffix>
    precisions: tuple[str, ...] = ()   # what `specrt engines` builds (() = not built: runtime only)
    default_precisions: tuple[str, ...] = ()
    portable: bool = False             # builds the portable graph (export/portable.py)
    compiler: str | None = None        # the portable graph compiled by this TensorRT (build/tensorrt.py COMPILERS)
    batch: bool = False                # its RUNTIME has open_batch: several streams (runtime/engine.py BatchEngine)
    gpu: bool = False                  # its engines run on an NVIDIA GPU (heads beside them read hidden rows there)
    provider: str | None = None        # the ONNX Runtime execution provider its engines need (checked before a build)

    @property
    def module(self) -> str:
        return f"specrt.runtime.backends.{self.runtime}"


BACKENDS = {b.name: b for b in (
    Backend("onnxruntime", "ONNX Runtime's CPU provider with fused kernels (the fastest here)", "onnxruntime_cpu",
            precisions=("fp32", "int8", "int4", "int4-fp32"), default_precisions=("fp32", "int8", "int4"), batch=True),
    Backend("onnxruntime-portable", "the standard-op graph GPUs compile, run on the CPU (their parity reference)",
            "onnxruntime_portable", "-portable", PORTABLE_PRECISIONS, ("fp32", "fp16"), portable=True, batch=True),
    Backend("onnxruntime-cuda", "onnxruntime-gpu's CUDA EP with CUDA graphs", "onnxruntime_cuda", "-cuda",
            PORTABLE_PRECISIONS, ("fp16",), portable=True, batch=True, gpu=True, provider="CUDAExecutionProvider"),
    Backend("tensorrt", "serialized TensorRT engines, built on the GPU that runs them", "tensorrt", "-tensorrt",
            PORTABLE_PRECISIONS, ("fp16",), portable=True, compiler="tensorrt", batch=True, gpu=True),
    Backend("tensorrt-rtx", "TensorRT for RTX engines, compiled ahead of time on any machine for --gpu-arch",
            "tensorrt", "-tensorrt-rtx", PORTABLE_PRECISIONS, ("fp16",), portable=True, compiler="tensorrt-rtx",
            batch=True, gpu=True),
    Backend("reference", "numpy, for tests: the engine contract's executable spec", "reference"),
)}
BUILT = tuple(name for name, b in BACKENDS.items() if b.precisions)  # what --backend takes


@dataclass(frozen=True)
class Compiler:
    """A TensorRT compiler: the backend it builds for, its Python module, how to install it, and whether it
    compiles ahead of time for named GPU architectures (no GPU needed) or for the GPU it runs on."""

    backend: str
    module: str
    label: str
    install: str
    ahead_of_time: bool
    rebuild: str  # the one-line fix for an engine of its that cannot run here

    def require(self):
        """The compiler's module, or a one-line SpecrtError naming the package to install."""
        try:
            return importlib.import_module(self.module)
        except ImportError:
            raise SpecrtError(self.install) from None


TENSORRT = Compiler("tensorrt", "tensorrt", "TensorRT",
                    "TensorRT is not installed: `pip install tensorrt-cu12` (or tensorrt-cu13, matching your CUDA) on "
                    "a machine with an NVIDIA GPU; --backend tensorrt needs it", ahead_of_time=False,
                    rebuild="rebuild the engine set with `specrt engines --backend tensorrt` on this GPU (or --backend "
                            "tensorrt-rtx --gpu-arch for it)")
TENSORRT_RTX = Compiler("tensorrt-rtx", "tensorrt_rtx_bindings", "TensorRT for RTX",
                        "TensorRT for RTX is not installed: `pip install 'specrt[tensorrt-rtx]'` "
                        "(tensorrt-rtx-cu13-libs and -bindings 1.7.1.116); --backend tensorrt-rtx needs it",
                        ahead_of_time=True,
                        rebuild="rebuild the engine set with `specrt engines --backend tensorrt-rtx --gpu-arch ARCHS`")
COMPILERS = {c.backend: c for c in (TENSORRT, TENSORRT_RTX)}
INSTALL = TENSORRT.install

# TensorRT for RTX's targets (its ComputeCapability enum: no SM90, Hopper is regular TensorRT's) and its default
# set (docs: "CPU-Only AOT and TensorRT-RTX Engines"); the architectures with FP8 tensor cores (its support matrix)
GPU_ARCHS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
DEFAULT_GPU_ARCHS = ("sm80", "sm86", "sm89", "sm120")
FP8_ARCHS = ("sm89", "sm120", "sm121")
# what TensorRT for RTX 1.7 refuses to compile per architecture (each pair compiled: BENCHMARKS.md, "Does every
# engine compile with a real TensorRT compiler?"): FP8 before Ada; on Turing also FP32 GEMMs and INT4 weights
ARCH_LACKS = {"sm75": {"fp32": "FP32 GEMMs", "fp8": "FP8", "int4-awq": "INT4 weights"},
              "sm80": {"fp8": "FP8"}, "sm86": {"fp8": "FP8"}}
