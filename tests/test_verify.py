"""verify / verify_greedy / verify_typical: tables, determinism, edge properties."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrt.runtime import verify as verify_mod
from specrt.runtime.verify import Draft, VerifyResult, verify, verify_greedy, verify_typical


def one_hot_rows(am, V):
    p = np.zeros((len(am), V), np.float32)
    p[np.arange(len(am)), am] = 1.0
    return p


# ---------------------------------------------------------------- greedy table
# (target argmax per row, draft tokens, parents, expected path, next, bonus)
GREEDY = [
    ("chain all accepted", [1, 2, 3, 4], [1, 2, 3], None, [0, 1, 2], 4, True),
    ("chain first rejected", [5, 2, 3, 4], [1, 2, 3], None, [], 5, False),
    ("chain middle rejected", [1, 9, 3, 4], [1, 2, 3], None, [0], 9, False),
    ("chain last rejected", [1, 2, 7, 4], [1, 2, 3], None, [0, 1], 7, False),
    ("empty draft", [7], [], None, [], 7, True),
    ("tree second branch", [2, 3, 4, 0, 6], [1, 2, 3, 4], [-1, -1, 0, 1], [1, 3], 6, True),
    ("tree branch cut", [2, 3, 8, 0, 6], [1, 2, 3, 4], [-1, -1, 0, 1], [1], 8, False),
    ("tree nothing", [9, 3, 4, 0, 6], [1, 2, 3, 4], [-1, -1, 0, 1], [], 9, False),
    ("tree leaf at depth 1", [1, 5, 4, 0], [1, 2, 3], [-1, -1, 1], [0], 5, True),
    ("duplicate siblings: longest", [2, 0, 5, 9], [2, 2, 5], [-1, -1, 1], [1, 2], 9, True),
    ("duplicate siblings: first on tie", [2, 4, 4], [2, 2], [-1, -1], [0], 4, True),
]


@pytest.mark.parametrize("name, am, toks, par, path, nxt, bonus", GREEDY, ids=[g[0] for g in GREEDY])
def test_greedy_table(name, am, toks, par, path, nxt, bonus):
    d = Draft(tokens=np.array(toks, np.int64), parents=par)
    r = verify_greedy(np.array(am, np.int64), d)
    assert r.path.tolist() == path
    assert r.accepted.tolist() == [toks[i] for i in path]
    assert (r.next_token, r.bonus, r.lossy) == (nxt, bonus, False)
    assert r.tokens.tolist() == r.accepted.tolist() + [nxt]
    assert r.acceptance.tolist() == [i < len(path) for i in range(d.depth())]
    if "duplicate" not in name:
        # sampling-mode verify with one-hot p is the same decision, any seed
        rs = verify(one_hot_rows(am, 10), d, np.random.default_rng(0))
        assert (rs.path.tolist(), rs.next_token, rs.bonus) == (path, nxt, bonus)


def test_greedy_argmax_shape_checked():
    with pytest.raises(ValueError, match="n \\+ 1"):
        verify_greedy(np.array([1, 2]), Draft(tokens=[1, 2]))


# ---------------------------------------------------------------- determinism

def random_case(seed, V=12, tree=True, stochastic=True):
    g = np.random.default_rng(seed)
    parents = np.array([-1, -1, 0, 0, 1, 2, 5]) if tree else None
    n = 7
    p = g.dirichlet(np.full(V, 0.5), size=n + 1).astype(np.float32)
    q = g.dirichlet(np.full(V, 0.5), size=n).astype(np.float32) if stochastic else None
    return p, Draft(tokens=g.integers(0, V, n), parents=parents, q=q)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_seeded_determinism(tree, stochastic):
    p, d = random_case(3, tree=tree, stochastic=stochastic)
    runs = [[verify(p, d, np.random.default_rng(s)).tokens.tolist() for s in range(20)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 1  # the seed actually matters


# ---------------------------------------------------------------- edge properties

@st.composite
def cases(draw, stochastic=None):
    V = draw(st.integers(1, 6))
    n = draw(st.integers(0, 6))
    tree = draw(st.booleans())
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)] if tree else None
    sto = draw(st.booleans()) if stochastic is None else stochastic

    def dist(k):
        w = np.array([draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 3.0])) for _ in range(V)])
        if w.sum() == 0:
            w[draw(st.integers(0, V - 1))] = 1.0
        return (w / w.sum()).astype(np.float32)

    p = np.stack([dist(V) for _ in range(n + 1)])
    q = np.array([dist(V) for _ in range(n)], np.float32).reshape(n, V) if sto else None
    tokens = np.array([draw(st.integers(0, V - 1)) for _ in range(n)], np.int64)
    seed = draw(st.integers(0, 2**32 - 1))
    return p, Draft(tokens=tokens, parents=parents, q=q), seed


def check_well_formed(p, d, r: VerifyResult):
    par = np.arange(-1, d.tokens.size - 1) if d.parents is None else d.parents
    row = 0
    for node in r.path.tolist():
        assert par[node] + 1 == row                      # a root path
        assert p[row, d.tokens[node]] > 0                # never accepts a p = 0 token
        row = node + 1
    assert p[row, r.next_token] > 0                      # nor emits one
    assert r.bonus == (not d.children()[row])
    assert r.acceptance.shape == (d.depth(),)
    assert r.acceptance.sum() == r.path.size
    assert r.accepted.dtype == np.int64 and r.path.dtype == np.int64


@settings(max_examples=150, deadline=None)
@given(cases())
def test_zeros_anywhere_give_well_formed_results(case):
    # zeros in p and q, drafted tokens with q(x) = 0 and/or p(x) = 0, V = 1, n = 0
    p, d, seed = case
    check_well_formed(p, d, verify(p, d, np.random.default_rng(seed)))
    check_well_formed(p, d, verify_greedy(p.argmax(axis=1), d))


@settings(max_examples=80, deadline=None)
@given(cases(stochastic=True))
def test_p_equals_q_always_accepts(case):
    p, d, seed = case
    g = np.random.default_rng(seed)
    # draft exactly as a proposer with q = p would: every token from q's support
    toks = np.array([g.choice(p.shape[1], p=_norm(p, d, i)) for i in range(d.tokens.size)],
                    np.int64)
    q = np.array([p[_row(d, i)] for i in range(d.tokens.size)], np.float32).reshape(-1, p.shape[1])
    d = Draft(tokens=toks, parents=d.parents, q=q)
    r = verify(p, d, g)
    # the first child at every node is accepted, down to a leaf: a bonus token
    assert r.bonus
    node = -1
    for c in r.path.tolist():
        assert c == d.children()[node + 1][0]
        node = c
    check_well_formed(p, d, r)


def _row(d, i):
    return i if d.parents is None else int(d.parents[i]) + 1


def _norm(p, d, i):
    w = p[_row(d, i)].astype(np.float64)
    return w / w.sum()


@settings(max_examples=60, deadline=None)
@given(cases(stochastic=False))
def test_one_hot_p_on_the_draft_always_accepts(case):
    p, d, seed = case
    p = p.copy()
    for i, t in enumerate(d.tokens.tolist()):
        p[_row(d, i)] = 0
        p[_row(d, i), t] = 1
    r = verify(p, d, np.random.default_rng(seed))
    # every row with children is one-hot on one of them: descend to a leaf
    assert r.bonus
    if d.parents is None:
        assert r.path.size == d.tokens.size
    check_well_formed(p, d, r)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 8), st.integers(1, 5), st.booleans(), st.integers(0, 2**32 - 1))
def test_disjoint_supports_always_reject(V, n, stochastic, seed):
    g = np.random.default_rng(seed)
    cut = g.integers(1, V)                               # p on [0, cut), q on [cut, V)
    p = np.zeros((n + 1, V), np.float32)
    p[:, :cut] = g.dirichlet(np.ones(cut), size=n + 1)
    q = np.zeros((n, V), np.float32)
    q[:, cut:] = g.dirichlet(np.ones(V - cut), size=n)
    toks = g.integers(cut, V, n)
    r = verify(p, Draft(tokens=toks, q=q if stochastic else None), g)
    assert r.path.size == 0 and not r.bonus and r.next_token < cut
    assert r.acceptance.tolist() == [False] * n


@pytest.mark.parametrize("stochastic", [False, True])
def test_vocab_of_one(stochastic):
    n = 4
    p = np.ones((n + 1, 1), np.float32)
    d = Draft(tokens=np.zeros(n, np.int64), q=np.ones((n, 1), np.float32) if stochastic else None)
    r = verify(p, d, np.random.default_rng(0))
    assert r.tokens.tolist() == [0] * (n + 1) and r.bonus and r.acceptance.all()


def test_impossible_rejection_is_undone():
    # q(x) = 0 = p(x) for a drafted x and p = q elsewhere: rejecting x leaves
    # max(0, p - q) = 0 everywhere; the residual falls back to p, not garbage.
    p = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], np.float32)
    q = p[:2].copy()
    for seed in range(20):
        r = verify(p, Draft(tokens=[0, 1], q=q), np.random.default_rng(seed))
        assert r.path.size == 0 and r.next_token in (1, 2)
        # a sibling after the impossible rejection is tested against p again: p = q, accepted
        r = verify(p, Draft(tokens=[0, 1], parents=[-1, -1], q=p[[0, 0]]),
                   np.random.default_rng(seed))
        assert r.path.tolist() == [1] and r.bonus


def test_draft_length_zero():
    p = np.array([[0.0, 0.25, 0.75]], np.float32)
    for d in (Draft(tokens=np.zeros(0, np.int64)), Draft(tokens=[], q=np.zeros((0, 3)))):
        r = verify(p, d, np.random.default_rng(1))
        assert r.path.size == 0 and r.bonus and r.next_token in (1, 2)
        assert r.acceptance.shape == (0,) and r.tokens.size == 1


@pytest.mark.filterwarnings("ignore:invalid value")
@pytest.mark.parametrize("where", ["p_drafted", "q_drafted", "bonus_row", "residual"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_inf_probabilities_raise(where, bad):
    V = 5
    p = np.full((3, V), 1 / V, np.float32)
    q = np.full((2, V), 1 / V, np.float32)          # p == q: the chain is accepted
    toks = np.array([1, 2])
    if where == "p_drafted":
        p[0, 1] = bad
    elif where == "q_drafted":
        q[0, 1] = bad
    elif where == "bonus_row":
        p[2, 4] = bad
    else:                                             # rejection -> residual over a bad q row
        p[0] = [0, 0, 0, 0, 1]
        q[0, 3] = bad
    with pytest.raises(ValueError, match="NaN|inf|probability"):
        verify(p, Draft(tokens=toks, q=q), np.random.default_rng(0))


def test_input_validation_messages():
    p = np.full((3, 4), 0.25, np.float32)
    with pytest.raises(ValueError, match=r"p must be \[n \+ 1 = 3"):
        verify(p[:2], Draft(tokens=[1, 2]), np.random.default_rng(0))
    with pytest.raises(ValueError, match="parents"):
        Draft(tokens=[1, 2], parents=[-1, 1])
    with pytest.raises(ValueError, match="Draft.q"):
        Draft(tokens=[1, 2], q=np.ones((3, 4)))
    with pytest.raises(ValueError, match="vocab mismatch"):
        verify(p, Draft(tokens=[1, 2], q=np.ones((2, 5))), np.random.default_rng(0))
    with pytest.raises(ValueError, match="vocab size"):
        verify(p, Draft(tokens=[1, 4]), np.random.default_rng(0))


# ---------------------------------------------------------------- typical (lossy)

def test_typical_is_labelled_lossy_and_follows_medusa_rule():
    assert "LOSSY" in verify_typical.__doc__ and "lossy" in verify_mod.__doc__
    V = 8
    p = np.full((4, V), 0.01, np.float32)
    p[:, 0] = 1 - 0.01 * (V - 1)                       # peaked: threshold = 0.09
    p[1, 3] += 0.1; p[1, 0] -= 0.1                     # after node 0, token 3 has p=0.11
    d = Draft(tokens=[0, 3, 5], parents=None)          # 0 ok, 3 ok (0.11 > 0.09), 5 no
    r = verify_typical(p, d, np.random.default_rng(0))
    assert r.lossy and r.path.tolist() == [0, 1] and not r.bonus
    assert not verify(p, d, np.random.default_rng(0)).lossy


# ---------------------------------------------------------------- allocation

def _peak_bytes(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_no_vocab_sized_allocation_unless_a_stochastic_rejection():
    V, K = 151_936, 8
    g = np.random.default_rng(0)
    toks = g.integers(0, V, K)
    p = np.full((K + 1, V), 1e-7, np.float32)
    p[np.arange(K), toks] = 0.9
    p /= p.sum(axis=1, keepdims=True)
    vsize = V * 4
    # one-hot draft: accepted or rejected, zero-and-renormalise allocates nothing V-sized
    for rows in (p, np.roll(p, 1, axis=1)):
        d = Draft(tokens=toks)
        assert _peak_bytes(lambda: verify(rows, d, np.random.default_rng(1))) < vsize // 8
    # stochastic draft rejected at position 0: exactly one residual buffer
    q = np.roll(p[:K], 1, axis=1)
    d = Draft(tokens=(toks + 1) % V, q=q)          # q(x) = 0.9, p(x) ~ 1e-7
    r_peak = _peak_bytes(lambda: verify(p, d, np.random.default_rng(1)))
    assert vsize <= r_peak < vsize + vsize // 4
