"""Tool calls in the Hermes format (the one Qwen2.5's chat template and runtime/tokenizer.HERMES_TOOLS ask for):

    <tool_call>
    {"name": "book_table", "arguments": {"party": 4}}
    </tool_call>

`grammar` holds the model to it (llguidance's Lark, each call's arguments to its tool's JSON Schema); `CallParser`
turns the streamed text into content deltas and OpenAI's tool calls, holding back text that may open a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

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


@dataclass
class Event:
    content: str = ""
    call: ToolCall | None = None


class CallParser:
    """Feed the text deltas of a reply; each feed gives the content to send now and the calls completed. Text that
    may still become '<tool_call>' is held back, as a stop string's prefix is."""

    def __init__(self):
        self.buf, self.in_call, self.calls = "", False, []

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        out = []
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE):], False
                call = _parse(body)
                if call is None:  # not a call after all (only without a grammar): its text is content
                    out.append(Event(content=OPEN + body + CLOSE))
                else:
                    self.calls.append(call)
                    out.append(Event(call=call))
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(Event(content=self.buf[:start]))
                self.buf, self.in_call = self.buf[start + len(OPEN):], True
                continue
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                         if self.buf.endswith(OPEN[:k])), 0)
            if len(self.buf) > keep:
                out.append(Event(content=self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return out

    def finish(self) -> str:
        """The text still held at the end (an unfinished call, cut by max_tokens, is returned as text)."""
        rest = (OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        return rest


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
    content = "".join(e.content for e in p.feed(text)) + p.finish()
    return content.strip(), p.calls
