"""The Hermes tool-call parser (specrt/tool_calls.py): content around calls, a call's id and name as soon as its
head is read, its arguments streamed as they come and never its closing brace or tag, whatever the deltas."""

from __future__ import annotations

import json

import pytest

from specrt.tool_calls import CallParser, split

ARGS = '{"party": 4, "note": "a } inside, and </tool_", "time": "19:30"}'
REPLY = (f'Sure.<tool_call>\n{{"name": "book_table", "arguments": {ARGS}}}\n</tool_call>'
         f'<tool_call>\n{{"name": "ping", "arguments": {{}}}}\n</tool_call> done')


def _stream(text: str, size: int):
    p = CallParser()
    events = []
    for i in range(0, len(text), size):
        events += p.feed(text[i:i + size])
    return p, events + p.finish()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_deltas_of_any_size_give_the_same_calls_streamed_in_order(size):
    p, events = _stream(REPLY, size)
    content = "".join(e.content for e in events)
    assert content == "Sure. done"
    starts = [(e.index, e.start.name) for e in events if e.start]
    assert starts == [(0, "book_table"), (1, "ping")]
    for i, args in ((0, ARGS), (1, "{}")):
        first = next(k for k, e in enumerate(events) if e.start and e.index == i)
        fragments = [(k, e.arguments) for k, e in enumerate(events) if e.arguments and e.index == i]
        assert all(k > first for k, _ in fragments)  # the name before any argument
        assert "".join(f for _, f in fragments) == args
    assert [c.name for c in p.calls] == ["book_table", "ping"] and p.calls[0].arguments == ARGS
    assert json.loads(p.calls[0].arguments)["party"] == 4
    assert split(REPLY)[0] == "Sure. done" and [c.arguments for c in split(REPLY)[1]] == [ARGS, "{}"]


def test_arguments_go_out_before_the_call_closes():
    p = CallParser()
    first = p.feed('<tool_call>\n{"name": "book_table", "arguments": {"party": 4, ')
    assert first[0].start.name == "book_table" and "".join(e.arguments for e in first) == '{"party": 4,'
    assert "".join(e.arguments for e in p.feed('"time": "19')) == ' "time": "19'  # whitespace waits for more
    assert "".join(e.arguments for e in p.feed('"}')) == '"'  # this brace may be the call's own


def test_a_call_cut_short_sends_what_it_had_and_no_text():
    p, events = _stream('<tool_call>\n{"name": "book_table", "arguments": {"party": 4, "ti', 5)
    assert not any(e.content for e in events) and not p.calls
    assert "".join(e.arguments for e in events) == '{"party": 4, "ti'


def test_text_that_only_looks_like_a_call_stays_text():
    p, events = _stream("a <tool_c b <tool_call>not json</tool_call>", 4)
    assert "".join(e.content for e in events) == "a <tool_c b <tool_call>not json</tool_call>" and not p.calls
