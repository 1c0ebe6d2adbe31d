"""A chat reply read as it streams: reasoning between the chat template's think markers, tool calls in the model's
format (tool_calls.py), and the text left, which alone is content (docs/formats.md, "Nothing but text in content").
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import SpecrtError
from .openai_api import ApiError, GenRequest
from ..runtime.generate import stop_prefix
from ..runtime.tokenizer import Detokenizer
from ..runtime.tool_formats import ThinkFormat, ToolFormat
from .tool_calls import CallParser, Event, grammar, text_grammar

# the chat template's variables the server sets itself (TextCodec.render_chat)
SERVER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                              "raise_exception", "strftime_now"})


def request_grammar(session, req: GenRequest, state: str = ""):
    """The matcher a request's reply is held to: its tool calls in the model's format, its response_format, or
    (tool_choice "none" with tools given) text that never opens a call; None when free. A 400 names what does not
    compile. A thinking model may reason first, unless its template turned that off (state: think_state)."""
    for where, source in req.tool_grammars:  # each tool's own error names it
        _compile(session, source, f"{where}: its parameters", "tools")
    fmt, literal, inside = session.codec.tool_format, session.grammar_literal, state == "inside"
    think = session.codec.think if state in ("inside", "free") else None
    if req.call_tools:
        source = grammar(list(req.call_tools), req.call_required, req.call_parallel, literal, fmt, think, inside)
        return _compile(session, source, "tools", "tools")
    if req.grammar is not None:
        return _compile(session, req.grammar, "response_format", "response_format")
    if req.tool_grammars:  # a model that knows tools may still open a call
        return _compile(session, text_grammar(fmt, think, inside, literal), "tools", "tools")
    return None


def _compile(session, source: str, what: str, param: str):
    try:
        return session.grammar(source)
    except SpecrtError as e:
        reason = str(e).removeprefix("the grammar does not compile: ")
        raise ApiError(400, f"{what} cannot be enforced: {reason}; fix the JSON Schema", param) from None


def template_kwargs(codec, asked: dict | None, reasoning: str) -> dict | None:
    """A request's chat_template_kwargs, each a variable the template reads (else a 400 naming it, never ignored),
    over --reasoning off's switch (the template's, where it has one)."""
    readable = sorted(codec.template_variables - SERVER_VARIABLES)
    for key in asked or {}:
        if key in SERVER_VARIABLES:
            raise ApiError(400, f"'chat_template_kwargs.{key}' is set by the server from the request; drop it",
                           "chat_template_kwargs")
        if key not in readable:
            reads = f"it reads {', '.join(readable)}" if readable else "it reads none"
            raise ApiError(400, f"'chat_template_kwargs.{key}' is not read by this model's chat template ({reads}); "
                           "drop it", "chat_template_kwargs")
    think = codec.think
    off = {think.switch: False} if reasoning == "off" and think and think.switch else {}
    return {**off, **(asked or {})} or None


def think_state(codec, req: GenRequest, tools, kwargs) -> str:
    """Where the prompt leaves a thinking model: "inside" a think block the template opened (the reply starts with
    reasoning, unmarked), "closed" (the template wrote an empty block: thinking is off), "free", or "" (it does
    not think)."""
    if not req.chat or codec.think is None:
        return ""
    think, end = codec.think, codec.render_chat(req.prompt, tools, kwargs).rstrip()
    if end.endswith(think.open) or end.endswith(think.close):
        return "inside" if end.endswith(think.open) else "closed"
    on = (kwargs or {}).get(think.switch, think.default_on) if think.switch else True
    return "free" if on else "closed"


def open_reply(codec, req: GenRequest, inside: bool) -> Reply | None:
    """The reader of a chat reply that may think or call tools; None for plain text."""
    if not (req.parse_calls or codec.think is not None):
        return None
    return Reply(codec.think, inside, codec.tool_format if req.parse_calls else None,
                 tuple(t["name"] for t in req.call_tools))


class ThinkSplitter:
    """Splits deltas into ("reasoning", text) and ("text", text): what is between the think markers is reasoning
    (from the first token where the prompt ends inside a block: `inside`), a stray closing marker is dropped, the
    whitespace after a block is the template's; prefixes of a marker are held back."""

    def __init__(self, think: ThinkFormat, inside: bool = False):
        self.t, self.inside, self.buf, self.lead = think, inside, "", True

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        out: list[tuple[str, str]] = []
        while True:
            if self.lead and not self.inside:
                self.buf = self.buf.lstrip()
            marks = (self.t.close,) if self.inside else (self.t.open, self.t.close)
            found = [(i, m) for m in marks if (i := self.buf.find(m)) >= 0]
            if found:
                i, mark = min(found)
                out.append(("reasoning" if self.inside else "text", self.buf[:i]))
                self.buf = self.buf[i + len(mark):]
                self.lead = self.inside or (self.lead and not out[-1][1])
                self.inside = mark == self.t.open
                continue
            keep = len(self.buf) - stop_prefix(self.buf, marks)
            out.append(("reasoning" if self.inside else "text", self.buf[:keep]))
            self.buf = self.buf[keep:]
            if out[-1][1] and not self.inside:
                self.lead = False
            return [p for p in out if p[1]]

    def finish(self, cut: bool = False) -> list[tuple[str, str]]:
        """What is held at the end: reasoning the reply ended inside, or a held prefix of a marker, text unless the
        budget cut it (cut: then it is markup)."""
        rest, self.buf = self.buf, ""
        if self.inside:
            return [("reasoning", rest)] if rest else []
        return [("text", rest)] if rest.strip() and not cut else []


class Reply:
    """Events of a chat reply: Event(reasoning=...), Event(content=...) and the calls' events (CallParser)."""

    def __init__(self, think: ThinkFormat | None, inside: bool = False, fmt: ToolFormat | None = None, names=()):
        self.think = ThinkSplitter(think, inside) if think is not None else None
        self.parser = CallParser(fmt, names) if fmt is not None else None  # names: the tools a bare call may name
        self.reasoning, self.inside = "", inside
        self.spoke = False  # content sent yet: the whitespace before the first of it is dropped, as whole() strips it

    @property
    def calls(self):
        return self.parser.calls if self.parser is not None else []

    def feed(self, delta: str) -> list[Event]:
        return self._route(self.think.feed(delta) if self.think is not None else [("text", delta)])

    def finish(self, cut: bool) -> list[Event]:
        out = self._route(self.think.finish(cut) if self.think is not None else [])
        held = self.parser.finish(cut) if self.parser is not None else []  # text held as a possible call's start
        return out + [e for e in map(self._lead, held) if e is not None]

    def _route(self, parts) -> list[Event]:
        out: list[Event] = []
        for kind, text in parts:
            if kind == "reasoning":
                self.reasoning += text
                out.append(Event(reasoning=text))
            elif self.parser is not None:
                out += self.parser.feed(text)
            else:
                out.append(Event(content=text))
        return [e for e in map(self._lead, out) if e is not None]

    def _lead(self, e: Event) -> Event | None:
        """The event with the reply's leading whitespace dropped from its content (a call's markup or a think block
        before the text leaves the template's blank lines; a voice agent would be sent them)."""
        if self.spoke or not e.content:
            return e
        text = e.content.lstrip()
        self.spoke = bool(text)
        return replace(e, content=text) if text or e.start or e.arguments or e.reasoning or e.call else None

    def reasoning_tokens(self, codec, ids: list[int]) -> int | None:
        return None if self.think is None else reasoning_tokens(codec, ids, self.think.t, self.inside)

    def whole(self, text: str, cut: bool) -> tuple[str, str, list]:
        """A whole reply: its content (stripped), its reasoning (stripped) and its calls."""
        events = self.feed(text) + self.finish(cut)
        return "".join(e.content for e in events).strip(), self.reasoning.strip(), self.calls


def cut(result) -> bool:
    """The token budget or the context ended the reply."""
    return result.stats.finish_reason in ("length", "context")


def reasoning_tokens(codec, ids: list[int], think: ThinkFormat | None, inside: bool) -> int:
    """How many of a reply's tokens are reasoning, markers included: those whose text falls in a think block (one
    the reply ended inside runs to its end)."""
    if think is None or not ids:
        return 0
    detok, ends = Detokenizer(codec), []
    for t in ids:
        detok.push(t)
        ends.append(len(detok.emitted))
    spans, text, at = [], detok.emitted, 0 if inside else -1
    while True:
        if at < 0 and (at := text.find(think.open)) < 0:
            break
        close = text.find(think.close, at)
        spans.append((at, len(text) if close < 0 else close + len(think.close)))
        if close < 0:
            break
        at = text.find(think.open, close)
        if at < 0:
            break
    n, start = 0, 0
    for end in ends:
        n += any(a <= start < b or (a < end and start < b) for a, b in spans)
        start = end
    return n
