"""OpenAI's requests for `specrt serve`, as plain functions (no web framework here).

parse() turns a request body into a GenRequest or raises ApiError (status, OpenAI's error JSON); the response
objects are openai_shapes.py's. Fields we cannot honour (n > 1, logprobs,
penalties) are refused with a 400 rather than ignored; unknown fields are ignored, as OpenAI's own clients send a
few (user, metadata, ...). Tools and `response_format` become a grammar (tool_calls.py, runtime/grammar.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from .errors import SpecrtError
from .runtime.grammar import json_schema_grammar
from .runtime.sampling import SamplingParams
from .runtime.tokenizer import Message, ToolCall

MAX_STOPS = 4  # OpenAI's limit
ROLES = ("system", "developer", "user", "assistant", "tool")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class GenRequest:
    chat: bool                          # /v1/chat/completions (else /v1/completions: a raw prompt)
    prompt: str | list[Message]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    tools: tuple[dict, ...] = ()        # the tools the prompt shows, as sent (none under tool_choice "none")
    parse_calls: bool = False           # the reply's <tool_call> blocks become tool_calls (tool_choice not "none")
    grammar: str | None = None          # the llguidance grammar of response_format's JSON Schema
    call_tools: tuple[dict, ...] = ()   # the tools a reply may call ({"name", "parameters"}; tool_calls.grammar)
    call_required: bool = False         # "required" or a named function: the reply is calls only
    call_parallel: bool = True          # more than one call
    tool_grammars: tuple[tuple[str, str], ...] = ()  # (where, grammar) of each tool's parameters, checked one by one


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be a number, got {json.dumps(v)}", name)
    if v < lo or (lo_open and v == lo) or v > hi:
        raise ApiError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(v)}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be in [{lo}, {hi}], got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def _content(m: dict, i: int, optional: bool = False) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}); optional: null too
    (an assistant turn that only calls tools)."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and optional:
        return ""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts; only text is supported",
                   "messages")


def _calls(raw, i: int) -> tuple[ToolCall, ...]:
    """An assistant turn's tool_calls, as OpenAI sends them back."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise ApiError(400, f"{where} must be a list of {{\"id\", \"type\": \"function\", \"function\"}} "
                            "objects", "messages")
    out = []
    for j, c in enumerate(raw):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(c.get("id"), str) or not isinstance(f.get("name"), str):
            raise ApiError(400, f"{where}[{j}] needs a string 'id' and a 'function' with a string 'name'",
                           "messages")
        args = f.get("arguments", "{}")
        try:
            ok = isinstance(json.loads(args), dict) if isinstance(args, str) else False
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise ApiError(400, f"{where}[{j}].function.arguments must be a JSON object in a string, like "
                                "'{\"party\": 4}'", "messages")
        out.append(ToolCall(c["id"], f["name"], args))
    return tuple(out)


def _messages(raw) -> list[Message]:
    if raw is None:
        raise ApiError(400, "'messages' is required: a non-empty list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
                       "messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out, called = [], set()
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role' and 'content'", "messages")
        role = m["role"]
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role '{role}' is not one of {', '.join(ROLES)}", "messages")
        calls = _calls(m["tool_calls"], i) if role == "assistant" and m.get("tool_calls") else ()
        called.update(c.id for c in calls)
        call_id = None
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"messages[{i}] (role 'tool') needs 'tool_call_id', the id of the call it answers",
                               "messages")
            if call_id not in called:
                raise ApiError(400, f"messages[{i}].tool_call_id '{call_id}' answers no earlier assistant tool call",
                               "messages")
        # `developer` is the system turn of OpenAI's newer models; templates know only `system`
        out.append(Message("system" if role == "developer" else role, _content(m, i, optional=bool(calls)),
                           calls, call_id))
    if not any(m.content.strip() or m.tool_calls for m in out):
        raise ApiError(400, "the messages are empty (every 'content' is blank); put some text in them", "messages")
    return out


def _tools(body: dict) -> tuple[tuple[dict, ...], list[dict]]:
    """OpenAI's `tools` as sent, and each one's {"name", "parameters"}."""
    raw = body.get("tools")
    if raw is None:
        return (), []
    if not isinstance(raw, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    out, seen = [], set()
    for i, t in enumerate(raw):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; only "
                                "function tools are supported", "tools")
        name = f.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ApiError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got "
                                f"{json.dumps(name)}", "tools")
        if name in seen:
            raise ApiError(400, f"tools[{i}]: the function name '{name}' is given twice", "tools")
        seen.add(name)
        params = f.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ApiError(400, f"tools[{i}] '{name}': 'parameters' must be a JSON Schema of an object "
                                "({\"type\": \"object\", \"properties\": {...}})", "tools")
        out.append({"name": name, "parameters": params})
    return tuple(raw), out


def _tool_choice(body: dict, tools: list[dict]) -> str:
    """'none', 'auto', 'required', or the name of the one function to call."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if not tools:
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if choice in ("none", "auto", "required"):
        return choice
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t["name"] for t in tools}:
        raise ApiError(400, f"'tool_choice' names the function '{name}', which is not in 'tools'", "tool_choice")
    return name


def _schema_grammar(schema: dict, param: str) -> str:
    try:
        return json_schema_grammar(schema)
    except SpecrtError as e:
        raise ApiError(400, str(e), param) from None


def _response_format(body: dict) -> dict | None:
    """The JSON Schema `response_format` asks for (json_object: any object), or None for text."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise ApiError(400, "'response_format' json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}",
                           "response_format")
        return js["schema"]
    raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {...}}", "response_format")


def _prompt(raw) -> str:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if raw is None:
        raise ApiError(400, "'prompt' is required: a string", "prompt")
    if not isinstance(raw, str):
        raise ApiError(400, "'prompt' must be a string (or a list of one string); token arrays and batches are "
                            "not supported", "prompt")
    if not raw.strip():
        raise ApiError(400, "'prompt' is empty; pass some text", "prompt")
    return raw


def _stop(raw) -> tuple[str, ...]:
    stops = (raw,) if isinstance(raw, str) else tuple(raw) if isinstance(raw, list) else () if raw is None else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise ApiError(400, "'stop' has an empty string, which would stop before any output", "stop")
    return stops


def _unsupported(body: dict) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"'{name}' is not supported; omit it or pass 0", name)
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise ApiError(400, "'top_logprobs' is only allowed when 'logprobs' is true", "top_logprobs")
    for name in ("logprobs", "echo", "top_logprobs"):
        if body.get(name) not in (None, False, 0):
            raise ApiError(400, f"'{name}' is not supported; omit it", name)
    for name in ("functions", "function_call", "logit_bias", "suffix"):
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported; omit it", name)
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "'best_of' must be 1 (one engine, one answer)", "best_of")


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)}); send a JSON object")
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_model(body: dict, model: str) -> None:
    """`model` may be absent (this server's one engine set) or this set's name; anything else is 404."""
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise ApiError(400, f"'model' must be a string, got {json.dumps(m)}", "model")
    if m not in (None, model):
        raise ApiError(404, f"The model '{m}' does not exist; this server serves '{model}'", "model",
                       "model_not_found")


def parse(body: dict, chat: bool, max_context: int, default_max_tokens: int | None = None) -> GenRequest:
    """A validated generation request. max_tokens defaults to default_max_tokens (None: the rest of the context) for
    chat, 16 for completions (OpenAI's default); above the engine's context it is refused."""
    n = _int(body, "n", 1, 1, 1 << 31)
    if n != 1:
        raise ApiError(400, "'n' must be 1: this server returns one choice per request", "n")
    _unsupported(body)
    prompt = _messages(body.get("messages")) if chat else _prompt(body.get("prompt"))
    if not chat:
        for name in ("tools", "tool_choice", "response_format"):
            if body.get(name) is not None:
                raise ApiError(400, f"'{name}' belongs to /v1/chat/completions; /v1/completions takes a raw prompt",
                               name)
    raw_tools, tools = _tools(body)
    choice = _tool_choice(body, tools)
    parallel = _bool(body, "parallel_tool_calls", True)
    schema = _response_format(body)
    if schema is not None and choice != "none":
        raise ApiError(400, "'response_format' with tools that may be called is not supported yet; send "
                            "'tool_choice': \"none\" or omit one of them", "response_format")
    chosen = () if choice == "none" else tuple(t for t in tools if choice in ("auto", "required", t["name"]))
    each = tuple((f"tools[{i}] '{t['name']}'", _schema_grammar(t["parameters"] or {"type": "object"}, "tools"))
                 for i, t in enumerate(tools))
    grammar = None if schema is None else _schema_grammar(schema, "response_format")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = min(default_max_tokens or max_context, max_context) if chat else 16
    max_tokens = _int(body, name, default, 1, max_context)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, 0, 1 << 31)       # not OpenAI's; vLLM's extension (-1 is not accepted)
    seed = _int(body, "seed", None, 0, 2**63 - 1)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    stream = _bool(body, "stream")
    include_usage = _bool(opts or {}, "include_usage")
    if opts is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    return GenRequest(chat, prompt, max_tokens, SamplingParams(temperature, top_k, top_p, seed),
                      _stop(body.get("stop")), stream, include_usage, _bool(body, "ignore_eos"),
                      raw_tools if choice != "none" else (),  # unseen, they are not called in text either
                      choice != "none", grammar, chosen, choice != "auto",
                      parallel and choice in ("auto", "required"), each)
