"""`specrt bench --isolate`: every contender in a worker process of its own.

In one process, ONNX Runtime sessions decode faster or slower depending on where their buffers land
(which depends on what was created and freed before them: docs/design-notes.md, "Session load order"),
and whatever one runtime does to the process (thread pools, allocator state, memory advice) touches the
others. A user's process holds one runtime, so `--isolate` gives each contender that: the runner still
interleaves the calls (one at a time, same prompts, same order as without it), a worker sits idle on its
pipe between them, and each call's timings are taken inside its worker, so the pipe costs nothing in the
figures.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
from pathlib import Path

from ..errors import SpecrtError
from .peers import Checkpoint, Trace, Unavailable


def _serve(conn, name: str, engines: str, ck: Checkpoint) -> None:
    """Worker: build the contender, then answer ("run", args) until ("stop",) or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the runner's to handle: it stops the workers
    from ..manifest import load_manifest
    from . import contenders

    try:
        c = contenders.make(name, load_manifest(Path(engines)), ck)
        c.load(log=lambda m: conn.send(("log", m)))
    except Unavailable as e:
        conn.send(("unavailable", str(e)))
        return
    except SpecrtError as e:  # a user's mistake: the runner shows the one-line message
        conn.send(("specrt-error", str(e)))
        return
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        try:
            conn.send(("ok", c.run(*msg[1])))
        except SpecrtError as e:
            conn.send(("specrt-error", str(e)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))


class WorkerError(RuntimeError):
    """A contender failed inside its worker (or the worker died); `detail` is the worker's traceback."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def _raise(msg: tuple):
    """Re-raise in the runner what a worker reported: the same kinds as an in-process contender raises."""
    kind = msg[0]
    if kind == "unavailable":
        raise Unavailable(msg[1])
    if kind == "specrt-error":
        raise SpecrtError(msg[1])
    raise WorkerError(msg[1], msg[2] if len(msg) > 2 else "")


class Isolated:
    """A contender (ours or a peer) behind a pipe to its own process; same load/run interface."""

    def __init__(self, name: str, engines: Path, ck: Checkpoint):
        self.name, self.engines, self.ck = name, engines, ck
        self.proc = self.conn = None

    def load(self, log=print) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing inherited from the runner's heap
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, self.name, str(self.engines), self.ck), daemon=True,
                                name=f"specrt-bench-{self.name}")
        self.proc.start()
        child.close()
        while True:
            msg = self._recv()
            if msg[0] == "log":
                log(msg[1])
            elif msg[0] == "ready":
                return
            else:
                self.close()
                _raise(msg)

    def run(self, prompt_ids: list[int], messages, max_new_tokens: int) -> Trace:
        self.conn.send(("run", (prompt_ids, messages, max_new_tokens)))
        msg = self._recv()
        if msg[0] != "ok":
            _raise(msg)
        return msg[1]

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(timeout=5)
            code = self.proc.exitcode
            self.close()
            raise WorkerError(f"{self.name}'s worker process died (exit code {code})") from None

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        self.proc = None
