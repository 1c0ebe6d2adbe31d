"""Suffix decoding (runtime/proposers/suffix.py): the count trie against a naive count, the tree it grows, the store's
bound, and exactness on a tiny engine (greedy equals plain; seeded sampling returns plain sampling's very tokens)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrt.errors import SpecrtError
from specrt.runtime.engine import EngineOptions
from specrt.runtime.generate import Generator
from specrt.runtime.proposers import Context
from specrt.runtime.proposers.suffix import NODE_BYTES, SuffixDecoding, SuffixStore, SuffixTrie
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import SpeculativeConfig, make_decoder


def _trie(seqs, depth):
    t = SuffixTrie(depth)
    for seq in seqs:
        o = []
        for x in seq:
            o = t.add(o, x)
    return t


def _counts(node, prefix=()):
    out = {}
    for tok, child in node[1].items():
        out[prefix + (tok,)] = child[0]
        out.update(_counts(child, prefix + (tok,)))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=20), min_size=1, max_size=4), st.integers(1, 6))
def test_the_trie_counts_every_substring_up_to_its_depth_and_forgets_exactly(seqs, depth):
    naive = Counter(tuple(s[i:j]) for s in seqs for i in range(len(s))
                    for j in range(i + 1, min(i + depth, len(s)) + 1))
    t = _trie(seqs, depth)
    assert _counts(t.root) == dict(naive) and t.nodes == len(naive)
    o = []
    for x in seqs[0]:  # forget the first sequence: the rest's counts, as if it never came
        o = t.add(o, x, -1)
    rest = _trie(seqs[1:], depth)
    assert _counts(t.root) == _counts(rest.root) and t.nodes == rest.nodes


def test_the_longest_suffix_with_a_continuation_is_matched():
    t = _trie([[1, 2, 3, 4, 9, 2, 3, 5]], 8)
    assert t.match([7, 2, 3])[0] == 2          # "2 3" occurred (twice); "7 2 3" never
    assert t.match([1, 2, 3])[0] == 3
    assert t.match([5]) == (0, None)           # "5" ends the sequence: nothing followed it
    assert t.match([8]) == (0, None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=3), st.lists(st.integers(0, 2),
       min_size=1, max_size=4), st.floats(0.01, 1.0))
def test_a_grown_tree_lists_parents_first_most_probable_first(seqs, tail, threshold):
    t = _trie(seqs, 6)
    m, node = t.match(tail)
    if node is None:
        return
    tokens, parents, score = t.grow(node, 24, 6 - m, threshold)
    assert all(-1 <= p < i for i, p in enumerate(parents)) and len(tokens) <= 24
    assert score <= len(tokens) + 1e-9


def test_the_tree_takes_the_most_frequent_continuations_above_the_threshold():
    t = _trie([[1, 2, 3]] * 3 + [[1, 2, 4]], 8)
    _, node = t.match([1, 2])
    tokens, parents, score = t.grow(node, 8, 8, 0.2)
    assert tokens == [3, 4] and parents == [-1, -1] and score == pytest.approx(1.0)
    tokens, _, _ = t.grow(node, 8, 8, 0.3)     # 4 followed "1 2" a quarter of the time
    assert tokens == [3]
    _, node = t.match([1])
    tokens, parents, _ = t.grow(node, 8, 8, 0.2)
    assert tokens == [2, 3, 4] and parents == [-1, 0, 0]


def test_the_store_stays_within_its_budget_oldest_answer_out():
    store = SuffixStore(60 * NODE_BYTES, 4)
    for a in range(5):
        answer = store.begin()
        store.extend(answer, [100 * a + i for i in range(10)])  # 10 tokens, depth 4: 34 nodes an answer
        store.end(answer)
    assert store.nbytes <= 60 * NODE_BYTES and list(store.answers) == [4]
    assert store.trie.match([400, 401])[0] == 2 and store.trie.match([300, 301]) == (0, None)
    small = SuffixStore(NODE_BYTES, 4)
    answer = small.begin()
    small.extend(answer, list(range(10)))  # an answer being written is never evicted
    assert small.trie.match([0, 1])[0] == 2


def test_bad_settings_are_one_line():
    for cfg, words in ((SpeculativeConfig(suffix_threshold=0), "--suffix-threshold"),
                       (SpeculativeConfig(suffix_threshold=1.5), "--suffix-threshold"),
                       (SpeculativeConfig(suffix_cache_mib=-1), "--suffix-cache"),
                       (SpeculativeConfig(suffix_factor=0), "--suffix-factor")):
        with pytest.raises(SpecrtError, match=words):
            cfg.check()
    with pytest.raises(SpecrtError, match="threshold"):
        SuffixDecoding(None, threshold=0)


def test_a_request_drafts_from_its_own_text_and_from_earlier_answers():
    p = SuffixDecoding(SuffixStore(2**20, 8))
    ctx = Context([5, 6, 7, 8, 5, 6], 64)
    p.start(ctx)
    assert p.propose(ctx, 4).tokens.tolist() == [7, 8, 5, 6][:2 * 2]  # a 2-token match drafts up to 4
    ctx.extend(np.array([20, 21, 22, 23], np.int64))  # the answer so far goes to the store
    p.propose(ctx, 4)
    fresh = Context([1, 20, 21], 64)  # a new request: only the store has seen "20 21"
    p.start(fresh)
    assert p.propose(fresh, 4).tokens.tolist() == [22, 23]


@pytest.fixture(scope="module")
def gen(tiny_engines):
    return Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))


PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2, "def add(a, b):\n    return a + b\n" * 2,
           "The quick brown fox jumps over the lazy dog. " * 2]  # the third repeats the first: the store knows it


@pytest.mark.parametrize("k", [None, 8])
def test_greedy_suffix_equals_plain_and_drafts_from_the_store(gen, k):
    decoder = make_decoder("suffix", gen.manifest, config=SpeculativeConfig(draft_tokens=k))
    rounds = []
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_new_tokens=60)
        spec = gen.generate(prompt, max_new_tokens=60, decode=decoder)
        assert spec.token_ids == plain.token_ids and spec.stats.proposer == "suffix" and spec.stats.exact
        rounds.append(spec.stats.rounds)
    if k:  # (the adaptive K keeps this tiny engine's drafts short: its wide passes cost more than they save)
        assert rounds[2] < rounds[0] / 2, rounds  # the repeated request: its answer came from the store


def test_seeded_sampling_returns_plain_samplings_tokens(gen):
    decoder = make_decoder("suffix", gen.manifest)
    for seed, prompt in enumerate(PROMPTS):
        s = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        plain = gen.generate(prompt, max_new_tokens=50, sampling=s)
        spec = gen.generate(prompt, max_new_tokens=50, sampling=s, decode=decoder)
        assert spec.token_ids == plain.token_ids and spec.stats.exact


def test_the_streams_of_a_batch_share_one_store_and_stay_exact(tiny_engines, gen):
    import threading

    from specrt.runtime.session import load

    batch = load(tiny_engines, "fp32", "suffix", parallel=2, config=SpeculativeConfig(draft_tokens=8))
    stores = {id(slot.decoder.proposer.store) for slot in batch.slots}
    assert len(stores) == 1
    want = [gen.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]
    got = [None] * len(PROMPTS)

    def run(i):
        got[i] = batch.generate(PROMPTS[i], max_new_tokens=40).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    run(2)  # the first prompt again, on whichever slot: the shared store holds its answer
    assert got == want


def test_the_servers_suffix_flags_default_to_the_configs():
    import inspect

    from specrt.serve_command import serve

    params = inspect.signature(serve).parameters
    cfg = SpeculativeConfig()
    assert params["suffix_threshold"].default.default == cfg.suffix_threshold
    assert params["suffix_factor"].default.default == cfg.suffix_factor
    assert params["suffix_cache"].default.default == cfg.suffix_cache_mib
