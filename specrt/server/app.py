"""`specrt serve`: an OpenAI-compatible HTTP server over one Session (runtime/session.py).

    POST /v1/chat/completions, POST /v1/completions   (stream: true -> SSE chunks, ending `data: [DONE]`)
    GET  /v1/models, GET /health, GET /metrics (Prometheus: TTFT and latency histograms, when installed)

Every request's Stream runs on a worker thread (worker.py; one per stream the session runs at once), which pushes
its deltas to the request's asyncio.Queue; a client that goes away stops its loop at the next round boundary; a
mistake answers OpenAI's error JSON, never a traceback; the last request's KV cache is reused, others' wait on the
host within --cache-ram. More: docs/server.md, "Module notes: specrt/server/app.py".
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SpecrtError, first_line
from .metrics import Metrics
from .openai_api import ApiError, check_model, error_body, parse, parse_body
from .openai_shapes import Shapes, finish_reason
from ..runtime.generate import Stats, Stream
from ..runtime.prefix_cache import MIB, PrefixStore
from ..runtime.session import Session
from .scopes import store_key
from .replies import Reply, cut, open_reply, request_grammar, template_kwargs, think_state
from .tool_calls import Event
from .worker import Loading, Overloaded, run_stream, sse_event

log = logging.getLogger("specrt.server")

# host memory for sequences kept besides the engine's (KV reuse across conversations), as llama.cpp's --cache-ram
DEFAULT_CACHE_RAM_MIB = 1024
# a chat reply's length when the request names none (voice agents' frameworks send no max_tokens): long enough for
# any spoken turn or a page of code, short enough that one runaway reply does not hold the engine for minutes
DEFAULT_MAX_TOKENS = 512


class Server:
    """The state behind the app: the session (None while it loads), its one worker, the model id, the optional API
    key, and the stats of the last requests (`history`, newest last: for logs and tests)."""

    def __init__(self, session: Session | None, model: str | None = None, api_key: str | None = None,
                 max_queue: int = 16, ping_s: float = 5.0, cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB,
                 default_max_tokens: int | None = DEFAULT_MAX_TOKENS, suffix_scope: str = "server",
                 reasoning: str = "separate"):
        self.session: Session | None = None
        self.reasoning = reasoning  # --reasoning: "off" renders with the template's no-thinking switch
        self.suffix_scope = suffix_scope  # whose earlier answers a request drafts from (specrt/server/scopes.py)
        self.default_max_tokens = default_max_tokens
        self.model, self.api_key, self.cache_ram_mib = model, api_key, cache_ram_mib
        self.worker: ThreadPoolExecutor | None = None  # one thread per stream the session runs at once (attach)
        self.history: deque[Stats] = deque(maxlen=64)
        self.metrics = Metrics.create()
        self.max_queue, self.ping_s = max_queue, ping_s
        self.pending = 0            # requests waiting or running
        self.open_streams: set[Stream] = set()
        self._lock = threading.Lock()
        self.created = int(time.time())
        self.load_error: BaseException | None = None
        self.on_load_error = None   # called (from the loading thread) when a background load fails
        if session is not None:
            self.attach(session)

    def attach(self, session: Session) -> None:
        """Serve a loaded session: KV reuse across requests (the sequence in the engine, and others kept on the
        host within --cache-ram)."""
        session.enable_reuse(PrefixStore(self.cache_ram_mib * MIB))
        self.max_queue = max(self.max_queue, session.parallel)  # room for at least the streams that run at once
        if session.parallel > 1:
            session.detach = False  # each worker hands every delta on at once (run_stream): the batch never waits
        self.worker = ThreadPoolExecutor(max_workers=session.parallel, thread_name_prefix="specrt-engine")
        self.model = self.model or session.manifest.name
        self.created = int(session.manifest.root.stat().st_mtime)
        self.session = session      # last: from here on requests run

    def load(self, loader) -> None:
        """Load the session in the background (/health answers 503 until it is ready)."""
        try:
            self.attach(loader())
            log.info("ready: '%s' (%s, --speculate %s)", self.model, self.session.precision, self.session.mode)
        except Exception as e:  # noqa: BLE001 -- reported in one line; `serve` exits 2
            self.load_error = e
            log.error("loading failed: %s", first_line(e))
            if self.on_load_error is not None:
                self.on_load_error()

    def admit(self) -> None:
        """Count a request in, or refuse it when max_queue are already waiting or running."""
        with self._lock:
            if self.pending >= self.max_queue:
                raise Overloaded(self.pending)
            self.pending += 1

    def release(self) -> None:
        with self._lock:
            self.pending -= 1

    def close_all(self) -> None:
        """Shutdown: every open stream stops at its next round boundary."""
        for stream in list(self.open_streams):
            stream.close()

    @property
    def max_context(self) -> int:
        return self.session.engine.max_context

    def open(self, body: dict, chat: bool, store_key: str | None = None):
        """Validate a request and open its Stream (not started: it runs when the worker takes it). store_key: its
        suffix store (specrt/scopes.store_key)."""
        check_model(body, self.model)
        req = parse(body, chat, self.max_context, self.default_max_tokens)
        codec, tools = self.session.codec, list(req.tools) or None
        kwargs = template_kwargs(codec, req.template_kwargs, self.reasoning) if chat else None
        try:
            state = think_state(codec, req, tools, kwargs)
        except SpecrtError as e:  # the template refused the history
            raise ApiError(400, str(e), "messages") from None
        grammar = request_grammar(self.session, req, state)
        try:
            stream = self.session.stream(req.prompt, max_new_tokens=req.max_tokens, sampling=req.sampling,
                                         stop=req.stop, chat=chat, ignore_eos=req.ignore_eos, grammar=grammar,
                                         tools=tools, store_key=store_key, template_kwargs=kwargs)
        except SpecrtError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise ApiError(400, str(e), "messages" if chat else "prompt", code) from None
        return req, stream, open_reply(codec, req, state == "inside") if chat else None

    def submit(self, stream: Stream) -> asyncio.Queue:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        queued, last, waited = time.perf_counter(), [None], [0.0]
        self.open_streams.add(stream)

        def started():
            waited[0] = time.perf_counter() - queued
            if self.metrics is not None:
                self.metrics.queue.observe(waited[0])

        def push(item):
            now = time.perf_counter()
            if item[0] == "delta" and self.metrics is not None and last[0] is not None:
                self.metrics.itl.observe(now - last[0])
            last[0] = now
            if item[0] != "delta":
                self.open_streams.discard(stream)
                self.release()
            if item[0] != "delta" and stream.result is not None:
                st = stream.result.stats
                st.queue_s = waited[0]
                self.history.append(st)
                if self.metrics is not None:
                    self.metrics.observe(st, self.session.prefix_store)
                log.info("%d prompt + %d new tokens, ttft %.0f ms, %.1f tok/s, %s, tau %.2f", st.prompt_tokens,
                         st.new_tokens, st.ttft_s * 1000, st.tok_s, st.finish_reason, st.tau)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
                pass

        self.worker.submit(run_stream, stream, push, started, self.session.stash)
        return queue

    async def events(self, shapes: Shapes, stream: Stream, queue: asyncio.Queue, include_usage: bool,
                     reply: Reply | None = None):
        """The SSE body of a streamed request (submitted already: the worker releases its place in the queue even
        if this body never runs). reply: a chat reply's reader (replies.Reply): its reasoning goes out as
        delta.reasoning_content, its calls as delta.tool_calls, the rest as content."""
        first = True

        def chunks(events: list[Event]):
            nonlocal first
            for e in events:
                out = shapes.event_chunk(e, first)
                if out is None:
                    continue
                if include_usage:
                    out["usage"] = None
                yield sse_event(out)
                first = False

        try:
            while True:
                if first:  # the queue or a long prefill: keep the connection alive
                    try:
                        kind, value = await asyncio.wait_for(queue.get(), self.ping_s)
                    except asyncio.TimeoutError:
                        yield ": ping\n\n"
                        continue
                else:
                    kind, value = await queue.get()
                if kind == "delta":
                    for line in chunks([Event(content=value)] if reply is None else reply.feed(value)):
                        yield line
                elif kind == "done":
                    if reply is not None:  # what it held: text, or the markup of a call cut short (dropped)
                        for line in chunks(reply.finish(cut(value))):
                            yield line
                    chunk = shapes.chunk(None, first, finish_reason(value.stats, reply and reply.calls))
                    if include_usage:
                        chunk["usage"] = None
                    yield sse_event(chunk)
                    if include_usage:
                        yield sse_event(shapes.usage_chunk(value.stats, self._reasoning_tokens(value, reply)))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield sse_event(error_body(f"generation failed: {first_line(value)}", "server_error"))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            stream.close()  # the client went away (or we finished): the loop stops at its next round boundary

    async def complete(self, shapes: Shapes, stream: Stream, reply: Reply | None = None) -> dict:
        queue = self.submit(stream)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "done":
                    if reply is None:
                        return shapes.completion(value.text, value.stats)
                    text, reasoning, calls = reply.whole(value.text, cut(value))
                    return shapes.completion(text, value.stats, calls, reasoning,
                                             self._reasoning_tokens(value, reply))
                if kind == "error":
                    raise RuntimeError(first_line(value))
        finally:
            stream.close()

    def _reasoning_tokens(self, result, reply: Reply | None) -> int | None:
        return None if reply is None else reply.reasoning_tokens(self.session.codec, result.token_ids)

    def authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


RETRY_AFTER_S = 1

def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _retry_later(why: str, code: str) -> JSONResponse:
    """503 in OpenAI's error shape with Retry-After: the server cannot take the request now."""
    return JSONResponse(error_body(f"{why}; retry after {RETRY_AFTER_S} s", "server_error", code=code),
                        status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def create_app(session: Session | None = None, model: str | None = None, api_key: str | None = None,
               max_queue: int = 16, ping_s: float = 5.0, cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB,
               loader=None, default_max_tokens: int | None = DEFAULT_MAX_TOKENS, suffix_scope: str = "server",
               reasoning: str = "separate") -> FastAPI:
    """The FastAPI app for one session; `app.state.server` is its Server. loader (instead of session): a callable
    that loads the session, run in a thread when the app starts, so the port answers (/health 503, /v1 routes
    503 with Retry-After) while the engines load; `model` names it meanwhile. default_max_tokens: a chat reply's
    length when the request names none (None: the rest of the context). suffix_scope: whose earlier answers a
    request's suffix drafts come from (specrt/server/scopes.py). reasoning: --reasoning (docs/formats.md)."""
    if (session is None) == (loader is None):
        raise ValueError("create_app takes a session or a loader")
    server = Server(session, model, api_key, max_queue, ping_s, cache_ram_mib, default_max_tokens, suffix_scope,
                    reasoning)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if loader is not None:
            threading.Thread(target=server.load, args=(loader,), name="specrt-load", daemon=True).start()
        yield
        server.close_all()
        if server.worker is not None:
            server.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specrt", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server
    _answer_errors(app, server)
    _serve_info(app, server)
    _serve_generation(app, server)
    return app


def _answer_errors(app: FastAPI, server: Server) -> None:
    """Every failure answers OpenAI's error JSON: a user's mistake its 4xx, a full queue or a load in progress 503
    with Retry-After, anything unexpected 500 (logged)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, e: Overloaded):
        return _retry_later(f"the server is busy ({e.args[0]} requests waiting or running, the most it queues: "
                            f"--max-queue {server.max_queue})", "server_overloaded")

    @app.exception_handler(Loading)
    async def _loading(request: Request, e: Loading):
        return _retry_later(f"the model '{server.model}' is still loading (GET /health answers 200 once it is "
                            "ready)", "model_loading")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {404: f"no route {request.method} {request.url.path}; see GET /v1/models",
                405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(e.status_code, what.get(e.status_code, str(e.detail)), code=None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("request failed")
        return _error(500, f"internal error: {first_line(e)}", "server_error")


def _auth(server: Server, request: Request) -> None:
    """A check in each /v1 route: an HTTP middleware would wrap the SSE stream."""
    if not server.authorized(request):
        raise ApiError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>' with the key "
                            "given to `specrt serve --api-key`", code="invalid_api_key")


def _serve_info(app: FastAPI, server: Server) -> None:
    """GET /health, /metrics, /v1/models and /v1/models/{id}."""

    @app.get("/health")
    async def health():
        if server.session is None:
            return JSONResponse({"status": "error" if server.load_error else "loading"}, status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": server.model, "object": "model", "created": server.created, "owned_by": "specrt"}

    @app.get("/metrics")
    async def metrics():
        if server.metrics is None:
            raise ApiError(404, "/metrics needs prometheus-client; pip install 'specrt[serve]'")
        return server.metrics.render()

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(server, request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        _auth(server, request)
        if model_id != server.model:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{server.model}'",
                           "model", "model_not_found")
        return model_card()


def _serve_generation(app: FastAPI, server: Server) -> None:
    """POST /v1/chat/completions and /v1/completions: streamed as server-sent events or answered whole."""

    async def generate(request: Request, chat: bool):
        _auth(server, request)
        if server.session is None:
            raise Loading()
        body = parse_body(await request.body())
        req, stream, reply = server.open(body, chat, store_key(server.suffix_scope, request.url.path, body,
                                                               request.headers))
        server.admit()  # released when the worker finishes it (submit's push)
        shapes = Shapes(chat, server.model)
        if req.stream:
            queue = server.submit(stream)
            return StreamingResponse(server.events(shapes, stream, queue, req.include_usage, reply),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await server.complete(shapes, stream, reply)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)
