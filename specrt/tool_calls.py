"""Tool calls in the Hermes format (the one Qwen2.5's chat template and runtime/tokenizer.HERMES_TOOLS ask for):

    <tool_call>
    {"name": "book_table", "arguments": {"party": 4}}
    </tool_call>

`grammar` holds the model to it (llguidance's Lark, each call's arguments to its tool's JSON Schema); `CallParser`
turns the streamed text into content deltas and OpenAI's tool calls, holding back text that may open a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .runtime.generate import stop_prefix
from .runtime.grammar import JSON_OPTIONS
from .runtime.tokenizer import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_schema(tools: list[dict]) -> dict:
    """One call's JSON: {"name": one of the tools, "arguments": that tool's parameters}."""
    shapes = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                 "arguments": t.get("parameters") or NO_PARAMETERS},
               "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {**(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}), "x-guidance": JSON_OPTIONS}


def grammar(tools: list[dict], required: bool, parallel: bool = True, literal=json.dumps) -> str:
    """The Lark grammar of a reply: text with calls anywhere (required False: OpenAI's "auto"), or calls alone
    (required: "required" or a named function, whose one tool is then `tools`). tools: [{"name", "parameters"}].
    literal: how the grammar writes the tags (GrammarTokenizer.literal: Qwen2.5's are tokens of their own)."""
    open_, close = literal(OPEN), literal(CLOSE)
    call = f'"\\n" %json {json.dumps(call_schema(tools))} "\\n" {close}'
    if required:
        more = ' ("\\n" seg)*' if parallel else ""
        return f'%llguidance {{}}\nstart: seg{more}\nseg: {open_} {call}\n'
    if not open_.startswith('"'):  # a special token ends the text by itself (llguidance's StructTag does the same)
        return f'%llguidance {{}}\nstart: seg* tail\nseg: TEXT {open_} {call}\ntail: TEXT\nTEXT: /(.|\\n)*/\n'
    return (f'%llguidance {{}}\nstart: seg* tail\nseg: trig {call}\ntrig[lazy]: TEXT {open_}\ntail: TEXT\n'
            f'TEXT: /(.|\\n)*/\n')


# the head of a call's JSON, up to its arguments' first character (the grammar writes "name" first)
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class Event:
    """One thing to send: content text, a call's start (`start`: its id and name, arguments empty), a fragment of
    the arguments of the call last started, or a call completed (`call`, whole)."""

    content: str = ""
    start: ToolCall | None = None
    arguments: str = ""
    call: ToolCall | None = None
    index: int = 0  # of the call started or streaming, in the reply's calls


class CallParser:
    """Feed the text deltas of a reply; each feed gives the events to send now. Text that may still become
    '<tool_call>' is held back, as a stop string's prefix is; inside a call, its id and name go out once the head
    `{"name": ..., "arguments": ` is read, then the arguments as they come, less a tail that may be the call's own
    closing brace."""

    def __init__(self):
        self.buf, self.in_call, self.calls = "", False, []
        self.started: ToolCall | None = None  # the call whose arguments are streaming
        self.sent = 0                          # of its arguments, the characters sent (from buf's start)

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        out = []
        while True:
            if self.in_call:
                if self.started is None and (m := HEAD.match(self.buf)) and m.end() < len(self.buf):
                    self.started = ToolCall("call_" + uuid.uuid4().hex[:24], json.loads(m.group(1)), "")
                    self.buf, self.sent = self.buf[m.end():], 0
                    out.append(Event(start=self.started, index=len(self.calls)))
                end = self.buf.find(CLOSE)
                if end < 0:
                    if self.started is not None:
                        self._fragment(self._held(self.buf), out)
                    return out
                body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE):], False
                if self.started is not None:  # the arguments end before the call's own closing brace
                    args = body.rstrip()[:-1].rstrip() if body.rstrip().endswith("}") else body.rstrip()
                    self._fragment(len(args), out, body)
                    call, self.started = ToolCall(self.started.id, self.started.name, args), None
                    self.calls.append(call)
                    out.append(Event(call=call))
                    continue
                call = _parse(body)
                if call is None:  # not a call after all (only without a grammar): its text is content
                    out.append(Event(content=OPEN + body + CLOSE))
                else:
                    i = len(self.calls)
                    self.calls.append(call)
                    out += [Event(start=call, index=i), Event(arguments=call.arguments, index=i), Event(call=call)]
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(Event(content=self.buf[:start]))
                self.buf, self.in_call = self.buf[start + len(OPEN):], True
                continue
            keep = stop_prefix(self.buf, (OPEN,))
            if len(self.buf) > keep:
                out.append(Event(content=self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return out

    def _held(self, text: str) -> int:
        """How much of a call's arguments text so far may go out: all but a tail that could be whitespace, the
        call's closing brace, and the start of '</tool_call>'."""
        h = len(text) - stop_prefix(text, (CLOSE,))
        while h and text[h - 1].isspace():
            h -= 1
        return h - 1 if h and text[h - 1] == "}" else h

    def _fragment(self, upto: int, out: list, text: str | None = None) -> None:
        text = self.buf if text is None else text
        if upto > self.sent:
            out.append(Event(arguments=text[self.sent:upto], index=len(self.calls)))
            self.sent = upto

    def finish(self) -> list[Event]:
        """The events still held at the end: an unfinished call cut by max_tokens sends the rest of its arguments
        if it had started, else goes out as text."""
        out = []
        if self.in_call and self.started is not None:
            self._fragment(len(self.buf), out)
        elif self.in_call or self.buf:
            out.append(Event(content=(OPEN if self.in_call else "") + self.buf))
        self.buf, self.in_call, self.started = "", False, None
        return out


def _parse(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    return ToolCall("call_" + uuid.uuid4().hex[:24], obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def split(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: its content (outside the calls, stripped) and its calls."""
    p = CallParser()
    content = "".join(e.content for e in p.feed(text) + p.finish())
    return content.strip(), p.calls
