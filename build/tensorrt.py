"""TensorRT backends: the portable decoder graph (export/portable.py) -> a serialized TensorRT engine, by regular
TensorRT (on the GPU that will run it) or TensorRT for RTX (ahead of time, on any machine, for the GPU
architectures named): one build, the compiler a small descriptor (`Compiler`), as Polygraphy keeps TensorRT for
RTX as a config over its TensorRT backend.

More: docs/design-notes.md, "Module notes: build/tensorrt.py".
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

from ..backends import (ARCH_LACKS, COMPILERS, DEFAULT_GPU_ARCHS, FP8_ARCHS, GPU_ARCHS,  # noqa: F401 (re-exported)
                        TENSORRT, TENSORRT_RTX, Compiler)
from ..errors import SpecrtError, first_line
from ..interface import EAGLE_INPUTS, PAST_PREFIX, PORTABLE_CACHE_DIMS, PORTABLE_INPUTS

PREFILL_OPT, DECODE_OPT = 256, 8  # the widths TensorRT tunes each profile's kernels for
MAX_BATCH = 8  # sequences one decode pass takes (--parallel); its kernels are tuned for one (the opt shape)
WORKSPACE = 4 << 30  # bytes of scratch TensorRT may use while building and running
# cache positions the fixed capacity is a multiple of: with 4 bytes or more a head row, each sequence's cache then
# starts on the 256-byte boundary TensorRT wants of a tensor address (a batch engine binds a prefill at its slot)
CAPACITY_ALIGN = 64


COMPILE_FORMAT = 1  # bump when build_engine changes what it compiles (flags, profiles, marks): cached engines rebuild


def check_gpu_archs(archs: tuple[str, ...], precisions: tuple[str, ...]) -> tuple[str, ...]:
    """--gpu-arch, checked before any work -> the architectures, lower case, in GPU_ARCHS' order."""
    archs = tuple(a.strip().lower() for a in archs if a.strip())
    bad = [a for a in archs if a not in GPU_ARCHS]
    if bad:
        hint = " (Hopper data-center GPUs are regular TensorRT's: --backend tensorrt)" if bad[0] == "sm90" else ""
        raise SpecrtError(f"--gpu-arch {bad[0]} is not an architecture TensorRT for RTX compiles for{hint}; use some "
                          f"of {', '.join(GPU_ARCHS)}")
    if not archs:
        raise SpecrtError(f"--gpu-arch is empty; name some of {', '.join(GPU_ARCHS)} (default: "
                          f"{','.join(DEFAULT_GPU_ARCHS)})")
    lacking = [a for a in archs if a not in FP8_ARCHS]
    if "fp8" in precisions and lacking:
        fp8 = ",".join(a for a in archs if a in FP8_ARCHS) or "sm89,sm120"
        raise SpecrtError(f"fp8 needs FP8 tensor cores, which {', '.join(lacking)} lack; build fp8 with --gpu-arch "
                          f"{fp8} (Ada and later), or drop fp8")
    for p in dict.fromkeys(precisions):
        lacking = [a for a in archs if p in ARCH_LACKS.get(a, {})]
        if lacking:
            what = ARCH_LACKS[lacking[0]][p]
            raise SpecrtError(f"{p} does not compile for {', '.join(lacking)} (TensorRT for RTX has no {what} "
                              f"there); build {p} for the other architectures, or Turing engines from fp16 or int8 "
                              f"(e.g. --gpu-arch sm75 --precisions fp16 --draft-precisions fp16)")
    return tuple(a for a in GPU_ARCHS if a in archs)


def require_tensorrt():
    """The tensorrt module, or a one-line SpecrtError naming the package to install."""
    return TENSORRT.require()


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


def local_gpu_arch() -> str:
    """The architecture of this machine's GPU as regular TensorRT's engines are keyed by it (e.g. "sm90"): they run
    only where they were built; a one-line SpecrtError where there is none."""
    cc = compute_capability()
    if cc is None:
        raise SpecrtError("--backend tensorrt found no CUDA device; build TensorRT engines on the GPU that runs them")
    return "sm" + cc.replace(".", "")


def profile_shapes(inputs: dict[str, tuple[int, ...]], seq: tuple[int, int, int], logits: tuple[int, int, int],
                   capacity: tuple[int, int, int], batch: tuple[int, int, int] = (1, 1, 1),
                   ) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The (min, opt, max) shape of every input of a portable decoder network for one profile. inputs: name ->
    the network's shape (-1 where dynamic); seq, logits, capacity, batch: (min, opt, max) of those dims (batch:
    the sequences of one pass, runtime/backends/device/batch.py). A dim the network fixes keeps its size."""
    axes = {name: dims for name, dims, _ in (*PORTABLE_INPUTS, *EAGLE_INPUTS)}  # an EAGLE head: features too
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
                 opt_level: int = 3, fp32_parity: bool = True, timing_cache: Path | None = None,
                 workspace: int = WORKSPACE,
                 max_batch: int = MAX_BATCH, compiler: Compiler = TENSORRT, gpu_archs: tuple[str, ...] = (),
                 name: str | None = None, heads: bool = False) -> dict:
    """Build the engine of the portable graph at onnx_path into out_path (written whole or not at all) -> facts:
    compiler, version, tensorrt (regular TensorRT's version, which the runtime checks), compute_capability (the
    building GPU's) or gpu_archs (ahead of time), profiles, static_capacity (the fixed cache capacity), opt_level,
    tf32, decomposable_attention, build_s, engine_bytes, onnx_sha256 (graph and weights), log (the compiler's log,
    kept beside the engine). max_capacity: the largest cache layout (max_context + max_width), rounded up to
    CAPACITY_ALIGN; fp32_parity: TF32 off; max_batch: sequences per decode pass (prefills run one at a time);
    gpu_archs: TensorRT for RTX's targets (check_gpu_archs; () = its default set); name: the engine's name in
    errors; heads: a Medusa heads graph (its rows, every dynamic dim, 1..max_width in one profile) instead of a
    portable decoder or EAGLE head. A parser or builder failure is one line naming the engine, the node or the
    first error, the ONNX file and the log file."""
    trt = compiler.require()
    name = name or Path(onnx_path).stem
    log_path = Path(str(out_path) + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger = _file_logger(trt, log_path)
    builder = _builder(trt, compiler, logger)
    max_capacity = -(-max_capacity // CAPACITY_ALIGN) * CAPACITY_ALIGN
    network = _parse(trt, builder, logger, onnx_path, max_capacity, compiler, name, log_path)
    decomposable = mark_decomposable(trt, network)
    config = builder.create_builder_config()
    config.builder_optimization_level = opt_level
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    if fp32_parity:
        config.clear_flag(trt.BuilderFlag.TF32)
    if compiler.ahead_of_time:  # our own CUDA-graph capture needs it (TensorRT for RTX 1.2 release notes)
        config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
    if gpu_archs:
        config.num_compute_capabilities = len(gpu_archs)
        for i, arch in enumerate(gpu_archs):
            config.set_compute_capability(getattr(trt.ComputeCapability, arch.upper()), i)
    # nothing is timed without a GPU; a regular build without a cache file times anew
    timing_cache = None if compiler.ahead_of_time or timing_cache is None else Path(timing_cache)
    if timing_cache is not None:
        _use_timing_cache(config, timing_cache)
    ranges = _add_profiles(builder, network, config, max_prompt=max_prompt, max_width=max_width,
                           max_capacity=max_capacity, max_batch=max_batch, heads=heads)
    t0 = time.perf_counter()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise SpecrtError(f"{compiler.label} {trt.__version__} could not build {name} from '{onnx_path}': "
                          f"{logger.first_error() or 'no error reported'}; full log in {log_path}")
    build_s = time.perf_counter() - t0
    _write_atomic(Path(out_path), memoryview(blob))
    if timing_cache is not None:
        _write_atomic(timing_cache, memoryview(config.get_timing_cache().serialize()))
    facts = {"compiler": compiler.backend, "version": trt.__version__}
    facts.update({"gpu_archs": list(gpu_archs or DEFAULT_GPU_ARCHS)} if compiler.ahead_of_time else
                 {"tensorrt": trt.__version__, "compute_capability": compute_capability()})
    return {**facts, "profiles": {k: {dim: list(v) for dim, v in r.items()} for k, r in ranges.items()},
            "static_capacity": max_capacity, "opt_level": opt_level, "tf32": not fp32_parity,
            "decomposable_attention": decomposable, "build_s": round(build_s, 3),
            "engine_bytes": Path(out_path).stat().st_size, "onnx_sha256": onnx_sha256(Path(onnx_path)),
            "log": log_path.name}


def _builder(trt, compiler: Compiler, logger):
    """A TensorRT builder, or the one line saying why none starts (no GPU, or a driver TensorRT cannot use)."""
    try:
        return trt.Builder(logger)
    except Exception as e:
        fix = ("reinstall it: `pip install --force-reinstall 'specrt[tensorrt-rtx]'`" if compiler.ahead_of_time else
               "build TensorRT engines on the machine with the NVIDIA GPU that will run them, or compile them ahead "
               "of time with --backend tensorrt-rtx")
        raise SpecrtError(f"{compiler.label} cannot start a builder ({first_line(e)}); {fix}") from None


def _parse(trt, builder, logger, onnx_path: Path, max_capacity: int, compiler: Compiler, name: str, log_path: Path):
    """The network of the graph at onnx_path, its cache capacity fixed, or one line naming the first parser error."""
    # TensorRT 11 networks are always strongly typed (the flag is kept there, deprecated and ignored)
    strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly is None else 1 << int(strongly))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(fix_capacity(onnx_path, max_capacity), str(onnx_path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        raise SpecrtError(f"{compiler.label} {trt.__version__} cannot parse {name} ('{onnx_path}'): "
                          + (_parser_error(errors[0]) if errors else "no error reported")
                          + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else "")
                          + f"; full log in {log_path}")
    return network


def _use_timing_cache(config, timing_cache: Path) -> None:
    """Start from the timings in the cache file, or anew where it is unreadable or another GPU's."""
    try:
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    except Exception:  # noqa: BLE001 -- an unreadable cache file is only lost timings
        cache = None
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):  # another GPU's: start anew
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _add_profiles(builder, network, config, *, max_prompt: int, max_width: int, max_capacity: int, max_batch: int,
                  heads: bool) -> dict:
    """The optimization profiles (prefill first, then decode: the runtime's profile indices; or the heads' rows)
    added to config -> their ranges by name, as the facts record them."""
    inputs = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    capacity = (max_capacity, max_capacity, max_capacity)
    ranges = {"prefill": {"seq": (1, min(PREFILL_OPT, max_prompt), max_prompt), "num_logits": (1, 1, max_width),
                          "capacity": capacity, "batch": (1, 1, 1)},
              "decode": {"seq": (1, min(DECODE_OPT, max_width), max_width),
                         "num_logits": (1, min(DECODE_OPT, max_width), max_width), "capacity": capacity,
                         "batch": (1, 1, max_batch)}}
    if heads:
        rows = (1, 1, max_width)
        ranges = {"heads": {"rows": rows}}
        shapes = [{k: tuple(tuple(d if d > 0 else rows[i] for d in dims) for i in range(3))
                   for k, dims in inputs.items()}]
    else:
        shapes = [profile_shapes(inputs, r["seq"], r["num_logits"], r["capacity"], r["batch"])
                  for r in ranges.values()]
    for each in shapes:
        profile = builder.create_optimization_profile()
        for input_name, (lo, opt, hi) in each.items():
            profile.set_shape(input_name, lo, opt, hi)
        config.add_optimization_profile(profile)
    return ranges


def mark_decomposable(trt, network) -> int:
    """Mark every fp32 attention of a parsed network decomposable (IAttention.decomposable: TensorRT may split it
    into MatMul/Softmax layers); neither compiler has a dedicated fp32 attention kernel and both refuse such a layer
    otherwise. fp16 attention keeps its dedicated kernel. -> how many were marked."""
    kind = getattr(trt.LayerType, "ATTENTION_OUTPUT", None)
    marked = 0
    for i in range(network.num_layers if kind is not None else 0):
        layer = network.get_layer(i)
        if layer.type != kind:
            continue
        layer.__class__ = trt.IAttentionOutputLayer  # TensorRT's Python way to reach a layer's own interface
        attention = layer.attention
        if attention.get_input(0).dtype == trt.float32:
            attention.decomposable = True
            marked += 1
    return marked


def onnx_sha256(path: Path) -> str:
    """sha256 over an ONNX graph and its external weights (path, then path.data when there is one)."""
    h = hashlib.sha256()
    for f in (path, Path(str(path) + ".data")):
        if f.is_file():
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def _parser_error(e) -> str:
    """One parser error in a line: the node (name and op) and the first line of its description."""
    try:
        node = f"node '{e.node_name()}' ({e.node_operator()}): " if e.node_name() else ""
        return node + first_line(e.desc())
    except AttributeError:  # an older parser's error object
        return first_line(str(e))


def _file_logger(trt, path: Path):
    """A TensorRT logger that writes every message to path (warnings and up; the console stays quiet) and keeps
    the first error for the one-line failure."""

    class FileLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self._file = open(path, "w", encoding="utf-8")

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.WARNING:
                self._file.write(f"[{severity.name}] {msg}\n")
                self._file.flush()
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(msg)

        def first_error(self) -> str | None:
            """The most telling error in a line: the builder's own (its last), without TensorRT's source locations
            and exception names, at most 300 characters."""
            if not self.errors:
                return None
            text = " ".join(self.errors[-1].split())
            text = re.sub(r"\[[^\]]*\.(cpp|h)[^\]]*\]:? ?", "", text)  # [file.cpp:12: fn] locations
            text = re.sub(r" In \w+ at /\S+", "", text)
            text = re.sub(r"Error Code \d+: (\w+) \((.*?)\.?\)?$", r"\1: \2", text)
            for marker in ("Internal Error: ", "MyelinCheckException: ", "IBuilder::buildSerializedNetwork: "):
                text = text.split(marker, 1)[-1]
            return text[:300] + ("..." if len(text) > 300 else "")

    return FileLogger()


def _write_atomic(path: Path, data) -> None:
    """Write to path.part, then rename over path: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
    os.replace(part, path)
