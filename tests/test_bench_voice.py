"""bench-serve's voice workload (bench/voice.py, bench/voice_report.py) and the llama-server peer's helper
(bench/llama_server.py): the workload file's checks, time to first sentence on fake streams, a whole run on the tiny
engine set (calls alternated between two launched `specrt serve`, KV reuse on later turns, every fp32 turn identical
to plain decoding, a llama-server that cannot start skipped with one line), the report, and the bad-file exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_user_error

pytest.importorskip("httpx")

from specrt.bench import llama_server as ls  # noqa: E402
from specrt.bench import voice  # noqa: E402
from specrt.bench.peers import Unavailable  # noqa: E402
from specrt.bench.serve_load import ServeBenchConfig  # noqa: E402
from specrt.bench.voice_report import markdown, summarize, table, write  # noqa: E402
from specrt.errors import SpecrtError  # noqa: E402

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
GOOD = {"name": "tiny clinic", "system": "You answer the phone. Open 9 to 5. A visit is 40 dollars.",
        "max_tokens": 8, "calls": [["Hi.", "Hours?", "Price?", "Bye."], ["Hello.", "Open Sunday?", "Cost?", "Thanks."]]}


def write_workload(path: Path, obj) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_shipped_workload_loads():
    wl = voice.load_workload(voice.DEFAULT_WORKLOAD)
    assert len(wl.calls) >= 4 and all(len(c) >= voice.MIN_TURNS for c in wl.calls)
    assert "dollars" in wl.system and wl.max_tokens == 64


@pytest.mark.parametrize("bad, words", [
    ("not json", ["not JSON"]),
    ([1, 2], ["not a JSON object"]),
    ({**GOOD, "turns": []}, ["unknown key", "turns"]),
    ({**GOOD, "system": ""}, ["'system'"]),
    ({**GOOD, "calls": []}, ["'calls'"]),
    ({**GOOD, "calls": [["a", "b", "c"]]}, ["call 1", "at least 4"]),
    ({**GOOD, "calls": [["a", "b", "c", 4]]}, ["call 1"]),
    ({**GOOD, "max_tokens": 1}, ["max_tokens"]),
])
def test_bad_workload_is_one_line(tmp_path, bad, words):
    with pytest.raises(SpecrtError) as e:
        voice.load_workload(write_workload(tmp_path / "w.json", bad))
    msg = str(e.value)
    assert "\n" not in msg and all(w.lower() in msg.lower() for w in words), msg


def test_bad_workload_exits_2(tmp_path):
    bad = write_workload(tmp_path / "w.json", {**GOOD, "calls": [["only one turn"]]})
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "bench-serve", "--voice-workload", str(bad),
                        "--engines", str(tmp_path / "none"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=ENV)
    assert_user_error(r, "call 1", "at least 4")
    assert not (tmp_path / "out").exists()


def test_voice_options_without_voice_are_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "bench-serve", "--url", "http://127.0.0.1:9",
                        "--llama-server", "--out", str(tmp_path / "out")], capture_output=True, text=True, env=ENV)
    assert_user_error(r, "--llama-server", "add --voice")


@pytest.mark.parametrize("pieces, end, want", [
    ([(0.1, "Hello"), (0.2, " there."), (0.3, " How"), (0.4, " are you?")], 0.5, (0.3, True)),
    ([(0.1, "Hi!"), (0.2, "\n"), (0.3, "Next.")], 0.4, (0.2, True)),      # a newline ends it too
    ([(0.1, "It costs $3.50 now"), (0.2, " ok")], 0.3, (0.3, False)),     # a decimal point is no sentence end
    ([(0.1, "Open 9 to 5"), (0.2, ".")], 0.25, (0.25, True)),            # the mark ends the text: the stream's end
    ([(0.1, "Wait... "), (0.2, "yes.")], 0.3, (0.1, True)),              # the first mark with a space after it
    ([], 0.05, (0.05, False)),
])
def test_first_sentence_on_fake_streams(pieces, end, want):
    assert voice.first_sentence_s(pieces, end) == want


def test_turn_figures():
    rec = {"ttft_s": 0.1, "e2e_s": 0.5, "completion_tokens": 9, "pieces": [(0.1, "Yes. "), (0.2, "We")],
           "text": "Yes. We"}
    out = voice.turn_figures(rec)
    assert out["ttfs_s"] == 0.1 and out["sentence_end"] and out["decode_tok_s"] == pytest.approx(8 / 0.4)
    assert out["first_sentence_chars"] == 4
    assert "pieces" not in out


def test_parse_ours():
    assert voice.parse_ours("fp32:auto, int4:auto,fp32:auto") == [("fp32", "auto"), ("int4", "auto")]
    with pytest.raises(SpecrtError, match="PRECISION:SPECULATE"):
        voice.parse_ours("fp32")


def test_cpu_options_turn_on_what_the_cpu_reports_and_never_amx():
    opts = ls.cpu_options("processor : 0\nflags : fpu avx avx2 fma f16c bmi2 avx512f amx_tile amx_int8\n")
    assert "-DGGML_AVX512=ON" in opts and "-DGGML_AVX2=ON" in opts and "-DGGML_AVX512_VNNI=OFF" in opts
    assert not any("AMX" in o for o in opts)
    assert "-DGGML_NATIVE=OFF" in ls.FIXED_OPTIONS and "-DGGML_AMX_TILE=OFF" in ls.FIXED_OPTIONS


def test_llama_server_command_and_modes(tmp_path):
    exe, gguf, draft = tmp_path / "llama-server", tmp_path / "m.gguf", tmp_path / "d.gguf"
    plain = ls.command(exe, gguf, 8081, 2)
    assert plain[plain.index("--host") + 1] == "127.0.0.1" and "--spec-type" not in plain
    mode = next(m for m in ls.SPEC_MODES if m.needs_draft)
    spec = ls.command(exe, gguf, 8081, 2, mode, draft)
    assert spec[spec.index("-md") + 1] == str(draft) and spec[spec.index("--spec-type") + 1] == "draft-simple"
    assert all(not m.needs_draft for m in ls.modes_for(None)) and mode in ls.modes_for(draft)
    assert [m.name for m in ls.modes_for(None, ("ngram-mod",))] == ["ngram-mod"]
    ls.check_modes(("ngram-mod", "draft-simple"), draft)
    with pytest.raises(SpecrtError, match="draft-simple needs --llama-draft"):
        ls.check_modes(("draft-simple",), None)


def test_ensure_built_reuses_the_cache_and_names_what_is_missing(tmp_path, monkeypatch):
    exe = ls.binary(tmp_path)
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    assert ls.ensure_built(tmp_path, log=lambda m: pytest.fail("no build expected")) == exe
    monkeypatch.setattr(ls.shutil, "which", lambda name: None)
    with pytest.raises(Unavailable, match="cmake is not installed"):
        ls.ensure_built(tmp_path / "empty")


@pytest.fixture(scope="module")
def voice_run(tiny_engines, tmp_path_factory):
    """The whole voice run on the tiny set: our fp32 and int4 servers, and a llama-server whose binary exits at once
    (a peer that fails to start)."""
    tmp = tmp_path_factory.mktemp("voice")
    fake = tmp / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: unknown model format' >&2\nexit 1\n")
    fake.chmod(0o755)
    gguf = write_workload(tmp / "m.gguf", "not a model")
    cfg = ServeBenchConfig(engines=tiny_engines, threads=1, voice=write_workload(tmp / "w.json", GOOD),
                           voice_calls=2, ours=(("fp32", "auto"), ("int4", "auto")), llama_server=True,
                           llama_gguf=gguf, start_timeout_s=60)
    mp = pytest.MonkeyPatch()
    mp.setattr(ls, "ensure_built", lambda log=print: fake)
    lines = []
    try:
        res = voice.run_bench(cfg, log=lines.append)
    finally:
        mp.undo()
    return res, lines, tmp


@pytest.mark.slow
def test_voice_run_on_the_tiny_set(voice_run):
    res, lines, _ = voice_run
    names = [s["name"] for s in res["servers"]]
    assert names == ["specrt-fp32-auto", "specrt-int4-auto"]
    recs = res["records"]
    assert len(recs) == 2 * 4 * 2 and {r["turn"] for r in recs} == {1, 2, 3, 4}
    # the calls alternate: call 1 goes to fp32 first, call 2 to int4 first
    assert [r["server"] for r in recs if r["turn"] == 1] == names + names[::-1]
    for r in recs:
        assert r["ttft_s"] <= r["ttfs_s"] <= r["e2e_s"]
        assert r["completion_tokens"] < 2 or r["decode_tok_s"] > 0
    assert all(r["cached_tokens"] > 0 for r in recs if r["turn"] > 1)   # later turns reuse the KV cache
    fp32 = res["plain_check"]["specrt-fp32-auto"]
    assert fp32 == {"identical": 8, "turns": 8, "precision": "fp32"}
    assert all(r["identical_to_plain"] for r in recs if r["server"] == "specrt-fp32-auto")
    assert set(res["drafting"]) == set(names)   # /metrics read before and after the calls
    assert all(0 <= d["accepted"] <= d["draft_tokens"] for d in res["drafting"].values())
    for d in res["drafting"].values():  # auto's drafting rounds per drafter, from /metrics, add up
        assert sum(v for k, v in d.items() if k.startswith("by:")) == d["rounds_drafted"], d
    skipped = [n for n in res["notes"] if n.startswith("skipped:")]
    assert len(skipped) == 1 and "llama-server did not start" in skipped[0] and "unknown model format" in skipped[0]
    assert "\n" not in skipped[0]
    assert sum(r["completion_tokens"] for r in recs if r["server"] == "specrt-int4-auto") == \
        res["drafting"]["specrt-int4-auto"]["tokens"]


@pytest.mark.slow
def test_voice_report_files(voice_run):
    res, _, tmp = voice_run
    res = json.loads(json.dumps({**res, "server_logs": {}}))
    write(res, tmp / "out", "specrt bench-serve --voice")
    text = (tmp / "out" / "report.md").read_text()
    assert "## Drafting over the measured calls" in text and "## Voice turns" in text
    assert "specrt-int4-auto" in text and "8/8" in text
    assert (tmp / "out" / "voice.png").stat().st_size > 1000
    back = json.loads((tmp / "out" / "results.json").read_text())
    assert back["summary"]["servers"][0]["ttfs_s_later"]["n"] == 6


def fake_results() -> dict:
    """Two servers, two calls of 3 turns, figures chosen so the medians and ratios are known."""
    recs = []
    for server, ttfs, tok_s in (("ours", 0.2, 150.0), ("peer", 0.4, 100.0)):
        for call in (1, 2):
            for turn in (1, 2, 3):
                slow = 2.0 if turn == 1 else 1.0
                recs.append({"server": server, "call": call, "turn": turn, "ttft_s": 0.05 * slow,
                             "ttfs_s": ttfs * slow + 0.01 * call, "decode_tok_s": tok_s, "e2e_s": 1.0,
                             "completion_tokens": 20, "cached_tokens": 30 if turn > 1 else 0, "sentence_end": True})
    meta = {"engine_set": "x", "command": "c", "date": "d", "cpu": "cpu", "cores": 2, "threads": 2, "bench_s": 1,
            "versions": {"specrt": "0"}, "workload": "w", "workload_file": "w.json", "calls": 2,
            "turns_per_call": [3], "max_tokens": 20}
    return {"meta": meta, "notes": [], "plain_check": {"ours": {"identical": 6, "turns": 6, "precision": "fp32"}},
            "records": recs, "servers": [{"name": "ours", "kind": "specrt", "command": ["py", "-m", "x", "serve"]},
                                         {"name": "peer", "kind": "llama-server", "command": ["/b/llama-server"]}]}


def test_summary_arithmetic_and_goals():
    res = fake_results()
    res["summary"] = sm = summarize(res)
    ours = sm["servers"][0]
    assert ours["ttfs_s_later"]["median"] == pytest.approx(215.0) and ours["ttfs_s_later"]["n"] == 4
    assert ours["ttfs_s_turn1"]["median"] == pytest.approx(415.0) and ours["cached_later"] == 30
    v = sm["versus"][0]
    assert v["peer"] == "peer" and v["ttfs_later"] == pytest.approx(215 / 415)
    assert v["decode_later"] == pytest.approx(1.5) and v["ttfs_turn1"] == pytest.approx(415 / 815)
    assert v["goals_met"]
    text = markdown(res)
    assert "6/6" in text and "goals **met**" in text and "`llama-server `" in text
    assert len(table(res)) == 4


@pytest.mark.slow
def test_voice_command(tiny_engines, tmp_path):
    """The command end to end: one call on one launched server, the table printed, the files written."""
    wl = write_workload(tmp_path / "w.json", GOOD)
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "bench-serve", "--voice-workload", str(wl), "--engines",
                        str(tiny_engines), "--calls", "1", "--ours", "fp32:prompt-lookup", "--threads", "1", "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| specrt-fp32-prompt-lookup | 4 |" in r.stdout and "4/4" in r.stdout
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"report.md", "results.json", "voice.png"}


@pytest.mark.parametrize("batches, extra, want", [(True, [], 4), (True, ["--parallel", "1"], 1), (False, [], 1)])
def test_serve_parallel_default(tiny_engines, monkeypatch, batches, extra, want):
    """`specrt serve` without --parallel runs 4 streams at once where the set's backend batches, else 1."""
    import dataclasses

    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from specrt.cli import app

    from specrt.backends import BACKENDS

    monkeypatch.setitem(BACKENDS, "onnxruntime", dataclasses.replace(BACKENDS["onnxruntime"], batch=batches))
    seen = {}

    def serve_until_loaded(self, *args, **kwargs):  # instead of listening: the app's startup, until the load ends
        import time

        server = self.config.app.state.server
        with TestClient(self.config.app):
            t = time.time()
            while server.session is None and server.load_error is None and time.time() - t < 60:
                time.sleep(0.02)
        seen["parallel"] = server.session.parallel if server.session else server.load_error

    monkeypatch.setattr(uvicorn.Server, "run", serve_until_loaded)
    r = CliRunner().invoke(app, ["serve", "--engines", str(tiny_engines), "--threads", "1", "--speculate", "off",
                                 *extra])
    assert r.exit_code == 0, r.output
    assert seen["parallel"] == want
