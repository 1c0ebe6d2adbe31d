"""`specrt bench`: a quick run on the tiny engine set (no timing assertions: CI machines are noisy),
the prompt-set schema, and bad input (one-line errors that name the fix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_user_error

from specrt.runtime.engine import EngineOptions
from specrt.bench.prompts import CATEGORIES, DEFAULT_PROMPTS, load_prompts, select
from specrt.bench.runner import BenchConfig, first_divergence, run_bench
from specrt.errors import SpecrtError

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def write_prompts(path: Path, per_category: int = 1, max_new_tokens: int = 6) -> Path:
    lines = [json.dumps({"id": f"{c}-{i}", "category": c, "max_new_tokens": max_new_tokens,
                         "messages": [{"role": "user", "content": f"def add(a, b): return a + b  # {c} {i}"}]})
             for c in CATEGORIES for i in range(per_category)]
    path.write_text("\n".join(lines) + "\n")
    return path


def specrt(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "specrt.cli", "bench", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=600, cwd=cwd)


def test_default_prompt_set_loads():
    cases = load_prompts(DEFAULT_PROMPTS)
    assert {c.category for c in cases} == set(CATEGORIES)
    assert all(sum(c.category == cat for c in cases) >= 3 for cat in CATEGORIES)
    quick = select(cases, per_category=1, max_new_tokens=32)
    assert len(quick) == len(CATEGORIES) and all(c.max_new_tokens <= 32 for c in quick)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


@pytest.mark.slow
def test_quick_bench_on_tiny_engines(tiny_engines, tmp_path, monkeypatch):
    """Ours (plain, prompt lookup) and a transformers peer run; a missing peer is a note, not a crash."""
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # as if not installed
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the HF peer must not shrink other tests' pool
    prompts = write_prompts(tmp_path / "p.jsonl")
    cfg = BenchConfig(engines=tiny_engines, prompts=prompts, quick=True, reps=2, threads=1,
                      modes="plain-fp32,plain-int4,prompt-lookup-fp32,auto-fp32,genai-fp32,llamacpp,hf,hf-pld")
    res = run_bench(cfg, log=lambda m: None)
    assert res["modes"][0] == "plain-fp32" and res["load_order"] == res["modes"]
    assert {"plain-fp32", "plain-int4", "prompt-lookup-fp32", "auto-fp32", "hf", "hf-pld"} <= set(res["modes"])
    notes = " ".join(res["notes"])
    assert "genai-fp32: skipped" in notes and "onnxruntime-genai is not installed" in notes
    assert "llamacpp: skipped" in notes  # the tiny set comes from a HF folder, llama.cpp needs a GGUF
    rows = {(r["mode"], r["category"]): r for r in res["summary"]}
    assert set(r["category"] for r in res["summary"]) == set(CATEGORIES) | {"all"}
    assert rows[("plain-fp32", "all")]["speedup"] == 1.0
    # speculation is lossless at fp32: greedy output equals the reference token for token
    for m in ("prompt-lookup-fp32", "auto-fp32"):
        assert rows[(m, "all")]["identical"] == f"{len(CATEGORIES)}/{len(CATEGORIES)}"
        assert rows[(m, "all")]["tau"] >= 1.0
    assert len(res["runs"]) == 2 * len(CATEGORIES) * len(res["modes"])
    for r in res["runs"]:
        assert r["new_tokens"] >= 1 and r["ttft_s"] is not None and len(r["gaps_s"]) == r["new_tokens"] - 1
        if r["mode"] in ("prompt-lookup-fp32", "auto-fp32"):  # the counts the summary pools, per run
            assert r["rounds"] >= 1 and len(r["drafted"]) == len(r["accepted"]) == len(r["acceptance"])
            assert all(0 <= k <= d for k, d in zip(r["accepted"], r["drafted"]))
    assert rows[("auto-fp32", "all")]["proposer"] == "lookup/suffix"  # no draft model, no heads in the tiny set
    assert rows[("prompt-lookup-fp32", "all")]["pooled"] and rows[("plain-fp32", "all")]["tau"] == 1.0

    from specrt.bench.report import write

    write(res, tmp_path / "out", "specrt bench --quick")
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["meta"]["threads"] == 1
    md = (out / "report.md").read_text()
    assert "| plain-fp32 |" in md and "specrt bench --quick" in md and "Skipped" in md
    assert "- load order (sessions created later decoded faster here): plain-fp32, plain-int4," in md
    assert "| new tokens |" in md and "auto-fp32: lookup/suffix" in md and "predates" not in md
    for png in ("speedup.png", "acceptance.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert rows[("plain-fp32", "all")]["decode_speedup"] == 1.0
    # the report can be re-derived from results.json alone
    (out / "report.md").unlink()
    subprocess.run([sys.executable, "-m", "specrt.bench.report", str(out / "results.json")], check=True)
    assert "| plain-fp32 |" in (out / "report.md").read_text()


def test_reversed_load_order_keeps_the_tables_in_listed_order(tiny_engines, tmp_path):
    cfg = BenchConfig(engines=tiny_engines, prompts=write_prompts(tmp_path / "p.jsonl"), quick=True, reps=1,
                      threads=1, modes="plain-fp32,plain-int4,prompt-lookup-fp32", load_order="reversed")
    res = run_bench(cfg, log=lambda m: None)
    assert res["load_order"] == ["prompt-lookup-fp32", "plain-int4", "plain-fp32"]
    assert res["modes"] == ["plain-fp32", "plain-int4", "prompt-lookup-fp32"]
    assert [r["mode"] for r in res["summary"] if r["category"] == "all"] == res["modes"]


def test_decode_speed_leaves_out_the_first_round():
    from specrt.bench.runner import decode_tok_s

    # 5 tokens: the first round emits 3 at TTFT = 1 s, then one token every 0.5 s; total 2 s
    run = {"new_tokens": 5, "ttft_s": 1.0, "total_s": 2.0, "gaps_s": [0.0, 0.0, 0.5, 0.5]}
    assert decode_tok_s(run) == pytest.approx(2 / 1.0)
    assert decode_tok_s({**run, "new_tokens": 1, "gaps_s": []}) is None   # nothing after the first round


@pytest.mark.slow
def test_cli_quick_writes_report(tiny_engines, tmp_path):
    r = specrt("--engines", tiny_engines, "--prompts", write_prompts(tmp_path / "p.jsonl"), "--quick", "--reps", 1,
               "--threads", 1, "--modes", "plain-fp32", "--categories", "chat,code", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert "plain-fp32" in r.stdout and (tmp_path / "o" / "report.md").is_file()


@pytest.mark.slow
def test_the_workloads_that_repeat_are_reported_beside_the_prompt_set(tmp_path):
    """--repeat-calls: the voice-agent calls and the code-edit loop for plain and each fp32 speculation mode, in
    results.json, report.md and repeat.png; speculative output identical to plain on every turn."""
    from tiny import make_checkpoint

    from specrt.pipeline import EngineSetRequest, make_engine_set

    ckpt = make_checkpoint(tmp_path / "tiny-long", positions=2048)  # a call's history outgrows the tiny set's 256
    engines = make_engine_set(EngineSetRequest(str(ckpt), "tiny-long", ("fp32",), 2048, tmp_path / "e"),
                              log=lambda m: None)
    r = specrt("--engines", engines, "--prompts", write_prompts(tmp_path / "p.jsonl"), "--quick", "--reps", 1,
               "--threads", 1, "--modes", "plain-fp32,plain-fullhead-fp32,prompt-lookup-fp32,suffix-fp32",
               "--categories", "chat",
               "--repeat-calls", 2, "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "o" / "results.json").read_text())["repeat"]
    assert rep["modes"] == ["off", "prompt-lookup", "suffix"] and rep["calls"] == 2 and rep["edits"] == 1  # no fullhead
    for workload in ("voice", "code"):
        s = rep["summary"][workload]
        assert all(s["identical"].values()) and s["tau"]["off"] <= 1.0 and s["drafted"]["off"] == 0
    md = (tmp_path / "o" / "report.md").read_text()
    assert "## Workloads that repeat" in md and "### voice (from call 2 on)" in md and "| suffix |" in md
    assert (tmp_path / "o" / "repeat.png").is_file()
    assert_user_error(specrt("--engines", engines, "--repeat-calls", -1), "--repeat-calls must be >= 0")


@pytest.mark.parametrize("line, words", [
    ('{"id": "a", "category": "chat", "messages": [', ["p.jsonl:2", "malformed JSON"]),
    ('{"id": "a", "category": "poetry", "messages": [{"role": "user", "content": "x"}], "max_new_tokens": 4}',
     ["p.jsonl:2", "unknown category 'poetry'", "chat"]),
    ('{"id": "a", "category": "chat", "messages": [], "max_new_tokens": 4}', ["p.jsonl:2", "messages"]),
    ('{"id": "a", "category": "chat", "messages": [{"role": "user", "content": "x"}], "max_new_tokens": 0}',
     ["p.jsonl:2", "max_new_tokens"]),
    ('{"id": "a", "category": "chat", "messages": [{"role": "user", "content": "x"}]}', ["p.jsonl:2", "missing"]),
    ('{"id": "c0", "category": "chat", "messages": [{"role": "user", "content": "x"}], "max_new_tokens": 4}',
     ["p.jsonl:2", "duplicate id"]),
])
def test_bad_prompt_lines(tmp_path, line, words):
    good = '{"id": "c0", "category": "chat", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 4}'
    p = tmp_path / "p.jsonl"
    p.write_text(good + "\n" + line + "\n")
    with pytest.raises(SpecrtError) as e:
        load_prompts(p)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_cli_bad_input(tiny_engines, tmp_path):
    """Each bad input is one line, exit 2, and nothing written: the runs start in an empty folder, where the
    default --out (bench-out) would appear."""
    prompts = write_prompts(tmp_path / "p.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(prompts.read_text() + "{not json\n")
    here = tmp_path / "cwd"
    here.mkdir()

    def run(*args):
        return specrt(*args, cwd=here)

    assert_user_error(run("--engines", tiny_engines, "--prompts", bad), f"{bad}:7", "malformed")
    assert_user_error(run("--engines", tiny_engines, "--prompts", prompts, "--modes", "plain-fp32,warp-drive"),
                      "unknown mode 'warp-drive'", "plain-int4")
    assert_user_error(run("--engines", tiny_engines, "--prompts", prompts, "--categories", "poetry"),
                      "unknown category 'poetry'")
    assert_user_error(run("--engines", tiny_engines, "--prompts", prompts, "--load-order", "sideways"),
                      "--load-order must be 'listed' or 'reversed'")
    assert_user_error(run("--engines", tmp_path / "nope", "--prompts", prompts), "not found", "specrt engines")
    assert_user_error(run("--engines", tiny_engines, "--prompts", tmp_path / "missing.jsonl"), "not found")
    assert list(here.iterdir()) == []  # errors happen before anything is written


def test_peer_failing_mid_run_is_dropped_with_a_note(tiny_engines, tmp_path, monkeypatch):
    from specrt.bench import peers

    class Flaky:  # runs the warm-up, then breaks
        name, calls = "flaky", 0

        def __init__(self, ck):
            pass

        def load(self, log=print):
            pass

        def run(self, prompt_ids, messages, max_new_tokens):
            Flaky.calls += 1
            if Flaky.calls > 1:
                raise RuntimeError("device lost")
            return peers.Trace([1], [0.01], 0.01)

    monkeypatch.setitem(peers.PEERS, "flaky", Flaky)
    cfg = BenchConfig(engines=tiny_engines, prompts=write_prompts(tmp_path / "p.jsonl"), quick=True, reps=1,
                      threads=1, modes="plain-fp32,flaky")
    res = run_bench(cfg, log=lambda m: None)
    assert res["modes"] == ["plain-fp32"] and not any(r["mode"] == "flaky" for r in res["runs"])
    assert any(n.startswith("flaky: dropped") and "device lost" in n for n in res["notes"])


def test_ceiling_replay_of_a_copy_task():
    from experiments.ceiling import accepted_runs, replay_rounds

    prompt = out = [5, 6, 7, 8, 9, 10, 11, 12]                  # the answer repeats the prompt
    bucket, lookup, oracle = accepted_runs(prompt, out)
    assert (bucket[0], lookup[0]) == (5, 0)                     # "12" never had a successor: no match
    assert (bucket[1], lookup[1], oracle[1]) == (4, 7, 7)       # "5" (1-gram) -> 6..12, all kept
    assert bucket[6] == 0 and lookup[6] == 2                    # "5..10" (6-gram) -> 11, 12
    # drafts of 4 after any match: 5 (a plain round), 6 7 8 9 accepted + 10, 11 accepted + 12 (the end)
    assert replay_rounds(bucket, lookup, [4, 4, 4, 4, 4, 0], lambda w: float(w)) == (8, 3, 1.0 + 5.0 + 5.0)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, 120).tolist()
    _, lookup, oracle = accepted_runs(seq[:60], seq[60:])
    # a bound, and not trivially equal
    assert all(o >= lk for o, lk in zip(oracle, lookup)) and sum(oracle) > sum(lookup)


@pytest.mark.slow
def test_ignore_eos_gives_every_contender_the_full_length(tiny_engines, tmp_path, monkeypatch):
    """--ignore-eos: ours and the transformers peer all make exactly max_new_tokens, where without it they
    stop at EOS (here a token the tiny model really emits early, declared EOS for the test; a random tiny
    model tends to repeat one token, so that may be the very first: an empty answer must not break the bench)."""
    import dataclasses

    import torch

    from specrt.bench import runner
    from specrt.runtime.generate import Generator

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    prompts = write_prompts(tmp_path / "p.jsonl", max_new_tokens=8)
    first = load_prompts(prompts)[0]
    gen = Generator.load(tiny_engines, "fp32", EngineOptions(threads=1))
    from specrt.runtime.tokenizer import Message

    plain = gen.generate([Message(r, c) for r, c in first.messages], max_new_tokens=8).token_ids
    real = runner.load_manifest(Path(tiny_engines))
    cut = next((i for i in range(1, 8) if plain[i] not in plain[:i]), 0)  # a token first emitted at index `cut`
    # appended: the first id stays the tokenizer's eos, the one the chat template renders
    fake = dataclasses.replace(real, eos_token_ids=real.eos_token_ids + (plain[cut],))
    monkeypatch.setattr(runner, "load_manifest", lambda path: fake)
    monkeypatch.setattr(runner.contenders, "_GENERATORS", {})  # generators cached by earlier tests hold the real EOS
    cfg = dict(engines=tiny_engines, prompts=prompts, reps=1, threads=1, categories=(first.category,),
               modes="plain-fp32,prompt-lookup-fp32,hf")
    stopped = run_bench(BenchConfig(**cfg), log=lambda m: None)
    assert {r["mode"]: r["new_tokens"] for r in stopped["runs"]} == dict.fromkeys(
        ("plain-fp32", "prompt-lookup-fp32", "hf"), cut)
    full = run_bench(BenchConfig(**cfg, ignore_eos=True), log=lambda m: None)
    assert {r["mode"]: r["new_tokens"] for r in full["runs"]} == {"plain-fp32": 8, "prompt-lookup-fp32": 8, "hf": 8}
    assert full["meta"]["ignore_eos"] is True
    ours = [r["token_ids"] for r in full["runs"] if r["mode"] != "hf"]
    assert ours[0] == ours[1] == plain  # ours decode through EOS: the same tokens as the unstopped run


@pytest.mark.slow
def test_isolate_runs_each_contender_in_its_own_process(tiny_engines, tmp_path, monkeypatch):
    """--isolate: same interface and results (greedy output equals the reference's), one process each,
    every worker stopped afterwards."""
    from specrt.bench import isolate, runner

    made = []

    class Recorded(isolate.Isolated):
        def load(self, log=print):
            made.append(self)
            super().load(log)
            self.pid = self.proc.pid

    monkeypatch.setattr(runner, "Isolated", Recorded)
    cfg = BenchConfig(engines=tiny_engines, prompts=write_prompts(tmp_path / "p.jsonl"), quick=True, reps=1,
                      threads=1, modes="plain-fp32,prompt-lookup-fp32,llamacpp", isolate=True)
    res = run_bench(cfg, log=lambda m: None)
    assert res["modes"] == ["plain-fp32", "prompt-lookup-fp32"] and res["meta"]["isolate"] is True
    assert any("llamacpp: skipped" in n for n in res["notes"])  # Unavailable (no GGUF) crosses the pipe as a note
    pids = [c.pid for c in made if hasattr(c, "pid")]
    assert len(made) == 3 and len(set(pids)) == 2 and os.getpid() not in pids
    assert all(c.proc is None for c in made)  # every worker stopped, the skipped one included
    rows = {(r["mode"], r["category"]): r for r in res["summary"]}
    assert rows[("prompt-lookup-fp32", "all")]["identical"] == f"{len(CATEGORIES)}/{len(CATEGORIES)}"
    assert all(r["new_tokens"] >= 1 for r in res["runs"])


@pytest.mark.slow
def test_isolate_stops_a_worker_whose_warm_up_fails(tiny_engines, tmp_path, monkeypatch):
    from specrt.bench import isolate, runner

    made = []

    class Interrupted(isolate.Isolated):
        def load(self, log=print):
            made.append(self)
            super().load(log)

        def run(self, *args):
            raise KeyboardInterrupt  # e.g. Ctrl-C during the warm-up: the worker is not in `live` yet

    monkeypatch.setattr(runner, "Isolated", Interrupted)
    cfg = BenchConfig(engines=tiny_engines, prompts=write_prompts(tmp_path / "p.jsonl"), quick=True, reps=1,
                      threads=1, modes="plain-fp32", isolate=True)
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, log=lambda m: None)
    assert len(made) == 1 and made[0].proc is None


def test_isolate_reports_a_bad_engine_set_in_one_line(tmp_path):
    from specrt.bench.isolate import Isolated
    from specrt.bench.peers import Checkpoint

    ck = Checkpoint("hf", tmp_path, "x", (2,), tmp_path, 1)
    with pytest.raises(SpecrtError, match="manifest"):
        Isolated("plain-fp32", tmp_path, ck).load(log=lambda m: None)


def _run(case, rep, tok_s, mode="m", n=10, **kw):
    """A synthetic runs[] entry (what runner._interleave records), n tokens at tok_s."""
    return {"mode": mode, "case": case, "category": "chat", "rep": rep, "prompt_tokens": 5, "new_tokens": n,
            "total_s": n / tok_s if tok_s else 0.5, "tok_s": tok_s if n else 0.0, "ttft_s": 0.1 if n else None,
            "gaps_s": [0.01] * max(0, n - 1), "tau": None, "acceptance": [], "rounds": None, "drafted": [],
            "accepted": [], "proposer": None, "token_ids": [1] * n, "first_divergence": None, **kw}


def test_speedup_pairs_each_rep_with_the_reference_of_the_same_rep():
    """Rep 0 slow for both (the machine), rep 1 slow for the mode only: per rep the ratios are 1, 0.5, 1, so
    the speedup is 1.0; a ratio of medians taken over each side's own reps said 20/40 = 0.5."""
    from specrt.bench.runner import paired_speedup

    ref = [_run("a", i, v, "plain-fp32") for i, v in enumerate([20.0, 40.0, 40.0])]
    mine = [_run("a", i, v) for i, v in enumerate([20.0, 20.0, 40.0])]
    assert paired_speedup(mine, ref) == (1.0, [])
    # over prompts: the geometric mean of per-prompt medians (b at half speed in every rep: sqrt(1 x 0.5))
    ref += [_run("b", i, 10.0, "plain-fp32") for i in range(3)]
    assert paired_speedup(mine + [_run("b", i, 5.0) for i in range(3)], ref) == (round(np.sqrt(0.5), 3), [])


def test_a_prompt_with_no_tokens_is_left_out_of_the_speedup_and_named():
    from specrt.bench.report import markdown
    from specrt.bench.runner import _figures

    ref = [_run(c, 0, 40.0, "plain-fp32") for c in ("x", "y")]
    mine = [_run("x", 0, 0.0, n=0), _run("y", 0, 60.0)]  # its first token was EOS: tok/s 0, log 0 = -inf
    f = _figures(mine, ref)
    assert f["speedup"] == 1.5 and f["speedup_left_out"] == ["x"] and f["tok_s"] == 30.0
    res = _result(ref + mine, ["plain-fp32", "m"])
    assert "left out of the speedups" in markdown(res, "specrt bench") and "m (x)" in markdown(res, "specrt bench")


def test_tau_and_acceptance_pool_counts_over_runs():
    """Run A: 96 tokens in 24 rounds, 8 drafted and kept each round; run B: 10 tokens in 10 rounds, one of
    which drafted 8 tokens, all rejected. Pooled: tau 106/34, position 1: 24/34, position 8: 24/25; the
    old means of per-run figures said tau 2.5, 0.5 at every position."""
    from specrt.bench.runner import pooled_tau_acceptance

    a = _run("a", 0, 50.0, n=96, tau=4.0, rounds=24, acceptance=[1.0] * 8, drafted=[24] * 8, accepted=[24] * 8)
    b = _run("b", 0, 50.0, n=10, tau=1.0, rounds=10, acceptance=[0.0] * 8, drafted=[10] + [1] * 7, accepted=[0] * 8)
    plain = _run("a", 0, 40.0, tau=1.0, rounds=10)
    tau, acc, pooled = pooled_tau_acceptance([a, b])
    assert pooled and tau == round(106 / 34, 3) and acc[0] == round(24 / 34, 4) and acc[7] == round(24 / 25, 4)
    assert pooled_tau_acceptance([plain]) == (1.0, [], True)
    # a results.json saved before the counts: the old way, flagged for the report
    old = [{k: v for k, v in r.items() if k not in ("rounds", "drafted", "accepted")} for r in (a, b)]
    assert pooled_tau_acceptance(old) == (2.5, [0.5] * 8, False)


def _result(runs: list[dict], modes: list[str], **meta) -> dict:
    """A results.json around synthetic runs, summarized by this version (as report.rerender does)."""
    from specrt.bench.prompts import PromptCase
    from specrt.bench.runner import summarize

    cases = [PromptCase(c, "chat", (("user", "hi"),), 10) for c in dict.fromkeys(r["case"] for r in runs)]
    return {"meta": {"engine_set": "t", "quick": False, "date": "d", "cpu": "c", "cores": 2, "threads": 2, "cases": 1,
                     "reps": 1, "bench_s": 1.0, "versions": {}, "reference": "plain-fp32", **meta},
            "notes": [], "modes": modes, "cases": [c.as_dict() for c in cases], "runs": runs,
            "summary": summarize(runs, modes, cases)}


def test_report_shows_lengths_proposers_and_medusa_accuracy():
    from specrt.bench.report import markdown

    runs = [_run("a", 0, 40.0, "plain-fp32", n=20), _run("a", 0, 100.0, "plain-int4", n=20),
            _run("a", 0, 90.0, "genai-int4", n=12),   # stops at another EOS: a length to see beside its tok/s
            _run("a", 0, 60.0, "auto-fp32", n=20, tau=2.0, rounds=10, acceptance=[0.5], drafted=[10], accepted=[5],
                 proposer="lookup+medusa")]
    heads = {"engine": "medusa-fp32", "top1": [0.36, 0.21], "top5": [0.62, 0.44], "heldout_positions": 100}
    md = markdown(_result(runs, ["plain-fp32", "plain-int4", "genai-int4", "auto-fp32"], medusa=heads), "x")
    assert "| new tokens |" in md and "| genai-int4 | 90.0 | 12 |" in md
    assert ("plain-int4 >= genai-int4 on 1/1 prompts (same-rep pairs; by medians of tok/s 1/1); new tokens "
            "differ (ours vs peer) on: a 20 vs 12") in md
    assert "- proposers: auto-fp32: lookup+medusa" in md and "top-1 36% 21%, top-5 62% 44%" in md
    assert "predates" not in md and "arithmetic mean of those per-prompt medians" in md and "one slow rep" in md


@pytest.mark.slow
def test_old_results_without_counts_still_render(tmp_path):
    """results.json files from before the counts (no rounds/drafted/accepted/proposer per run) re-derive."""
    from specrt.bench.report import rerender

    runs = [_run("a", r, 40.0, "plain-fp32", tau=1.0) for r in range(2)]
    runs += [_run("a", r, 60.0, "prompt-lookup-fp32", tau=t, acceptance=[0.5, 0.25]) for r, t in enumerate((2.0, 1.0))]
    for r in runs:
        for k in ("rounds", "drafted", "accepted", "proposer"):
            del r[k]
    res = _result(runs, ["plain-fp32", "prompt-lookup-fp32"], command="specrt bench")
    (tmp_path / "results.json").write_text(json.dumps(res))
    rerender(tmp_path / "results.json")
    md = (tmp_path / "report.md").read_text()
    assert "predates the round and draft counts" in md and "| prompt-lookup-fp32 | 60.0 | 10 | 1.50x |" in md
    assert "| 1.50 |" in md and "0.50 0.25" in md


def test_a_peer_that_raises_at_load_or_warm_up_is_skipped(tiny_engines, tmp_path, monkeypatch):
    """llama.cpp raises ValueError("Failed to load model ...") on a GGUF it cannot read: a note, not a dead run."""
    from specrt.bench import peers

    class BadLoad:
        def __init__(self, ck):
            pass

        def load(self, log=print):
            raise ValueError("Failed to load model from file: x.gguf\nmore detail")

    class BadWarmUp(BadLoad):
        def load(self, log=print):
            pass

        def run(self, *args):
            raise RuntimeError("segfault avoided")

    monkeypatch.setitem(peers.PEERS, "badload", BadLoad)
    monkeypatch.setitem(peers.PEERS, "badwarm", BadWarmUp)
    cfg = BenchConfig(engines=tiny_engines, prompts=write_prompts(tmp_path / "p.jsonl"), quick=True, reps=1,
                      threads=1, modes="plain-fp32,badload,badwarm", categories=("chat",))
    res = run_bench(cfg, log=lambda m: None)
    assert res["modes"] == ["plain-fp32"]
    assert "badload: skipped (ValueError: Failed to load model from file: x.gguf)" in res["notes"]
    assert "badwarm: skipped (RuntimeError: segfault avoided)" in res["notes"]


def test_plain_runs_on_a_lone_target_where_a_draft_model_takes_turns(tiny_engines, monkeypatch):
    """On a set with a draft, plain-fp32 gets the target as `specrt generate` loads it for plain decoding
    (ORT spinning on), the draft mode its own turn-taking one; the draft mode names its draft engine and
    reports the counts the bench pools."""
    import dataclasses

    from specrt.bench import contenders
    from specrt.manifest import load_manifest

    real = load_manifest(Path(tiny_engines))
    target = real.engine("target", "fp32")  # the target as its own draft: cheap, and every draft is kept
    draft = dataclasses.replace(target, name="draft-fp32", role="draft", raw={**target.raw, "role": "draft"})
    fake = dataclasses.replace(real, engines={**real.engines, "draft-fp32": draft})
    monkeypatch.setattr(contenders, "_GENERATORS", {})
    plain, spec, lookup = (contenders.Ours(m, fake, 1) for m in ("plain-fp32", "draft-fp32", "prompt-lookup-fp32"))
    for c in (plain, spec, lookup):
        c.load(log=lambda m: None)

    def spinning_stopped(c) -> bool:
        try:
            return c.gen.engine.batch.session.get_session_options().get_session_config_entry(
                "session.force_spinning_stop") == "1"
        except RuntimeError:  # ORT raises for an entry that was never set
            return False

    assert not spinning_stopped(plain) and spinning_stopped(spec) and lookup.gen is plain.gen
    tr = spec.run([], [("user", "hi")], 12)  # ours render the prompt from the messages
    assert tr.proposer == "draft (draft-fp32)" and tr.rounds >= 1 and len(tr.drafted) == len(tr.acceptance)
    assert tr.accepted == tr.drafted and list(tr.drafted) == sorted(tr.drafted, reverse=True)


def test_goal_lines_judge_each_prompt_by_same_rep_pairs():
    """A slow rep must not decide a prompt: ours 30/10/20 vs the peer's 29/21/19 tok/s loses by medians (20 vs 21)
    but wins in two reps of three (median same-rep ratio 1.03)."""
    from specrt.bench.report import markdown

    runs = [_run("a", rep, v, "plain-fp32") for rep, v in enumerate((30.0, 10.0, 20.0))]
    runs += [_run("a", rep, v, "genai-fp32") for rep, v in enumerate((29.0, 21.0, 19.0))]
    md = markdown(_result(runs, ["plain-fp32", "genai-fp32"]), "x")
    assert "plain-fp32 >= genai-fp32 on 1/1 prompts (same-rep pairs; by medians of tok/s 0/1)" in md


def test_length_caveats_name_speculative_modes_whose_answers_change_length():
    from specrt.bench.runner import length_caveats

    def run(mode, case, n):
        return {"mode": mode, "case": case, "new_tokens": n}

    runs = [run("plain-fp32", "a", 100), run("plain-int4", "a", 128), run("plain-int4", "b", 128),
            run("auto-int4", "a", 36), run("auto-int4", "b", 125), run("auto-fp32", "a", 100)]
    ours = {"plain-fp32": ("plain", "fp32"), "plain-int4": ("plain", "int4"), "auto-int4": ("auto", "int4"),
            "auto-fp32": ("auto", "fp32"), "auto-int4-fp32": ("auto", "int4-fp32")}
    out = length_caveats(runs, ["plain-fp32", "plain-int4", "auto-int4", "auto-fp32"], ours)
    assert len(out) == 1 and out[0].startswith("auto-int4:") and "1 of 2 prompts (a)" in out[0]
    assert "--ignore-eos" in out[0]
    assert length_caveats([r for r in runs if r["case"] == "b"], ["plain-int4", "auto-int4"], ours) == []
    # a precision with a '-' in it pairs with its own plain mode, not with plain-fp32
    mixed = runs + [run("auto-int4-fp32", "a", 36)]
    assert length_caveats(mixed, ["plain-fp32", "auto-int4-fp32"], ours) == []
