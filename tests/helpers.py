"""Helpers several test files share: a server on a loopback port, a recorder of its chat requests, and the one-line
user-error check."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time


# the voice-agent framework tests' booking conversation (tests/test_agents_*.py)
FORCE_BOOKING = {"type": "function", "function": {"name": "book_table"}}
TURNS = ["Hi, I'd like to book a table for tonight.",
         "Four people at 19:30, under the name Ada.",  # the booking turn: book_table is forced here
         "Can we sit by the window?",
         "Do you have vegetarian dishes?",
         "Thanks, bye!"]
BOOKING_TURN = 1
MAX_TOKENS = 128  # a forced book_table call spells ~48 tokens in the Hermes markup; replies stay short
# SPECRT_AGENT_TOOL_CHOICE=auto: every turn goes out with tool_choice "auto" and the model decides when to book (a
# set whose model holds a conversation, e.g. Qwen2.5-Coder 1.5B: docs/formats.md); unset: the booking turn forces
# the call and the others send "none", since a 135M model never decides to call by itself
AGENT_CHOICE = os.environ.get("SPECRT_AGENT_TOOL_CHOICE", "forced")
if AGENT_CHOICE not in ("auto", "forced"):
    raise ValueError(f"SPECRT_AGENT_TOOL_CHOICE={AGENT_CHOICE!r}: use 'auto' or 'forced' (the default)")
AUTO = AGENT_CHOICE == "auto"
AGENT_PRECISION = os.environ.get("SPECRT_AGENT_PRECISION", "fp32")  # the target the agent tests serve
# what a text-to-speech stage must never read: tool-call and think markup of any format (runtime/tool_formats.py)
MARKUP = ("<tool_call", "</tool_call", "<|", "[TOOL_CALLS]", "[ARGS]", "<think", "</think", '{"name"')


def turn_choice(i: int):
    """The tool_choice of the conversation's i-th user turn."""
    return "auto" if AUTO else FORCE_BOOKING if i == BOOKING_TURN else "none"


def booking_turn(called: list[bool]) -> int:
    """The turn that booked, given which turns called a tool: the forced turn; under "auto" the model picks its
    turn (Qwen2.5-Coder 1.5B books on the first, inventing what it was not told), so any one turn, once."""
    booked = [i for i, c in enumerate(called) if c]
    assert booked == [BOOKING_TURN] or (AUTO and len(booked) == 1), f"turns that called a tool: {booked}"
    return booked[0]


# a call's JSON however it is spaced (pretty-printed, fenced): a "name" string and an arguments key in one object
CALL_JSON = re.compile(r'\{[^{}]*("name"\s*:\s*"[^"]*"[^{}]*"(arguments|parameters)"'
                       r'|"(arguments|parameters)"\s*:[\s\S]*"name"\s*:\s*")')


def markup_in(text: str) -> list[str]:
    """The tool-call or think markup in text: MARKUP's strings, and a call's JSON in any spacing (CALL_JSON)."""
    return [m for m in MARKUP if m in text] + [m[0] for m in CALL_JSON.finditer(text)]


@contextlib.contextmanager
def loopback(app):
    """uvicorn serving `app` on a free loopback port in a background thread; yields (base URL, uvicorn.Server)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(10)


class Recorder:
    """ASGI middleware around the server's app: each /v1/chat/completions request body and response status."""

    def __init__(self, app) -> None:
        self.app, self.requests = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        entry = {"body": b"", "status": None, "text": b""}
        self.requests.append(entry)

        async def rx():
            msg = await receive()
            if msg["type"] == "http.request":
                entry["body"] += msg.get("body", b"")
            return msg

        async def tx(msg):
            if msg["type"] == "http.response.start":
                entry["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                entry["text"] += msg.get("body", b"")
            await send(msg)

        await self.app(scope, rx, tx)


def assert_user_error(r, *words):
    """A CLI run that failed on a user mistake: exit 2, no traceback, one `error:` line naming `words`."""
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and sum(x.startswith("error: ") for x in lines) == 1, r.stderr
    for w in words:
        assert w.lower() in lines[-1].lower(), lines[-1]
