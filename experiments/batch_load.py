"""The trade-off curve of several streams at once: aggregate throughput and p99 inter-token latency against
concurrency, with speculation off, at a fixed K, and chosen by load, in-process (no HTTP), closed loop: the same
`--answers` prompts at every concurrency C, shared out over C streams, each asking its next prompt as soon as its
answer is done.

    python -m experiments.batch_load --engines engines/smollm2-135m --concurrency 1,2,4,8 --out bench-out/batch
More: docs/bench-notes.md, "Module notes: experiments/batch_load.py".
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

from specrt.bench.prompts import DEFAULT_PROMPTS

MODES = {  # name -> (--speculate, --draft-tokens)
    "off": ("off", None),
    "fixed-k4": ("lookup+medusa", 4),
    "by-load": ("lookup+medusa", None),
}


def _run(session, prompts, concurrency: int, answers: int, max_new_tokens: dict[str, int]) -> dict:
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.tokenizer import Message

    greedy = SamplingParams(temperature=0.0)
    gaps, ttft, tokens, errors, out = [], [], [0] * concurrency, [], {}
    lock = threading.Lock()
    gate = threading.Barrier(concurrency + 1)

    def stream(i):
        try:
            gate.wait()
            for j in range(i, answers, concurrency):
                case = prompts[j % len(prompts)]
                msgs = [Message(role, content) for role, content in case.messages]
                asked = time.perf_counter()
                s = session.stream(msgs, max_new_tokens=max_new_tokens[case.id], sampling=greedy, ignore_eos=True)
                last, mine, first = None, [], None
                for _ in s:
                    now = time.perf_counter()
                    if last is not None:
                        mine.append(now - last)
                    else:
                        first = now - asked
                    last = now
                tokens[i] += s.result.stats.new_tokens
                with lock:
                    gaps.extend(mine)
                    ttft.extend([] if first is None else [first])
                    out[case.id] = s.result.token_ids
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    g = np.array(gaps) if gaps else np.zeros(1)
    ms = lambda x, q: round(float(np.percentile(x, q)) * 1000, 1) if len(x) else None  # noqa: E731
    return {"tok_s": round(sum(tokens) / wall, 1), "itl_p50_ms": ms(g, 50), "itl_p99_ms": ms(g, 99),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "tokens": sum(tokens),
            "wall_s": round(wall, 2), "answers": out}


def prompt_set(path: Path, categories: str, answers: int) -> list:
    """The first `answers` prompts of the set, the categories in turn (so any first n prompts mix them)."""
    from specrt.bench.prompts import CATEGORIES, load_prompts, select

    cats = tuple(c for c in categories.split(",") if c in CATEGORIES)
    prompts = select(load_prompts(path), categories=cats, per_category=max(4, -(-answers // len(cats))))
    rank = {c.id: sum(1 for d in prompts[:i] if d.category == c.category) for i, c in enumerate(prompts)}
    return sorted(prompts, key=lambda c: rank[c.id])[:answers]


def main(argv=None) -> list[dict]:
    ap = _parser()
    a = ap.parse_args(argv)
    if a.slots < 0:
        ap.error(f"--slots must be >= 0, got {a.slots}")

    import onnxruntime as ort

    from specrt.runtime.engine import EngineOptions
    from specrt.runtime.session import load
    from specrt.runtime.speculative import SpeculativeConfig
    prompts = prompt_set(Path(a.prompts), a.categories, a.answers)
    options = EngineOptions(threads=a.threads)
    plain = load(a.engines, "fp32", "off", options)  # the reference answers: plain decoding, one stream
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.tokenizer import Message

    # varied: answers of 0.5x to 1.5x --max-new-tokens (golden-ratio steps), so streams fall out of step and one's
    # prefill lands while the others decode, as requests arriving at their own times do
    lengths = {c.id: (a.max_new_tokens if a.lengths == "equal" else max(1, round(a.max_new_tokens * (
        0.5 + (i * 0.6180339887) % 1.0)))) for i, c in enumerate(prompts)}
    want = {c.id: plain.generate([Message(r, t) for r, t in c.messages], max_new_tokens=lengths[c.id],
                                 sampling=SamplingParams(temperature=0.0), ignore_eos=True).token_ids
            for c in prompts}
    del plain

    # (label, C, slots, --speculate, K, chunk)
    configs = [("single (auto, no --parallel)", 1, 1, "auto", None, None)]
    chunks = [int(t) for t in a.prefill_chunk.split(",")] if a.prefill_chunk else [None]
    for C in (int(c) for c in a.concurrency.split(",")):
        for name in a.modes.split(","):
            for chunk in chunks if C > 1 else [None]:
                label = name if len(chunks) == 1 or C == 1 else f"{name}, chunk {chunk}"
                configs.append((label, C, max(C, a.slots), *MODES[name], chunk))
    runs: dict[tuple[str, int], list[dict]] = {}
    for rep in range(a.reps):  # every configuration once per rep, so the machine's drift reaches all of them
        for label, C, slots, speculate, k, chunk in configs:
            session = load(a.engines, "fp32", speculate, options, config=SpeculativeConfig(draft_tokens=k),
                           parallel=slots, prefill_chunk=chunk)
            _run(session, prompts[::-1], C, C, lengths)  # warm-up: pass costs and acceptance measured
            r = _run(session, prompts, C, a.answers, lengths)
            answers = r.pop("answers")
            r["prefill_chunk"] = getattr(session, "prefill_chunk", None)
            r["slots"] = slots
            r["identical"] = sum(want[key] == v for key, v in answers.items())
            runs.setdefault((label, C), []).append(r)
            print(json.dumps({"rep": rep + 1, "mode": label, "concurrency": C, **r}), flush=True)
            del session
            gc.collect()  # the last session's engines and caches go before the next one opens
    rows = _medians(runs, len(prompts))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"engines": a.engines, "machine": platform.processor() or platform.machine(),
            "onnxruntime": ort.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "max_new_tokens": a.max_new_tokens, "lengths": a.lengths, "answers": a.answers, "reps": a.reps,
            "command": "python -m experiments.batch_load " + " ".join(sys.argv[1:] if argv is None else argv)}
    (out / "batch_load.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _write_table(out, rows)
    _plot(out, rows)
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/smollm2-135m")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--answers", type=int, default=16, help="answers per (mode, concurrency), timed")
    ap.add_argument("--reps", type=int, default=1, help="runs of every (mode, concurrency), interleaved; the tables "
                                                        "give their medians")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lengths", choices=("equal", "varied"), default="equal",
                    help="every answer --max-new-tokens long, or 0.5x-1.5x of it (streams out of step: prefills "
                         "land while others decode)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--categories", default="chat,code,qa,summarize,math,edit")
    ap.add_argument("--out", default="bench-out/batch")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                    help="prompt set (JSONL, the bench's format)")
    ap.add_argument("--prefill-chunk", default="", metavar="T[,T...]",
                    help="chunked prefill sizes to run each batched (mode, C) at (0 = one pass; default: the "
                         "runtime's default only)")
    ap.add_argument("--slots", type=int, default=0,
                    help="run every C on a BatchSession of at least this many slots (`specrt serve --parallel "
                         "N` with C clients); default: C slots, and the one-stream Session at C = 1")
    return ap


def _medians(runs: dict, n_prompts: int) -> list[dict]:
    """One row per (mode, C): the median of each figure over the reps."""
    rows = []
    for (label, C), rs in runs.items():  # the median of each figure over the reps
        row = {"mode": label, "concurrency": C, "slots": rs[0]["slots"], "prefill_chunk": rs[0]["prefill_chunk"],
               "reps": len(rs)}
        for key in ("tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "wall_s"):
            vals = [r[key] for r in rs if r[key] is not None]
            row[key] = round(float(np.median(vals)), 1) if vals else None
        row["tok_s_reps"] = [r["tok_s"] for r in rs]
        row["identical"] = f"{min(r['identical'] for r in rs)}/{n_prompts}"
        rows.append(row)
    return rows


def _write_table(out: Path, rows: list[dict]) -> None:
    """batch_load.md: every row, and its tok/s against its mode's one stream."""
    one = {r["mode"]: r["tok_s"] for r in rows if r["concurrency"] == 1}
    lines = ["| mode | C | tok/s (all streams) | tok/s of each rep | vs one stream (same mode) | ITL p50 ms "
             "| ITL p99 ms | TTFT p50 ms | TTFT p99 ms | identical, worst rep |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = one.get(r["mode"].split(", chunk")[0])
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['tok_s']} | {' / '.join(map(str, r['tok_s_reps']))} | "
                     + (f"{r['tok_s'] / base:.2f}x" if base else "")
                     + f" | {r['itl_p50_ms']} | {r['itl_p99_ms']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} "
                       f"| {r['identical']} |")
    (out / "batch_load.md").write_text("\n".join(x for x in lines if x) + "\n")


def _plot(out: Path, rows: list[dict]) -> None:
    """batch_load.png: tok/s and p99 inter-token latency against the streams (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for name in dict.fromkeys(r["mode"] for r in rows if r["concurrency"] > 1):
            base = name.split(", chunk")[0]  # its C = 1 point is the one-stream row of its mode
            pts = [r for r in rows if r["mode"] == name or (r["mode"] == base and r["concurrency"] == 1)]
            ax1.plot([r["concurrency"] for r in pts], [r["tok_s"] for r in pts], marker="o", label=name)
            ax2.plot([r["concurrency"] for r in pts], [r["itl_p99_ms"] for r in pts], marker="o", label=name)
        ax1.set_xlabel("concurrent streams")
        ax1.set_ylabel("tokens/s, all streams")
        ax2.set_xlabel("concurrent streams")
        ax2.set_ylabel("inter-token latency p99, ms")
        if ax1.lines:  # a run at C = 1 only has no curve
            ax1.legend()
        fig.tight_layout()
        fig.savefig(out / "batch_load.png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
