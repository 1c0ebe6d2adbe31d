"""make_engine_set: source -> engines/<name>/ (export, build, check, manifest), atomically.

Steps whose inputs did not change are skipped: exports are cached under engines/.cache keyed by
the source fingerprint and export options; built engines are cached next to their export; an
engine set whose manifest already records the same inputs is left as it is. The set is written
to a temp folder beside the target and renamed into place, so a failure leaves nothing half-written.
This module validates the request, keys and caches the export and drives the other pipeline modules.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ..backends import BACKENDS
from ..errors import SpecrtError
from ..interface import ACTIVATION_QDQ, QDQ_PRECISIONS
from ..manifest import SCHEMA_VERSION, file_sha256, load_manifest, manifest_dict, tool_versions
from .buildcache import one_build_at_a_time, swap_into_place
from .engines import build_engine, chat_template
from .portable import PORTABLE_BACKENDS, ahead_of_time, build_portable_engine, check_backend, compile_set
from .tree_sizing import TREE_COSTS, build_medusa

EXPORT_FORMAT = 3  # bump when export/ changes what it writes: the graph, or export.json's facts (3: stop ids)
MIN_CONTEXT = 64    # the export's parity check decodes a ~16-token golden prompt + 32 tokens


@dataclass(frozen=True)
class EngineSetRequest:
    source: str
    name: str
    precisions: tuple[str, ...] = ("fp32",)
    max_context: int = 4096
    out_root: Path = Path("engines")
    draft_source: str | None = None  # a smaller model with the same tokenizer: entries draft-<prec>
    draft_precisions: tuple[str, ...] = ("fp32",)
    medusa_heads: Path | None = None  # a heads file from `specrt train-medusa`: entry medusa-fp32
    medusa_tree_nodes: int = 0        # 0 = the size that maximises expected tokens per measured pass second
    eagle_head: Path | None = None    # an EAGLE head file from `specrt train-eagle`: entry eagle-int8
                                      # (eagle-fp32 where the head runs on the GPU: pipeline/eagle.py on_gpu)
    backend: str = "onnxruntime"      # or onnxruntime-portable | onnxruntime-cuda | tensorrt | tensorrt-rtx
    calibration_texts: int = 32       # fp8/int8 portable engines: packaged texts their activations are calibrated on
    quality_floor: float | None = None  # Q/DQ: the least top-1 agreement with fp32 on held-out text a build keeps
    #                                     (None: by precision, quality.DEFAULT_FLOORS)
    float_layers: int = 0             # Q/DQ targets: the first and last this many layers keep their GEMMs in float
    float_gemms: tuple[str, ...] = ()  # Q/DQ targets: every layer's GEMMs of these kinds (qkv, o, gateup, down) too
    outlier_channels: int | None = None  # fp8/int8 targets: input channels per activation kept in float (None:
    #                                      build.quantize.DEFAULT_OUTLIERS)
    gpu_archs: tuple[str, ...] | None = None  # tensorrt-rtx: the GPU architectures to compile for (None: its default)


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]specrt[/] {msg}")


def check_destination(out_root: Path, name: str) -> None:
    """An engine set goes to out_root/name: out_root a folder (created if missing), name one plain folder name."""
    if out_root.exists() and not out_root.is_dir():
        raise SpecrtError(f"--out '{out_root}' is a file, not a folder; pass a folder (it is created if missing)")
    if not name or name in (".", "..") or name.startswith(".") or any(c in name for c in "/\\"):
        raise SpecrtError(f"engine set name '{name}' is not a plain folder name (no '/', '\\', '..' or leading '.', "
                          "which is kept for the build cache); pass e.g. --name mymodel")


def make_engine_set(req: EngineSetRequest, log=_say) -> Path:
    """Export (cached per source, context and tool versions), build every requested engine, write the
    manifest, and move the set into req.out_root / req.name in one rename -> that path. Validates the
    request before any work; skips everything when the set there was built from the same inputs and still
    loads; one build per out_root at a time. Errors are one-line SpecrtErrors and leave no partial set."""
    from ..build.ort import build_key, precision
    from ..export.sources import check_family, fingerprint, resolve, vocab_size

    check_destination(Path(req.out_root), req.name)
    built = req.precisions + (req.draft_precisions if req.draft_source else ())
    # before any work: a missing library, precision or architecture is one line
    req = replace(req, gpu_archs=check_backend(req.backend, built, req.gpu_archs) or None)
    portable = req.backend in PORTABLE_BACKENDS
    for p in ([] if portable else built):
        precision(p)
    if req.outlier_channels and not (portable and any(p in ACTIVATION_QDQ for p in req.precisions)):
        raise SpecrtError("--outlier-channels applies to fp8 and int8 targets of the portable backends "
                          f"({', '.join(PORTABLE_BACKENDS)}); add one to --precisions, or drop it")
    if portable and any(p in QDQ_PRECISIONS for p in built):
        if req.calibration_texts < 1:
            raise SpecrtError(f"--calibration-texts {req.calibration_texts} calibrates nothing; use at least 1 "
                              "(default 32)")
        if req.float_layers < 0:
            raise SpecrtError(f"--float-layers {req.float_layers} is negative; use 0 (every layer quantized) or more")
        from ..build.quantize import check_float_gemms

        check_float_gemms(req.float_gemms)
        if req.outlier_channels is not None and req.outlier_channels < 0:
            raise SpecrtError(f"--outlier-channels {req.outlier_channels} is negative; use 0 (every channel "
                              "quantized) or more")
        if req.quality_floor is not None and not 0.0 <= req.quality_floor <= 1.0:
            raise SpecrtError(f"--quality-floor {req.quality_floor} is not a share of tokens; use 0-1 (default: "
                              "0.85, int4-awq 0.70)")
    if req.max_context < MIN_CONTEXT:
        raise SpecrtError(f"--max-context {req.max_context} is too small; use at least {MIN_CONTEXT} (default 4096)")
    src = resolve(req.source)
    dsrc = resolve(req.draft_source) if req.draft_source else None
    for source in (src, dsrc):  # the family and its features from config.json, before fingerprinting the weights
        if source is not None:
            check_family(source)
    if dsrc is not None:  # from the configs, before minutes of export; the tokenizers are compared after it
        _check_same_vocab(req, vocab_size(src), vocab_size(dsrc))
    final = req.out_root / req.name
    log(f"fingerprinting {src.path.name}")
    fp = fingerprint(src)

    if portable:
        from ..build.quantize import FORMAT as QDQ_FORMAT
        from ..export.portable import FORMAT

        from .quality import DRAFTING_FORMAT

        recipes = [req.backend, FORMAT, QDQ_FORMAT, req.calibration_texts, req.quality_floor, DRAFTING_FORMAT,
                   req.float_layers, sorted(req.float_gemms), req.outlier_channels]
        if BACKENDS[req.backend].compiler is not None:  # by this compiler and recipe, for these architectures
            from ..build.tensorrt import COMPILE_FORMAT, COMPILERS, local_gpu_arch

            recipes += [list(req.gpu_archs or (local_gpu_arch(),)),
                        COMPILERS[BACKENDS[req.backend].compiler].require().__version__, COMPILE_FORMAT]
    else:
        recipes = sorted(build_key(precision(p)) for p in built)  # a changed recipe (or ORT version) rebuilds
    tools = _export_tools()
    key = [fp, sorted(req.precisions), req.max_context, EXPORT_FORMAT, tools, recipes, SCHEMA_VERSION]
    if dsrc is not None:
        log(f"fingerprinting {dsrc.path.name}")
        dfp = fingerprint(dsrc)
        key += [dfp, sorted(req.draft_precisions)]
    if req.medusa_heads is not None:
        if not Path(req.medusa_heads).is_file():
            raise SpecrtError(f"Medusa heads file '{req.medusa_heads}' not found; train it with `make heads`")
        from ..export.medusa import HEADS_ENGINE
        from ..export.medusa_tree import TREE_TOLERANCE

        key += [file_sha256(Path(req.medusa_heads)), req.medusa_tree_nodes, TREE_TOLERANCE, TREE_COSTS, HEADS_ENGINE]
    if req.eagle_head is not None:
        if not Path(req.eagle_head).is_file():
            raise SpecrtError(f"EAGLE head file '{req.eagle_head}' not found; train it with `specrt train-eagle`")
        from ..export.eagle import EAGLE_FORMAT
        from .eagle import check_head

        check_head(Path(req.eagle_head))
        key += [file_sha256(Path(req.eagle_head)), EAGLE_FORMAT, TREE_COSTS]
    inputs_key = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    with one_build_at_a_time(Path(req.out_root), log):
        if _up_to_date(final, inputs_key):
            log(f"{final} is up to date")
            return final
        return _make(req, final, inputs_key, fp, dfp if dsrc is not None else None, src, dsrc, tools, log)


def _make(req: EngineSetRequest, final: Path, inputs_key: str, fp: str, dfp: str | None, src, dsrc, tools: str,
          log) -> Path:
    cache = req.out_root / ".cache" / f"export-{fp[:16]}-ctx{req.max_context}-v{EXPORT_FORMAT}-t{tools}"
    facts = _cached_export(src, cache, req.max_context, log)
    roles = [("target", cache, facts, req.precisions)]
    if dsrc is not None:
        dcache = req.out_root / ".cache" / f"export-{dfp[:16]}-ctx{req.max_context}-v{EXPORT_FORMAT}-t{tools}"
        roles.append(("draft", dcache, _cached_export(dsrc, dcache, req.max_context, log), req.draft_precisions))
        _check_same_tokenizer(req, cache, dcache, facts, roles[1][2])
    req.out_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{req.name}-", dir=req.out_root))
    tmp.chmod(0o755)
    # an ahead-of-time compiler's set is built and checked as the portable set, then compiled (compile_set)
    backend = "onnxruntime-portable" if req.backend in PORTABLE_BACKENDS and ahead_of_time(req.backend) \
        else req.backend
    try:
        engines = {}
        for role, rcache, rfacts, precs in roles:
            mixed = dict(float_layers=req.float_layers, float_gemms=req.float_gemms,
                         outlier_channels=req.outlier_channels) if role == "target" else {}
            for p in precs:
                engines[f"{role}-{p}"] = (build_portable_engine(role, p, rcache, rfacts, tmp, log, backend,
                                                                req.calibration_texts, req.quality_floor, **mixed)
                                          if req.backend in PORTABLE_BACKENDS
                                          else build_engine(role, p, rcache, rfacts, tmp, log))
        if req.medusa_heads is not None:
            engines["medusa-fp32"] = build_medusa(Path(req.medusa_heads), cache, facts, tmp, log,
                                                  req.medusa_tree_nodes, engines, backend)
            if req.backend in PORTABLE_BACKENDS and "target-fp32" in engines:  # heads at the set's Q/DQ precisions
                from .quality import build_quantized_heads

                for p in (p for p in req.precisions if p in QDQ_PRECISIONS):
                    engines[f"medusa-{p}"] = build_quantized_heads(p, engines["medusa-fp32"], Path(req.medusa_heads),
                                                                   engines["target-fp32"], cache, facts, tmp, log,
                                                                   req.calibration_texts)
        if req.eagle_head is not None:
            from .eagle import build_eagle, on_gpu

            entry = build_eagle(Path(req.eagle_head), cache, facts, tmp, log, engines,
                                backend=backend if on_gpu(req.backend) else None)
            engines[entry.name] = entry
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(cache / f, tmp / f)
        manifest = manifest_dict(
            name=req.name, inputs_key=inputs_key, source=facts["source"], export_parity=facts["parity"],
            versions=facts["versions"], tokenizer_sha256=file_sha256(tmp / "tokenizer.json"),
            chat_template=chat_template(cache), bos_token=facts["bos_token"], eos_token_ids=facts["eos_token_ids"],
            engines=engines)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if req.backend in PORTABLE_BACKENDS and "target-fp32" in engines:
            _measure_drafts(tmp, manifest, log)
        if BACKENDS[req.backend].compiler is not None:  # what is still ONNX (regular TensorRT: the heads)
            compile_set(tmp, req.backend, req.gpu_archs, req.out_root / ".cache" / "compiled", log)
        swap_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {final}")
    return final


def _measure_drafts(tmp: Path, manifest: dict, log) -> None:
    """Every draft and heads engine's tau and acceptance by position for the fp32 target, in its quality
    (quality.py)."""
    from .quality import draft_acceptance, heads_acceptance

    for name, e in manifest["engines"].items():
        measure = {"draft": draft_acceptance, "medusa": heads_acceptance}.get(e["role"])
        if measure is not None:
            log(f"measuring {name}'s acceptance for target-fp32")
            e["quality"] = {**(e.get("quality") or {}), "drafting": measure(tmp, "target-fp32", name)}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _export_tools() -> str:
    """Short hash of the versions that shape an export (torch runs the golden pass, transformers converts
    the checkpoint and GGUF files, onnx writes the graph): an upgrade re-exports instead of reusing."""
    packages = ("torch", "transformers", "gguf", "onnx")
    found = tool_versions(packages)
    versions = {pkg: found.get(pkg) for pkg in packages}   # None = not installed
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:8]


def _up_to_date(final: Path, inputs_key: str) -> bool:
    """The set at final was built from these inputs and still loads: every file its manifest lists is there
    and its tokenizer is the recorded one (a set missing a file is rebuilt, as the load error tells users)."""
    try:
        return load_manifest(final).raw.get("inputs_key") == inputs_key
    except SpecrtError:
        return False


def source_name(source: str) -> str:
    """What an engine set or a heads file made from `source` is called by default: an embedded name as it
    is, a model folder or .gguf file by its file name (lower case)."""
    return source if "/" not in source and not source.endswith(".gguf") else Path(source).stem.lower()


def default_heads(source: str) -> Path | None:
    """The committed heads for an embedded default (heads/<name>.npz beside the package), if any."""
    path = Path(__file__).resolve().parents[2] / "heads" / f"{source}.npz"
    return path if path.is_file() else None


def default_eagle(source: str) -> Path | None:
    """The committed EAGLE head for an embedded default (heads/<name>-eagle.npz beside the package), if any."""
    path = Path(__file__).resolve().parents[2] / "heads" / f"{source}-eagle.npz"
    return path if path.is_file() else None


def _check_same_vocab(req, tv: int | None, dv: int | None) -> None:
    if tv is not None and dv is not None and tv != dv:
        raise SpecrtError(f"draft '{req.draft_source}' has vocabulary size {dv}, target '{req.source}' has {tv}; "
                          "choose a draft from the target's model family (same tokenizer)")


def _check_same_tokenizer(req, cache: Path, dcache: Path, facts: dict, dfacts: dict) -> None:
    """Speculation compares token ids: the draft must share the target's tokenizer exactly."""
    _check_same_vocab(req, facts["spec"]["vocab_size"], dfacts["spec"]["vocab_size"])
    th, dh = file_sha256(cache / "tokenizer.json"), file_sha256(dcache / "tokenizer.json")
    if th != dh:
        raise SpecrtError(f"draft '{req.draft_source}' and target '{req.source}' use different tokenizers "
                          f"(sha256 {dh[:12]}… vs {th[:12]}…); choose a draft with the target's tokenizer")


def _cached_export(src, cache: Path, max_context: int, log) -> dict:
    from ..export.exporter import export_checkpoint

    if (cache / "export.json").is_file():
        log(f"export cached in {cache}")
        return json.loads((cache / "export.json").read_text())
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=cache.parent))
    try:
        facts = export_checkpoint(src, tmp, max_context, log=log)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return facts
