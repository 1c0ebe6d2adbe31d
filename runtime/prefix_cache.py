"""Sequences whose KV cache the server keeps besides the one in the engine, least recently used first out.

One engine holds one sequence's cache (the `live` one: the last request's prompt + answer). A request that would
overwrite much of it (another conversation's turn; SAVE_MIN_LOST tokens or more) saves it here first, and
a kept sequence that shares a longer prefix with the request than the live one goes back into the engine, so the
request prefills only the rest (Generator._reuse; a kept sequence the request shares only a head with, another
conversation's under the same system prompt, is copied back and stays kept). Saved caches are host copies
(Engine.save_prefix) of the target and of any proposer that keeps a cache of its own (a draft model), bounded by a
byte budget, like llama.cpp's server `--cache-ram`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .engine import KVSnapshot

MIB = 1 << 20
# A request that would overwrite at least this many tokens of the sequence in the engine saves it first: another
# conversation's turn, not the next turn of the same one (which rewrites a few at most, where the answer's text
# tokenizes differently). Likewise a kept sequence all but this many of whose tokens a newer one holds is dropped.
SAVE_MIN_LOST = 32


def _locked(method):
    """Run a PrefixStore method under its lock."""
    import functools

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


def common_prefix(a, b, limit: int) -> int:
    """Length of the longest common prefix of token sequences a and b, at most limit (vectorised: the server
    compares every request with every kept sequence)."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if same.all() else int(np.argmin(same))


@dataclass
class Kept:
    """One saved sequence: its tokens (what the target's cache holds, position by position), the target's cache,
    and the state of each proposer that keeps one (by name)."""

    ids: np.ndarray  # int64
    target: KVSnapshot
    proposers: dict[str, object] = field(default_factory=dict)
    nbytes: int = 0


class PrefixStore:
    """Kept sequences under a byte budget, least recently used evicted first. budget_bytes 0: keep none (only the
    live sequence in the engine is reused). Thread-safe: the slots of a batch share one."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._next = 0
        self.evictions = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._kept)

    @property
    @_locked
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self._kept.values())

    @_locked
    def best(self, ids, limit: int) -> tuple[int | None, int]:
        """(key, length) of the kept sequence sharing the longest prefix with ids (at most limit); (None, 0) if
        none shares any."""
        key, best = None, 0
        for k, kept in self._kept.items():
            n = common_prefix(kept.ids, ids, limit)
            if n > best:
                key, best = k, n
        return key, best

    @_locked
    def holds(self, ids) -> bool:
        """A kept sequence is exactly ids."""
        return any(len(k.ids) == len(ids) and common_prefix(k.ids, ids, len(ids)) == len(ids)
                   for k in self._kept.values())

    @_locked
    def claim(self, ids, limit: int, longer_than: int) -> tuple[Kept | None, int]:
        """The kept sequence sharing the longest prefix with ids (at most limit), if that is more than longer_than
        tokens, and that length; (None, 0) otherwise. One that the request extends (it would overwrite fewer than
        SAVE_MIN_LOST of its tokens) leaves the store, as the engine holds it from now on; one it shares only a
        head with (another conversation under the same system prompt) stays, as the most recently used, so that
        conversation's next turn still finds it. One step under the lock: the slots of a batch claim at once."""
        key, n = self.best(ids, limit)
        if key is None or n <= longer_than:
            return None, 0
        kept = self._kept[key]
        if len(kept.ids) - n >= SAVE_MIN_LOST:
            self._kept.move_to_end(key)
        else:
            del self._kept[key]
        return kept, n

    @_locked
    def put(self, kept: Kept) -> bool:
        """Keep a sequence, evicting the least recently used ones to stay within the budget (and any kept one it
        holds all but SAVE_MIN_LOST tokens of); False (and nothing kept) when it alone exceeds the budget."""
        kept.nbytes = kept.target.nbytes + sum(s.nbytes for s in kept.proposers.values())
        if kept.nbytes > self.budget:
            return False
        for k in [k for k, old in self._kept.items()
                  if common_prefix(old.ids, kept.ids, len(old.ids)) > len(old.ids) - SAVE_MIN_LOST]:
            del self._kept[k]  # this one holds (nearly) all of it: an earlier turn of the same conversation
        while self._kept and self.nbytes + kept.nbytes > self.budget:
            self._kept.popitem(last=False)
            self.evictions += 1
        self._kept[self._next] = kept
        self._next += 1
        return True
