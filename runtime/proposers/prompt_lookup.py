"""PromptLookup: draft by copying what followed the last occurrence of the context's suffix.

Summaries quote their source, code edits repeat most of the code: when the last n tokens of the
context occurred before, the tokens that followed them then are a good guess for what follows now
(Saxena 2023, "prompt lookup decoding"). The draft is deterministic, so q = None (one-hot).

More: docs/runtime-notes.md, "Module notes: runtime/proposers/prompt_lookup.py".
"""

from __future__ import annotations

from ...errors import SpecrtError
from ..verify import Draft
from .base import EMPTY, Context, Proposer


class PromptLookup(Proposer):
    name = "prompt-lookup"

    def __init__(self, ngram_sizes: tuple[int, ...] = (6, 4, 3, 2, 1), max_tokens: int = 16):
        sizes = tuple(sorted(set(int(n) for n in ngram_sizes), reverse=True))
        if not sizes or sizes[-1] < 1:
            raise SpecrtError(f"prompt-lookup n-gram sizes must be >= 1, got {ngram_sizes}; e.g. (4, 3, 2)")
        if max_tokens < 1:
            raise SpecrtError(f"prompt-lookup max_tokens must be >= 1, got {max_tokens}")
        self.ngram_sizes, self.max_tokens = sizes, max_tokens
        self.buckets = len(sizes) + 1
        self.match_sizes = sizes  # the match lengths its buckets start at (a Fallback routes by them)
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in sizes}
        self._indexed = 0  # n-grams ending at e < _indexed are in the index
        self._match = (-1, 0, None)  # (context length, bucket, end) of the last lookup

    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        self._index = {n: {} for n in self.ngram_sizes}
        self._indexed = 0
        self._match = (-1, 0, None)

    def bucket(self, ctx: Context) -> int:
        return self._lookup(ctx)[0]

    def propose(self, ctx: Context, k: int) -> Draft:
        _, end = self._lookup(ctx)
        if end is None or k < 1:
            return EMPTY
        return Draft(ctx.ids[end: min(end + k, ctx.length)])

    def _lookup(self, ctx: Context) -> tuple[int, int | None]:
        """(bucket, end of the most recent occurrence of the longest matching suffix), once per length."""
        if self._match[0] != ctx.length:
            self._catch_up(ctx)
            length = ctx.length
            tail = ctx.ids[max(0, length - self.ngram_sizes[0]):].tolist()  # one conversion per round
            found = (len(self.ngram_sizes), None)
            for b, n in enumerate(self.ngram_sizes):
                end = self._index[n].get(tuple(tail[len(tail) - n:])) if length >= n else None
                if end is not None:
                    found = (b, end)
                    break
            self._match = (ctx.length, *found)
        return self._match[1:]

    def _catch_up(self, ctx: Context) -> None:
        """Index the n-grams ending at e in [_indexed, length - 1] (each has a next token)."""
        stop = ctx.length - 1
        start = min(max(self._indexed, n) for n in self.ngram_sizes)   # an n-gram ending at e starts at e - n >= 0
        if start > stop:
            return
        # slices of one Python list: faster than numpy windows for a round's few new tokens (no per-call
        # overhead) and for a whole prompt alike, so there is one path
        lo = max(0, start - self.ngram_sizes[0])
        ids = ctx.ids[lo: stop].tolist()
        for n in self.ngram_sizes:
            index = self._index[n]
            for e in range(max(self._indexed, n), stop + 1):
                index[tuple(ids[e - n - lo: e - lo])] = e   # the last write wins: the most recent occurrence
        self._indexed = max(self._indexed, stop + 1)
