"""Pipecat (`OpenAILLMService`, which always streams, with Pipecat's own context aggregators) against `specrt serve`
on the default set (SmolLM2-135M, fp32; another set with $SPECRT_AGENT_ENGINES):
a 5-turn restaurant-booking conversation with one registered function,
`book_table`. A 135M model will not decide to call a tool by itself, so the booking turn forces the call with
Pipecat's own `LLMSetToolChoiceFrame` naming the tool, and the handler sets the choice back to "none" before it
returns its result (as a Pipecat app does to stop a forced call repeating); the other turns go out with "none".
Checked: the handler ran exactly once, with arguments valid against the booking JSON Schema; every response that
is not the tool call, the one right after the tool result included, has text; the context holds the tool round;
and on the wire, every request streamed, the booking turn named the tool, the request after the result carried the
`tool` message, and no request was refused. No reply carries tool-call or think markup (helpers.MARKUP).
With SPECRT_AGENT_TOOL_CHOICE=auto (a model that holds a conversation) every turn goes out with "auto" and the model
itself must call the tool on the booking turn, in its own format (issue 50's goal)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from helpers import (AGENT_PRECISION, AUTO, MAX_TOKENS, TURNS, Recorder, booking_turn, loopback, markup_in,
                     turn_choice)

pytestmark = pytest.mark.real

pytest.importorskip("pipecat")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pipecat.adapters.llm.schemas.function_schema import FunctionSchema  # noqa: E402
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    FunctionCallResultFrame,
    FunctionCallsStartedFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMMessagesAppendFrame,
    LLMSetToolChoiceFrame,
    LLMTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.llm_service import FunctionCallParams  # noqa: E402
from pipecat.services.openai.llm import OpenAILLMService  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from specrt.runtime.session import load  # noqa: E402
from specrt.server.app import create_app  # noqa: E402

BOOK_TABLE = {
    "type": "object",
    "properties": {"party": {"type": "integer", "minimum": 1, "maximum": 12, "description": "Number of guests"},
                   "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$", "description": "24-hour HH:MM"},
                   "name": {"type": "string", "maxLength": 40, "description": "Name for the booking"}},
    "required": ["party", "time", "name"]}
WAIT_S = 600  # one response, the slowest set's included (Qwen2.5-Coder 1.5B at fp32 on 2 cores)
SYSTEM = ("You are the host of a small restaurant. Answer in one short sentence. "
          "Use book_table to book a table once you know the party size, time and name.")


class Responses(FrameProcessor):
    """Between the LLM service and the assistant aggregator: each LLM response as (text, function calls), queued
    when its end frame passes; the function results seen."""

    def __init__(self) -> None:
        super().__init__()
        self.done: asyncio.Queue = asyncio.Queue()
        self.results: list[FunctionCallResultFrame] = []
        self._text, self._calls = "", []

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMFullResponseStartFrame):
            self._text, self._calls = "", []
        elif isinstance(frame, LLMTextFrame):
            self._text += frame.text
        elif isinstance(frame, FunctionCallsStartedFrame):
            self._calls += list(frame.function_calls)
        elif isinstance(frame, FunctionCallResultFrame):
            self.results.append(frame)
        elif isinstance(frame, LLMFullResponseEndFrame):
            self.done.put_nowait((self._text, self._calls))
        await self.push_frame(frame, direction)


async def _converse(base_url: str, model: str):
    bookings: list[dict] = []

    async def book_table(params: FunctionCallParams) -> None:
        bookings.append(dict(params.arguments))
        if not AUTO:
            params.context.set_tool_choice("none")  # the forced choice was for this call only
        await params.result_callback({"booked": True, "table": 7})

    llm = OpenAILLMService(base_url=base_url, api_key="specrt", settings=OpenAILLMService.Settings(
        model=model, temperature=0, max_completion_tokens=MAX_TOKENS, system_instruction=SYSTEM))
    llm.register_function("book_table", book_table)
    tools = ToolsSchema(standard_tools=[FunctionSchema(
        name="book_table", description="Book a table at the restaurant.",
        properties=BOOK_TABLE["properties"], required=BOOK_TABLE["required"])])
    context = LLMContext(tools=tools)
    aggregators = LLMContextAggregatorPair(context)
    responses = Responses()
    worker = PipelineWorker(Pipeline([aggregators.user(), llm, responses, aggregators.assistant()]),
                            cancel_on_idle_timeout=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(worker, frame):
        started.set()

    turns: list[list[tuple[str, list]]] = []

    async def drive():
        await asyncio.wait_for(started.wait(), WAIT_S)
        for i, text in enumerate(TURNS):
            await worker.queue_frame(LLMSetToolChoiceFrame(tool_choice=turn_choice(i)))
            await worker.queue_frame(LLMMessagesAppendFrame(messages=[{"role": "user", "content": text}], run_llm=True))
            got = [await asyncio.wait_for(responses.done.get(), WAIT_S)]
            while got[-1][1]:  # a tool call: the answer after its result is this turn's next response
                got.append(await asyncio.wait_for(responses.done.get(), WAIT_S))
            turns.append(got)
        await worker.queue_frame(EndFrame())

    t0 = time.monotonic()
    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return bookings, turns, responses.results, context, time.monotonic() - t0


def test_booking_conversation(agent_engines):
    session = load(agent_engines, AGENT_PRECISION, "auto")
    app = Recorder(create_app(session))
    with loopback(app) as (url, _):
        bookings, turns, results, context, elapsed = asyncio.run(_converse(url + "/v1", session.manifest.name))
    print(bookings, turns, f"{elapsed:.1f} s", sep="\n")

    refused = [(r["status"], r["text"].decode()) for r in app.requests if r["status"] != 200]
    assert not refused, f"the server refused Pipecat's requests: {refused}"

    # the handler ran exactly once, on the booking turn (the model's choice under auto), with schema-valid arguments
    assert len(bookings) == 1, bookings
    jsonschema.validate(bookings[0], BOOK_TABLE)
    assert len(turns) == len(TURNS)
    booked = booking_turn([any(calls for _, calls in got) for got in turns])
    for i, got in enumerate(turns):
        if i == booked:
            assert len(got) == 2 and len(got[0][1]) == 1 and not got[1][1], got
            assert got[0][1][0].function_name == "book_table"
        else:
            assert len(got) == 1 and not got[0][1], f"turn {i + 1} called a tool: {got}"
        assert got[-1][0].strip(), f"turn {i + 1} ({TURNS[i]!r}) got no assistant text: {got}"
        assert not any(markup_in(text) for text, _ in got), f"turn {i + 1}: markup in what would be spoken: {got}"
    assert len(results) == 1 and results[0].result == {"booked": True, "table": 7}

    # the context holds the tool round: the call, its result with the call's id, then the answer
    msgs = context.get_messages()
    k = next(j for j, m in enumerate(msgs) if m.get("tool_calls"))
    call = msgs[k]["tool_calls"][0]
    assert call["function"]["name"] == "book_table"
    jsonschema.validate(json.loads(call["function"]["arguments"]), BOOK_TABLE)
    assert msgs[k + 1]["role"] == "tool" and msgs[k + 1]["tool_call_id"] == call["id"]
    assert msgs[k + 2]["role"] == "assistant" and msgs[k + 2]["content"].strip()

    # on the wire: all streamed; the booking turn named the tool, the request after the result carried it
    bodies = [json.loads(r["body"]) for r in app.requests]
    assert len(bodies) == len(TURNS) + 1
    assert all(b["stream"] is True and b["model"] == session.manifest.name for b in bodies)
    choices = [b.get("tool_choice") for b in bodies]
    assert choices == [turn_choice(i) for i in range(booked + 1)] + [
        "auto" if AUTO else "none"] + [turn_choice(i) for i in range(booked + 1, len(TURNS))], choices
    after = bodies[booked + 1]
    assert [m["tool_call_id"] for m in after["messages"] if m["role"] == "tool"] == [call["id"]]
    assert bodies[0]["messages"][0] == {"role": "system", "content": SYSTEM}
    print(f"the conversation took {elapsed:.1f} s")
