"""The request models' refusals word by word (parse() alone, no engines): each way pydantic's errors become ours."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from specrt.server.openai_api import ApiError, parse  # noqa: E402

ASK = [{"role": "user", "content": "Hi"}]
CALL = {"id": "c", "function": {"name": "f", "arguments": "[1]"}}

WORDS = [
    (True, {}, "messages", "'messages' is required: a non-empty list like [{\"role\": \"user\", \"content\": \"Hi\"}]"),
    (True, {"messages": None}, "messages", "'messages' is required: a non-empty list like [{\"role\": \"user\", "
                                           "\"content\": \"Hi\"}]"),
    (True, {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages[0].content must be a string or a list of text parts; only text is supported"),
    (True, {"messages": [{"role": "wizard", "content": "x"}]}, "messages",
     "messages[0].role 'wizard' is not one of system, developer, user, assistant, tool"),
    (True, {"messages": ASK + [{"role": "assistant", "tool_calls": [CALL]}]}, "messages",
     "messages[1].tool_calls[0].function.arguments must be a JSON object in a string, like '{\"party\": 4}'"),
    (True, {"messages": ASK, "max_tokens": "12"}, "max_tokens", "'max_tokens' must be an integer, got \"12\""),
    (True, {"messages": ASK, "max_tokens": 300}, "max_tokens", "'max_tokens' must be in [1, 256], got 300"),
    (True, {"messages": ASK, "temperature": 5}, "temperature", "'temperature' must be in [0, 2], got 5"),
    (True, {"messages": ASK, "top_p": 0}, "top_p", "'top_p' must be in (0, 1], got 0"),
    (True, {"messages": ASK, "n": 0}, "n", "'n' must be in [1, 2147483648], got 0"),
    (True, {"messages": ASK, "n": 2}, "n", "'n' must be 1: this server returns one choice per request"),
    (True, {"messages": ASK, "stream": True, "stream_options": {"include_usage": 1}}, "include_usage",
     "'include_usage' must be true or false, got 1"),
    (True, {"messages": ASK, "stop": ["a", 3]}, "stop", "'stop' must be a string or a list of strings"),
    (True, {"messages": ASK, "stop": list("abcde")}, "stop", "'stop' takes at most 4 strings, got 5"),
    (True, {"messages": ASK, "frequency_penalty": 0.5}, "frequency_penalty",
     "'frequency_penalty' is not supported; omit it or pass 0"),
    (True, {"messages": ASK, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
     "tools[0].function.name must be 1-64 letters, digits, '_' or '-', got \"a b\""),
    (False, {"prompt": ["a", "b"]}, "prompt",
     "'prompt' must be a string (or a list of one string); token arrays and batches are not supported"),
    (False, {"prompt": "hi", "tools": []}, "tools",
     "'tools' belongs to /v1/chat/completions; /v1/completions takes a raw prompt"),
]


@pytest.mark.parametrize("chat, body, param, message", WORDS)
def test_a_refusal_names_the_field_and_the_fix(chat, body, param, message):
    with pytest.raises(ApiError) as e:
        parse(body, chat, 256)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


def test_null_is_the_default_and_unknown_fields_are_ignored():
    req = parse({"messages": ASK, "temperature": None, "stop": None, "n": None, "user": "u", "metadata": {}}, True,
                256, 64)
    assert (req.max_tokens, req.sampling.temperature, req.stop, req.stream) == (64, 1.0, (), False)
    assert parse({"prompt": ["hi"], "max_tokens": None}, False, 256).max_tokens == 16
