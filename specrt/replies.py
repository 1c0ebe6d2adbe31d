"""A chat reply read as it streams: reasoning between the chat template's think markers, tool calls in the model's
format (tool_calls.py), and the text left, which alone is content (docs/formats.md, "Nothing but text in content").
"""

from __future__ import annotations

from .errors import SpecrtError
from .openai_api import ApiError, GenRequest
from .runtime.generate import stop_prefix
from .runtime.tool_formats import ThinkFormat, ToolFormat
from .tool_calls import CallParser, Event, grammar, text_grammar

# the chat template's variables the server sets itself (TextCodec.render_chat)
SERVER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                              "raise_exception", "strftime_now"})


def request_grammar(session, req: GenRequest):
    """The matcher a request's reply is held to: its tool calls in the model's format, its response_format, or
    (tool_choice "none" with tools given) text that never opens a call; None when free. A 400 names what does not
    compile."""
    for where, source in req.tool_grammars:  # each tool's own error names it
        _compile(session, source, f"{where}: its parameters", "tools")
    fmt = session.codec.tool_format
    if req.call_tools:
        source = grammar(list(req.call_tools), req.call_required, req.call_parallel, session.grammar_literal, fmt)
        return _compile(session, source, "tools", "tools")
    if req.grammar is not None:
        return _compile(session, req.grammar, "response_format", "response_format")
    if req.tool_grammars:  # a model that knows tools may still open a call
        return _compile(session, text_grammar(fmt), "tools", "tools")
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


def open_reply(codec, req: GenRequest, tools, kwargs) -> Reply | None:
    """The reader of a chat reply that may think or call tools; None for plain text."""
    if not (req.parse_calls or codec.think is not None):
        return None
    # a template may end the prompt inside the think block (the reply then starts with reasoning, unmarked)
    inside = codec.think is not None and codec.render_chat(req.prompt, tools, kwargs).rstrip().endswith(
        codec.think.open)
    return Reply(codec.think, inside, codec.tool_format if req.parse_calls else None)


class ThinkSplitter:
    """Splits deltas into ("reasoning", text) and ("text", text): one think block, at the reply's start (or from the
    first token, where the prompt ends inside one: `inside`); prefixes of a marker are held back."""

    def __init__(self, think: ThinkFormat, inside: bool = False):
        self.t, self.inside, self.buf = think, inside, ""
        self.done = False   # the block is over (or the reply began with text): the rest is text
        self.lead = True    # whitespace after the block is the template's, not the answer's

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        out: list[tuple[str, str]] = []
        while True:
            if self.inside:
                i = self.buf.find(self.t.close)
                if i >= 0:
                    out.append(("reasoning", self.buf[:i]))
                    self.buf, self.inside, self.done = self.buf[i + len(self.t.close):], False, True
                    continue
                keep = len(self.buf) - stop_prefix(self.buf, (self.t.close,))
                out.append(("reasoning", self.buf[:keep]))
                self.buf = self.buf[keep:]
                return [p for p in out if p[1]]
            if not self.done:
                head = self.buf.lstrip()
                if head.startswith(self.t.open):
                    self.buf, self.inside = head[len(self.t.open):], True
                    continue
                if self.t.open.startswith(head):  # may still open the block
                    return [p for p in out if p[1]]
                self.done, self.lead = True, False
            if self.lead:
                self.buf = self.buf.lstrip()
                self.lead = not self.buf
            out.append(("text", self.buf))
            self.buf = ""
            return [p for p in out if p[1]]

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end: reasoning the reply ended inside, or text (a held prefix of the open marker)."""
        rest, self.buf = self.buf, ""
        if self.inside:
            return [("reasoning", rest)] if rest else []
        return [("text", rest)] if rest.strip() else []


class Reply:
    """Events of a chat reply: Event(reasoning=...), Event(content=...) and the calls' events (CallParser)."""

    def __init__(self, think: ThinkFormat | None, inside: bool = False, fmt: ToolFormat | None = None):
        self.think = ThinkSplitter(think, inside) if think is not None else None
        self.parser = CallParser(fmt) if fmt is not None else None
        self.reasoning, self.inside = "", inside

    @property
    def calls(self):
        return self.parser.calls if self.parser is not None else []

    def feed(self, delta: str) -> list[Event]:
        return self._route(self.think.feed(delta) if self.think is not None else [("text", delta)])

    def finish(self, cut: bool) -> list[Event]:
        out = self._route(self.think.finish() if self.think is not None else [])
        return out + (self.parser.finish(cut) if self.parser is not None else [])

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
        return out

    def reasoning_tokens(self, decode, ids: list[int]) -> int | None:
        return None if self.think is None else reasoning_tokens(decode, ids, self.think.t, self.inside)

    def whole(self, text: str, cut: bool) -> tuple[str, str, list]:
        """A whole reply: its content (stripped), its reasoning (stripped) and its calls."""
        events = self.feed(text) + self.finish(cut)
        return "".join(e.content for e in events).strip(), self.reasoning.strip(), self.calls


def cut(result) -> bool:
    """The token budget or the context ended the reply."""
    return result.stats.finish_reason in ("length", "context")


def reasoning_tokens(decode, ids: list[int], think: ThinkFormat | None, inside: bool) -> int:
    """How many of a reply's tokens are its reasoning, markers included: up to the first whose text closes the
    think block (a binary search over decoded prefixes), all of them when the reply ended inside it."""
    if think is None or not ids:
        return 0
    text = decode(ids)
    if not inside and not text.lstrip().startswith(think.open):
        return 0
    if think.close not in text:
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if think.close in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
