"""Token trees as data: a list of paths, compiled once into what a tree-verification pass needs.

A path is a tuple of candidate ranks, one per draft depth: (0,) is head 1's best token, (1, 0)
is head 1's second-best followed by head 2's best. Every prefix of a path must itself be a path
(a node's parent is in the tree). `compile_tree` is pure and runs once per tree, never per round.

More: docs/runtime-notes.md, "Module notes: runtime/tree.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

Path = tuple[int, ...]

# A generic 24-node shape over 4 heads (most nodes at the shallow depths, where heads are right
# most often), for tests and hand use; engine sets carry the tree chosen from their heads' measured
# accuracies and the target's measured pass costs (specrt/pipeline/tree_sizing.py).
DEFAULT_TREE: tuple[Path, ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 2), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0),
)


@dataclass(frozen=True, eq=False)
class CompiledTree:
    paths: tuple[Path, ...]  # in node order
    parents: np.ndarray      # [n] int64
    depth: np.ndarray        # [n] int64
    rank: np.ndarray         # [n] int64
    positions: np.ndarray    # [n + 1] int64
    mask: np.ndarray         # [n + 1, n + 1] float32
    retrieve: np.ndarray     # [leaves, max_depth + 1] int64

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.size else 0

    @property
    def max_rank(self) -> int:
        """Candidates needed per head: top-(max_rank + 1)."""
        return int(self.rank.max()) + 1 if self.size else 0

    def tokens(self, candidates: np.ndarray) -> np.ndarray:
        """candidates [heads, k] token ids (best first) -> node tokens [n]."""
        return candidates[self.depth - 1, self.rank]


def ancestry(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """parents [n] (parents before children, -1 = root) -> depth [n] (1 for a root child) and
    anc [n, n] bool, anc[i, j] = node j is node i or one of its ancestors. Shared by the tree
    compiler and the speculative loop, which lays out any Draft tree the same way."""
    n = len(parents)
    depth = np.ones(n, np.int64)
    anc = np.eye(n, dtype=bool)
    for i, p in enumerate(np.asarray(parents).tolist()):
        if p >= 0:
            depth[i], anc[i] = depth[p] + 1, anc[i] | anc[p]
    return depth, anc


def tree_layout(parents: np.ndarray, pending: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The one layout of a tree pass: `pending` tokens (the root, or the prompt on round 1), then the
    nodes of `parents` -> offsets [pending + n] from the cache length (a node at pending - 1 + depth) and
    the additive mask [pending + n, pending + n]: nodes see the pending tokens and their ancestors;
    causality (later tokens hidden from earlier ones) is the graph's own. Cached per shape: the loop asks
    for the same few trees every round. Read-only arrays."""
    return _layout(np.ascontiguousarray(parents, np.int64).tobytes(), pending)


@lru_cache(maxsize=64)
def _layout(parents: bytes, pending: int) -> tuple[np.ndarray, np.ndarray]:
    depth, anc = ancestry(np.frombuffer(parents, np.int64))
    n = depth.size
    offsets = np.concatenate([np.arange(pending), pending - 1 + depth])
    mask = np.zeros((pending + n, pending + n), np.float32)
    mask[pending:, pending:] = np.where(anc, 0.0, -np.inf)
    for a in (offsets, mask):
        a.setflags(write=False)
    return offsets, mask


def compile_tree(paths) -> CompiledTree:
    """paths: iterable of non-empty tuples of ranks >= 0 -> CompiledTree (nodes sorted by depth, then path)."""
    ps = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if not ps:
        raise ValueError("a tree needs at least one path, e.g. [(0,)]")
    index = {p: i for i, p in enumerate(ps)}
    for p in ps:
        if not p or min(p) < 0:
            raise ValueError(f"tree path {p} must be a non-empty tuple of ranks >= 0")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {p} has no parent {p[:-1]} in the tree; add every prefix of a path")
    n = len(ps)
    parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in ps], np.int64)
    depth, anc = ancestry(parents)
    rank = np.array([p[-1] for p in ps], np.int64)
    positions, layout = tree_layout(parents)
    mask = layout + np.triu(np.full((n + 1, n + 1), -np.inf, np.float32), 1)  # causality spelled out here
    see = mask == 0
    is_parent = np.zeros(n, bool)
    is_parent[parents[parents >= 0]] = True
    leaves = np.flatnonzero(~is_parent)
    retrieve = np.full((len(leaves), int(depth.max()) + 1), -1, np.int64)
    for r, leaf in enumerate(leaves):
        chain = np.flatnonzero(see[leaf + 1])  # ancestors are exactly the visible pass indices
        retrieve[r, : len(chain)] = chain
    for a in (parents, depth, rank, mask, retrieve):
        a.setflags(write=False)
    return CompiledTree(tuple(ps), parents, depth, rank, positions, mask, retrieve)
