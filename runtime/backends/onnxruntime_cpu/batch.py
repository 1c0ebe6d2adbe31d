"""Batched passes on the ONNX Runtime CPU backend: B sequences (slots) in one session run, each with its own cache
row and length (GroupQueryAttention's per-row `seqlens_k`).

GroupQueryAttention on the CPU takes several rows over a cache only one token each ("batch_size must be 1 when
sequence_length > 1 and past context is given"), so one-token passes (plain decoding, or a stream whose draft is
empty) of every stream go together and a wider pass (a prefill, a draft's verification) runs alone, over that
slot's rows only. batch.LoadPlanner knows (`wide_rows_alone`): under load a draft costs a pass of its own. Rows of
idle slots in the bound range get one-token pads written past their committed length (garbage by the engine
contract), so the cache holds max_context + 1 positions per slot.

More: docs/runtime-notes.md, "Module notes: runtime/backends/onnxruntime_cpu/batch.py".
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ....errors import SpecrtError
from ....interface import (APPROX_INPUT, GREEDY_OUTPUT, HIDDEN_STATES, INPUT_IDS, KV_KINDS, LOGITS, NUM_LOGITS_TO_KEEP,
                          POSITION_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, TREE_MASK)
from ...batch import SoloEngine
from ...engine import EngineOptions, KVSnapshot, restore_views, snapshot_views
from ...hugepages import advise_huge_pages, anonymous_mappings
from .session import SCREEN_MAX_ROWS, bind_in_place, entry_config, open_session, session_options


def screen_rows(onnx_path: Path) -> bytes | None:
    """The engine graph with its logit screen reading every row of the batch as rows of one sequence (the screen's
    graph takes one batch row: build/screen.py), serialized; None when the engine has no screen. The lm_head and its
    screen are per row, so a row's greedy token is the same either way."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    g = model.graph
    nodes = list(g.node)
    ifs = [n for n in nodes if n.op_type == "If"]
    if len(ifs) != 2 or list(ifs[1].output) != [LOGITS, GREEDY_OUTPUT]:
        return None
    rows = next(n for n in nodes if n.op_type == "Slice" and n.input[0] == HIDDEN_STATES)
    last = rows.output[0]
    rows.output[0] = last + ".rows"                                         # [B, n, H]
    ifs[1].output[0], ifs[1].output[1] = LOGITS + ".flat", GREEDY_OUTPUT + ".flat"
    c = lambda name, vals: helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals)  # noqa: E731
    g.initializer.extend([c("rows.flat_shape", [1, -1, 0]), c("rows.start", [0]), c("rows.two", [2]),
                          c("rows.vocab", [int(model.graph.output[0].type.tensor_type.shape.dim[2].dim_value)])])
    extra = [helper.make_node("Reshape", [last + ".rows", "rows.flat_shape"], [last]),  # [1, B * n, H]
             helper.make_node("Shape", [last + ".rows"], ["rows.shape"]),
             helper.make_node("Slice", ["rows.shape", "rows.start", "rows.two"], ["rows.bn"]),
             helper.make_node("Concat", ["rows.bn", "rows.vocab"], ["rows.bnv"], axis=0),
             helper.make_node("Reshape", [LOGITS + ".flat", "rows.bnv"], [LOGITS]),
             helper.make_node("Reshape", [GREEDY_OUTPUT + ".flat", "rows.bn"], [GREEDY_OUTPUT])]
    at = nodes.index(rows) + 1
    del g.node[:]
    g.node.extend(nodes[:at] + extra[:1] + nodes[at:] + extra[1:])
    return model.SerializeToString()


def grown(buffers: dict[str, np.ndarray], name: str, size: int) -> np.ndarray:
    """buffers[name]: a flat output buffer reused across passes, replaced by a larger one when it is too small."""
    buf = buffers[name]
    if buf.size < size:
        buf = buffers[name] = np.empty(size, buf.dtype)
    return buf


def open_batch(root: Path, entry, options: EngineOptions, slots: int) -> "OrtBatchEngine":
    """`slots` sequences of a decoder entry; one slot (a single stream) asks for huge pages as options say."""
    config, note = entry_config(entry, options)
    huge_pages = options.huge_pages and slots == 1
    engine = OrtBatchEngine(Path(root) / entry.file, slots=slots, num_layers=entry.num_layers,
                            num_kv_heads=entry.num_kv_heads, head_dim=entry.head_dim, vocab_size=entry.vocab_size,
                            max_context=entry.max_context, threads=options.threads, session_config=config,
                            screen=note is None, width_exact=entry.width_exact, name=entry.name, huge_pages=huge_pages)
    engine.screen_note = note
    return engine


class OrtSoloEngine(SoloEngine):
    """batch.SoloEngine over a one-slot OrtBatchEngine, with what the build's checks read (pipeline/checks.py):
    forward(approx=True) goes through the logit screen whatever the engine's rule (its logits are then the 8-bit
    lm_head's), and `greedy` holds the greedy tokens of the last pass (screen graphs)."""

    def forward(self, tokens, positions=None, tree_mask=None, num_logits: int = 1, approx: bool = False):
        return self._pass(tokens, positions, tree_mask, num_logits, False, approx)

    @property
    def greedy(self) -> np.ndarray:
        return self.batch.greedy

    @property
    def screen_note(self) -> str | None:
        return self.batch.screen_note


class OrtBatchEngine:
    """`slots` sequences' caches and one session (runtime/batch.py's BatchEngine)."""

    max_pass_tokens = 64
    wide_rows_alone = True  # see the module docstring
    rows_on_device = False  # hidden rows come to the host (PassRow.hidden)
    screen_max_rows = 8  # a batched one-token pass reads the screen up to this many rows (docs/runtime-notes.md,
    # "Batched logit screen rows")
    CAPACITY_STEP = 256  # one slot: reserve() rounds its cache layout up to a multiple of this many positions
    screen_note: str | None = None  # why the logit screen is not in use (open_batch: the entry's rule)

    def pass_width(self, n: int) -> int:
        """The width a pass of n tokens runs at: n (no padding to buckets)."""
        return n

    def __init__(self, onnx_path: Path, *, slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 vocab_size: int, max_context: int, threads: int = 0, session_config: dict | None = None,
                 screen: bool = False, width_exact: bool = True, name: str | None = None, huge_pages: bool = False):
        before = anonymous_mappings() if huge_pages else None
        so = session_options(threads, session_config)
        # several rows: a screen that reads them as one sequence's rows (one slot: the graph as built)
        graph = screen_rows(Path(onnx_path)) if screen and slots > 1 else None
        if graph is not None:  # from memory; the weights from the engine's folder
            so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                        str(Path(onnx_path).parent))
        self.session = open_session(Path(onnx_path), so, graph)
        self.slots, self.max_context, self.vocab_size = slots, max_context, vocab_size
        self.width_exact, self.name = width_exact, name or Path(onnx_path).stem
        self.lengths = [0] * slots
        # one allocation of max_context positions a slot (+ 1: idle slots' pad rows), laid out for `capacity` of them
        self._dims, self._top = (num_layers, slots, num_kv_heads, head_dim), max_context + (slots > 1)
        self._kv = np.zeros(num_layers * len(KV_KINDS) * slots * num_kv_heads * self._top * head_dim, np.float32)
        self.capacity, self.cache = 0, self._kv[:0]
        names = {i.name for i in self.session.get_inputs()}
        self._has_screen = APPROX_INPUT in names
        self.screen = screen and self._has_screen
        self.hidden_size = next((int(o.shape[-1]) for o in self.session.get_outputs() if o.name == HIDDEN_STATES),
                                None)
        self.with_hidden = False
        self._flags = (np.array(False), np.array(True))
        # one binding per bound range: slots [0, b) for batched passes, slot s alone for solo passes (one slot: one)
        self._ranges = [self.session.io_binding() for _ in range(slots)]
        self._solo = [self.session.io_binding() for _ in range(slots)] if slots > 1 else self._ranges
        self._layout(self._top)
        self._zero_mask = np.zeros(self.max_pass_tokens ** 2, np.float32)  # flat: any [1, n, n] view is contiguous
        self._out = {"logits": np.empty(0, np.float32), "greedy": np.empty(0, np.int64),
                     "hidden": np.empty(0, np.float32)}  # flat output buffers reused across passes (grown)
        if huge_pages:  # weights pre-packed and cache allocated: ask for huge pages (runtime/hugepages.py)
            advise_huge_pages(since=before)

    @property
    def description(self) -> str:
        if self.slots == 1:  # a single stream's engine
            return f"onnxruntime-cpu {self.name}" + (", logit screen" if self.screen else "")
        return f"onnxruntime-cpu {self.name}, {self.slots} slots"

    @property
    def greedy(self) -> np.ndarray:
        """The greedy tokens of the last call, row after row (screen graphs)."""
        return self._out["greedy"]

    def _layout(self, capacity: int) -> None:
        """View the cache for `capacity` positions a slot (keeping the committed ones) and bind every range to it."""
        layers, slots, heads, head_dim = self._dims
        cache = self._kv[:layers * len(KV_KINDS) * slots * heads * capacity * head_dim].reshape(
            layers, len(KV_KINDS), slots, heads, capacity, head_dim)
        keep = max(self.lengths)
        if keep and self.capacity:  # old and new layouts share memory: copy out first
            cache[..., :keep, :] = self.cache[..., :keep, :].copy()
        self.cache, self.capacity = cache, capacity
        for b, io in enumerate(self._ranges):
            bind_in_place(io, cache[:, :, :b + 1])
        if self._solo is not self._ranges:
            for s, io in enumerate(self._solo):
                bind_in_place(io, cache[:, :, s:s + 1])

    def reserve(self, positions: int) -> None:
        """One slot: lay the cache out for about `positions` positions per head (rounded up to CAPACITY_STEP, at most
        max_context, never fewer than are committed): a request that knows its size asks for it, so each head's keys
        sit closer together (docs/runtime-notes.md, "Cache layout per request"). Free while the cache is empty;
        otherwise the committed entries are copied into the new layout. Several slots keep one layout."""
        if self.slots > 1:
            return
        step = self.CAPACITY_STEP
        capacity = min(self.max_context, -(-max(positions, self.lengths[0], 1) // step) * step)
        if capacity != self.capacity:
            self._layout(capacity)

    def enable_hidden(self) -> None:
        if self.hidden_size is None:
            raise SpecrtError("this target engine has no hidden_states output; rebuild it with `specrt engines`")
        self.with_hidden = True

    def views(self, slot: int) -> list[np.ndarray]:
        """The slot's cache, [1, kv_heads, capacity, head_dim] per (layer, key|value): the single engine's layout."""
        return [self.cache[i, j, slot:slot + 1] for i in range(self.cache.shape[0]) for j in range(len(KV_KINDS))]

    def snapshot(self, slot: int, length: int) -> KVSnapshot:
        return snapshot_views(self.views(slot), length)

    def restore(self, slot: int, snapshot: KVSnapshot) -> None:
        self.reserve(snapshot.length)  # one slot (which holds nothing now: SoloEngine.load_prefix): laid out for it
        restore_views(self.views(slot), snapshot)

    def move(self, slot: int, src: np.ndarray, dst: np.ndarray) -> None:
        self.cache[:, :, slot, :, dst] = self.cache[:, :, slot, :, src]

    def run(self, rows) -> list[tuple[float, int, int]]:
        """Every row's pass (runtime/batch.py's PassRow): the one-token rows of slots that hold a context together,
        the others alone. Returns (seconds, rows, width) of each call."""
        if len(rows) == 1:  # one row (every pass of a single stream): over its slot alone
            r, t = rows[0], time.perf_counter()
            self._solo_pass(r)
            return [(time.perf_counter() - t, 1, len(r.tokens))]
        ran = []
        together = [r for r in rows if len(r.tokens) == 1 and self.lengths[r.slot] > 0]
        if len(together) == 1:  # one row: over its slot alone (which the logit screen can read)
            together = []
        if together:  # first: its pad rows write at the other slots' lengths, which their own passes then overwrite
            t = time.perf_counter()
            self._batched(together)
            ran.append((time.perf_counter() - t, len(together), 1))
        for r in rows:
            if r not in together:
                t = time.perf_counter()
                self._solo_pass(r)
                ran.append((time.perf_counter() - t, 1, len(r.tokens)))
        return ran

    def _batched(self, rows) -> None:
        B = max(r.slot for r in rows) + 1
        lengths = np.array(self.lengths[:B], np.int64)
        ids = np.zeros((B, 1), np.int64)
        pos = np.minimum(lengths, self.max_context - 1).reshape(B, 1)
        for r in rows:
            ids[r.slot, 0] = r.tokens[0]
            pos[r.slot, 0] = r.positions[0]
        self._call(self._ranges[B - 1], ids, pos, np.zeros((B, 1, 1), np.float32), lengths, int(lengths.max()) + 1, 1,
                   approx=self.screen and all(r.greedy for r in rows) and B <= self.screen_max_rows)
        for r in rows:
            self._take(r, r.slot)

    def _solo_pass(self, r) -> None:
        n, L, io = len(r.tokens), self.lengths[r.slot], self._solo[r.slot]
        if L + n > self.capacity:  # one slot, past what the request reserved: grow (copies the cache once)
            self.reserve(max(L + n, 2 * self.capacity))
        if r.mask is not None:
            mask = r.mask.reshape(1, n, n)
        elif n <= self.max_pass_tokens:
            mask = self._zero_mask[:n * n].reshape(1, n, n)
        else:  # a long prefill: once per request, so this allocation is fine
            mask = np.zeros((1, n, n), np.float32)
        approx = r.approx or (self.screen and r.greedy and r.num_logits <= SCREEN_MAX_ROWS)
        ids, pos = r.tokens.reshape(1, n), r.positions.reshape(1, n)
        if r.mask is not None and L == 0 and n > 1:
            # GroupQueryAttention does not keep tree siblings apart when the cache is empty, so the first token goes
            # alone: same cache contents and outputs, one extra call, only for a tree drafted in the very first round
            # (docs/runtime-notes.md, "Trees over an empty cache"). Both calls write into one set of output rows.
            keep = min(r.num_logits, n - 1)
            grown(self._out, "logits", r.num_logits * self.vocab_size)
            grown(self._out, "greedy", r.num_logits)
            if self.with_hidden:
                grown(self._out, "hidden", n * self.hidden_size)
            self._call(io, ids[:, :1], pos[:, :1], mask[:, :1, :1], np.array([0], np.int32), 1, 1, approx)
            self._call(io, ids[:, 1:], pos[:, 1:], np.ascontiguousarray(mask[:, 1:, 1:]), np.array([n - 1], np.int32),
                       n, keep, approx, at=r.num_logits - keep, hidden_at=1)
        else:
            self._call(io, ids, pos, mask, np.array([L + n - 1], np.int32), L + n, r.num_logits, approx)
        self._take(r, 0)

    def _call(self, io, ids, pos, mask, seqlens, total: int, keep: int, approx: bool, at: int = 0,
              hidden_at: int = 0) -> None:
        """One session run over the bound range of io; outputs from row `at` of the logits (and greedy) buffers, row
        `hidden_at` of the hidden one, for _take (rows before them: an earlier call of the same pass)."""
        B, W = ids.shape
        V = self.vocab_size
        io.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(ids, np.int64))
        io.bind_cpu_input(POSITION_IDS, np.ascontiguousarray(pos, np.int64))
        io.bind_cpu_input(TREE_MASK, np.ascontiguousarray(mask, np.float32))
        io.bind_cpu_input(SEQLENS_K, np.ascontiguousarray(seqlens, np.int32))
        io.bind_cpu_input(TOTAL_SEQUENCE_LENGTH, np.array(total, np.int32))
        io.bind_cpu_input(NUM_LOGITS_TO_KEEP, np.array(keep, np.int64))
        logits = grown(self._out, "logits", (at + B * keep) * V)
        io.bind_output(LOGITS, "cpu", 0, np.float32, [B, keep, V], logits.ctypes.data + at * V * 4)
        self._shape = (B, at + keep)
        if self._has_screen:
            io.bind_cpu_input(APPROX_INPUT, self._flags[approx])
            greedy = grown(self._out, "greedy", at + B * keep)
            io.bind_output(GREEDY_OUTPUT, "cpu", 0, np.int64, [B, keep], greedy.ctypes.data + at * 8)
        if self.with_hidden:
            H = self.hidden_size
            hidden = grown(self._out, "hidden", (hidden_at + B * W) * H)
            io.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, [B, W, H], hidden.ctypes.data + hidden_at * H * 4)
        self._hshape = (B, hidden_at + W)
        self.session.run_with_iobinding(io)

    def _take(self, r, b: int) -> None:
        """Batch row b's results into r: the r.num_logits logits (or greedy tokens) rows the pass kept for it, and its
        hidden states. Several slots: copies (another stream's call may reuse the buffers before this one reads
        them); one slot: views into the buffers, valid until its next pass."""
        B, keep = self._shape
        copy = self.slots > 1
        if r.greedy and self._has_screen:
            out = self._out["greedy"][:B * keep].reshape(B, keep)[b, :r.num_logits]
            r.out = out.copy() if copy else out
        else:
            V = self.vocab_size
            logits = self._out["logits"][:B * keep * V].reshape(B, keep, V)[b, :r.num_logits]
            r.out = logits.argmax(axis=1) if r.greedy else logits.copy() if copy else logits
        if self.with_hidden:
            Bh, W = self._hshape
            H = self.hidden_size
            hidden = self._out["hidden"][:Bh * W * H].reshape(Bh, W, H)[b, :len(r.tokens)]
            r.hidden = hidden.copy() if copy else hidden
