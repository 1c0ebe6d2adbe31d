"""Exact verification of a speculative draft against the target distribution.

Contract: pure functions of (p, draft, rng). No model code, no KV cache, no
logits: probabilities come from ``runtime.sampling.probs_from_logits``, the
same function plain sampling uses, so p and q are exactly the distributions
that were (or would have been) sampled from. One function is lossy and opt-in:
verify_typical, Medusa's typical acceptance.

More: docs/runtime-notes.md, "Module notes: runtime/verify.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling import _sample_or_none

__all__ = ["Draft", "VerifyResult", "verify", "verify_greedy", "verify_typical"]


@dataclass(frozen=True, eq=False)
class Draft:
    """A proposer's output: a chain or a tree of drafted tokens.

    tokens:  [n] int64 node tokens, parents before children.
    parents: [n] int64, parents[i] < i, -1 = child of the root; None = chain
             (parents = i - 1). Siblings are verified in index order.
    q:       [n, V] float32; q[i] is the distribution node i's token was drawn
             from (the draft at node i's parent context; i.i.d. siblings share
             it). None = deterministic draft, treated as one-hot at tokens[i].
    """

    tokens: np.ndarray
    parents: np.ndarray | None = None
    q: np.ndarray | None = None

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        object.__setattr__(self, "tokens", tokens)
        n = tokens.size
        if self.parents is not None:
            par = np.asarray(self.parents, dtype=np.int64).reshape(-1)
            if par.size != n or (n and ((par < -1).any() or (par >= np.arange(n)).any())):
                raise ValueError("Draft.parents must be [n] with -1 <= parents[i] < i "
                                 "(list parents before children); use None for a chain")
            object.__setattr__(self, "parents", par)
        if self.q is not None:
            q = np.asarray(self.q)
            if q.ndim != 2 or q.shape[0] != n:
                raise ValueError(f"Draft.q must be [n={n}, V], got {q.shape}; "
                                 "use q=None for a deterministic (one-hot) draft")
            object.__setattr__(self, "q", q)
        if n and tokens.min() < 0:
            raise ValueError("Draft.tokens must be >= 0 token ids")

    def first(self, n: int) -> "Draft":
        """The first n nodes: a chain's prefix, or a subtree (parents come before children)."""
        cut = lambda a: None if a is None else a[:n]  # noqa: E731
        return Draft(self.tokens[:n], cut(self.parents), cut(self.q))

    def children(self) -> list[list[int]]:
        """children[r] = nodes whose parent row is r (row 0 = root, r = i + 1 = node i)."""
        n = self.tokens.size
        if self.parents is None:
            return [[r] for r in range(n)] + [[]]
        kids: list[list[int]] = [[] for _ in range(n + 1)]
        for i, par in enumerate(self.parents.tolist()):
            kids[par + 1].append(i)
        return kids

    def depth(self) -> int:
        """Longest root-to-node path length (chain: n)."""
        if self.parents is None:
            return int(self.tokens.size)
        d = [0] * (self.tokens.size + 1)                # d[row]; row 0 = root
        for i, par in enumerate(self.parents.tolist()):
            d[i + 1] = d[par + 1] + 1
        return max(d)


@dataclass(frozen=True, eq=False)
class VerifyResult:
    """What one verification round emits.

    accepted:   [m] int64 accepted draft tokens.
    path:       [m] int64 node indices of the accepted nodes (chain: arange(m)).
    next_token: the recovered token (bonus=False) or the bonus token (bonus=True).
    acceptance: [depth] bool, True where the token emitted at that depth was an
                accepted draft token (= arange(depth) < m); per-position stats.
    lossy:      True only for verify_typical: the output is NOT distributed as p.
    """

    accepted: np.ndarray
    path: np.ndarray
    next_token: int
    bonus: bool
    acceptance: np.ndarray
    lossy: bool = False

    @property
    def tokens(self) -> np.ndarray:
        """[m + 1] int64: accepted tokens then next_token (what gets committed)."""
        return np.append(self.accepted, np.int64(self.next_token))

    @property
    def rows(self) -> np.ndarray:
        """[m + 1] the rows of the target's pass that `tokens` came from: the root, then each accepted node's."""
        return np.append(np.int64(0), 1 + self.path)

    @property
    def num_accepted(self) -> int:
        return int(self.accepted.size)


def _result(draft: Draft, path: list[int], next_token: int, bonus: bool,
            lossy: bool = False) -> VerifyResult:
    idx = np.asarray(path, dtype=np.int64)
    return VerifyResult(accepted=draft.tokens[idx], path=idx, next_token=int(next_token),
                        bonus=bonus, acceptance=np.arange(draft.depth()) < idx.size,
                        lossy=lossy)


def _check_p(p: np.ndarray, draft: Draft) -> None:
    n = draft.tokens.size
    if p.ndim != 2 or p.shape[0] != n + 1:
        raise ValueError(f"p must be [n + 1 = {n + 1}, V] (row 0 = root, row i + 1 = after "
                         f"node i), got {p.shape}")
    if draft.q is not None and draft.q.shape[1] != p.shape[1]:
        raise ValueError(f"vocab mismatch: p has V={p.shape[1]}, q has V={draft.q.shape[1]}; "
                         "target and draft must share one tokenizer")
    if n and draft.tokens.max() >= p.shape[1]:
        raise ValueError(f"draft token {int(draft.tokens.max())} >= vocab size {p.shape[1]}")


def _prob(v: float, what: str) -> float:
    # Every probability the verifier reads is checked, so NaN/inf in p or q is
    # a clear error instead of a silently biased accept/reject decision.
    if not (0.0 <= v < np.inf):
        raise ValueError(f"{what} = {v} is not a probability; build p and q with "
                         "probs_from_logits, which rejects NaN/inf logits")
    return v


class _Residual:
    """The target still 'owed' at one tree node while its children are tried.

    Starts as p[row]. Rejecting child x drawn from q_x turns it into
    norm(max(0, r - q_x)) (Leviathan et al.; SpecInfer's multi-step speculative
    sampling for several siblings). Sampled drafts only: deterministic ones go
    through _sample_and_match. Residuals live in at most two buffers,
    allocated only at rows where a rejection happens. The mass (normaliser) is computed lazily: a
    chain never needs it, since the sampler draws u * total by itself.

    If a rejection leaves no mass (r <= q_x pointwise, i.e. r = q_x up to
    rounding, or a q(x) = 0 draft) it could not happen in exact arithmetic;
    it is undone, so the residual's support always stays inside p's.
    """

    def __init__(self, base: np.ndarray) -> None:
        self.base = base                   # [V] view of p[row], never written
        self.cur = base                    # [V] unnormalised residual r * mass
        self.mass: float | None = 1.0      # sum(cur); p rows sum to 1
        self.undo: tuple | None = None     # (cur, mass) before the last rejection

    def accept(self, x: int, q_x: float, u: float) -> bool:
        # accept iff u < min(1, r(x) / q(x)), r = cur / mass; written without
        # the division so q(x) = 0 accepts whenever r(x) > 0 (ratio = inf).
        mass = self._mass()                # first: a zero mass reverts cur
        r_x = _prob(float(self.cur[x]), f"p[{x}]")
        return u * q_x * mass < r_x

    def _mass(self) -> float:
        if self.mass is None:
            m = float(self.cur.sum(dtype=np.float64))
            if not np.isfinite(m):
                raise ValueError("p or q contains NaN/inf; build them with probs_from_logits")
            if m > 0.0:
                self.mass = m
            else:
                self._revert()
        return self.mass

    def _revert(self) -> None:
        self.cur, self.mass = self.undo
        self.undo = None

    def reject(self, q_row: np.ndarray) -> None:
        """r <- norm(max(0, r - q_row))."""
        mass = self._mass()                # known: accept() just needed it
        prev, self.undo = self.undo, (self.cur, mass)
        self.mass = None
        # Reuse the buffer the previous undo pointed at (not cur, not base).
        spare = prev[0] if prev is not None and prev[0] is not self.base else None
        new = spare if spare is not None else np.empty(self.cur.shape, np.float32)
        if self.cur is self.base:          # mass 1: r = cur
            np.maximum(self.cur, q_row, out=new, casting="same_kind")
        else:
            np.multiply(self.cur, np.float32(1.0 / mass), out=new)
            np.maximum(new, q_row, out=new, casting="same_kind")
        # max(r, q) - q == max(0, r - q) exactly (q - q = 0), but an inf in q
        # becomes inf - inf = NaN and is caught by the sampler, not hidden as 0.
        np.subtract(new, q_row, out=new, casting="same_kind")
        self.cur = new

    def sample(self, rng: np.random.Generator) -> int:
        tok = _sample_or_none(self.cur, rng)
        if tok is None and self.undo is not None:
            self._revert()
            tok = _sample_or_none(self.cur, rng)
        if tok is None:
            raise ValueError("target row has no probability mass; check p")
        return tok


def verify(p: np.ndarray, draft: Draft, rng: np.random.Generator) -> VerifyResult:
    """Lossless speculative verification of a chain or tree (sampling mode).

    p:     [n + 1, V] float32 target probabilities; row 0 after the committed
           context, row i + 1 after node i (conditioned on the path to node i).
    draft: n nodes; draft.q [n, V] or None (one-hot).
    rng:   the session's Generator. Deterministic drafts (q None): one draw per
           emitted token, as plain sampling does. Sampled drafts: one uniform
           per tested node, one draw for the recovered/bonus token.

    At a node with residual r (initially p at that node), children x_1..x_k:
      accept x_j with prob min(1, r(x_j) / q_j(x_j)), then descend to x_j;
      else r <- norm(max(0, r - q_j)) and try x_{j+1}.
    If every child is rejected the recovered token is drawn from r; at a leaf
    the bonus token is drawn from p at that leaf. For one child per node this
    is Leviathan et al.'s speculative sampling; for i.i.d. sampled siblings it
    is SpecInfer's multi-step speculative sampling; for one-hot siblings,
    q_j = onehot(x_j): accept with prob r(x_j), else zero x_j and renormalise.
    Each step emits exactly r-distributed tokens:
      P(x_j = y, accepted) + P(rejected) * r'(y) = min(q_j, r)(y) + (r - q_j)^+(y) = r(y).

    Deterministic drafts (q None: prompt lookup, Medusa, greedy drafting) take the equivalent
    sample-and-match form of that one-hot rule: draw y ~ p at the node, the way plain sampling
    draws; descend to the child whose token is y, else emit y (recovered). P(accept x) = p(x), and
    a y != x is p restricted to the other tokens: the residual above. One draw per emitted token,
    in plain sampling's order, so a seeded run gives plain sampling's own output whatever the
    draft lengths were (up to p's width rounding).
    """
    p = np.asarray(p)
    _check_p(p, draft)
    kids = draft.children()
    tokens = draft.tokens.tolist()
    q = draft.q
    if q is None:
        return _sample_and_match(p, draft, kids, tokens, rng)
    path: list[int] = []
    row = 0
    while True:
        children = kids[row]
        if not children:                         # fully accepted: bonus from p at the leaf
            tok = _sample_or_none(p[row], rng)
            if tok is None:
                raise ValueError(f"p row {row} has no probability mass; check p")
            return _result(draft, path, tok, bonus=True)
        res = _Residual(p[row])
        for c in children:
            x = tokens[c]
            if res.accept(x, _prob(float(q[c, x]), f"q[{c}, {x}]"), rng.random()):
                break
            res.reject(q[c])
        else:                                    # every child rejected: recovered token
            return _result(draft, path, res.sample(rng), bonus=False)
        path.append(c)
        row = c + 1


def _sample_and_match(p: np.ndarray, draft: Draft, kids: list[list[int]], tokens: list[int],
                      rng: np.random.Generator) -> VerifyResult:
    """verify for q None (see there): y ~ p[row]; a child with token y is accepted, else y is emitted."""
    path: list[int] = []
    row = 0
    while True:
        y = _sample_or_none(p[row], rng)
        if y is None:
            raise ValueError(f"p row {row} has no probability mass; check p")
        c = next((c for c in kids[row] if tokens[c] == y), None)   # duplicate siblings: the first
        if c is None:
            return _result(draft, path, y, bonus=not kids[row])
        path.append(c)
        row = c + 1


def verify_greedy(target_argmax: np.ndarray, draft: Draft) -> VerifyResult:
    """Lossless greedy verification: keep the longest path of argmax tokens.

    target_argmax: [n + 1] int64, argmax of the target logits per row (row 0 =
                   root, row i + 1 = after node i); no softmax needed.
    Equals ``verify`` with one-hot p. Ties between equal-length paths go to
    the first in node order; the next token is the argmax after the path
    (bonus when that node has no children, recovered otherwise).
    """
    am = np.asarray(target_argmax, dtype=np.int64).reshape(-1)
    if am.size != draft.tokens.size + 1:
        raise ValueError(f"target_argmax must be [n + 1 = {draft.tokens.size + 1}], got {am.shape}")
    ok = draft.tokens == am[_parent_rows(draft)]      # [n] node matches its parent's argmax
    if draft.parents is None:                         # a chain: the accepted prefix, without the tree walk
        m = int(ok.argmin()) if not ok.all() else ok.size
        return _result(draft, list(range(m)), int(am[m]), bonus=m == ok.size)
    path = _deepest_path(draft, ok)
    row = path[-1] + 1 if path else 0
    return _result(draft, path, int(am[row]), bonus=not draft.children()[row])


def verify_typical(p: np.ndarray, draft: Draft, rng: np.random.Generator, *,
                   posterior_threshold: float = 0.09,
                   posterior_alpha: float = 0.3) -> VerifyResult:
    """LOSSY, opt-in: Medusa's typical acceptance (Cai et al. 2024, sec. 2.3.1).

    Not lossless: the emitted tokens are NOT distributed as p; results carry
    ``lossy=True``. Use only when the user explicitly asks for it.

    p: [n + 1, V] float32 target probabilities (as in ``verify``).
    A node x under parent row r passes if
      p_r(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_r))),
    and the longest path of passing nodes is accepted (first on ties); the
    next token is sampled from p after that path.
    """
    p = np.asarray(p)
    _check_p(p, draft)
    prow = _parent_rows(draft)
    ok = np.zeros(draft.tokens.size, dtype=bool)
    thresh: dict[int, float] = {}
    for i, (r, x) in enumerate(zip(prow.tolist(), draft.tokens.tolist())):
        if r not in thresh:                      # entropy only for rows with children
            pr = p[r].astype(np.float64)
            h = float(-(pr * np.log(np.maximum(pr, 1e-30))).sum())
            if not np.isfinite(h):
                raise ValueError(f"p row {r} contains NaN/inf")
            thresh[r] = min(posterior_threshold, posterior_alpha * float(np.exp(-h)))
        ok[i] = _prob(float(p[r, x]), f"p[{r}, {x}]") > thresh[r]
    path = _deepest_path(draft, ok)
    row = path[-1] + 1 if path else 0
    tok = _sample_or_none(p[row], rng)
    if tok is None:
        raise ValueError(f"p row {row} has no probability mass; check p")
    return _result(draft, path, tok, bonus=not draft.children()[row], lossy=True)


def _parent_rows(draft: Draft) -> np.ndarray:
    """[n] int64 row of p each node's token is judged against (parent + 1)."""
    n = draft.tokens.size
    return np.arange(n, dtype=np.int64) if draft.parents is None else draft.parents + 1


def _deepest_path(draft: Draft, ok: np.ndarray) -> list[int]:
    """Longest root path whose nodes all have ok[i]; first in node order on ties."""
    n = draft.tokens.size
    par = np.arange(-1, n - 1) if draft.parents is None else draft.parents
    depth = [0] * n
    best, best_d = -1, 0
    for i in range(n):                       # parents precede children
        pi = int(par[i])
        if ok[i] and (pi < 0 or depth[pi] > 0):
            depth[i] = (depth[pi] if pi >= 0 else 0) + 1
            if depth[i] > best_d:
                best, best_d = i, depth[i]
    path = []
    while best >= 0:
        path.append(best)
        best = int(par[best])
    return path[::-1]
