"""Text <-> token ids with `tokenizers`, chat formatting with jinja2 (the template the model ships)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ..errors import SpecrtError, first_line


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


# Tools for chat templates that take none (SmolLM2's): the Hermes function-calling prompt, which Qwen2.5's own template
# also writes, so one parser reads both (docs/runtime-notes.md, "Tool calls")
HERMES_TOOLS = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def tool_call_text(call: ToolCall) -> str:
    """A call as the Hermes format writes it."""
    return f'<tool_call>\n{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}\n</tool_call>'


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
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(chat_template)
                self.template_takes_tools = "tools" in meta.find_undeclared_variables(env.parse(chat_template))
            except TemplateSyntaxError as e:
                raise SpecrtError(f"the chat template does not parse (line {e.lineno}: {e.message}); rebuild the "
                                  "engine set with `specrt engines`") from None

    template_takes_tools = False

    def render_chat(self, messages: list[Message], tools: list[dict] | None = None) -> str:
        """The prompt of a chat; tools: OpenAI's [{"type": "function", "function": {...}}], given to a template that
        takes them, else written into the system turn as the Hermes prompt (tool rounds in the history likewise)."""
        if self._template is None:
            return self.plain_prompt("".join(m.content for m in messages))
        if self.template_takes_tools:
            rows = [_template_row(m) for m in messages]
            extra = {"tools": tools} if tools else {}
        else:
            rows, extra = _hermes_rows(messages, tools), {}
        return self._template.render(messages=rows, add_generation_prompt=True, bos_token=self.bos_token or "",
                                     eos_token=self._eos_token or "", **extra)

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
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _template_row(m: Message) -> dict:
    """A message as chat templates read it (transformers' convention: a call's arguments as an object)."""
    row = {"role": m.role, "content": m.content}
    if m.tool_calls:
        row["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        row["tool_call_id"] = m.tool_call_id
    return row


def _hermes_rows(messages: list[Message], tools: list[dict] | None) -> list[dict]:
    """Tools and tool rounds for a template that knows neither: the tool list in the system turn, calls in the
    assistant's text, results as `tool` turns in <tool_response> tags (Hermes 2 Pro's format; a small model echoes
    them back when they come as user turns, as Qwen2.5's template writes them: docs/runtime-notes.md, "Tool calls")."""
    rows = []
    for m in messages:
        if m.tool_calls:
            text = "\n".join([m.content] * bool(m.content) + [tool_call_text(c) for c in m.tool_calls])
            rows.append({"role": m.role, "content": text})
        elif m.role == "tool":
            rows.append({"role": "tool", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        else:
            rows.append({"role": m.role, "content": m.content})
    if tools:
        prompt = HERMES_TOOLS.format(tools="\n".join(_tojson(t) for t in tools))
        if rows and rows[0]["role"] == "system":
            rows[0] = {"role": "system", "content": f"{rows[0]['content']}\n\n{prompt}"}
        else:
            rows.insert(0, {"role": "system", "content": prompt})
    return rows


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
