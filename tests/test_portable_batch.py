"""Several streams at once over the portable graph (runtime/backends/onnxruntime_portable/batch.py): every row of a
round in one call padded to the widest (drafts' verifications beside one-token passes), idle slots padded past what
they hold, the cache layout following the longest sequence, and each stream's output its output alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specrt.manifest import load_manifest
from specrt.runtime.batch import Scheduler, SlotEngine
from specrt.runtime.engine import EngineOptions, open_engine
from specrt.runtime.session import load
from specrt.runtime.speculative import SpeculativeConfig, tree_inputs
from test_batch import GREEDY, PROMPTS, gathering, run_threads, seeded_alone_and_batched


def _batch(root, slots: int):
    from specrt.runtime.backends.onnxruntime_portable import open_batch

    m = load_manifest(root)
    entry = m.engine("target", "fp32")
    return open_batch(m.root, entry, EngineOptions(threads=1), slots), open_engine(m.root, entry,
                                                                                  EngineOptions(threads=1))


def _round(sched, slots, rows, results):
    """One pass of each (slot, tokens, positions, mask) in its own thread, so the scheduler gathers them."""
    def one(i):
        s, tokens, p, msk = rows[i]
        results[i] = slots[s].forward(tokens, p, msk, num_logits=len(tokens)).copy()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_a_chain_a_tree_and_a_one_token_row_go_in_one_call_and_equal_passes_alone(portable_engines):
    """Slots 0, 2, 3 in one round (a one-token pass, a 4-token chain, a 4-node tree under a pending token) and
    slot 1 idle in the bound range: one backend call at width 8, each row's logits those of its pass alone, and
    the idle slot's sequence untouched by the pad rows written past it."""
    batch, alone = _batch(portable_engines, 4)
    sched = Scheduler()
    slots = [SlotEngine(batch, s, sched) for s in range(4)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n) for n in (5, 30, 40, 17)]
    for s, p in zip(slots, prompts):  # prefills, one by one
        sched.join(s.slot)
        s.forward(p)
        s.commit(len(p))
        sched.leave(s.slot)
    for s in (0, 2, 3):
        sched.join(s)
    parents = np.array([-1, 0, 0, 1])
    pos, mask = tree_inputs(len(prompts[3]), 1, parents)
    rows = [(0, rng.integers(3, 300, 1), None, None), (2, rng.integers(3, 300, 4), None, None),
            (3, rng.integers(3, 300, 5), pos, mask)]
    passes, results = sched.passes, [None] * 3
    _round(sched, slots, rows, results)
    assert sched.passes - passes == 1 and sched.costs_of(batch).cells[(3, 8)][1] == 1  # one call, width 8
    for (s, tokens, p, msk), got in zip(rows, results):
        alone.rewind(0)
        alone.forward(prompts[s])
        alone.commit(len(prompts[s]))
        want = alone.forward(tokens, p, msk, num_logits=len(tokens))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert (got.argmax(1) == want.argmax(1)).all()
    for s in (0, 2, 3):
        sched.leave(s)
    sched.join(1)  # the idle slot's next token, after the pads the round wrote past its 30 positions
    nxt = slots[1].forward(np.array([7])).copy()
    alone.rewind(0)
    alone.forward(prompts[1])
    alone.commit(len(prompts[1]))
    np.testing.assert_allclose(nxt, alone.forward(np.array([7])), atol=1e-4, rtol=0)


def test_the_layout_grows_past_a_capacity_bucket_and_keeps_every_slots_rows(portable_engines):
    """A stream that grows past the first cache layout (256 positions less the widest pad) moves every slot's
    rows into the larger layout: both slots' next passes still equal passes alone; a snapshot taken and
    restored around it gives the same."""
    batch, alone = _batch(portable_engines, 2)
    sched = Scheduler()
    slots = [SlotEngine(batch, s, sched) for s in range(2)]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, 20), rng.integers(3, 300, 200)]
    sched.join(0)
    slots[0].forward(prompts[0])
    slots[0].commit(20)
    snap = slots[0].save_prefix(20)
    sched.leave(0)
    first = batch.capacity
    sched.join(1)
    slots[1].forward(prompts[1])
    slots[1].commit(200)
    sched.join(0)
    results = [None, None]
    _round(sched, slots, [(0, np.array([11]), None, None), (1, np.array([12, 13]), None, None)], results)
    assert batch.capacity > first  # 200 held + the widest pad (64) > 256: the next layout
    for s, got, extra in ((0, results[0], [11]), (1, results[1], [12, 13])):
        alone.rewind(0)
        alone.forward(prompts[s])
        alone.commit(len(prompts[s]))
        np.testing.assert_allclose(got, alone.forward(np.array(extra), num_logits=len(extra)), atol=1e-4, rtol=0)
    slots[0].load_prefix(snap)  # back to its 20 positions, restored into the larger layout
    assert slots[0].length == 20
    sched.leave(1)
    alone.rewind(0)
    alone.forward(prompts[0])
    alone.commit(20)
    np.testing.assert_allclose(slots[0].forward(np.array([11])), alone.forward(np.array([11])), atol=1e-4, rtol=0)
    sched.leave(0)


@pytest.mark.parametrize("mode,config", [("off", None), ("prompt-lookup", None),
                                         ("prompt-lookup", SpeculativeConfig(draft_tokens=4))])
def test_streams_on_the_portable_backend_keep_their_own_output(portable_engines, mode, config):
    """Four streams of different prompt and answer lengths on 3 slots (the fourth waits for one), plain, with
    speculation by load and with a fixed K: each gets the tokens it gets alone; with a fixed K, drafts'
    verifications shared calls with other rows."""
    kw = {} if config is None else {"config": config}
    alone = load(portable_engines, "fp32", mode, **kw)
    jobs = [(PROMPTS[0], 100, 0.0), (PROMPTS[1], 30, 0.0), (PROMPTS[2] * 2, 70, 0.005), (PROMPTS[3], 50, 0.01)]
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    batched = gathering(load(portable_engines, "fp32", mode, parallel=3, **kw), 3)
    assert "onnxruntime-portable" in batched.batch.description
    assert run_threads(batched, jobs) == want
    cells = batched.scheduler.costs_of(batched.batch).cells
    assert any(B > 1 for B, _ in cells)  # rows were batched
    if config is not None:
        assert any(B > 1 and W > 1 for B, W in cells)  # and a draft's pass went beside the others


def test_a_follow_up_turn_on_the_portable_batch_reuses_its_slot(portable_engines):
    """KV reuse per slot: a second request that extends the first one's prompt finds it in its slot (cached
    tokens) and answers as a fresh run does."""
    first, follow = PROMPTS[3], PROMPTS[3] + " and then"
    fresh = load(portable_engines, "fp32", "off").generate(follow, max_new_tokens=20, sampling=GREEDY,
                                                           ignore_eos=True)
    batched = load(portable_engines, "fp32", "off", parallel=2)
    batched.enable_reuse(None)
    batched.generate(first, max_new_tokens=20, sampling=GREEDY, ignore_eos=True)
    again = batched.generate(follow, max_new_tokens=20, sampling=GREEDY, ignore_eos=True)
    assert again.stats.cached_tokens > 0
    assert again.token_ids == fresh.token_ids


def test_a_seeded_sampled_stream_on_the_portable_batch_keeps_its_output(portable_engines):
    """Sampled rows read their logits from the batched call: a seeded request gives the same tokens alone and
    beside another stream."""
    batched = gathering(load(portable_engines, "fp32", "prompt-lookup", parallel=2), 2)
    want, got = seeded_alone_and_batched(portable_engines, batched)
    assert got == want
    assert any(B > 1 for B, _ in batched.scheduler.costs_of(batched.batch).cells)
