"""A draft model that sat out while other drafters drafted must first read what it missed (its catch-up prefill);
auto's controllers charge that, spread over the tokens the request is expected to have left (docs/voice.md, "The
draft's catch-up is a cost"). Fed a simulated workload with the Qwen2.5-Coder int4 pair's costs: on short voice
turns a lagging draft model is left out (no retry, no exploration that would read hundreds of tokens for a dozen);
on long answers the same draft model, just as far behind, catches up and drafts."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.choice import Remaining, SourceTable
from specrt.runtime.control import AdaptiveK, Round, Source
from specrt.runtime.load_k import LoadK
from test_voice_turns import _result, load_k

# The pair's costs and acceptance (docs/voice.md, "The Qwen2.5-Coder pair at int4 against llama-server"): the int4
# target's pass of w = 1..5 tokens and its slope past them, a drafted token, the draft's acceptance on the voice calls
# and on long answers
PASS = [0.0350, 0.0387, 0.0508, 0.0605, 0.0731]
D, VOICE, LONG = 0.0122, 0.64, 0.8


def cost(w: float) -> float:
    w = max(1, round(w))
    return PASS[w - 1] if w <= len(PASS) else PASS[-1] + 0.0125 * (w - len(PASS))


SOURCES = (Source("draft", 1, pair=True), Source("prompt-lookup", 1))
DRAFT, LOOKUP = 0, 1                 # each source's one bucket
PER_TOKEN = 0.003                    # the draft's catch-up, seconds per context token read
LOOKUP_ALPHA = 0.2
NEW_WORDS = 30                       # context tokens a request adds before its first answer token (the caller's words)
APART = 4                            # unread tokens the draft reads in its first step (draft_model.CATCHUP_APART)

CONTROLLERS = {"adaptive": lambda: AdaptiveK(8, width_exact=False, sources=SOURCES),
               "load": lambda: load_k(8, cost, sources=SOURCES)}


def workload(ctl, length: int, requests: int, alpha: float, charge: bool = True, seed: int = 0
             ) -> tuple[float, float, int]:
    """Requests of `length` tokens each, the draft keeping `alpha` of its tokens and behind by what it has not
    read: (simulated seconds a token,
    the draft's share of the drafting rounds, context tokens its catch-ups read). charge=False: the controller is
    not told what the draft has not read (as before the charge), though its catch-ups still cost their time."""
    rng = np.random.default_rng(seed)
    seconds = tokens = caught_all = 0.0
    by = {DRAFT: 0, LOOKUP: 0}
    behind = 0
    for _ in range(requests):
        ctl.start()
        ctl.observe(Round(0, 0, 0, 40, _result(np.zeros(0, bool)), 0.0, cost(40), True))
        behind += NEW_WORDS
        made = 1
        while made < length:
            if isinstance(ctl, LoadK):
                ctl.planner.scheduler.passes += 1
            unread = [behind - 1 if behind > APART else 0, 0]
            i = ctl.choose([DRAFT, LOOKUP], unread if charge else None)
            k = ctl.k(i, unread[i] if charge else 0)
            caught = unread[i] if k else 0
            catchup = caught * PER_TOKEN
            acc = np.cumprod(rng.random(k) < (alpha if i == DRAFT else LOOKUP_ALPHA)).astype(bool)
            kept = int(acc.sum())
            draft_s = (D if i == DRAFT else 1e-4) * k
            ctl.observe(Round(i, k, k, 1 + k, _result(acc), draft_s, cost(1 + k), False, catchup, caught))
            seconds += cost(1 + k) + draft_s + catchup
            made += 1 + kept
            tokens += 1 + kept
            caught_all += caught
            behind = 1 if (k and i == DRAFT) else behind + 1 + kept
            by[i] += k > 0
    return seconds / tokens, by[DRAFT] / max(1, by[DRAFT] + by[LOOKUP]), int(caught_all)


@pytest.mark.parametrize("name", CONTROLLERS)
def test_on_short_turns_a_lagging_draft_model_is_left_out(name):
    charged = workload(CONTROLLERS[name](), 12, 40, VOICE)
    blind = workload(CONTROLLERS[name](), 12, 40, VOICE, charge=False)
    # once it has fallen behind (after the first requests) it is not retried: a few catch-ups, not one a turn
    assert charged[2] < blind[2] / 3, (charged, blind)
    assert charged[0] < 0.97 * blind[0], (charged, blind)


@pytest.mark.parametrize("name", CONTROLLERS)
def test_on_long_answers_the_same_draft_model_catches_up_and_drafts(name):
    seconds, share, caught = workload(CONTROLLERS[name](), 400, 6, LONG)
    assert share >= 0.8 and caught > 0, (seconds, share, caught)
    assert seconds < cost(1) / 1.15                               # it pays: well under a plain pass a token


def test_the_charge_spreads_the_catch_up_over_the_tokens_left():
    table = SourceTable(SOURCES, 8)
    t = lambda w: 0.035  # noqa: E731
    assert table.surcharge(DRAFT, 0) == 0.0
    assert table.surcharge(DRAFT, 250) == 0.0                   # none measured: the first catch-up measures it
    table.observe(DRAFT, 2, 2, 3, 0.024, 1, caught=250, catchup_s=0.75)
    assert table.surcharge(DRAFT, 250) == pytest.approx(250 * 0.003 / Remaining.PRIOR)
    table.observe(DRAFT, 2, 2, 3, 0.024, 2, caught=10, catchup_s=0.05)  # pooled by size, not per catch-up
    assert table.surcharge(DRAFT, 1) * Remaining.PRIOR == pytest.approx((0.7 * 0.75 + 0.05) / (0.7 * 250 + 10))
    for _ in range(30):                                           # short requests: the mean length falls to ~12
        table.start()
        table.made(12)
    table.start()
    assert table.left() == pytest.approx(12, abs=0.5)
    assert not table.affords(table.surcharge(DRAFT, 250), t) and table.affords(table.surcharge(DRAFT, 1), t)
    table.made(40)                                                # past the mean: as many again expected
    assert table.left() == 40


ALONE = {"adaptive": lambda: AdaptiveK(8, width_exact=False, pair=True), "load": lambda: load_k(8, cost)}


def _request(ctl, made: int = 1) -> None:
    ctl.start()
    ctl.observe(Round(0, 0, 0, 40, _result(np.zeros(0, bool)), 0.0, cost(40), True, forced=made - 1))
    if isinstance(ctl, LoadK):
        ctl.planner.scheduler.passes += 1


@pytest.mark.parametrize("name", ALONE)
def test_a_first_catch_up_runs_whatever_its_length_and_a_measured_one_is_charged(name):
    """`--speculate draft`: with no catch-up measured, a draft 2000 tokens behind is tried (it measures the cost);
    once one was measured at the pair's cost, the same lag on requests of ~12 tokens is not."""
    ctl = ALONE[name]()
    _request(ctl)
    assert ctl.k(0, 2000) >= 1
    ctl.observe(Round(0, 1, 1, 2, _result(np.ones(1, bool)), D, cost(2), False, 2000 * PER_TOKEN, 2000))
    for _ in range(30):                                           # short requests (forced tokens count as made)
        _request(ctl, made=12)
    _request(ctl)
    assert ctl.k(0, 2000) == 0 and ctl.k(0, 0) >= 1


@pytest.mark.parametrize("wide_rows_alone", [True, False])
def test_a_batch_plans_again_for_a_stream_whose_catch_up_came_due(wide_rows_alone):
    """Two streams of one batch: the plan is made by the first to ask; the second, whose draft model has fallen 3000
    tokens behind since its last round, must not draft on the plan made with its old surcharge."""
    first = load_k(8, cost)
    first.planner.batch.wide_rows_alone = wide_rows_alone
    second = LoadK(first.planner, 1, 8, buckets=1, pair=True)
    first.planner.scheduler.active.add(1)
    table = first.planner.scheduler.costs_of(first.planner.batch)
    for w in range(1, 10):                                        # two rows cost nearly two passes: a draft pays
        for _ in range(table.trust):
            table.observe(2, w, 1.9 * cost(w))
    for ctl, kept in ((first, False), (second, True)):            # the second's drafts are kept: drafting pays
        ctl.start()
        for _ in range(10):
            ctl.observe(Round(0, 4, 4, 5, _result(np.full(4, kept)), 4 * D, cost(5), False))
        ctl.observe(Round(0, 1, 1, 2, _result(np.ones(1, bool)), D, cost(2), False, 2000 * PER_TOKEN, 2000))
    first.planner.scheduler.passes += 1
    first.k(0, 0)                                                 # plans for both, the second's surcharge still 0
    assert second.k(0, 3000) == 0
    first.planner.scheduler.passes += 1
    first.k(0, 0)
    assert second.k(0, 0) >= 1                                    # in sync, the same plan drafts for it
