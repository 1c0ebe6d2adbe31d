"""LiveKit Agents (text-only AgentSession, `livekit.plugins.openai.LLM`, which always streams) against `specrt serve`
on the default set (SmolLM2-135M, fp32; another set with $SPECRT_AGENT_ENGINES):
a 5-turn restaurant-booking conversation with one `@function_tool`,
`book_table`. A 135M model will not decide to call a tool by itself, so the booking turn forces the call through
LiveKit's own API (the Agent's `llm_node` passes a `tool_choice` naming the tool, for that turn only); the other
turns go out with tool_choice "none", the reply after the tool result with the choice LiveKit picks itself
("auto" in 1.8.9). Checked: the tool ran exactly once, with arguments valid against the
booking JSON Schema; every turn, the one right after the tool result included, ends in a non-empty assistant
message (RunResult events); the chat history holds the tool round; and on the wire, every request streamed, the
booking turn named the tool, the request after the result carried the `tool` message and forced nothing, and no
request was refused. No reply carries tool-call or think markup (helpers.MARKUP).
With SPECRT_AGENT_TOOL_CHOICE=auto (a model that holds a conversation) every turn goes out with "auto" and the model
itself must call the tool on the booking turn, in its own format (issue 50's goal)."""

from __future__ import annotations

import ast
import asyncio
import json
import time
from typing import Annotated

import pytest
from helpers import AGENT_PRECISION, MAX_TOKENS, TURNS, Recorder, booking_turn, loopback, markup_in, turn_choice

pytestmark = pytest.mark.real

pytest.importorskip("livekit.agents")
pytest.importorskip("livekit.plugins.openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from livekit.agents import Agent, AgentSession, ModelSettings, RunContext, function_tool, llm  # noqa: E402
from livekit.agents.voice.run_result import ChatMessageEvent, FunctionCallEvent, FunctionCallOutputEvent  # noqa: E402
from livekit.plugins import openai as lk_openai  # noqa: E402
from pydantic import Field  # noqa: E402

from specrt.runtime.session import load  # noqa: E402
from specrt.server.app import create_app  # noqa: E402

BOOK_TABLE = {"type": "object",
              "properties": {"party": {"type": "integer", "minimum": 1, "maximum": 12},
                             "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                             "name": {"type": "string", "maxLength": 40}},
              "required": ["party", "time", "name"], "additionalProperties": False}


class BookingAgent(Agent):
    """A restaurant host with one tool. `turn_tool_choice` is the tool choice of the next user turn's first LLM
    request; a request LiveKit already pins (the reply after a tool result) keeps LiveKit's choice."""

    def __init__(self) -> None:
        super().__init__(instructions="You are the host of a small restaurant. Answer in one short sentence. "
                                      "Use book_table to book a table once you know the party size, time and name.")
        self.turn_tool_choice: llm.ToolChoice = "none"
        self.bookings: list[dict] = []

    @function_tool
    async def book_table(self, context: RunContext,
                         party: Annotated[int, Field(ge=1, le=12, description="Number of guests")],
                         time: Annotated[str, Field(pattern=r"^[0-2][0-9]:[0-5][0-9]$", description="24-hour HH:MM")],
                         name: Annotated[str, Field(max_length=40, description="Name for the booking")]) -> dict:
        """Book a table at the restaurant."""
        self.bookings.append({"party": party, "time": time, "name": name})
        return {"booked": True, "table": 7}

    async def llm_node(self, chat_ctx, tools, model_settings):
        choice = model_settings.tool_choice
        if choice is None or not isinstance(choice, (str, dict)):  # NOT_GIVEN: a fresh user turn
            choice = self.turn_tool_choice
        async for chunk in Agent.default.llm_node(self, chat_ctx, tools, ModelSettings(tool_choice=choice)):
            yield chunk


@pytest.fixture(scope="module")
def session(agent_engines):
    return load(agent_engines, AGENT_PRECISION, "auto")


@pytest.fixture(scope="module")
def server(session):
    app = Recorder(create_app(session))
    with loopback(app) as (url, _):
        yield url + "/v1", app


def _turn_events(result) -> tuple[list, list, list]:
    calls = [e for e in result.events if isinstance(e, FunctionCallEvent)]
    outputs = [e for e in result.events if isinstance(e, FunctionCallOutputEvent)]
    messages = [e for e in result.events if isinstance(e, ChatMessageEvent) and e.item.role == "assistant"]
    return calls, outputs, messages


async def _converse(base_url: str, model: str) -> tuple[BookingAgent, list, llm.ChatContext, float]:
    model_llm = lk_openai.LLM(base_url=base_url, model=model, api_key="specrt", temperature=0,
                              max_completion_tokens=MAX_TOKENS)
    agent = BookingAgent()
    results = []
    t0 = time.monotonic()
    async with model_llm, AgentSession(llm=model_llm, max_tool_steps=1) as lk_session:
        await lk_session.start(agent)
        for i, text in enumerate(TURNS):
            agent.turn_tool_choice = turn_choice(i)
            results.append(await lk_session.run(user_input=text))
        history = lk_session.history.copy()
    return agent, results, history, time.monotonic() - t0


def test_booking_conversation(server, session):
    base_url, recorder = server
    agent, results, history, elapsed = asyncio.run(_converse(base_url, session.manifest.name))
    for r in results:  # what the model said and called, turn by turn
        print([(type(e).__name__, getattr(e.item, "text_content", None) or getattr(e.item, "arguments", None))
               for e in r.events])
    print(agent.bookings, f"{elapsed:.1f} s")

    refused = [(json.loads(r["body"] or b"{}"), r["status"], r["text"].decode()) for r in recorder.requests
               if r["status"] != 200]
    assert not refused, f"the server refused LiveKit's requests: {refused}"

    # the tool ran exactly once, on the booking turn (the model's choice under auto), with schema-valid arguments
    assert len(agent.bookings) == 1, agent.bookings
    jsonschema.validate(agent.bookings[0], BOOK_TABLE)
    booked = booking_turn([bool(_turn_events(r)[0]) for r in results])
    for i, result in enumerate(results):
        calls, outputs, messages = _turn_events(result)
        assert messages and messages[-1].item.text_content and messages[-1].item.text_content.strip(), \
            f"turn {i + 1} ({TURNS[i]!r}) got no assistant text: {result.events}"
        spoken = [m.item.text_content or "" for m in messages]
        assert not any(markup_in(t) for t in spoken), f"turn {i + 1}: markup in what would be spoken: {spoken}"
        if i != booked:
            assert not calls and not outputs, f"turn {i + 1} called a tool: {result.events}"
    booking = results[booked]
    booking.expect.next_event().is_function_call(name="book_table")
    booking.expect.next_event().is_function_call_output()
    booking.expect.next_event().is_message(role="assistant")  # the answer after the tool result
    booking.expect.no_more_events()
    call = booking.events[0].item
    jsonschema.validate(json.loads(call.arguments), BOOK_TABLE)
    output = booking.events[1].item
    # LiveKit writes a dict result as Python's str() of it
    assert output.call_id == call.call_id and not output.is_error and ast.literal_eval(output.output)["table"] == 7

    # the chat history holds the tool round: user, call, result, answer
    items = history.items
    kinds = [it.type if it.type != "message" else it.role for it in items]
    k = kinds.index("function_call")
    assert kinds[k - 1: k + 3] == ["user", "function_call", "function_call_output", "assistant"], kinds
    assert items[k + 1].call_id == items[k].call_id

    # on the wire: all streamed; the booking turn named the tool, the request after the result forced nothing
    bodies = [json.loads(r["body"]) for r in recorder.requests]
    assert len(bodies) == len(TURNS) + 1, [b.get("tool_choice") for b in bodies]
    assert all(b["stream"] is True and b["model"] == session.manifest.name for b in bodies)
    after = bodies[booked + 1]
    choices = [b.get("tool_choice") for b in bodies]
    assert choices[:booked + 1] == [turn_choice(i) for i in range(booked + 1)]
    assert after.get("tool_choice") in ("auto", "none")
    assert choices[booked + 2:] == [turn_choice(i) for i in range(booked + 1, len(TURNS))], choices
    tool_msgs = [m for m in after["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == 1 and tool_msgs[0]["tool_call_id"] == call.call_id
    assert any(m["role"] == "assistant" and m.get("tool_calls") for m in after["messages"])
    print(f"the conversation took {elapsed:.1f} s")
