"""PromptLookup: the incremental n-gram index against a naive scan, and exactness on a tiny engine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrt.runtime.engine import EngineOptions
from specrt.errors import SpecrtError
from specrt.runtime.proposers import Context, PromptLookup


def naive(ids: list[int], sizes: tuple[int, ...], k: int) -> tuple[int, list[int]]:
    """The most recent earlier occurrence of the longest suffix n-gram: (bucket = index of its
    size in descending order, what followed it); (len(sizes), []) without a match."""
    L = len(ids)
    for b, n in enumerate(sorted(sizes, reverse=True)):
        if L < n:
            continue
        suffix = ids[L - n:]
        for end in range(L - 1, n - 1, -1):       # end < L: a continuation exists
            if ids[end - n:end] == suffix:
                return b, ids[end:min(end + k, L)]
    return len(sizes), []


def test_copies_what_followed_the_suffix():
    ctx = Context([5, 6, 7, 8, 9, 1, 5, 6], capacity=32)
    pl = PromptLookup(ngram_sizes=(2,), max_tokens=8)
    pl.start(ctx)
    assert pl.propose(ctx, 3).tokens.tolist() == [7, 8, 9]
    assert pl.propose(ctx, 10).tokens.tolist() == [7, 8, 9, 1, 5, 6]   # capped at the context's end


def test_longer_ngram_wins_and_most_recent_occurrence():
    ctx = Context([1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3], capacity=32)
    pl = PromptLookup(ngram_sizes=(3, 2), max_tokens=4)
    pl.start(ctx)
    assert pl.propose(ctx, 1).tokens.tolist() == [40]        # 3-gram (1, 2, 3) beats 2-gram (2, 3) -> 50
    assert pl.bucket(ctx) == 0 and pl.buckets == 3           # buckets: sizes 3, 2, and "no match"
    pl2 = PromptLookup(ngram_sizes=(2,), max_tokens=4)
    pl2.start(ctx)
    assert pl2.propose(ctx, 1).tokens.tolist() == [50]       # most recent (2, 3)


def test_no_match_is_an_empty_draft_and_bad_config_is_an_error():
    ctx = Context([1, 2, 3, 4], capacity=8)
    pl = PromptLookup()
    pl.start(ctx)
    assert pl.propose(ctx, 5).tokens.size == 0
    assert pl.bucket(ctx) == len(pl.ngram_sizes)
    with pytest.raises(SpecrtError):
        PromptLookup(ngram_sizes=(0,))
    with pytest.raises(SpecrtError):
        PromptLookup(max_tokens=0)


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), min_size=1, max_size=100),
       chunks=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5) | st.lists(st.integers(0, 4),
                       min_size=60, max_size=80), max_size=8),
       k=st.integers(1, 6))
def test_incremental_index_equals_naive_scan(prompt, chunks, k):
    # short chunks (a round's new tokens) and long ones (a prompt) alike
    sizes = (3, 2, 1)
    ctx = Context(prompt, capacity=len(prompt) + 8 * 80)
    pl = PromptLookup(sizes, max_tokens=8)
    pl.start(ctx)
    ids = list(prompt)
    for chunk in [[]] + chunks:
        ctx.extend(np.array(chunk, np.int64))
        ids += chunk
        bucket, expect = naive(ids, sizes, k)
        assert pl.bucket(ctx) == bucket
        assert pl.propose(ctx, k).tokens.tolist() == expect


def test_greedy_prompt_lookup_equals_plain_on_tiny_engine(tiny_engines):
    from specrt.runtime.generate import Generator
    from specrt.runtime.speculative import SpeculativeConfig, make_decoder

    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    prompt = "def add(a, b):\n    return a + b\n" * 3 + "The quick brown fox jumps over the lazy dog. " * 2
    plain = gen.generate(prompt, max_new_tokens=60)
    for cfg in (SpeculativeConfig(), SpeculativeConfig(draft_tokens=5), SpeculativeConfig(ngram_sizes=(1,))):
        spec = gen.generate(prompt, max_new_tokens=60, decode=make_decoder("prompt-lookup", gen.manifest, config=cfg))
        assert spec.token_ids == plain.token_ids
        assert spec.stats.proposer == "prompt-lookup" and spec.stats.exact
        assert spec.stats.rounds <= plain.stats.rounds
