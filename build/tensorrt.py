"""TensorRT backend: the portable decoder graph (export/portable.py) -> a serialized TensorRT engine.

The network is strongly typed (precision comes from the graph: an fp16 graph gives an fp16 engine; TensorRT 11
has no other kind), and TF32 is off by default so an fp32 engine stays within fp32 parity of the CPU reference.
Two optimization profiles, in this order (runtime/backends/tensorrt.py opens one execution context on each):
prefill (1..max_prompt tokens, one sequence) and decode/verify (1..max_width tokens, the widths CUDA graphs
capture, for 1..MAX_BATCH sequences: several streams' passes at once).
TensorRT's KV-cache update (what the parser makes of TensorScatter) wants a static sequence dimension, so the
cache capacity is fixed at max_capacity in the graph handed to the parser: every pass then attends
over max_capacity slots, the mask hiding the unused ones. The timing cache is read and written back, so
rebuilds on one GPU reuse their kernel timings. A serialized engine runs only under the TensorRT version and on
the GPU architecture it was built with, which is why the facts record both.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import SpecrtError, first_line
from ..interface import PAST_PREFIX, PORTABLE_CACHE_DIMS, PORTABLE_INPUTS

INSTALL = ("TensorRT is not installed: `pip install tensorrt-cu12` (or tensorrt-cu13, matching your CUDA) on a "
           "machine with an NVIDIA GPU; --backend tensorrt needs it")
PREFILL_OPT, DECODE_OPT = 256, 8  # the widths TensorRT tunes each profile's kernels for
MAX_BATCH = 8  # sequences one decode pass takes (--parallel); its kernels are tuned for one (the opt shape)
WORKSPACE = 4 << 30  # bytes of scratch TensorRT may use while building and running
# cache positions the fixed capacity is a multiple of: with 4 bytes or more a head row, each sequence's cache then
# starts on the 256-byte boundary TensorRT wants of a tensor address (a batch engine binds a prefill at its slot)
CAPACITY_ALIGN = 64


def require_tensorrt():
    """The tensorrt module, or a one-line SpecrtError naming the package to install."""
    try:
        import tensorrt
    except ImportError:
        raise SpecrtError(INSTALL) from None
    return tensorrt


def compute_capability() -> str | None:
    """Device 0's compute capability, e.g. "9.0" (cuda-bindings, else torch), None when neither can tell."""
    try:
        from cuda.bindings import runtime as rt

        err, prop = rt.cudaGetDeviceProperties(0)
        if err == rt.cudaError_t.cudaSuccess:
            return f"{prop.major}.{prop.minor}"
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return "{}.{}".format(*torch.cuda.get_device_capability(0))
    except ImportError:
        pass
    return None


def profile_shapes(inputs: dict[str, tuple[int, ...]], seq: tuple[int, int, int], logits: tuple[int, int, int],
                   capacity: tuple[int, int, int], batch: tuple[int, int, int] = (1, 1, 1),
                   ) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The (min, opt, max) shape of every input of a portable decoder network for one profile. inputs: name ->
    the network's shape (-1 where dynamic); seq, logits, capacity, batch: (min, opt, max) of those dims (batch:
    the sequences of one pass, runtime/backends/cuda_batch.py). A dim the network fixes keeps its size."""
    axes = {name: dims for name, dims, _ in PORTABLE_INPUTS}
    ranges = {"batch": batch, "seq": seq, "num_logits": logits, "capacity": capacity}
    out = {}
    for name, shape in inputs.items():
        dims = axes.get(name, PORTABLE_CACHE_DIMS if name.startswith(PAST_PREFIX) else None)
        if dims is None or len(dims) != len(shape):
            raise SpecrtError(f"the graph's input '{name}' {list(shape)} is not one of a portable decoder's "
                              "(specrt/interface.py); rebuild the set with `specrt engines --backend tensorrt`")
        per_dim = [(d, d, d) if d > 0 else ranges.get(a) for a, d in zip(dims, shape)]
        if None in per_dim:
            raise SpecrtError(f"the graph's input '{name}' {list(shape)} has a dynamic dim of no known range; "
                              "rebuild the set with `specrt engines --backend tensorrt`")
        out[name] = tuple(tuple(r[k] for r in per_dim) for k in range(3))
    return out


def fix_capacity(onnx_path: Path, capacity: int) -> bytes:
    """The graph at onnx_path (without its external weights) with every `capacity` dim of its inputs, outputs and
    value infos set to `capacity`, serialized: what the parser reads (the weights it loads from beside onnx_path)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    g = model.graph
    for info in [*g.input, *g.output, *g.value_info]:
        for dim in info.type.tensor_type.shape.dim:
            if dim.dim_param == "capacity":
                dim.dim_value = capacity  # clears dim_param (a oneof)
    return model.SerializeToString()


def build_engine(onnx_path: Path, out_path: Path, *, max_prompt: int, max_width: int, max_capacity: int,
                 opt_level: int = 3, fp32_parity: bool = True, timing_cache: Path, workspace: int = WORKSPACE,
                 max_batch: int = MAX_BATCH) -> dict:
    """Build the engine of the portable graph at onnx_path into out_path (written whole or not at all) -> facts:
    tensorrt (version), compute_capability, profiles, static_capacity (the fixed cache capacity), opt_level, tf32,
    build_s, engine_bytes. max_capacity: the largest cache layout (max_context + max_width), rounded up to
    CAPACITY_ALIGN; fp32_parity: TF32 off; max_batch: sequences per decode pass (prefills run one at a time)."""
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # no GPU, or a driver TensorRT cannot use
        raise SpecrtError(f"TensorRT cannot start a builder ({first_line(e)}); build TensorRT engines on the "
                          "machine with the NVIDIA GPU that will run them") from None
    # TensorRT 11 networks are always strongly typed (the flag is kept there, deprecated and ignored)
    strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly is None else 1 << int(strongly))
    parser = trt.OnnxParser(network, logger)
    max_capacity = -(-max_capacity // CAPACITY_ALIGN) * CAPACITY_ALIGN
    model = fix_capacity(onnx_path, max_capacity)
    if not parser.parse(model, str(onnx_path)):
        errors = [first_line(parser.get_error(i)) for i in range(parser.num_errors)] or ["no error reported"]
        raise SpecrtError(f"TensorRT {trt.__version__} cannot parse '{onnx_path}': {errors[0]}"
                          + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else "")
                          + "; rebuild the set with `specrt engines --backend onnxruntime-portable` instead")
    config = builder.create_builder_config()
    config.builder_optimization_level = opt_level
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    if fp32_parity:
        config.clear_flag(trt.BuilderFlag.TF32)
    timing_cache = Path(timing_cache)
    try:
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    except Exception:  # noqa: BLE001 -- an unreadable cache file is only lost timings
        cache = None
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):  # another GPU's: start anew
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    inputs = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    capacity = (max_capacity, max_capacity, max_capacity)
    ranges = {"prefill": {"seq": (1, min(PREFILL_OPT, max_prompt), max_prompt), "num_logits": (1, 1, max_width),
                          "capacity": capacity, "batch": (1, 1, 1)},
              "decode": {"seq": (1, min(DECODE_OPT, max_width), max_width),
                         "num_logits": (1, min(DECODE_OPT, max_width), max_width), "capacity": capacity,
                         "batch": (1, 1, max_batch)}}
    for r in ranges.values():  # prefill first, then decode: the runtime's profile indices
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile_shapes(inputs, r["seq"], r["num_logits"], r["capacity"],
                                                  r["batch"]).items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    t0 = time.perf_counter()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise SpecrtError(f"TensorRT {trt.__version__} could not build an engine from '{onnx_path}' (see its log "
                          "above); rebuild the set with `specrt engines --backend onnxruntime-portable` instead")
    build_s = time.perf_counter() - t0
    _write_atomic(Path(out_path), memoryview(blob))
    _write_atomic(timing_cache, memoryview(config.get_timing_cache().serialize()))
    return {"tensorrt": trt.__version__, "compute_capability": compute_capability(),
            "profiles": {k: {dim: list(v) for dim, v in r.items()} for k, r in ranges.items()},
            "static_capacity": max_capacity, "opt_level": opt_level,
            "tf32": not fp32_parity, "build_s": round(build_s, 1), "engine_bytes": Path(out_path).stat().st_size}


def _write_atomic(path: Path, data) -> None:
    """Write to path.part, then rename over path: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
    os.replace(part, path)
