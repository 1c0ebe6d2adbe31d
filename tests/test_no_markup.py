"""Nothing but text in `content` (docs/formats.md): a tiny model that writes <tool_call> by itself (its lm_head
favours the token), served with tools, over every tool_choice x parallel_tool_calls x stream x max_tokens 8-256.
A call cut by the budget, or a second one with no room, never shows its markup; a complete call comes back in
tool_calls; `parallel_tool_calls: false` ends the turn after one call; streamed and whole replies agree."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from fastapi.testclient import TestClient  # noqa: E402

from specrt.runtime.session import load  # noqa: E402
from specrt.server.app import create_app  # noqa: E402
from test_server import sse  # noqa: E402
from test_server_tools import ASK, BOOK, HOURS  # noqa: E402

MARKUP = ("tool_call", "<tool", "</", '{"name"', '"arguments"')
CHOICES = {"unset": None, "none": "none", "auto": "auto", "required": "required",
           "named": {"type": "function", "function": {"name": "book_table"}}}
PARALLEL = {"unset": None, "true": True, "false": False}
BUDGETS = (8, 16, 32, 48, 64, 96, 128, 256)
PROMPTS = (ASK, [{"role": "user", "content": "What time do you open?"}])


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-caller", "llama", seed=0, positions=2048,
                           tokenizer={"plain": ("<tool_call>", "</tool_call>")}, favour={"<tool_call>": 4.5})
    engines = make_engine_set(EngineSetRequest(str(ckpt), "tiny", ("fp32",), 2048, tmp_path_factory.mktemp("caller")),
                              log=lambda m: None)
    with TestClient(create_app(load(engines, "fp32", "auto")), raise_server_exceptions=False) as c:
        yield c


def _reply(client, body: dict) -> tuple[str, list[dict], str]:
    """content, tool_calls [{"index", "name", "arguments"}], finish_reason: whole or assembled from the stream."""
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        calls = [{"index": i, "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for i, c in enumerate(choice["message"].get("tool_calls") or [])]
        return choice["message"]["content"] or "", calls, choice["finish_reason"]
    content, calls, finish = "", {}, None
    for chunk in sse(r.text):
        if chunk == "[DONE]" or not chunk["choices"]:
            continue
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for c in delta.get("tool_calls") or []:
            entry = calls.setdefault(c["index"], {"index": c["index"], "name": "", "arguments": ""})
            entry["name"] += c["function"].get("name") or ""
            entry["arguments"] += c["function"].get("arguments") or ""
        finish = chunk["choices"][0]["finish_reason"] or finish
    return content.strip(), [calls[i] for i in sorted(calls)], finish


def _sweep(client, prompts=PROMPTS, budgets=BUDGETS, markup=MARKUP) -> dict:
    """Every combination: asserts each reply's shape, returns what the sweep reached."""
    seen = {"calls": 0, "several": 0, "auto calls": 0, "cut markup": 0, "text": 0}
    bad = []
    for choice_name, choice in CHOICES.items():
        for par_name, parallel in PARALLEL.items():
            for prompt in prompts:
                for budget in budgets:
                    body = {"messages": prompt, "tools": [BOOK, HOURS], "max_tokens": budget, "temperature": 0}
                    body.update({k: v for k, v in (("tool_choice", choice), ("parallel_tool_calls", parallel))
                                 if v is not None})
                    whole = _reply(client, body)
                    streamed = _reply(client, {**body, "stream": True})
                    assert streamed == (whole[0].strip(), whole[1], whole[2]), (body, whole, streamed)
                    content, calls, finish = whole
                    if any(m in content for m in markup):
                        bad.append((choice_name, par_name, budget, content))
                    for i, c in enumerate(calls):
                        assert c["index"] == i and c["name"] in ("book_table", "opening_hours")
                        assert isinstance(json.loads(c["arguments"]), dict)
                    if calls:
                        assert finish == "tool_calls", (body, whole)
                    if choice_name == "none":
                        assert not calls
                    if par_name == "false" or choice_name == "named":
                        assert len(calls) <= 1, (body, whole)
                    if choice_name in ("required", "named"):
                        assert not content and (calls or finish == "length"), (body, whole)
                        seen["cut markup"] += not calls
                    seen["calls"] += bool(calls)
                    seen["several"] += len(calls) > 1
                    seen["auto calls"] += bool(calls) and choice_name in ("unset", "auto")
                    seen["text"] += bool(content)
    assert not bad, bad
    return seen


def test_no_reply_has_markup_in_content_over_every_combination(client):
    seen = _sweep(client)
    assert all(seen.values()), seen  # the sweep reached calls, several calls, cut calls, calls by choice, text


FAMILY_MARKUP = MARKUP + ('"parameters"', "[TOOL_CALLS]", "<|tool_call|>", "<|/tool_call|>")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3.2", "mistral-nemo", "ministral3", "granite3.3", "phi4-mini", "gemma2",
                                    "qwen3"])
def test_no_markup_in_content_in_each_family_format(family, tmp_path):
    """The sweep on each family's real template and format, the model favouring its opening marker."""
    from llama_templates import template
    from test_formats import FAMILIES

    from specrt.pipeline import EngineSetRequest, make_engine_set
    from specrt.runtime.tool_formats import by_name
    from tiny import make_checkpoint

    file, tok, name = FAMILIES[family]
    fmt = by_name(name)
    favour = {fmt.open: 4.5} if fmt.open else {"{": 7.0}  # a bare JSON call opens with a plain brace
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", seed=0, positions=2048,
                           tokenizer={**tok, "template": template(file)}, favour=favour)
    engines = make_engine_set(EngineSetRequest(str(ckpt), family, ("fp32",), 2048, tmp_path / "engines"),
                              log=lambda m: None)
    session = load(engines, "fp32", "auto")
    assert session.codec.tool_format is fmt
    with TestClient(create_app(session), raise_server_exceptions=False) as c:
        seen = _sweep(c, PROMPTS[:1], (8, 24, 64, 160), FAMILY_MARKUP)
    assert seen["calls"] and seen["auto calls"] and seen["cut markup"] and seen["text"], seen


@pytest.fixture(scope="module")
def bare_engines(tmp_path_factory):
    """A tiny Hermes-format model that opens its reply with '{' (as Qwen2.5-Coder writes a call bare under auto)."""
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-bare", "llama", seed=0, positions=2048,
                           tokenizer={"plain": ("<tool_call>", "</tool_call>")}, favour={"{": 7.0})
    return make_engine_set(EngineSetRequest(str(ckpt), "tiny", ("fp32",), 2048, tmp_path_factory.mktemp("bare")),
                           log=lambda m: None)


def test_a_bare_call_under_auto_is_a_call_never_content(bare_engines):
    """docs/formats.md#bare-calls: the sweep on a model that writes a bare '{' first: under auto its reply is held
    to one call (tool_calls, never content), under none to text; greedy speculative equals plain on it."""
    from specrt.runtime.tokenizer import Message
    from specrt.server.tool_calls import grammar

    session, plain = load(bare_engines, "fp32", "auto"), load(bare_engines, "fp32", "off")
    tools = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in (BOOK, HOURS)]
    ask = [Message("user", ASK[0]["content"])]
    a, b = (s.generate(ask, max_new_tokens=160, tools=[BOOK, HOURS],
                       grammar=s.grammar(grammar(tools, False, True, s.grammar_literal, s.codec.tool_format)))
            for s in (session, plain))
    assert a.token_ids == b.token_ids and a.stats.proposer != "off"
    assert a.text.startswith("{") and a.stats.finish_reason == "eos", a.text  # the bare shape, ended by itself
    with TestClient(create_app(session), raise_server_exceptions=False) as c:
        seen = _sweep(c, PROMPTS[:1], (8, 24, 64, 160))
        r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": [BOOK, HOURS], "max_tokens": 160,
                                                 "temperature": 0, "tool_choice": "auto"}).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None, r
    assert seen["calls"] and seen["auto calls"] and seen["cut markup"] and seen["text"], seen
