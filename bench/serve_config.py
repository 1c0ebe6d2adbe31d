"""bench-serve's configuration (bench/serve_load.py runs it): the servers to drive and the load to put on them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .prompts import DEFAULT_PROMPTS

DEFAULT_CONCURRENCY = (1, 2, 4, 8)
DEFAULT_NUM_PROMPTS = 12   # 2 per category: concurrency 1,2,4,8 x 128 tokens in ~1.5 min per server on 2 cores
TURN_MAX_TOKENS = 48       # bench/multiturn.py's answer length (a voice assistant's)


@dataclass
class Target:
    """One server to drive: its name in the report, base URL (no /v1), kind ("specrt" and "llamacpp" when
    launched here, "url" for a running one), the model id it lists, and how it was launched."""
    name: str
    url: str
    kind: str = "url"
    model: str | None = None
    command: list[str] | None = None
    log: Path | None = None


@dataclass(frozen=True)
class ServeBenchConfig:
    engines: Path | None = None              # launch `specrt serve` on it (and the in-process baseline)
    urls: tuple[str, ...] = ()               # running servers: "URL" or "NAME=URL"
    llamacpp: bool = False                   # also launch llama-cpp-python's server on the set's GGUF
    in_process: bool = True                  # with engines: the in-process baseline
    overhead_reps: int = 1                   # (in-process, `specrt serve`) single-stream pairs, interleaved
    prompts: Path = DEFAULT_PROMPTS
    num_prompts: int = DEFAULT_NUM_PROMPTS
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    max_tokens: int = 128
    conversations: int = 2                   # multi-turn conversations (0 = none)
    turn_max_tokens: int = TURN_MAX_TOKENS
    ignore_eos: bool = True
    min_tokens: bool = False                 # also send min_tokens = max_tokens (llama-cpp-python, vLLM)
    speculate: str = "auto"                  # for the launched `specrt serve` and the in-process baseline
    precision: str = "fp32"
    threads: int = 0                         # 0 = all cores; every launched server and the baseline get it
    api_key: str | None = None               # sent to URL servers
    health_timeout_s: float = 10.0           # a URL server must answer /health (or /v1/models) within it
    start_timeout_s: float = 300.0           # a launched server must be up within it
    request_timeout_s: float = 600.0
    serve_args: tuple[str, ...] = ()         # appended to the launched `specrt serve` command line
    llamacpp_args: tuple[str, ...] = ()      # appended to the launched llama-cpp-python server's
    system_prompt: str | None = None         # multi-turn material (None: bench/multiturn.py's)
    turns: tuple[str, ...] | None = None
    voice: Path | None = None                # the voice workload file (bench/voice.py) instead of the loads above
    voice_calls: int = 8
    ours: tuple[tuple[str, str], ...] = ()   # voice: (precision, speculate) per launched `specrt serve`
    llama_server: bool = False               # voice: also llama.cpp's llama-server (bench/llama_server.py)
    llama_gguf: Path | None = None           # its model (None: the GGUF the engine set was built from)
    llama_draft: Path | None = None          # its draft model's GGUF (-md), a speculative mode to try
    llama_server_args: tuple[str, ...] = ()  # appended to every llama-server command line
    llama_modes: tuple[str, ...] = ()        # its speculative modes to try (bench/llama_server.py SPEC_MODES)
