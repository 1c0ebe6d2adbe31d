"""Statistical proof that verification is lossless: emitted tokens ~ target.

Set-up: a toy target LM and an independent toy draft LM over V = 5 tokens,
both context-dependent (logits seeded by the context), both passed through
the same ``probs_from_logits`` with the same SamplingParams. A decode loop of
propose -> verify rounds runs until two tokens are emitted; the pair (t1, t2)
must follow P(t1, t2) = p(t1 | ()) * p(t2 | (t1,)). A chi-square test on
the V^2 cells of that joint checks it (cells with expected count < 5 are
pooled so the chi-square approximation holds; a count in a cell of target
probability 0 fails outright).

False-failure rate: every goodness-of-fit assertion (20 here, 2 in
test_sampling.py) uses ALPHA = 2e-8, so for a correct sampler the chance that
*any* of them fails is <= 22 * 2e-8 = 4.4e-7 <= 1e-6 (Bonferroni; nominal, via
the asymptotic chi-square tail). Seeds are fixed, so CI is deterministic;
the figure says how unlucky a seed would have to be to fail a correct build.
With 3000 samples each, the deliberately biased samplers below give
p-values < 1e-20 (13 orders of magnitude below ALPHA).

Power: ``test_biased_samplers_are_caught`` runs four deliberately wrong
verifiers through the same harness and requires p-values < ALPHA:
  no_residual     - on rejection draws from p instead of norm(max(0, p - q))
                    (for one-hot drafts: does not zero the rejected token);
  unnormalised    - draws from the residual without renormalising it
                    (inverse CDF with u in [0, 1); overflow lands on V - 1);
  siblings_vs_p   - tests each tree sibling against p instead of the residual
                    left by the siblings rejected before it;
  paths_longest   - verifies every root-to-leaf path independently as a chain
                    and keeps the longest acceptance (a classic tree bug).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from specrt.runtime import verify as verify_mod
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.verify import Draft, VerifyResult, verify

V = 5
N = 6000          # samples per configuration
ALPHA = 2e-8      # per assertion; see the module docstring for the 1e-6 budget

CHAIN1 = [-1]                      # K = 1: second token is often the bonus
CHAIN3 = [-1, 0, 1]
TREE = [-1, -1, 0, 0, 1, 2, -1]    # root: 0, 1, 6 (6 is a depth-1 leaf); depth 3
SHAPES = {"chain1": CHAIN1, "chain3": CHAIN3, "tree": TREE}
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_k3": SamplingParams(temperature=0.7, top_k=3),
    "t1.3_p0.8": SamplingParams(temperature=1.3, top_p=0.8),
}


class ToyLM:
    """Context -> probabilities, memoised; logits are a pure function of (seed, ctx)."""

    def __init__(self, seed: int, params: SamplingParams, scale: float = 1.5) -> None:
        self.seed, self.params, self.scale = seed, params, scale
        self.cache: dict[tuple, np.ndarray] = {}
        self.cdfs: dict[tuple, np.ndarray] = {}
        self.ranked: dict[tuple, list[int]] = {}

    def logits(self, ctx: tuple) -> np.ndarray:
        g = np.random.default_rng([self.seed, len(ctx), *ctx])
        return g.normal(0.0, self.scale, V).astype(np.float32)

    def probs(self, ctx: tuple) -> np.ndarray:
        if ctx not in self.cache:
            self.cache[ctx] = probs_from_logits(self.logits(ctx)[None], self.params)[0]
        return self.cache[ctx]

    def draw(self, ctx: tuple, rng: np.random.Generator) -> int:
        """Independent reference sampler (float64 inverse CDF), not the one under test."""
        if ctx not in self.cdfs:
            c = np.cumsum(self.probs(ctx).astype(np.float64))
            self.cdfs[ctx] = c / c[-1]
        return int(np.searchsorted(self.cdfs[ctx], rng.random(), side="right"))

    def ranking(self, ctx: tuple) -> list[int]:
        if ctx not in self.ranked:
            self.ranked[ctx] = np.argsort(-self.logits(ctx), kind="stable").tolist()
        return self.ranked[ctx]


def make_proposer(parents: list[int], draft_lm: ToyLM, stochastic: bool):
    par = np.array(parents, np.int64)
    rank = [sum(1 for j in range(i) if parents[j] == parents[i]) for i in range(len(parents))]
    is_chain = all(pi == i - 1 for i, pi in enumerate(parents))

    def propose(ctx: tuple, rng: np.random.Generator):
        toks, nctx, qrows = [], [], []
        for i, pi in enumerate(parents):
            pctx = ctx if pi < 0 else nctx[pi]
            q = draft_lm.probs(pctx)
            if stochastic:    # siblings i.i.d. from q at the parent context
                x = draft_lm.draw(pctx, rng)
            else:             # deterministic: the rank-th most likely draft logit
                x = draft_lm.ranking(pctx)[rank[i]]
            toks.append(x)
            nctx.append(pctx + (x,))
            qrows.append(q)
        d = Draft(tokens=np.array(toks, np.int64), parents=None if is_chain else par,
                  q=np.stack(qrows) if stochastic else None)
        return d, nctx

    return propose


def emitted_pairs(verifier, shape: str, stochastic: bool, params: SamplingParams,
                  seed: int, n: int = N):
    target, draft_lm = ToyLM(seed, params), ToyLM(seed + 1000, params)
    propose = make_proposer(SHAPES[shape], draft_lm, stochastic)
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V), np.int64)
    for _ in range(n):
        ctx: tuple = ()
        while len(ctx) < 2:
            d, nctx = propose(ctx, rng)
            p = np.stack([target.probs(ctx)] + [target.probs(c) for c in nctx])
            r = verifier(p, d, rng)
            ctx = ctx + tuple(r.tokens.tolist())
        counts[ctx[0], ctx[1]] += 1
    p0 = target.probs(()).astype(np.float64)
    joint = np.stack([p0[a] * target.probs((a,)).astype(np.float64) for a in range(V)])
    return counts, joint / joint.sum()


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts vs probs; 0.0 if a p = 0 cell was hit."""
    counts, probs = counts.ravel(), probs.ravel()
    if counts[probs == 0].any():
        return 0.0
    o, e = counts[probs > 0], probs[probs > 0] * counts.sum()
    order = np.argsort(e)
    o, e = o[order], e[order]
    small = np.cumsum(e) < 5.0                 # pool the rarest cells into one >= 5
    if small.any():
        k = int(small.sum()) + 1
        o = np.concatenate([[o[:k].sum()], o[k:]])
        e = np.concatenate([[e[:k].sum()], e[k:]])
    return float(stats.chisquare(o, e * o.sum() / e.sum()).pvalue)


@pytest.mark.parametrize("params", list(PARAMS), ids=list(PARAMS))
@pytest.mark.parametrize("stochastic", [False, True], ids=["onehot", "sampled"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.slow
def test_emitted_tokens_follow_the_target(shape, stochastic, params):
    seed = 11 + 7 * list(SHAPES).index(shape) + 3 * stochastic + list(PARAMS).index(params)
    counts, joint = emitted_pairs(verify, shape, stochastic, PARAMS[params], seed)
    assert gof_pvalue(counts, joint) > ALPHA


@pytest.mark.parametrize("stochastic", [False, True], ids=["onehot", "sampled"])
def test_duplicate_siblings_stay_lossless(stochastic):
    # Four root siblings (the first with a child) that often repeat a token:
    # one-hot duplicates match the draw once (the first); sampled duplicates (drawn
    # i.i.d. from a peaked q) must each meet the residual left so far.
    pr = np.array([0.05, 0.2, 0.4, 0.1, 0.25], np.float32)
    p = np.stack([pr] * 5)
    qr = np.array([0.05, 0.05, 0.8, 0.05, 0.05], np.float32)
    q = np.stack([qr] * 4)
    par = [-1, -1, -1, 0]
    rng = np.random.default_rng(77)
    cdf = np.cumsum(qr.astype(np.float64))
    first = np.zeros(V, np.int64)
    for _ in range(N):
        if stochastic:
            toks = np.searchsorted(cdf / cdf[-1], rng.random(4), side="right")
            d = Draft(tokens=toks, parents=par, q=q)
        else:
            d = Draft(tokens=[2, 2, 4, 2], parents=par)
        first[verify(p, d, rng).tokens[0]] += 1
    assert gof_pvalue(first, pr.astype(np.float64) / pr.sum()) > ALPHA


def test_greedy_params_reproduce_greedy_decoding():
    # temperature 0: p is one-hot, so verify must emit exactly the argmax chain
    prm = SamplingParams()
    target = ToyLM(5, prm)
    counts, joint = emitted_pairs(verify, "tree", True, prm, 5, n=50)
    a = int(np.argmax(target.logits(())))
    b = int(np.argmax(target.logits((a,))))
    assert counts[a, b] == 50 and joint[a, b] == 1.0


# ------------------------------------------------------------ the test has teeth

class _NoResidual(verify_mod._Residual):
    def sample(self, rng):
        return verify_mod._sample_or_none(self.base, rng)


class _Unnormalised(verify_mod._Residual):
    def sample(self, rng):
        r = self.cur.astype(np.float64)
        return min(int(np.searchsorted(np.cumsum(r), rng.random(), side="right")), V - 1)


class _SiblingsVsP(verify_mod._Residual):
    def accept(self, x, q_x, u):          # tests every sibling against p, not the residual
        return u * q_x < float(self.base[x])


def _match_no_exclusion(p, d, kids, tokens, rng) -> VerifyResult:
    """One-hot children accepted with prob p(x), then a redraw from p that may give x again."""
    path, row = [], 0
    while True:
        for c in kids[row]:
            if rng.random() < p[row][tokens[c]]:
                break
        else:
            return verify_mod._result(d, path, verify_mod._sample_or_none(p[row], rng), bonus=not kids[row])
        path.append(c)
        row = c + 1


def _match_stale_bonus(p, d, kids, tokens, rng) -> VerifyResult:
    """Sample-and-match, but the bonus after a full match is drawn from the row before the leaf's."""
    path, row = [], 0
    while True:
        y = verify_mod._sample_or_none(p[row if kids[row] or not path else path[-1]], rng)
        c = next((c for c in kids[row] if tokens[c] == y), None)
        if c is None:
            return verify_mod._result(d, path, y, bonus=not kids[row])
        path.append(c)
        row = c + 1


def _paths_longest(p: np.ndarray, d: Draft, rng) -> VerifyResult:
    par = np.arange(-1, d.tokens.size - 1) if d.parents is None else d.parents
    best = None
    for leaf in range(d.tokens.size):
        if leaf in par:
            continue
        path = [leaf]
        while par[path[-1]] >= 0:
            path.append(int(par[path[-1]]))
        path = path[::-1]
        sub = Draft(tokens=d.tokens[path], q=None if d.q is None else d.q[path])
        r = verify(p[[0] + [i + 1 for i in path]], sub, rng)
        if best is None or r.accepted.size > best.accepted.size:
            best = r
    return best


@pytest.mark.parametrize("bug, shape, stochastic", [
    ("no_residual", "chain3", True),
    ("unnormalised", "chain3", True),
    ("siblings_vs_p", "tree", True),
    ("paths_longest", "tree", True),
    ("paths_longest", "tree", False),
    ("onehot_no_exclusion", "chain3", False),   # one-hot drafts go through sample-and-match, not _Residual
    ("onehot_no_exclusion", "tree", False),
    ("onehot_stale_bonus", "chain1", False),    # token 2 is the bonus whenever token 1 matched
])
@pytest.mark.slow
def test_biased_samplers_are_caught(bug, shape, stochastic, monkeypatch):
    if bug == "no_residual":
        monkeypatch.setattr(verify_mod, "_Residual", _NoResidual)
    elif bug == "unnormalised":
        monkeypatch.setattr(verify_mod, "_Residual", _Unnormalised)
    elif bug == "siblings_vs_p":
        monkeypatch.setattr(verify_mod, "_Residual", _SiblingsVsP)
    elif bug == "onehot_no_exclusion":
        monkeypatch.setattr(verify_mod, "_sample_and_match", _match_no_exclusion)
    elif bug == "onehot_stale_bonus":
        monkeypatch.setattr(verify_mod, "_sample_and_match", _match_stale_bonus)
    verifier = _paths_longest if bug == "paths_longest" else verify
    counts, joint = emitted_pairs(verifier, shape, stochastic, PARAMS["t1"], 101, n=3000)
    assert gof_pvalue(counts, joint) < ALPHA
