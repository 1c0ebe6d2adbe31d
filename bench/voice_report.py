"""The voice workload's figures (bench/voice.py's per-turn records): per server, turn 1 and turns 2+ apart, the
median and spread (p10-p90 over turns) of time to first token, time to first sentence and decode tok/s; per turn the
medians (the plot); ours against llama-server's fastest (the issue-53 goals); report.md, voice.png, results.json."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .plotting import png, pyplot, write_report

GOAL_TTFS_LATER = 0.7     # ours / llama-server's best, turns 2+ median time to first sentence: at most
GOAL_DECODE_LATER = 1.3   # ours / llama-server's best, turns 2+ median decode tok/s: at least
GOAL_TTFS_FIRST = 1.1     # ours / llama-server's best, turn 1 median time to first sentence: at most
FIGURES = (("ttft_s", "time to first token", 1e3, "ms"), ("ttfs_s", "time to first sentence", 1e3, "ms"),
           ("decode_tok_s", "decode", 1.0, "tok/s"))


def spread(xs: list[float]) -> dict | None:
    """Median and p10/p90 of the values (None when there are none)."""
    if not xs:
        return None
    return {"median": float(np.median(xs)), "p10": float(np.percentile(xs, 10)), "p90": float(np.percentile(xs, 90)),
            "n": len(xs)}


def server_row(name: str, recs: list[dict], check: dict | None) -> dict:
    row = {"server": name, "calls": len({r["call"] for r in recs}), "turns": len(recs)}
    for part, keep in (("turn1", lambda r: r["turn"] == 1), ("later", lambda r: r["turn"] > 1)):
        rs = [r for r in recs if keep(r)]
        for key, _, scale, _ in FIGURES:
            s = spread([r[key] * scale for r in rs if r[key] is not None])
            row[f"{key}_{part}"] = s
        row[f"tokens_{part}"] = float(np.mean([r["completion_tokens"] for r in rs])) if rs else None
        cached = [r["cached_tokens"] for r in rs if r.get("cached_tokens") is not None]
        row[f"cached_{part}"] = float(np.mean(cached)) if cached else None
    row["sentence_end"] = sum(r["sentence_end"] for r in recs)
    chars = [r["first_sentence_chars"] for r in recs if r["turn"] > 1 and r.get("first_sentence_chars") is not None]
    row["first_sentence_chars_later"] = float(np.median(chars)) if chars else None
    row["per_turn"] = {t: {key: spread([r[key] * scale for r in recs if r["turn"] == t and r[key] is not None])
                           for key, _, scale, _ in FIGURES} for t in sorted({r["turn"] for r in recs})}
    row["identical_to_plain"] = check
    return row


def _med(row: dict, key: str) -> float | None:
    return (row.get(key) or {}).get("median")


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(res: dict) -> dict:
    rows = [server_row(s["name"], [r for r in res["records"] if r["server"] == s["name"]],
                       res["plain_check"].get(s["name"])) for s in res["servers"]]
    kinds = {s["name"]: s["kind"] for s in res["servers"]}
    peers = [r for r in rows if kinds[r["server"]] == "llama-server" and _med(r, "ttfs_s_later") is not None]
    best = min(peers, key=lambda r: _med(r, "ttfs_s_later"), default=None)
    versus = []
    for r in rows:
        if kinds[r["server"]] != "specrt" or best is None:
            continue
        v = {"ours": r["server"], "peer": best["server"],
             "ttfs_later": _ratio(_med(r, "ttfs_s_later"), _med(best, "ttfs_s_later")),
             "decode_later": _ratio(_med(r, "decode_tok_s_later"), _med(best, "decode_tok_s_later")),
             "ttfs_turn1": _ratio(_med(r, "ttfs_s_turn1"), _med(best, "ttfs_s_turn1")),
             "ttft_turn1": _ratio(_med(r, "ttft_s_turn1"), _med(best, "ttft_s_turn1"))}
        v["goals_met"] = (v["ttfs_later"] is not None and v["ttfs_later"] <= GOAL_TTFS_LATER
                          and v["decode_later"] is not None and v["decode_later"] >= GOAL_DECODE_LATER
                          and v["ttfs_turn1"] is not None and v["ttfs_turn1"] <= GOAL_TTFS_FIRST)
        versus.append(v)
    return {"servers": rows, "versus": versus}


def _f(s: dict | None, fmt: str = "{:.0f}") -> str:
    return "–" if not s else f"{fmt.format(s['median'])} ({fmt.format(s['p10'])}–{fmt.format(s['p90'])})"


def table(res: dict) -> list[str]:
    """The per-server table (printed by the command too)."""
    out = ["| server | turns | TTFT ms, turn 1 | TTFS ms, turn 1 | decode tok/s, turn 1 | TTFT ms, turns 2+ | "
           "TTFS ms, turns 2+ | decode tok/s, turns 2+ | tokens/turn, 2+ | first sentence chars, 2+ | "
           "cached tokens, 2+ | identical to plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["summary"]["servers"]:
        chk, cached, tokens = r["identical_to_plain"], r["cached_later"], r["tokens_later"]
        chars = r.get("first_sentence_chars_later")
        out.append(f"| {r['server']} | {r['turns']} | {_f(r['ttft_s_turn1'])} | {_f(r['ttfs_s_turn1'])} | "
                   f"{_f(r['decode_tok_s_turn1'], '{:.1f}')} | {_f(r['ttft_s_later'])} | {_f(r['ttfs_s_later'])} | "
                   f"{_f(r['decode_tok_s_later'], '{:.1f}')} | {'–' if tokens is None else f'{tokens:.1f}'} | "
                   f"{'–' if chars is None else f'{chars:.0f}'} | "
                   f"{'–' if cached is None else f'{cached:.0f}'} | "
                   + ("–" if chk is None else f"{chk['identical']}/{chk['turns']}") + " |")
    return out


def versus_lines(res: dict) -> list[str]:
    out = []
    for v in res["summary"]["versus"]:
        x = lambda k: "–" if v[k] is None else f"{v[k]:.2f}x"  # noqa: E731
        out.append(f"- {v['ours']} / {v['peer']}: turns 2+ time to first sentence {x('ttfs_later')} (goal <= "
                   f"{GOAL_TTFS_LATER}x), decode tok/s {x('decode_later')} (goal >= {GOAL_DECODE_LATER}x); turn 1 "
                   f"time to first sentence {x('ttfs_turn1')} (goal <= {GOAL_TTFS_FIRST}x), first token "
                   f"{x('ttft_turn1')}: goals **{'met' if v['goals_met'] else 'NOT met'}**")
    return out


def drafting_lines(res: dict) -> list[str]:
    """What drafted over the measured calls: ours from /metrics, llama-server from its answers' timings."""
    out = []
    for name, d in (res.get("drafting") or {}).items():
        rate = f"{d['accepted'] / d['draft_tokens']:.0%}" if d.get("draft_tokens") else "–"
        rounds = (f"{d['rounds_drafted']:.0f} rounds drafted, " if "rounds_drafted" in d else "")
        per = (f", {d['accepted'] / d['rounds_drafted']:.2f} accepted per drafting round"
               if d.get("rounds_drafted") else "")
        by = ", ".join(f"{k[3:]} {v:.0f}" for k, v in d.items() if k.startswith("by:") and v)
        out.append(f"- {name}: {rounds}{d['draft_tokens']:.0f} draft tokens, {d['accepted']:.0f} accepted ({rate})"
                   f"{per}; {d['tokens']:.0f} tokens made" + (f"; drafting rounds by drafter: {by}" if by else ""))
    return out


def markdown(res: dict) -> str:
    meta = res["meta"]
    out = [f"# specrt bench-serve --voice — {meta['engine_set'] or 'servers'}", "",
           f"- command: `{meta['command']}`",
           f"- {meta['date']}; CPU: {meta['cpu']} ({meta['cores']} cores), {meta['threads']} threads for every "
           f"server; bench time {meta['bench_s']:.0f} s",
           "- versions: " + ", ".join(f"{k} {val}" for k, val in meta["versions"].items() if val),
           f"- workload: {meta['workload']} (`{Path(meta['workload_file']).name}`): {meta['calls']} calls of "
           f"{meta['turns_per_call']} turns, each call made on every server in turn (the order rotated per call); "
           f"one system prompt (\"Call <k>.\" first: turn 1 is a cold prefill), max_tokens {meta['max_tokens']}, "
           "streamed, temperature 0, natural lengths",
           "- TTFT: request sent to the first content chunk; TTFS (time to first sentence): to the chunk that shows "
           "the first . ! or ? followed by whitespace (the stream's end when it ends the text or the reply has "
           "none); decode tok/s: (tokens - 1) / (end - first token); each cell: median (p10–p90) over turns",
           "- identical to plain: each turn of ours decoded again in-process by plain greedy decoding at the same "
           "precision, after the servers stopped"]
    for s in res["servers"]:
        lead = "specrt" if s["kind"] == "specrt" else Path(s["command"][0]).name
        args = s["command"][3:] if s["kind"] == "specrt" else s["command"][1:]
        out.append(f"- **{s['name']}**: `{lead} {' '.join(args)}`")
    out += ["", "## Voice turns", ""] + table(res)
    if drafting_lines(res):
        out += ["", "## Drafting over the measured calls", ""] + drafting_lines(res)
    if res["summary"]["versus"]:
        out += ["", "## Ours against llama-server's fastest (lowest turns 2+ time to first sentence)", ""]
        out += versus_lines(res)
    if res["notes"]:
        out += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    out += ["", "Plot: `voice.png` (time to first sentence and decode tok/s per turn, median and p10–p90).", ""]
    return "\n".join(out)


def plot(res: dict) -> tuple[dict[str, bytes], list[str]]:
    plt, note = pyplot()
    if plt is None:
        return {}, [note]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for row in res["summary"]["servers"]:
        turns = sorted(row["per_turn"])
        for ax, key in zip(axes, ("ttfs_s", "decode_tok_s")):
            cells = [row["per_turn"][t][key] for t in turns]
            xs = [t for t, c in zip(turns, cells) if c]
            scale = 1e3 if key == "ttfs_s" else 1.0  # seconds are drawn in ms
            med = np.array([c["median"] for c in cells if c]) * scale
            lo = np.array([c["p10"] for c in cells if c]) * scale
            hi = np.array([c["p90"] for c in cells if c]) * scale
            ax.errorbar(xs, med, yerr=[med - lo, hi - med], marker="o", capsize=3, label=row["server"])
    turns = sorted({t for row in res["summary"]["servers"] for t in row["per_turn"]})
    for ax, what in zip(axes, ("time to first sentence, ms", "decode tok/s")):
        ax.set_xticks(turns)
        ax.set_xlabel("turn")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"voice: {res['meta']['workload']}, {res['meta']['calls']} calls, max_tokens "
                 f"{res['meta']['max_tokens']}")
    return {"voice.png": png(plt, fig)}, []


def write(res: dict, out: Path, command: str) -> None:
    """Everything rendered first, then written: a failure leaves no half-written report."""
    write_report(res, out, command, summarize, plot, markdown)
