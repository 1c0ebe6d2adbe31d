"""The ONNX Runtime CPU backend: decoder engines (the export's GroupQueryAttention graph) and Medusa heads.

Buffers (cache, logits) are allocated once; every pass binds them by pointer through IOBinding, and past and
present are the same buffer, so there is one host sync per pass and no per-step copy. Everything CPU-specific
lives here: huge pages, sessions that take turns on the cores, the fp32 logit screen's safety rule, and the
GroupQueryAttention empty-cache workaround for trees.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...errors import SpecrtError, first_line
from ...interface import (APPROX_INPUT, ATTENTION_MASK, EAGLE_FEATURES, EAGLE_LOGPROBS, EAGLE_TOKENS, GREEDY_OUTPUT,
                          HEADS_CANDIDATES, HEADS_HIDDEN, HEADS_TOKEN, HIDDEN_STATES, INPUT_IDS, KV_KINDS, LOGITS,
                          NUM_LOGITS_TO_KEEP, POSITION_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, TREE_MASK, WRITE_INDICES,
                          past_name, present_name)
from ..engine import EngineOptions, KVSnapshot, check_pass, restore_views, snapshot_views, tree_moves
from ..hugepages import advise_huge_pages, anonymous_mappings

# The screen saves time on narrow passes and loses it on wide ones (docs/runtime-notes.md, "Logit screen row limit").
SCREEN_MAX_ROWS = 6

# Sessions that take turns on the same cores (a target and its draft model) stop ORT's intra-op threads from
# spinning after a Run returns, or the spinning threads of one steal the cores the other needs; a lone target
# keeps the default, which is faster back to back (docs/runtime-notes.md, "Sessions that take turns").
TAKING_TURNS = {"session.force_spinning_stop": "1"}


def bind_in_place(io, layers) -> None:
    """Bind each cache buffer as both its layer's past input and present output: one OrtValue, so the graph writes
    the new positions into it in place. layers: per layer, its [key, value] arrays."""
    for i, layer in enumerate(layers):
        for kind, view in zip(KV_KINDS, layer):
            value = ort.OrtValue.ortvalue_from_numpy(view)
            io.bind_ortvalue_input(past_name(i, kind), value)
            io.bind_ortvalue_output(present_name(i, kind), value)


def open_session(onnx_path: Path, options: ort.SessionOptions, graph: bytes | None = None,
                 providers=("CPUExecutionProvider",)) -> ort.InferenceSession:
    """A session for onnx_path (or for `graph`, a serialized variant of it) on `providers` (the CPU's unless
    asked); a corrupt or incomplete engine file is a one-line SpecrtError, not ORT's traceback (ORT raises its own
    exception types: InvalidProtobuf, Fail, NoSuchFile, ...)."""
    try:
        return ort.InferenceSession(graph if graph is not None else str(onnx_path), options,
                                    providers=list(providers))
    except MemoryError:
        raise
    except Exception as e:
        raise SpecrtError(f"cannot load engine '{onnx_path}' ({first_line(e)}); "
                          "rebuild the engine set with `specrt engines`") from None


def session_options(threads: int = 0, session_config: dict[str, str] | None = None) -> ort.SessionOptions:
    """A decoder engine's session options: all graph optimizations, `threads` intra-op threads (0 = all cores), one
    inter-op thread, and the entries build/ chose for the engine."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    for key, value in (session_config or {}).items():
        so.add_session_config_entry(key, value)
    return so


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


def entry_config(entry, options: EngineOptions) -> tuple[dict[str, str], str | None]:
    """A decoder entry's session config entries under these options, and why its logit screen must not be used
    (None: it may)."""
    config = {**(entry.session_config or {}), **(TAKING_TURNS if options.taking_turns else {})}
    note = screen_unusable(entry.screen, entry.build_versions)
    if note is None and not options.logit_screen:
        note = "turned off (EngineOptions.logit_screen)"
    return config, note


def open_engine(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtEngine":
    """The decoder engine a manifest entry describes (engine.open_engine's ONNX Runtime half)."""
    config, note = entry_config(entry, options)
    engine = OrtEngine(Path(root) / entry.file, num_layers=entry.num_layers, num_kv_heads=entry.num_kv_heads,
                       head_dim=entry.head_dim, vocab_size=entry.vocab_size, max_context=entry.max_context,
                       threads=options.threads, session_config=config, huge_pages=options.huge_pages,
                       screen=note is None, width_exact=entry.width_exact, name=entry.name)
    engine.screen_note = note
    return engine


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtHeads":
    """A Medusa heads engine: one thread, since a call is a few small MatMuls between two target passes."""
    return OrtHeads(Path(root) / entry.file, threads=1, session_config=entry.session_config)


class OrtHeads:
    """The heads engine: hidden [H] (+ the pending token) -> candidates [K, topk] token ids, best first.
    session_config: the entry's (a Q/DQ heads graph runs as written)."""

    def __init__(self, onnx_path: Path, threads: int = 1, session_config: dict[str, str] | None = None,
                 providers=("CPUExecutionProvider",)):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        for key, value in (session_config or {}).items():
            so.add_session_config_entry(key, value)
        self.session = open_session(onnx_path, so, providers=providers)
        shape = self.session.get_outputs()[0].shape   # [batch, K, topk]
        self.heads, self.topk = int(shape[1]), int(shape[2])
        self._h = np.zeros((1, self.session.get_inputs()[0].shape[1]), np.float32)
        self._t = np.zeros(1, np.int64)
        self._feed = {HEADS_HIDDEN: self._h}
        if any(i.name == HEADS_TOKEN for i in self.session.get_inputs()):
            self._feed[HEADS_TOKEN] = self._t

    def __call__(self, hidden: np.ndarray, token: int) -> np.ndarray:
        self._h[0], self._t[0] = hidden, token
        return self.session.run([HEADS_CANDIDATES], self._feed)[0][0]


class OrtEngine:
    CAPACITY_STEP = 256  # reserve() rounds cache layouts up to a multiple of this many positions

    def __init__(self, onnx_path: Path, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 vocab_size: int, max_context: int, max_pass_tokens: int = 64, threads: int = 0,
                 with_hidden: bool = False, session_config: dict[str, str] | None = None, huge_pages: bool = True,
                 screen: bool = False, width_exact: bool = True, name: str | None = None):
        before = anonymous_mappings() if huge_pages else None
        so = session_options(threads, session_config)
        self.session = open_session(onnx_path, so)
        self.max_context, self.vocab_size, self.max_pass_tokens = max_context, vocab_size, max_pass_tokens
        self.width_exact = width_exact
        self.name = name or Path(onnx_path).stem
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
        # bytes (build/screen.py). `screen`: use it on greedy passes (open_engine decides where it is safe).
        inputs = {i.name for i in self.session.get_inputs()}
        self._has_screen = APPROX_INPUT in inputs
        self.screen = screen and self._has_screen
        self.screen_note: str | None = None if self.screen else "not in use"
        self._flags = (np.array(False), np.array(True))
        self.greedy = np.empty(max_pass_tokens, np.int64)  # [num_logits] greedy tokens of the last pass (screen graphs)
        self._io = self.session.io_binding()
        self.reserve(max_context)
        # flat: any [1,n,n] view is contiguous
        self._zero_mask = np.zeros(max_pass_tokens * max_pass_tokens, np.float32)
        if huge_pages:  # weights pre-packed and cache allocated: ask for huge pages (runtime/hugepages.py)
            advise_huge_pages(since=before)

    @property
    def description(self) -> str:
        return f"onnxruntime-cpu {self.name}" + (", logit screen" if self.screen else "")

    def reserve(self, positions: int) -> None:
        """Lay the cache out for about `positions` positions per head (rounded up to CAPACITY_STEP, at most
        max_context, never fewer than are committed): a request that knows its size asks for it, so each
        head's keys sit closer together (docs/runtime-notes.md, "Cache layout per request"). Free while the
        cache is empty; otherwise the committed entries are copied into the new layout."""
        step = self.CAPACITY_STEP
        cap = min(self.max_context, -(-max(positions, self.length, 1) // step) * step)
        if cap == self.capacity:
            return
        layers, kv_heads, head_dim = self._kv_dims
        cache = self._kv[: layers * 2 * kv_heads * cap * head_dim].reshape(layers, 2, 1, kv_heads, cap, head_dim)
        if self.length:  # old and new layouts share memory: copy out first
            cache[..., : self.length, :] = self.cache[..., : self.length, :].copy()
        self.cache, self.capacity = cache, cap
        bind_in_place(self._io, cache)

    def enable_hidden(self) -> None:
        """Opt in to the final-norm hidden state of every token of each pass (Medusa/EAGLE heads read it)."""
        if not self.with_hidden:
            outs = {o.name: o.shape for o in self.session.get_outputs()}
            if HIDDEN_STATES not in outs:
                raise SpecrtError("this target engine has no hidden_states output; rebuild it with `specrt engines`")
            self._hidden = np.empty((self.max_pass_tokens, int(outs[HIDDEN_STATES][-1])), np.float32)
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
        check_pass(self, n, num_logits)
        if self.length + n > self.capacity:  # past what the request reserved: grow (copies the cache once)
            self.reserve(max(self.length + n, 2 * self.capacity))
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
            # GroupQueryAttention does not keep tree siblings apart when the cache is empty, so the first token
            # goes alone: same cache contents and outputs, one extra pass, only for a tree drafted in the very
            # first round (docs/runtime-notes.md, "Trees over an empty cache").
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
        io.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(tokens, np.int64).reshape(1, n))
        io.bind_cpu_input(POSITION_IDS, np.ascontiguousarray(positions, np.int64).reshape(1, n))
        io.bind_cpu_input(TREE_MASK, np.ascontiguousarray(mask, np.float32))
        io.bind_cpu_input(SEQLENS_K, np.array([self.length + n - 1], np.int32))
        io.bind_cpu_input(TOTAL_SEQUENCE_LENGTH, np.array(self.length + n, np.int32))
        io.bind_cpu_input(NUM_LOGITS_TO_KEEP, np.array(num_logits, np.int64))
        io.bind_output(LOGITS, "cpu", 0, np.float32, [1, num_logits, self.vocab_size], self._logits[row:].ctypes.data)
        if self._has_screen:
            io.bind_cpu_input(APPROX_INPUT, self._flags[approx])
            io.bind_output(GREEDY_OUTPUT, "cpu", 0, np.int64, [1, num_logits], self.greedy[row:].ctypes.data)
        if hidden is not None:
            io.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, [1, n, hidden.shape[1]], hidden.ctypes.data)
        self.session.run_with_iobinding(io)

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Accept n of the tokens of the last pass. path [n]: their indices in that pass (trees)."""
        moves = None if path is None else tree_moves(self.length, n, path)
        if moves is not None:
            src, dst = moves
            self.cache[:, :, :, :, dst] = self.cache[:, :, :, :, src]
        self.length += n

    def rewind(self, length: int = 0) -> None:
        self.length = length

    def _views(self) -> list[np.ndarray]:
        return [self.cache[i, j] for i in range(self.cache.shape[0]) for j in range(len(KV_KINDS))]

    def save_prefix(self, length: int) -> KVSnapshot:
        return snapshot_views(self._views(), min(length, self.length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.length = 0  # nothing to keep across the relayout
        self.reserve(snapshot.length)
        restore_views(self._views(), snapshot)
        self.length = snapshot.length


def open_eagle(root: Path, entry, options: EngineOptions = EngineOptions()) -> "OrtEagleHead":
    """An EAGLE head engine (export/eagle.py's graph, standard ops): one thread, like the Medusa heads."""
    e = entry.eagle or {}
    return OrtEagleHead(Path(root) / entry.file, hidden=entry.hidden_size, kv_heads=entry.num_kv_heads,
                        head_dim=entry.head_dim, capacity=int(e["capacity"]), topk=int(e["topk"]), threads=1)


class OrtEagleHead:
    """The EAGLE head: one decoder layer with its own cache, one buffer per key|value of `max_capacity` positions,
    laid out for `capacity` of them ([1, kv_heads, capacity, head_dim] views, bound as past and present): the
    layout follows the context in steps of CAPACITY_STEP (reserve), because attention reads every slot of it.
    `run` writes its rows' K/V at slots [slot, slot + W) and returns the predicted next features and the top-k next
    tokens of every row; the caller's mask says which slots each row sees, so real positions, a chain's steps and
    a tree's levels are all one call."""

    CAPACITY_STEP = 256

    def __init__(self, onnx_path: Path, *, hidden: int, kv_heads: int, head_dim: int, capacity: int, topk: int,
                 threads: int = 1):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        self.session = open_session(onnx_path, so)
        self.hidden_size, self.max_capacity, self.topk = hidden, capacity, topk
        self._heads, self._head_dim = kv_heads, head_dim
        self._buffers = [np.zeros(kv_heads * capacity * head_dim, np.float32) for _ in KV_KINDS]
        self.cache: list[np.ndarray] = []
        self.capacity = 0
        self.length = 0  # real positions the cache holds (slots [0, length))
        self._io = self.session.io_binding()
        self._layout(self.CAPACITY_STEP, 0)
        # outputs land in buffers of `capacity` rows (the widest call: a whole prompt), bound by address per call
        self._hidden = np.empty((capacity, hidden), np.float32)
        self._tokens = np.empty((capacity, topk), np.int64)
        self._logp = np.empty((capacity, topk), np.float32)

    def _layout(self, capacity: int, keep: int) -> None:
        from ..static_shapes import relayout

        self.cache = [relayout(buf, self._heads, self._head_dim, self.capacity, capacity, keep)
                      for buf in self._buffers]
        self.capacity = capacity
        bind_in_place(self._io, [self.cache])

    def reserve(self, slots: int, keep: int | None = None) -> None:
        """Lay the cache out for at least `slots` slots (keeping the first `keep`, default the real positions):
        call it before building a round's masks, which are `capacity` wide."""
        step = self.CAPACITY_STEP
        capacity = min(self.max_capacity, -(-max(slots, 1) // step) * step)
        if capacity != self.capacity:
            self._layout(capacity, min(self.length if keep is None else keep, capacity, self.capacity))

    def run(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, slot: int,
            mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """features [W, H], tokens [W] (the token after each row's position), positions [W], mask [W, capacity]
        additive -> (next features [W, H], top-k tokens [W, k], their log-probabilities [W, k]), fresh arrays
        (a tree keeps the rows of several calls)."""
        W = len(tokens)
        if slot + W > self.capacity or mask.shape[-1] != self.capacity:
            raise ValueError(f"EAGLE head: slots {slot}..{slot + W} with a mask of {mask.shape[-1]} do not fit its "
                             f"layout of {self.capacity} (reserve first)")
        io = self._io
        io.bind_cpu_input(EAGLE_FEATURES, np.ascontiguousarray(features, np.float32).reshape(1, W, -1))
        io.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(tokens, np.int64).reshape(1, W))
        io.bind_cpu_input(POSITION_IDS, np.ascontiguousarray(positions, np.int64).reshape(1, W))
        io.bind_cpu_input(ATTENTION_MASK, np.ascontiguousarray(mask, np.float32).reshape(1, 1, W, self.capacity))
        io.bind_cpu_input(WRITE_INDICES, np.array([slot], np.int64))
        io.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, [1, W, self.hidden_size], self._hidden.ctypes.data)
        io.bind_output(EAGLE_TOKENS, "cpu", 0, np.int64, [1, W, self.topk], self._tokens.ctypes.data)
        io.bind_output(EAGLE_LOGPROBS, "cpu", 0, np.float32, [1, W, self.topk], self._logp.ctypes.data)
        self.session.run_with_iobinding(io)
        return self._hidden[:W].copy(), self._tokens[:W].copy(), self._logp[:W].copy()

    def save_prefix(self, length: int) -> KVSnapshot:
        return snapshot_views(self.cache, min(length, self.length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        self.length = 0
        self.reserve(snapshot.length + 1, keep=0)
        restore_views(self.cache, snapshot)
        self.length = snapshot.length


def open_batch(root: Path, entry, options: EngineOptions, slots: int):
    """A batch engine of `slots` sequences for a decoder entry (runtime/backends/onnxruntime_batch.py)."""
    from .onnxruntime_batch import open_batch as _open

    return _open(root, entry, options, slots)
