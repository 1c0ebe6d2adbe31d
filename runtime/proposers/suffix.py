"""Suffix decoding: draft trees from what followed the context's longest suffix, in this request and in earlier answers.

The tries are plain dicts (node = [count, children, last writer]); adding a token updates the `depth` suffixes
that end at it, O(depth) dict operations, and an evicted answer is replayed to decrement its counts.
ArcticInference's C++ tree needs torch (and vLLM's protobuf) to build, which the runtime does not ship.

More: docs/runtime-notes.md, "Module notes: runtime/proposers/suffix.py".
"""

from __future__ import annotations

import contextlib
import heapq
import threading
from collections import OrderedDict

import numpy as np

from ...errors import SpecrtError
from ..verify import Draft
from .base import EMPTY, Context, Proposer

NODE_BYTES = 300  # a node's Python cost (a 2-list, a small dict, an int key in its parent), measured by tracemalloc
MATCH_BUCKETS = (16, 8, 4, 2, 1)  # the bucket of a draft: the first of these its match length reaches


class SuffixTrie:
    """Occurrence counts of every substring of up to `depth` tokens of the sequences added."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root: list = [0, {}, -1]
        self.nodes = 0

    def add(self, open_: list, token: int, delta: int = 1, tag: int = -1) -> list:
        """Count `token` after each open suffix of a sequence (and alone); the new open suffixes (a new sequence
        starts with none: []). delta -1 undoes an earlier add of the same sequence (nodes left at 0 are removed).
        tag: who wrote it (a store's answer key), kept by the nodes it counts in as their last writer."""
        out = []
        for node in [self.root] + open_[: self.depth - 1]:
            kids = node[1]
            child = kids.get(token)
            if child is None:
                if delta < 0:
                    continue
                child = kids[token] = [0, {}, tag]
                self.nodes += 1
            elif delta > 0:
                child[2] = tag
            child[0] += delta
            if child[0] <= 0:  # its subtree holds only what is being undone: it goes with it, emptied, so the
                del kids[token]  # open suffixes inside it that this undo still holds find nothing left to count
                self.nodes -= _drop(child)
                continue
            out.append(child)
        return out

    def match(self, tail: list[int]) -> tuple[int, list | None]:
        """The longest suffix of `tail` the trie holds with a continuation: (its length, its node)."""
        for m in range(min(len(tail), self.depth - 1), 0, -1):
            node = self.root
            for t in tail[len(tail) - m:]:
                node = node[1].get(t)
                if node is None:
                    break
            else:
                if node[1]:
                    return m, node
        return 0, None

    def grow(self, node: list, max_nodes: int, max_depth: int, threshold: float) -> tuple[list, list, float]:
        """The draft tree below `node`: (tokens, parents, expected accepted tokens), most probable node first. The
        most probable path's node is expanded first; each child whose path probability reaches `threshold` is
        drafted."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        order = 1
        heap = [(-1.0, 0, -1, 0, node)]  # (-path probability, order, draft index (-1: the root), depth, trie node)
        while heap and len(tokens) < max_nodes:
            neg_p, _, me, d, at = heapq.heappop(heap)
            if d >= max_depth:
                continue
            kids = at[1]
            total = sum(c[0] for c in kids.values())
            for tok, child in sorted(kids.items(), key=lambda kv: -kv[1][0]):
                q = -neg_p * (child[0] / total)  # never above its parent, rounding included
                if q < threshold or len(tokens) >= max_nodes:
                    break
                tokens.append(tok)
                parents.append(me)
                probs.append(q)
                heapq.heappush(heap, (-q, order, len(tokens) - 1, d + 1, child))
                order += 1
        # most probable first (a child is never more probable than its parent, so parents stay first): the first
        # k nodes are then the best tree of k
        rank = sorted(range(len(tokens)), key=lambda i: (-probs[i], i))
        where = {old: new for new, old in enumerate(rank)}
        return ([tokens[i] for i in rank], [where[parents[i]] if parents[i] >= 0 else -1 for i in rank],
                float(sum(probs)))


class Answer:
    """One answer being written into a store: its tokens and its open suffixes."""

    def __init__(self, key: int, store: "SuffixStore"):
        self.key, self.store, self.tokens, self.open = key, store, [], []


class SuffixStore:
    """The trie of one scope's earlier answers (a server's, an API key's, a conversation's)."""

    def __init__(self, key, depth: int):
        self.key, self.trie, self.answers = key, SuffixTrie(depth), 0


class SuffixStores:
    """The stores of earlier answers, one per scope key (None: the one every unkeyed request shares), within
    `budget_bytes` together, least recently used complete answer out: an answer is used when it is written and
    when a draft matches a substring it was the last to write. One per proposer, or one the streams of a batch
    share (every call takes its lock); a server or a Session keeps it for its lifetime."""

    def __init__(self, budget_bytes: int, depth: int):
        self.budget, self.depth = budget_bytes, depth
        self.lock = threading.Lock()
        self.stores: dict = {}
        self.answers: OrderedDict[int, Answer] = OrderedDict()  # least recently used first
        self.nodes = 0
        self._next = 0
        self._writing: set[int] = set()

    def begin(self, key=None) -> Answer:
        """A new answer starts, in the store of `key`."""
        with self.lock:
            store = self.stores.get(key)
            if store is None:
                store = self.stores[key] = SuffixStore(key, self.depth)
            answer = Answer(self._next, store)
            self._next += 1
            store.answers += 1
            self.answers[answer.key] = answer
            self._writing.add(answer.key)
            return answer

    def end(self, answer: Answer) -> None:
        """An answer is complete: it may be evicted from now on."""
        with self.lock:
            self._writing.discard(answer.key)

    def extend(self, answer: Answer, tokens) -> None:
        with self.lock:
            trie = answer.store.trie
            before = trie.nodes
            for t in tokens:
                answer.open = trie.add(answer.open, t, tag=answer.key)
                answer.tokens.append(t)
            self.nodes += trie.nodes - before
            if answer.key in self.answers:
                self.answers.move_to_end(answer.key)
            while self.nodes * NODE_BYTES > self.budget:
                old = next((k for k in self.answers if k not in self._writing), None)
                if old is None:
                    break
                self._forget(self.answers.pop(old))

    def used(self, node: list) -> None:
        """A draft came from `node` (the lock held): the answer that last wrote it is the most recently used."""
        if node[2] in self.answers:
            self.answers.move_to_end(node[2])

    def _forget(self, answer: Answer) -> None:
        store, open_ = answer.store, []
        before = store.trie.nodes
        for t in answer.tokens:
            open_ = store.trie.add(open_, t, -1)
        self.nodes += store.trie.nodes - before
        store.answers -= 1
        if not store.answers:
            del self.stores[store.key]

    @property
    def nbytes(self) -> int:
        return self.nodes * NODE_BYTES


class SuffixDecoding(Proposer):
    name = "suffix"
    buckets = len(MATCH_BUCKETS) + 1
    reads_prompt = True  # the prompt goes into the local trie after the first token, not before it
    match_sizes = MATCH_BUCKETS  # the match lengths its buckets start at (as prompt lookup's n-gram sizes)

    def __init__(self, stores: SuffixStores | None, depth: int = 32, max_nodes: int = 24, factor: float = 4.0,
                 threshold: float = 0.3, max_tokens: int = 16):
        if not 0 < threshold <= 1:
            raise SpecrtError(f"the suffix threshold must be in (0, 1], got {threshold}")
        if factor <= 0:
            raise SpecrtError(f"the suffix match factor must be > 0, got {factor}")
        self.stores, self.depth, self.max_nodes = stores, depth, max_nodes
        self.factor, self.threshold, self.max_tokens = factor, threshold, max_tokens
        self.local = SuffixTrie(depth)
        self._answer: Answer | None = None
        self._open: list = []
        self._seen = 0        # context tokens added to the local trie
        self._answer_from = 0  # where the answer starts in the context (the store gets tokens from there)
        self._plan = (-1, 0, None)

    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        self.local, self._open, self._seen = SuffixTrie(self.depth), [], 0
        self._answer_from = ctx.prompt_length
        self._plan = (-1, 0, None)
        if self.stores is not None:
            if self._answer is not None:
                self.stores.end(self._answer)
            self._answer = self.stores.begin(ctx.store_key)  # the request's scope (None: the shared store)

    def _catch_up(self, ctx: Context) -> None:
        ids = ctx.ids[self._seen:].tolist()
        for t in ids:
            self._open = self.local.add(self._open, t)
        if self._answer is not None:
            self.stores.extend(self._answer, ctx.ids[max(self._seen, self._answer_from):].tolist())
        self._seen = ctx.length

    def _best(self, ctx: Context) -> tuple[int, Draft | None]:
        """(bucket, draft at the full size) of this context, once per context length."""
        if self._plan[0] != ctx.length:
            self._catch_up(ctx)
            tail = ctx.ids[max(0, ctx.length - self.depth // 2):].tolist()  # half the depth is left to draft
            best = (0, 0.0, None)
            stored = [(self._answer.store.trie, self.stores)] if self._answer is not None else []
            for trie, stores in [(self.local, None)] + stored:
                with stores.lock if stores else contextlib.nullcontext():
                    m, node = trie.match(tail)
                    if node is None:
                        continue
                    cap = min(self.max_nodes, max(1, int(self.factor * m)))
                    tokens, parents, score = trie.grow(node, cap, self.depth - m, self.threshold)
                    if tokens and (m, score) > best[:2]:  # the longer match, then the likelier tree
                        best = (m, score, (tokens, parents))
                        if stores:
                            stores.used(node)
            m, _, tree = best
            bucket = next((b for b, n in enumerate(MATCH_BUCKETS) if m >= n), len(MATCH_BUCKETS))
            draft = None if tree is None else Draft(np.array(tree[0], np.int64), np.array(tree[1], np.int64))
            self._plan = (ctx.length, bucket, draft)
        return self._plan[1:]

    def bucket(self, ctx: Context) -> int:
        return self._best(ctx)[0]

    def propose(self, ctx: Context, k: int) -> Draft:
        _, draft = self._best(ctx)
        if draft is None or k < 1:
            return EMPTY
        return draft.first(k)  # the best tree of k nodes, as wide a pass as the controller planned


def _drop(node: list) -> int:
    """Empty a subtree; the nodes it had, its root included."""
    n = 1 + sum(_drop(c) for c in node[1].values())
    node[0] = 0
    node[1].clear()
    return n
