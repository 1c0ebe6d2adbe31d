"""The tool-call parser (specrt/server/tool_calls.py) in every format of runtime/tool_formats.py: content around calls,
each call whole once its markup ends, whatever the deltas, and never any markup in content (a call cut by the
budget, a held prefix of a marker, markup that does not parse)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specrt.runtime.tokenizer import ToolCall
from specrt.runtime.tool_formats import FORMATS, NAMES, by_name, detect
from specrt.server.tool_calls import CallParser, split

ARGS = '{"party": 4, "note": "a } inside, and </tool_ [x]", "time": "19:30"}'
CALLS = [ToolCall("a", "book_table", ARGS), ToolCall("b", "ping", "{}")]


def _reply(fmt, calls, before="Sure.") -> str:
    text = fmt.calls_text(calls)
    return text if not fmt.open else f"{before}{text} "  # bare JSON: a call only at the reply's start


def _stream(fmt, text: str, size: int, cut=False):
    p = CallParser(fmt)
    events = []
    for i in range(0, len(text), size):
        events += p.feed(text[i:i + size])
    return p, events + p.finish(cut)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name", NAMES)
def test_deltas_of_any_size_give_the_same_calls_in_order(name, size):
    fmt = by_name(name)
    calls = CALLS if fmt.parallel else CALLS[:1]
    p, events = _stream(fmt, _reply(fmt, calls), size)
    assert "".join(e.content for e in events) == ("Sure." if fmt.open else "")
    assert [(e.index, e.start.name) for e in events if e.start] == [(i, c.name) for i, c in enumerate(calls)]
    for i, c in enumerate(calls):
        first = next(k for k, e in enumerate(events) if e.start and e.index == i)
        args = [(k, e.arguments) for k, e in enumerate(events) if e.arguments and e.index == i]
        assert all(k > first for k, _ in args) and json.loads("".join(a for _, a in args)) == json.loads(c.arguments)
    assert [json.loads(c.arguments) for c in p.calls] == [json.loads(c.arguments) for c in calls]
    content, parsed, cut = split(_reply(fmt, calls), fmt)
    assert [c.name for c in parsed] == [c.name for c in calls] and not cut
    if fmt.id_chars:
        assert all(len(c.id) == fmt.id_chars and c.id.isalnum() for c in parsed)


@pytest.mark.parametrize("name", NAMES)
def test_no_cut_of_a_call_reaches_content(name):
    """Every prefix of a reply whose calls the budget cuts: the text before them and the complete calls only."""
    fmt = by_name(name)
    calls = CALLS if fmt.parallel else CALLS[:1]
    reply = _reply(fmt, calls)
    markup = reply.index(fmt.open or "{")
    for n in range(len(reply)):
        for size in (1, 5):
            p, events = _stream(fmt, reply[:n], size, cut=True)
            content = "".join(e.content for e in events)
            assert content in (reply[:n], reply[:n][:markup], reply[:markup]) or not fmt.open, (n, content)
            for marker in filter(None, (fmt.open, fmt.close, "{", "[", "<", "tool")):
                assert marker not in content[len(reply[:markup]) if n > markup else n:]
            if n > markup:
                assert not content.strip() or content == reply[:markup]
                assert p.cut or p.calls  # the reply ended in markup
            assert all(json.loads(c.arguments) == json.loads(calls[i].arguments) for i, c in enumerate(p.calls))


def test_a_held_prefix_of_the_marker_is_text_when_the_reply_ended_by_itself():
    fmt = by_name("hermes")
    assert split("a <tool_", fmt) == ("a <tool_", [], False)
    assert split("a <tool_", fmt, cut=True) == ("a", [], True)


def test_markup_that_does_not_parse_is_dropped():
    p, events = _stream(by_name("hermes"), "a <tool_c b <tool_call>not json</tool_call> c", 4)
    assert "".join(e.content for e in events) == "a <tool_c b  c" and not p.calls


def test_whitespace_between_calls_is_markup():
    fmt = by_name("hermes")
    p, events = _stream(fmt, fmt.calls_text(CALLS) + "\n\n", 3)
    assert not any(e.content for e in events) and len(p.calls) == 2


def test_detection_is_data_and_one_call_a_turn_is_refused_in_a_history():
    vocab = {"[TOOL_CALLS]", "<|tool_call|>", "<|/tool_call|>", "<|eot_id|>"}
    assert detect(None, vocab.__contains__).name == "mistral"
    assert detect("", {"<|tool_call|>", "<|/tool_call|>"}.__contains__).name == "phi4-mini"
    assert detect("", {"<|tool_call|>"}.__contains__).name == "granite"
    assert detect('{"name": function name, "parameters": dict}', set().__contains__).name == "llama3-json"
    assert detect("<start_of_turn>", set().__contains__).name == "gemma-json"
    assert detect("{{ x }}", set().__contains__) is FORMATS[-1]
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="one call a turn"):
        by_name("llama3-json").calls_text(CALLS)
    with pytest.raises(SpecrtError, match="mistral, .*, hermes"):
        by_name("chatml")


BARE_ARGS = '{"party": 4, "note": "} and {{ inside", "time": "19:30"}'
TOOLS = ("book_table", "ping")


FENCE = ("```json\n", "\n```")  # a shape a row may list (a marker of several characters on each side)


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("shape", by_name("hermes").bare + (FENCE,))
def test_a_reply_that_is_one_bare_call_is_a_call_in_each_shape(shape, size):
    """Qwen2.5-Coder under "auto" writes its call bare, or in the doubled braces of its template: a call, never
    content, whole and streamed, the budget cut or not."""
    fmt, (before, after) = replace(by_name("hermes"), bare=(shape,)), shape
    reply = "\n" + before + '{"name": "book_table", "arguments": ' + BARE_ARGS + "}" + after + "\n"
    for cut in (False, True):
        p, events = _stream_named(fmt, reply, size, cut)
        assert not any(e.content for e in events), events
        assert [c.name for c in p.calls] == ["book_table"] and json.loads(p.calls[0].arguments)["party"] == 4
        assert [e.start.name for e in events if e.start] == ["book_table"]
        content, calls, _ = split(reply, fmt, cut, TOOLS)
        assert content == "" and [(c.name, c.arguments) for c in calls] == [("book_table", p.calls[0].arguments)]


def _stream_named(fmt, text, size, cut=False):
    p = CallParser(fmt, TOOLS)
    events = []
    for i in range(0, len(text), size):
        events += p.feed(text[i:i + size])
    return p, events + p.finish(cut)


@pytest.mark.parametrize("text", [
    '{"answer": 42}', '{"name": "unknown_tool", "arguments": {"party": 4}}', '{"name": "book_table"}',
    '{"name": "book_table", "arguments": "party 4"}', '{{"answer": 42}}', '```json\n{"total": 3}\n```',
    '```python\nprint({"name": 1})\n```', "Sure, {\"name\": \"book_table\", \"arguments\": {}} is what I'd send.",
    "{ not json at all"])
def test_json_that_is_not_one_call_of_a_known_tool_stays_text(text):
    """A known tool's name and an arguments object must both be there; anything else that opens like JSON is
    text, streamed as whole."""
    fmt = by_name("hermes")
    for size in (1, 3, 1000):
        p, events = _stream_named(fmt, text, size)
        assert "".join(e.content for e in events) == text and not p.calls, (size, events)
    assert split(text, fmt, False, TOOLS) == (text, [], False)
    call = '{"name": "book_table", "arguments": {"party": 4}}'
    assert split(call, fmt) == (call, [], False)  # no tools given: no bare call either


def test_a_bare_call_cut_by_the_budget_is_never_content():
    """Every prefix of a bare call (single and doubled braces), the budget ending the reply there: no content.
    Ended by the model instead, a prefix that names a tool is malformed markup (dropped); one that does not is
    text."""
    fmt = by_name("hermes")
    for reply in ('{"name": "book_table", "arguments": ' + BARE_ARGS + "}",
                  '{{"name": "book_table", "arguments": ' + BARE_ARGS + "}}"):
        for n in range(1, len(reply)):
            for size in (1, 4):
                p, events = _stream_named(fmt, reply[:n], size, cut=True)
                assert not any(e.content for e in events) and (p.cut or p.calls), (n, events)
        p, events = _stream_named(fmt, reply[:-1], 2)
        assert not any(e.content for e in events) and p.cut and not p.calls
    assert split('{"name": "nothing we know', fmt, False, TOOLS) == ('{"name": "nothing we know', [], False)


FENCED = 'Here\'s the JSON object for the function call:\n```json\n{\n  "name": "book_table",\n  "arguments": ' + \
    BARE_ARGS + '\n}\n```'


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
@pytest.mark.parametrize("tag, after", [("json", ""), ("", "\nShall I book it?")])
def test_a_fenced_call_after_text_is_a_call_and_the_text_stays(tag, after, size):
    """Qwen2.5-Coder under "auto" writes a sentence, then its call in a Markdown fence (docs/formats.md#fenced-calls):
    the sentence is content, the fence a call, whole and streamed, at every delta size."""
    from helpers import markup_in

    fmt, reply = by_name("hermes"), FENCED.replace("```json", "```" + tag) + after
    spoken = FENCED[:FENCED.index("```")] + after  # the text around the fence, as written
    for cut in (False, True):
        p, events = _stream_named(fmt, reply, size, cut)
        content = "".join(e.content for e in events)
        assert content == spoken, events
        assert not markup_in(content) and "`" not in content
        assert [(e.index, e.start.name) for e in events if e.start] == [(0, "book_table")]
        assert json.loads(p.calls[0].arguments) == json.loads(BARE_ARGS) and not p.cut
    content, calls, cut = split(reply, fmt, False, TOOLS)
    assert content == spoken.strip() and not cut
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("book_table", json.loads(BARE_ARGS))]


@pytest.mark.parametrize("text", [
    "Like this:\n```python\nprint(book_table(party=4))\n```\nThen run it.",
    'In Python:\n```python\nbook_table(**{"name": "book_table", "arguments": {"party": 4}})\n```',
    'Totals:\n```json\n{"total": 3}\n```\nand more:\n```\n{"name": "unknown", "arguments": {}}\n```',
    'See:\n```json\n{"name": "book_table", "arguments": "party 4"}\n```', "Use ``` for code, `x` inline.",
    "```yaml\nname: book_table\n```"])
def test_a_fenced_block_that_is_not_one_call_stays_text(text):
    """Code, other JSON, an unknown tool's name, no arguments object: the fence is text, unchanged, at every delta
    size (held back only while it may still be a call)."""
    fmt = by_name("hermes")
    for size in (1, 2, 3, 1000):
        for cut in (False, True):
            p, events = _stream_named(fmt, text, size, cut)
            assert "".join(e.content for e in events) == text and not p.calls, (size, cut, events)
    assert split(text, fmt, False, TOOLS) == (text.strip(), [], False)


def test_a_fence_is_a_call_only_where_the_row_allows_it_and_tools_are_given():
    """A row without `fenced`, or no tools given: the fence stays text; the format's own tags still read after one."""
    fmt = by_name("hermes")
    assert split(FENCED, replace(fmt, fenced=()), False, TOOLS) == (FENCED, [], False)
    assert split(FENCED, fmt) == (FENCED, [], False)  # no tools given (tool_choice "none" parses no calls)
    ping = '{"name": "ping", "arguments": {}}'
    tagged = f"Sure.\n```json\n{ping}\n```\n<tool_call>\n{ping}\n</tool_call>"
    content, calls, _ = split(tagged, fmt, False, TOOLS)
    assert content == "Sure." and [c.name for c in calls] == ["ping", "ping"]


def test_a_fenced_call_cut_by_the_budget_is_never_content():
    """Every prefix of a fenced call, the budget ending the reply there: the text before the fence at most, never
    the fence. Ended by the model unclosed, a block naming a tool is dropped as markup."""
    from helpers import markup_in

    fmt, text = by_name("hermes"), FENCED[:FENCED.index("```")]
    for n in range(1, len(FENCED)):
        for size in (1, 4):
            p, events = _stream_named(fmt, FENCED[:n], size, cut=True)
            content = "".join(e.content for e in events)
            assert text.startswith(content) and not markup_in(content) and not p.calls, (n, events)
            assert p.cut or n <= len(text) + 1, (n, events)
    p, events = _stream_named(fmt, FENCED[:-3], 2)
    assert "".join(e.content for e in events) == text and p.cut and not p.calls


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("name", NAMES)
def test_streamed_content_starts_as_the_whole_replys_does(name, size):
    """The blank lines a reply opens with, or leaves after a call's markup, are not sent: streamed content is the
    non-streamed content's text (which is stripped), save whitespace at its very end."""
    from specrt.server.replies import Reply

    fmt = by_name(name)
    for text in ["\n\n Hello there.", fmt.calls_text(CALLS[:1]) + "\n\nBooked. ", '\n\n{"na']:  # held, not a call
        r = Reply(None, False, fmt, ("book_table",))
        events = [e for i in range(0, len(text), size) for e in r.feed(text[i:i + size])] + r.finish(False)
        whole = Reply(None, False, fmt, ("book_table",)).whole(text, False)
        assert "".join(e.content for e in events).rstrip() == whole[0], (text, events)
        assert [e.start.name for e in events if e.start] == [c.name for c in whole[2]]
