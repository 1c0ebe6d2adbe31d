"""`specrt serve-ray`: the server's app (specrt.server.app.create_app) on Ray Serve, one engine per replica, with
requests routed by conversation. Ray is an optional extra (`pip install 'specrt[ray]'`): this module imports
without it (only typer at import time); Ray loads inside the command and on the replicas.
More: docs/server.md, "Module notes: specrt/server/ray_serve.py".
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ..errors import SpecrtError, first_line
from .scopes import CONVERSATION_HEADER, conversation_key
from ..cli.serve import (DEFAULT_MAX_TOKENS_HELP, REASONING_HELP, SUFFIX_CACHE_HELP, SUFFIX_SCOPE_HELP,
                            TOOL_FORMAT_HELP, Reasoning, SuffixScope, ToolFormatName)

log = logging.getLogger("specrt.ray_serve")

APP_NAME = "specrt"
ENGINE_DEPLOYMENT = "SpecrtEngine"
INGRESS_DEPLOYMENT = "SpecrtIngress"
REPLICA_HEADER = "x-specrt-replica"            # which engine replica answered (its Serve replica id)
CONVERSATION_KWARG = "conversation"            # the engine call's keyword the router reads
INSTALL_HINT = "specrt serve-ray needs Ray Serve: pip install 'specrt[ray]'"
ROUTER_CLASS = "specrt.server.ray_router:ConversationRouter"
START_RETRIES = 2                              # a request whose replica died before it answered: tries elsewhere


def rendezvous(key: str, replica_ids) -> str:
    """The replica id a key maps to (highest random weight): stable while that replica lives; removing a replica
    moves only its own keys. Deterministic (no per-process hash seed), so every router agrees."""
    return max(replica_ids, key=lambda rid: hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest())


@dataclass(frozen=True)
class EngineSpec:
    """What each engine replica loads and how it serves (pickled to the replicas)."""

    engines: str                # the engine set folder, absolute
    precision: str = "fp32"
    speculate: str = "auto"
    threads: int = 0
    api_key: str | None = None
    max_queue: int = 16
    cache_ram_mib: int = 1024
    parallel: int = 1           # streams each replica decodes at once (specrt serve --parallel)
    prefill_chunk: int | None = None  # specrt serve --prefill-chunk (None: its default)
    default_max_tokens: int | None = 512  # specrt serve --default-max-tokens (None: the rest of the context)
    suffix: tuple = (64.0, 0.3, 4.0)  # specrt serve --suffix-cache, --suffix-threshold, --suffix-factor
    suffix_scope: str = "server"      # per replica: a conversation's turns stay on one, an API key's do not
    tool_format: str = "auto"         # specrt serve --tool-format
    reasoning: str = "separate"       # specrt serve --reasoning


@dataclass(frozen=True)
class Placement:
    """How many engine replicas, and what Ray reserves for each."""

    replicas: int
    num_cpus: float
    num_gpus: float
    threads: int                # the engine's CPU threads (0 = all cores)


def check_flags(replicas: int | None, cores_per_replica: int, gpus_per_replica: float) -> None:
    """The resource flags' own bounds (before Ray starts). Raises SpecrtError (one line)."""
    if replicas is not None and replicas < 1:
        raise SpecrtError(f"--replicas must be >= 1, got {replicas}")
    if cores_per_replica < 0:
        raise SpecrtError(f"--cores-per-replica must be >= 1 (0 = the cluster's CPUs shared evenly), got "
                          f"{cores_per_replica}")
    if gpus_per_replica < 0:
        raise SpecrtError(f"--gpus-per-replica must be > 0, got {gpus_per_replica:g}")


def plan(replicas: int | None, cores_per_replica: int, gpus_per_replica: float, cluster: dict) -> Placement:
    """Replicas and their resources from the flags (None replicas: by resources) and the cluster's resources
    (ray.cluster_resources()). Raises SpecrtError (one line) for what cannot run, rather than waiting forever for
    resources the cluster does not have."""
    check_flags(replicas, cores_per_replica, gpus_per_replica)
    cpus, gpus = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    if gpus_per_replica:
        n = replicas or int(gpus // gpus_per_replica)
        if n < 1 or n * gpus_per_replica > gpus:
            raise SpecrtError(f"{max(n, 1)} replicas x --gpus-per-replica {gpus_per_replica:g} need "
                              f"{max(n, 1) * gpus_per_replica:g} GPUs, the Ray cluster has {gpus:g}")
        cores = cores_per_replica or 1
        if n * cores > cpus:
            raise SpecrtError(f"{n} replicas x --cores-per-replica {cores} need {n * cores} CPUs, the Ray cluster "
                              f"has {cpus:g}")
        return Placement(n, cores, gpus_per_replica, cores_per_replica)
    if cores_per_replica:
        n, cores = replicas or max(1, int(cpus // cores_per_replica)), cores_per_replica
    else:
        n = replicas or 1
        cores = int(cpus // n)
        if cores < 1:
            raise SpecrtError(f"--replicas {n}: the Ray cluster has {cpus:g} CPUs, fewer than one a replica; lower "
                              "--replicas")
    if n * cores > cpus:
        raise SpecrtError(f"{n} replicas x --cores-per-replica {cores} need {n * cores} CPUs, the Ray cluster has "
                          f"{cpus:g}; lower --replicas or --cores-per-replica")
    return Placement(n, cores, 0, cores)


def _sse_error(message: str) -> bytes:
    from .openai_api import error_body

    return (f"data: {json.dumps(error_body(message, 'server_error'), separators=(',', ':'))}\n\n"
            "data: [DONE]\n\n").encode()


class SpecrtEngine:
    """An engine replica: one Session, loaded before the replica takes requests, and the server's app over it."""

    def __init__(self, spec: EngineSpec):
        from ray import serve

        from ..runtime.engine import EngineOptions
        from ..runtime.plan import SpeculativeConfig
        from ..runtime.session import load
        from ..cli.serve import with_tool_format
        from .app import create_app

        mib, threshold, factor = spec.suffix
        config = SpeculativeConfig(suffix_cache_mib=mib, suffix_threshold=threshold, suffix_factor=factor)
        session = load(Path(spec.engines), spec.precision, spec.speculate, EngineOptions(threads=spec.threads),
                       config=config, parallel=spec.parallel, prefill_chunk=spec.prefill_chunk)
        self.app = create_app(with_tool_format(session, spec.tool_format), session.manifest.name, spec.api_key,
                              spec.max_queue, cache_ram_mib=spec.cache_ram_mib,
                              default_max_tokens=spec.default_max_tokens, suffix_scope=spec.suffix_scope,
                              reasoning=spec.reasoning)
        self.replica = serve.get_replica_context().replica_id.unique_id
        logging.getLogger("specrt.server").setLevel(logging.INFO)

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                      client: tuple | None = None, conversation: str | None = None):
        """Run one HTTP request through the app; yield {"status", "headers"} and then the body's chunks (bytes).
        Closing this generator (the client went away) disconnects the request: a stream stops at its next round
        boundary."""
        import asyncio

        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await out.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": headers, "client": client, "server": None, "state": {}}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda t: out.put_nowait(None))
        try:
            while True:
                message = await out.get()
                if message is None:  # the app returned (or failed) without finishing its response
                    if not task.cancelled() and task.exception() is not None:
                        log.error("request failed: %s", first_line(task.exception()))
                    return
                if message["type"] == "http.response.start":
                    yield {"status": message["status"],
                           "headers": list(message.get("headers", [])) + [(REPLICA_HEADER.encode(),
                                                                          self.replica.encode())]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 -- the request is over either way
                    task.cancel()

    def __del__(self):  # Serve's graceful shutdown: every open stream stops at its next round boundary
        server = getattr(getattr(self, "app", None), "state", None)
        server = getattr(server, "server", None)
        if server is not None:
            server.close_all()
            server.worker.shutdown(wait=False, cancel_futures=True)


class SpecrtIngress:
    """The HTTP entry: reads each request, computes its conversation key and forwards it to an engine replica
    (the router picks which), relaying the streamed answer."""

    def __init__(self, engine):
        self.engine = engine.options(stream=True)

    async def __call__(self, request):
        from ray.exceptions import RayActorError
        from starlette.responses import StreamingResponse

        body = await request.body()
        key = conversation_key(request.url.path, body, request.headers.get(CONVERSATION_HEADER))
        client = (request.client.host, request.client.port) if request.client else None
        args = (request.method, request.url.path, request.url.query.encode(), list(request.scope["headers"]), body,
                client)
        for attempt in range(START_RETRIES + 1):
            gen = self.engine.forward.remote(*args, **{CONVERSATION_KWARG: key})
            try:
                start = await gen.__anext__()
                break
            except RayActorError as e:  # the replica died before it answered: nothing was sent, try a live one
                gen.cancel()
                if attempt == START_RETRIES:
                    raise RuntimeError(f"the engine replicas died before answering: {first_line(e)}") from None
                log.warning("an engine replica died before answering; retrying (%s)", first_line(e))
            except StopAsyncIteration:
                raise RuntimeError("the engine replica returned no response") from None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]
                   if k.lower() != b"content-length"}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._relay(gen, sse, headers.get(REPLICA_HEADER)), status_code=start["status"],
                                 headers=headers)

    @staticmethod
    async def _relay(gen, sse: bool, replica: str | None):
        finished = False
        try:
            async for chunk in gen:
                yield chunk
            finished = True
        except Exception as e:  # noqa: BLE001 -- the replica died mid-answer: end this response cleanly
            log.warning("engine replica %s failed mid-answer: %s", replica, first_line(e))
            if sse:
                why = first_line(e).rstrip(".")
                yield _sse_error(f"the engine replica serving this stream failed ({why}); retry the request")
            finished = True
        finally:
            if not finished:  # the client went away: stop the generation on the replica
                gen.cancel()


def build_app(spec: EngineSpec, placement: Placement, ingress_cpus: float = 0, engine_cls=None):
    """The Serve application: the ingress bound to N engine replicas routed by conversation. engine_cls: a
    subclass of SpecrtEngine to deploy instead (tests pace its streams)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    engine = serve.deployment(engine_cls or SpecrtEngine, name=ENGINE_DEPLOYMENT).options(
        num_replicas=placement.replicas,
        ray_actor_options={"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus},
        max_ongoing_requests=spec.max_queue + 4,  # the server's own queue answers 503 first
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_CLASS),
        health_check_period_s=2, health_check_timeout_s=10,
    )
    ingress = serve.deployment(SpecrtIngress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1, ray_actor_options={"num_cpus": ingress_cpus},
        max_ongoing_requests=max(100, placement.replicas * (spec.max_queue + 4)),
    )
    return ingress.bind(engine.bind(spec))


SERVE_RAY_HELP = {
    "--replicas": "Engine replicas (default: one per --gpus-per-replica GPUs, or per --cores-per-replica cores, of "
                  "the Ray cluster; with neither, 1).",
    "--cores-per-replica": "CPUs Ray reserves per replica, and the engine's threads (0 = the cluster's CPUs shared "
                           "evenly).",
    "--gpus-per-replica": "GPUs Ray reserves per replica (num_gpus; fractions share one).",
    "--api-key": "Require 'Authorization: Bearer KEY' on /v1 routes.",
    "--max-queue": "Per replica: requests that may wait or run at once.",
    "--parallel": "Per replica: streams decoded at once (as for `specrt serve`).",
    "--cache-ram": "Per replica: host memory for other conversations' KV caches.",
    "--address": "A running Ray cluster to join ('auto' or host:port; default: start a local Ray instance).",
}


def serve_ray(
    engines_dir: Path = typer.Option(Path("engines/smollm2-135m"), "--engines", "-e", help="Engine set folder."),
    replicas: Optional[int] = typer.Option(None, "--replicas", "-n", help=SERVE_RAY_HELP["--replicas"]),
    cores_per_replica: int = typer.Option(0, "--cores-per-replica", metavar="N",
                                          help=SERVE_RAY_HELP["--cores-per-replica"]),
    gpus_per_replica: float = typer.Option(0, "--gpus-per-replica", metavar="G",
                                           help=SERVE_RAY_HELP["--gpus-per-replica"]),
    host: str = typer.Option("127.0.0.1", "--host", help="Address Serve's HTTP proxy listens on."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    speculate: str = typer.Option("auto", "--speculate", help="As for `specrt serve`."),
    precision: str = typer.Option("fp32", "--precision", help="Which target engine of the set to run."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECRT_API_KEY", help=SERVE_RAY_HELP["--api-key"]),
    max_queue: int = typer.Option(16, "--max-queue", help=SERVE_RAY_HELP["--max-queue"]),
    parallel: int = typer.Option(1, "--parallel", "-np", help=SERVE_RAY_HELP["--parallel"]),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", metavar="TOKENS",
                                                help="Per replica, as for `specrt serve`.", show_default=False),
    cache_ram: int = typer.Option(1024, "--cache-ram", metavar="MIB", help=SERVE_RAY_HELP["--cache-ram"]),
    default_max_tokens: int = typer.Option(512, "--default-max-tokens", metavar="TOKENS", help=DEFAULT_MAX_TOKENS_HELP),
    suffix_cache: float = typer.Option(64, "--suffix-cache", metavar="MIB", help="Per replica: " + SUFFIX_CACHE_HELP),
    suffix_scope: SuffixScope = typer.Option("server", "--suffix-scope", metavar="SCOPE", help=SUFFIX_SCOPE_HELP),
    suffix_threshold: float = typer.Option(0.3, "--suffix-threshold", metavar="P", help="As for `specrt serve`."),
    suffix_factor: float = typer.Option(4.0, "--suffix-factor", metavar="X", help="As for `specrt serve`."),
    tool_format: ToolFormatName = typer.Option("auto", "--tool-format", metavar="NAME", help=TOOL_FORMAT_HELP),
    reasoning: Reasoning = typer.Option("separate", "--reasoning", metavar="MODE", help=REASONING_HELP),
    address: Optional[str] = typer.Option(None, "--address", help=SERVE_RAY_HELP["--address"]),
):
    """Serve an engine set on Ray Serve: N replicas of `specrt serve`'s app behind one HTTP endpoint, each
    conversation's turns routed to the replica that holds its KV cache. Needs the ray extra."""
    from ..runtime.plan import SpeculativeConfig
    from ..cli.serve import check_serve_flags

    check_serve_flags(port, max_queue, parallel, cache_ram, api_key, prefill_chunk, default_max_tokens)
    check_flags(replicas, cores_per_replica, gpus_per_replica)
    suffix = (suffix_cache, suffix_threshold, suffix_factor)
    SpeculativeConfig(suffix_cache_mib=suffix_cache, suffix_threshold=suffix_threshold,
                      suffix_factor=suffix_factor).check()
    ray, serve = _import_ray()
    from dataclasses import replace

    from ..runtime.plan import make_plan

    made = make_plan(engines_dir, precision, speculate)  # a wrong folder, precision or mode: one line before Ray starts
    manifest, mode = made.manifest, made.mode  # the replicas get the mode resolved
    ray.init(address=address, logging_level=logging.WARNING)
    started = False
    try:
        placement = plan(replicas, cores_per_replica, gpus_per_replica, ray.cluster_resources())
        spec = replace(EngineSpec(str(Path(manifest.root).resolve())), precision=precision, speculate=mode,
                       threads=placement.threads, api_key=api_key, max_queue=max_queue, cache_ram_mib=cache_ram,
                       parallel=parallel, prefill_chunk=prefill_chunk,
                       default_max_tokens=default_max_tokens or None, suffix=suffix,
                       suffix_scope=suffix_scope.value, tool_format=tool_format.value, reasoning=reasoning.value)
        serve.start(http_options={"host": host, "port": port})
        started = True
        typer.echo(f"loading '{manifest.name}' on {placement.replicas} replicas ({placement.num_cpus:g} CPUs"
                   + (f", {placement.num_gpus:g} GPUs" if placement.num_gpus else "") + " each)", err=True)
        try:
            serve.run(build_app(spec, placement), name=APP_NAME, route_prefix="/")
        except Exception as e:  # noqa: BLE001 -- a replica that cannot load: one line
            raise SpecrtError(f"could not start the replicas: {first_line(e)}") from None
        typer.echo(f"serving at http://{host}:{port}/v1 ({placement.replicas} replicas, routed by "
                   "conversation); Ctrl-C stops", err=True)
        try:
            import time

            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            typer.echo("stopping", err=True)
    finally:
        try:
            if started:
                serve.shutdown()
        finally:
            ray.shutdown()


def _import_ray():
    """(ray, ray.serve), or a one-line SpecrtError naming the extra to install (ray, or the server's FastAPI)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecrtError(INSTALL_HINT) from None
    try:
        import fastapi  # noqa: F401
    except ImportError as e:
        raise SpecrtError(f"`specrt serve-ray` needs the serve extra ({e.name} is missing); "
                          "pip install 'specrt[serve,ray]'") from None
    return ray, serve
