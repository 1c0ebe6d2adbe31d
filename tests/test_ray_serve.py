"""`specrt serve-ray`: the conversation key and its rendezvous choice, the resource plan, the command's one-line
errors (Ray missing, bad values), and on a local Ray instance 2 engine replicas behind Serve's HTTP proxy on
loopback: a conversation's turns on one replica (reusing its KV cache), conversations spread over both, a client's
disconnect reaching the replica, and a replica killed mid-stream (its stream ends cleanly, a request waiting on it
and new requests go to the live one, the other replica's stream runs on)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import assert_user_error

from specrt.errors import SpecrtError
from specrt.server.ray_serve import INSTALL_HINT, REPLICA_HEADER, Placement, SpecrtEngine, plan, rendezvous
from specrt.server.scopes import PROMPT_PREFIX_CHARS, conversation_key

pytestmark = pytest.mark.slow  # Ray Serve clusters in subprocesses: left out of the quick tier

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


# --- the routing key and the choice (no Ray) ---

def test_turns_of_a_conversation_share_a_key():
    turn1 = [SYSTEM, {"role": "user", "content": "Tell me a story about a robot."}]
    turn2 = turn1 + [{"role": "assistant", "content": "Once a robot..."}, {"role": "user", "content": "More."}]
    k1, k2 = conversation_key(CHAT, body(messages=turn1)), conversation_key(CHAT, body(messages=turn2, stream=True))
    assert k1 == k2 and k1 is not None
    other = [SYSTEM, {"role": "user", "content": "Tell me a story about a cat."}]
    assert conversation_key(CHAT, body(messages=other)) != k1
    assert conversation_key(CHAT, body(messages=[{"role": "system", "content": "Be verbose."}] + turn1[1:])) != k1
    # /v1/completions: the prompt's first characters; a continuation of a long enough prompt keeps them
    prompt = "x" * PROMPT_PREFIX_CHARS + " and then"
    assert conversation_key("/v1/completions", body(prompt=prompt)) == \
        conversation_key("/v1/completions", body(prompt=[prompt + " some more"]))
    # the client's own key wins; no key for what is not a generation or not JSON
    assert conversation_key(CHAT, body(messages=turn1), "abc") == conversation_key(CHAT, body(messages=other), "abc")
    assert conversation_key("/v1/models", b"") is None
    assert conversation_key(CHAT, b"{not json") is None and conversation_key(CHAT, body(messages=[])) is None


def test_rendezvous_moves_only_a_dead_replicas_keys():
    keys = [f"k{i}" for i in range(400)]
    three = {k: rendezvous(k, ["a", "b", "c"]) for k in keys}
    assert three == {k: rendezvous(k, ["c", "a", "b"]) for k in keys}  # order does not matter
    assert {"a", "b", "c"} == set(three.values())
    two = {k: rendezvous(k, ["a", "c"]) for k in keys}
    assert all(two[k] == three[k] for k in keys if three[k] != "b")  # only b's keys moved
    assert all(two[k] in ("a", "c") for k in keys)


def test_plan_by_resources():
    assert plan(2, 1, 0, {"CPU": 2}) == Placement(2, 1, 0, 1)
    assert plan(None, 4, 0, {"CPU": 16}) == Placement(4, 4, 0, 4)          # one per 4 cores
    assert plan(2, 0, 0, {"CPU": 16}) == Placement(2, 8, 0, 8)             # the cores shared evenly
    assert plan(None, 0, 1, {"CPU": 16, "GPU": 4}) == Placement(4, 1, 1, 0)  # one per GPU
    for args, words in [((0, 0, 0), "--replicas must be >= 1"), ((3, 1, 0), "need 3 CPUs"),
                        ((4, 0, 0), "fewer than one a replica"), ((None, 0, 1), "GPUs"),
                        ((None, -1, 0), "--cores-per-replica")]:
        with pytest.raises(SpecrtError, match=words):
            plan(*args, {"CPU": 2})


def test_serve_ray_without_ray_names_the_install(tiny_engines):
    code = ("import sys; sys.modules['ray'] = None\nfrom specrt.cli import app\n"
            f"app(['serve-ray', '--engines', {str(tiny_engines)!r}, '--replicas', '2'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert_user_error(r)
    assert r.stderr.strip() == f"error: {INSTALL_HINT}"


def test_serve_ray_bad_values(tiny_engines):
    for flags, words in [(["--replicas", "0"], "--replicas must be >= 1"), (["--port", "0"], "--port"),
                         (["--cores-per-replica", "-2"], "--cores-per-replica"), (["--max-queue", "0"], "--max-queue"),
                         (["--default-max-tokens", "-1"], "--default-max-tokens")]:
        r = subprocess.run([sys.executable, "-m", "specrt.cli", "serve-ray", "--engines", str(tiny_engines), *flags],
                           capture_output=True, text=True, env=ENV, timeout=120)
        assert_user_error(r, words)


# --- on a local Ray instance ---

DEFAULT_MAX = 9  # the replicas' --default-max-tokens
PACE_S = 0.05  # seconds between a stream's chunks, so a replica can be killed while one is open


class PacedEngine(SpecrtEngine):
    """Streams paced by PACE_S a chunk; a request with `x-test-hold: S` waits S seconds on the replica first."""

    async def forward(self, method, path, query, headers, *args, **kwargs):
        hold = dict(headers).get(b"x-test-hold")
        if hold:
            await asyncio.sleep(float(hold))
        gen = super().forward(method, path, query, headers, *args, **kwargs)
        try:
            async for item in gen:
                yield item
                if isinstance(item, bytes):
                    await asyncio.sleep(PACE_S)
        finally:
            await gen.aclose()


@pytest.fixture(scope="module")
def cluster(tiny_engines):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    httpx = pytest.importorskip("httpx")
    from ray import cloudpickle

    from specrt.server.ray_serve import APP_NAME, EngineSpec, build_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # PacedEngine: the workers cannot import tests/
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = EngineSpec(str(tiny_engines), threads=1, default_max_tokens=DEFAULT_MAX)
        serve.run(build_app(spec, Placement(2, 1, 0, 1), engine_cls=PacedEngine), name=APP_NAME, route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield client
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        serve.shutdown()
        ray.shutdown()


def chat(client, messages, headers=None, **kw):
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 12, "temperature": 0, **kw}, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER], r.json()


def sse(lines) -> list:
    return [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x.startswith("data: ")]


def conversation(i: int) -> list:
    return [SYSTEM, {"role": "user", "content": f"Conversation {i}: tell me a story about a robot."}]


def test_a_conversations_turns_stay_on_one_replica(cluster):
    messages, replicas, cached = conversation(0), [], []
    for turn in range(3):
        if turn < 2:
            replica, r = chat(cluster, messages)
            answer, usage = r["choices"][0]["message"]["content"], r["usage"]
        else:  # the last turn streamed: the header and the usage chunk come through the relay
            with cluster.stream("POST", CHAT, json={"messages": messages, "max_tokens": 12, "temperature": 0,
                                                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                replica, events = r.headers[REPLICA_HEADER], sse(r.iter_lines())
            assert events[-1] == "[DONE]"
            answer = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
            usage = events[-2]["usage"]
        replicas.append(replica)
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        messages = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    assert len(set(replicas)) == 1, replicas
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached


def test_conversations_spread_over_both_replicas(cluster):
    seen = {}
    for i in range(1, 17):  # 2 replicas: 16 conversations all on one would be a 1 in 32768 chance
        seen.setdefault(chat(cluster, conversation(i), max_tokens=2)[0], i)
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    # the client's own key pins different conversations together
    pinned = {cluster.post(CHAT, headers={"X-Specrt-Conversation": "pinned"},
                           json={"messages": conversation(100 + i), "max_tokens": 2}).headers[REPLICA_HEADER]
              for i in range(4)}
    assert len(pinned) == 1


def test_a_client_that_goes_away_stops_its_generation(cluster):
    pin = {"X-Specrt-Conversation": "goes-away"}  # the stream and the /metrics reads reach one replica

    def cancelled() -> float:
        text = cluster.get("/metrics", headers=pin).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('specrt_requests_total{finish_reason="cancelled"}'))

    before = cancelled()
    with cluster.stream("POST", CHAT, headers=pin, json={"messages": conversation(7), "max_tokens": 200,
                                                         "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if sse([line]) and sse([line])[0]["choices"][0]["delta"].get("content"):
                break  # closing the response mid-stream
    deadline = time.monotonic() + 15
    while cancelled() == before:
        assert time.monotonic() < deadline, "the replica did not stop the abandoned stream"
        time.sleep(0.2)


def test_replica_killed_mid_stream(cluster):
    import ray

    victim, first = chat(cluster, conversation(0))
    messages = conversation(0) + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                  {"role": "user", "content": "Go on, at length."}]
    other = next(i for i in range(1, 33) if chat(cluster, conversation(i), max_tokens=2)[0] != victim)
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + victim)]
    assert len(names) == 1, names
    actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])

    bystander, held = {}, {}

    def read_bystander():  # a stream on the other replica, open while the victim dies
        with cluster.stream("POST", CHAT, json={"messages": conversation(other), "max_tokens": 40, "temperature": 0,
                                                "stream": True, "ignore_eos": True}) as r:
            bystander["replica"], bystander["events"] = r.headers[REPLICA_HEADER], sse(r.iter_lines())

    def send_held():  # a request on the victim that has not answered yet when it dies: retried on a live replica
        held["replica"], held["answer"] = chat(cluster, conversation(0), headers={"x-test-hold": "1.5"})

    t0 = time.monotonic()
    with cluster.stream("POST", CHAT, json={"messages": messages, "max_tokens": 200, "temperature": 0,
                                            "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == victim
        lines = r.iter_lines()
        before = []
        for line in lines:
            before += sse([line])
            if before and before[-1] != "[DONE]" and before[-1]["choices"][0]["delta"].get("content"):
                break
        threads = [threading.Thread(target=f, daemon=True) for f in (read_bystander, send_held)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        ray.kill(actor)
        after = sse(lines)  # the rest: must end, not hang (the client's read timeout is 30 s)
    elapsed = time.monotonic() - t0
    events = before + after
    assert elapsed < 30 and events[-1] == "[DONE]", events[-3:]
    assert "error" in events[-2] and "failed" in events[-2]["error"]["message"], events[-2]
    assert not any(e["choices"][0]["finish_reason"] for e in events[:-2]), "the stream ran to its end before the kill"

    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert bystander["replica"] != victim
    assert bystander["events"][-1] == "[DONE]" and bystander["events"][-2]["choices"][0]["finish_reason"] == "length"
    assert held["replica"] != victim and held["answer"]["choices"][0]["finish_reason"] in ("length", "stop")

    # new requests, this conversation's retried turn among them, are served by a live replica
    replica, retry = chat(cluster, messages)
    assert replica != victim and retry["choices"][0]["finish_reason"] in ("length", "stop")
    for i in range(40, 44):
        assert chat(cluster, conversation(i), max_tokens=2)[0] != victim


def test_a_request_without_max_tokens_gets_the_replicas_default(cluster):
    r = cluster.post(CHAT, json={"messages": conversation(900), "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == DEFAULT_MAX and r.json()["choices"][0]["finish_reason"] == "length"
