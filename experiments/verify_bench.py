"""Time one verification round: K = 8 draft tokens over Qwen2.5's vocabulary.

    .venv/bin/python -m experiments.verify_bench [--rounds 2000] [--vocab 151936] [--k 8]

Only ``verify`` is timed; p and q are prepared beforehand (in the runtime they
come from ``probs_from_logits`` on the engine's logits). Cases cover the paths
with different costs: the bonus draw after a full accept, the residual
norm(max(0, p - q)) after a stochastic rejection, zero-and-renormalise for a
one-hot draft, a realistic mix (q = noisy p, tokens drawn from q), a tree,
and greedy (argmax only). Reports median / p99 microseconds per round.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specrt.runtime.sampling import SamplingParams, probs_from_logits, sample
from specrt.runtime.verify import Draft, verify, verify_greedy


def _time(fn, rounds: int) -> tuple[float, float]:
    for _ in range(20):                      # warm caches and numpy dispatch
        fn(0)
    t = np.empty(rounds)
    for i in range(rounds):
        t0 = time.perf_counter_ns()
        fn(i)
        t[i] = time.perf_counter_ns() - t0
    return float(np.median(t)) / 1e3, float(np.percentile(t, 99)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--k", type=int, default=8)
    a = ap.parse_args()
    V, K = a.vocab, a.k
    g = np.random.default_rng(0)
    prm = SamplingParams(temperature=0.8)

    # Peaked, LLM-like rows: a few tokens carry most of the mass.
    zt = (g.standard_normal((K + 1, V)) * 3.0).astype(np.float32)
    zd = (zt[:K] + g.standard_normal((K, V)).astype(np.float32) * 1.5)
    p = probs_from_logits(zt, prm)
    q = probs_from_logits(zd, prm)
    t0 = time.perf_counter()
    out = np.empty_like(zt)
    for _ in range(50):
        probs_from_logits(zt, prm, out=out)
    softmax_us = (time.perf_counter() - t0) / 50 * 1e6

    top = p.argmax(axis=1)
    pool = [np.array([sample(q[i], g) for i in range(K)]) for _ in range(64)]
    rng = np.random.default_rng(1)
    far = (top[:K] + V // 2) % V                         # tokens with tiny p: rejected at 0
    pq = np.concatenate([q, p[-1:]])                    # p = q on every drafted row
    tree_par = np.array([-1, -1, 0, 0, 1, 2, 4, 6])      # 8 nodes, depth 5
    # Fresh engine output is not in L2: rotate over copies bigger than L2 (~44 MB).
    cold = [(p * np.float32(1.0), q * np.float32(1.0)) for _ in range(4)]
    cases = {
        "sampled chain, all accepted (p = q, bonus)":
            lambda i: verify(pq, Draft(top[:K], q=q), rng),
        "sampled chain, rejected at 0 (residual)":
            lambda i: verify(p, Draft(far, q=q), rng),
        "sampled chain, rejected at K-1 (residual)":
            lambda i: verify(p, Draft(np.r_[top[:K - 1], far[-1]], q=q), rng),
        "sampled chain, realistic mix (tokens ~ q)":
            lambda i: verify(p, Draft(pool[i % 64], q=q), rng),
        "one-hot chain, rejected at 0":
            lambda i: verify(p, Draft(far), rng),
        "one-hot chain, all accepted":
            lambda i: verify(p, Draft(top[:K]), rng),
        "sampled chain, realistic mix, cold cache":
            lambda i: verify(cold[i % 4][0], Draft(pool[i % 64], q=cold[i % 4][1]), rng),
        "sampled tree (8 nodes), realistic mix":
            lambda i: verify(p, Draft(pool[i % 64], parents=tree_par, q=q), rng),
        "sampled tree (8 nodes), realistic, cold cache":
            lambda i: verify(cold[i % 4][0], Draft(pool[i % 64], parents=tree_par,
                                                   q=cold[i % 4][1]), rng),
        "greedy chain (argmax given)":
            lambda i: verify_greedy(top, Draft(np.r_[top[:4], far[4:]])),
    }
    print(f"verify, K={K}, V={V}, {a.rounds} rounds, numpy {np.__version__}")
    worst = 0.0
    for name, fn in cases.items():
        med, p99 = _time(fn, a.rounds)
        worst = max(worst, med)
        print(f"  {name:45s} median {med:7.1f} us   p99 {p99:7.1f} us")
    print(f"worst median: {worst:.1f} us per round (budget 1000 us)")
    print(f"(not part of verify) probs_from_logits [{K + 1}, {V}] with out=: "
          f"{softmax_us:.0f} us")


if __name__ == "__main__":
    main()
