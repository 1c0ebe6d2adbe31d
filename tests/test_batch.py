"""Several streams at once: batched passes equal passes alone, streams joining and leaving keep their own output,
and the load planner's choice of draft length on known costs."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from specrt.runtime.batch import BatchCosts, Scheduler, SlotEngine
from specrt.runtime.load_k import LoadK, LoadPlanner
from specrt.runtime.control import Round
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.session import load
from specrt.runtime.speculative import SpeculativeConfig
from specrt.runtime.verify import VerifyResult

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["def add(a, b):", "The quick brown fox", "Hello, how are you today? I am fine, thank you. Hello, how",
           "import numpy as np\nx = np.arange(10)\nprint(x.sum())\nimport numpy as np\n", "Speculative decoding"]


class Gathering(Scheduler):
    """Holds the first passes until `expect` streams joined (a tiny model's stream is over before the next thread
    starts), so the test sees rows batched whatever the thread timing."""

    expect, started = 0, False

    def _ready(self):
        if not self.started and len(self.active) < self.expect:
            return False
        self.started = True
        return super()._ready()


def gathering(session, expect: int):
    session.scheduler.__class__ = Gathering
    session.scheduler.expect = expect
    return session


def run_threads(session, jobs):
    """jobs: [(prompt, max_new_tokens, delay_s)] -> token ids of each, run concurrently (each in its thread, all
    released at once, then each after its delay)."""
    import time

    out = [None] * len(jobs)
    errors = []
    gate = threading.Barrier(len(jobs))

    def one(i, prompt, n, delay):
        try:
            gate.wait()
            time.sleep(delay)
            out[i] = session.generate(prompt, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def test_batched_rows_equal_passes_alone(tiny_engines):
    """The batch engine's rows (different lengths, a tree row among chains) give the logits of each pass alone."""
    from specrt.manifest import load_manifest
    from specrt.runtime.backends.onnxruntime_cpu.batch import open_batch
    from specrt.runtime.engine import EngineOptions, open_engine
    from specrt.runtime.speculative import tree_inputs

    m = load_manifest(tiny_engines)
    entry = m.engine("target", "fp32")
    batch = open_batch(m.root, entry, EngineOptions(threads=1), 3)
    sched = Scheduler()
    slots = [SlotEngine(batch, s, sched) for s in range(3)]
    alone = open_engine(m.root, entry, EngineOptions(threads=1))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n) for n in (5, 40, 17)]
    for s, p in zip(slots, prompts):  # prefills: alone, one by one
        sched.join(s.slot)
        s.forward(p)
        s.commit(len(p))
        sched.leave(s.slot)
    for s in slots:
        sched.join(s.slot)
    # one round: slots 0 and 1 one token each (one call), slot 2 a tree of 4 nodes under one pending token (alone:
    # GroupQueryAttention batches one-token rows only)
    parents = np.array([-1, 0, 0, 1])
    pos, mask = tree_inputs(len(prompts[2]), 1, parents)
    rows = [(rng.integers(3, 300, 1), None, None), (rng.integers(3, 300, 1), None, None),
            (rng.integers(3, 300, 5), pos, mask)]
    passes = sched.passes
    results = [None] * 3

    def one(s):
        tokens, p, msk = rows[s]
        results[s] = slots[s].forward(tokens, p, msk, num_logits=len(tokens)).copy()

    threads = [threading.Thread(target=one, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sched.passes - passes == 2 and sched.costs_of(batch).cells[(2, 1)][1] == 1  # two rows in one call
    for s in range(3):
        alone.rewind(0)
        alone.forward(prompts[s])
        alone.commit(len(prompts[s]))
        tokens, p, msk = rows[s]
        want = alone.forward(tokens, p, msk, num_logits=len(tokens))
        np.testing.assert_allclose(results[s], want, atol=1e-4, rtol=0)
        assert (results[s].argmax(1) == want.argmax(1)).all()


def test_a_chunked_prefill_equals_one_pass_and_lets_the_others_decode(tiny_engines):
    """A prompt read in chunks while another slot decodes: the same logits and hidden states as one pass over it,
    and the other stream's one-token passes ran between the chunks; alone, the prompt goes in one pass."""
    from specrt.manifest import load_manifest
    from specrt.runtime.backends.onnxruntime_cpu.batch import open_batch
    from specrt.runtime.engine import EngineOptions, open_engine

    m = load_manifest(tiny_engines)
    entry = m.engine("target", "fp32")
    batch = open_batch(m.root, entry, EngineOptions(threads=1), 2)
    sched = Scheduler()
    sched.prefill_chunk = 16
    slots = [SlotEngine(batch, s, sched) for s in range(2)]
    for s in slots:
        s.enable_hidden()
    alone = open_engine(m.root, entry, EngineOptions(threads=1))
    alone.enable_hidden()
    rng = np.random.default_rng(1)
    head, prompt = rng.integers(3, 300, 7), rng.integers(3, 300, 70)
    sched.join(0)
    slots[0].forward(head)
    slots[0].commit(len(head))
    sched.join(1)
    got, decoded = {}, []

    def other():  # slot 0 decodes until slot 1's prompt is in
        while "logits" not in got:
            decoded.append(int(slots[0].argmax(np.array([5]))[0]))
            slots[0].commit(1)
        sched.leave(0)

    t = threading.Thread(target=other)
    t.start()
    got["logits"] = slots[1].forward(prompt, num_logits=3).copy()
    got["hidden"] = slots[1].hidden.copy()
    assert slots[1].length == 0  # the caller commits, as after one pass
    slots[1].commit(len(prompt))
    nxt = slots[1].forward(np.array([9])).copy()  # beside slot 0's last pass
    slots[1].commit(1)
    t.join(30)
    assert not t.is_alive()
    want = alone.forward(prompt, num_logits=3)
    np.testing.assert_allclose(got["logits"], want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["hidden"], alone.hidden[:len(prompt)], atol=1e-4, rtol=0)
    assert len(decoded) >= 4  # 70 tokens = 4 chunks of 16 and the rest: slot 0 passed beside each
    assert sched.costs_of(batch).cells[(1, 16)][1] == 4
    alone.commit(len(prompt))  # the next token after the chunked prompt, against the engine alone
    np.testing.assert_allclose(nxt, alone.forward(np.array([9])), atol=1e-4, rtol=0)
    # alone in the batch now: a prompt in one pass
    slots[1].rewind(0)
    cells = dict(sched.costs_of(batch).cells)
    slots[1].forward(prompt)
    assert sched.costs_of(batch).cells[(1, 70)][1] == cells.get((1, 70), [0, 0])[1] + 1
    sched.leave(1)


@pytest.mark.parametrize("chunk", [0, 20])
def test_streams_with_long_prompts_keep_their_output_with_and_without_chunks(tiny_engines, chunk):
    """Streams whose prompts are read in chunks of 20 (wider than any draft's pass) while the others decode, and
    without chunks: each gets the tokens it gets alone."""
    alone = load(tiny_engines, "fp32", "prompt-lookup")
    jobs = [(PROMPTS[0], 90, 0.0), (PROMPTS[3] * 4, 30, 0.0), (PROMPTS[2] * 3, 40, 0.01)]
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    batched = gathering(load(tiny_engines, "fp32", "prompt-lookup", parallel=3, prefill_chunk=chunk), 3)
    run, per_call = batched.batch.run, []

    def counting(rows):  # the chunks of prefills each backend call held
        per_call.append(sum(1 for r in rows if r.chunk))
        return run(rows)

    batched.batch.run = counting
    assert run_threads(batched, jobs) == want
    chunks = batched.scheduler.costs_of(batched.batch).cells.get((1, 20), [0, 0])[1]
    assert (chunks > 0) == (chunk > 0)
    assert max(per_call) == (1 if chunk else 0)  # two prompts read at once take turns, a chunk a round


@pytest.mark.parametrize("mode", ["off", "prompt-lookup"])
def test_streams_joining_and_leaving_keep_their_own_output(tiny_engines, mode):
    """Four streams of different prompt and answer lengths, started at different times on 3 slots (the fourth
    waits for one): each gets the tokens it gets alone."""
    alone = load(tiny_engines, "fp32", mode)
    jobs = [(PROMPTS[0], 120, 0.0), (PROMPTS[1], 30, 0.0), (PROMPTS[2], 90, 0.005), (PROMPTS[3], 60, 0.01)]
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    batched = gathering(load(tiny_engines, "fp32", mode, parallel=3), 3)
    assert batched.batch.screen  # greedy one-token rows go together through the logit screen
    got = run_threads(batched, jobs)
    assert got == want
    assert batched.scheduler.passes > 0 and batched.scheduler.rows > batched.scheduler.passes  # rows were batched


def test_fixed_k_in_a_batch_is_exact(tiny_engines):
    cfg = SpeculativeConfig(draft_tokens=4)
    alone = load(tiny_engines, "fp32", "prompt-lookup", config=cfg)
    jobs = [(PROMPTS[2], 30, 0.0), (PROMPTS[3], 30, 0.0), (PROMPTS[0], 20, 0.02)]
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    assert run_threads(load(tiny_engines, "fp32", "prompt-lookup", config=cfg, parallel=3), jobs) == want


def seeded_alone_and_batched(root, parallel_session=None):
    """A seeded sampled request on PROMPTS[2], alone and beside another stream: (its tokens alone, in the batch)."""
    s = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    want = load(root, "fp32", "prompt-lookup").generate(PROMPTS[2], max_new_tokens=24, sampling=s,
                                                        ignore_eos=True).token_ids
    batched = parallel_session or load(root, "fp32", "prompt-lookup", parallel=2)
    out = [None, None]

    def one(i):
        out[i] = batched.generate(PROMPTS[2] if i == 0 else PROMPTS[1], max_new_tokens=24, sampling=s,
                                  ignore_eos=True).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return want, out[0]


def test_sampled_streams_in_a_batch_keep_their_seeded_output(tiny_engines):
    """A seeded sampled request gives the same tokens alone and in a batch (each stream has its own generator)."""
    want, got = seeded_alone_and_batched(tiny_engines)
    assert got == want


class FakeBatch:
    description = "fake"
    wide_rows_alone = False

    def pass_width(self, n: int) -> int:
        return n  # no padding to buckets


class FakeRowsAlone(FakeBatch):
    wide_rows_alone = True


def _planner(costs: dict[tuple[int, int], float], streams: int, alpha: float, batch=None):
    sched = Scheduler()
    batch = batch or FakeBatch()
    table = sched.costs_of(batch)
    for (B, W), t in costs.items():
        for _ in range(table.trust):
            table.observe(B, W, t)
    planner = LoadPlanner(sched, batch, 9)
    controls = []
    for m in range(streams):
        sched.active.add(m)
        c = LoadK(planner, m, 8)
        for _ in range(30):  # this stream's acceptance: alpha at every position
            acc = np.random.default_rng(m).random(8) < alpha
            result = VerifyResult(np.zeros(0, np.int64), np.zeros(0, np.int64), 0, False, acc)
            c.observe(Round(0, 8, 8, 9, result, 0.0, 0.0, False))
        controls.append(c)
    return planner, controls


def test_load_planner_drafts_alone_and_stops_under_load():
    """Known costs: a memory-bound single row (width nearly free) and a compute-bound batch of 8 (cost grows with
    rows x width). Alone it drafts; at 8 streams the same acceptance does not pay and K = 0."""
    costs = {}
    for W in range(1, 10):
        costs[(1, W)] = 0.010 + 0.0005 * (W - 1)        # alone: +5% a token
        costs[(8, W)] = 0.016 * (1 + 0.9 * (W - 1))      # 8 rows, compute-bound: a width token ~ a pass
    planner, controls = _planner({k: v for k, v in costs.items() if k[0] == 1}, 1, alpha=0.7)
    assert controls[0].k(0) >= 3
    planner, controls = _planner({k: v for k, v in costs.items() if k[0] == 8}, 8, alpha=0.7)
    assert all(c.k(0) == 0 for c in controls)


def test_load_planner_when_wide_rows_run_alone():
    """One-token rows batched, a drafting stream's pass alone (ONNX Runtime CPU): alone, drafting pays; with 8
    streams a pass of its own costs more than the tokens it adds, so nobody drafts; with 2 streams it pays again."""
    costs = {(1, W): 0.010 + 0.0005 * (W - 1) for W in range(1, 10)}
    costs |= {(B, 1): 0.010 + 0.001 * (B - 1) for B in range(2, 9)}
    planner, controls = _planner(costs, 1, alpha=0.7, batch=FakeRowsAlone())
    assert controls[0].k(0) >= 3
    planner, controls = _planner(costs, 8, alpha=0.7, batch=FakeRowsAlone())
    assert all(c.k(0) == 0 for c in controls)
    planner, controls = _planner(costs, 2, alpha=0.9, batch=FakeRowsAlone())
    assert sum(c.k(0) > 0 for c in controls) >= 1


def test_load_planner_alone_drafts_for_the_most_tokens_per_second():
    """One stream, wide rows alone: the plan is the k with the best rate E(k) / (t(1, 1 + k) + d k), the
    one-stream objective (AdaptiveK's), not the k with the most extra tokens per second of its pass (which
    drafts longer: here 5 or 6 against 4)."""
    costs = {(1, W): 0.010 + 0.001 * (W - 1) for W in range(1, 10)}
    planner, controls = _planner(costs, 1, alpha=0.7, batch=FakeRowsAlone())
    c = controls[0]
    table = [1.0 + sum(0.7 ** j for j in range(1, k + 1)) for k in range(c.k_max + 1)]  # alpha 0.7 everywhere
    c.table = lambda: table
    cost = planner.scheduler.costs_of(planner.batch)
    rate = [table[k] / (cost(1, max(2, round(c.width[k]))) + c.d * k) for k in range(1, c.k_max + 1)]
    extra = [(table[k] - 1) / (cost(1, max(2, round(c.width[k]))) + c.d * k) for k in range(1, c.k_max + 1)]
    assert int(np.argmax(rate)) != int(np.argmax(extra))  # the costs tell the two objectives apart
    assert c.k(0) == int(np.argmax(rate)) + 1


def test_load_planner_widens_a_step_at_a_time():
    """Padded batches of 4 rows measured at widths 1 and 2 only, and drafts almost always kept: the plan goes no
    wider than twice the widest measured pass (4), however cheap the lines make a wider one look."""
    costs = {(4, 1): 0.010, (4, 2): 0.0105} | {(1, W): 0.010 + 0.0002 * (W - 1) for W in range(1, 10)}
    planner, controls = _planner(costs, 4, alpha=0.95)
    ks = [c.k(0) for c in controls]
    assert max(ks) == controls[0].fits(4) == 3
    for _ in range(planner.scheduler.costs_of(planner.batch).trust):  # width 4 measured: up to 8 now
        planner.scheduler.costs_of(planner.batch).observe(4, 4, 0.011)
    planner.scheduler.passes += 1  # a new round: a new plan
    assert max(c.k(0) for c in controls) == 7


def test_load_planner_follows_acceptance():
    """Same costs, a stream whose drafts are never kept gets K = 0 alone."""
    costs = {(1, W): 0.010 + 0.002 * (W - 1) for W in range(1, 10)}
    planner, controls = _planner(costs, 1, alpha=0.0)
    assert controls[0].k(0) == 0


def test_batch_costs_fit_rows_and_width_apart_and_leave_prefills_out():
    c = BatchCosts()
    for B, W, t in [(1, 1, 0.010), (1, 2, 0.011), (1, 3, 0.012), (2, 1, 0.0105), (4, 1, 0.0115), (1, 300, 0.3)] * 2:
        c.observe(B, W, t)
    assert c(1, 5) == pytest.approx(0.014, abs=1e-3)   # one row, by width: the prefill did not pull it up
    assert c(8, 1) == pytest.approx(0.0135, abs=1e-3)  # one-token rows, by count
    assert c(4, 2) == pytest.approx(c(8, 1))            # a padded batch no cheaper than its tokens as rows
    wide = BatchCosts()  # a row's width is dear, rows are cheap
    for B, W, t in [(1, 1, 0.010), (1, 2, 0.020), (1, 3, 0.030), (2, 1, 0.0105), (4, 1, 0.0115)] * 2:
        wide.observe(B, W, t)
    assert wide(2, 2) == pytest.approx(0.021, abs=1e-3)  # ... nor than its rows scaled as a row's width scales it
    for _ in range(c.trust):
        c.observe(8, 1, 0.02)
    assert c(8, 1) == pytest.approx(0.02)              # a cell with enough passes of its own is its average


def _chat(content: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, **kw}


def test_the_server_with_parallel_streams_answers_each_as_alone_and_cancels_one(tiny_engines):
    """`serve --parallel 3`: four concurrent streamed requests (one waits for a slot) each answer what a request
    alone does; one client hanging up mid-stream stops only its stream; a conversation's next turn reuses its
    prefix (cached_tokens)."""
    pytest.importorskip("fastapi")
    import httpx
    from helpers import loopback

    from specrt.server.app import create_app

    alone = load(tiny_engines, "fp32", "prompt-lookup")
    want = {p: alone.generate(p, max_new_tokens=40, sampling=GREEDY, ignore_eos=True).text for p in PROMPTS[:4]}
    session = gathering(load(tiny_engines, "fp32", "prompt-lookup", parallel=3), 3)
    app = create_app(session, "tiny")
    with loopback(app) as (url, _):
        got, errors = {}, []

        def ask(prompt):
            try:
                with httpx.Client(timeout=60) as http:
                    text = ""
                    with http.stream("POST", url + "/v1/chat/completions", json=_chat(prompt, stream=True)) as r:
                        assert r.status_code == 200
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                for c in json.loads(line[6:]).get("choices", []):
                                    text += c["delta"].get("content") or ""
                    got[prompt] = text
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def hang_up():
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", url + "/v1/chat/completions",
                                 json=_chat(PROMPTS[4], max_tokens=200, stream=True)) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i == 6:
                            break

        threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS[:4]] + [threading.Thread(target=hang_up)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert got == want
        server, deadline = app.state.server, time.monotonic() + 10
        while len(server.history) < 5 or server.pending:  # the hung-up stream finishes on its own round
            assert time.monotonic() < deadline, "the hung-up stream did not finish"
            time.sleep(0.005)
        ends = sorted(st.finish_reason for st in server.history)
        assert ends == ["cancelled", "length", "length", "length", "length"], ends
        assert next(st for st in server.history if st.finish_reason == "cancelled").new_tokens < 200
        with httpx.Client(timeout=60) as http:
            first = http.post(url + "/v1/chat/completions", json=_chat(PROMPTS[0])).json()
            turn2 = _chat(PROMPTS[0])
            turn2["messages"] += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                  {"role": "user", "content": "More."}]
            second = http.post(url + "/v1/chat/completions", json=turn2).json()
        assert first["choices"][0]["message"]["content"] == want[PROMPTS[0]]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    assert session.scheduler.rows > session.scheduler.passes  # rows went together
    assert session.pool.busy == 0 and not session.scheduler.active  # every slot is free again


def test_parallel_on_a_backend_that_cannot_batch_is_one_line(tiny_engines, tmp_path):
    """A backend without batch engines (the reference backend, the GPU ones) refuses --parallel with the fix."""
    import json as _json
    import shutil

    from specrt.errors import SpecrtError

    root = tmp_path / "set"
    shutil.copytree(tiny_engines, root)
    m = _json.loads((root / "manifest.json").read_text())
    for e in m["engines"].values():
        e["backend"] = "reference"
    (root / "manifest.json").write_text(_json.dumps(m))
    with pytest.raises(SpecrtError, match="--parallel 1"):
        load(root, "fp32", "off", parallel=2)


def test_the_prefill_chunk_default_in_serve_help_is_the_runtime_default():
    from specrt.runtime.batch_session import PREFILL_CHUNK
    from specrt.cli.serve import PREFILL_CHUNK_HELP

    assert PREFILL_CHUNK_HELP.endswith(f"Default {PREFILL_CHUNK}.")


@pytest.mark.parametrize("args,words", [(("--parallel", "0"), ("--parallel", ">= 1")),
                                        (("--parallel", "2", "--prefill-chunk", "-1"), ("--prefill-chunk", ">= 0")),
                                        (("--parallel", "2", "--draft-tokens", "99"), ("--draft-tokens", "1..32"))])
def test_serve_parallel_bad_values_are_one_line(tiny_engines, args, words):
    import os
    import subprocess
    import sys

    from helpers import assert_user_error

    r = subprocess.run([sys.executable, "-m", "specrt.cli", "serve", "--engines", str(tiny_engines), *args],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert_user_error(r, *words)


def test_a_slow_reader_does_not_hold_up_the_other_streams(tiny_engines):
    """Python API with --parallel: one caller sleeps between deltas (speech synthesis); the other stream finishes
    long before it, both with the tokens they get alone; closing a stream early cancels it at a round boundary."""
    import time

    alone = load(tiny_engines, "fp32", "off")
    want = {p: alone.generate(p, max_new_tokens=40, sampling=GREEDY, ignore_eos=True).token_ids for p in PROMPTS[:2]}
    batched = load(tiny_engines, "fp32", "off", parallel=2)
    took, got = {}, {}

    def read(prompt, pause):
        t = time.perf_counter()
        s = batched.stream(prompt, max_new_tokens=40, sampling=GREEDY, ignore_eos=True)
        for _ in s:
            time.sleep(pause)
        took[prompt], got[prompt] = time.perf_counter() - t, s.result.token_ids

    slow = threading.Thread(target=read, args=(PROMPTS[0], 0.02))
    slow.start()
    time.sleep(0.05)
    read(PROMPTS[1], 0.0)
    slow.join(30)
    assert got == want
    assert took[PROMPTS[1]] < took[PROMPTS[0]] / 3
    s = batched.stream(PROMPTS[2], max_new_tokens=200, sampling=GREEDY, ignore_eos=True)
    next(s)
    s.close()
    assert s.result.stats.finish_reason == "cancelled" and s.result.stats.new_tokens < 200
    assert batched.pool.busy == 0 and not batched.scheduler.active


def test_a_prompt_that_fills_the_context_is_refused_and_the_batch_goes_on(tiny_engines):
    """Bad input in a batch: a prompt as long as the context is one line before it takes a slot; a stream that
    reaches the context end stops with finish_reason "context" while the other keeps its own output."""
    from specrt.errors import SpecrtError

    batched = load(tiny_engines, "fp32", "off", parallel=2)
    with pytest.raises(SpecrtError, match="context"):
        batched.stream("word " * 400, max_new_tokens=8)
    assert batched.pool.busy == 0
    alone = load(tiny_engines, "fp32", "off")
    long_prompt = " ".join(PROMPTS) * 2
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True) for p, n in
            ((long_prompt, 300), (PROMPTS[0], 40))]
    assert want[0].stats.finish_reason == "context"
    got = run_threads(gathering(batched, 2), [(long_prompt, 300, 0.0), (PROMPTS[0], 40, 0.0)])
    assert got == [w.token_ids for w in want]


@pytest.mark.slow
def test_batch_load_bench_writes_rows_per_prefill_chunk(tiny_engines, tmp_path):
    """The trade-off bench on the tiny set: a row per (mode, C, chunk), the median of 2 reps, TTFT and ITL columns,
    every answer identical to one-stream plain decoding."""
    from test_bench import write_prompts

    from experiments.batch_load import main

    rows = main(["--engines", str(tiny_engines), "--prompts", str(write_prompts(tmp_path / "p.jsonl", 4)),
                 "--modes", "off", "--concurrency", "1,2", "--answers", "4",
                 "--max-new-tokens", "8", "--lengths", "varied", "--categories", "chat", "--prefill-chunk", "0,16",
                 "--threads", "1", "--reps", "2",
                 "--out", str(tmp_path)])
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        ("single (auto, no --parallel)", 1), ("off", 1), ("off, chunk 0", 2), ("off, chunk 16", 2)]
    assert all(r["identical"] == "4/4" and r["ttft_p50_ms"] > 0 and r["itl_p99_ms"] > 0 for r in rows)
    assert all(r["reps"] == 2 and len(r["tok_s_reps"]) == 2 for r in rows)
    assert all(r["tok_s"] == round(float(np.median(r["tok_s_reps"])), 1) for r in rows)
    table = (tmp_path / "batch_load.md").read_text()
    assert "TTFT p99 ms" in table and "| off, chunk 16 | 2 |" in table


@pytest.mark.slow
def test_batch_load_slots_runs_one_stream_on_a_batch_session(tiny_engines, tmp_path):
    """--slots 2 at C = 1: the mode runs on a BatchSession of 2 slots (a server's --parallel 2 with one client), the
    single row on the one-stream Session; answers identical to plain decoding."""
    from test_bench import write_prompts

    from experiments.batch_load import main

    rows = main(["--engines", str(tiny_engines), "--prompts", str(write_prompts(tmp_path / "p.jsonl", 3)),
                 "--modes", "off", "--concurrency", "1", "--answers", "3", "--max-new-tokens", "8",
                 "--categories", "chat", "--threads", "1", "--slots", "2", "--out", str(tmp_path)])
    assert [(r["mode"], r["slots"]) for r in rows] == [("single (auto, no --parallel)", 1), ("off", 2)]
    assert all(r["identical"] == "3/3" for r in rows)


def test_batch_ceiling_with_prefills_is_the_closed_loops_arithmetic(tiny_engines, tmp_path):
    """The ceiling bench on the tiny set: the pass costs by rows, then the closed loop's ceiling with the prompts'
    prefills counted, (prefills + tokens t(1)) / (prefills + tokens / C t(C))."""
    from test_bench import write_prompts

    from experiments.batch_ceiling import main

    rows = main(["--engines", str(tiny_engines), "--batches", "1,2", "--context", "40", "--threads", "1",
                 "--passes", "8", "--with-prefills", "--answers", "3", "--max-new-tokens", "10", "--categories",
                 "chat", "--prompts", str(write_prompts(tmp_path / "p.jsonl", 4))])
    passes, loop = rows[:2], rows[2:]
    assert [r["batch"] for r in passes] == [1, 2] and [r["concurrency"] for r in loop] == [1, 2]
    t = {r["batch"]: r["pass_ms"] / 1000 for r in passes}
    pre = loop[0]["prefill_s"]
    assert loop[0]["prompts"] == 3 and pre > 0 and loop[0]["ceiling_vs_one_stream"] == 1.0
    # the rows are rounded (pass_ms to 0.01 ms, seconds to 1 us): tiny passes need that much slack
    assert loop[1]["decode_s"] == pytest.approx(30 / 2 * t[2], rel=0.01, abs=2e-4)
    assert loop[1]["ceiling_vs_one_stream"] == pytest.approx((pre + 30 * t[1]) / (pre + 15 * t[2]), abs=0.01)
    with pytest.raises(SystemExit):  # the one-stream cost is the baseline
        main(["--engines", str(tiny_engines), "--batches", "2", "--with-prefills"])


def test_parallel_conversations_reuse_their_prefixes_from_any_slot(tiny_engines):
    """--parallel 2 with KV reuse: four conversations at once over two slots, three turns each. A finished stream
    stashes its slot's cache (the batch engine's snapshot of that slot) and a later turn, on whichever slot it
    gets, restores it: every turn answers what a fresh session does, and turns 2-3 prefill from the cache."""
    from specrt.runtime.prefix_cache import MIB, PrefixStore
    from specrt.runtime.tokenizer import Message

    fresh = load(tiny_engines, "fp32", "off")
    batched = load(tiny_engines, "fp32", "off", parallel=2)
    batched.enable_reuse(PrefixStore(64 * MIB))
    talks = {k: [Message("user", f"Conversation {k}: tell me about rivers and lakes and seas.")] for k in "abcd"}
    for turn in range(3):
        out = {}

        def one(k):
            out[k] = batched.generate(list(talks[k]), max_new_tokens=12, sampling=GREEDY)

        threads = [threading.Thread(target=one, args=(k,)) for k in talks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(out) == set(talks), f"turn {turn}: a conversation did not finish"
        for k, history in talks.items():
            alone = fresh.generate(list(history), max_new_tokens=12, sampling=GREEDY)
            assert out[k].token_ids == alone.token_ids, (turn, k)
            if turn:
                assert out[k].stats.cached_tokens >= 40, (turn, k, out[k].stats.cached_tokens)
            history += [Message("assistant", out[k].text), Message("user", "More.")]


def test_batch_engines_follow_the_protocol_and_their_descriptor(tiny_engines):
    """A backend's descriptor says `batch` exactly when its module opens batch engines, and every batch engine class
    has what runtime/engine.py's BatchEngine names (an instance on the CPU: its attributes too)."""
    import importlib
    import inspect

    from specrt.backends import BACKENDS
    from specrt.manifest import load_manifest
    from specrt.runtime.backends.device.batch import DeviceBatchEngine
    from specrt.runtime.backends.onnxruntime_cpu.batch import OrtBatchEngine, open_batch
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.backends.onnxruntime_portable.batch import PortableBatchEngine
    from specrt.runtime.backends.tensorrt.batch import TrtBatchEngine
    from specrt.runtime.engine import BatchEngine, EngineOptions

    for name, b in BACKENDS.items():
        assert b.batch == hasattr(importlib.import_module(b.module), "open_batch"), name
    methods = [n for n, v in vars(BatchEngine).items() if inspect.isfunction(v)]
    assert {"run", "snapshot", "restore", "move", "enable_hidden"} <= set(methods)
    for cls in (OrtBatchEngine, PortableBatchEngine, DeviceBatchEngine, TrtBatchEngine, OrtCudaBatchEngine):
        assert all(callable(getattr(cls, n, None)) for n in methods), cls
    m = load_manifest(tiny_engines)
    batch = open_batch(m.root, m.engine("target", "fp32"), EngineOptions(threads=1), 2)
    assert [n for n in BatchEngine.__annotations__ if not hasattr(batch, n)] == []
    assert batch.slots == 2 and batch.lengths == [0, 0]
