"""`specrt bench-serve` on the tiny engine set: the load runner's per-request figures against a live uvicorn server
on a loopback port (exact lengths with ignore_eos, TTFT < end-to-end, one ITL per gap, cached tokens on later
turns, overlapping requests at concurrency 2), the summary's arithmetic, the report files, and bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_user_error, loopback

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from specrt.bench import serve_load as sl  # noqa: E402
from specrt.bench.serve_report import markdown, summarize, tpot_s, write  # noqa: E402
from specrt.errors import SpecrtError  # noqa: E402
from specrt.runtime.session import load  # noqa: E402
from specrt.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.slow  # live servers and load runs: left out of the quick tier

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
N = 10  # max_tokens of the prompt-set requests
TEXT = "Speculative decoding drafts tokens and verifies them in one pass. " * 2  # long enough to be kept by the
# server's prefix cache (runtime/generate.py SAVE_MIN_LOST), so a prompt repeated at the next level would hit it
SYSTEM, TURNS = "You are terse.", ("Hello, how are you?", "The quick brown fox.", "def add(a, b):")


def write_prompts(path: Path, n: int = 4) -> Path:
    cats, first = ("chat", "code", "qa", "math"), ("Hello", "Speculative", "import", "def")
    lines = [json.dumps({"id": f"{cats[i % 4]}-{i}", "category": cats[i % 4], "max_new_tokens": 64,
                         "messages": [{"role": "user", "content": f"{first[i % 4]} the quick brown fox {i}. " + TEXT}]})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def live(tiny_engines):
    """Our server (the tiny set, --speculate auto) by uvicorn on a free loopback port in a background thread."""
    with loopback(create_app(load(tiny_engines, "fp32", "auto"))) as (url, _):
        yield url


@pytest.fixture(scope="module")
def measured(live, tiny_engines, tmp_path_factory):
    """One run of every load shape against the live server, and the in-process baseline on the same prompts."""
    prompts = write_prompts(tmp_path_factory.mktemp("p") / "p.jsonl")
    cfg = sl.ServeBenchConfig(engines=tiny_engines, urls=(f"ours={live}",), prompts=prompts, num_prompts=4,
                              concurrency=(1, 2), max_tokens=N, conversations=2, turn_max_tokens=6, threads=1,
                              system_prompt=SYSTEM, turns=TURNS)
    plan = sl.plan(cfg)
    target = plan.targets[0]
    sl.wait_ready(target, 5)
    recs = sl.drive(target, plan.cases, cfg, log=lambda m: None)
    base = sl.in_process(cfg, plan.cases, log=lambda m: None)
    return cfg, plan, target, recs, base


def test_each_request_has_honest_figures(measured):
    cfg, plan, target, recs, _ = measured
    assert target.model == "tiny"   # read from /v1/models and sent with every request
    prompts = [r for r in recs if r["shape"] == "prompts"]
    assert len(prompts) == 2 * 4
    for r in prompts:
        assert r["completion_tokens"] == N and r["tokens_from"] == "usage"   # ignore_eos: exactly max_tokens
        assert r["finish_reason"] == "length"
        assert 0 < r["ttft_s"] < r["e2e_s"]
        assert 1 <= r["chunks"] <= N and len(r["itl_s"]) == r["chunks"] - 1
        assert all(g >= 0 for g in r["itl_s"]) and sum(r["itl_s"]) <= r["e2e_s"] - r["ttft_s"] + 1e-6
        assert r["prompt_tokens"] > 0 and r["cached_tokens"] is not None
        assert tpot_s(r) == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (N - 1))
    for c in (1, 2):  # every prompt once per concurrency
        assert sorted(r["case"] for r in prompts if r["concurrency"] == c) == sorted(x.id for x in plan.cases)
    # each level's prompts are tagged "[C=c] ": the server's prefix cache cannot answer C=2 from C=1's requests
    # (it holds them all), only the template and tag the prompts of a level share
    assert all(r["messages"][0]["content"].startswith(f"[C={r['concurrency']}] ") for r in prompts)
    first_level = max(r["cached_tokens"] for r in prompts if r["concurrency"] == 1)
    assert all(r["cached_tokens"] <= first_level + 2 and r["cached_tokens"] < r["prompt_tokens"] - 5
               for r in prompts)


def test_concurrency_2_keeps_two_requests_in_flight(measured):
    _, _, _, recs, _ = measured
    one = sorted((r for r in recs if r["shape"] == "prompts" and r["concurrency"] == 1), key=lambda r: r["t_start"])
    two = sorted((r for r in recs if r["shape"] == "prompts" and r["concurrency"] == 2), key=lambda r: r["t_start"])
    assert all(b["t_start"] >= a["t_end"] for a, b in zip(one, one[1:]))   # closed loop of one: never overlapping
    assert two[1]["t_start"] < two[0]["t_end"]                              # both sent before the first ended
    assert all(r["t_start"] < 0.05 for r in two[:2])
    # one engine: the second request waits for the first, so its TTFT includes that wait
    assert max(r["ttft_s"] for r in two[:2]) > min(r["e2e_s"] for r in two[:2]) * 0.9


def test_later_turns_report_cached_tokens(measured):
    _, _, _, recs, _ = measured
    turns = [r for r in recs if r["shape"] == "multiturn"]
    assert [(r["conversation"], r["turn"]) for r in turns] == [(k, t) for k in (1, 2) for t in (1, 2, 3)]
    for r in turns:
        assert r["tokens_from"] == "usage" and 1 <= r["completion_tokens"] <= 6
    for k in (1, 2):
        conv = [r for r in turns if r["conversation"] == k]
        # turn 1: the system prompt starts with a new conversation number, so only the template and the word
        # before the number can be in the cache (a handful of tokens; ~20 with the tiny set's near-byte tokenizer)
        assert conv[0]["cached_tokens"] < min(25, conv[0]["prompt_tokens"] // 2)
        for prev, r in zip(conv, conv[1:]):    # the whole earlier turn is in the cache
            assert r["cached_tokens"] >= prev["prompt_tokens"] - 1 > 0
            assert r["prompt_tokens"] > prev["prompt_tokens"]


def test_in_process_baseline_matches_the_server(measured):
    _, plan, _, recs, base = measured
    assert [r["case"] for r in base] == [c.id for c in plan.cases]
    server = {r["case"]: r for r in recs if r["shape"] == "prompts" and r["concurrency"] == 1}
    for r in base:
        assert r["completion_tokens"] == N and 0 < r["ttft_s"] < r["e2e_s"] and len(r["itl_s"]) == r["chunks"] - 1
        assert r["text"] == server[r["case"]]["text"]    # greedy: the same answer over HTTP
        assert r["cached_tokens"] == server[r["case"]]["cached_tokens"]   # the same KV reuse, request by request


def test_summary_arithmetic():
    def rec(server, c, case, t0, ttft, e2e, tokens, gaps, cached=None):
        return {"server": server, "shape": "prompts", "concurrency": c, "case": case, "turn": None, "t_start": t0,
                "t_end": t0 + e2e, "ttft_s": ttft, "e2e_s": e2e, "itl_s": gaps, "chunks": len(gaps) + 1,
                "completion_tokens": tokens, "tokens_from": "usage", "prompt_tokens": 5, "cached_tokens": cached,
                "text": case}

    res = {"meta": {"max_tokens": 11}, "servers": [{"name": "a", "kind": "specrt"}], "records": [
        rec("a", 1, "p", 0.0, 0.1, 1.1, 11, [0.1] * 10, 4), rec("a", 1, "q", 1.1, 0.3, 0.9, 7, [0.1] * 6, 0),
        rec("in-process", 1, "p", 0.0, 0.05, 1.0, 11, [0.1] * 10), rec("in-process", 1, "q", 1.0, 0.25, 0.85, 7,
                                                                         [0.1] * 6)]}
    sm = summarize(res)
    a = next(r for r in sm["prompts"] if r["server"] == "a")
    assert a["tpot_ms"] == pytest.approx(100.0)          # (1.1-0.1)/10 and (0.9-0.3)/6
    assert a["ttft_p50_ms"] == pytest.approx(200.0) and a["itl_p99_ms"] == pytest.approx(100.0)
    assert a["tok_s"] == pytest.approx(18 / 2.0) and a["at_max_tokens"] == 1 and a["cached_tokens_mean"] == 2
    o = sm["overhead"]
    assert o["tok_s_ratio"] == pytest.approx((18 / 2.0) / (18 / 1.85))
    assert o["ttft_diff_ms"] == pytest.approx(50.0) and o["ttft_paired_diff_ms"] == pytest.approx(50.0)
    assert o["identical_texts"] == 2 and not o["goal_tok_s_met"] and not o["goal_ttft_met"]

    # --overhead-reps: two more pairs; the tables keep the first pair's rows, the goals take the medians
    def again(rep, server_e2e, server_ttft):
        out = []
        for r in res["records"][:4]:
            r2 = dict(r, rep=rep)
            if r["server"] == "a":
                r2.update(e2e_s=server_e2e[r["case"]], ttft_s=server_ttft)
            out.append(r2)
        return out

    res["records"] += again(1, {"p": 1.0, "q": 0.85}, 0.05) + again(2, {"p": 1.0, "q": 0.8}, 0.1)
    sm2 = summarize(res)
    assert sm2["prompts"] == sm["prompts"]
    o2 = sm2["overhead"]
    assert [p["tok_s_ratio"] for p in o2["pairs"]] == pytest.approx([1.85 / 2.0, 1.0, 1.85 / 1.8])
    assert o2["tok_s_ratio"] == pytest.approx(1.0) and o2["goal_tok_s_met"]
    # TTFT p50 of the pairs: server 200 / 50 / 100 ms against 150 ms in-process each time
    assert [p["ttft_diff_ms"] for p in o2["pairs"]] == pytest.approx([50.0, -100.0, -50.0])
    assert o2["ttft_diff_ms"] == pytest.approx(-50.0) and o2["goal_ttft_met"]
    assert o2["identical_texts"] == 6 and o2["prompts"] == 6


def test_report_files(measured, tmp_path):
    cfg, _, target, recs, base = measured
    res = {"meta": {"date": "d", "engines": None, "engine_set": "tiny", "gguf": None, "prompts": "p.jsonl",
                    "cases": [c for c in dict.fromkeys(r["case"] for r in base)], "concurrency": [1, 2],
                    "max_tokens": N, "turn_max_tokens": 6, "conversations": 2, "turns": 3, "ignore_eos": True,
                    "min_tokens": False, "speculate": "auto", "precision": "fp32", "threads": 1, "cpu": "x",
                    "cores": 2, "platform": "p", "in_process": True, "versions": {"specrt": "0"}, "bench_s": 1.0},
           "notes": [], "servers": [{"name": "ours", "kind": "specrt", "url": target.url, "model": "tiny",
                                     "command": None}],
           "records": base + recs, "server_logs": {"ours": "INFO: up\n"}}
    write(res, tmp_path / "o", "specrt bench-serve --test")
    saved = json.loads((tmp_path / "o" / "results.json").read_text())
    assert saved["meta"]["command"] == "specrt bench-serve --test" and len(saved["records"]) == len(base + recs)
    assert [(r["server"], r["concurrency"]) for r in saved["summary"]["prompts"]] == [
        ("in-process", 1), ("ours", 1), ("ours", 2)]
    md = (tmp_path / "o" / "report.md").read_text()
    assert md == markdown(saved)
    for words in ("| ours | 2 | 4 |", "## Multi-turn", "| ours | 3 | 2 |", "Server overhead", "identical to the "
                  "in-process ones: 4/4"):
        assert words in md, words
    assert (tmp_path / "o" / "ours.log").read_text() == "INFO: up\n"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert any(n.startswith("plots skipped") for n in saved["notes"])
    else:
        assert (tmp_path / "o" / "latency.png").stat().st_size > 1000
        assert (tmp_path / "o" / "multiturn.png").is_file()


def test_an_http_error_is_one_line_naming_the_server(live, tmp_path):
    cfg = sl.ServeBenchConfig(urls=(live,), prompts=write_prompts(tmp_path / "p.jsonl"), num_prompts=1,
                              concurrency=(1,), max_tokens=100000, conversations=0)
    plan = sl.plan(cfg)
    sl.wait_ready(plan.targets[0], 5)
    with pytest.raises(SpecrtError) as e:
        sl.drive(plan.targets[0], plan.cases, cfg, log=lambda m: None)
    msg = str(e.value)
    assert "\n" not in msg and live in msg and "HTTP 400" in msg and "max_tokens" in msg


def test_parsers():
    assert sl.parse_concurrency("1, 2,4,4") == (1, 2, 4)
    for bad in ("", "1,x", "0", "-2"):
        with pytest.raises(SpecrtError, match="--concurrency"):
            sl.parse_concurrency(bad)
    assert (sl.parse_url("http://127.0.0.1:8000/v1/").url, sl.parse_url("http://127.0.0.1:8000").name) == (
        "http://127.0.0.1:8000", "127.0.0.1:8000")
    t = sl.parse_url("vllm=http://h:1")
    assert (t.name, t.url, t.kind) == ("vllm", "http://h:1", "url")
    with pytest.raises(SpecrtError, match="not http"):
        sl.parse_url("localhost:8000")
    ids = [c.id for c in sl.select_cases(sl.DEFAULT_PROMPTS, 7)]
    assert ids == ["chat-00", "code-00", "summarize-00", "qa-00", "math-00", "translation-00", "chat-01"]
    conv = sl.conversations(2)
    assert [len(t) for _, t in conv] == [5, 5] and conv[0][0] != conv[1][0] and len(conv[0][0]) > 1000


def bench_serve(*args):
    return subprocess.run([sys.executable, "-m", "specrt.cli", "bench-serve", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=300)


def test_cli_bad_input(live, tiny_engines, tmp_path):
    out = tmp_path / "o"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    cases = [
        ((), ["no server to drive", "--engines", "--url"]),
        (("--url", live, "--concurrency", "1,two"), ["--concurrency", "1,2,4,8", "1,two"]),
        (("--url", live, "--concurrency", "0"), ["--concurrency"]),
        (("--url", "localhost:8000"), ["not http", "--url"]),
        (("--url", f"http://127.0.0.1:{closed}", "--health-timeout", "0.5"), ["did not answer", "/health"]),
        (("--llamacpp", "--url", live), ["--llamacpp", "--engines"]),
        (("--engines", tmp_path / "nope"), ["not found"]),
        (("--url", live, "--num-prompts", "0"), ["--num-prompts must be >= 1"]),
        (("--url", live, "--overhead-reps", "0"), ["--overhead-reps must be >= 1"]),
        (("--url", live, "--overhead-reps", "3"), ["--overhead-reps", "needs --engines"]),
        (("--engines", tiny_engines, "--overhead-reps", "2", "--concurrency", "2"), ["1 in --concurrency"]),
        (("--url", live, "--num-prompts", "1", "--concurrency", "1", "--conversations", "0", "--max-tokens",
          "100000"), ["HTTP 400", live]),
    ]
    for args, words in cases:
        assert_user_error(bench_serve(*args, "--out", out), *words)
        assert not out.exists(), args
    (tmp_path / "file").write_text("x")
    assert_user_error(bench_serve("--url", live, "--out", tmp_path / "file"), "is a file")


def test_cli_launches_specrt_serve_and_writes_the_report(tiny_engines, tmp_path):
    """The whole command: the in-process baseline, then `specrt serve` launched as a subprocess and stopped."""
    r = bench_serve("--engines", tiny_engines, "--prompts", write_prompts(tmp_path / "p.jsonl"), "--num-prompts", 3,
                    "--concurrency", "1,2", "--max-tokens", 8, "--conversations", 0, "--threads", 1,
                    "--speculate", "off", "--overhead-reps", 2, "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert "| specrt | 2 | 3 |" in r.stdout and "server / in-process: tok/s" in r.stdout
    assert "(medians of 2 pairs)" in r.stdout
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [s["name"] for s in res["servers"]] == ["specrt"] and "--speculate" in res["servers"][0]["command"]
    assert res["summary"]["overhead"]["identical_texts"] == 6 and len(res["summary"]["overhead"]["pairs"]) == 2
    assert {(r["server"], r["concurrency"], r["rep"]) for r in res["records"]} == {
        ("in-process", 1, 0), ("specrt", 1, 0), ("specrt", 2, 0), ("in-process", 1, 1), ("specrt", 1, 1)}
    # the second pair sent prompts of its own, so the server's prefix cache did not answer them from the first's
    second = [r for r in res["records"] if r["rep"] == 1]
    assert len(second) == 6 and all(r["cached_tokens"] < r["prompt_tokens"] // 2 for r in second)
    assert "| pair |" in (tmp_path / "o" / "report.md").read_text()
    assert all(r["completion_tokens"] == 8 for r in res["records"])
    assert (tmp_path / "o" / "specrt.log").is_file() and (tmp_path / "o" / "report.md").is_file()
    with socket.socket() as s:   # the launched server is gone
        s.settimeout(1)
        port = int(res["servers"][0]["url"].rsplit(":", 1)[1])
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_llamacpp_needs_a_gguf_and_its_server_package(tiny_engines, monkeypatch, tmp_path):
    cfg = sl.ServeBenchConfig(engines=tiny_engines, llamacpp=True, prompts=write_prompts(tmp_path / "p.jsonl"))
    with pytest.raises(SpecrtError, match="needs a GGUF checkpoint"):   # the tiny set was built from a HF folder
        sl.plan(cfg)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sse_starlette" else
                        real(name, *a))
    with pytest.raises(SpecrtError) as e:
        sl.check_llamacpp_server()
    assert "pip install 'llama-cpp-python[server]==0.3.36'" in str(e.value) and "\n" not in str(e.value)


def test_a_terminated_bench_stops_the_servers_it_launched(tmp_path):
    """SIGTERM to the bench (a CI timeout, `kill`) still stops the server it launched: the port goes quiet."""
    import signal
    import time

    from specrt.bench.serve_procs import free_port

    port = free_port()
    server = ("import http.server as h\n"
              "class H(h.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers()\n"
              f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    bench = ("import sys, time\nfrom pathlib import Path\n"
             "from specrt.bench.serve_load import Target\nfrom specrt.bench.serve_procs import launched\n"
             f"t = Target('fake', 'http://127.0.0.1:{port}', log=Path({str(tmp_path / 'log')!r}))\n"
             f"with launched(t, [sys.executable, '-c', {server!r}], 30):\n"
             "    print('ready', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", bench], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the launched server still answers on port {port} after the bench was terminated")
