"""PromptLookup: draft by copying what followed the last occurrence of the context's suffix.

Summaries quote their source, code edits repeat most of the code: when the last n tokens of the
context occurred before, the tokens that followed them then are a good guess for what follows now
(Saxena 2023, "prompt lookup decoding"). The draft is deterministic, so q = None (one-hot).

Index: for each n-gram size, a dict from the n-gram (tuple of ids) to the end of its most recent
occurrence, maintained incrementally: each round adds only the n-grams ending in the new tokens
(O(new tokens), never O(context) per round). An n-gram is indexed once a token follows it, so a
hit always has a continuation. Larger n is tried first: a longer match is a more specific guess.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ...errors import SpecrtError
from ..verify import Draft, VerifyResult
from .base import EMPTY, Context


class PromptLookup:
    name = "prompt-lookup"
    adaptive = True

    def __init__(self, ngram_sizes: tuple[int, ...] = (4, 3, 2), max_tokens: int = 16):
        sizes = tuple(sorted(set(int(n) for n in ngram_sizes), reverse=True))
        if not sizes or sizes[-1] < 1:
            raise SpecrtError(f"prompt-lookup n-gram sizes must be >= 1, got {ngram_sizes}; e.g. (4, 3, 2)")
        if max_tokens < 1:
            raise SpecrtError(f"prompt-lookup max_tokens must be >= 1, got {max_tokens}")
        self.ngram_sizes, self.max_tokens = sizes, max_tokens
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in sizes}
        self._indexed = 0  # n-grams ending at e < _indexed are in the index

    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        self._index = {n: {} for n in self.ngram_sizes}
        self._indexed = 0

    def propose(self, ctx: Context, k: int) -> Draft:
        self._catch_up(ctx)
        ids, length = ctx.ids, ctx.length
        for n in self.ngram_sizes:
            if length < n:
                continue
            end = self._index[n].get(tuple(ids[length - n:].tolist()))
            if end is not None:
                return Draft(ids[end: min(end + k, length)])
        return EMPTY

    def observe(self, result: VerifyResult) -> None:
        pass  # the index catches up with the context at the next propose

    def _catch_up(self, ctx: Context) -> None:
        """Index the n-grams ending at e in [_indexed, length - 1] (each has a next token)."""
        ids, stop = ctx.ids, ctx.length - 1
        for n in self.ngram_sizes:
            first = max(self._indexed, n)        # an n-gram ending at e starts at e - n >= 0
            if first > stop:
                continue
            grams = sliding_window_view(ids[first - n: stop], n)   # [stop - first + 1, n]
            # dict.update keeps the last write: the most recent occurrence wins
            self._index[n].update(zip(map(tuple, grams.tolist()), range(first, stop + 1)))
        self._indexed = max(self._indexed, stop + 1)
