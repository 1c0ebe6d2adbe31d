"""OpenAI's request and response shapes for `specrt serve`, as plain functions (no web framework here).

parse() turns a request body into a GenRequest or raises ApiError (status, OpenAI's error JSON); the builders
make the `chat.completion(.chunk)` and `text_completion` objects. Fields we cannot honour (n > 1, logprobs,
penalties, tools) are refused with a 400 rather than ignored; unknown fields are ignored, as OpenAI's own
clients send a few (user, metadata, ...).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from .runtime.generate import Stats
from .runtime.sampling import SamplingParams
from .runtime.tokenizer import Message

# Stats.finish_reason -> OpenAI's finish_reason ("cancelled" only reaches a client that is gone)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
MAX_STOPS = 4  # OpenAI's limit


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


def _content(m: dict, i: int) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...})."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts; only text is supported",
                   "messages")


def _messages(raw) -> list[Message]:
    if raw is None:
        raise ApiError(400, "'messages' is required: a non-empty list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
                       "messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role' and 'content'", "messages")
        out.append(Message(m["role"], _content(m, i)))
    if not any(m.content.strip() for m in out):
        raise ApiError(400, "the messages are empty (every 'content' is blank); put some text in them", "messages")
    return out


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
    for name in ("logprobs", "echo"):
        if body.get(name) not in (None, False, 0):
            raise ApiError(400, f"'{name}' is not supported; omit it", name)
    for name in ("tools", "functions", "logit_bias", "suffix"):
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


def parse(body: dict, chat: bool, max_context: int) -> GenRequest:
    """A validated generation request. max_tokens defaults to the rest of the context for chat, 16 for
    completions (OpenAI's defaults); above the engine's context it is refused."""
    n = _int(body, "n", 1, 1, 1 << 31)
    if n != 1:
        raise ApiError(400, "'n' must be 1: this server returns one choice per request", "n")
    _unsupported(body)
    prompt = _messages(body.get("messages")) if chat else _prompt(body.get("prompt"))
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, max_context if chat else 16, 1, max_context)
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
                      _stop(body.get("stop")), stream, include_usage, _bool(body, "ignore_eos"))


class Shapes:
    """The response objects of one request (one id, one creation time)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, first: bool, finish: str | None = None) -> dict:
        """A streamed chunk: a text delta (the role goes with the first one), or the last one (finish set)."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": text or ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "system_fingerprint": None, "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, stats: Stats) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(stats), "metrics": metrics(stats)}

    def completion(self, text: str, stats: Stats) -> dict:
        finish = FINISH[stats.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice, obj = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}, "text_completion"
        return {**self._base(obj), "choices": [choice], "usage": usage(stats), "metrics": metrics(stats)}


def usage(st: Stats) -> dict:
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
            "total_tokens": st.prompt_tokens + st.new_tokens,
            "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}


def metrics(st: Stats) -> dict:
    """specrt's own figures beside `usage` (not an OpenAI field; clients keep it in model_extra)."""
    return {"ttft_s": round(st.ttft_s, 6), "tok_s": round(st.tok_s, 3), "tau": round(st.tau, 4),
            "acceptance_by_position": [round(a, 4) for a in st.acceptance_by_position], "proposer": st.proposer,
            "exact": st.exact}
