"""Constrained decoding (runtime/grammar.py): output held to a grammar, exact under every proposer (greedy equals
plain constrained greedy token for token), and sampled speculation keeping the constrained distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.engine import EngineOptions
from specrt.runtime.generate import Generator, Stats, plain_decode
from specrt.runtime.grammar import Grammar, json_schema_grammar, masked
from specrt.runtime.proposers import Proposer
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.session import load
from specrt.runtime.speculative import FixedK, SpeculativeConfig, speculative_decode
from specrt.runtime.verify import Draft
from test_speculative import ALPHA, Oracle, same_distribution_p

pytest.importorskip("llguidance")

# bounded JSON (an enum, a short string, a boolean): a random model finishes it well within the budget
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "note": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "note", "ok"], "additionalProperties": False}
PROMPT = 'Answer in JSON like {"city": "Rome", "note": "sunny", "ok": true}. {"city": "Oslo", "note": "'


@pytest.fixture(scope="module")
def gen(tiny_engines):
    return Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))


def _json(gen) -> Grammar:
    return gen.grammar(json_schema_grammar(SCHEMA))


def test_output_is_json_of_the_schema_greedy_and_sampled(gen):
    free = gen.generate(PROMPT, max_new_tokens=60)
    with pytest.raises(ValueError):
        json.loads(free.text)  # the random model alone writes no JSON: the grammar is what makes it
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=7),
                     SamplingParams(temperature=1.5, seed=9)):
        r = gen.generate(PROMPT, max_new_tokens=80, sampling=sampling, grammar=_json(gen))
        assert r.stats.finish_reason == "eos", (sampling, r.text)
        obj = json.loads(r.text)
        assert set(obj) == {"city", "note", "ok"} and obj["city"] in ("Paris", "Rome", "Oslo")
        assert isinstance(obj["ok"], bool) and len(obj["note"]) <= 12


def test_a_budget_too_short_for_the_grammar_ends_with_length(gen):
    r = gen.generate(PROMPT, max_new_tokens=3, grammar=_json(gen))
    assert r.stats.finish_reason == "length" and len(r.token_ids) == 3


def test_a_grammar_that_does_not_compile_is_one_line(gen):
    with pytest.raises(SpecrtError, match="does not compile.*strnig"):
        gen.grammar(json_schema_grammar({"type": "object", "properties": {"a": {"type": "strnig"}}}))


@pytest.mark.parametrize("tree", [False, True])
def test_an_oracle_of_the_unconstrained_path_keeps_constrained_greedy_exact(gen, tree):
    """The oracle drafts the unconstrained greedy continuation: most of its tokens are forbidden, chains are cut
    at them and tree nodes are never accepted; the output is plain constrained greedy's, token for token."""
    prompt = gen.prompt_ids(PROMPT)
    free = _tokens(plain_decode, gen, prompt, 40)
    ref = _tokens(plain_decode, gen, prompt, 40, grammar=_json(gen))
    assert ref != free
    for oracle in (Oracle(free, 384, tree), Oracle(ref, 384, tree)):
        stats = Stats()
        out = _tokens(lambda *a, **kw: speculative_decode(*a, proposer=oracle, control=FixedK(3), **kw), gen, prompt,
                      40, stats, grammar=_json(gen))
        assert out == ref
    assert stats.acceptance_by_position[0] == 1.0  # the constrained oracle is accepted whole


def _tokens(decode, gen, prompt, n, stats=None, sampling=SamplingParams(), rng=None, grammar=None) -> list[int]:
    out: list[int] = []
    kw = {} if grammar is None else {"grammar": grammar}
    rounds = decode(gen.engine, prompt, sampling, rng or np.random.default_rng(0), stats or Stats(), **kw)
    for toks in rounds:
        out += toks
        if len(out) >= n or gen.codec.eos_token_ids & set(toks):
            break
    rounds.close()
    return out[:n]


@pytest.fixture(scope="module")
def every_proposer(tiny_dir, tmp_path_factory):
    """The tiny Llama with a noisy draft model and a random EAGLE head: one set, every --speculate mode but
    Medusa's (its heads are trained: tested on the real default set below)."""
    import torch
    from transformers import AutoConfig

    from specrt.export.eagle import HeadShape, make_head, save_head
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint

    draft = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-draft-g", "llama", seed=0, noise=0.3)
    config = AutoConfig.from_pretrained(str(tiny_dir))
    shape = HeadShape.of(config)
    torch.manual_seed(0)
    head = tmp_path_factory.mktemp("eagle-g") / "head.npz"
    save_head(head, make_head(shape), np.arange(config.vocab_size), {"shape": shape.__dict__})
    return make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-grammar", ("fp32",), 256,
                                            tmp_path_factory.mktemp("engines-g"), str(draft), eagle_head=head),
                           log=lambda m: None)


@pytest.mark.parametrize("mode", ["prompt-lookup", "suffix", "draft", "eagle", "lookup+eagle", "eagle-chain"])
def test_every_proposer_under_a_grammar_equals_plain_constrained_greedy(every_proposer, mode):
    config = SpeculativeConfig(eagle_tree=mode != "eagle-chain")
    spec = load(every_proposer, "fp32", mode.replace("-chain", ""), config=config)
    plain = load(every_proposer, "fp32", "off")
    rounds = 0
    for prompt in (PROMPT, 'Reply {"city": "Paris", "note": "rain", "ok": false} or {"city": "Rome", "note": "'):
        a = spec.generate(prompt, max_new_tokens=80, grammar=spec.grammar(json_schema_grammar(SCHEMA)))
        b = plain.generate(prompt, max_new_tokens=80, grammar=plain.grammar(json_schema_grammar(SCHEMA)))
        assert a.token_ids == b.token_ids, (mode, prompt)
        assert a.stats.finish_reason == "eos" and json.loads(a.text)
        rounds += a.stats.rounds
        assert a.stats.proposer != "off" and any(a.stats.drafted_by_position)
    assert rounds < 2 * 60


@pytest.mark.parametrize("mode", ["off", "prompt-lookup", "eagle"])
def test_the_logit_screen_gives_constrained_greedy_the_tokens_of_full_logits(every_proposer, mode):
    """Greedy under a grammar reads the screen's argmax where the grammar allows every emitted token and reads the
    pass again in full where it does not: the output is the full-logits one, and both branches ran."""
    screened = load(every_proposer, "fp32", mode)
    full = load(every_proposer, "fp32", mode, options=EngineOptions(logit_screen=False))
    assert screened.engine.screen and not full.engine.screen
    calls = {"argmax": 0, "forward": 0}
    engine = screened.engine
    for name in calls:
        def counted(*a, _f=getattr(engine, name), _n=name, **kw):
            calls[_n] += not calls.get("inside")  # a backend's argmax may run its own forward: one pass
            calls["inside"] = True
            try:
                return _f(*a, **kw)
            finally:
                calls["inside"] = False
        setattr(engine, name, counted)
    rounds = 0
    for prompt in (PROMPT, 'Reply {"city": "Paris", "note": "rain", "ok": false} or {"city": "Rome", "note": "'):
        a = screened.generate(prompt, max_new_tokens=80, grammar=screened.grammar(json_schema_grammar(SCHEMA)))
        b = full.generate(prompt, max_new_tokens=80, grammar=full.grammar(json_schema_grammar(SCHEMA)))
        assert a.token_ids == b.token_ids and json.loads(a.text), (mode, prompt)
        rounds += a.stats.rounds
    # a round is one screened pass (a hit), a screened pass read again in full (a miss), or a full pass
    assert 0 < calls["forward"] < rounds and calls["argmax"] > rounds - calls["forward"], (calls, rounds)


def test_a_batch_session_gives_each_stream_the_constrained_output(tiny_engines, gen):
    """Two streams at once (load(parallel=2)), each under its own grammar: each equals the one-stream output."""
    import threading

    batch = load(tiny_engines, "fp32", "auto", parallel=2)
    prompts = [PROMPT, 'Reply {"city": "Paris", "note": "rain", "ok": false} or {"city": "Rome", "note": "']
    want = [gen.generate(p, max_new_tokens=80, grammar=_json(gen)).token_ids for p in prompts]
    got = [None, None]

    def run(i):
        got[i] = batch.generate(prompts[i], max_new_tokens=80,
                                grammar=batch.grammar(json_schema_grammar(SCHEMA))).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


# --- sampling: the constrained distribution ------------------------------------------------------------------

LETTERS = 'start: /[a-z ]{1,6}/'  # about a third of the tiny vocabulary is letters and spaces


class SampledOracle(Proposer):
    """Drafts each token from a fixed q (most of its mass on tokens the grammar forbids), as a sampled draft model
    does: a forbidden token's rejection must still draw from the residual norm(max(0, p - q))."""

    name, max_tokens, adaptive = "sampled-oracle", 4, True

    def __init__(self, q: np.ndarray):
        self.q = q

    def start(self, ctx, sampling, rng):
        self.rng = rng

    def propose(self, ctx, k):
        tokens = self.rng.choice(self.q.size, size=k, p=self.q)
        return Draft(tokens, q=np.repeat(self.q[None], k, 0))


def _constrained_joint(gen, prompt, params, grammar_text):
    """Exact P(t1, t2) under the grammar's masks, from one-token passes."""
    eng, V = gen.engine, gen.engine.vocab_size
    g = gen.grammar(grammar_text)
    eng.rewind(0)
    p1 = probs_from_logits(masked(eng.forward(np.array(prompt, np.int64)), g.allowed()[None]), params)[0]
    eng.commit(len(prompt))
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1):
        eng.rewind(len(prompt))
        g.advance([t1])
        row = probs_from_logits(masked(eng.forward(np.array([t1])), g.allowed()[None]), params)[0]
        joint[t1] = p1[t1] * row
        g.rollback(1)
    return joint


def _sampled_counts(gen, prompt, params, q, k, n, greedy_cut=False):
    counts = np.zeros((gen.engine.vocab_size,) * 2)
    rng = np.random.default_rng(2024)
    for _ in range(n):
        g = gen.grammar(LETTERS)
        if greedy_cut:  # the plausible bug: a sampled chain cut before its forbidden token, as greedy's is
            check = g.check_draft
            g.check_draft = lambda draft, greedy: check(draft, True)
        oracle = SampledOracle(q)
        t = _tokens(lambda *a, **kw: speculative_decode(*a, proposer=oracle, control=FixedK(k), **kw), gen, prompt,
                    2, sampling=params, rng=rng, grammar=g)
        counts[t[0], t[1]] += 1
    return counts


def _q_mostly_forbidden(gen, prompt, params):
    """q: 0.3 on the likeliest allowed first token, 0.7 spread over forbidden ones."""
    p = _constrained_joint(gen, prompt, params, LETTERS).sum(1)
    forbidden = np.flatnonzero(~gen.grammar(LETTERS).allowed())[:8]
    q = np.zeros(gen.engine.vocab_size)
    q[int(p.argmax())], q[forbidden] = 0.3, 0.7 / forbidden.size
    return q


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.slow
def test_sampled_speculation_keeps_the_constrained_distribution(gen, k):
    prompt = gen.prompt_ids("Hello, how are you today?")
    params = SamplingParams(temperature=1.0, top_k=4)
    joint = _constrained_joint(gen, prompt, params, LETTERS)
    assert (joint.sum(1) > 0).sum() >= 3  # several tokens are possible first, and the draft's q differs from p
    counts = _sampled_counts(gen, prompt, params, _q_mostly_forbidden(gen, prompt, params), k, 1500)
    p = same_distribution_p(counts, joint)
    assert p > ALPHA, f"constrained speculative sampling differs from the target: chi-square p = {p:.2g}"


@pytest.mark.slow
def test_the_constrained_distribution_test_catches_a_greedy_cut_of_a_sampled_chain(gen):
    prompt = gen.prompt_ids("Hello, how are you today?")
    params = SamplingParams(temperature=1.0, top_k=4)
    joint = _constrained_joint(gen, prompt, params, LETTERS)
    counts = _sampled_counts(gen, prompt, params, _q_mostly_forbidden(gen, prompt, params), 1, 1500, greedy_cut=True)
    assert same_distribution_p(counts, joint) < ALPHA


def test_tags_that_are_tokens_of_their_own_are_written_as_tokens(tiny_engines, tmp_path):
    """Qwen2.5 has <tool_call> and </tool_call> as added tokens (not `special` to transformers, special to
    llguidance): a grammar spelling them as text would force the model to write them in pieces, which it never
    does, and llguidance refuses the token itself. The grammar names the token instead."""
    from tokenizers import AddedToken, Tokenizer

    from specrt.runtime.grammar import GrammarTokenizer
    from specrt.server.tool_calls import grammar, split

    tok = Tokenizer.from_file(str(tiny_engines / "tokenizer.json"))
    tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    V = tok.get_vocab_size()
    opened = tok.token_to_id("<tool_call>")
    gt = GrammarTokenizer(tok.to_str(), V, [tok.token_to_id("<|im_end|>")])
    plain = GrammarTokenizer(Tokenizer.from_file(str(tiny_engines / "tokenizer.json")).to_str(), 384, [2])
    assert gt.literal("<tool_call>") == f"<[{opened}]>" and plain.literal("<tool_call>") == '"<tool_call>"'
    tools = [{"name": "book_table", "parameters": {"type": "object", "properties": {"party": {"enum": [2, 4]}},
                                                   "required": ["party"], "additionalProperties": False}}]
    g = gt.matcher(grammar(tools, required=True, literal=gt.literal))
    assert np.flatnonzero(g.allowed()).tolist() == [opened]
    out = [opened]
    g.advance(out)
    for _ in range(80):  # a "model" that takes the lowest allowed id (single characters: about 50 tokens)
        ok = np.flatnonzero(g.allowed())
        if ok.tolist() == [tok.token_to_id("<|im_end|>")]:
            break
        out.append(int(ok[0]))
        g.advance(out[-1:])
    text = tok.decode(out, skip_special_tokens=True)
    content, calls, _ = split(text)
    assert content == "" and calls[0].name == "book_table" and json.loads(calls[0].arguments)["party"] in (2, 4)
    auto = gt.matcher(grammar(tools, required=False, literal=gt.literal))
    assert auto.allowed()[opened] and auto.allowed().sum() > 100  # text, or the call's token


@pytest.fixture(scope="module")
def sessions(every_proposer):
    """One session per --speculate mode of the every-proposer set, loaded once."""
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode] = load(every_proposer, "fp32", mode.replace("-chain", ""),
                               config=SpeculativeConfig(eagle_tree=mode != "eagle-chain"))
        return cache[mode]
    return get


@pytest.mark.parametrize("required", [True, False])
@pytest.mark.parametrize("fmt", ["hermes", "llama3-json", "mistral", "mistral-args", "granite", "phi4-mini",
                                 "gemma-json"])
@pytest.mark.parametrize("mode", ["prompt-lookup", "suffix", "draft", "eagle", "lookup+eagle", "eagle-chain"])
def test_every_proposer_under_every_tool_formats_grammar_equals_plain(sessions, mode, fmt, required):
    """Greedy speculative output equals plain output under each format's tool-call grammar (forced calls, and
    auto's text-or-calls), and a forced reply is a call in that format."""
    from specrt.runtime.tool_formats import by_name
    from specrt.server.tool_calls import grammar, split

    f, tools = by_name(fmt), [{"name": "report", "parameters": SCHEMA}]
    spec, plain = sessions(mode), sessions("off")
    a, b = (s.generate(PROMPT, max_new_tokens=120, grammar=s.grammar(grammar(tools, required, False,
                                                                             s.grammar_literal, f)))
            for s in (spec, plain))
    assert a.token_ids == b.token_ids, (mode, fmt, required)
    assert a.stats.proposer != "off"
    if required:
        content, calls, _ = split(a.text, f)
        assert a.stats.finish_reason == "eos" and calls and not content, a.text
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome", "Oslo")


def test_auto_holds_a_reply_opening_as_a_bare_call_to_one_call(tmp_path):
    """Hermes under "auto" (docs/formats.md#bare-calls): a reply that is one call bare or in doubled braces is
    accepted token by token; a reply opening like one must be a call of a tool (other JSON there is
    refused, text elsewhere free); tool_choice "none" refuses the shapes. A "model" that writes '{' whenever it
    may writes a doubled-brace call, which reads back as a call."""
    from tokenizers import Tokenizer

    from specrt.runtime.grammar import GrammarTokenizer
    from specrt.runtime.tool_formats import by_name
    from specrt.server.tool_calls import grammar, split, text_grammar
    from tiny import make_tokenizer

    make_tokenizer(tmp_path, 384, plain=("<tool_call>", "</tool_call>"))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    gt, fmt = GrammarTokenizer(tok.to_str(), 384, [2]), by_name("hermes")
    tools = [{"name": "book_table", "parameters": {"type": "object", "properties": {"party": {"enum": [2, 4]}},
                                                   "required": ["party"], "additionalProperties": False}}]
    auto, none = grammar(tools, False, True, gt.literal, fmt), text_grammar(fmt, literal=gt.literal)
    call = '{"name": "book_table", "arguments": {"party": 4}}'

    def takes(source: str, text: str) -> bool:
        m, ids = gt.matcher(source).m, tok.encode(text).ids
        return m.validate_tokens(ids) == len(ids) and (m.consume_tokens(ids) or True) and m.is_accepting()

    for before, after in fmt.bare:
        assert takes(auto, before + call + after) and not takes(none, before + call + after), before
    for text in ("Sure, at 19:30.", "```python\nx = 1\n```", "Done: " + call, "The call:\n```json\n" + call + "\n```"):
        assert takes(auto, text) and takes(none, text), text  # a fenced call after text: the parser's to read
    for text in ('{"answer": 4}', '{"name": "book_table", "arguments": {"party": 3}}', " " + call + " and more",
                 '{{"name": "other", "arguments": {}}}'):
        assert not takes(auto, text), text
    g, out, brace = gt.matcher(auto), [], tok.token_to_id("{")
    for _ in range(80):
        ok = np.flatnonzero(g.allowed())
        if ok.tolist() == [2]:
            break
        out.append(brace if g.allowed()[brace] else int(ok[0]))
        g.advance(out[-1:])
    text = tok.decode(out)
    content, calls, _ = split(text, fmt, names=["book_table"])
    assert text.startswith("{{") and content == "" and [c.name for c in calls] == ["book_table"], text
