"""bench-serve's figures (from the per-request records of bench/serve_load.py), report.md, PNG plots, results.json.

Per (server, concurrency) on the prompt set: TTFT p50/p90/p99 over requests; TPOT = the median over requests of
(end-to-end - TTFT) / (completion tokens - 1); ITL p50/p90/p99 over every gap of every request, pooled; end-to-end
p50; tok/s = all completion tokens / the wall time of the whole closed loop (first request sent to last answer
ended); cached tokens = the mean per request of `usage.prompt_tokens_details.cached_tokens` (– where the server
reports none). Multi-turn: per turn the median over conversations.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from .plotting import png, pyplot, write_report

GOAL_TOK_S_RATIO = 0.95   # server tok/s at least this share of the in-process API's, single stream
GOAL_TTFT_MS = 15.0       # server TTFT at most this many ms above the in-process API's
GOAL_VS_LLAMACPP_AT = (1, 4)


def _ms(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else None


def _median(xs):
    return statistics.median(xs) if xs else None


def _order(res: dict) -> list[str]:
    names = [s["name"] for s in res["servers"]]
    return (["in-process"] if any(r["server"] == "in-process" for r in res["records"]) else []) + names


def tpot_s(r: dict) -> float | None:
    n = r["completion_tokens"]
    return (r["e2e_s"] - r["ttft_s"]) / (n - 1) if r["ttft_s"] is not None and n >= 2 else None


def prompt_row(server: str, concurrency: int, rs: list[dict], max_tokens: int) -> dict:
    ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
    itl = [g for r in rs for g in r["itl_s"]]
    tpot = [t for t in map(tpot_s, rs) if t is not None]
    wall = max(r["t_end"] for r in rs) - min(r["t_start"] for r in rs)
    tokens = sum(r["completion_tokens"] for r in rs)
    cached = [r["cached_tokens"] for r in rs if r["cached_tokens"] is not None]
    return {"server": server, "concurrency": concurrency, "requests": len(rs),
            "ttft_p50_ms": _ms(ttft, 50), "ttft_p90_ms": _ms(ttft, 90), "ttft_p99_ms": _ms(ttft, 99),
            "tpot_ms": _median(tpot) * 1e3 if tpot else None,
            "itl_p50_ms": _ms(itl, 50), "itl_p90_ms": _ms(itl, 90), "itl_p99_ms": _ms(itl, 99), "itl_gaps": len(itl),
            "e2e_p50_ms": _ms([r["e2e_s"] for r in rs], 50), "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else None,
            # single stream: tokens / the time spent in requests (the in-process baseline's definition too)
            "tok_s_in_requests": tokens / sum(r["e2e_s"] for r in rs),
            "completion_tokens_mean": tokens / len(rs),
            "at_max_tokens": sum(r["completion_tokens"] == max_tokens for r in rs),
            "cached_tokens_mean": sum(cached) / len(cached) if cached else None,
            "tokens_from": sorted({r["tokens_from"] for r in rs})}


def summarize(res: dict) -> dict:
    recs, meta = res["records"], res["meta"]
    prompts, turns, conv = [], [], []
    for s in _order(res):
        mine = [r for r in recs if r["server"] == s and r.get("rep", 0) == 0]   # repeated pairs: overhead() only
        for c in sorted({r["concurrency"] for r in mine if r["shape"] == "prompts"}):
            rs = [r for r in mine if r["shape"] == "prompts" and r["concurrency"] == c]
            prompts.append(prompt_row(s, c, rs, meta["max_tokens"]))
        mt = [r for r in mine if r["shape"] == "multiturn"]
        for t in sorted({r["turn"] for r in mt}):
            rs = [r for r in mt if r["turn"] == t]
            cached = [r["cached_tokens"] for r in rs if r["cached_tokens"] is not None]
            turns.append({"server": s, "turn": t, "conversations": len(rs),
                          "prompt_tokens": _median([r["prompt_tokens"] for r in rs if r["prompt_tokens"] is not None]),
                          "cached_tokens": _median(cached) if cached else None,
                          "ttft_ms": _ms([r["ttft_s"] for r in rs if r["ttft_s"] is not None], 50),
                          "e2e_ms": _ms([r["e2e_s"] for r in rs], 50),
                          "completion_tokens_mean": sum(r["completion_tokens"] for r in rs) / len(rs)})
        if mt:
            first = [r["ttft_s"] for r in mt if r["turn"] == 1 and r["ttft_s"] is not None]
            later = [r["ttft_s"] for r in mt if r["turn"] > 1 and r["ttft_s"] is not None]
            cached = [r["cached_tokens"] for r in mt if r["turn"] > 1 and r["cached_tokens"] is not None]
            conv.append({"server": s, "ttft_turn1_ms": _ms(first, 50), "ttft_later_ms": _ms(later, 50),
                         "cached_later_mean": sum(cached) / len(cached) if cached else None})
    return {"prompts": prompts, "multiturn": turns, "conversation": conv, "overhead": overhead(res, prompts),
            "versus": versus(res, prompts)}


def _launched(res: dict, kind: str) -> str | None:
    return next((s["name"] for s in res["servers"] if s["kind"] == kind), None)


def overhead(res: dict, rows: list[dict]) -> dict | None:
    """`specrt serve` on loopback against the in-process API, single stream, the same prompts; with
    --overhead-reps N, one figure per (baseline, server) pair and the goals judged on the medians of the N."""
    ours = _launched(res, "specrt")
    cell = {(r["server"], r["concurrency"]): r for r in rows}
    if cell.get((ours, 1)) is None or cell.get(("in-process", 1)) is None:
        return None
    pairs = []
    for rep in sorted({r.get("rep", 0) for r in res["records"] if r["server"] == "in-process"}):
        by_case = lambda s: {r["case"]: r for r in res["records"]  # noqa: E731
                             if r["server"] == s and r["shape"] == "prompts" and r["concurrency"] == 1
                             and r.get("rep", 0) == rep}
        sv, ip = by_case(ours), by_case("in-process")
        if not sv or not ip:
            continue
        a, b = prompt_row(ours, 1, list(sv.values()), 0), prompt_row("in-process", 1, list(ip.values()), 0)
        paired = [sv[c]["ttft_s"] - ip[c]["ttft_s"] for c in sv if c in ip
                  and sv[c]["ttft_s"] is not None and ip[c]["ttft_s"] is not None]
        pairs.append({"tok_s_server": a["tok_s_in_requests"], "tok_s_in_process": b["tok_s_in_requests"],
                      "tok_s_ratio": a["tok_s_in_requests"] / b["tok_s_in_requests"],
                      "ttft_p50_ms_server": a["ttft_p50_ms"], "ttft_p50_ms_in_process": b["ttft_p50_ms"],
                      "ttft_diff_ms": (a["ttft_p50_ms"] - b["ttft_p50_ms"]
                                       if None not in (a["ttft_p50_ms"], b["ttft_p50_ms"]) else None),
                      "ttft_paired_diff_ms": _median(paired) * 1e3 if paired else None,
                      "identical_texts": sum(sv[c]["text"] == ip[c]["text"] for c in sv if c in ip),
                      "prompts": len(sv)})
    med = lambda k: _median([p[k] for p in pairs if p[k] is not None])  # noqa: E731
    ratio, diff = med("tok_s_ratio"), med("ttft_diff_ms")
    return {"server": ours, "pairs": pairs, "tok_s_server": med("tok_s_server"),
            "tok_s_in_process": med("tok_s_in_process"), "tok_s_ratio": ratio,
            "ttft_p50_ms_server": med("ttft_p50_ms_server"), "ttft_p50_ms_in_process": med("ttft_p50_ms_in_process"),
            "ttft_diff_ms": diff, "ttft_paired_diff_ms": med("ttft_paired_diff_ms"),
            "identical_texts": sum(p["identical_texts"] for p in pairs), "prompts": sum(p["prompts"] for p in pairs),
            "goal_tok_s_met": ratio >= GOAL_TOK_S_RATIO,
            "goal_ttft_met": diff is not None and diff <= GOAL_TTFT_MS}


def versus(res: dict, rows: list[dict]) -> list[dict]:
    """Ours against llama-cpp-python's server, both launched here, at every concurrency both ran."""
    ours, peer = _launched(res, "specrt"), _launched(res, "llamacpp")
    cell = {(r["server"], r["concurrency"]): r for r in rows}
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        a, b = cell.get((ours, c)), cell.get((peer, c))
        if a is None or b is None:
            continue
        out.append({"concurrency": c, "ours": ours, "peer": peer,
                    "ttft_p50_ms": [a["ttft_p50_ms"], b["ttft_p50_ms"]],
                    "itl_p99_ms": [a["itl_p99_ms"], b["itl_p99_ms"]], "tok_s": [a["tok_s"], b["tok_s"]],
                    "tokens_mean": [a["completion_tokens_mean"], b["completion_tokens_mean"]],
                    "ahead_ttft": _lt(a["ttft_p50_ms"], b["ttft_p50_ms"]),
                    "ahead_itl_p99": _lt(a["itl_p99_ms"], b["itl_p99_ms"])})
    return out


def _lt(a, b):
    return None if a is None or b is None else a < b


def _f(v, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _yes(v) -> str:
    return "–" if v is None else "**yes**" if v else "no"


def prompt_table(res: dict) -> list[str]:
    """The prompt-set table (printed by the command too)."""
    sm = res["summary"]
    out = ["| server | C | requests | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TPOT ms | ITL p50 ms | ITL p90 ms | "
           "ITL p99 ms | e2e p50 ms | tok/s | tokens/req (at max) | cached tokens/req |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sm["prompts"]:
        chunks = "*" if r["tokens_from"] == ["chunks"] else ""
        out.append(f"| {r['server']} | {r['concurrency']} | {r['requests']} | {_f(r['ttft_p50_ms'])} | "
                   f"{_f(r['ttft_p90_ms'])} | {_f(r['ttft_p99_ms'])} | {_f(r['tpot_ms'], '{:.2f}')} | "
                   f"{_f(r['itl_p50_ms'], '{:.2f}')} | {_f(r['itl_p90_ms'], '{:.2f}')} | "
                   f"{_f(r['itl_p99_ms'], '{:.2f}')} | {_f(r['e2e_p50_ms'], '{:.0f}')} | {_f(r['tok_s'])} | "
                   f"{r['completion_tokens_mean']:.1f}{chunks} ({r['at_max_tokens']}/{r['requests']}) | "
                   f"{_f(r['cached_tokens_mean'])} |")
    return out


def multiturn_table(res: dict) -> list[str]:
    out = ["| server | turn | conversations | prompt tokens | cached tokens | TTFT ms | e2e ms | new tokens |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["summary"]["multiturn"]:
        out.append(f"| {r['server']} | {r['turn']} | {r['conversations']} | {_f(r['prompt_tokens'], '{:.0f}')} | "
                   f"{_f(r['cached_tokens'], '{:.0f}')} | {_f(r['ttft_ms'])} | {_f(r['e2e_ms'], '{:.0f}')} | "
                   f"{r['completion_tokens_mean']:.1f} |")
    return out


def markdown(res: dict) -> str:
    meta, sm = res["meta"], res["summary"]
    out = _header(res)
    out += ["", "## Prompt set, closed loop", ""] + prompt_table(res)
    if sm["multiturn"]:
        out += ["", "## Multi-turn", ""] + multiturn_table(res)
        out.append("")
        for c in sm["conversation"]:
            ratio = (f" ({c['ttft_later_ms'] / c['ttft_turn1_ms']:.2f}x)"
                     if c["ttft_later_ms"] is not None and c["ttft_turn1_ms"] else "")
            out.append(f"- {c['server']}: TTFT turn 1 {_f(c['ttft_turn1_ms'])} ms, turns 2+ "
                       f"{_f(c['ttft_later_ms'])} ms{ratio}; cached tokens per later turn "
                       f"{_f(c['cached_later_mean'], '{:.0f}')}")
    out += _overhead(sm["overhead"])
    out += _versus(sm, meta)
    if res["notes"]:
        out += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    out += ["", "Plots: `latency.png` (TTFT p50 and p99 ITL against concurrency, per server)"
            + (", `multiturn.png` (TTFT per turn)" if sm["multiturn"] else "") + ".", ""]
    return "\n".join(out)


def _header(res: dict) -> list[str]:
    """The report's title and how it was measured: command, machine, versions, workloads, and the servers."""
    meta = res["meta"]
    v = meta["versions"]
    title = meta["engine_set"] or ", ".join(s["name"] for s in res["servers"])
    out = [f"# specrt bench-serve — {title}", "",
           f"- command: `{meta['command']}`",
           f"- {meta['date']}; CPU: {meta['cpu']} ({meta['cores']} cores), {meta['threads']} threads for every "
           f"server launched here; bench time {meta['bench_s']:.0f} s",
           "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
           f"- prompt set: {len(meta['cases'])} prompts of `{Path(meta['prompts']).name}` "
           f"({', '.join(meta['cases'])}), each at every concurrency C in {meta['concurrency']} as a closed loop "
           f"(C clients, each sends the next prompt when its answer has ended; each level's prompts start with "
           f"`[C=<C>] `, so none is answered from an earlier level's prefix cache); max_tokens {meta['max_tokens']}, "
           f"temperature 0, streamed" + (", `ignore_eos`" if meta["ignore_eos"] else "")
           + (", `min_tokens` = max_tokens" if meta["min_tokens"] else ""),
           f"- multi-turn: {meta['conversations']} conversation(s) of a system prompt (bench/multiturn.py's, "
           f"numbered per conversation) and {meta['turns']} user turns, each resending the whole history; "
           f"max_tokens {meta['turn_max_tokens']}, natural lengths (no ignore_eos)",
           "- TTFT: request sent to the first chunk with non-empty `delta.content`; ITL: the gaps between such "
           "chunks, all requests pooled; TPOT: per request (e2e - TTFT) / (tokens - 1), the median; tok/s: all "
           "tokens / the wall time of the loop; tokens from `usage` (* = counted as content chunks: no usage in "
           "the stream), (at max) = requests that made exactly max_tokens",
           ("- one server at a time; the in-process baseline (`load(...).stream(...)`, KV reuse on as in `specrt "
            "serve`) ran before any server started"
            + (f", and before each of the {meta['overhead_reps'] - 1} repeated single-stream runs of `specrt serve` "
               "(the server loaded and idle meanwhile)" if meta.get("overhead_reps", 1) > 1 else "")
            if meta["in_process"] else "- one server at a time")]
    for s in res["servers"]:
        how = s["url"]
        if s["command"]:  # [python, -m, module, ...]
            lead = {"specrt": "specrt", "llamacpp": "python -m llama_cpp.server"}.get(s["kind"], s["command"][2])
            how = f"`{lead} {' '.join(s['command'][3:])}`"
        out.append(f"- **{s['name']}**: {how} (model `{s['model']}`)")
    return out


def _overhead(o: dict | None) -> list[str]:
    """`specrt serve` on loopback against the in-process API, single stream: the figures and their goals."""
    if not o:
        return []
    n = len(o["pairs"])
    how = (f"the medians of {n} pairs, each baseline run right before its server run (the first pair's the "
           "tables' rows)" if n > 1 else "one pair")
    out = ["", f"## Server overhead: `{o['server']}` on loopback against the in-process API, single stream", "",
           f"Figures: {how}.", "",
           f"- tok/s (tokens / time in requests): server {o['tok_s_server']:.1f}, in-process "
           f"{o['tok_s_in_process']:.1f}: **{o['tok_s_ratio']:.3f}x** (goal >= {GOAL_TOK_S_RATIO}x: "
           f"{'met' if o['goal_tok_s_met'] else 'NOT met'})",
           f"- TTFT p50: server {_f(o['ttft_p50_ms_server'])} ms, in-process {_f(o['ttft_p50_ms_in_process'])} "
           f"ms: **{_f(o['ttft_diff_ms'], '{:+.1f}')} ms** (per prompt, the median difference "
           f"{_f(o['ttft_paired_diff_ms'], '{:+.1f}')} ms; goal <= +{GOAL_TTFT_MS:g} ms: "
           f"{'met' if o['goal_ttft_met'] else 'NOT met'})",
           f"- answers identical to the in-process ones: {o['identical_texts']}/{o['prompts']}"]
    if n > 1:
        out += ["", "| pair | tok/s server | tok/s in-process | ratio | TTFT p50 ms server | in-process | "
                "difference ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for i, p in enumerate(o["pairs"], 1):
            out.append(f"| {i} | {p['tok_s_server']:.1f} | {p['tok_s_in_process']:.1f} | "
                       f"{p['tok_s_ratio']:.3f}x | {_f(p['ttft_p50_ms_server'])} | "
                       f"{_f(p['ttft_p50_ms_in_process'])} | {_f(p['ttft_diff_ms'], '{:+.1f}')} |")
    return out


def _versus(sm: dict, meta: dict) -> list[str]:
    """Ours against llama-cpp-python's server on the same prompts, per concurrency, and the goal."""
    if not sm["versus"]:
        return []
    vs = sm["versus"]
    out = ["", f"## `{vs[0]['ours']}` against llama-cpp-python's server (`{vs[0]['peer']}`), same prompts", "",
           "| C | TTFT p50 ms, ours / theirs | ITL p99 ms, ours / theirs | tok/s, ours / theirs | tokens/req, "
           "ours / theirs | ahead on TTFT | ahead on p99 ITL |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in vs:
        out.append(f"| {r['concurrency']} | {_f(r['ttft_p50_ms'][0])} / {_f(r['ttft_p50_ms'][1])} | "
                   f"{_f(r['itl_p99_ms'][0], '{:.2f}')} / {_f(r['itl_p99_ms'][1], '{:.2f}')} | "
                   f"{_f(r['tok_s'][0])} / {_f(r['tok_s'][1])} | {r['tokens_mean'][0]:.1f} / "
                   f"{r['tokens_mean'][1]:.1f} | {_yes(r['ahead_ttft'])} | {_yes(r['ahead_itl_p99'])} |")
    goal = [r for r in vs if r["concurrency"] in GOAL_VS_LLAMACPP_AT]
    if goal:
        met = all(r["ahead_ttft"] and r["ahead_itl_p99"] for r in goal)
        out += ["", f"Goal: ahead on TTFT p50 and p99 ITL at concurrency "
                f"{' and '.join(str(r['concurrency']) for r in goal)}: **{'met' if met else 'NOT met'}**"
                + ("" if len(goal) == len(GOAL_VS_LLAMACPP_AT) else
                   f" (concurrency {', '.join(map(str, GOAL_VS_LLAMACPP_AT))} not all run)")]
    short = [r["concurrency"] for r in sm["prompts"]
             if r["server"] == vs[0]["peer"] and r["at_max_tokens"] < r["requests"]]
    if short and not meta["min_tokens"]:
        out.append("- llama-cpp-python ignores `ignore_eos` (and has no equivalent but `min_tokens`, "
                   "--min-tokens: a Python logits processor on every token, which slows it), so its answers "
                   f"end at its EOS (shorter than max_tokens at concurrency {', '.join(map(str, short))}): "
                   "compare the per-token columns; tokens/req shows the lengths")
    return out


def plots(res: dict) -> tuple[dict[str, bytes], list[str]]:
    """PNG bytes by file name, and notes (matplotlib missing)."""
    plt, note = pyplot()
    if plt is None:
        return {}, [note]
    sm, files = res["summary"], {}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in _order(res):
        rows = [r for r in sm["prompts"] if r["server"] == s]
        xs = [r["concurrency"] for r in rows]
        style = dict(marker="o", label=s) if len(xs) > 1 else dict(marker="D", ls="none", label=s)
        for ax, key in zip(axes, ("ttft_p50_ms", "itl_p99_ms")):
            ax.plot(xs, [r[key] if r[key] is not None else np.nan for r in rows], **style)
    for ax, what in zip(axes, ("TTFT p50 ms", "ITL p99 ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(res["meta"]["concurrency"], [str(c) for c in res["meta"]["concurrency"]])
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['meta']['engine_set'] or 'bench-serve'}: {len(res['meta']['cases'])} prompts, "
                 f"max_tokens {res['meta']['max_tokens']}, {res['meta']['threads']} threads")
    files["latency.png"] = png(plt, fig)
    if sm["multiturn"]:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for s in dict.fromkeys(r["server"] for r in sm["multiturn"]):
            rows = [r for r in sm["multiturn"] if r["server"] == s]
            ax.plot([r["turn"] for r in rows], [r["ttft_ms"] for r in rows], marker="o", label=s)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT ms (median over conversations)")
        ax.set_ylim(bottom=0)
        ax.set_title("multi-turn: whole history resent each turn")
        ax.legend(fontsize=8)
        files["multiturn.png"] = png(plt, fig)
    return files, []


def write(res: dict, out: Path, command: str) -> None:
    """Everything is rendered first, then written: a failure leaves no half-written report."""
    write_report(res, out, command, summarize, plots, markdown)
