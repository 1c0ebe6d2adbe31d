"""Tool calls in the model's own format (runtime/tool_formats.py: Hermes' <tool_call> JSON, Llama 3.x's bare JSON,
Mistral's [TOOL_CALLS] list, ...): `grammar` holds the model to it (llguidance's Lark, each call's arguments to its
tool's JSON Schema), `CallParser` turns the streamed text into content and OpenAI's tool calls.

Nothing but text reaches content (docs/formats.md): a call goes out once it is complete, and the markup of a call
the token budget cut, or of one that does not parse, is dropped, never sent as text.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from ..runtime.generate import stop_prefix
from ..runtime.grammar import JSON_OPTIONS
from ..runtime.tokenizer import ToolCall
from ..runtime.tool_formats import FORMATS, ThinkFormat, ToolFormat

log = logging.getLogger("specrt.server")
HERMES = FORMATS[-1]
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
TEXT = "TEXT: /(.|\\n)*/\n"


def _arguments(tool: dict) -> dict:
    return {**(tool.get("parameters") or NO_PARAMETERS), "x-guidance": JSON_OPTIONS}


def call_schema(tools: list[dict], key: str = "arguments") -> dict:
    """One call's JSON: {"name": one of the tools, key: that tool's parameters}."""
    shapes = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                 key: t.get("parameters") or NO_PARAMETERS},
               "required": ["name", key], "additionalProperties": False} for t in tools]
    return {**(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}), "x-guidance": JSON_OPTIONS}


def grammar(tools: list[dict], required: bool, parallel: bool = True, literal=json.dumps,
            fmt: ToolFormat = HERMES, think: ThinkFormat | None = None, inside: bool = False) -> str:
    """The Lark grammar of a reply: text, or text then calls that end the turn (required False: OpenAI's "auto"),
    or calls alone (required: "required" or a named function, whose one tool is then `tools`); one call when not
    parallel (or the format has room for one). tools: [{"name", "parameters"}]. literal: how the grammar writes a
    marker (GrammarTokenizer.literal: a special token as itself). think: a thinking model's markers, its reasoning
    first (inside: the prompt opened the block)."""
    one = f'%json {json.dumps(call_schema(tools, fmt.key))}'
    if fmt.named:  # name, the separator, then that tool's arguments
        sep = literal(fmt.named)
        one = "(" + " | ".join(f'{json.dumps(t["name"])} {sep} %json {json.dumps(_arguments(t))}'
                               for t in tools) + ")"
    pad = f' {json.dumps(fmt.pad)}' if fmt.pad else ""
    close = f' {literal(fmt.close)}' if fmt.close else ""
    many = parallel and fmt.parallel
    if fmt.listed:
        more = f' (", " {one})*' if many else ""
        rest = f'{pad} "[" {one}{more} "]"{pad}{close}'
    else:
        block = f'{pad} {one}{pad}{close}'
        between = f'{json.dumps(fmt.between)} ' if fmt.between else ""
        rest = f'{block} ({between}{literal(fmt.open)} {block})*' if many and fmt.open else block
    pre, rules = _thinking(think, inside, literal)
    head = '%llguidance {}\n' + rules
    if not fmt.open:  # a bare JSON object at the reply's start is a call; any other reply is text
        return head + (f'start: {pre}{rest}\n' if required else f'start: {pre}({rest} | TEXT?)\n' + BARE)
    open_ = literal(fmt.open)
    if required:
        return head + f'start: {pre}{open_} {rest}\n'
    bare, text = _bare(fmt, tools)
    if not open_.startswith('"'):  # a special token ends the text by itself (llguidance's StructTag does the same)
        return head + f'start: {pre}(TEXT ({open_} {rest})?{bare[0]})\n' + bare[1] + text
    return head + f'start: {pre}(TEXT | trig {rest}{bare[0]})\ntrig[lazy]: TEXT {open_}\n' + bare[1] + text


BARE = 'TEXT: /[^{](.|\\n)*/\n'  # text that is not a bare JSON call


def _bare(fmt: ToolFormat, tools: list[dict]) -> tuple[tuple[str, str], str]:
    """Under "auto", a reply that is one call in a shape of fmt.bare (docs/formats.md#bare-calls): its alternative
    and rules, and the TEXT that starts as none of them (a reply opening like one is held to a call)."""
    if not fmt.bare:
        return ("", ""), TEXT
    shapes = " | ".join(" ".join([json.dumps(b)] * bool(b) + ["bare_call"] + [json.dumps(a)] * bool(a))
                        for b, a in fmt.bare)
    rules = f'bare: {shapes}\nbare_call: %json {json.dumps(call_schema(tools, fmt.key))}\n'
    return (" | bare", rules), f'TEXT: /(.|\\n)*/ & ~/{_bare_start(fmt)}(.|\\n)*/\n'


def _bare_start(fmt: ToolFormat) -> str:
    """The regex of a reply's start that may be a bare call (fmt.bare): text opening so is not text."""
    leads = sorted({_escape(b.strip()) for b, _ in fmt.bare if b.strip()})
    return f"[ \\n]*({'|'.join(leads)})?[ \\n]*\\{{" if leads else "[ \\n]*\\{"


def _escape(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$*+?{}[]|()/" else c for c in text)


def _thinking(think: ThinkFormat | None, inside: bool, literal) -> tuple[str, str]:
    """The start of a reply that may reason first (llguidance reads added tokens such as Qwen3's <think> as
    special: no text lexeme makes them, so the grammar names them), and its rules."""
    if think is None:
        return "", ""
    opening = "" if inside else literal(think.open) + " "
    rules = (f'think: {opening}THINK {literal(think.close)} SPACE\n'
             f'THINK: /(.|\\n)*/ & ~/(.|\\n)*{_escape(think.close)}(.|\\n)*/\nSPACE: /[ \\n]*/\n')
    return ("think " if inside else "think? "), rules


def text_grammar(fmt: ToolFormat = HERMES, think: ThinkFormat | None = None, inside: bool = False,
                 literal=json.dumps) -> str:
    """A reply of text that never opens a call (tool_choice "none" with tools given: the model may still try)."""
    pre, rules = _thinking(think, inside, literal)
    if not fmt.open:
        return f'%llguidance {{}}\n{rules}start: {pre}TEXT?\n' + BARE
    bare = f' & ~/{_bare_start(fmt)}(.|\\n)*/' if fmt.bare else ""
    return (f'%llguidance {{}}\n{rules}start: {pre}TEXT\n'
            f'TEXT: /(.|\\n)*/ & ~/(.|\\n)*{_escape(fmt.open)}(.|\\n)*/{bare}\n')


@dataclass
class Event:
    """One thing to send: content text, reasoning text, or a call (complete: `start` is it, `arguments` its
    arguments)."""

    content: str = ""
    reasoning: str = ""
    start: ToolCall | None = None
    arguments: str = ""
    call: ToolCall | None = None
    index: int = 0  # of the call, in the reply's calls


class CallParser:
    """Feed the text deltas of a reply; each feed gives the events to send now. Text that may still become the
    format's opening marker is held back, as a stop string's prefix is; a call goes out whole once its markup ends
    (its closing marker, or the end of its JSON where the format has none). `cut` is set when finish() dropped the
    markup of a call the reply ended inside."""

    def __init__(self, fmt: ToolFormat = HERMES, names=()):
        self.fmt, self.buf, self.in_call, self.calls = fmt, "", False, []
        self.at_start, self.cut, self.space = True, False, ""
        self.names = frozenset(names)  # the tools a bare call may name (fmt.bare)
        self.leading = bool(fmt.bare and fmt.open and names)  # the reply's start: it may still be a bare call
        self.fenced = bool(fmt.fenced and fmt.open and names)  # a fenced block may be a call (fmt.fenced)
        self.code = False  # inside a fenced block that is text: the next fence closes it

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        out: list[Event] = []
        while True:
            if self.leading:
                text = self.buf.lstrip()
                got = [bare_call(text, before, after, self.fmt, self.names) for before, after in self.fmt.bare]
                done = next((g for g in got if isinstance(g, tuple)), None)
                if done is None and (not text or WAIT in got):
                    return out
                self.leading = False
                if done is not None:  # a call; text after it (none under the grammar) is read as usual
                    self.buf = text[done[0]:]
                    self._add([done[1]], out)
                continue
            if self.in_call:
                end = self._end()
                if end < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:end], self.buf[end:], False
                self._parsed(body, out)
                continue
            if not self.fmt.open:  # bare JSON: a call only at the reply's start
                if self.at_start:
                    if not self.buf.strip():
                        return out
                    self.at_start, self.buf = False, self.buf.lstrip()
                    if self.buf.startswith("{"):
                        self.in_call = True
                        continue
                self._text(self.buf, out)
                self.buf = ""
                return out
            start = self.buf.find(self.fmt.open)
            fence = self.buf.find(FENCE) if self.fenced else -1
            if fence >= 0 and (start < 0 or fence < start):
                self._text(self.buf[:fence], out)
                self.buf = self.buf[fence:]
                if not self._fence(out):
                    return out
                continue
            if start >= 0:
                self._text(self.buf[:start], out)
                self.buf, self.in_call = self.buf[start + len(self.fmt.open):], True
                continue
            keep = stop_prefix(self.buf, (self.fmt.open,) + (FENCE,) * self.fenced)
            self._text(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def _fence(self, out: list) -> bool:
        """buf opens with a fence: a call's block goes out as the call, a block that is not one (or its closing
        fence) as text; False while it may still be a call (held back)."""
        got = None if self.code else fenced_call(self.buf, self.fmt, self.names)
        if got == WAIT:
            return False
        if got is None:  # text, up to the fence that closes it
            self._text(FENCE, out)
            self.buf, self.code = self.buf[len(FENCE):], not self.code
            return True
        self.buf = self.buf[got[0]:]
        self._add([got[1]], out)
        return True

    def _text(self, text: str, out: list) -> None:
        """Content; after a call, whitespace waits for text (the newlines between calls are markup)."""
        if self.calls:
            self.space += text
            if not self.space.strip():
                return
            text, self.space = self.space, ""
        if text:
            out.append(Event(content=text))

    def _end(self) -> int:
        """Where the markup that started ends in buf (after its closing marker, or its JSON), or -1 (not yet)."""
        if self.fmt.close:
            i = self.buf.find(self.fmt.close)
            return i + len(self.fmt.close) if i >= 0 else -1
        i = len(self.buf) - len(self.buf.lstrip())
        if self.fmt.named:  # the arguments' JSON starts after the name and the separator
            i = self.buf.find(self.fmt.named)
            if i < 0:
                return -1
            i += len(self.fmt.named)
        try:
            return json.JSONDecoder().raw_decode(self.buf, i)[1]
        except json.JSONDecodeError:
            return -1

    def _parsed(self, body: str, out: list) -> None:
        calls = parse_calls(body.removesuffix(self.fmt.close), self.fmt)
        if calls is None:  # without a grammar only: markup that is not a call is dropped, never spoken
            log.warning("dropped tool-call markup that does not parse as the '%s' format", self.fmt.name)
            return
        self._add(calls, out)

    def _add(self, calls: list[ToolCall], out: list) -> None:
        for call in calls:
            i = len(self.calls)
            self.calls.append(call)
            out += [Event(start=call, index=i), Event(arguments=call.arguments, index=i), Event(call=call)]

    def finish(self, cut: bool = False) -> list[Event]:
        """The events still held at the end. cut: the token budget ended the reply; then a held tail that may open
        a call (or the whitespace after one, before the next) is markup too. A call the reply ended inside is dropped
        (`cut` set)."""
        out = []
        if self.leading and self.buf.strip() and (cut or names_a_tool(self.buf, self.names)):
            self.cut = True  # a bare call cut short, or one that never parsed: markup, never spoken
            if not cut:
                log.warning("dropped a bare tool call that does not parse as the '%s' format", self.fmt.name)
        elif self.in_call or (cut and ((self.buf and self.fmt.open) or self.space)):
            self.cut = True
        elif self.fenced and not self.code and self.buf.startswith(FENCE) and names_a_tool(self.buf, self.names):
            self.cut = True  # a fenced call that never closed or never parsed: markup, never spoken
            log.warning("dropped a fenced tool call that does not parse as the '%s' format", self.fmt.name)
        elif not (self.fmt.open == "" and self.at_start):
            self._text(self.buf, out)
        self.buf, self.in_call, self.space = "", False, ""
        return out


def parse_calls(body: str, fmt: ToolFormat) -> list[ToolCall] | None:
    """The calls of one block of markup (between the markers), or None when it is not calls in the format."""
    if fmt.named:
        name, _, body = body.partition(fmt.named)
        body = '{"name": ' + json.dumps(name.strip()) + f', "{fmt.key}": ' + body + "}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = obj if fmt.listed and isinstance(obj, list) else [obj] if not fmt.listed else []
    calls = []
    for o in items:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str) or not isinstance(o.get(fmt.key), dict):
            return None
        calls.append(ToolCall(fmt.new_id(), o["name"], json.dumps(o[fmt.key], ensure_ascii=False)))
    return calls or None


WAIT = "wait"
_KEY = re.compile(r'\{\s*"((?:[^"\\]|\\.)*)"\s*:\s*')  # an object's first key
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None


def bare_call(text: str, before: str, after: str, fmt: ToolFormat, names) -> tuple[int, ToolCall] | str | None:
    """Whether a reply's start (text, stripped on the left) is one bare call of a known tool in the shape `before`
    JSON `after` (whitespace between them free): (its end in text, the call); WAIT while it may still be one; None
    when it is not (docs/formats.md#bare-calls: a known tool's name and an arguments object, or it stays text)."""
    lead = before.strip()
    if not text.startswith(lead):
        return WAIT if lead.startswith(text) else None
    i = len(text) - len(text[len(lead):].lstrip())
    if i == len(text) or text[i] != "{":
        return WAIT if i == len(text) else None
    key = _KEY.match(text, i)
    if key is None:  # '{{' is not this shape (it is the doubled one); a key still being written may be
        more = text[i + 1:].lstrip()
        return WAIT if not more or more[0] == '"' else None
    if _string(key[1]) not in ("name", fmt.key):
        return None
    name = _NAME.match(text, key.start(1) - 1)
    if name is not None and _string(name[1]) not in names:
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(text, i)
    except json.JSONDecodeError:
        return WAIT  # not complete yet (or never: finish() decides)
    if not (isinstance(obj.get("name"), str) and obj["name"] in names and isinstance(obj.get(fmt.key), dict)):
        return None
    rest, tail = text[end:].lstrip(), after.strip()
    if not rest.startswith(tail):
        return WAIT if tail.startswith(rest) else None
    call = ToolCall(fmt.new_id(), obj["name"], json.dumps(obj[fmt.key], ensure_ascii=False))
    return len(text) - len(rest) + len(tail), call


FENCE = "```"  # a Markdown fence, its info string (fmt.fenced) on the rest of its line


def fenced_call(text: str, fmt: ToolFormat, names) -> tuple[int, ToolCall] | str | None:
    """Whether text, opening with a fence, is one call of a known tool fenced (docs/formats.md#fenced-calls): (the
    end of its closing fence in text, the call); WAIT while it may still be one; None when it is not."""
    line, newline, body = text[len(FENCE):].partition("\n")
    if not newline:
        return WAIT if any(t.startswith(line.strip()) for t in fmt.fenced) else None
    if line.strip() not in fmt.fenced:
        return None
    inner = body.lstrip()
    got = bare_call(inner, "", FENCE, fmt, names)
    return (len(text) - len(inner) + got[0], got[1]) if isinstance(got, tuple) else got


def names_a_tool(text: str, names) -> bool:
    return any(_string(m[1]) in names for m in _NAME.finditer(text))


def split(text: str, fmt: ToolFormat = HERMES, cut: bool = False, names=()) -> tuple[str, list[ToolCall], bool]:
    """A whole reply: its content (outside the calls, stripped), its calls (a bare one naming one of `names`), and
    whether markup was cut."""
    p = CallParser(fmt, names)
    content = "".join(e.content for e in p.feed(text) + p.finish(cut))
    return content.strip(), p.calls, p.cut
