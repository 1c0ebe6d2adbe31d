"""How fast can prompt lookup be on these prompts at best? A replay of the target's greedy outputs.

For each prompt: the target's greedy output (our fp32 engine), its prefill time and the measured
cost of a w-token pass, w = 1..17. Then every round is replayed offline for two candidates:

  lookup   what the shipped PromptLookup drafts (longest n-gram, most recent occurrence)
  oracle   the past occurrence of the context's last token whose continuation the target keeps
           longest (what any choice among past occurrences can reach: an upper bound for
           candidate ranking, trees of candidates excepted, which pay for their extra nodes)

each with the best fixed draft length per match-length bucket (found by coordinate search on the
same outputs: an upper bound for what the adaptive controller can pick, which must learn them).
Per-round Python overhead is left out; the first token is counted as a decode step on both sides
(the loop really drafts in the prefill pass), one step in ~100. Reported per category: tau, decode speedup (tokens per
unit of pass cost) and end-to-end speedup with the measured prefill, the way `specrt bench`
counts tok/s. If the oracle stays under a goal, no prompt-lookup policy reaches it on these prompts.

    python -m specrt.bench.ceiling --engines engines/smollm2-135m --categories summarize,code,chat
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime.proposers import Context, PromptLookup
from .prompts import DEFAULT_PROMPTS, CATEGORIES, load_prompts, select

MAX_DRAFT = 16


@dataclass
class Replay:
    """One prompt's greedy output and, per decode position, what each candidate would get accepted."""
    case_id: str
    category: str
    new_tokens: int
    prefill_s: float
    bucket: list[int]   # the shipped lookup's bucket at each position (len(sizes) = no match)
    lookup: list[int]   # tokens of its continuation the target keeps there (up to MAX_DRAFT)
    oracle: list[int]   # best over every past occurrence of the last token


def accepted_runs(prompt: list[int], output: list[int]) -> tuple[list, list, list]:
    """(bucket, lookup, oracle) per decode position i (context = prompt + output[:i]); the lookup is
    the shipped PromptLookup with its default n-gram sizes."""
    seq = list(prompt) + list(output)
    ctx = Context(prompt, len(seq) + 1)
    pl = PromptLookup(max_tokens=MAX_DRAFT)
    pl.start(ctx)
    bucket, lookup, oracle = [], [], []
    arr = np.asarray(seq, np.int64)
    for i in range(len(output)):
        L = len(prompt) + i
        future = seq[L: L + MAX_DRAFT]
        bucket.append(pl.bucket(ctx))
        lookup.append(_common(pl.propose(ctx, MAX_DRAFT).tokens.tolist(), future))
        best = 0
        for e in np.flatnonzero(arr[: L - 1] == seq[L - 1]) + 1:  # continuations of the last token's occurrences
            best = max(best, _common(seq[e: min(e + MAX_DRAFT, L)], future))
        oracle.append(best)
        ctx.extend(arr[L: L + 1])
    return bucket, lookup, oracle


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay_rounds(bucket: list[int], accepted: list[int], lengths: list[int], cost) -> tuple[int, int, float]:
    """(tokens, rounds, pass cost) of greedy speculation with draft length lengths[bucket] per round."""
    i = rounds = 0
    total = 0.0
    n = len(bucket)
    while i < n:
        k = lengths[bucket[i]]
        a = min(accepted[i], k, n - 1 - i)   # the last token of the output ends the request
        total += cost(k + 1)
        rounds += 1
        i += a + 1
    return n, rounds, total


def best_lengths(replays: list[Replay], which: str, cost, buckets: int) -> list[int]:
    """Per-bucket fixed draft lengths maximising tokens per pass cost (coordinate search)."""
    lengths = [8] * (buckets - 1) + [0]   # the no-match bucket never drafts

    def rate(ls):
        tok = tot = 0.0
        for r in replays:
            n, _, c = replay_rounds(r.bucket, getattr(r, which), ls, cost)
            tok, tot = tok + n, tot + c
        return tok / tot

    for _ in range(2):
        for b in range(buckets - 1):
            lengths[b] = max(range(MAX_DRAFT + 1), key=lambda k: rate(lengths[:b] + [k] + lengths[b + 1:]))
    return lengths


def measure_costs(engine, context: int, reps: int = 9) -> np.ndarray:
    """Seconds of a w-token pass, w = 1..MAX_DRAFT + 1 (median of reps), at the given context length."""
    engine.rewind(0)
    engine.forward(np.ones(context, np.int64))
    engine.commit(context)
    out = np.zeros(MAX_DRAFT + 2)
    for w in range(1, MAX_DRAFT + 2):
        tok, times = np.ones(w, np.int64), []
        for _ in range(reps):
            t0 = time.perf_counter()
            engine.forward(tok, num_logits=w)
            times.append(time.perf_counter() - t0)
        out[w] = float(np.median(times))
    return out


def report(replays: list[Replay], costs: np.ndarray, buckets: int) -> list[dict]:
    rows = []
    t1 = costs[1]
    rel = lambda w: costs[min(w, MAX_DRAFT + 1)] / t1  # noqa: E731  (pass cost in decode steps)
    for cat in [c for c in CATEGORIES if any(r.category == c for r in replays)]:
        rs = [r for r in replays if r.category == cat]
        row = {"category": cat, "prompts": len(rs), "tokens": sum(r.new_tokens for r in rs)}
        for which in ("lookup", "oracle"):
            ls = best_lengths(rs, which, rel, buckets)
            tok = rounds = steps = plain = spec = 0.0
            for r in rs:
                n, k, c = replay_rounds(r.bucket, getattr(r, which), ls, rel)
                tok, rounds, steps = tok + n, rounds + k, steps + c
                plain += r.prefill_s + n * t1   # the bench's tok/s ratio: the same tokens in less time
                spec += r.prefill_s + c * t1
            row[which] = {"lengths": ls, "tau": round(tok / rounds, 2), "decode_speedup": round(tok / steps, 2),
                          "speedup": round(plain / spec, 2)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    from ..manifest import load_manifest
    from ..runtime.generate import Generator
    from ..runtime.tokenizer import Message

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=Path, default=Path("engines/smollm2-135m"))
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--categories", default="summarize,code,chat")
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    cases = select(load_prompts(a.prompts), categories=tuple(a.categories.split(",")),
                   per_category=a.per_category, max_new_tokens=a.max_new_tokens)
    gen = Generator(load_manifest(a.engines), "fp32", a.threads)
    eos = next(iter(gen.codec.eos_token_ids))
    replays, prompt_lengths = [], []
    for c in cases:
        messages = [Message(r, t) for r, t in c.messages]
        res = gen.generate(messages, max_new_tokens=c.max_new_tokens)
        prompt = gen.prompt_ids(messages)
        out = res.token_ids + ([eos] if res.stats.finish_reason == "eos" else [])  # the target emits EOS too
        replays.append(Replay(c.id, c.category, len(out), res.stats.ttft_s, *accepted_runs(prompt, out)))
        prompt_lengths.append(len(prompt))
        print(f"{c.id}: {len(prompt)} prompt + {len(out)} new tokens", flush=True)
    costs = measure_costs(gen.engine, int(np.median(prompt_lengths)))
    print("pass cost (steps) by width: " + " ".join(f"{w}:{costs[w] / costs[1]:.2f}" for w in range(1, MAX_DRAFT + 2)))
    rows = report(replays, costs, PromptLookup().buckets)
    print("| category | prompts | lookup tau | lookup decode | lookup end-to-end | oracle tau | oracle decode | oracle end-to-end |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lk, orc = r["lookup"], r["oracle"]
        print(f"| {r['category']} | {r['prompts']} | {lk['tau']} | {lk['decode_speedup']}x | {lk['speedup']}x "
              f"| {orc['tau']} | {orc['decode_speedup']}x | {orc['speedup']}x |")
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "pass_cost_steps": (costs[1:] / costs[1]).round(3).tolist()}, indent=1))


if __name__ == "__main__":
    main()
