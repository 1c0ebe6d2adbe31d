"""Multi-turn time to first token with and without KV reuse, in-process (what `specrt serve` does per request):
a voice-assistant conversation of a ~340-token system prompt and 5 user turns (specrt.bench.multiturn's), each turn
resending the whole history, greedy. Prints each turn's median TTFT over --reps runs of each setting, interleaved,
and whether the tokens are identical.

    python -m experiments.multiturn --engines engines/smollm2-135m --reps 3
"""

from __future__ import annotations

import argparse

import numpy as np

from specrt.bench.multiturn import TURNS, system_prompt


def conversation(engines: str, precision: str, speculate: str, reuse: bool, max_new_tokens: int = 48):
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.tokenizer import Message

    system = system_prompt()
    session = load(engines, precision, speculate)
    session.generator.keep_cache = reuse
    history, ttft, tokens, cached = [Message("system", system)], [], [], []
    for turn in TURNS:
        history.append(Message("user", turn))
        r = session.generate(list(history), max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=0.0))
        ttft.append(r.stats.ttft_s)
        tokens.append(list(r.token_ids))
        cached.append((r.stats.prompt_tokens, r.stats.cached_tokens))
        history.append(Message("assistant", r.text))
    return ttft, tokens, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/smollm2-135m", help="engine set folder")
    ap.add_argument("--precision", default="fp32", help="target precision (fp32: tokens must be identical)")
    ap.add_argument("--speculate", default="off", help="as for `specrt generate` (off, auto, draft, ...)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each setting; each turn's TTFT is their median")
    a = ap.parse_args()
    runs = {False: [], True: []}
    for _ in range(a.reps):
        for reuse in (False, True):
            runs[reuse].append(conversation(a.engines, a.precision, a.speculate, reuse))
    cold = np.median([r[0] for r in runs[False]], axis=0)
    warm = np.median([r[0] for r in runs[True]], axis=0)
    same = all(c[1] == w[1] for c, w in zip(runs[False], runs[True]))
    print("| turn | prompt tokens | cached | TTFT ms, no reuse | TTFT ms, reuse | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, ((p, c), x, y) in enumerate(zip(runs[True][0][2], cold, warm)):
        print(f"| {i + 1} | {p} | {c} | {x * 1e3:.0f} | {y * 1e3:.0f} | {y / x:.2f}x |")
    print(f"identical tokens in every turn and run: {same}")


if __name__ == "__main__":
    main()
