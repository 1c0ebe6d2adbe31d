"""OpenAI's response objects for `specrt serve`: `chat.completion(.chunk)` and `text_completion`, usage, and
specrt's own figures beside it."""

from __future__ import annotations

import time
import uuid

from ..runtime.generate import Stats
from ..runtime.tokenizer import ToolCall

# Stats.finish_reason -> OpenAI's finish_reason ("cancelled" only reaches a client that is gone)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


class Shapes:
    """The response objects of one request (one id, one creation time)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, first: bool, finish: str | None = None, calls: dict | None = None) -> dict:
        """A streamed chunk: a text delta (the role goes with the first one), a tool call's delta (calls: OpenAI's
        {"index", ...} of one call), or the last one (finish set)."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": text or ("" if calls is None else None)}
            if calls is not None:
                delta["tool_calls"] = [calls]
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "system_fingerprint": None, "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def event_chunk(self, e, first: bool) -> dict | None:
        """The chunk of a reply's event (tool_calls.Event): content, reasoning, or a call (index, id and name first,
        then its arguments, in OpenAI's order); None for an event with nothing to send."""
        if e.start is not None:
            return self.chunk(None, first, calls={"index": e.index, "id": e.start.id, "type": "function",
                                                  "function": {"name": e.start.name, "arguments": ""}})
        if e.arguments:
            return self.chunk(None, first, calls={"index": e.index, "function": {"arguments": e.arguments}})
        if e.reasoning:
            out = self.chunk(None, first)
            out["choices"][0]["delta"]["reasoning_content"] = e.reasoning
            return out
        return self.chunk(e.content, first) if e.content else None

    def usage_chunk(self, stats: Stats, reasoning_tokens: int | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(stats, reasoning_tokens), "metrics": metrics(stats)}

    def completion(self, text: str, stats: Stats, calls: list[ToolCall] | None = None, reasoning: str = "",
                   reasoning_tokens: int | None = None) -> dict:
        """The whole reply; calls: the tool calls parsed out of it (text is then what is outside them); reasoning:
        what it wrote between the template's think markers, and how many tokens that took."""
        finish = finish_reason(stats, calls)
        if self.chat:
            message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call_json(c) for c in calls]
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice, obj = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}, "text_completion"
        return {**self._base(obj), "choices": [choice], "usage": usage(stats, reasoning_tokens),
                "metrics": metrics(stats)}


def finish_reason(stats: Stats, calls) -> str:
    """OpenAI's finish_reason: "tool_calls" when a reply has complete calls (calls end a turn: whatever the budget
    cut after them was the markup of a call with no room, dropped); else "length" when the budget cut the reply
    (its text, or the markup of its only call), "stop" when it ended by itself."""
    return "tool_calls" if calls else FINISH[stats.finish_reason]


def call_json(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def usage(st: Stats, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; reasoning_tokens: of a model that thinks (completion_tokens_details, as OpenAI's)."""
    out = {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
           "total_tokens": st.prompt_tokens + st.new_tokens,
           "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def metrics(st: Stats) -> dict:
    """specrt's own figures beside `usage` (not an OpenAI field; clients keep it in model_extra)."""
    return {"queue_s": round(st.queue_s, 6), "ttft_s": round(st.ttft_s, 6), "tok_s": round(st.tok_s, 3),
            "tau": round(st.tau, 4),
            "acceptance_by_position": [round(a, 4) for a in st.acceptance_by_position], "proposer": st.proposer,
            "exact": st.exact}
