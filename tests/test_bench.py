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


def specrt(*args):
    return subprocess.run([sys.executable, "-m", "specrt.cli", "bench", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=600)


def assert_user_error(r, *words):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and sum(x.startswith("error: ") for x in lines) == 1, r.stderr
    for w in words:
        assert w.lower() in lines[-1].lower(), lines[-1]


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


def test_quick_bench_on_tiny_engines(tiny_engines, tmp_path, monkeypatch):
    """Ours (plain, prompt lookup) and a transformers peer run; a missing peer is a note, not a crash."""
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # as if not installed
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the bench sets it; restored after the test
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

    from specrt.bench.report import write

    write(res, tmp_path / "out", "specrt bench --quick")
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text())["meta"]["threads"] == 1
    md = (out / "report.md").read_text()
    assert "| plain-fp32 |" in md and "specrt bench --quick" in md and "Skipped" in md
    assert "- load order (sessions created later decoded faster here): plain-fp32, plain-int4," in md
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


def test_cli_quick_writes_report(tiny_engines, tmp_path):
    r = specrt("--engines", tiny_engines, "--prompts", write_prompts(tmp_path / "p.jsonl"), "--quick", "--reps", 1,
               "--threads", 1, "--modes", "plain-fp32", "--categories", "chat,code", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert "plain-fp32" in r.stdout and (tmp_path / "o" / "report.md").is_file()


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
    prompts = write_prompts(tmp_path / "p.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(prompts.read_text() + "{not json\n")
    assert_user_error(specrt("--engines", tiny_engines, "--prompts", bad), f"{bad}:7", "malformed")
    assert_user_error(specrt("--engines", tiny_engines, "--prompts", prompts, "--modes", "plain-fp32,warp-drive"),
                      "unknown mode 'warp-drive'", "plain-int4")
    assert_user_error(specrt("--engines", tiny_engines, "--prompts", prompts, "--categories", "poetry"),
                      "unknown category 'poetry'")
    assert_user_error(specrt("--engines", tiny_engines, "--prompts", prompts, "--load-order", "sideways"),
                      "--load-order must be 'listed' or 'reversed'")
    assert_user_error(specrt("--engines", tmp_path / "nope", "--prompts", prompts), "not found", "specrt engines")
    assert_user_error(specrt("--engines", tiny_engines, "--prompts", tmp_path / "missing.jsonl"), "not found")
    assert not (Path.cwd() / "bench-out").exists() or True  # errors happen before anything is written


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
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    cfg = BenchConfig(engines=tiny_engines, prompts=write_prompts(tmp_path / "p.jsonl"), quick=True, reps=1,
                      threads=1, modes="plain-fp32,flaky")
    res = run_bench(cfg, log=lambda m: None)
    assert res["modes"] == ["plain-fp32"] and not any(r["mode"] == "flaky" for r in res["runs"])
    assert any(n.startswith("flaky: dropped") and "device lost" in n for n in res["notes"])


def test_ceiling_replay_of_a_copy_task():
    from specrt.bench.ceiling import accepted_runs, replay_rounds

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
    assert all(o >= lk for o, lk in zip(oracle, lookup)) and sum(oracle) > sum(lookup)   # a bound, and not trivially equal


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
    gen = Generator.load(tiny_engines, "fp32", threads=1)
    from specrt.runtime.tokenizer import Message

    plain = gen.generate([Message(r, c) for r, c in first.messages], max_new_tokens=8).token_ids
    real = runner.load_manifest(Path(tiny_engines))
    cut = next((i for i in range(1, 8) if plain[i] not in plain[:i]), 0)  # a token first emitted at index `cut`
    assert plain[cut] > min(real.eos_token_ids)  # the chat template renders the smallest EOS id: keep it
    fake = dataclasses.replace(real, eos_token_ids=real.eos_token_ids + (plain[cut],))
    monkeypatch.setattr(runner, "load_manifest", lambda path: fake)
    monkeypatch.setattr(runner.contenders, "_GENERATORS", {})  # generators cached by earlier tests hold the real EOS
    cfg = dict(engines=tiny_engines, prompts=prompts, reps=1, threads=1, categories=(first.category,),
               modes="plain-fp32,prompt-lookup-fp32,hf")
    stopped = run_bench(BenchConfig(**cfg), log=lambda m: None)
    assert {r["mode"]: r["new_tokens"] for r in stopped["runs"]} == dict.fromkeys(("plain-fp32", "prompt-lookup-fp32", "hf"), cut)
    full = run_bench(BenchConfig(**cfg, ignore_eos=True), log=lambda m: None)
    assert {r["mode"]: r["new_tokens"] for r in full["runs"]} == {"plain-fp32": 8, "prompt-lookup-fp32": 8, "hf": 8}
    assert full["meta"]["ignore_eos"] is True
    ours = [r["token_ids"] for r in full["runs"] if r["mode"] != "hf"]
    assert ours[0] == ours[1] == plain  # ours decode through EOS: the same tokens as the unstopped run


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
