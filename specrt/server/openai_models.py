"""OpenAI's request bodies as pydantic models (ChatRequest, CompletionRequest), and first_error(): the param and
one-line message a client gets for a body that is neither.

Strict ("12" is not an integer, 1 not a boolean); unknown fields are ignored, as OpenAI's clients send a few (user,
metadata, ...); a top-level null is the default. Fields we cannot honour (n > 1, logprobs, penalties) are refused,
never ignored. A validator's ValueError is the message, "{where}" the field's path; pydantic's errors are worded by
SCALARS, the field's range or WHAT.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic import model_validator

MAX_STOPS = 4  # OpenAI's limit
ROLES = ("system", "developer", "user", "assistant", "tool")
CONTENT = "{where} must be a string or a list of text parts; only text is supported"
ARGUMENTS = "{where} must be a JSON object in a string, like '{\"party\": 4}'"
PROMPT = "'prompt' must be a string (or a list of one string); token arrays and batches are not supported"


class Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _check(ok, message) -> AfterValidator:
    """Refuses a value ok() rejects, with message (or message(value))."""
    def check(v):
        if not ok(v):
            raise ValueError(message(v) if callable(message) else message)
        return v
    return AfterValidator(check)


Omit = Annotated[Any, _check(lambda v: not v, "{where} is not supported; omit it")]
Off = Annotated[Any, _check(lambda v: v == 0, "{where} is not supported; omit it")]  # false or 0
Zero = Annotated[Any, _check(lambda v: v == 0, "{where} is not supported; omit it or pass 0")]
ChatOnly = Annotated[Any, _check(lambda v: False, "{where} belongs to /v1/chat/completions; /v1/completions takes a "
                                                  "raw prompt")]


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _tokens(v: int, info: ValidationInfo) -> int:
    hi = info.context["max_context"]  # the engine's, so not a Field(le=...)
    if not 1 <= v <= hi:
        raise ValueError(f"{{where}} must be in [1, {hi}], got {v}")
    return v


class TextPart(Model):
    type: Literal["text"]
    text: str


class Function(Model):
    name: str
    arguments: Annotated[str, _check(_is_object, ARGUMENTS)] = "{}"


class Call(Model):
    id: str
    function: Function


class ChatMessage(Model):
    role: Annotated[str, _check(ROLES.__contains__, lambda r: f"{{where}} '{r}' is not one of {', '.join(ROLES)}")]
    tool_calls: list[Call] | None = None
    tool_call_id: Any = None  # read for role "tool" only
    content: str | list[TextPart] | None = None  # null: an assistant turn that only calls tools

    @property
    def calls(self) -> list[Call]:
        return (self.tool_calls or []) if self.role == "assistant" else []

    @property
    def text(self) -> str:
        c = self.content or ""
        return c if isinstance(c, str) else "".join(p.text for p in c)


def _conversation(messages: list[ChatMessage]) -> list[ChatMessage]:
    if not messages:
        raise ValueError(WHAT[("messages",)])
    called = set()
    for i, m in enumerate(messages):
        called.update(c.id for c in m.calls)
        if m.role == "tool" and not isinstance(m.tool_call_id, str):
            raise ValueError(f"messages[{i}] (role 'tool') needs 'tool_call_id', the id of the call it answers")
        if m.role == "tool" and m.tool_call_id not in called:
            raise ValueError(f"messages[{i}].tool_call_id '{m.tool_call_id}' answers no earlier assistant tool call")
        if m.content is None and not m.calls:
            raise ValueError(CONTENT.replace("{where}", f"messages[{i}].content"))
    if not any(m.text.strip() or m.calls for m in messages):
        raise ValueError("the messages are empty (every 'content' is blank); put some text in them")
    return messages


class FunctionDef(Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function names
    parameters: Any = None  # a JSON Schema, checked by compiling its grammar


class Tool(Model):
    type: Literal["function"]
    function: FunctionDef


def _functions(tools: list[Tool]) -> list[Tool]:
    names = [t.function.name for t in tools]
    for i, (name, p) in enumerate(zip(names, (t.function.parameters for t in tools))):
        if name in names[:i]:
            raise ValueError(f"tools[{i}]: the function name '{name}' is given twice")
        if p is not None and (not isinstance(p, dict) or p.get("type", "object") != "object"):
            raise ValueError(f"tools[{i}] '{name}': 'parameters' must be a JSON Schema of an object "
                             "({\"type\": \"object\", \"properties\": {...}})")
    return tools


class NamedChoice(Model):
    type: Literal["function"]
    function: Function


class PlainFormat(Model):
    type: Literal["text", "json_object"]


class JsonSchema(Model):
    schema_: dict = Field(alias="schema")


class SchemaFormat(Model):
    type: Literal["json_schema"]
    json_schema: JsonSchema


class StreamOptions(Model):
    include_usage: bool | None = None


# The fields in three groups, in the order they are checked (a model's fields are its bases', the last base's first)
class _Refusals(Model):
    n: Annotated[int, Field(ge=1, le=1 << 31),
                 _check(lambda n: n == 1, "'n' must be 1: this server returns one choice per request")] = 1
    frequency_penalty: Zero = None
    presence_penalty: Zero = None
    logprobs: Off = None
    top_logprobs: Annotated[Any, _check(lambda v: False, "{where} is only allowed when 'logprobs' is true")] = None
    echo: Off = None
    functions: Omit = None
    function_call: Omit = None
    logit_bias: Omit = None
    suffix: Omit = None
    best_of: Annotated[Any, _check(lambda v: v == 1, "'best_of' must be 1 (one engine, one answer)")] = None

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, body):
        if isinstance(body, dict) and None in body.values():
            return {k: v for k, v in body.items() if v is not None}
        return body


class _Sampling(Model):
    max_tokens: Annotated[int | None, AfterValidator(_tokens)] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 31)  # not OpenAI's; vLLM's extension (-1 is not accepted)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str], AfterValidator(lambda s: (s,) if isinstance(s, str) else tuple(s)),
                    _check(lambda s: len(s) <= MAX_STOPS, lambda s: f"{{where}} takes at most {MAX_STOPS} strings, "
                                                                    f"got {len(s)}"),
                    _check(all, "{where} has an empty string, which would stop before any output")] = ()
    ignore_eos: bool = False

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, v, info: ValidationInfo):
        if not info.data.get("stream"):
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return v


class _Chat(Model):
    messages: Annotated[list[ChatMessage], AfterValidator(_conversation)]
    tools: Annotated[list[Tool], AfterValidator(_functions)] = ()  # a tuple: a list default is copied per request
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True
    response_format: PlainFormat | SchemaFormat | None = Field(None, discriminator="type")
    max_completion_tokens: Annotated[int | None, AfterValidator(_tokens)] = None
    chat_template_kwargs: dict | None = None  # each key checked against the template's variables (app.py)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _with_tools(cls, v, info: ValidationInfo):
        if not info.data.get("tools"):
            raise ValueError("'tool_choice' is only allowed when 'tools' are given")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _known(cls, v, info: ValidationInfo):
        if isinstance(v, NamedChoice) and v.function.name not in {t.function.name for t in info.data["tools"]}:
            raise ValueError(f"'tool_choice' names the function '{v.function.name}', which is not in 'tools'")
        return v

    @field_validator("response_format")
    @classmethod
    def _without_calls(cls, v, info: ValidationInfo):
        if v.type != "text" and info.data.get("tools") and info.data.get("tool_choice") != "none":
            raise ValueError("'response_format' with tools that may be called is not supported yet; send "
                             "'tool_choice': \"none\" or omit one of them")
        return v


class _Prompt(Model):
    prompt: Annotated[str | list[str], _check(lambda p: isinstance(p, str) or len(p) == 1, PROMPT),
                      AfterValidator(lambda p: p if isinstance(p, str) else p[0]),
                      _check(str.strip, "{where} is empty; pass some text")]
    tools: ChatOnly = None
    tool_choice: ChatOnly = None
    response_format: ChatOnly = None
    chat_template_kwargs: ChatOnly = None


class ChatRequest(_Sampling, _Chat, _Refusals):
    pass


class CompletionRequest(_Sampling, _Prompt, _Refusals):
    pass


# what a field must be, where pydantic's words differ from ours: by path, a list's index as "*"
WHAT = {
    ("messages",): "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
    ("messages", "*"): "{where} must be an object with a string 'role' and 'content'",
    ("messages", "*", "content"): CONTENT,
    ("messages", "*", "tool_calls"): "{where} must be a list of {\"id\", \"type\": \"function\", \"function\"} objects",
    ("messages", "*", "tool_calls", "*"): "{where} needs a string 'id' and a 'function' with a string 'name'",
    ("messages", "*", "tool_calls", "*", "function", "arguments"): ARGUMENTS,
    ("tools",): "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects",
    ("tools", "*"): "{where} must be {\"type\": \"function\", \"function\": {\"name\": ...}}; only function tools are "
                    "supported",
    ("tools", "*", "function", "name"): "{where} must be 1-64 letters, digits, '_' or '-', got {got}",
    ("tool_choice",): "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}",
    ("response_format",): "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"json_schema\": {...}}",
    ("response_format", "json_schema"): "'response_format' json_schema needs 'json_schema': {\"name\": ..., "
                                        "\"schema\": {...}}",
    ("stream_options",): "'stream_options' must be an object like {\"include_usage\": true}",
    ("chat_template_kwargs",): "'chat_template_kwargs' must be an object like {\"enable_thinking\": false}",
    ("stop",): "'stop' must be a string or a list of strings",
    ("prompt",): PROMPT,
}
REQUIRED = {"messages": "'messages' is required: a non-empty list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
            "prompt": "'prompt' is required: a string"}
SCALARS = {"int_type": "an integer", "float_type": "a number", "finite_number": "a number",
           "bool_type": "true or false"}


def _where(loc: tuple) -> str:
    """A field's path as messages name it: 'stop' (a top-level field), messages[1].content (a nested one)."""
    if len(loc) == 1:
        return f"'{loc[0]}'"
    return str(loc[0]) + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:])


def first_error(e: ValidationError, model: type[Model]) -> tuple[str, str]:
    """The param and message of e's first error, in OpenAI's error style: one line naming the problem and the fix."""
    err = e.errors(include_url=False)[0]
    loc, kind, got = err["loc"], err["type"], err.get("input")
    param = str(loc[0])
    if kind == "value_error":
        return param, str(err["ctx"]["error"]).replace("{where}", _where(loc), 1)
    if kind == "missing" and len(loc) == 1:
        return param, REQUIRED[param]
    if kind in SCALARS:  # a nested one (stream_options.include_usage) is named as itself
        return str(loc[-1]), f"'{loc[-1]}' must be {SCALARS[kind]}, got {json.dumps(got)}"
    if kind in ("greater_than", "greater_than_equal", "less_than_equal"):
        b = {k: getattr(m, k) for m in model.model_fields[param].metadata for k in ("gt", "ge", "le") if hasattr(m, k)}
        lo, hi = (f"{x:g}" if isinstance(x, float) else x for x in (b.get("gt", b.get("ge")), b["le"]))
        return param, f"'{param}' must be in {'(' if 'gt' in b else '['}{lo}, {hi}], got {got}"
    for n in range(len(loc), 0, -1):
        what = WHAT.get(tuple("*" if isinstance(x, int) else x for x in loc[:n]))
        if what:
            got = json.dumps(None if kind == "missing" else got)
            return param, what.replace("{where}", _where(loc[:n]), 1).replace("{got}", got)
    return param, f"{_where(loc)}: {err['msg']}"
