"""Does suffix decoding's store of earlier answers cost it on prompts unlike earlier ones? The shipped prompt set,
greedy fp32, one pass in a seeded random order per prompt: plain, prompt lookup, suffix, and suffix without a store
(`--suffix-cache 0`: this request only). Prints tok/s over plain (all tokens over all seconds), overall and per
category, and checks every mode's output equals plain's.

    python -m experiments.suffix_store --engines engines/smollm2-135m [--categories code,qa]
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=Path, default=Path("engines/smollm2-135m"))
    ap.add_argument("--categories", default=None, help="comma-separated prompt categories (default: all)")
    a = ap.parse_args(argv)

    from specrt.bench.prompts import DEFAULT_PROMPTS, load_prompts, select
    from specrt.manifest import load_manifest
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.speculative import SpeculativeConfig
    from specrt.runtime.tokenizer import Message

    m, shared = load_manifest(a.engines), {}
    sessions = {"off": load(m, "fp32", "off", shared=shared),
                "prompt-lookup": load(m, "fp32", "prompt-lookup", shared=shared),
                "suffix": load(m, "fp32", "suffix", shared=shared),
                "suffix, no store": load(m, "fp32", "suffix", shared=shared,
                                         config=SpeculativeConfig(suffix_cache_mib=0))}
    cases = select(load_prompts(DEFAULT_PROMPTS), categories=tuple(a.categories.split(",")) if a.categories else None)
    greedy, rng = SamplingParams(temperature=0.0), random.Random(0)
    done = defaultdict(lambda: [0, 0.0])  # (mode, category) -> [tokens, seconds]
    for c in cases:
        msgs = [Message(r, t) for r, t in c.messages]
        out = {}
        for name in rng.sample(list(sessions), len(sessions)):
            r = sessions[name].generate(msgs, max_new_tokens=c.max_new_tokens, sampling=greedy)
            out[name] = r.token_ids
            for key in ((name, c.category), (name, "all")):
                done[key][0] += len(r.token_ids)
                done[key][1] += r.stats.total_s
        assert all(ids == out["off"] for ids in out.values()), f"{c.id}: a mode's output differs from plain's"
    for cat in ["all"] + sorted({c.category for c in cases}):
        base = done[("off", cat)][0] / done[("off", cat)][1]
        print(f"{cat:>12}: " + "  ".join(f"{n} {done[(n, cat)][0] / done[(n, cat)][1] / base:.3f}x"
                                         for n in sessions))


if __name__ == "__main__":
    main()
