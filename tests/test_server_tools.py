"""`specrt serve` with tools and structured output on the tiny set: OpenAI's tool_calls (whole and streamed), tool
rounds in the history, response_format held by the grammar, the refusals, and the defaults agents hit."""

from __future__ import annotations

import json

import pytest
from helpers import loopback

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from fastapi.testclient import TestClient  # noqa: E402

from specrt.runtime.session import load  # noqa: E402
from specrt.runtime.tokenizer import Message, ToolCall  # noqa: E402
from specrt.server.app import create_app  # noqa: E402
from test_server import sse  # noqa: E402

BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table at the restaurant.",
    "parameters": {"type": "object", "properties": {"party": {"type": "integer", "minimum": 1, "maximum": 12},
                                                     "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
                   "required": ["party", "time"], "additionalProperties": False}}}
HOURS = {"type": "function", "function": {"name": "opening_hours", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Book a table for 4 at 19:30, please."}]


@pytest.fixture(scope="module")
def long_engines(tmp_path_factory):
    """A tiny Llama with room for a tool prompt (its 384-token vocabulary spells the Hermes prompt long)."""
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-long", "llama", seed=0, positions=2048)
    return make_engine_set(EngineSetRequest(str(ckpt), "tiny", ("fp32",), 2048, tmp_path_factory.mktemp("long")),
                           log=lambda m: None)


@pytest.fixture(scope="module")
def session(long_engines):
    return load(long_engines, "fp32", "auto")


@pytest.fixture(scope="module")
def client(session):
    with TestClient(create_app(session), raise_server_exceptions=False) as c:
        yield c


def body(**kw):
    return {"messages": ASK, "tools": [BOOK, HOURS], "max_tokens": 160, "temperature": 0, **kw}  # a tiny vocabulary
    # spells a call in 60-90 tokens


def _check_booking(call: dict) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "book_table"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"party", "time"} and 1 <= args["party"] <= 12
    assert len(args["time"]) == 5 and args["time"][2] == ":"


def test_a_required_call_comes_back_as_tool_calls_valid_for_its_schema(client):
    r = client.post("/v1/chat/completions", json=body(tool_choice="required", parallel_tool_calls=False))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] in ("book_table", "opening_hours")
    named = client.post("/v1/chat/completions", json=body(
        tool_choice={"type": "function", "function": {"name": "book_table"}})).json()["choices"][0]
    assert named["finish_reason"] == "tool_calls"
    (call,) = named["message"]["tool_calls"]
    _check_booking(call)


def test_streamed_tool_calls_come_as_openai_streams_them(client):
    choice = {"type": "function", "function": {"name": "book_table"}}
    whole = client.post("/v1/chat/completions", json=body(tool_choice=choice)).json()["choices"][0]["message"]
    r = client.post("/v1/chat/completions", json=body(tool_choice=choice, stream=True))
    chunks = [e for e in sse(r.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head, *rest = calls
    assert head["index"] == 0 and head["id"].startswith("call_") and head["function"] == {"name": "book_table",
                                                                                          "arguments": ""}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
    args = "".join(c["function"]["arguments"] for c in rest)
    assert args == whole["tool_calls"][0]["function"]["arguments"]  # greedy: the same call, streamed
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_lets_the_model_answer_in_text(client):
    r = client.post("/v1/chat/completions", json=body(max_tokens=12)).json()["choices"][0]
    assert r["finish_reason"] in ("length", "stop", "tool_calls")
    assert r["message"]["content"] or r["message"].get("tool_calls")


def test_a_history_with_a_tool_round_is_rendered_and_answered(client, session):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "book_table",
                                                               "arguments": '{"party": 4, "time": "19:30"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"booked": true}'},
    ]
    r = client.post("/v1/chat/completions", json=body(messages=history, tool_choice="none", max_tokens=8))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    # the tiny template takes no tools: the Hermes prompt in the system turn, the round as text
    codec = session.generator.codec
    assert not codec.template_takes_tools
    text = codec.render_chat([Message("user", "hi"),
                              Message("assistant", "", (ToolCall("call_1", "book_table", '{"party": 4}'),)),
                              Message("tool", '{"booked": true}', (), "call_1")], [BOOK])
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "book_table"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "book_table", "arguments": {"party": 4}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n{\"booked\": true}\n</tool_response>" in text


def test_a_template_that_takes_tools_gets_them(long_engines):
    from specrt.runtime.tokenizer import TextCodec

    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
                "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
    codec = TextCodec(long_engines / "tokenizer.json", template, None, (0,))
    assert codec.template_takes_tools
    text = codec.render_chat([Message("user", "a <b> & c"),
                              Message("assistant", "", (ToolCall("c1", "book_table", '{"time": "<19:30>"}'),))],
                             [BOOK])
    assert text.startswith('TOOLS:{"type": "function", "function": {"name": "book_table"')
    assert 'CALL book_table {"time": "<19:30>"}' in text  # transformers' tojson: no HTML escaping


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}


def test_response_format_is_held_by_the_grammar(client):
    plain = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 40, "temperature": 0}).json()
    with pytest.raises(ValueError):
        json.loads(plain["choices"][0]["message"]["content"])
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for temperature in (0, 1.0):
        r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 60, "temperature": temperature,
                                                      "seed": 5, "response_format": rf}).json()["choices"][0]
        assert r["finish_reason"] == "stop", r
        obj = json.loads(r["message"]["content"])
        assert obj["city"] in ("Paris", "Rome") and isinstance(obj["ok"], bool)
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 200, "temperature": 0,
                                                  "response_format": {"type": "json_object"}}).json()["choices"][0]
    if r["finish_reason"] == "stop":
        assert isinstance(json.loads(r["message"]["content"]), dict)
    else:  # a grammar cut by max_tokens says so; never invalid JSON claimed complete
        assert r["finish_reason"] == "length"


def _bad(**kw):
    return body(**kw)


BAD = [
    (_bad(tools=[{"type": "function", "function": {"name": "book_table", "parameters": {
        "type": "object", "properties": {"party": {"type": "strnig"}}}}}]), "tools", ["book_table", "strnig"]),
    (_bad(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools", ["name"]),
    (_bad(tools=[BOOK, BOOK]), "tools", ["twice"]),
    (_bad(tools=[{"type": "code_interpreter"}]), "tools", ["function"]),
    (_bad(tool_choice={"type": "function", "function": {"name": "order_pizza"}}), "tool_choice", ["order_pizza"]),
    (_bad(tool_choice="sometimes"), "tool_choice", ["required"]),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     ["schema"]),
    ({"messages": ASK, "response_format": {"type": "yaml"}}, "response_format", ["json_object"]),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}}, "response_format",
     ["strnig"]),
    (_bad(response_format={"type": "json_object"}), "response_format", ["tool_choice"]),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages", ["tool_call_id"]),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages", ["call_9"]),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages",
     ["arguments"]),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", ["wizard"]),
    ({"messages": ASK, "top_logprobs": 2}, "top_logprobs", ["logprobs"]),
]


def test_what_cannot_be_honoured_is_refused_in_one_line_and_the_server_keeps_serving(client):
    for request, param, words in BAD:
        r = client.post("/v1/chat/completions", json=request)
        assert r.status_code == 400, (request, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "\n" not in err["message"], err
        for w in words:
            assert w in err["message"], (w, err["message"])
    r = client.post("/v1/completions", json={"prompt": "hi", "tools": [BOOK]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = client.post("/v1/chat/completions", json=body(tool_choice="required"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]


def test_developer_is_the_system_turn(session):
    from specrt.server.openai_api import parse

    req = parse({"messages": [{"role": "developer", "content": "Be brief."}, ASK[0]]}, True, 256)
    assert req.prompt[0] == Message("system", "Be brief.")
    codec = session.generator.codec
    assert codec.render_chat(req.prompt).startswith("<|im_start|>system\nBe brief.")


def test_a_request_without_max_tokens_gets_the_servers_default(session):
    import inspect

    from specrt.cli.serve import serve
    from specrt.server.app import DEFAULT_MAX_TOKENS

    assert inspect.signature(serve).parameters["default_max_tokens"].default.default == DEFAULT_MAX_TOKENS
    with TestClient(create_app(session, default_max_tokens=6), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": "hi", "temperature": 0, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 16  # OpenAI's default for completions


def test_time_to_first_token_counts_the_queue(session):
    pytest.importorskip("prometheus_client")
    import threading

    import httpx

    app = create_app(session)
    server = app.state.server
    with loopback(app) as (url, _):
        long = {"messages": ASK, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        short = {"messages": ASK, "max_tokens": 2, "temperature": 0}
        first = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions", json=long, timeout=60))
        first.start()
        while not server.pending:
            pass
        r = httpx.post(url + "/v1/chat/completions", json=short, timeout=60).json()
        first.join()
        waited = r["metrics"]["queue_s"]
        assert waited > 0.01, r["metrics"]  # it waited for the long one
        metrics = httpx.get(url + "/metrics").text
    total = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("specrt_time_to_first_token_seconds_sum")))
    assert total >= waited + r["metrics"]["ttft_s"]


def test_the_openai_client_reads_the_tool_calls(session):
    openai = pytest.importorskip("openai")
    with loopback(create_app(session)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=30, max_retries=0)
        choice = {"type": "function", "function": {"name": "book_table"}}
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[BOOK, HOURS], tool_choice=choice,
                                           temperature=0, max_tokens=160)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "book_table"
        streamed = {}
        for chunk in client.chat.completions.create(model="tiny", messages=ASK, tools=[BOOK, HOURS],
                                                    tool_choice=choice, temperature=0, max_tokens=160, stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
        assert streamed == {0: {"name": "book_table", "arguments": call.function.arguments}}


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt():
    from specrt.server.openai_api import parse

    tools = [BOOK]
    shown = parse({"messages": ASK, "tools": tools}, True, 2048)
    hidden = parse({"messages": ASK, "tools": tools, "tool_choice": "none"}, True, 2048)
    assert shown.tools == tuple(tools) and shown.parse_calls and shown.call_tools
    assert hidden.tools == () and not hidden.parse_calls and not hidden.call_tools
    assert hidden.tool_grammars  # its schema is still checked
