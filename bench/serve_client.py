"""bench-serve's client side: streamed requests against an OpenAI-compatible server, timed token by token, in the
load shapes (a closed loop of C clients over the prompt set; multi-turn conversations), with the prompts tagged so
no server's prefix cache serves one level from another's requests."""

from __future__ import annotations

import asyncio
import json
import time

from ..errors import SpecrtError, first_line
from .prompts import PromptCase
from .serve_config import ServeBenchConfig, Target
from .serve_procs import _log_hint


WARMUP = [{"role": "user", "content": "Say hello."}]  # not in the prompt set: no prefix shared with a measured one


WARMUP_TOKENS = 8


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


class _Fail(Exception):
    """An HTTP error or broken stream: turned into a one-line SpecrtError naming the server."""


async def request(client, target: Target, messages: list[dict], max_tokens: int, ignore_eos: bool,
                  min_tokens: bool, pieces: bool = False) -> dict:
    """One streamed chat completion; the per-request figures (seconds, from the client's clock). pieces: also each
    content chunk's text and arrival (seconds from the request), for timings inside the text (bench/voice.py)."""
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if target.model is not None:
        body["model"] = target.model
    if ignore_eos:
        body["ignore_eos"] = True
    if min_tokens:
        body["min_tokens"] = max_tokens
    times, parts, usage, finish, timings = [], [], None, None, None
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
                timings = obj.get("timings") or timings   # llama-server's (draft_n, draft_n_accepted)
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
            "finish_reason": finish, "text": "".join(parts),
            **({"pieces": list(zip([t - t0 for t in times], parts)), "timings": timings} if pieces else {})}


def _error_text(raw: str) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        return first_line(Exception(str(msg if msg else raw)), "no message")[:300]
    except (json.JSONDecodeError, AttributeError):
        return first_line(Exception(raw), "no message")[:300]


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
