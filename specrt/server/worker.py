"""What runs a request off the event loop: its Stream driven to the end on the engine's worker thread, pushing
deltas, the result or the error to the request's queue; the framing of a server-sent event; and why a request is
not admitted to the worker (503 with Retry-After)."""

from __future__ import annotations

import json
import logging

from ..runtime.generate import Stream

log = logging.getLogger("specrt.server")


def sse_event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def run_stream(stream: Stream, push, started, after=None) -> None:
    """On the worker thread: run the loop to the end, pushing ("delta", text) then ("done", result) or
    ("error", exception); started() first, when the request leaves the queue; after() once the result is out
    (the KV cache's copy for reuse: off this request's and the next one's critical path)."""
    started()
    try:
        for delta in stream:
            push(("delta", delta))
        push(("done", stream.result))
    except Exception as e:  # noqa: BLE001 -- reported to the client and the log; the worker lives on
        log.exception("generation failed")
        push(("error", e))
        return
    if after is not None:
        try:
            after()
        except Exception:  # noqa: BLE001 -- only reuse is lost
            log.exception("keeping the KV cache for reuse failed")


class Overloaded(Exception):
    """max_queue requests are already waiting or running."""


class Loading(Exception):
    """The session is still loading."""
