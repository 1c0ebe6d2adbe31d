"""results.json -> report.md (tables) and PNG plots (speedup per category and mode; acceptance per
draft position). Pure formatting: every figure is computed in runner.py."""

from __future__ import annotations

import json
from pathlib import Path


def _f(v, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def markdown(res: dict, command: str) -> str:
    rows = res["summary"]
    cats = list(dict.fromkeys(r["category"] for r in rows if r["category"] != "all")) + ["all"]
    cell = {(r["mode"], r["category"]): r for r in rows}
    out = _header(res, command, cell)
    out += _tables(res, cats, cell)
    out += _per_prompt(res)
    if res.get("caveats"):
        out += ["", "## Caveats", ""] + [f"- {n}" for n in res["caveats"]]
    if res["notes"]:
        out += ["", "## Skipped", ""] + [f"- {n}" for n in res["notes"]]
    if res.get("repeat"):  # --repeat-calls: bench/repeat.py's workloads, same engines
        from .repeat import markdown as repeat_markdown

        out += ["", "## Workloads that repeat (`--repeat-calls`)", ""]
        out += [line.replace("## ", "### ") for line in repeat_markdown(res["repeat"]).splitlines()[2:]]
        out.append("`repeat.png`: tok/s per voice call, as the suffix store warms up.")
    out += ["", "Plots: `speedup.png` (speedup per category and mode), `acceptance.png` (acceptance rate per "
            "draft position).", ""]
    return "\n".join(out)


def _header(res: dict, command: str, cell: dict) -> list[str]:
    """The report's title and how it was measured: command, machine, versions, and what each column means."""
    meta, rows = res["meta"], res["summary"]
    v = meta["versions"]
    out = [
        f"# specrt bench — {meta['engine_set']}" + ("  (quick)" if meta["quick"] else ""),
        "",
        f"- command: `{command}`",
        f"- {meta['date']}; CPU: {meta['cpu']} ({meta['cores']} cores), **{meta['threads']} threads** for every "
        f"contender; {meta['cases']} prompts x {meta['reps']} reps, modes interleaved; "
        f"bench time {meta['bench_s']:.0f} s"
        + ("; **--ignore-eos**: every contender generates exactly each prompt's max_new_tokens (ours and llama.cpp "
           "decode through EOS, genai and transformers suppress it), so agreement past an EOS means nothing"
           if meta.get("ignore_eos") else ""),
        ("- each contender in a worker process of its own (`--isolate`), nothing shared; workers started in order: "
         if meta.get("isolate") else "- load order (sessions created later decoded faster here): ")
        + ", ".join(res.get("load_order", res["modes"])),
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val)
        + f"; OMP_WAIT_POLICY={meta.get('omp_wait_policy')}",
        "- tok/s = new tokens / wall time of the call (prefill included): per prompt the median of reps, per "
        "category and over all prompts the arithmetic mean of those per-prompt medians; new tokens = mean over runs",
        f"- speedup = per prompt the median over reps of (tok/s / `{meta['reference']}`'s tok/s in the same rep: "
        "reps are interleaved, so each pair ran close in time), then the geometric mean over prompts; decode "
        "speedup = the same with prefill left out (tokens after the first round / time after it)",
        "- tau = tokens per target pass; acceptance at draft position i = P(draft token i kept | the round drafted "
        ">= i tokens), cumulative from position 1 (token i is kept only if 1..i-1 were); both pooled over runs "
        "(summed counts)",
        "- gap p50/p99: the gaps between streamed tokens of every prompt and every rep pooled, so one slow rep "
        "can set p99; agreement = prompts whose greedy tokens equal the reference's, and the earliest divergence index",
    ]
    if any(r.get("pooled") is False and r["tau"] is not None for r in rows):
        out.append("- **this results.json predates the round and draft counts**: tau and acceptance are unweighted "
                   "means of per-run figures here (the old way), not pooled")
    left = [f"{r['mode']} ({', '.join(r['speedup_left_out'])})" for r in rows
            if r["category"] == "all" and r.get("speedup_left_out")]
    if left:
        out.append("- left out of the speedups (0 new tokens on either side in every rep: no ratio to average): "
                   + "; ".join(left))
    out += _meta_lines(res, cell)
    return out


def _tables(res: dict, cats: list[str], cell: dict) -> list[str]:
    """tok/s (speedup) per category, every figure over all prompts, and per (mode, category)."""
    rows = res["summary"]
    out = []
    out += [
        "",
        "## tok/s (speedup) per category",
        "",
        "| mode | " + " | ".join(cats) + " |",
        "|---|" + "---:|" * len(cats),
    ]
    for m in res["modes"]:
        cells = []
        for c in cats:
            r = cell.get((m, c))
            cells.append("–" if r is None else f"{r['tok_s']:.1f} ({_f(r['speedup'], '{:.2f}')}x)")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    out += ["", "## All prompts", "",
            "| mode | tok/s | new tokens | speedup | decode speedup | tau | TTFT ms | gap p50 ms | gap p99 ms | "
            "identical | first divergence | acceptance by position |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m in res["modes"]:
        r = cell[(m, "all")]
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"][:8]) or "–"
        out.append(f"| {m} | {r['tok_s']:.1f} | {r['new_tokens']:g} | {_f(r['speedup'], '{:.2f}')}x | "
                   f"{_f(r.get('decode_speedup'), '{:.2f}')}x | {_f(r['tau'], '{:.2f}')} | "
                   f"{_f(r['ttft_ms'], '{:.0f}')} | {_f(r['gap_p50_ms'], '{:.1f}')} | "
                   f"{_f(r['gap_p99_ms'], '{:.1f}')} | "
                   f"{r['identical']} | {_f(r['first_divergence'], '{}')} | {acc} |")
    out += ["", "## Per (mode, category)", "",
            "| mode | category | tok/s | new tokens | speedup | decode speedup | tau | TTFT ms | gap p50/p99 ms | "
            "identical | first divergence |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["category"] == "all":
            continue
        out.append(f"| {r['mode']} | {r['category']} | {r['tok_s']:.1f} | {r['new_tokens']:g} | "
                   f"{_f(r['speedup'], '{:.2f}')}x | "
                   f"{_f(r.get('decode_speedup'), '{:.2f}')}x | {_f(r['tau'], '{:.2f}')} | "
                   f"{_f(r['ttft_ms'], '{:.0f}')} | {_f(r['gap_p50_ms'])}/"
                   f"{_f(r['gap_p99_ms'])} | {r['identical']} | {_f(r['first_divergence'], '{}')} |")
    return out


def _meta_lines(res: dict, cell: dict) -> list[str]:
    """What drafted for each speculative mode (what `auto` resolved to, a draft model's engine) and the Medusa
    heads' accuracy from training, beside the acceptance measured here."""
    out = []
    drafted = [f"{m}: {cell[(m, 'all')]['proposer']}" for m in res["modes"] if cell[(m, "all")].get("proposer")]
    if drafted:
        out.append("- proposers: " + "; ".join(drafted))
    heads = res["meta"].get("medusa")
    if heads:
        pct = lambda xs: " ".join(f"{x:.0%}" for x in xs)  # noqa: E731
        out.append(f"- Medusa heads `{heads['engine']}`, held-out accuracy from training per head (head k guesses the "
                   f"token k places past the target's next): top-1 {pct(heads['top1'])}"
                   + (f", top-5 {pct(heads['top5'])}" if heads.get("top5") else "")
                   + (f" ({heads['heldout_positions']} positions)" if heads.get("heldout_positions") else ""))
    return out


def _per_prompt(res: dict) -> list[str]:
    """Median tok/s per prompt and mode, and ours against onnxruntime-genai at the same precision, prompt by
    prompt."""
    from .runner import median_by_case, paired_ratios

    med, n = ({(m, case): v for m in res["modes"]
                for case, v in median_by_case([r for r in res["runs"] if r["mode"] == m], key).items()}
              for key in ("tok_s", "new_tokens"))
    cases = [c["id"] for c in res["cases"]]
    out = ["", "## tok/s per prompt (median of reps)", "", "| prompt | " + " | ".join(res["modes"]) + " |",
           "|---|" + "---:|" * len(res["modes"])]
    for c in cases:
        out.append(f"| {c} | " + " | ".join(_f(med.get((m, c))) for m in res["modes"]) + " |")
    goals = [(f"plain-{p}", f"genai-{p}") for p in ("fp32", "int4")]
    lines = []
    for ours, peer in goals:
        if ours in res["modes"] and peer in res["modes"]:
            # per prompt the median of same-rep ratios (as the speedups); the medians of tok/s for comparison
            paired = paired_ratios([r for r in res["runs"] if r["mode"] == ours],
                                   [r for r in res["runs"] if r["mode"] == peer])
            wins = [c for c in cases if (paired.get(c) or 0) >= 1.0]
            lost = [c for c in cases if c not in wins]
            by_median = sum(med[(ours, c)] >= med[(peer, c)] for c in cases)
            # two int4 models stop at different EOS positions: a shorter answer's tok/s carries more prefill
            odd = [f"{c} {n[(ours, c)]:g} vs {n[(peer, c)]:g}" for c in cases if n[(ours, c)] != n[(peer, c)]]
            lines.append(f"- {ours} >= {peer} on {len(wins)}/{len(cases)} prompts (same-rep pairs; by medians of "
                         f"tok/s {by_median}/{len(cases)})"
                         + (f" (behind on: {', '.join(lost)})" if lost else "")
                         + (f"; new tokens differ (ours vs peer) on: {', '.join(odd)}" if odd else
                            "; same new tokens on every prompt"))
    return out + (["", "Ours against onnxruntime-genai at the same precision, prompt by prompt:", ""] + lines
                  if lines else [])


def plots(res: dict, out: Path) -> list[str]:
    """Writes the PNGs; returns notes (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install 'specrt[bench]')"]
    rows = res["summary"]
    cats = list(dict.fromkeys(r["category"] for r in rows if r["category"] != "all")) + ["all"]
    modes = res["modes"]
    cell = {(r["mode"], r["category"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cats) * max(1, len(modes)) / 4), 4.5))
    w = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        ys = [(cell.get((m, c)) or {}).get("speedup") or 0 for c in cats]
        ax.bar([j + i * w - 0.4 + w / 2 for j in range(len(cats))], ys, w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel(f"speedup vs {res['meta']['reference']}")
    ax.set_title(f"{res['meta']['engine_set']}: tok/s speedup ({res['meta']['threads']} threads)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for m in modes:
        acc = (cell.get((m, "all")) or {}).get("acceptance") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
            drawn += 1
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance per draft position (all prompts)" + ("" if drawn else ": no speculative mode ran"))
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
    return []


def rerender(results: Path) -> None:
    """Re-derive the figures of a results.json with this version's summary and rewrite report.md beside it:
    python -m specrt.bench.report bench-out/results.json"""
    from .prompts import parse_case
    from .runner import summarize

    res = json.loads(results.read_text())
    cases = [parse_case(c, f"{results}: case {i}") for i, c in enumerate(res["cases"])]
    res["summary"] = summarize(res["runs"], res["modes"], cases)
    write(res, results.parent, res["meta"]["command"])


def write(res: dict, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res["notes"] = res["notes"] + plots(res, out)
    if res.get("repeat"):
        from .repeat import plot

        plot(res["repeat"], out / "repeat.png")
    res["meta"]["command"] = command
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "report.md").write_text(markdown(res, command))


if __name__ == "__main__":
    import sys

    rerender(Path(sys.argv[1]))
