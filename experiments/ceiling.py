"""How fast can prompt lookup (and Medusa) be on these prompts at best? A replay of the target's greedy outputs.

For each prompt: the target's greedy output (our fp32 engine), its prefill time and the measured cost of a w-token
pass; every round is then replayed offline for the shipped PromptLookup and for an oracle (the past occurrence whose
continuation the target keeps longest), each at its best fixed draft length; `--medusa HEADS.npz` replays Medusa's
trees the same way. Upper bounds: if the oracle stays under a goal, no prompt-lookup policy reaches it here.

    python -m experiments.ceiling --engines engines/smollm2-135m --categories summarize,code,chat
    python -m experiments.ceiling --categories chat,qa,translation --medusa heads/smollm2-135m.npz
More: docs/bench-notes.md, "Module notes: experiments/ceiling.py".
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.runtime.proposers import Context, PromptLookup
from specrt.bench.prompts import DEFAULT_PROMPTS, CATEGORIES, load_prompts, select

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


def replay(accepted, costs) -> tuple[int, int, float]:
    """(tokens, rounds, pass cost) over one output when a round at position i keeps accepted[i] draft tokens, then
    the target's bonus token, and costs costs[i] (in decode steps)."""
    i = rounds = 0
    total = 0.0
    n = len(accepted)
    while i < n:
        total += costs[i]
        rounds += 1
        i += min(int(accepted[i]), n - 1 - i) + 1   # the last token of the output ends the request
    return n, rounds, total


def replay_rounds(bucket: list[int], accepted: list[int], lengths: list[int], cost) -> tuple[int, int, float]:
    """(tokens, rounds, pass cost) of greedy speculation with draft length lengths[bucket] per round."""
    ks = [lengths[b] for b in bucket]
    return replay([min(a, k) for a, k in zip(accepted, ks)], [cost(k + 1) for k in ks])


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


def measure_costs(engine, tokens: np.ndarray, context: int, max_width: int = MAX_DRAFT + 1,
                  reps: int = 9) -> np.ndarray:
    """Seconds of a w-token greedy pass as the loop runs it (`argmax`: through the logit screen up to its row
    limit), w = 1..max_width (median of reps, widths interleaved), after `context` tokens of real text, fed
    the text that follows (a pass of one repeated token made the screen's rescoring far busier)."""
    from specrt.pipeline import time_passes

    need = context + max_width
    tokens = np.resize(np.asarray(tokens, np.int64), max(need, len(tokens)))
    engine.rewind(0)
    engine.reserve(need)
    engine.forward(tokens[:context])
    engine.commit(context)
    out = np.zeros(max_width + 1)
    out[1:] = time_passes(engine, tokens, context, range(1, max_width + 1), positions=1, reps=reps)
    return out


def _summary(rs: list[Replay], outcomes, t1: float, digits: int) -> dict:
    """tau, decode speedup and end-to-end speedup (with the measured prefill, the way `specrt bench` counts tok/s:
    the same tokens in less time) of one category's replays; outcomes: (tokens, rounds, pass cost) per replay."""
    tok = rounds = steps = plain = spec = 0.0
    for r, (n, k, c) in zip(rs, outcomes):
        tok, rounds, steps = tok + n, rounds + k, steps + c
        plain += r.prefill_s + n * t1
        spec += r.prefill_s + c * t1
    return {"tau": round(tok / rounds, digits), "decode_speedup": round(tok / steps, digits),
            "speedup": round(plain / spec, digits)}


def report(replays: list[Replay], costs: np.ndarray, buckets: int) -> list[dict]:
    rows = []
    t1 = costs[1]
    rel = lambda w: costs[min(w, len(costs) - 1)] / t1  # noqa: E731  (pass cost in decode steps)
    for cat in [c for c in CATEGORIES if any(r.category == c for r in replays)]:
        rs = [r for r in replays if r.category == cat]
        row = {"category": cat, "prompts": len(rs), "tokens": sum(r.new_tokens for r in rs)}
        for which in ("lookup", "oracle"):
            ls = best_lengths(rs, which, rel, buckets)
            outcomes = [replay_rounds(r.bucket, getattr(r, which), ls, rel) for r in rs]
            row[which] = {"lengths": ls, **_summary(rs, outcomes, t1, 2)}
        rows.append(row)
    return rows


MEDUSA_RANKS, MEDUSA_NODES = 10, 63  # a pass returns at most 64 rows of logits (max_pass_tokens)


def onnx_heads(path: Path):
    """A heads engine file as a batch function: hidden [N, H], pending tokens [N] -> candidates [N, K, topk]."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    token = any(i.name == "token" for i in sess.get_inputs())
    return lambda hidden, tokens: sess.run(["candidates"],
                                           {"hidden": hidden, **({"token": tokens} if token else {})})[0]


def medusa_ranks(heads, hidden: np.ndarray, seq: list[int], prompt_len: int, n: int, ranks: int) -> np.ndarray:
    """[n, K] rank of the target's own token among head k's top `ranks` candidates (`ranks`: not among them) at
    each decode position i of an n-token output (context seq[:P + i]: the heads read the hidden state at
    P + i - 2 and the pending token seq[P + i - 1], head k guesses seq[P + i - 1 + k]). Row 0 is the prefill
    round, which drafts nothing; guesses past the output's end are misses. heads: see onnx_heads."""
    P, arr = prompt_len, np.asarray(seq, np.int64)
    rows = np.arange(1, n)
    cand = heads(np.ascontiguousarray(hidden[P + rows - 2], np.float32), arr[P + rows - 1])   # [n - 1, K, R]
    K = cand.shape[1]
    out = np.full((n, K), ranks, np.int64)
    for k in range(1, K + 1):
        where = P + rows - 1 + k
        ok = where < P + n
        hit = cand[ok, k - 1, :ranks] == arr[where[ok]][:, None]
        out[rows[ok], k - 1] = np.where(hit.any(1), hit.argmax(1), ranks)
    return out


def tree_accepts(ranks: np.ndarray, tree: set | None, miss: int = MEDUSA_RANKS) -> np.ndarray:
    """[n] draft nodes a round at each position keeps: the longest path of `tree` (a prefix-closed set of rank
    paths) whose every head is right at its rank; tree None: the unlimited tree, every path of candidates
    ranked below `miss` (medusa_ranks' "not among them"). Row 0, the prefill round, keeps none."""
    if tree is None:
        out = np.cumprod(ranks < miss, axis=1).sum(1)
    else:
        depth = max((len(p) for p in tree), default=0)
        out = np.zeros(len(ranks), np.int64)
        for i in range(1, len(ranks)):
            a = 0
            while a < depth and tuple(ranks[i, : a + 1].tolist()) in tree:
                a += 1
            out[i] = a
    out[0] = 0
    return out


def replay_tree(ranks: np.ndarray, tree: set | None, cost_of_pass: float,
                miss: int = MEDUSA_RANKS) -> tuple[int, int, float]:
    """(tokens, rounds, pass cost) of Medusa with a fixed tree over one output (tree_accepts): the prefill round
    costs one step, every other round cost_of_pass."""
    return replay(tree_accepts(ranks, tree, miss), [1.0] + [cost_of_pass] * (len(ranks) - 1))


def medusa_report(replays: list[Replay], ranks_by_case: dict[str, np.ndarray], costs: np.ndarray,
                  ranks: int) -> list[dict]:
    """Per category: the best in-sample tree (a prefix of the joint-accuracy order) at the measured pass costs,
    with its tau and speedups, the 1-node tree, and tau of the unlimited tree of top-`ranks` paths."""
    from specrt.export.medusa_tree import tree_order

    t1, top = costs[1], len(costs) - 1
    rows = []
    for cat in [c for c in CATEGORIES if any(r.category == c for r in replays)]:
        rs = [r for r in replays if r.category == cat]
        rk = [ranks_by_case[r.case_id] for r in rs]
        order, _ = tree_order(np.concatenate([x[1:] for x in rk]), ranks, MEDUSA_NODES)

        def run(tree: set | None, nodes: int) -> dict:
            rel = costs[min(nodes + 1, top)] / t1
            return {"nodes": nodes, **_summary(rs, [replay_tree(x, tree, rel, ranks) for x in rk], t1, 3)}

        curve = [run(set(map(tuple, order[:m])), m) for m in range(1, len(order) + 1)]
        rows.append({"category": cat, "prompts": len(rs), "best": max(curve, key=lambda c: c["speedup"]),
                     "one_node": curve[0], "max_tau": max(c["tau"] for c in curve),
                     "tau_all": run(None, 0)["tau"], "curve": curve})
    return rows


def _table(columns: list[str], rows: list[list]) -> None:
    """A markdown table on stdout: the first column left-aligned, the rest right-aligned."""
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from specrt.export.graph import read_initializers
    from specrt.export.medusa import export_heads_onnx, load_heads
    from specrt.manifest import load_manifest
    from specrt.runtime.engine import EngineOptions
    from specrt.runtime.session import load
    from specrt.runtime.tokenizer import Message

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=Path, default=Path("engines/smollm2-135m"), help="engine set (its fp32 target)")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompt file (JSONL, as `specrt bench`)")
    ap.add_argument("--categories", default="summarize,code,chat", help="comma-separated prompt categories")
    ap.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap each prompt's max_new_tokens")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (the pass costs depend on it)")
    ap.add_argument("--medusa", type=Path, default=None, help="also replay Medusa trees of these heads (.npz)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    cases = select(load_prompts(a.prompts), categories=tuple(a.categories.split(",")),
                   per_category=a.per_category, max_new_tokens=a.max_new_tokens)
    manifest = load_manifest(a.engines)
    gen = load(manifest, "fp32", options=EngineOptions(threads=a.threads)).generator
    eos = next(iter(gen.codec.eos_token_ids))
    heads = None
    if a.medusa:  # all the file's heads, top MEDUSA_RANKS (the session holds the graph: the file can go)
        lm_head = read_initializers(a.engines / gen.entry.file, "lm_head.weight_t")[0].T
        with tempfile.TemporaryDirectory(prefix="specrt-ceiling-") as tmp:
            export_heads_onnx(load_heads(a.medusa), lm_head, Path(tmp) / "heads.onnx", MEDUSA_RANKS)
            heads = onnx_heads(Path(tmp) / "heads.onnx")
        gen.engine.enable_hidden()
    replays, prompt_lengths, medusa_ranks_by_case, texts = [], [], {}, []
    for c in cases:
        messages = [Message(r, t) for r, t in c.messages]
        res = gen.generate(messages, max_new_tokens=c.max_new_tokens)
        prompt = gen.prompt_ids(messages)
        out = res.token_ids + ([eos] if res.stats.finish_reason == "eos" else [])  # the target emits EOS too
        replays.append(Replay(c.id, c.category, len(out), res.stats.ttft_s, *accepted_runs(prompt, out)))
        prompt_lengths.append(len(prompt))
        texts.append(prompt + out)
        if heads:  # the hidden states of one pass over prompt + output (what decoding computed, to float noise)
            gen.engine.rewind(0)
            gen.engine.reserve(len(prompt) + len(out))
            gen.engine.forward(np.asarray(prompt + out, np.int64))
            medusa_ranks_by_case[c.id] = medusa_ranks(heads, gen.engine.hidden, prompt + out, len(prompt),
                                                      len(out), MEDUSA_RANKS)
        print(f"{c.id}: {len(prompt)} prompt + {len(out)} new tokens", flush=True)
    context = int(np.median(prompt_lengths))
    longest = max(texts, key=len)
    costs = measure_costs(gen.engine, longest, min(context, len(longest) - 1),
                          MEDUSA_NODES + 1 if heads else MAX_DRAFT + 1)
    print("pass cost (steps) by width: " + " ".join(f"{w}:{costs[w] / costs[1]:.2f}" for w in range(1, len(costs))))
    rows = report(replays, costs, PromptLookup().buckets)
    _table(["category", "prompts", "lookup tau", "lookup decode", "lookup end-to-end", "oracle tau", "oracle decode",
            "oracle end-to-end"],
           [[r["category"], r["prompts"], r["lookup"]["tau"], f"{r['lookup']['decode_speedup']}x",
             f"{r['lookup']['speedup']}x", r["oracle"]["tau"], f"{r['oracle']['decode_speedup']}x",
             f"{r['oracle']['speedup']}x"] for r in rows])
    result = {"rows": rows, "pass_cost_steps": (costs[1:] / costs[1]).round(3).tolist(), "context": context}
    if heads:
        mrows = medusa_report(replays, medusa_ranks_by_case, costs, MEDUSA_RANKS)
        print()
        _table(["category", "prompts", "1-node tau", "1-node decode", "1-node end-to-end", "best nodes", "best tau",
                "best decode", "best end-to-end", "max tau (<= 63 nodes)", "tau, every top-10 path"],
               [[r["category"], r["prompts"], r["one_node"]["tau"], f"{r['one_node']['decode_speedup']}x",
                 f"{r['one_node']['speedup']}x", r["best"]["nodes"], r["best"]["tau"],
                 f"{r['best']['decode_speedup']}x", f"{r['best']['speedup']}x", r["max_tau"], r["tau_all"]]
                for r in mrows])
        result["medusa"] = mrows
        result["medusa_ranks"] = {k: v.tolist() for k, v in medusa_ranks_by_case.items()}  # for offline replays
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
