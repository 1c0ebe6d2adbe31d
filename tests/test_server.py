"""`specrt serve` on the tiny engine set: OpenAI's shapes, streaming, errors, auth, cancellation, and the official
`openai` client against uvicorn on a loopback port. Greedy answers must equal `load(...).generate(...)`'s."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers import loopback

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from specrt.runtime.sampling import SamplingParams  # noqa: E402
from specrt.runtime.session import load  # noqa: E402
from specrt.runtime.tokenizer import Message  # noqa: E402
from specrt.server.app import create_app  # noqa: E402

PROMPT, N = "Tell me a story about a robot.", 24
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def session(tiny_engines):
    return load(tiny_engines, "fp32", "auto")


@pytest.fixture(scope="module")
def reference(tiny_engines):
    """What a fresh run returns: its own session, plain decoding."""
    ref = load(tiny_engines)
    return {"chat": ref.generate([Message("user", PROMPT)], max_new_tokens=N, sampling=GREEDY).text,
            "raw": ref.generate(PROMPT, max_new_tokens=N, sampling=GREEDY, chat=False).text}


@pytest.fixture(scope="module")
def client(session):
    with TestClient(create_app(session), raise_server_exceptions=False) as c:
        yield c


def chat_body(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": N, "temperature": 0,
            **kw}


def sse(text: str) -> list:
    """The data payloads of an SSE body; the [DONE] sentinel as the string."""
    events = [b[len("data: "):] for b in text.split("\n\n") if b]
    assert all(not e.startswith("data") for e in events)
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_health_and_models(client, session):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [session.manifest.name] == ["tiny"]
    assert client.get("/v1/models/tiny").json()["object"] == "model"
    assert client.get("/v1/models/other").status_code == 404


def test_streamed_chat_chunks(client, reference):
    r = client.post("/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["choices"][0]["delta"]["content"]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == reference["chat"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == N
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + N
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    m = usage["metrics"]
    assert m["proposer"] == "lookup/suffix" and m["exact"] is True and m["tau"] >= 1 and m["ttft_s"] > 0
    assert len({c["id"] for c in chunks + [usage]}) == 1


def test_streamed_completion_without_usage(client, reference):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "temperature": 0, "stream": True})
    events = sse(r.text)
    assert events[-1] == "[DONE]" and all("usage" not in c for c in events[:-1])
    assert all(c["object"] == "text_completion" for c in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == reference["raw"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_non_streamed(client, reference):
    r = client.post("/v1/chat/completions", json=chat_body()).json()
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["message"]["content"] == reference["chat"]
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == N
    r = client.post("/v1/completions", json={"prompt": [PROMPT], "max_tokens": N, "temperature": 0}).json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == reference["raw"]


def test_stop_string_finishes_with_stop(client, reference):
    stop = reference["chat"][len(reference["chat"]) // 2:][:3]
    if not stop.strip():
        pytest.skip("the tiny model's answer has no usable stop string")
    r = client.post("/v1/chat/completions", json=chat_body(stop=stop)).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == reference["chat"][:reference["chat"].find(stop)]


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "tiny"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
    (chat_body(model="gpt-4"), 404, "model"),
    (chat_body(model=3), 400, "model"),
    (chat_body(max_tokens=0), 400, "max_tokens"),
    (chat_body(max_tokens=10**9), 400, "max_tokens"),
    (chat_body(max_tokens="12"), 400, "max_tokens"),
    (chat_body(max_completion_tokens=-1), 400, "max_completion_tokens"),
    (chat_body(temperature="hot"), 400, "temperature"),
    (chat_body(temperature=5), 400, "temperature"),
    (chat_body(top_p=0), 400, "top_p"),
    (chat_body(seed=-1), 400, "seed"),
    (chat_body(n=2), 400, "n"),
    (chat_body(stop=["a", 3]), 400, "stop"),
    (chat_body(stop=""), 400, "stop"),
    (chat_body(stream="yes"), 400, "stream"),
    (chat_body(stream_options={"include_usage": True}), 400, "stream_options"),
    (chat_body(logprobs=True), 400, "logprobs"),
    (chat_body(messages=[{"role": "user", "content": "word " * 400}]), 400, "messages"),
    ({"prompt": 7}, 400, "prompt"),
]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions"])
def test_bad_requests_answer_openai_errors_and_the_server_keeps_serving(client, reference, endpoint):
    for body, status, param in BAD:
        path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else endpoint
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = client.post(path, **kw)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], body
        assert err["param"] == param and "\n" not in err["message"], (body, err)
    assert client.post(endpoint, json=chat_body(messages=[{"role": "user", "content": "word " * 400}])).json()[
        "error"]["code"] == "context_length_exceeded"
    assert client.get("/v1/nothing").status_code == 404 and "error" in client.get("/v1/nothing").json()
    assert client.get("/v1/chat/completions").status_code == 405
    r = client.post(endpoint, json=chat_body())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference["chat"]


def test_metrics(client):
    pytest.importorskip("prometheus_client")
    client.post("/v1/chat/completions", json=chat_body())
    text = client.get("/metrics").text
    assert "specrt_time_to_first_token_seconds_count" in text
    assert 'specrt_requests_total{finish_reason="length"}' in text


def test_api_key(session):
    with TestClient(create_app(session, api_key="sekret")) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200


class Slow:
    """A decoder that sleeps between rounds, so a stream is still running when its client goes away."""

    def __init__(self, inner, delay: float = 0.02):
        self.inner, self.delay = inner, delay
        self.name, self.proposer, self.control = inner.name, inner.proposer, inner.control

    def __call__(self, *args):
        rounds = self.inner(*args)
        try:
            for r in rounds:
                time.sleep(self.delay)
                yield r
        finally:
            rounds.close()


@pytest.fixture(scope="module")
def live(session):
    """uvicorn on a free loopback port in a background thread."""
    app = create_app(session, api_key="k")
    with loopback(app) as (url, _):
        yield url, app.state.server


def test_openai_client(live, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live[0] + "/v1", api_key="k", timeout=30, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "user", "content": PROMPT}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]
    assert chunks[-1].usage.completion_tokens == N and chunks[-1].model_extra["metrics"]["exact"] is True
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=N, temperature=0)
    assert r.choices[0].message.content == reference["chat"] and r.usage.completion_tokens == N
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == reference["raw"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live[0] + "/v1", api_key="bad", max_retries=0).models.list()


def serves_as_before(url: str, reference) -> None:
    """A normal request to the live server answers what a fresh run does."""
    import httpx

    with httpx.Client(timeout=30, headers={"Authorization": "Bearer k"}) as http:
        r = http.post(url + "/v1/chat/completions", json=chat_body()).json()
    assert r["choices"][0]["message"]["content"] == reference["chat"]


def hang_up(http, url: str, server, body: dict, chunks: int):
    """Stream a request, read `chunks` data lines, disconnect; wait until the server has finished it -> its Stats."""
    before = server.history[-1] if server.history else None
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == chunks:
                break
    deadline = time.monotonic() + 10
    while not server.history or server.history[-1] is before or server.pending:
        assert time.monotonic() < deadline, "the cancelled stream did not finish"
        time.sleep(0.005)
    return server.history[-1]


def test_disconnect_cancels_the_stream_and_frees_the_engine(live, session, reference):
    import httpx

    url, server = live
    body = chat_body(max_tokens=200, ignore_eos=True, stream=True)
    session.decoder, inner = Slow(session.decoder), session.decoder
    try:
        with httpx.Client(timeout=10, headers={"Authorization": "Bearer k"}) as http:
            st = hang_up(http, url, server, body, 3)
        assert st.finish_reason == "cancelled" and 3 <= st.new_tokens < 100
    finally:
        session.decoder = inner
    serves_as_before(url, reference)


def test_a_full_queue_answers_503_with_retry_after_then_serves_again(session, reference):
    with TestClient(create_app(session, max_queue=2), raise_server_exceptions=False) as c:
        server = c.app.state.server
        server.pending = 2  # two requests waiting or running
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded" and "--max-queue 2" in r.json()["error"]["message"]
        server.pending = 0
        ok = c.post("/v1/chat/completions", json=chat_body())
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == reference["chat"]
        streamed = c.post("/v1/chat/completions", json=chat_body(stream=True))
        assert streamed.status_code == 200 and server.pending == 0 and not server.open_streams


def test_pings_while_waiting_for_the_first_token_and_spec_counters(tiny_engines, reference):
    spec = load(tiny_engines, "fp32", "prompt-lookup")
    with TestClient(create_app(spec, ping_s=0.02), raise_server_exceptions=False) as c:
        gate = threading.Event()  # the engine is busy with something else for 0.3 s: the request waits in the queue
        c.app.state.server.worker.submit(gate.wait)
        threading.Timer(0.3, gate.set).start()
        r = c.post("/v1/chat/completions", json=chat_body(stream=True))
        assert r.text.startswith(": ping\n\n: ping\n\n")
        payloads = sse("\n\n".join(b for b in r.text.split("\n\n") if b and not b.startswith(":")))
        text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads[:-1] if p["choices"])
        assert text == reference["chat"]
        metrics = c.get("/metrics").text
        for name in ("specrt:spec_decode_num_drafts_total", "specrt:spec_decode_num_draft_tokens_total",
                     "specrt:spec_decode_num_accepted_tokens_total", "specrt_request_queue_time_seconds_count 1.0",
                     "specrt_inter_token_latency_seconds_count"):
            assert name in metrics, name
        drafts = [ln for ln in metrics.splitlines() if ln.startswith("specrt:spec_decode_num_draft_tokens_total")]
        assert float(drafts[0].split()[-1]) > 0


def test_the_next_turn_reports_cached_prompt_tokens(session):
    with TestClient(create_app(session), raise_server_exceptions=False) as c:
        first = c.post("/v1/chat/completions", json=chat_body()).json()
        answer = first["choices"][0]["message"]["content"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
        turn2 = chat_body(messages=[{"role": "user", "content": PROMPT}, {"role": "assistant", "content": answer},
                                    {"role": "user", "content": "Shorter, please."}])
        second = c.post("/v1/chat/completions", json=turn2).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < second["usage"]["prompt_tokens"]


def _two_conversations(c, turns: int = 3) -> list[tuple[int, int]]:
    """Conversations a and b take turns on one server; (prompt tokens of the turn before, cached tokens) of each
    turn after the first."""
    talks = {"a": [{"role": "user", "content": PROMPT}], "b": [{"role": "user", "content": "Write a poem on gears."}]}
    last, seen = {}, []
    for turn in range(turns):
        for name, history in talks.items():
            r = c.post("/v1/chat/completions", json=chat_body(messages=history)).json()
            usage = r["usage"]
            if turn:
                seen.append((last[name], usage["prompt_tokens_details"]["cached_tokens"]))
            last[name] = usage["prompt_tokens"]
            history += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"More, part {turn}."}]
    return seen


def test_conversations_taking_turns_each_find_their_own_cache(tiny_engines):
    """--cache-ram keeps the other conversation's cache on the host: each turn reuses all of its own last prompt;
    with --cache-ram 0 only the sequence in the engine is reused, so a turn after the other conversation's finds
    only the shared chat-template prefix. Prometheus shows the kept sequence and the cache hits."""
    with TestClient(create_app(load(tiny_engines)), raise_server_exceptions=False) as c:
        seen = _two_conversations(c)
        assert seen and all(cached >= before for before, cached in seen)
        metrics = c.get("/metrics").text
        assert "specrt_prefix_cache_kept_sequences 1.0" in metrics
        hits = [ln for ln in metrics.splitlines() if ln.startswith("specrt:prefix_cache_hits_total")]
        assert float(hits[0].split()[-1]) >= sum(cached for _, cached in seen)
    with TestClient(create_app(load(tiny_engines), cache_ram_mib=0), raise_server_exceptions=False) as c:
        assert all(cached < 10 for _, cached in _two_conversations(c))


def test_health_answers_503_while_the_engines_load_then_200(tiny_engines, reference):
    gate = threading.Event()

    def loader():
        gate.wait(10)
        return load(tiny_engines)

    with TestClient(create_app(loader=loader, model="tiny"), raise_server_exceptions=False) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "model_loading"
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
        gate.set()
        deadline = time.monotonic() + 20
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engines did not load"
            time.sleep(0.02)
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.json()["choices"][0]["message"]["content"] == reference["chat"]


def test_a_failed_load_reports_one_line_and_stops_the_server():
    from specrt.errors import SpecrtError

    stopped = threading.Event()

    def loader():
        raise SpecrtError("no engine set at 'nowhere'; build one with `specrt engines`")

    app = create_app(loader=loader, model="tiny")
    app.state.server.on_load_error = stopped.set
    with TestClient(app, raise_server_exceptions=False) as c:
        assert stopped.wait(10)
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "error"}
        assert "no engine set" in str(app.state.server.load_error)


def _live_objects(kind) -> int:
    import gc

    gc.collect()
    return sum(isinstance(o, kind) for o in gc.get_objects())


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


@pytest.mark.slow
def test_a_hundred_disconnects_leak_nothing_and_each_stops_within_a_round(live, session, reference):
    """100 clients go away mid-stream: each generation stops at the next round boundary (cancel_s, from close()
    to the loop's end, far below the 200-token run it would have been), no Stream, queue or byte stays behind, and
    the next request's output equals a fresh run's."""
    import asyncio

    import httpx

    from specrt.runtime.generate import Stream

    if not Path("/proc/self/status").exists():
        pytest.skip("reads /proc/self/status (Linux)")
    url, server = live
    body = chat_body(max_tokens=200, ignore_eos=True, stream=True)
    session.decoder, inner = Slow(session.decoder, delay=0.01), session.decoder

    try:
        with httpx.Client(timeout=10, headers={"Authorization": "Bearer k"}) as http:
            for _ in range(10):  # warm-up: allocators and caches reach their steady size
                hang_up(http, url, server, body, 2)
            streams, queues, rss = _live_objects(Stream), _live_objects(asyncio.Queue), _rss_bytes()
            for _ in range(100):
                hang_up(http, url, server, body, 2)
            cancelled = [st for st in list(server.history)[-64:]]
            assert all(st.finish_reason == "cancelled" and st.new_tokens < 100 for st in cancelled)
            assert all(0 < st.cancel_s < 1.0 for st in cancelled)
            assert _live_objects(Stream) <= streams and _live_objects(asyncio.Queue) <= queues
            assert _rss_bytes() - rss < 32 << 20
            assert server.pending == 0 and not server.open_streams
    finally:
        session.decoder = inner
    serves_as_before(url, reference)


def test_a_client_that_never_reads_does_not_hold_the_engine(live, reference):
    """A streamed request whose client sends and then never reads: its generation runs to the end into its own
    queue (the worker never waits on a socket), and the next client is served as usual."""

    url, server = live
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(chat_body(max_tokens=64, ignore_eos=True, stream=True)).encode()
    before = server.history[-1] if server.history else None
    with socket.create_connection((host, int(port))) as idle:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        idle.sendall(head + body)
        deadline = time.monotonic() + 20
        while not server.history or server.history[-1] is before or server.pending:
            assert time.monotonic() < deadline, "the unread stream held the engine"
            time.sleep(0.01)
        assert server.history[-1].new_tokens == 64 and server.history[-1].finish_reason == "length"
        serves_as_before(url, reference)
