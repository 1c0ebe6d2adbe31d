"""`specrt serve`: the typer command. Only typer at import time (FastAPI and uvicorn load inside it), so
`specrt --help` stays fast and works without the `serve` extra."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from . import model_flags as mf
from ..errors import SpecrtError
from ..runtime.methods import modes_help
from ..runtime.tool_formats import NAMES as TOOL_FORMATS
from ..server.scopes import SUFFIX_SCOPES

SuffixScope = Enum("SuffixScope", {s: s for s in SUFFIX_SCOPES}, type=str)  # --suffix-scope's choices, for typer
ToolFormatName = Enum("ToolFormatName", {s: s for s in ("auto", *TOOL_FORMATS)}, type=str)
Reasoning = Enum("Reasoning", {s: s for s in ("separate", "off")}, type=str)
REASONING_HELP = ("A thinking model's reasoning (docs/formats.md): separate (sent as reasoning_content, never as "
                  "content) or off (the chat template's no-thinking switch, e.g. enable_thinking=false, where it "
                  "has one; a request's chat_template_kwargs still decide).")
TOOL_FORMAT_HELP = ("How the model writes tool calls and is shown tools (docs/formats.md): auto (from the chat "
                    "template and the tokenizer's special tokens) or one of " + ", ".join(TOOL_FORMATS) + ".")


def check_serve_flags(port: int, max_queue: int, parallel: int, cache_ram: int, api_key: str | None,
                      prefill_chunk: int | None = None, default_max_tokens: int = 0) -> None:
    """The flags `serve` and `serve-ray` share, checked before anything loads (one line each)."""
    if not 0 < port < 65536:
        raise SpecrtError(f"--port must be in 1..65535, got {port}")
    if max_queue < 1:
        raise SpecrtError(f"--max-queue must be >= 1, got {max_queue}")
    if parallel < 1:
        raise SpecrtError(f"--parallel must be >= 1, got {parallel}")
    if cache_ram < 0:
        raise SpecrtError(f"--cache-ram must be >= 0 MiB, got {cache_ram}")
    if api_key is not None and not api_key.strip():
        raise SpecrtError("--api-key is empty; pass a key or omit the flag")
    if default_max_tokens < 0:
        raise SpecrtError(f"--default-max-tokens must be >= 0 (0 = the rest of the context), got {default_max_tokens}")
    if prefill_chunk is not None:
        from ..runtime.batch_session import check_prefill_chunk

        check_prefill_chunk(prefill_chunk)


DEFAULT_MAX_TOKENS_HELP = ("A chat reply's length when the request sends no max_tokens (Pipecat and LiveKit send "
                           "none): one runaway reply holds the engine while every other caller waits. 0 = the rest "
                           "of the context.")
SUFFIX_CACHE_HELP = ("--speculate suffix: memory for the stores of earlier answers it drafts from, all scopes "
                     "together (least recently used answer out; 0 = off: each request's own text only).")
SUFFIX_SCOPE_HELP = ("--speculate suffix: whose earlier answers a request drafts from, since how fast an answer "
                     "comes reveals what they looked like: server (every request's; one tenant), api-key (those "
                     "sent with the same bearer token), conversation (this conversation's only).")
DEFAULT_PARALLEL = 4   # where the backend batches; why: docs/voice.md, "The --parallel default"
PARALLEL_HELP = (f"Streams decoded at once, their passes batched (llama.cpp's server --parallel). Default "
                 f"{DEFAULT_PARALLEL} where the set's backend batches, else 1: with one stream at a time a fourth "
                 "caller waits for three whole answers, while a lone caller pays a little per token for the batch "
                 "(docs/voice.md, \"The --parallel default\"); a server for one caller at a time: --parallel 1. "
                 "Draft lengths then follow the load unless --draft-tokens fixes them.")
# its default is batch_session.PREFILL_CHUNK (tested)
PREFILL_CHUNK_HELP = ("With --parallel: a prompt longer than this many tokens is read in chunks of it, the other "
                      "streams decoding between them, so their next token waits for one chunk, not the whole prompt "
                      "(SGLang's --chunked-prefill-size; 0 = one pass). Default 128.")


def serve(
    engines_dir: Optional[Path] = typer.Option(None, "--engines", "-e", show_default=False,
                                               help="Engine set folder. Default engines/smollm2-135m."),
    model: Optional[str] = mf.model_option(),
    backend: Optional[str] = mf.backend_option(mf.MODEL_PANEL),
    max_context: Optional[int] = mf.max_context_option(mf.MODEL_PANEL, mf.MODEL_CONTEXT_DEFAULT),
    medusa_heads: Optional[str] = mf.medusa_heads_option(mf.MODEL_PANEL),
    eagle_head: Optional[str] = mf.eagle_head_option(mf.MODEL_PANEL, mf.MODEL_EAGLE_DEFAULT),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 = every interface)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    speculate: str = typer.Option("auto", "--speculate", help=modes_help()),
    precision: str = typer.Option("fp32", "--precision", help="Which target engine of the set to run."),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0 = all cores)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECRT_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes (or set "
                                               "SPECRT_API_KEY)."),
    max_queue: int = typer.Option(16, "--max-queue",
                                  help="Requests that may wait or run at once; the next gets 503 with Retry-After."),
    parallel: Optional[int] = typer.Option(None, "--parallel", "-np", help=PARALLEL_HELP, show_default=False),
    draft_tokens: Optional[int] = typer.Option(None, "--draft-tokens",
                                               help="Fixed draft length K (default: adaptive, by load with "
                                                    "--parallel)."),
    suffix_cache: float = typer.Option(64, "--suffix-cache", metavar="MIB", help=SUFFIX_CACHE_HELP),
    suffix_scope: SuffixScope = typer.Option("server", "--suffix-scope", metavar="SCOPE", help=SUFFIX_SCOPE_HELP),
    suffix_threshold: float = typer.Option(0.3, "--suffix-threshold", metavar="P",
                                           help="--speculate suffix: the least probability (0, 1] of a drafted "
                                                "path, from how often it followed before."),
    suffix_factor: float = typer.Option(4.0, "--suffix-factor", metavar="X",
                                        help="--speculate suffix: the most tokens drafted per token of the matched "
                                             "suffix."),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", metavar="TOKENS", help=PREFILL_CHUNK_HELP,
                                                show_default=False),
    cache_ram: int = typer.Option(1024, "--cache-ram", metavar="MIB",
                                  help="Host memory for the KV caches of other conversations, kept while one runs "
                                       "(least recently used out; 0 = reuse only the last request's). Like "
                                       "llama.cpp's server --cache-ram."),
    default_max_tokens: int = typer.Option(512, "--default-max-tokens", metavar="TOKENS",  # server.DEFAULT_MAX_TOKENS
                                           help=DEFAULT_MAX_TOKENS_HELP),
    tool_format: ToolFormatName = typer.Option("auto", "--tool-format", metavar="NAME", help=TOOL_FORMAT_HELP),
    reasoning: Reasoning = typer.Option("separate", "--reasoning", metavar="MODE", help=REASONING_HELP),
):
    """Serve an engine set over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions
    (streamed as server-sent events or not), /v1/models, /health (503 while the engines load), /metrics.
    --parallel N requests run at once (default 4), the rest queue; each conversation's KV cache is reused by its
    next turn."""
    check_serve_flags(port, max_queue, 1 if parallel is None else parallel, cache_ram, api_key, prefill_chunk,
                      default_max_tokens)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise SpecrtError(f"`specrt serve` needs the serve extra ({e.name} is missing); "
                          "pip install 'specrt[serve]'") from None
    from ..runtime.engine import EngineOptions
    from ..runtime.plan import SpeculativeConfig, make_plan
    from ..runtime.session import open_session

    config = SpeculativeConfig(draft_tokens=draft_tokens, suffix_cache_mib=suffix_cache,
                               suffix_threshold=suffix_threshold, suffix_factor=suffix_factor)
    config.check()  # before a --model build
    engines_dir, served = mf.chosen_engines(engines_dir, model, precision, backend, max_context, medusa_heads,
                                            eagle_head)
    # a wrong folder, precision or mode: one line now, before listening; the session runs this plan (runtime/plan.py)
    plan = make_plan(engines_dir, precision, speculate, EngineOptions(threads=threads), config)
    if parallel is None:
        from ..backends import BACKENDS

        parallel = DEFAULT_PARALLEL if BACKENDS[plan.target.backend].batch else 1
    run_server(lambda: with_tool_format(open_session(plan, parallel=parallel, prefill_chunk=prefill_chunk),
                                        tool_format.value),
               served or plan.manifest.name, host, port, api_key, max_queue, cache_ram, default_max_tokens or None,
               suffix_scope.value, reasoning.value)


def with_tool_format(session, name: str):
    """The session, its replies read and its prompts written in the format `name` ("auto": the detected one)."""
    if name != "auto":
        from ..runtime.tool_formats import by_name

        session.codec.use_format(by_name(name))
    return session


def run_server(loader, model: str, host: str, port: int, api_key: str | None, max_queue: int, cache_ram_mib: int,
               default_max_tokens: int | None, suffix_scope: str, reasoning: str = "separate") -> None:
    """Listen at once and load the session (loader()) in the background; a failed load stops the server with a
    one-line SpecrtError."""
    import logging

    import uvicorn

    from ..errors import first_line
    from ..server.app import create_app, log

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    app = create_app(loader=loader, model=model, api_key=api_key, max_queue=max_queue, cache_ram_mib=cache_ram_mib,
                     default_max_tokens=default_max_tokens, suffix_scope=suffix_scope, reasoning=reasoning)
    uv = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    server = app.state.server
    server.on_load_error = lambda: setattr(uv, "should_exit", True)
    log.info("loading '%s'; serving at http://%s:%d/v1 (GET /health: 503 until ready)", model, host, port)
    uv.run()
    if server.load_error is not None:
        raise SpecrtError(f"could not load the engines: {first_line(server.load_error)}")
