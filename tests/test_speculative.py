"""The speculative loop: exactness (greedy chains and trees, sampled distribution), the adaptive K
controller, make_decoder's mapping, and the real default model with prompt lookup."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats as sps

from specrt.runtime.engine import EngineOptions
from specrt.errors import SpecrtError
from specrt.runtime.generate import Generator, PlainDecoder, Stats, plain_decode
from specrt.runtime.proposers import Context, Proposer
from specrt.runtime.sampling import SamplingParams, probs_from_logits
from specrt.runtime.control import Round
from specrt.runtime.speculative import (AdaptiveK, FixedK, GatedK, SpeculativeConfig, make_decoder, speculative_decode,
                                        tree_inputs)
from specrt.runtime.tree import compile_tree
from specrt.runtime.verify import Draft, verify

ALPHA = 1e-6   # per goodness-of-fit assertion; seeds are fixed, so CI is deterministic


class Oracle(Proposer):
    """Drafts from a known greedy continuation `ref`: a tree whose first branches are wrong, so the
    accepted path is never the first nodes and commit(path) has to move K/V entries."""

    name, max_tokens, adaptive = "oracle", 8, True

    def __init__(self, ref: list[int], vocab: int, tree: bool):
        self.ref, self.vocab, self.tree = ref, vocab, tree

    def start(self, ctx, sampling, rng):
        self.prompt_length = ctx.prompt_length

    def propose(self, ctx: Context, k: int) -> Draft:
        done = ctx.length - self.prompt_length
        right = np.array(self.ref[done:done + 3], np.int64)
        if not self.tree or right.size < 3:
            return Draft(right[:k])
        wrong = (right + 1) % self.vocab
        # nodes: w0, c0, w1(w0), x(c0), c1(c0), c2(c1) -> accepted path [1, 4, 5]
        return Draft(np.array([wrong[0], right[0], wrong[1], wrong[1], right[1], right[2]]),
                     parents=np.array([-1, -1, 0, 1, 1, 4]))


def _prompt(gen: Generator) -> list[int]:
    return gen.prompt_ids("The quick brown fox jumps over the lazy dog. Hello, how are you today?")


def test_tree_inputs_match_compiled_trees():
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    ct = compile_tree(paths)
    pos, mask = tree_inputs(100, 1, ct.parents)
    assert pos.tolist() == (100 + ct.positions).tolist()
    causal = np.triu(np.full(mask.shape, -np.inf, np.float32), 1)   # the graph adds causality itself
    assert np.array_equal(mask + causal, ct.mask + causal)
    pos3, mask3 = tree_inputs(10, 3, ct.parents)                       # round 1: the prompt is pending
    assert pos3.tolist()[:3] == [10, 11, 12] and pos3.tolist()[3:] == (12 + ct.depth).tolist()
    assert (mask3[:, :3] == 0).all() and np.array_equal(mask3[3:, 3:], mask[1:, 1:])


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_oracle_chain_and_tree_equal_target_only(tiny_engines, tree):
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    prompt = _prompt(gen)
    ref = _run(plain_decode, gen, prompt, 30)
    proposer = Oracle(ref, gen.engine.vocab_size, tree)
    stats = Stats()
    out = _run(lambda *a: speculative_decode(*a, proposer=proposer, control=FixedK(3)), gen, prompt, 30, stats)
    assert out == ref
    assert stats.rounds <= 30 // 3 + 1 and stats.acceptance_by_position[:3] == [1.0, 1.0, 1.0]


class LateTreeOracle(Oracle):
    """The tree oracle from round 2 on, like Medusa: a tree pass over an empty cache (the prompt
    pending) lets siblings see each other (test_tree.py), which flips a near-tie over 230 tokens."""

    def propose(self, ctx: Context, k: int) -> Draft:
        return Draft(np.zeros(0, np.int64)) if ctx.length == self.prompt_length else super().propose(ctx, k)


def test_trees_are_cut_to_the_room_left_at_the_end_of_the_context(tiny_engines):
    """The oracle drafts a 6-node tree of depth 3 whatever k is; near the end of the context (256) the
    loop keeps the nodes that fit, and decoding fills the context with target-only greedy's tokens.
    Four prompt lengths put the free places of the last tree rounds at every residue of the 4 tokens
    a round emits (the uncut tree raised ContextFullError with 3, 4 or 5 places left)."""
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    for cut in range(4):
        prompt = _prompt(gen)[cut:]
        n = gen.engine.max_context - len(prompt)
        ref = _run(plain_decode, gen, prompt, n)
        out = _run(lambda *a: speculative_decode(*a, proposer=LateTreeOracle(ref, 384, True), control=FixedK(3)),
                   gen, prompt, n)
        assert out == ref, cut


def _run(decode, gen, prompt, n, stats=None, sampling=SamplingParams(), rng=None) -> list[int]:
    out: list[int] = []
    rounds = decode(gen.engine, prompt, sampling, rng or np.random.default_rng(0), stats or Stats())
    for toks in rounds:
        out += toks
        if len(out) >= n:
            break
    rounds.close()
    return out[:n]


def test_stats_say_not_exact_on_width_inexact_engines(tiny_engines):
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    prompt = _prompt(gen)
    ref = _run(plain_decode, gen, prompt, 8)
    for width_exact in (True, False):
        stats = Stats()
        gen.engine.width_exact = width_exact   # what the manifest records for the engine
        _run(lambda *a: speculative_decode(*a, proposer=Oracle(ref, 384, False), control=FixedK(2)),
             gen, prompt, 8, stats)
        assert stats.exact is width_exact and stats.proposer == "oracle" and not stats.lossy


# --- sampling: speculative output has the target's distribution ------------------------------------

def target_joint(gen: Generator, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """Exact P(t1, t2) [V, V] under `params`, from one-token passes of the target engine."""
    eng, V = gen.engine, gen.engine.vocab_size
    eng.rewind(0)
    p1 = probs_from_logits(eng.forward(np.array(prompt, np.int64)), params)[0].astype(np.float64)
    eng.commit(len(prompt))
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1):
        eng.rewind(len(prompt))
        joint[t1] = p1[t1] * probs_from_logits(eng.forward(np.array([t1])), params)[0]
    return joint


def first_two_counts(gen: Generator, prompt: list[int], params: SamplingParams, decode, n: int) -> np.ndarray:
    V = gen.engine.vocab_size
    counts = np.zeros((V, V))
    rng = np.random.default_rng(12345)
    for _ in range(n):
        t1, t2 = _run(decode, gen, prompt, 2, sampling=params, rng=rng)
        counts[t1, t2] += 1
    return counts


def assert_same_distribution(counts: np.ndarray, joint: np.ndarray) -> None:
    p = same_distribution_p(counts, joint)
    assert p > ALPHA, f"speculative sampling differs from the target: chi-square p = {p:.2g}"


def same_distribution_p(counts: np.ndarray, joint: np.ndarray) -> float:
    """Chi-square p-value of the observed (t1, t2) counts under the target's joint; 0 when a pair
    the target cannot produce was emitted."""
    n = counts.sum()
    if counts[joint == 0].sum():
        return 0.0
    exp = joint[joint > 0].ravel() * n
    obs = counts[joint > 0].ravel()
    small = exp < 5                                          # pool sparse cells for the chi-square approximation
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    keep = exp > 0
    return float(sps.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def _bonus_from_the_wrong_row(probs, draft, rng):
    """A plausible bug: the bonus token drawn from the last draft token's row instead of the row after it."""
    if draft.tokens.size:
        probs = probs.copy()
        probs[-1] = probs[-2]
    return verify(probs, draft, rng)


def _oracle_counts(tiny_engines, k: int, accept=verify, n: int = 1500):
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    prompt = _prompt(gen)
    params = SamplingParams(temperature=1.0, top_k=3)
    ref = _run(plain_decode, gen, prompt, 4)
    joint = target_joint(gen, prompt, params)
    proposer = Oracle(ref, 384, tree=False)
    counts = first_two_counts(gen, prompt, params, lambda *a: speculative_decode(
        *a, proposer=proposer, control=FixedK(k), accept=accept), n)
    return counts, joint


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.slow
def test_sampled_speculation_has_the_target_distribution(tiny_engines, k):
    """One-hot chains from an oracle of the greedy path: accepted with prob p(x), otherwise the
    residual p without x; both the full-accept (bonus) and reject paths occur often here. With
    k = 1 the second token is the bonus whenever the first draft token is kept."""
    assert_same_distribution(*_oracle_counts(tiny_engines, k))


def test_the_distribution_test_catches_a_wrong_bonus_row(tiny_engines):
    """The test above can fail: the same loop with the bonus token drawn from the wrong row is rejected
    (the tiny target's next-token distribution depends on the token before it)."""
    counts, joint = _oracle_counts(tiny_engines, 1, accept=_bonus_from_the_wrong_row, n=600)
    assert same_distribution_p(counts, joint) < ALPHA


# --- the adaptive controller ------------------------------------------------------------------------

def _feed(ctl: AdaptiveK, acc, cost, rounds: int) -> list[int]:
    """acc: a list of bools (fixed outcome per position) or a float (i.i.d. acceptance rate)."""
    ks, rng = [], np.random.default_rng(0)
    for _ in range(rounds):
        k = ctl.k()
        ks.append(k)
        a = np.array(acc[:k], bool) if isinstance(acc, list) else np.cumprod(rng.random(k) < acc).astype(bool)
        result = SimpleNamespace(acceptance=a, num_accepted=int(a.sum()))
        ctl.observe(Round(0, k, k, 1 + k, result, 1e-5 * k, cost(1 + k), False))
    return ks


def test_adaptive_k_alpha_is_the_prior_chained_recurrence():
    ctl = AdaptiveK(k_max=16, buckets=3)
    rng = np.random.default_rng(1)
    tries = rng.random((3, 16)) * 7 * (rng.random((3, 16)) < 0.7)   # unmeasured positions too
    hits = tries * rng.random((3, 16))
    ctl.acceptance.tries, ctl.acceptance.hits = tries.tolist(), hits.tolist()
    expect, prior = np.empty((3, 16)), np.full(3, AdaptiveK.ALPHA0)
    for i in range(16):   # alpha_i = (hits_i + N alpha_{i-1}) / (tries_i + N): the definition, as a loop
        prior = expect[:, i] = (hits[:, i] + ctl.PRIOR_N * prior) / (tries[:, i] + ctl.PRIOR_N)
    np.testing.assert_allclose(ctl.alpha, expect, rtol=1e-9)


def test_adaptive_k_goes_long_when_drafts_are_right_and_passes_cheap():
    ctl = AdaptiveK(k_max=12)
    ks = _feed(ctl, [True] * 12, lambda w: 0.010 * (1 + 0.05 * (w - 1)), 60)
    assert ks[-1] == 12


def test_adaptive_k_switches_off_when_speculation_does_not_pay_and_retries():
    ctl = AdaptiveK(k_max=8, width_exact=False)
    ks = _feed(ctl, [False] * 8, lambda w: 0.010 * (1 + 0.3 * (w - 1)), 200)
    first_off = ks.index(0)
    assert first_off < 10                                   # learns quickly that drafts are wrong
    assert sum(k > 0 for k in ks) < 30                      # mostly off ...
    assert any(k > 0 for k in ks[first_off + 16:])          # ... but retried after the backoff
    assert ctl.backoff.length[0] > AdaptiveK.BACKOFF0                # and backs off longer each time it loses


def test_adaptive_k_prefers_short_drafts_when_wide_passes_are_expensive():
    cheap, dear = AdaptiveK(k_max=8), AdaptiveK(k_max=8, width_exact=False)
    k_cheap = _feed(cheap, 0.7, lambda w: 0.01 * (1 + 0.02 * (w - 1)), 120)[-40:]
    k_dear = _feed(dear, 0.7, lambda w: 0.01 * (1 + 0.3 * (w - 1)), 120)[-40:]
    assert np.mean(k_dear) < 4 < np.mean(k_cheap)            # optimum at alpha = 0.7: k = 2 vs k = 8


def test_adaptive_k_sizes_each_bucket_for_its_own_acceptance_and_keeps_it_across_requests():
    ctl = AdaptiveK(k_max=8, buckets=2)                     # e.g. long and short prompt-lookup matches
    rng = np.random.default_rng(0)
    for _ in range(3):                                      # three requests
        ctl.start()
        for r in range(80):
            b = r % 2
            k = ctl.k(b)
            acc = np.ones(k, bool) if b == 0 else np.zeros(min(k, 1), bool)  # bucket 1: always wrong
            ctl.observe(Round(b, k, k, 1 + k, SimpleNamespace(acceptance=acc, num_accepted=int(acc.sum())), 1e-5 * k,
                              0.01 * (1 + 0.05 * k) * (1 + 0.01 * rng.random()), False))
        assert ctl.k(0) == 8 or ctl.since_plain >= AdaptiveK.PROBE   # the sure bucket drafts long ...
        assert ctl.off[1] > 0 and ctl.off[0] == 0                      # ... the wrong one is off alone
    ctl.start()                                             # a new request starts from what was learned
    assert ctl.best(0) == 8 and ctl.off[1] > 0


def _gate(ctl: GatedK, accepted, cost: float, rounds: int) -> list[int]:
    """A 3-node tree that keeps `accepted` nodes a round (an int, or probabilities of 0, 1, 2) and costs
    `cost` plain steps (10 ms each)."""
    ks, rng = [], np.random.default_rng(0)
    for _ in range(rounds):
        k = ctl.k()
        ks.append(k)
        kept = accepted if isinstance(accepted, int) else int(rng.choice(3, p=accepted))
        ctl.observe(Round(0, k, 3 if k else 0, 4 if k else 1, SimpleNamespace(num_accepted=kept if k else 0),
                          0.0, 0.010 * (cost if k else 1.0), False))
    return ks


def test_gated_k_turns_a_losing_tree_off_and_retries_it():
    ks = _gate(GatedK(2), accepted=0, cost=1.3, rounds=200)          # 1 token per round at 1.3x the cost
    assert 0 < ks.index(0) < 12                                       # a plain probe early ...
    off = [i for i in range(20, 200) if ks[i] == 0]
    assert len(off) > 120                                             # ... then mostly plain
    assert any(ks[i] == 2 for i in range(60, 200))                    # but the tree is tried again


def test_gated_k_keeps_a_paying_tree():
    ks = _gate(GatedK(2), accepted=1, cost=1.2, rounds=200)          # 2 tokens per round at 1.2x
    assert sum(k == 0 for k in ks) <= 200 // GatedK.PROBE + 2         # plain only to re-measure its cost
    # a thin, noisy win (Medusa on chat: ~1.34 tokens a round at ~1.2x the cost, 1.12x) stays on too
    ks = _gate(GatedK(2), accepted=[0.75, 0.16, 0.09], cost=1.2, rounds=600)
    assert sum(k == 2 for k in ks) > 0.9 * 600


def test_make_decoder_maps_names_once(tiny_engines):
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    assert isinstance(make_decoder("off", gen.manifest), PlainDecoder)
    auto = make_decoder("auto", gen.manifest)               # no draft engine in this set
    assert auto.proposer.name == "lookup/suffix" and isinstance(auto.control, AdaptiveK)
    assert isinstance(make_decoder("prompt-lookup", gen.manifest,
                                   config=__import__("specrt.runtime.speculative", fromlist=["x"])
                                   .SpeculativeConfig(draft_tokens=3)).control, FixedK)
    fixed = make_decoder("prompt-lookup", gen.manifest, config=SpeculativeConfig(draft_tokens=4)).proposer
    assert fixed.ngram_sizes == (6, 4, 3, 2) and auto.proposer.parts[0].ngram_sizes == (6, 4, 3, 2, 1)
    for bad in ("nope", "Prompt-Lookup"):
        with pytest.raises(SpecrtError, match="unknown --speculate"):
            make_decoder(bad, gen.manifest)


# --- the real embedded default ------------------------------------------------------------------------

CODE_EDIT = ("Rewrite this code with better names:\n\ndef f(a, b):\n    c = a + b\n    d = c * 2\n    return d\n\n"
             "def g(x):\n    y = f(x, x)\n    return y\n")  # SmolLM2 echoes the code: long lookup matches


@pytest.mark.real
def test_real_default_prompt_lookup_equals_plain_greedy(default_engines):
    gen = Generator.load(default_engines, "fp32")
    plain = gen.generate(CODE_EDIT, max_new_tokens=64)
    spec = gen.generate(CODE_EDIT, max_new_tokens=64, decode=make_decoder("prompt-lookup", gen.manifest))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.exact and spec.stats.tau > 1.5


def test_tau_counts_every_token_the_target_emitted(tiny_engines):
    """A round that ends in EOS counts its tokens too: 3 rounds emitting 2 + 2 + EOS -> tau 5/3."""
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    eos = gen.manifest.eos_token_ids[0]

    def scripted(engine, prompt, sampling, rng, stats):
        for tokens in ([5, 6], [7, 8], [eos]):
            stats.rounds += 1
            yield tokens

    r = gen.generate("hi", max_new_tokens=12, decode=scripted)
    assert r.token_ids == [5, 6, 7, 8] and r.stats.finish_reason == "eos"
    assert r.stats.tau == pytest.approx(5 / 3)            # was 4 / 3: the EOS round counted no token


def test_ignore_eos_decodes_through_eos_to_the_budget(tiny_engines):
    """ignore_eos keeps EOS in the output and stops only at max_new_tokens (benchmarks at equal length)."""
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    eos = gen.manifest.eos_token_ids[0]

    def scripted(engine, prompt, sampling, rng, stats):
        for tokens in ([5, eos], [7, 8], [eos, 9, 10]):
            stats.rounds += 1
            yield tokens

    stopped = gen.generate("hi", max_new_tokens=6, decode=scripted)
    assert stopped.token_ids == [5] and stopped.stats.finish_reason == "eos"
    r = gen.generate("hi", max_new_tokens=6, decode=scripted, ignore_eos=True)
    assert r.token_ids == [5, eos, 7, 8, eos, 9] and r.stats.finish_reason == "length"


def test_seeded_sampling_gives_plain_output_with_deterministic_drafts(tiny_engines):
    """verify's sample-and-match form for one-hot drafts draws once per emitted token, in plain
    sampling's order: a seeded speculative run returns plain sampling's own tokens, whatever draft
    lengths the adaptive controller picked, and again on a reused Generator."""
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    prompt = "def add(a, b):\n    return a + b\n" * 3 + "The quick brown fox jumps over the lazy dog. " * 2
    kept = 0
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=0.5, top_k=40, seed=seed)
        plain = gen.generate(prompt, max_new_tokens=48, sampling=params).token_ids
        for _ in range(2):
            spec = gen.generate(prompt, max_new_tokens=48, sampling=params,
                                decode=make_decoder("prompt-lookup", gen.manifest))
            assert spec.token_ids == plain and sum(spec.stats.drafted_by_position) > 0
            kept += len(plain) - spec.stats.rounds
    assert kept > 0   # some drafts were accepted, so rounds of several tokens drew in plain's order


def test_streamed_text_never_leaks_a_stop_that_spans_tokens(default_engines):
    """Deltas are held back while the text's tail could still grow into a stop string: the stream
    joins to exactly result.text, plain or speculative, and a tail that never completes a stop is
    flushed at the end."""
    gen = Generator.load(default_engines, "fp32", EngineOptions(threads=1))
    prompt = "Write a short poem about the sea."
    full = gen.generate(prompt, max_new_tokens=40)
    pieces = [gen.codec.decode([t]) for t in full.token_ids]
    at = next(i for i in range(5, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip())
    spanning = pieces[at][-1] + pieces[at + 1][:2]           # starts in one token, ends in the next
    never = full.text[-2:] + "\u2603\u2603"                    # its start is the text's tail, the rest never comes
    for decode in (None, make_decoder("prompt-lookup", gen.manifest)):
        for stop, expect in ((spanning, full.text[: full.text.find(spanning)]), (never, full.text)):
            s = gen.stream(prompt, max_new_tokens=40, stop=(stop,), decode=decode)
            deltas = list(s)
            assert "".join(deltas) == s.result.text == expect
            assert s.result.stats.finish_reason == ("stop" if stop == spanning else full.stats.finish_reason)
