"""OpenAI's requests for `specrt serve` (pydantic, as FastAPI brings it; no web framework here).

parse() checks a request body against its pydantic model (openai_models.py) and turns it into a GenRequest, or raises
ApiError (status, OpenAI's error JSON); the response objects are openai_shapes.py's. Tools and `response_format`
become a grammar (tool_calls.py, runtime/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from ..errors import SpecrtError
from .openai_models import ChatRequest, CompletionRequest, first_error
from ..runtime.grammar import json_schema_grammar
from ..runtime.sampling import SamplingParams
from ..runtime.tokenizer import Message, ToolCall


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
    template_kwargs: dict | None = None  # chat_template_kwargs: more variables for the chat template


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


def _schema_grammar(schema: dict, param: str) -> str:
    try:
        return json_schema_grammar(schema)
    except SpecrtError as e:
        raise ApiError(400, str(e), param) from None


def parse(body: dict, chat: bool, max_context: int, default_max_tokens: int | None = None) -> GenRequest:
    """A validated generation request. max_tokens defaults to default_max_tokens (None: the rest of the context) for
    chat, 16 for completions (OpenAI's default); above the engine's context it is refused."""
    model = ChatRequest if chat else CompletionRequest
    try:
        r = model.model_validate(body, context={"max_context": max_context})
    except ValidationError as e:
        param, message = first_error(e, model)
        raise ApiError(400, message, param) from None
    if chat:  # `developer` is the system turn of OpenAI's newer models; templates know only `system`
        prompt = [Message("system" if m.role == "developer" else m.role, m.text,
                          tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.calls),
                          m.tool_call_id if m.role == "tool" else None) for m in r.messages]
        tools, c, rf = [t.function for t in r.tools], r.tool_choice, r.response_format
        # 'none', 'auto', 'required', or the name of the one function to call
        choice = ("auto" if tools else "none") if c is None else c if isinstance(c, str) else c.function.name
        schema = (None if rf is None or rf.type == "text" else {"type": "object"} if rf.type == "json_object"
                  else rf.json_schema.schema_)  # the JSON Schema response_format asks for (json_object: any object)
        max_tokens = r.max_tokens if r.max_completion_tokens is None else r.max_completion_tokens
        default = min(default_max_tokens or max_context, max_context)
    else:
        prompt, tools, choice, schema, max_tokens, default = r.prompt, [], "none", None, r.max_tokens, 16
    chosen = () if choice == "none" else tuple({"name": f.name, "parameters": f.parameters} for f in tools
                                               if choice in ("auto", "required", f.name))
    each = tuple((f"tools[{i}] '{f.name}'", _schema_grammar(f.parameters or {"type": "object"}, "tools"))
                 for i, f in enumerate(tools))
    return GenRequest(chat, prompt, default if max_tokens is None else max_tokens,
                      SamplingParams(r.temperature, r.top_k, r.top_p, r.seed), r.stop, r.stream,
                      bool(r.stream_options and r.stream_options.include_usage), r.ignore_eos,
                      tuple(body["tools"]) if choice != "none" else (),  # unseen, they are not called in text either
                      choice != "none", None if schema is None else _schema_grammar(schema, "response_format"),
                      chosen, choice != "auto", choice in ("auto", "required") and r.parallel_tool_calls, each,
                      r.chat_template_kwargs if chat else None)
