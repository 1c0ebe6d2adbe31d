"""Thinking models (docs/formats.md): chat_template_kwargs reach the template (Qwen3's real one, from
tests/llama_templates.py) or are refused naming the key; reasoning between the think markers goes out as
reasoning_content, never content, streamed or not, cut or not, and is counted in
usage.completion_tokens_details.reasoning_tokens; `--reasoning off` renders with the template's switch."""

from __future__ import annotations

import pytest
from llama_templates import template

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from fastapi.testclient import TestClient  # noqa: E402

from specrt.server.replies import Reply, reasoning_tokens  # noqa: E402
from specrt.runtime.session import load  # noqa: E402
from specrt.runtime.tokenizer import Message  # noqa: E402
from specrt.runtime.tool_formats import ThinkFormat  # noqa: E402
from specrt.server.app import create_app  # noqa: E402
from test_no_markup import _reply  # noqa: E402
from test_server_tools import ASK, BOOK, HOURS  # noqa: E402

THINK = ThinkFormat("<think>", "</think>", "enable_thinking")
QWEN3 = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
         "plain": ("<tool_call>", "</tool_call>", "<think>", "</think>")}
OPEN = [{"role": "user", "content": "What time do you open?"}]
REPLY = "<think>\nThe user wants a table.\n</think>\n\nSure, <b>4</b> at 19:30.</think> Done."


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_reasoning_is_split_from_content_whatever_the_deltas(size):
    for cut in range(len(REPLY) + 1):
        r = Reply(THINK)
        events = [e for i in range(0, cut, size) for e in r.feed(REPLY[i:min(i + size, cut)])] + r.finish(True)
        content = "".join(e.content for e in events)
        assert "<think" not in content and "</think" not in content and "think>" not in content, (cut, content)
        assert "The user" not in content
    assert Reply(THINK).whole(REPLY, False)[:2] == ("Sure, <b>4</b> at 19:30. Done.", "The user wants a table.")
    assert Reply(THINK, inside=True).whole("hmm\n</think>\n\nHi", False)[:2] == ("Hi", "hmm")
    assert Reply(THINK).whole("Plain text <thi", False)[:2] == ("Plain text <thi", "")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny model with Qwen3's real template and tokens, whose lm_head favours <think> and </think>."""
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", "llama", seed=0, positions=2048,
                           tokenizer={**QWEN3, "template": template("Qwen-Qwen3-0.6B.jinja")},
                           favour={"<think>": 5.0, "</think>": 4.5})
    engines = make_engine_set(EngineSetRequest(str(ckpt), "qwen3", ("fp32",), 2048,
                                               tmp_path_factory.mktemp("qwen3")), log=lambda m: None)
    return load(engines, "fp32", "auto")


@pytest.fixture(scope="module")
def client(qwen3):
    with TestClient(create_app(qwen3), raise_server_exceptions=False) as c:
        yield c


def _body(**kw):
    return {"messages": ASK, "max_tokens": 64, "temperature": 0, **kw}


def test_chat_template_kwargs_reach_the_template_or_are_refused_naming_the_key(client, qwen3):
    assert qwen3.codec.think == THINK
    on = client.post("/v1/chat/completions", json=_body(chat_template_kwargs={"enable_thinking": True})).json()
    off = client.post("/v1/chat/completions", json=_body(chat_template_kwargs={"enable_thinking": False})).json()
    plain = client.post("/v1/chat/completions", json=_body()).json()
    assert on["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] < off["usage"]["prompt_tokens"]
    text = qwen3.codec.render_chat([Message("user", "hi")], None, {"enable_thinking": False})
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for kwargs, words in (({"enable_thinkin": False}, ["enable_thinkin", "enable_thinking"]),
                          ({"messages": []}, ["messages", "set by the server"]),
                          ([1], ["must be an object"]), ("x", ["must be an object"])):
        r = client.post("/v1/chat/completions", json=_body(chat_template_kwargs=kwargs))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "chat_template_kwargs" and "\n" not in err["message"], r.text
        assert all(w in err["message"] for w in words), err
    r = client.post("/v1/completions", json={"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert client.post("/v1/chat/completions", json=_body(max_tokens=2)).status_code == 200  # still serving


def test_reasoning_never_reaches_content_and_is_counted(client, qwen3):
    seen = {"reasoning": 0, "content": 0, "cut inside": 0}
    for tools, prompt in ((None, ASK), (None, OPEN), ([BOOK, HOURS], ASK), ([BOOK, HOURS], OPEN)):
        for budget in (4, 8, 16, 32, 64, 128):
            body = _body(messages=prompt, max_tokens=budget, **({"tools": tools} if tools else {}))
            content, calls, finish = _reply(client, body)
            whole = client.post("/v1/chat/completions", json=body).json()
            message, usage = whole["choices"][0]["message"], whole["usage"]
            assert "think>" not in (message["content"] or "") and "think>" not in content, whole
            reasoning = message.get("reasoning_content") or ""
            n = usage["completion_tokens_details"]["reasoning_tokens"]
            assert 0 <= n <= usage["completion_tokens"] and (n > 0 or not reasoning.strip()), whole
            seen["reasoning"] += bool(reasoning)
            seen["content"] += bool(message["content"])
            seen["cut inside"] += n == usage["completion_tokens"] > 0
    assert all(seen.values()), seen
    ids = qwen3.generate([Message(**OPEN[0])], max_new_tokens=64).token_ids
    opened, closed = (qwen3.codec.tokenizer.token_to_id(t) for t in ("<think>", "</think>"))
    assert opened in ids and closed in ids[ids.index(opened):]
    want, inside = 0, False  # both markers are tokens of their own here: count by token
    for t in ids:  # a block runs from its opening token to its closing one; a stray closing token is no reasoning
        want += inside or t == opened
        inside = (inside or t == opened) and t != closed
    assert reasoning_tokens(qwen3.codec, ids, THINK, False) == want
    assert reasoning_tokens(qwen3.codec, ids[:3], THINK, True) == 3  # the prompt opened the block


def test_streamed_reasoning_comes_as_reasoning_content(client):
    from test_server import sse

    r = client.post("/v1/chat/completions", json=_body(messages=OPEN, stream=True,
                                                       stream_options={"include_usage": True}))
    chunks = [c for c in sse(r.text) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = "".join(d.get("reasoning_content") or "" for d in deltas)
    whole = client.post("/v1/chat/completions", json=_body(messages=OPEN)).json()
    assert streamed.strip() == whole["choices"][0]["message"]["reasoning_content"]
    assert not any("think>" in (d.get("content") or "") for d in deltas)
    assert chunks[-1]["usage"]["completion_tokens_details"] == whole["usage"]["completion_tokens_details"]


def test_reasoning_off_uses_the_templates_switch(qwen3):
    with TestClient(create_app(qwen3, reasoning="off"), raise_server_exceptions=False) as c:
        off = c.post("/v1/chat/completions", json=_body(max_tokens=2)).json()["usage"]["prompt_tokens"]
        on = c.post("/v1/chat/completions", json=_body(max_tokens=2, chat_template_kwargs={
            "enable_thinking": True})).json()["usage"]["prompt_tokens"]
    assert off > on  # the empty think block; the request's own kwargs still decide
