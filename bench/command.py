"""`specrt bench`: the typer command. Only typer at import time, so `specrt --help` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def bench(
    engines_dir: Path = typer.Option(Path("engines/smollm2-135m"), "--engines", "-e", help="Engine set folder."),
    prompts: Optional[Path] = typer.Option(None, "--prompts",
                                           help="JSONL prompt set (see bench/prompts.py); default: the shipped set."),
    out: Path = typer.Option(Path("bench-out"), "--out", help="Folder for results.json, report.md and PNG plots."),
    modes: Optional[str] = typer.Option(None, "--modes",
                                        help="Comma-separated modes: plain-<prec>, <speculate>-<prec> (prompt-lookup, "
                                             "draft, medusa, lookup+medusa, auto), genai-fp32, genai-int4, llamacpp, "
                                             "llamacpp-pld, hf, hf-pld, hf-assisted. Default: all that apply."),
    categories: Optional[str] = typer.Option(None, "--categories",
                                             help="Comma-separated subset of chat,code,summarize,qa,math,translation."),
    reps: int = typer.Option(3, "--reps", help="Repetitions per prompt and mode (tok/s is their median)."),
    threads: int = typer.Option(0, "--threads", help="CPU threads for every contender (0 = all cores)."),
    quick: bool = typer.Option(False, "--quick",
                               help="1 prompt per category, at most 32 new tokens, core modes unless --modes "
                                    "(a few minutes)."),
    per_category: Optional[int] = typer.Option(None, "--per-category", help="Use the first N prompts per category."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Cap every prompt's max_new_tokens."),
    load_order: str = typer.Option("listed", "--load-order",
                                   help="listed (the order of --modes / the default list) or reversed. ONNX Runtime "
                                        "sessions created later in a process can decode up to ~10% faster, so compare "
                                        "two contenders in both orders (docs/design-notes.md, 'Session load order')."),
    isolate: bool = typer.Option(False, "--isolate",
                                 help="Run every contender in a worker process of its own (as a user's process "
                                      "holds one runtime): no load-order effect, nothing shared; calls stay "
                                      "interleaved."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos",
                                    help="Every contender generates exactly each prompt's max_new_tokens, through EOS: "
                                         "tok/s then compares engines at equal lengths (two int4 models stop at "
                                         "different places, and a short answer's tok/s is mostly prefill)."),
    hf_assistant: Optional[Path] = typer.Option(None, "--hf-assistant",
                                                help="HF folder or GGUF of a smaller model with the same vocabulary, "
                                                     "for transformers' assistant_model (hf-assisted)."),
    compare: list[Path] = typer.Option([], "--compare",
                                       help="Another engine set to run side by side (repeatable), e.g. the "
                                            "onnxruntime-portable set; its modes are named <mode>@<folder> "
                                            "(default: its plain modes and auto-fp32)."),
):
    """Benchmark our modes against onnxruntime-genai, llama.cpp and transformers on one prompt set."""
    import shlex
    import sys

    from ..cli import _guard

    def run():
        from ..errors import SpecrtError
        from .prompts import DEFAULT_PROMPTS
        from .report import write
        from .runner import BenchConfig, run_bench

        cats = tuple(c.strip() for c in categories.split(",") if c.strip()) if categories else None
        for name, v in (("--per-category", per_category), ("--max-new-tokens", max_new_tokens)):
            if v is not None and v < 1:
                raise SpecrtError(f"{name} must be >= 1, got {v}")
        if out.exists() and not out.is_dir():  # found before the run, not after twenty minutes of it
            raise SpecrtError(f"--out '{out}' is a file, not a folder; pass a folder (it is created if missing)")
        if hf_assistant is not None and not hf_assistant.exists():
            raise SpecrtError(f"--hf-assistant '{hf_assistant}' not found; pass a HF folder or a .gguf file")
        cfg = BenchConfig(engines=engines_dir, prompts=prompts or DEFAULT_PROMPTS, modes=modes, categories=cats,
                          reps=reps, threads=threads, quick=quick, per_category=per_category,
                          max_new_tokens=max_new_tokens, hf_assistant=hf_assistant, load_order=load_order,
                          ignore_eos=ignore_eos, isolate=isolate, compare=tuple(compare))
        res = run_bench(cfg, log=lambda m: typer.secho(m, err=True, dim=True))
        command = "specrt bench " + shlex.join(sys.argv[1:][1:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
        write(res, out, command)
        for r in res["summary"]:
            if r["category"] == "all":
                typer.echo(f"{r['mode']:>36}: {r['tok_s']:7.1f} tok/s  {r['speedup'] or 0:5.2f}x  "
                           f"identical {r['identical']}" + (f"  drafts: {r['proposer']}" if r["proposer"] else ""))
        for n in res["notes"] + res.get("caveats", []):
            typer.secho(n, err=True, fg=typer.colors.YELLOW)
        typer.echo(f"wrote {out / 'report.md'}")

    _guard(run)
