"""How fast can any drafter be on the repeating workloads (`specrt bench --repeat-calls`)? A perfect-drafter bound.

Runs the voice-agent calls and the code-edit loop plain (greedy, fp32), keeping each turn's prefill time, total time
and new tokens, then times a w-token verification pass (w = 1..17, the loop's widest chain: 16 drafted tokens) after
a typical context. The bound gives every turn its measured prefill and then decodes the rest with passes that keep
all w tokens, at the best w: what a drafter that is never wrong, free to run, and chained would reach. Per-round
Python work is left out, so real modes stay under it. If the bound is under a goal, no drafter reaches it here.

    python -m experiments.repeat_ceiling --engines engines/smollm2-135m --calls 32 --warm 10
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

MAX_WIDTH = 17


def bound(ttft: float, new_tokens: int, costs: np.ndarray) -> float:
    """A turn's seconds with its prefill and perfect passes of the best width (costs[w] = a w-token pass)."""
    rest = max(new_tokens - 1, 0)
    return ttft + min(math.ceil(rest / w) * costs[w] for w in range(1, len(costs)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=Path, default=Path("engines/smollm2-135m"))
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--edits", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--warm", type=int, default=10, help="voice ratios count from this call on")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)

    from experiments.ceiling import measure_costs
    from specrt.bench.repeat import EDITS, FILE, SYSTEM, voice_calls
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.tokenizer import Message

    session = load(a.engines, "fp32", "off")  # the bench's own path: a Session, its prefix cache included
    gen = session.generator
    greedy = SamplingParams(temperature=0.0)
    rows, texts = [], []

    def turn(workload: str, call: int, msgs: list) -> str:
        r = session.generate(msgs, max_new_tokens=a.max_tokens, sampling=greedy)
        rows.append({"workload": workload, "call": call, "ttft_s": r.stats.ttft_s, "total_s": r.stats.total_s,
                     "tokens": len(r.token_ids)})
        texts.append(gen.prompt_ids(msgs) + list(r.token_ids))
        return r.text

    for i, call in enumerate(voice_calls(a.calls)):
        msgs = [Message("system", SYSTEM)]
        for user in call:
            msgs.append(Message("user", user))
            msgs.append(Message("assistant", turn("voice", i, msgs)))
    code = FILE
    for i, ask in enumerate(EDITS[:a.edits]):
        msgs = [Message("system", "You edit Python files. Reply with the whole updated file, nothing else."),
                Message("user", f"{ask}\n\n```python\n{code}```")]
        answer = turn("code", i, msgs)
        code = answer.split("```python\n")[-1].split("```")[0] if "```" in answer else answer
        code = code if code.endswith("\n") else code + "\n"

    typical = sorted(texts, key=len)[len(texts) // 2]
    costs = measure_costs(gen.engine, np.asarray(typical), min(len(typical) - 1, 256), MAX_WIDTH)
    out = {"engines": str(a.engines), "pass_ms": [round(c * 1e3, 2) for c in costs[1:]]}
    for workload, lo in (("voice", a.warm - 1), ("code", 0)):
        part = [r for r in rows if r["workload"] == workload and r["call"] >= lo]
        plain = sum(r["total_s"] for r in part)
        prefill = sum(r["ttft_s"] for r in part)
        best = sum(bound(r["ttft_s"], r["tokens"], costs) for r in part)
        out[workload] = {"from_call": lo + 1, "turns": len(part), "plain_tok_s": round(sum(r["tokens"] for r in part)
                                                                                       / plain, 2),
                         "prefill_share": round(prefill / plain, 3), "perfect_drafter_x": round(plain / best, 2)}
    print(json.dumps(out, indent=1))
    if a.out:
        a.out.write_text(json.dumps({**out, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
