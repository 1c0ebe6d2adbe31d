"""Portable engines of a set (`specrt engines --backend onnxruntime-portable | onnxruntime-cuda | tensorrt |
tensorrt-rtx`): the portable graph written from the export's own graph (export/portable.py), cached beside the
export, then, for TensorRT, compiled into a serialized engine; linked into the set, checked against PyTorch through
the runtime backend that will run it, and described by its manifest entry (memory included). TensorRT for RTX
compiles ahead of time on a machine that cannot run its engines: its set is built and checked as the portable set
(every check on the very graph compiled, on the CPU), then compile_set turns each target, draft and head into an
engine. Regular TensorRT builds each target and draft on the GPU that runs it before its check, and compile_set
turns the set's heads into engines on that GPU, with the same build.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..backends import BACKENDS, BUILT
from ..errors import SpecrtError
from ..interface import PORTABLE_DTYPES, QDQ_BASE, QDQ_PRECISIONS, portable_io_description
from ..manifest import EngineEntry, engine_memory, file_sha256, tool_versions
from . import checks
from .buildcache import link
from .quality import QDQ_SESSION, build_quantized, measure_quality, require_quality
from .runtime_link import provisional_entry

PORTABLE_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.portable)


def ahead_of_time(backend: str) -> bool:
    """Whether the backend's engines are compiled ahead of time, without a GPU (TensorRT for RTX)."""
    from ..backends import COMPILERS

    compiler = BACKENDS[backend].compiler
    return compiler is not None and COMPILERS[compiler].ahead_of_time


def check_backend(backend: str, precisions: tuple[str, ...], gpu_archs: tuple[str, ...] | None = None) -> tuple:
    """Before any work: the backend is known, its library is here, and it builds these precisions (for these GPU
    architectures, where it compiles ahead of time) -> the architectures to compile for (() where none apply)."""
    b = BACKENDS.get(backend)
    if b is None or not b.precisions:
        raise SpecrtError(f"--backend '{backend}' is not one specrt builds; use one of {', '.join(BUILT)}")
    if gpu_archs is not None and not ahead_of_time(backend):
        raise SpecrtError(f"--gpu-arch is for --backend tensorrt-rtx, which compiles ahead of time; {backend} "
                          "builds for the machine it runs on: drop --gpu-arch")
    if not b.portable:  # ONNX Runtime's contrib-op graphs: their precisions are check_request's (orchestrate.py)
        return ()
    bad = [p for p in precisions if p not in b.precisions]
    if bad:
        raise SpecrtError(f"--backend {backend} builds precisions {', '.join(b.precisions)}, not "
                          f"{', '.join(bad)}; pass e.g. --precisions fp16")
    if b.compiler is not None:
        from ..build.tensorrt import COMPILERS, DEFAULT_GPU_ARCHS, check_gpu_archs

        compiler = COMPILERS[b.compiler]
        compiler.require()
        if compiler.ahead_of_time:
            return check_gpu_archs(DEFAULT_GPU_ARCHS if gpu_archs is None else gpu_archs, precisions)
    elif b.provider is not None:
        import onnxruntime as ort

        if b.provider not in ort.get_available_providers():
            raise SpecrtError(f"--backend {backend} needs onnxruntime-gpu with CUDA, and this onnxruntime "
                              f"has only {', '.join(ort.get_available_providers())}; `pip install onnxruntime-gpu` "
                              "on a machine with an NVIDIA GPU, or build --backend onnxruntime-portable for the CPU")
    return ()


def build_portable_engine(role: str, p: str, cache: Path, facts: dict, tmp: Path, log, backend: str,
                          calibration_texts: int = 32, quality_floor: float | None = None,
                          float_layers: int = 0, float_gemms: tuple[str, ...] = (),
                          outlier_channels: int | None = None) -> EngineEntry:
    """<role>-<p> of a portable set: the portable graph (cached per export and graph format; fp8/int8: its Q/DQ
    form, calibrated, its quality against fp32 measured), compiled for TensorRT where asked, linked into tmp,
    checked -> its manifest entry. outlier_channels: fp8/int8, each activation's input channels kept in float
    (None: the precision's default, build.quantize.DEFAULT_OUTLIERS)."""
    from ..export.portable import FORMAT

    bdir = cache / f"portable-v{FORMAT}"
    fp32_graph = _portable_graph(role, "fp32", cache, facts, log, bdir)  # every precision is measured against it
    build, session_config, quality = {"portable_format": FORMAT}, None, None
    if p == "fp32":
        graph = fp32_graph
    elif p not in QDQ_PRECISIONS:
        graph = _portable_graph(role, p, cache, facts, log, bdir)
    else:
        from ..build.quantize import FORMAT as QDQ_FORMAT
        from ..build.quantize import outliers_for

        outliers = outliers_for(p, outlier_channels)
        mixed = (f"-float{float_layers}" if float_layers else "") + "".join(f"-f{k}" for k in float_gemms) + \
            (f"-out{outliers}" if outliers else "")
        graph = bdir / f"{role}-{p}-q{QDQ_FORMAT}-cal{calibration_texts}{mixed}.onnx"
        if not graph.is_file():
            provisional = provisional_entry(fp32_graph, facts, backend="onnxruntime-portable")
            build_quantized(fp32_graph, graph, p, cache, facts, provisional, log, calibration_texts,
                            float_layers=float_layers, float_gemms=float_gemms, outliers=outliers,
                            base_graph=_portable_graph(role, QDQ_BASE, cache, facts, log, bdir))
        build = {**build, **json.loads(graph.with_suffix(".json").read_text())}
        session_config = dict(QDQ_SESSION)
    if p != "fp32":  # on the CPU, on the very graph a GPU backend compiles
        quality = _measured_quality(graph, fp32_graph, facts, p, cache, log, f"{role}-{p}")
        require_quality(f"{role}-{p}", quality, p, quality_floor)
    files = [graph, Path(str(graph) + ".data")]
    if BACKENDS[backend].compiler is not None and not ahead_of_time(backend):  # on the GPU that runs it
        engine, trt_facts = _tensorrt_engine(graph, facts, log)
        files, build = [engine], {**build, **trt_facts}
    for f in files:
        link(f, tmp / f.name)
    log(f"checking {role}-{p} against PyTorch ({backend})")
    parity = checks.check_engine(tmp / files[0].name, facts, cache / "golden.npz", session_config, backend=backend,
                                 precision=p)
    if p == "fp32":  # fp32 weights and compute must match PyTorch; fp16 engines record their figures
        checks.require_parity(f"{role}-{p}", parity)
    if p in QDQ_PRECISIONS:  # a float difference of 1e-6 can cross a rounding boundary and move a value a whole step
        parity = {**parity, "width_exact": False, "width_note": "Q/DQ rounding amplifies float noise between pass "
                  "widths (docs/design-notes.md, \"Q/DQ engines are not width-exact\")"}
    s = facts["spec"]
    sizes = {k: s[k] for k in ("num_kv_heads", "head_dim", "hidden_size", "vocab_size")}
    inputs, outputs = portable_io_description(sizes, PORTABLE_DTYPES[p])
    entry = EngineEntry(
        name=f"{role}-{p}", role=role, file=files[0].name, files=[f.name for f in files], backend=backend,
        precision=p, num_layers=s["num_layers"], num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"],
        head_dim=s["head_dim"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
        max_context=facts["max_context"], architecture=s["architecture"], inputs=inputs, outputs=outputs,
        source_sha256=facts["source"]["sha256"], parity=parity, build=build, session_config=session_config,
        quality=quality, tokenizer_sha256=file_sha256(cache / "tokenizer.json"),
        build_versions=tool_versions(("specrt", "onnx", "onnxruntime", "tensorrt")))
    return entry.with_memory(engine_memory(entry, tmp))


def _measured_quality(graph: Path, fp32_graph: Path, facts: dict, p: str, cache: Path, log, name: str) -> dict:
    """measure_quality's figures for a cached graph, kept beside it (a build that failed its floor, or one with
    another precision added, does not measure a large model's graphs again)."""
    import onnxruntime as ort

    from .quality import QUALITY_FORMAT

    kept = graph.with_name(f"{graph.stem}.quality-v{QUALITY_FORMAT}-ort{ort.__version__}.json")
    if kept.is_file():
        return json.loads(kept.read_text())
    log(f"measuring {name} against fp32 on held-out text")
    quality = measure_quality(graph, fp32_graph, facts, "onnxruntime-portable", p, cache)
    part = kept.with_name(kept.name + ".part")
    part.write_text(json.dumps(quality))
    os.replace(part, kept)
    return quality


def _portable_graph(role: str, p: str, cache: Path, facts: dict, log, bdir: Path) -> Path:
    """bdir/<role>-<p>.onnx (+ .data), written once: into a temp folder, the weights first, the graph last."""
    from ..export.portable import write_portable

    out = bdir / f"{role}-{p}.onnx"
    if out.is_file():
        return out
    log(f"writing the portable {role} graph at {p}")
    bdir.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=".part-", dir=bdir))
    try:
        write_portable(cache / "model.onnx", facts["spec"], facts["max_context"], p, part / out.name)
        os.replace(part / (out.name + ".data"), str(out) + ".data")
        os.replace(part / out.name, out)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return out


def _tensorrt_engine(graph: Path, facts: dict, log) -> tuple[Path, dict]:
    """The serialized TensorRT engine of a portable graph and its build facts, cached per TensorRT version and GPU
    architecture (an engine runs only where both match)."""
    from ..build.tensorrt import MAX_BATCH, build_engine, local_gpu_arch, require_tensorrt

    trt, arch = require_tensorrt(), local_gpu_arch()
    key = f"trt{trt.__version__}-{arch}-b{MAX_BATCH}"
    out = graph.parent / f"tensorrt-{key}" / (graph.stem + ".engine")
    facts_file = out.with_suffix(".json")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        log(f"building the TensorRT engine {out.name} ({key}); minutes, once per GPU architecture")
        t0 = time.time()
        built = build_engine(graph, out, max_prompt=min(facts["max_context"], 2048), max_width=64,
                             max_capacity=facts["max_context"] + 64, timing_cache=graph.parent / "tensorrt.cache")
        facts_file.write_text(json.dumps({**built, "build_seconds": round(time.time() - t0, 1)}))
    return out, json.loads(facts_file.read_text())


def compile_set(tmp: Path, backend: str, gpu_archs: tuple[str, ...] | None, cache_root: Path, log) -> None:
    """The set in tmp -> the `backend` set: every target, draft, Medusa heads and EAGLE head graph still in ONNX
    compiled by the backend's compiler through one build (build_engine), ahead of time for gpu_archs (TensorRT for
    RTX: the whole set, built, checked and measured on the CPU as the portable set) or on this GPU for its
    architecture (regular TensorRT: the heads; its targets and drafts are engines already, built on it before their
    checks). Engines are cached under cache_root by the graph's sha256, the compiler, its version, the recipe and
    the architectures; each entry's ONNX files are replaced by its engine, the entry recording what was compiled.
    A parser or builder failure is one line naming the engine, and nothing of the set is kept."""
    from ..build.tensorrt import COMPILE_FORMAT, COMPILERS, MAX_BATCH, build_engine, local_gpu_arch, onnx_sha256

    compiler = COMPILERS[BACKENDS[backend].compiler]
    trt = compiler.require()
    aot = compiler.ahead_of_time
    archs = tuple(gpu_archs or ()) if aot else (local_gpu_arch(),)  # an engine runs only on what it was built for
    folder = cache_root / f"{compiler.backend}-{trt.__version__}-c{COMPILE_FORMAT}-{'-'.join(archs)}-b{MAX_BATCH}"
    where = f"for {', '.join(archs)}" if aot else f"on this GPU ({archs[0]})"
    path = tmp / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, e in manifest["engines"].items():
        if e["role"] not in ("target", "draft", "medusa", "eagle") or e["file"].endswith(".engine"):
            continue
        graph = tmp / e["file"]
        out = folder / f"{name}-{onnx_sha256(graph)[:16]}.engine"
        facts_file = out.with_suffix(".json")
        if not (out.is_file() and facts_file.is_file()):
            log(f"compiling {name} with {compiler.label} {trt.__version__} {where}")
            built = build_engine(graph, out, max_prompt=min(e["max_context"], 2048), max_width=64,
                                 max_capacity=e["max_context"] + 64, compiler=compiler, gpu_archs=archs if aot else (),
                                 name=name, heads=e["role"] == "medusa",
                                 timing_cache=None if aot else folder / "tensorrt.cache")
            part = facts_file.with_name(facts_file.name + ".part")
            part.write_text(json.dumps(built))
            os.replace(part, facts_file)
        built = json.loads(facts_file.read_text())
        log(f"{name}: {built['engine_bytes'] / 2**20:.0f} MiB engine, compiled in {built['build_s']:.0f} s")
        for f in e["files"]:
            (tmp / f).unlink()
        engine = f"{name}.engine"
        link(out, tmp / engine)
        e.update(backend=backend, file=engine, files=[engine],
                 build={**(e.get("build") or {}), **{k: v for k, v in built.items() if k != "log"}},
                 build_versions={**(e.get("build_versions") or {}), compiler.backend: trt.__version__})
        if "parity" in e:
            e["parity"] = {**e["parity"], "checked_on": "onnxruntime-portable, the graph compiled (on the CPU)"}
        e.pop("session_config", None)
        e["memory"] = engine_memory(EngineEntry.from_dict(name, e), tmp)
    path.write_text(json.dumps(manifest, indent=1))
