"""EAGLE: draft from the target's own features with a one-layer head (export/eagle.py), as a chain or a dynamic
tree (EAGLE-2).

Drafts are deterministic (q = None), so `verify` keeps the output exactly the target's, greedy or sampled. The
first round (the prompt is pending, no features yet) drafts nothing: the first token waits for the target alone.

More: docs/runtime-notes.md, "Module notes: runtime/proposers/eagle.py".
"""

from __future__ import annotations

import time

import numpy as np

from ..prefix_cache import common_prefix
from ..verify import Draft, VerifyResult
from .base import EMPTY, Context, HeldTokens, HiddenRows, Proposer

NEG = np.float32(-np.inf)


class Eagle(HeldTokens, Proposer):
    name = "eagle"
    reads_prompt = True

    def __init__(self, head, max_tokens: int = 6, tree: bool = False, beam: int = 6, nodes: int = 16,
                 max_context: int | None = None, pass_cost=None):
        """head: an EAGLE head engine (backends/onnxruntime_cpu/heads.OrtEagleHead); max_tokens: the deepest
        chain or tree; tree: EAGLE-2's dynamic tree of at most `nodes` nodes, `beam` expanded per level.
        pass_cost: the target's pass seconds by width ([[width, seconds], ...], measured at build): each round
        then verifies the number of nodes that maximises expected tokens per second, the nodes' cumulative draft
        probabilities standing for their chance to be accepted (EAGLE-2's observation)."""
        self.head, self.max_tokens, self.tree = head, max_tokens, tree
        self.cost = None if not pass_cost else tuple(np.asarray(c, np.float64) for c in zip(*pass_cost))
        self.adaptive = not tree  # a chain follows AdaptiveK; the tree sizes itself (GatedK switches it)
        self.beam, self.nodes = min(beam, head.topk), nodes
        cap = head.max_capacity - (max_tokens * self.beam + 2)
        self.max_context = cap if max_context is None else min(max_context, cap)
        self._feat = np.zeros((head.max_capacity, head.hidden_size), np.float32)  # features by target position
        self._known = 0          # features of positions [0, _known) are in _feat (or the head's store: _device)
        self._base = self._pending = 0  # the target's cache length and the pass's pending tokens at propose
        self._device = False     # the features live in the head's store on the device (the rows handed are there)

    @property
    def reads_hidden(self) -> str:
        # a head on the target's GPU keeps the features there (the module docstring): none crosses to the host
        return "device" if self.head.on_device else "host"

    # --- KV reuse across requests (Generator.prefix_store) ----------------------------------------------------
    def held(self) -> np.ndarray:
        return self.held_tokens(self.head.length)

    def save_state(self, limit: int):
        n = min(self.head.length, limit)
        feat = self.head.read_features(n) if self._device else self._feat[:n].copy()
        return _State(self.head.save_prefix(n), feat)

    def load_state(self, ids, state: "_State") -> None:
        self.head.load_prefix(state.cache)
        n = state.cache.length
        self._feat[:n] = state.feat
        if self.head.on_device:  # before the next pass says where features live: both are current
            self.head.write_features(state.feat)
        self._known = n
        self.hold(ids, n)

    # --- the proposer contract ---------------------------------------------------------------------------------
    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        # the head keeps the entries this prompt shares with its cache, if the target kept them too (KV reuse)
        keep = common_prefix(self.held(), ctx.ids, ctx.cached) if ctx.cached else 0
        self.head.length = keep
        self._known = keep
        self.follow(ctx)

    def propose(self, ctx: Context, k: int) -> Draft:
        self._t0 = time.perf_counter()
        base = self._base = ctx.committed
        self._pending = ctx.length - base
        if k <= 0 or self._pending != 1 or self._known < base or base < 1 or ctx.length >= self.max_context:
            return EMPTY  # features missing (the prompt's round, or speculation was off): plain this round
        h = self.head
        if h.length > base:  # the head read past what the target kept (a rewind): forget it
            h.length = base
        h.reserve(base + 2 + k * self.beam)  # every slot this round may write, before its masks are built
        # 1. the real entries the head has not read: positions [h.length, base), each with the token after it
        lo, hi = h.length, base
        ids = ctx.ids
        mask = self._mask(hi - lo, lo)
        feats = h.stored(lo, hi) if self._device else self._feat[lo:hi]
        feat, top, logp = h.run(feats, ids[lo + 1: hi + 1], np.arange(lo, hi), lo, mask)
        h.length = hi
        f, top, logp = feat[-1:], top[-1:], logp[-1:]  # row of position base - 1: guesses after the pending token
        return self._tree(f, top, logp, k) if self.tree else self._chain(f, top, k)

    def _chain(self, f, top, k: int) -> Draft:
        h, base = self.head, self._base
        tokens = np.empty(k, np.int64)
        tokens[0] = top[0, 0]
        for i in range(1, k):  # row i sits at position base + i - 1, slot base + i - 1: it sees [0, slot]
            slot = base + i - 1
            f, top, _ = h.run(f, tokens[i - 1: i], np.array([slot]), slot, self._mask(1, slot))
            tokens[i] = top[0, 0]
        return Draft(tokens)

    def _tree(self, f, top, logp, k: int) -> Draft:
        """EAGLE-2: grow by cumulative log-probability, then keep the best nodes."""
        h, base, K = self.head, self._base, int(self.head.topk)
        tokens, parents, score, slot_of = [], [], [], []  # per node; slot_of: head slot of its expansion (or -1)
        for j in range(K):
            tokens.append(int(top[0, j]))
            parents.append(-1)
            score.append(float(logp[0, j]))
            slot_of.append(-1)
        frontier = list(range(K))     # nodes whose children the last step produced
        feats = {}                   # node -> its predicted-feature input row (the parent's prediction)
        for j in range(K):
            feats[j] = f[0]
        slot = base
        depth = 1
        while depth < k:
            grow = sorted(frontier, key=lambda i: -score[i])[: self.beam]
            if not grow:
                break
            W = len(grow)
            mask = np.full((W, h.capacity), NEG, np.float32)
            mask[:, :base] = 0
            for r, i in enumerate(grow):  # each row sees the real entries, its ancestors' slots and its own
                slot_of[i] = slot + r
                a = i
                while a >= 0:
                    if slot_of[a] >= 0:
                        mask[r, slot_of[a]] = 0
                    a = parents[a]
            rows = [feats[i] for i in grow]  # host rows, or a device head's rows (DeviceRows)
            rows_f = rows[0].join(rows) if self._device else np.stack(rows)
            pos = np.full(W, base + depth - 1, np.int64)
            out_f, out_top, out_logp = h.run(rows_f, np.array([tokens[i] for i in grow]), pos, slot, mask)
            slot += W
            frontier = []
            for r, i in enumerate(grow):
                for j in range(K):
                    n = len(tokens)
                    tokens.append(int(out_top[r, j]))
                    parents.append(i)
                    score.append(score[i] + float(out_logp[r, j]))
                    slot_of.append(-1)
                    feats[n] = out_f[r]
                    frontier.append(n)
            depth += 1
        keep = sorted(range(len(tokens)), key=lambda i: -score[i])[: self.nodes]
        if self.cost is not None:  # expected tokens per second of the best N nodes, N = 1..nodes
            expected = 1.0 + np.cumsum(np.exp([score[i] for i in keep]))
            seconds = time.perf_counter() - self._t0 + np.interp(np.arange(2, len(keep) + 2), *self.cost)
            keep = keep[: int(np.argmax(expected / seconds)) + 1]
        keep = _closed(keep, parents)
        order = sorted(keep, key=lambda i: (_depth(i, parents), -score[i]))  # parents before children
        index = {i: n for n, i in enumerate(order)}
        return Draft(np.array([tokens[i] for i in order], np.int64),
                     np.array([index[parents[i]] if parents[i] >= 0 else -1 for i in order], np.int64))

    def observe(self, result: VerifyResult, hidden: HiddenRows | None = None) -> None:
        """Keep the features of the positions the target committed: the pending tokens', then the accepted
        nodes' (pass rows P + path)."""
        if hidden is None:
            raise ValueError("EAGLE reads the target's features; run it through the speculative loop")
        self._device = hidden.device
        P = self._pending
        committed = self._base + P + result.num_accepted
        if P <= 0:
            return
        rows = np.arange(P) if result.num_accepted == 0 else np.concatenate([np.arange(P), P + result.path])
        if len(hidden) < rows.max() + 1 or self._known < self._base:
            self._known = min(self._known, self._base)
            return
        if self._device:  # copied on the device, target rows to the head's store
            self.head.keep_features(self._base, hidden.rows(rows))
        else:
            self._feat[self._base: committed] = hidden.rows(rows)
        self._known = committed

    def _mask(self, W: int, lo: int) -> np.ndarray:
        """Causal rows for W entries written from slot lo on: row r sees slots [0, lo + r]."""
        slots = np.arange(self.head.capacity)
        return np.where(slots[None, :] <= lo + np.arange(W)[:, None], np.float32(0), NEG)


class _State:
    """save_state's copy: the head's cache and the features of its positions."""

    def __init__(self, cache, feat):
        self.cache, self.feat = cache, feat

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + self.feat.nbytes


def _closed(keep: list[int], parents: list[int]) -> list[int]:
    """keep plus every ancestor of its nodes (ties in score could leave one out)."""
    out = set(keep)
    for i in keep:
        a = parents[i]
        while a >= 0 and a not in out:
            out.add(a)
            a = parents[a]
    return list(out)


def _depth(i: int, parents: list[int]) -> int:
    d = 0
    while i >= 0:
        i, d = parents[i], d + 1
    return d
