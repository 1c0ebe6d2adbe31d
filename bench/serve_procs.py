"""bench-serve's servers: launching `specrt serve` and llama-cpp-python's server on a free loopback port, waiting
until they answer, their logs; and the llama.cpp server's entry point, run in its own process:

    python -m specrt.bench.serve_procs --model X.gguf ...   llama-cpp-python's server, with the AMX workaround
"""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import SpecrtError
from .serve_config import ServeBenchConfig, Target


LLAMACPP_PIP = "pip install 'llama-cpp-python[server]==0.3.36'"


def _log_hint(target: Target) -> str:
    """A launched server's last log line (the log itself is a temporary file until the report is written)."""
    return f"; its log ends: {_last_line(target.log)}" if target.log is not None else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(target: Target, timeout_s: float, proc: subprocess.Popen | None = None,
               api_key: str | None = None) -> None:
    """Until GET /health answers 200 (or, for servers without it, GET /v1/models); then the model id."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, last = time.monotonic() + timeout_s, "no answer"
    with httpx.Client(timeout=5, headers=headers) as http:
        while True:
            if proc is not None and proc.poll() is not None:
                raise SpecrtError(f"server '{target.name}' exited (code {proc.returncode}) before answering "
                                  f"/health; its log ends: {_last_line(target.log)}; run it by hand to see all: "
                                  + shlex.join(proc.args))
            try:
                r = http.get(target.url + "/health")
                if r.status_code == 404:
                    r = http.get(target.url + "/v1/models")
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
                if r.status_code in (401, 403):
                    raise SpecrtError(f"server '{target.name}' ({target.url}) refused the request ({last}); pass "
                                      "its key with --api-key")
            except httpx.HTTPError as e:
                last = type(e).__name__
            if time.monotonic() > deadline:
                hint = ("start it first (e.g. `specrt serve --port 8000`) or fix --url" if proc is None else
                        "it may still be loading: raise --start-timeout")
                raise SpecrtError(f"server '{target.name}' ({target.url}) did not answer GET /health or /v1/models "
                                  f"within {timeout_s:g} s ({last}); {hint}" + _log_hint(target))
            time.sleep(0.2)
        try:
            models = http.get(target.url + "/v1/models").json().get("data") or []
            target.model = models[0]["id"] if models else None
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
            target.model = None


def _last_line(log: Path | None) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except (OSError, AttributeError):
        return "no output"
    return lines[-1][:300] if lines else "no output"


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def launched(target: Target, cmd: list[str], timeout_s: float):
    """Run a server subprocess (its output to target.log) until it answers; stop it on the way out."""
    target.command = cmd
    with open(target.log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    # SIGTERM's default ends Python without running this `finally`: the server would outlive the bench
    own_signals = _main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if own_signals else None
    try:
        wait_ready(target, timeout_s, proc)
        yield target
    finally:
        if own_signals:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def specrt_command(cfg: ServeBenchConfig, port: int) -> list[str]:
    return [sys.executable, "-m", "specrt.cli", "serve", "--engines", str(cfg.engines), "--host", "127.0.0.1",
            "--port", str(port), "--speculate", cfg.speculate, "--precision", cfg.precision,
            "--threads", str(cfg.threads), "--max-queue", str(max(16, 2 * max(cfg.concurrency))), *cfg.serve_args]


def llamacpp_command(gguf: Path, port: int, n_ctx: int, threads: int) -> list[str]:
    """llama-cpp-python's server at its defaults except: the cores given to every contender; interrupt_requests
    off (its default cuts a streaming answer short as soon as another request arrives, so concurrency > 1 would
    measure truncated answers); logits_all off (its default computes the lm_head on every prompt position, for
    logprobs nobody asks for here: a slower prefill); verbose off (a timing printout per request)."""
    return [sys.executable, "-m", "specrt.bench.serve_procs", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch",
            str(threads), "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]


def check_llamacpp_server() -> None:
    import importlib.util

    try:
        found = all(importlib.util.find_spec(m) is not None
                    for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"))
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SpecrtError(f"--llamacpp needs llama-cpp-python's server, which is not installed; {LLAMACPP_PIP} "
                          "(or pip install -e '.[peers]')")


def llamacpp_main() -> None:  # pragma: no cover - runs in the server subprocess
    """llama-cpp-python's server (`python -m llama_cpp.server`), with bench/peers.py's workaround on AMX CPUs:
    ggml's AMX kernels segfault on Q4_1 weights with a batch > 1 in 0.3.36, so extra buffer types go off."""
    from .peers import _has_amx

    if _has_amx():
        import llama_cpp.llama as llama_mod

        default_params = llama_mod.llama_cpp.llama_model_default_params

        def params_without_extra_bufts():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_mod.llama_cpp.llama_model_default_params = params_without_extra_bufts
    from llama_cpp.server.__main__ import main

    main()


if __name__ == "__main__":  # pragma: no cover
    llamacpp_main()
