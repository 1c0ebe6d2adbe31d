"""The Medusa tree: the order in which tree nodes pay (from the heads' measured rank accuracies), and the tree size
that maximises expected tokens per second of the target's measured pass costs."""

from __future__ import annotations

import numpy as np


def tree_order(label_rank: np.ndarray, ranks: int, size: int = 64) -> tuple[list[tuple[int, ...]], list[float]]:
    """Greedy tree on measured joint accuracies. label_rank [N, K]. A path (r1..rd) is right at a
    position when label_rank[t, j] == r_j for j < d; its value is the fraction of positions where
    it is. A child is never worth more than its parent, so every prefix of the order is a tree."""
    N, K = label_rank.shape
    hit = {(): np.ones(N, bool)}
    frontier = {(r,): label_rank[:, 0] == r for r in range(ranks)}
    order, values = [], []
    while frontier and len(order) < size:
        p = max(frontier, key=lambda x: (frontier[x].sum(), -len(x)))
        h = frontier.pop(p)
        order.append(p)
        values.append(float(h.mean()))
        hit[p] = h
        if len(p) < K:
            for r in range(ranks):
                frontier[p + (r,)] = h & (label_rank[:, len(p)] == r)
    return order, values


def tree_from_accuracies(acc: np.ndarray, size: int) -> tuple[tuple[int, ...], ...]:
    """Greedy tree from measured accuracies: acc [heads, k], acc[h, r] = P(head h's rank-r
    candidate is the right token). A path's value is the product of its ranks' accuracies
    (heads treated as independent, as Medusa does); add the best child of the frontier until
    `size` nodes. Every added node is a child of the tree, so the result is prefix-closed."""
    acc = np.asarray(acc, np.float64)
    heads, k = acc.shape
    chosen: list[tuple[int, ...]] = []
    frontier = {(r,): acc[0, r] for r in range(k)}
    while frontier and len(chosen) < size:
        p = max(frontier, key=lambda x: (frontier[x], -len(x)))
        v = frontier.pop(p)
        chosen.append(p)
        if len(p) < heads:
            for r in range(k):
                frontier[p + (r,)] = v * acc[len(p), r]
    return tuple(chosen)


TREE_TOLERANCE = 0.02  # choose_tree's default (~ the noise of build-time pass timings); in sets' build key


def choose_tree(order, values, pass_cost, max_size: int = 48, draft_cost: float = 0.0,
                tolerance: float = TREE_TOLERANCE) -> tuple[tuple[tuple[int, ...], ...], dict]:
    """The smallest prefix of a greedy node order whose expected tokens per second of a round is within
    `tolerance` of the best prefix's.

    order: paths in the order a greedy builder adds them (every prefix is a tree); values[i] =
    P(path i is accepted), measured; pass_cost(w) = seconds of a w-token target pass.
    E(n) = 1 + sum(values[:n]) tokens per round, rate(n) = E(n) / (pass_cost(n + 1) + draft_cost).
    Why not the argmax: the curve is flat over a wide range of sizes, so the argmax follows timing noise
    and picks trees bigger than the bench rewards (docs/design-notes.md, "Medusa tree size tolerance")."""
    order = [tuple(p) for p in order][:max_size]
    e = 1.0 + np.cumsum(np.asarray(values, np.float64)[: len(order)])
    rate = np.array([e[n - 1] / (pass_cost(n + 1) + draft_cost) for n in range(1, len(order) + 1)])
    n = int(np.argmax(rate >= (1.0 - tolerance) * rate.max())) + 1
    curve = [{"nodes": i + 1, "expected_tokens": round(float(e[i]), 3), "rate": round(float(rate[i]), 2)}
             for i in range(len(order))]
    return tuple(order[:n]), {"nodes": n, "expected_tokens": round(float(e[n - 1]), 3),
                              "best_nodes": int(rate.argmax()) + 1, "tolerance": tolerance, "curve": curve}
