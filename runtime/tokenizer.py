"""Text <-> token ids with `tokenizers`, chat formatting with jinja2 (the template the model ships)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ..errors import SpecrtError, first_line
from .tool_formats import FORMATS, ThinkFormat, ToolFormat, detect, detect_thinking

HERMES = FORMATS[-1]


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made: OpenAI's id, the function's name and its arguments (a JSON object's text)."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()   # an assistant turn's calls
    tool_call_id: str | None = None         # a role "tool" turn: the call it answers


def tool_call_text(call: ToolCall) -> str:
    """A call as the Hermes format writes it."""
    return HERMES.calls_text([call])


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    """transformers' `tojson` for chat templates (jinja2's own escapes <, > and & as HTML)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def parse_messages(raw) -> list[Message]:
    """Validate a chat as [{"role": ..., "content": ...}, ...] with one-line errors."""
    if not isinstance(raw, list) or not raw:
        raise SpecrtError('messages must be a non-empty JSON list like [{"role": "user", "content": "Hi"}]')
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SpecrtError(f'message {i} must be an object with string "role" and "content"')
        out.append(Message(m["role"], m["content"]))
    if not any(m.content.strip() for m in out):  # as `--prompt ""` is
        raise SpecrtError("the messages are empty (every \"content\" is blank); put some text in them")
    return out


def load_messages_file(path: Path) -> list[Message]:
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")  # -sig: files saved with a BOM (Windows editors) too
    except FileNotFoundError:
        raise SpecrtError(f"messages file '{path}' not found; pass an existing JSON file") from None
    except IsADirectoryError:
        raise SpecrtError(f"messages file '{path}' is a folder; pass a JSON file") from None
    except OSError as e:
        raise SpecrtError(f"messages file '{path}' cannot be read ({e.strerror or e}); "
                          "pass a readable JSON file") from None
    except UnicodeDecodeError:
        raise SpecrtError(f"messages file '{path}' is not UTF-8; re-save it as UTF-8") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecrtError(f"messages file '{path}' is not valid JSON (line {e.lineno}: {e.msg}); "
                          "fix the file") from None
    return parse_messages(raw)


class TextCodec:
    grammar_tokenizer = None  # grammar.grammar_tokenizer's, built on first use

    def __init__(self, tokenizer_file: Path, chat_template: str | None, bos_token: str | None,
                 eos_token_ids: tuple[int, ...]):
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable or malformed files
            raise SpecrtError(f"tokenizer '{tokenizer_file}' cannot be loaded ({first_line(e)}); "
                              "rebuild the engine set with `specrt engines`") from None
        self.eos_token_ids = frozenset(eos_token_ids)
        # the first stop id is the tokenizer's own eos, what a template's eos_token means (export/stops.py)
        self._eos_token = self.tokenizer.id_to_token(eos_token_ids[0]) if eos_token_ids else ""
        self.bos_token = bos_token
        self._template = None
        if chat_template:
            from jinja2 import TemplateSyntaxError, meta
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now  # transformers gives templates today's date (Llama 3.x)
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(chat_template)
                self.template_variables = frozenset(meta.find_undeclared_variables(env.parse(chat_template)))
                self.template_takes_tools = "tools" in self.template_variables
                self.template_renders_calls = "tool_calls" in chat_template
            except TemplateSyntaxError as e:
                raise SpecrtError(f"the chat template does not parse (line {e.lineno}: {e.message}); rebuild the "
                                  "engine set with `specrt engines`") from None
        self.keep: frozenset[int] = frozenset()
        self.think: ThinkFormat | None = detect_thinking(chat_template, self.template_variables)
        self.use_format(detect(chat_template, self._one_token))

    template_variables: frozenset[str] = frozenset()  # what the chat template reads: chat_template_kwargs' keys
    template_takes_tools = False
    template_renders_calls = False

    def _one_token(self, text: str) -> bool:
        return self.tokenizer.token_to_id(text) is not None

    def use_format(self, fmt: ToolFormat) -> None:
        """The tool-call format prompts are rendered in and replies read in (tool_formats.py); its markers that are
        special tokens are kept in decoded text, where the parser finds them."""
        self.tool_format = fmt
        marks = (fmt.open, fmt.close, fmt.named) + ((self.think.open, self.think.close) if self.think else ())
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        self.keep = frozenset(special.intersection(self.tokenizer.token_to_id(m) for m in marks if m))

    def render_chat(self, messages: list[Message], tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """The prompt of a chat; tools: OpenAI's [{"type": "function", "function": {...}}], given to a template that
        takes them, else written in the tool-call format's own prompt (tool rounds in the history likewise);
        kwargs: more variables for the template (a request's chat_template_kwargs, --reasoning off's switch)."""
        if self._template is None:
            return self.plain_prompt("".join(m.content for m in messages))
        fmt = self.tool_format
        if self.template_takes_tools:
            rows = [_template_row(m, None if self.template_renders_calls else fmt) for m in messages]
            extra = {"tools": tools} if tools else {}
        else:
            rows, extra = _prompted_rows(messages, tools, fmt), {}
        return self._template.render(**(kwargs or {}), messages=rows, add_generation_prompt=True,
                                     bos_token=self.bos_token or "", eos_token=self._eos_token or "", **extra)

    def plain_prompt(self, text: str) -> str:
        """A prompt no chat template wrote, led by what the tokenizer itself puts before a text (Gemma's and Llama's
        <bos>; nothing for most ChatML models), as transformers and llama.cpp encode a raw prompt."""
        return self._lead + text

    @functools.cached_property
    def _lead(self) -> str:
        bare = self.tokenizer.encode("x", add_special_tokens=False).ids
        full = self.tokenizer.encode("x", add_special_tokens=True).ids
        k = next((k for k in range(len(full) - len(bare) + 1) if full[k:k + len(bare)] == bare), 0)
        return self.tokenizer.decode(full[:k], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        ids = list(ids)
        if not self.keep.intersection(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        out, start = [], 0  # the format's markers are special tokens: decoded as text, the rest as before
        for i, t in enumerate(ids + [-1]):
            if t in self.keep or t == -1:
                out.append(self.tokenizer.decode(ids[start:i], skip_special_tokens=True))
                out.append(self.tokenizer.id_to_token(t) if t != -1 else "")
                start = i + 1
        return "".join(out)


def _template_row(m: Message, fmt: ToolFormat | None = None) -> dict:
    """A message as chat templates read it (transformers' convention: a call's arguments as an object); fmt: a
    template that shows tools but not calls (Granite 3.3's) gets them in the turn's text, as the model wrote them."""
    row = {"role": m.role, "content": m.content}
    if m.tool_calls and fmt is not None:
        row["content"] = "\n".join([m.content] * bool(m.content) + [fmt.calls_text(m.tool_calls)])
    elif m.tool_calls:
        row["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        row["tool_call_id"] = m.tool_call_id
    return row


def _prompted_rows(messages: list[Message], tools: list[dict] | None, fmt: ToolFormat) -> list[dict]:
    """Tools and tool rounds for a template that knows neither, in the format's own words: the tool list in the
    system turn (or the first user turn), calls in the assistant's text, results as the format's result turns (the
    Hermes format's: `tool` turns in <tool_response> tags; a small model echoes them back when they come as user
    turns: docs/runtime-notes.md, "Tool calls")."""
    rows = []
    for m in messages:
        if m.tool_calls:
            rows.append({"role": m.role, "content": "\n".join([m.content] * bool(m.content)
                                                              + [fmt.calls_text(m.tool_calls)])})
        elif m.role == "tool":
            rows.append({"role": fmt.result_role, "content": fmt.result.format(content=m.content)})
        else:
            rows.append({"role": m.role, "content": m.content})
    if tools:
        prompt = fmt.prompt.format(tools="\n".join(_tojson(t) for t in tools))
        at = next((i for i, r in enumerate(rows) if r["role"] == fmt.prompt_turn), None)
        if at is not None and (fmt.prompt_turn == "user" or at == 0):
            rows[at] = {"role": rows[at]["role"], "content": f"{rows[at]['content']}\n\n{prompt}"
                        if fmt.prompt_turn == "system" else f"{prompt}\n\n{rows[at]['content']}"}
        else:
            rows.insert(0, {"role": "system", "content": prompt})
    return rows


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _raise(message: str):
    raise SpecrtError(f"chat template rejected the messages: {message}")


class Detokenizer:
    """Incremental text deltas in O(1) per token: each push decodes a short window of recent ids, not
    the whole output (the scheme of vLLM's incremental detokenizer). An incomplete UTF-8 character
    (decoded as U+FFFD) is held back until the token that completes it arrives.

    prefix..read: ids whose text was already emitted and that stay as context for the next decode
    (so a tokenizer's leading-space rules see the same neighbours); read..: ids not emitted yet.
    """

    CONTEXT = 5  # ids kept as left context

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.emitted = codec, [], ""
        self._prefix = self._read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.codec.decode
        before = decode(self.ids[self._prefix:self._read])
        text = decode(self.ids[self._prefix:])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        delta = text[len(before):]
        self._read = len(self.ids)
        self._prefix = max(0, self._read - self.CONTEXT)
        self.emitted += delta
        return delta
