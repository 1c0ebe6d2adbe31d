"""Engine: one compiled decoder plus its static KV cache. It knows nothing about text.

Contract: the cache holds `length` committed positions. `forward(tokens)` writes the K/V of the
new tokens at [length, length + n) and returns logits; it does not commit. `commit(n)` makes the
first n of them part of the context; anything written past that is garbage that the next pass
overwrites, which is why rejecting a draft costs nothing. For a token tree, `commit(path=...)`
moves the accepted nodes' K/V entries into place (a few rows per layer, never the whole cache).

Buffers (cache, logits) are allocated once; every pass binds them by pointer through IOBinding,
and past/present are the same buffer, so there is one host sync per pass and no per-step copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..errors import SpecrtError, first_line
from ..interface import APPROX_INPUT, GREEDY_OUTPUT  # an fp32 engine's logit screen (build/screen.py)
from .hugepages import advise_huge_pages, anonymous_mappings

# The screen's work grows with the rows of logits a pass returns, the fp32 lm_head's hardly: SmolLM2 passes over
# real text saved 1.4 / 1.3 / 1.2 / 0.4 ms at 1 / 2 / 4 / 8 rows and lost 1.3-1.8 ms at 12-16 (BENCHMARKS "Session 10").
SCREEN_MAX_ROWS = 6


class ContextFullError(SpecrtError):
    pass


# For sessions that take turns on the same cores (a target and its draft model): ONNX Runtime's intra-op
# threads keep spinning for a while after a Run returns, and on 2 cores the spinning threads of one session
# stole the cores the other needed. SmolLM2 fp32 target + its int4 engine as a draft, 2 threads each, K = 3:
# verify 46 ms and 3 draft steps 38 ms a round by default, 24-25 ms and 20 ms with spinning stopped when a
# Run returns (one shared global pool: 24 and 19 ms, but that binds every session in the process). Not on
# for a lone target: plain steps measured 0-6% (fp32) and 1-12% (int4) slower with it (threads wake per pass).
TAKING_TURNS = {"session.force_spinning_stop": "1"}


def open_session(onnx_path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU session for onnx_path; a corrupt or incomplete engine file is a one-line SpecrtError, not ORT's
    traceback (ORT raises its own exception types: InvalidProtobuf, Fail, NoSuchFile, ...)."""
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except MemoryError:
        raise
    except Exception as e:
        raise SpecrtError(f"cannot load engine '{onnx_path}' ({first_line(e)}); rebuild the engine set with `specrt engines`") from None


def screen_unusable(facts: dict | None, built_with: dict | None) -> str | None:
    """Why an engine's logit screen must not be used here (None: it may). Its error bound assumes the int8
    kernel `specrt engines` checked it against: the same onnxruntime on the same CPU family (x86-64's MLAS
    quantizes activations per block; e.g. KleidiAI on Arm quantizes per row, which the bound does not cover)."""
    import platform

    if not facts:
        return "engine built without a logit screen"
    if os.environ.get("SPECRT_LOGIT_SCREEN", "1") == "0":
        return "SPECRT_LOGIT_SCREEN=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"checked on x86-64 only, this is {platform.machine()}"
    built = (built_with or {}).get("onnxruntime")
    if built != ort.__version__:
        return f"built with onnxruntime {built}, running {ort.__version__} (rebuild with `specrt engines`)"
    if not (facts.get("check") or {}).get("holds"):
        return "its error bound did not hold when the engine was built"
    return None


class OrtEngine:
    CAPACITY_STEP = 256  # reserve() rounds cache layouts up to a multiple of this many positions

    def __init__(self, onnx_path: Path, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 vocab_size: int, max_context: int, max_pass_tokens: int = 64, threads: int = 0,
                 with_hidden: bool = False, session_config: dict[str, str] | None = None, huge_pages: bool = True,
                 screen: bool = False):
        before = anonymous_mappings() if huge_pages else None
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        for key, value in (session_config or {}).items():  # what build/ chose for this engine
            so.add_session_config_entry(key, value)
        self.session = open_session(onnx_path, so)
        self.max_context, self.vocab_size, self.max_pass_tokens = max_context, vocab_size, max_pass_tokens
        self.length = 0
        # One allocation of max_context positions, laid out for `capacity` positions per head (see reserve).
        self._kv = np.zeros(num_layers * 2 * num_kv_heads * max_context * head_dim, np.float32)
        self._kv_dims = (num_layers, num_kv_heads, head_dim)
        self.capacity = 0
        self.cache = self._kv[:0]
        self._logits = np.empty((max_pass_tokens, vocab_size), np.float32)
        self.with_hidden = False
        self._hidden = np.empty((0, 0), np.float32)
        self.hidden = self._hidden  # [n, hidden] of the last pass (with_hidden only), a view into a reused buffer
        if with_hidden:
            self.enable_hidden()
        # An fp32 engine with a logit screen takes a flag per pass (fp32 or screened lm_head) and returns the
        # greedy token of each row too; screened, those are the exact fp32 argmax at a quarter of the lm_head's
        # bytes (build/screen.py). `screen`: use it on greedy passes (from_entry decides where it is safe).
        inputs = {i.name for i in self.session.get_inputs()}
        self._has_screen = APPROX_INPUT in inputs
        self.screen = screen and self._has_screen
        self.screen_note: str | None = None if self.screen else "not in use"
        self._flags = (np.array(False), np.array(True))
        self.greedy = np.empty(max_pass_tokens, np.int64)  # [num_logits] greedy tokens of the last pass (screen graphs)
        self._io = self.session.io_binding()
        self.reserve(max_context)
        self._zero_mask = np.zeros(max_pass_tokens * max_pass_tokens, np.float32)  # flat: any [1,n,n] view is contiguous
        if huge_pages:  # weights pre-packed and cache allocated: ask for huge pages (hugepages.py; ~1.5 ms/step)
            advise_huge_pages(since=before)

    def reserve(self, positions: int) -> None:
        """Lay the cache out for about `positions` positions per head (rounded up to CAPACITY_STEP, at most
        max_context, never fewer than are committed). A request that knows its size asks for it, so
        each head's keys sit closer together: SmolLM2 fp32 decode steps measured 0.22 ms (~1%) faster
        here than with a 4096-position layout (median of 36 paired requests, same session; int4: 0.04 ms).
        Free while the cache is empty; otherwise the committed entries are copied into the new layout."""
        step = self.CAPACITY_STEP
        cap = min(self.max_context, -(-max(positions, self.length, 1) // step) * step)
        if cap == self.capacity:
            return
        layers, kv_heads, head_dim = self._kv_dims
        cache = self._kv[: layers * 2 * kv_heads * cap * head_dim].reshape(layers, 2, 1, kv_heads, cap, head_dim)
        if self.length:  # old and new layouts share memory: copy out first
            cache[..., : self.length, :] = self.cache[..., : self.length, :].copy()
        self.cache, self.capacity = cache, cap
        for i in range(layers):
            for j, kind in enumerate(("key", "value")):
                buf = ort.OrtValue.ortvalue_from_numpy(cache[i, j])
                self._io.bind_ortvalue_input(f"past_key_values.{i}.{kind}", buf)
                self._io.bind_ortvalue_output(f"present.{i}.{kind}", buf)

    @classmethod
    def from_entry(cls, root: Path, entry, threads: int = 0, taking_turns: bool = False, **kwargs) -> "OrtEngine":
        """The engine a manifest entry (specrt.manifest.EngineEntry) describes, under engine-set folder root.
        taking_turns: another session of this process runs between its passes (TAKING_TURNS)."""
        config = {**(entry.raw.get("session_config") or {}), **(TAKING_TURNS if taking_turns else {})}
        note = screen_unusable(entry.raw.get("screen"), entry.raw.get("build_versions"))
        engine = cls(Path(root) / entry.file, num_layers=entry.num_layers, num_kv_heads=entry.num_kv_heads,
                     head_dim=entry.head_dim, vocab_size=entry.vocab_size, max_context=entry.max_context,
                     threads=threads, session_config=config, screen=note is None, **kwargs)
        engine.screen_note = note
        return engine

    def enable_hidden(self) -> None:
        """Opt in to the final-norm hidden state of every token of each pass (Medusa/EAGLE heads read it)."""
        if not self.with_hidden:
            outs = {o.name: o.shape for o in self.session.get_outputs()}
            if "hidden_states" not in outs:
                raise SpecrtError("this target engine has no hidden_states output; rebuild it with `specrt engines`")
            self._hidden = np.empty((self.max_pass_tokens, int(outs["hidden_states"][-1])), np.float32)
            self.with_hidden = True

    def argmax(self, tokens: np.ndarray, positions: np.ndarray | None = None,
               tree_mask: np.ndarray | None = None, num_logits: int = 1) -> np.ndarray:
        """forward(), for the greedy token of each of the last num_logits rows only: [num_logits] int64, a
        view into a reused buffer. Through the logit screen where the engine has one and may use it."""
        if not self._has_screen:
            return self.forward(tokens, positions, tree_mask, num_logits).argmax(axis=1)
        self.forward(tokens, positions, tree_mask, num_logits, approx=self.screen and num_logits <= SCREEN_MAX_ROWS)
        return self.greedy[:num_logits]

    def forward(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                tree_mask: np.ndarray | None = None, num_logits: int = 1, approx: bool = False) -> np.ndarray:
        """tokens [n] int64 -> logits [num_logits, vocab] for the last num_logits tokens.

        positions [n] default to length + arange(n); tree_mask [n, n] additive, default causal.
        The returned array is a view into a reused buffer: copy it to keep it past the next pass.
        approx (screen engines): the logits of the 8-bit lm_head, not fp32; only self.greedy is exact then.
        """
        n = len(tokens)
        if self.length + n > self.max_context:
            raise ContextFullError(
                f"context full: {self.length} + {n} tokens exceed max_context {self.max_context}; "
                "shorten the prompt or lower --max-new-tokens, or rebuild the engines with a larger --max-context")
        if self.length + n > self.capacity:  # past what the request reserved: grow (copies the cache once)
            self.reserve(max(self.length + n, 2 * self.capacity))
        if not 1 <= num_logits <= min(n, self.max_pass_tokens):
            raise ValueError(f"a pass returns 1..min(n, {self.max_pass_tokens}) logits, asked {num_logits} of {n}")
        if positions is None:
            positions = np.arange(self.length, self.length + n, dtype=np.int64)
        if tree_mask is not None:
            mask = tree_mask.reshape(1, n, n)
        elif n <= self.max_pass_tokens:
            mask = self._zero_mask[: n * n].reshape(1, n, n)
        else:  # a long prefill: once per request, so this allocation is fine
            mask = np.zeros((1, n, n), np.float32)
        buf = None
        if self.with_hidden:  # a long prefill (once per request) gets its own buffer
            buf = self._hidden if n <= self.max_pass_tokens else np.empty((n, self._hidden.shape[1]), np.float32)
            self.hidden = buf[:n]
        if tree_mask is not None and self.length == 0 and n > 1:
            # ORT's GroupQueryAttention does not keep tree siblings apart when the cache is empty (a node's
            # logits moved by up to 7.8e-3 with a sibling before it; 7e-7 with one token cached), so the
            # first token goes alone: same cache contents and outputs, one extra pass, only for a tree
            # drafted in the very first round (no shipped proposer does that).
            self._run(tokens[:1], positions[:1], mask[:, :1, :1], 1, 0, buf, approx)
            self.length = 1
            try:
                keep = min(num_logits, n - 1)
                self._run(tokens[1:], positions[1:], np.ascontiguousarray(mask[:, 1:, 1:]), keep,
                          num_logits - keep, None if buf is None else buf[1:], approx)
            finally:
                self.length = 0
        else:
            self._run(tokens, positions, mask, num_logits, 0, buf, approx)
        return self._logits[:num_logits]

    def _run(self, tokens, positions, mask, num_logits: int, row: int, hidden, approx: bool = False) -> None:
        """One session run: logits into self._logits[row:row + num_logits], hidden states into `hidden`; approx:
        through the logit screen (engines that have one; others ignore it)."""
        n, io = len(tokens), self._io
        io.bind_cpu_input("input_ids", np.ascontiguousarray(tokens, np.int64).reshape(1, n))
        io.bind_cpu_input("position_ids", np.ascontiguousarray(positions, np.int64).reshape(1, n))
        io.bind_cpu_input("tree_mask", np.ascontiguousarray(mask, np.float32))
        io.bind_cpu_input("seqlens_k", np.array([self.length + n - 1], np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(self.length + n, np.int32))
        io.bind_cpu_input("num_logits_to_keep", np.array(num_logits, np.int64))
        io.bind_output("logits", "cpu", 0, np.float32, [1, num_logits, self.vocab_size], self._logits[row:].ctypes.data)
        if self._has_screen:
            io.bind_cpu_input(APPROX_INPUT, self._flags[approx])
            io.bind_output(GREEDY_OUTPUT, "cpu", 0, np.int64, [1, num_logits], self.greedy[row:].ctypes.data)
        if hidden is not None:
            io.bind_output("hidden_states", "cpu", 0, np.float32, [1, n, hidden.shape[1]], hidden.ctypes.data)
        self.session.run_with_iobinding(io)

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Accept n of the tokens of the last pass. path [n]: their indices in that pass (trees)."""
        if path is not None:
            src = self.length + np.asarray(path, np.int64)
            dst = self.length + np.arange(n)
            moved = src != dst
            if moved.any():
                self.cache[:, :, :, :, dst[moved]] = self.cache[:, :, :, :, src[moved]]
        self.length += n

    def rewind(self, length: int = 0) -> None:
        self.length = length
