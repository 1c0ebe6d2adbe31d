"""`auto` learns from the workload (docs/voice.md, "auto learns from the workload"): its drafters (the set's draft
model or heads, prompt lookup, suffix decoding of earlier answers) keep their acceptance apart in the controller,
and each round the one whose kind of draft promises the most tokens per second drafts. The controllers are fed a
workload that repeats and then stops repeating; on the tiny engines a repeating script makes suffix decoding take
over, and the output stays the target's, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.control import AdaptiveK, Round, Source
from specrt.runtime.engine import EngineOptions
from specrt.runtime.generate import Generator
from specrt.runtime.load_k import LoadK
from specrt.runtime.session import load
from specrt.runtime.speculative import make_decoder
from test_voice_turns import _result, cost, load_k

# auto's sources on a set without a draft model: prompt lookup's and suffix decoding's buckets (a match, none)
SOURCES = (Source("prompt-lookup", 2), Source("suffix", 2))
BASE, SUFFIX = 0, 2                      # each source's "a match" bucket
ROUNDS = 30


def _load_k(sources) -> LoadK:
    return load_k(16, sources=sources)


CONTROLLERS = {"adaptive": lambda: AdaptiveK(16, width_exact=False, sources=SOURCES),
               "load": lambda: _load_k(SOURCES)}


def requests(ctl, alpha: dict[int, float], n: int, rng) -> list[float]:
    """Suffix decoding's share of each request's drafting rounds; alpha: each source's acceptance per token now."""
    shares = []
    for _ in range(n):
        ctl.start()
        ctl.observe(Round(0, 0, 0, 40, _result(np.zeros(0, bool)), 0.0, cost(40), True))
        by = {BASE: 0, SUFFIX: 0}
        for _ in range(ROUNDS):
            if isinstance(ctl, LoadK):
                ctl.planner.scheduler.passes += 1
            bucket = [BASE, SUFFIX][ctl.choose([BASE, SUFFIX])]
            k = ctl.k(bucket)
            acc = np.cumprod(rng.random(k) < alpha[bucket]).astype(bool)
            ctl.observe(Round(bucket, k, k, 1 + k, _result(acc), 0.0, cost(1 + k), False))
            by[bucket] += k > 0
        shares.append(by[SUFFIX] / max(1, by[BASE] + by[SUFFIX]))
    return shares


@pytest.mark.parametrize("name", CONTROLLERS)
def test_auto_turns_to_suffix_decoding_where_requests_repeat_and_back_where_they_stop(name):
    ctl, rng = CONTROLLERS[name](), np.random.default_rng(0)
    novel = requests(ctl, {BASE: 0.6, SUFFIX: 0.3}, 3, rng)      # fresh requests: earlier answers rarely match
    repeating = requests(ctl, {BASE: 0.4, SUFFIX: 0.95}, 6, rng)  # the script repeats: earlier answers are right
    after = requests(ctl, {BASE: 0.6, SUFFIX: 0.1}, 6, rng)       # it stops: their drafts are rejected
    assert max(novel[1:]) <= 0.2, novel
    assert min(repeating[2:]) >= 0.8, repeating                  # a request or two to notice (SourceTable.RETRY)
    assert max(after[2:]) <= 0.2, after


def test_the_first_source_drafts_unless_another_beats_it_clearly():
    ctl = AdaptiveK(16, sources=SOURCES)
    assert ctl.choose([BASE, SUFFIX]) == 0                       # both at the prior: the base
    for _ in range(8):                                            # the base's drafts all kept
        ctl.observe(Round(BASE, 4, 4, 5, _result(np.ones(4, bool)), 0.0, cost(5), False))
    for _ in range(8):                                            # suffix decoding's all rejected
        ctl.observe(Round(SUFFIX, 4, 4, 5, _result(np.zeros(4, bool)), 0.0, cost(5), False))
    assert ctl.choose([BASE, SUFFIX]) == 0 and ctl.choose([SUFFIX, BASE]) == 1
    assert ctl.choose([BASE + 1, SUFFIX]) == 0                   # no measured rate beats the base by SWITCH


A = "orbit green cloud orbit river paper"       # the tiny model's greedy answer is 60 tokens and barely repeats
NOVEL = ["quiet beta orbit quiet river blue", "lamp delta quiet orbit lamp orbit"]


class _SteadyCost:
    """A pass of w tokens at fixed seconds: which drafter wins must not hang on a shared CPU's timing noise."""

    seen = [10**6] * 80

    def __call__(self, w: float) -> float:
        return 1e-3 * (1 + 0.1 * (w - 1))

    def observe(self, width: int, seconds: float) -> None:
        pass


def _steady(proposer) -> AdaptiveK:
    ctl = AdaptiveK(proposer.max_tokens, sources=proposer.sources)
    ctl.cost = _SteadyCost()
    return ctl


def _script(generate, plain) -> tuple[list[int], list[float]]:
    """One prompt six times, then two others: every answer equals plain greedy decoding; the rounds of each request
    and suffix decoding's share of its drafting rounds."""
    rounds, shares = [], []
    for prompt in [A] * 6 + NOVEL:
        spec = generate(prompt)
        assert spec.token_ids == plain(prompt).token_ids and spec.stats.exact
        by = spec.stats.drafted_by_source
        assert set(by) <= {"prompt-lookup", "suffix"}
        rounds.append(spec.stats.rounds)
        shares.append(by.get("suffix", 0) / max(1, sum(by.values())))
    return rounds, shares


def test_on_a_repeating_script_suffix_decoding_takes_over(tiny_engines):
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    auto = make_decoder("auto", gen.manifest, controller=_steady)
    rounds, shares = _script(lambda p: gen.generate(p, max_new_tokens=60, decode=auto),
                             lambda p: gen.generate(p, max_new_tokens=60))
    assert min(shares[4:6]) >= 0.8 and rounds[5] <= rounds[0] / 3, (shares, rounds)


@pytest.mark.parametrize("parallel", [1, 2])
def test_greedy_auto_on_a_repeating_script_equals_plain(tiny_engines, parallel):
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    session = load(tiny_engines, "fp32", "auto", EngineOptions(threads=1), parallel=parallel)
    assert session.mode == "lookup/suffix"
    _script(lambda p: session.generate(p, max_new_tokens=60), lambda p: gen.generate(p, max_new_tokens=60))
    slots = getattr(session, "slots", None) or [session]
    assert all(s.decoder.proposer.choose == s.decoder.control.choose for s in slots)


def test_auto_wires_its_sources_to_the_controller(tiny_engines):
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    auto = make_decoder("auto", gen.manifest)
    assert [p.name for p in auto.proposer.parts] == ["prompt-lookup", "suffix"]
    assert [s.name for s in auto.control.sources] == ["prompt-lookup", "suffix"]
    assert auto.proposer.choose == auto.control.choose
