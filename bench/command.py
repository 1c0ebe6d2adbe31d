"""`specrt bench`: the typer command. Only typer at import time, so `specrt --help` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


BENCH_HELP = {
    "--prompts": "JSONL prompt set (see bench/prompts.py); default: the shipped set.",
    "--out": "Folder for results.json, report.md and PNG plots.",
    "--modes": "Comma-separated modes: plain-<prec>, <speculate>-<prec> (prompt-lookup, draft, medusa, lookup+medusa, "
               "auto), genai-fp32, genai-int4, llamacpp, llamacpp-pld, hf, hf-pld, hf-assisted. Default: all that "
               "apply.",
    "--categories": "Comma-separated subset of chat,code,summarize,qa,math,translation.",
    "--reps": "Repetitions per prompt and mode (tok/s is their median).",
    "--quick": "1 prompt per category, at most 32 new tokens, core modes unless --modes (a few minutes).",
    "--load-order": "listed (the order of --modes / the default list) or reversed. ONNX Runtime sessions created "
                    "later in a process can decode faster, so compare two contenders in both orders "
                    "(docs/design-notes.md, 'Session load order').",
    "--isolate": "Run every contender in a worker process of its own (as a user's process holds one runtime): no "
                 "load-order effect, nothing shared; calls stay interleaved.",
    "--ignore-eos": "Every contender generates exactly each prompt's max_new_tokens, through EOS: tok/s then compares "
                    "engines at equal lengths (two int4 models stop at different places, and a short answer's tok/s "
                    "is mostly prefill).",
    "--hf-assistant": "HF folder or GGUF of a smaller model with the same vocabulary, for transformers' "
                      "assistant_model (hf-assisted).",
    "--repeat-calls": "Also run the workloads that repeat (bench/repeat.py): a voice-agent script of N calls (30+ "
                      "shows how a suffix store warms up) and a code-edit loop, for plain and every speculation mode "
                      "of --modes at fp32; tok/s per call, tau and drafted rounds in the report (0 = off).",
    "--compare": "Another engine set to run side by side (repeatable), e.g. the onnxruntime-portable set; its modes "
                 "are named <mode>@<folder> (default: its plain modes and auto-fp32).",
}


def bench(
    engines_dir: Path = typer.Option(Path("engines/smollm2-135m"), "--engines", "-e", help="Engine set folder."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help=BENCH_HELP["--prompts"]),
    out: Path = typer.Option(Path("bench-out"), "--out", help=BENCH_HELP["--out"]),
    modes: Optional[str] = typer.Option(None, "--modes", help=BENCH_HELP["--modes"]),
    categories: Optional[str] = typer.Option(None, "--categories", help=BENCH_HELP["--categories"]),
    reps: int = typer.Option(3, "--reps", help=BENCH_HELP["--reps"]),
    threads: int = typer.Option(0, "--threads", help="CPU threads for every contender (0 = all cores)."),
    quick: bool = typer.Option(False, "--quick", help=BENCH_HELP["--quick"]),
    per_category: Optional[int] = typer.Option(None, "--per-category", min=1,
                                               help="Use the first N prompts per category."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="Cap every prompt's max_new_tokens."),
    load_order: str = typer.Option("listed", "--load-order", help=BENCH_HELP["--load-order"]),
    isolate: bool = typer.Option(False, "--isolate", help=BENCH_HELP["--isolate"]),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help=BENCH_HELP["--ignore-eos"]),
    hf_assistant: Optional[Path] = typer.Option(None, "--hf-assistant", help=BENCH_HELP["--hf-assistant"]),
    repeat_calls: int = typer.Option(0, "--repeat-calls", metavar="N", min=0, help=BENCH_HELP["--repeat-calls"]),
    compare: list[Path] = typer.Option([], "--compare", help=BENCH_HELP["--compare"]),
):
    """Benchmark our modes against onnxruntime-genai, llama.cpp and transformers on one prompt set."""
    import shlex
    import sys

    from ..errors import SpecrtError
    from ..manifest import load_manifest
    from .prompts import DEFAULT_PROMPTS
    from .report import write
    from .runner import BenchConfig, run_bench

    cats = tuple(c.strip() for c in categories.split(",") if c.strip()) if categories else None
    if out.exists() and not out.is_dir():  # found before the run, not after twenty minutes of it
        raise SpecrtError(f"--out '{out}' is a file, not a folder; pass a folder (it is created if missing)")
    if hf_assistant is not None and not hf_assistant.exists():
        raise SpecrtError(f"--hf-assistant '{hf_assistant}' not found; pass a HF folder or a .gguf file")
    cfg = BenchConfig(engines=engines_dir, prompts=prompts or DEFAULT_PROMPTS, modes=modes, categories=cats,
                      reps=reps, threads=threads, quick=quick, per_category=per_category,
                      max_new_tokens=max_new_tokens, hf_assistant=hf_assistant, load_order=load_order,
                      ignore_eos=ignore_eos, isolate=isolate, compare=tuple(compare))
    manifest = load_manifest(engines_dir)  # once: the bench and the repeat workloads' modes read it
    res = run_bench(cfg, log=lambda m: typer.secho(m, err=True, dim=True), manifest=manifest)
    if repeat_calls:
        from .contenders import our_modes, spec_modes
        from .repeat import run as run_repeat

        ours = our_modes(manifest)  # name -> (strategy, precision), never split by hand
        spec = ["off"] + [s for s, p in (ours[m] for m in res["modes"] if m in ours)
                          if p == "fp32" and s in spec_modes()]
        res["repeat"] = run_repeat(manifest, spec, repeat_calls, min(8, max(1, repeat_calls // 4)),
                                   96, min(10, repeat_calls), log=lambda m: typer.secho(m, err=True, dim=True))
    command = "specrt bench " + shlex.join(sys.argv[1:][1:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    write(res, out, command)
    for r in res["summary"]:
        if r["category"] == "all":
            typer.echo(f"{r['mode']:>36}: {r['tok_s']:7.1f} tok/s  {r['speedup'] or 0:5.2f}x  "
                       f"identical {r['identical']}" + (f"  drafts: {r['proposer']}" if r["proposer"] else ""))
    for n in res["notes"] + res.get("caveats", []):
        typer.secho(n, err=True, fg=typer.colors.YELLOW)
    typer.echo(f"wrote {out / 'report.md'}")


SERVE_HELP = {
    "--engines": "Engine set: bench-serve launches `specrt serve` on it (a free loopback port) and, before that, runs "
                 "the in-process baseline.",
    "--url": "A running OpenAI-compatible server to drive too, as URL or NAME=URL, e.g. --url "
             "vllm=http://127.0.0.1:8000 (repeatable).",
    "--llamacpp": "Also launch llama-cpp-python's server on the GGUF the --engines set was built from, and drive it "
                  "with the same load (needs llama-cpp-python with its server extra).",
    "--in-process/--no-in-process": "With --engines: first run the single-stream prompts in this process "
                                    "(load(...).stream(...)), the baseline of the server-overhead figures.",
    "--overhead-reps": "Run the single-stream pair (in-process baseline, then `specrt serve` at C=1) this many times, "
                       "interleaved, and judge the server-overhead goals on the medians; the other loads run once.",
    "--concurrency": "Comma-separated concurrencies: C clients in a closed loop, each sending the next prompt when "
                     "its answer has ended.",
    "--num-prompts": "Prompts of the set, taken one category after another (12 = 2 of each).",
    "--prompts": "JSONL prompt set (bench/prompts.py); default: the shipped set.",
    "--ignore-eos/--no-ignore-eos": "Send ignore_eos (ours and vLLM honour it: every answer is exactly --max-tokens "
                                    "long; llama-cpp-python ignores it).",
    "--min-tokens": "Also send min_tokens = --max-tokens: llama-cpp-python's way through EOS (a Python logits "
                    "processor on every token: equal lengths, but it slows that server by ~0.5 ms a token on 2 "
                    "cores).",
    "--conversations": "Multi-turn conversations (a ~320-token system prompt, 5 user turns, the whole history resent "
                       "each turn); 0 = none.",
    "--speculate": "For the launched `specrt serve` and the baseline.",
    "--precision": "For the launched `specrt serve` and the baseline.",
    "--threads": "CPU threads of every server launched here and of the baseline (0 = all cores).",
    "--serve-args": "More options for the launched `specrt serve`, e.g. --serve-args '--cache-ram 0'.",
    "--llamacpp-args": "More options for the launched llama-cpp-python server, e.g. --llamacpp-args '--n_batch 256'.",
    "--health-timeout": "Seconds a --url server has to answer GET /health (or /v1/models).",
    "--start-timeout": "Seconds a launched server has to load and answer /health.",
    "--voice": "Run the voice workload instead of the loads above: phone calls of 4+ turns on one system prompt "
               "(--voice-workload), every server up at once, the calls alternating between them; time to first token "
               "and to first sentence, decode tok/s, turn 1 and turns 2+ (docs/voice.md).",
    "--voice-workload": "The voice workload's JSON file (default: the shipped clinic phone assistant, "
                        "bench/data/voice-clinic.json).",
    "--calls": "--voice: calls made on every server (the file's, cycled).",
    "--ours": "--voice: our servers as PRECISION:SPECULATE entries, e.g. fp32:auto,int4:auto (default: "
              "--precision:--speculate).",
    "--llama-server": "--voice: also llama.cpp's llama-server (built once by `make peers`, cached), at its defaults "
                      "and in its best speculative mode on the workload; skipped with one line if it cannot be built "
                      "or started.",
    "--llama-gguf": "llama-server's model (default: the GGUF the set was built from).",
    "--llama-draft": "A draft model's GGUF: llama-server's -md --spec-type draft-simple is tried too.",
    "--llama-spec-types": "llama-server's speculative modes to try (default: ngram-simple, ngram-map-k, "
                          "ngram-map-k4v, ngram-mod, and draft-simple with --llama-draft); one mode is taken without "
                          "a probe call.",
    "--out": "Folder for results.json, report.md, latency.png, multiturn.png and the launched servers' logs.",
}


def bench_serve(
    engines_dir: Optional[Path] = typer.Option(None, "--engines", "-e", help=SERVE_HELP["--engines"]),
    url: list[str] = typer.Option([], "--url", metavar="URL", help=SERVE_HELP["--url"]),
    llamacpp: bool = typer.Option(False, "--llamacpp", help=SERVE_HELP["--llamacpp"]),
    in_process: bool = typer.Option(True, "--in-process/--no-in-process",
                                    help=SERVE_HELP["--in-process/--no-in-process"]),
    overhead_reps: int = typer.Option(1, "--overhead-reps", help=SERVE_HELP["--overhead-reps"]),
    concurrency: str = typer.Option("1,2,4,8", "--concurrency", help=SERVE_HELP["--concurrency"]),
    num_prompts: int = typer.Option(12, "--num-prompts", help=SERVE_HELP["--num-prompts"]),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help=SERVE_HELP["--prompts"]),
    max_tokens: int = typer.Option(128, "--max-tokens", help="max_tokens of every prompt-set request."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help=SERVE_HELP["--ignore-eos/--no-ignore-eos"]),
    min_tokens: bool = typer.Option(False, "--min-tokens", help=SERVE_HELP["--min-tokens"]),
    conversations: int = typer.Option(2, "--conversations", help=SERVE_HELP["--conversations"]),
    turn_max_tokens: int = typer.Option(48, "--turn-max-tokens", help="max_tokens of each multi-turn answer."),
    speculate: str = typer.Option("auto", "--speculate", help=SERVE_HELP["--speculate"]),
    precision: str = typer.Option("fp32", "--precision", help=SERVE_HELP["--precision"]),
    threads: int = typer.Option(0, "--threads", help=SERVE_HELP["--threads"]),
    serve_args: str = typer.Option("", "--serve-args", help=SERVE_HELP["--serve-args"]),
    llamacpp_args: str = typer.Option("", "--llamacpp-args", help=SERVE_HELP["--llamacpp-args"]),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Bearer key for the --url servers."),
    health_timeout: float = typer.Option(10.0, "--health-timeout", help=SERVE_HELP["--health-timeout"]),
    start_timeout: float = typer.Option(300.0, "--start-timeout", help=SERVE_HELP["--start-timeout"]),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds one request may take."),
    voice: bool = typer.Option(False, "--voice", help=SERVE_HELP["--voice"]),
    voice_workload: Optional[Path] = typer.Option(None, "--voice-workload", help=SERVE_HELP["--voice-workload"]),
    calls: int = typer.Option(8, "--calls", help=SERVE_HELP["--calls"]),
    ours: str = typer.Option("", "--ours", help=SERVE_HELP["--ours"]),
    llama_server: bool = typer.Option(False, "--llama-server", help=SERVE_HELP["--llama-server"]),
    llama_gguf: Optional[Path] = typer.Option(None, "--llama-gguf", help=SERVE_HELP["--llama-gguf"]),
    llama_draft: Optional[Path] = typer.Option(None, "--llama-draft", help=SERVE_HELP["--llama-draft"]),
    llama_spec_types: str = typer.Option("", "--llama-spec-types", help=SERVE_HELP["--llama-spec-types"]),
    llama_server_args: str = typer.Option("", "--llama-server-args",
                                          help="More options for every launched llama-server."),
    out: Path = typer.Option(Path("bench-out/serve"), "--out", help=SERVE_HELP["--out"]),
):
    """Load-test OpenAI-compatible servers: TTFT, TPOT, inter-token latency p50/p90/p99, end-to-end, tok/s and
    cached tokens, on the prompt set at each --concurrency and on multi-turn conversations.

    Servers run one at a time: the --url ones, then `specrt serve` on --engines, then (with --llamacpp)
    llama-cpp-python's server on the same GGUF. Every request is streamed (SSE), greedy.

    Example: specrt bench-serve --engines engines/smollm2-135m --llamacpp
    """
    import shlex
    import sys

    from .prompts import DEFAULT_PROMPTS
    from .serve_load import ServeBenchConfig, parse_concurrency, run as run_load
    from .serve_report import write
    from .voice import DEFAULT_WORKLOAD, parse_ours

    _check_serve(out, health_timeout, start_timeout, request_timeout)
    cfg = ServeBenchConfig(engines=engines_dir, urls=tuple(url), llamacpp=llamacpp, in_process=in_process,
                           overhead_reps=overhead_reps, prompts=prompts or DEFAULT_PROMPTS,
                           num_prompts=num_prompts,
                           concurrency=parse_concurrency(concurrency), max_tokens=max_tokens,
                           conversations=conversations, turn_max_tokens=turn_max_tokens, ignore_eos=ignore_eos,
                           min_tokens=min_tokens, speculate=speculate, precision=precision, threads=threads,
                           api_key=api_key, health_timeout_s=health_timeout, start_timeout_s=start_timeout,
                           request_timeout_s=request_timeout, serve_args=_split("--serve-args", serve_args),
                           llamacpp_args=_split("--llamacpp-args", llamacpp_args),
                           voice=(voice_workload or DEFAULT_WORKLOAD) if voice or voice_workload else None,
                           voice_calls=calls,
                           ours=tuple(parse_ours(ours)), llama_server=llama_server, llama_gguf=llama_gguf,
                           llama_draft=llama_draft,
                           llama_modes=tuple(x.strip() for x in llama_spec_types.split(",") if x.strip()),
                           llama_server_args=_split("--llama-server-args", llama_server_args))
    argv = sys.argv[1:][1:] if sys.argv[1:2] == ["bench-serve"] else sys.argv[1:]
    if cfg.voice is not None:
        return _voice(cfg, out, "specrt bench-serve " + shlex.join(argv))
    res = run_load(cfg, log=lambda m: typer.secho(m, err=True, dim=True))
    write(res, out, "specrt bench-serve " + shlex.join(argv))
    _print_load(res)
    typer.echo(f"wrote {out / 'report.md'}")


def _check_serve(out: Path, health_timeout: float, start_timeout: float, request_timeout: float) -> None:
    """bench-serve's flags that would fail only after the first loads: one line each, now."""
    from ..errors import SpecrtError

    if out.exists() and not out.is_dir():
        raise SpecrtError(f"--out '{out}' is a file, not a folder; pass a folder (it is created if missing)")
    for flag, v in (("--health-timeout", health_timeout), ("--start-timeout", start_timeout),
                    ("--request-timeout", request_timeout)):
        if not v > 0:
            raise SpecrtError(f"{flag} must be > 0 seconds, got {v}")


def _split(flag: str, text: str) -> tuple[str, ...]:
    """--serve-args and the like: the options a launched server gets, split as a shell would."""
    import shlex

    from ..errors import SpecrtError

    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise SpecrtError(f"{flag} '{text}' cannot be split into options ({e}); quote it like "
                          f"{flag} '--cache-ram 0'") from None


def _print_load(res: dict) -> None:
    """The load test's tables and comparisons on stdout, its notes on stderr."""
    from .serve_report import multiturn_table, prompt_table

    typer.echo("\n".join(prompt_table(res)))
    if res["summary"]["multiturn"]:
        typer.echo("\n" + "\n".join(multiturn_table(res)))
    o = res["summary"]["overhead"]
    if o:
        n = len(o["pairs"])
        typer.echo(f"\nserver / in-process: tok/s {o['tok_s_ratio']:.3f}x, TTFT p50 "
                   f"{o['ttft_diff_ms']:+.1f} ms" + (f" (medians of {n} pairs)" if n > 1 else "")
                   + f"; identical answers {o['identical_texts']}/{o['prompts']}")
    for r in res["summary"]["versus"]:
        typer.echo(f"C={r['concurrency']}: TTFT p50 {r['ttft_p50_ms'][0]:.1f} vs {r['ttft_p50_ms'][1]:.1f} ms, "
                   f"ITL p99 {r['itl_p99_ms'][0]:.2f} vs {r['itl_p99_ms'][1]:.2f} ms ({r['ours']} vs "
                   f"{r['peer']})")
    for n in res["notes"]:
        typer.secho(n, err=True, fg=typer.colors.YELLOW)


def _voice(cfg, out: Path, command: str) -> None:
    from .voice import run_bench
    from .voice_report import table, versus_lines, write

    res = run_bench(cfg, log=lambda m: typer.secho(m, err=True, dim=True))
    write(res, out, command)
    typer.echo("\n".join(table(res) + [""] + versus_lines(res)))
    for n in res["notes"]:
        typer.secho(n, err=True, fg=typer.colors.YELLOW)
    typer.echo(f"wrote {out / 'report.md'}")
