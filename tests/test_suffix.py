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
from specrt.runtime.proposers.suffix import NODE_BYTES, SuffixDecoding, SuffixStores, SuffixTrie
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Message
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


def _answer(stores, key, tokens):
    answer = stores.begin(key)
    stores.extend(answer, tokens)
    stores.end(answer)
    return answer


def test_the_stores_stay_within_their_budget_least_recently_used_answer_out():
    stores = SuffixStores(60 * NODE_BYTES, 4)
    for a in range(5):
        _answer(stores, None, [100 * a + i for i in range(10)])  # 10 tokens, depth 4: 34 nodes an answer
    trie = stores.stores[None].trie
    assert stores.nbytes <= 60 * NODE_BYTES and list(stores.answers) == [4]
    assert trie.match([400, 401])[0] == 2 and trie.match([300, 301]) == (0, None)
    small = SuffixStores(NODE_BYTES, 4)
    answer = small.begin()
    small.extend(answer, list(range(10)))  # an answer being written is never evicted
    assert small.stores[None].trie.match([0, 1])[0] == 2


def test_a_draft_from_an_answer_keeps_it_and_an_unused_one_goes():
    stores = SuffixStores(80 * NODE_BYTES, 4)
    first = _answer(stores, None, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    _answer(stores, None, [21, 22, 23, 24, 25, 26, 27, 28, 29, 30])
    p = SuffixDecoding(stores, 4)
    ctx = Context([50, 1, 2], 64)
    p.start(ctx)
    assert p.propose(ctx, 4).tokens.tolist()[:1] == [3]  # drafted from the first answer: it is used
    p.stores.end(p._answer)
    _answer(stores, None, [41, 42, 43, 44, 45, 46, 47, 48, 49, 40])  # over budget: the second goes, not the first
    trie = stores.stores[None].trie
    assert first.key in stores.answers and trie.match([1, 2])[0] == 2 and trie.match([21, 22]) == (0, None)


def test_earlier_answers_draft_only_where_they_match_more_of_the_context_than_the_request():
    """A phrase earlier answers often continued (a 2-token match, a 6-node tree) does not out-draft the request's own
    longer match (3 tokens, 4 nodes); where the store matches more than the request, it drafts."""
    stores = SuffixStores(2**20, 8)
    for _ in range(5):
        _answer(stores, None, [1, 2, 30, 31, 32, 33, 34, 35, 36])
    p = SuffixDecoding(stores, 8)
    ctx = Context([5, 1, 2, 40, 5, 1, 2], 64)
    p.start(ctx)
    assert p.propose(ctx, 8).tokens.tolist() == [40, 5, 1, 2]
    ctx = Context([9, 30, 31, 32], 64)
    p.start(ctx)
    assert p.propose(ctx, 8).tokens.tolist()[:2] == [33, 34]


def test_each_scope_key_drafts_only_from_its_own_answers_and_empty_scopes_go():
    stores = SuffixStores(2**20, 8)
    _answer(stores, "alice", [7, 8, 9, 10, 11])
    p = SuffixDecoding(stores, 8)
    for key, want in (("alice", [9, 10, 11]), ("bob", []), (None, [])):
        ctx = Context([1, 7, 8], 64)
        ctx.store_key = key
        p.start(ctx)
        assert p.propose(ctx, 4).tokens.tolist() == want, key
    tight = SuffixStores(40 * NODE_BYTES, 4)
    for n in range(4):  # one conversation each: the oldest go whole, scope and trie
        _answer(tight, f"conversation-{n}", [10 * n + i for i in range(8)])
    assert sorted(tight.stores) == ["conversation-3"] and tight.nbytes <= 40 * NODE_BYTES


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
    p = SuffixDecoding(SuffixStores(2**20, 8))
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
    stores = {id(slot.decoder.proposer.stores) for slot in batch.slots}
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

    from specrt.cli.serve import serve

    params = inspect.signature(serve).parameters
    cfg = SpeculativeConfig()
    assert params["suffix_threshold"].default.default == cfg.suffix_threshold
    assert params["suffix_factor"].default.default == cfg.suffix_factor
    assert params["suffix_cache"].default.default == cfg.suffix_cache_mib
    from specrt.server.ray_serve import EngineSpec, serve_ray

    ray_params = inspect.signature(serve_ray).parameters
    assert EngineSpec("x").suffix == tuple(ray_params[f"suffix_{k}"].default.default
                                           for k in ("cache", "threshold", "factor"))
    assert (cfg.suffix_cache_mib, cfg.suffix_threshold, cfg.suffix_factor) == EngineSpec("x").suffix


@pytest.mark.parametrize("scope, stores, prefix", [("server", 1, None), ("api-key", 2, "key:"),
                                                   ("conversation", 2, "conversation:")])
def test_the_server_keeps_a_store_per_scope_and_answers_stay_exact(tiny_engines, gen, scope, stores, prefix):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from specrt.runtime.session import load
    from specrt.server.app import create_app

    session = load(tiny_engines, "fp32", "suffix")
    turns = [("alice", [{"role": "user", "content": PROMPTS[0]}]),
             ("bob", [{"role": "user", "content": PROMPTS[1]}]),
             ("alice", [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": "Yes."},
                        {"role": "user", "content": PROMPTS[2]}])]
    with TestClient(create_app(session, suffix_scope=scope)) as client:
        for token, messages in turns:
            body = {"model": "tiny", "messages": messages, "max_tokens": 30, "temperature": 0}
            r = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text
            want = gen.generate([Message(**m) for m in messages], max_new_tokens=30).text
            assert r.json()["choices"][0]["message"]["content"] == want
    keys = list(session.decoder.proposer.stores.stores)
    assert len(keys) == stores and all(k is None if prefix is None else k.startswith(prefix) for k in keys), keys


def test_an_unknown_scope_is_one_line_and_exit_2(tiny_engines):
    from typer.testing import CliRunner

    from specrt.cli import app

    for args in (["serve", "--suffix-scope", "tenant"], ["serve-ray", "--suffix-scope", "user"]):
        r = CliRunner().invoke(app, [*args, "--engines", str(tiny_engines)])
        assert r.exit_code == 2 and "--suffix-scope must be one of server, api-key, conversation" in r.output
        assert "Traceback" not in r.output


def test_the_bench_gives_each_rep_its_own_store(tiny_engines):
    """`specrt bench --reps N`: the n-th run of a prompt writes to the n-th store, so suffix decoding never drafts a
    rep's answer from its own answer to the same prompt in an earlier rep (which it would copy whole)."""
    from specrt.bench.contenders import Ours
    from specrt.manifest import load_manifest

    ours = Ours("suffix-fp32", load_manifest(tiny_engines), threads=1)
    ours.load()
    gen = ours.gen
    messages = [("user", PROMPTS[0])]
    ids = gen.prompt_ids([Message(r, c) for r, c in messages])
    first, again = (ours.run(ids, messages, 30) for _ in range(2))
    ours.run(gen.prompt_ids([Message("user", PROMPTS[1])]), [("user", PROMPTS[1])], 30)
    assert first.token_ids == again.token_ids
    assert sorted(ours.session.decoder.proposer.stores.stores) == ["rep-0", "rep-1"]
