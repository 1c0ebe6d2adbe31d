"""What the GPU backends' tests share where no GPU is: fakes of TensorRT's engine and context that run a random
portable graph through an ONNX Runtime CPU session at device.memory.HostMemory's raw addresses, compiled heads faked the
same way, memory that counts what crosses to the host, and the drivers of speculation on a target and a batch
engine on the device (test_gpu_*.py, test_medusa.py, test_eagle.py, test_tensorrt_rtx.py import them)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from specrt.errors import SpecrtError
from specrt.manifest import EngineEntry
from specrt.runtime.backends.device.memory import HostMemory
from specrt.runtime.static_shapes import Buckets


REPO = Path(__file__).resolve().parents[1]


def has_module(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def gpu_entry(backend: str, file: str, **extra) -> EngineEntry:
    return EngineEntry(name="target-fp16", role="target", file=file, backend=backend, precision="fp16",
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=96,
                       max_context=600, **extra)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def identity_model(path: Path) -> Path:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


# --- a random portable graph, and TensorRT's engine and execution context faked over an ONNX Runtime session -------

def random_portable(out: Path, layers: int = 2, hidden: int = 32, heads: int = 4, kv: int = 2, vocab: int = 96,
                     inter: int = 64, max_context: int = 600, seed: int = 0) -> dict:
    """A random portable decoder graph (export/portable.py) at out (+ out.data) whose output depends on the
    whole context (a sharpened lm_head)."""
    from specrt.export.portable import build_portable_decoder

    d = hidden // heads
    spec = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, num_layers=layers, rms_norm_eps=1e-6, qkv_bias=False,
                o_bias=False, intermediate_size=inter, hidden_size=hidden, vocab_size=vocab)
    g = np.random.default_rng(seed)
    w = lambda *s: (g.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    angle = np.arange(max_context)[:, None] * 10000.0 ** (-np.arange(d // 2) / (d // 2))
    weights = {"embed_tokens.weight": g.standard_normal((vocab, hidden)).astype(np.float32),
               "lm_head.weight_t": w(hidden, vocab) * 8, "rope.cos": np.cos(angle).astype(np.float32),
               "rope.sin": np.sin(angle).astype(np.float32), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": np.ones(hidden, np.float32),
                    p + "self_attn.qkv_proj.weight_t": w(hidden, (heads + 2 * kv) * d),
                    p + "self_attn.o_proj.weight_t": w(heads * d, hidden),
                    p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                    p + "mlp.gate_up_proj.weight_t": w(hidden, 2 * inter),
                    p + "mlp.down_proj.weight_t": w(inter, hidden)}
    onnx.save_model(build_portable_decoder(spec, weights, max_context, "fp32", Path(str(out) + ".data")), str(out))
    return spec


class FakeTrtContext:
    """A TensorRT execution context that runs the portable graph through an ONNX Runtime CPU session at the
    addresses and shapes TrtBatchEngine set: what reaches TensorRT is what a pass needs."""

    def __init__(self, session, log: list):
        self.session, self.log, self.shapes, self.addresses = session, log, {}, {}
        self.names = {i.name for i in session.get_inputs()} | {o.name for o in session.get_outputs()}

    def set_optimization_profile_async(self, profile: int, stream: int) -> bool:
        self.profile = profile
        return True

    def set_device_memory(self, ptr: int, size: int) -> None:
        self.scratch = (ptr, size)

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = ptr
        return name in self.names

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        self.shapes[name] = tuple(shape)
        return name in self.names

    def execute_async_v3(self, stream: int) -> bool:
        from specrt.interface import ATTENTION_MASK, GREEDY_TOKENS, HIDDEN_STATES, LOGITS, LOGITS_INDICES

        batch, _, width, capacity = self.shapes[ATTENTION_MASK]
        rows, io = self.shapes[LOGITS_INDICES][0], self.session.io_binding()
        self.log.append((self.profile, width, capacity))
        types = {"tensor(int64)": np.int64, "tensor(float)": np.float32}
        for i in self.session.get_inputs():
            io.bind_input(i.name, "cpu", 0, types[i.type], self.shapes[i.name], self.addresses[i.name])
        outputs = {LOGITS: [batch, rows, 96], GREEDY_TOKENS: [batch, rows], HIDDEN_STATES: [batch, width, 32]}
        for o in self.session.get_outputs():
            shape = outputs.get(o.name) or self.shapes[o.name.replace("present.", "past_key_values.")]
            io.bind_output(o.name, "cpu", 0, types[o.type], shape, self.addresses[o.name])
        self.session.run_with_iobinding(io)
        return True


class FakeTrtEngine:
    """The ICudaEngine calls TrtContexts makes: its tensors (the graph's inputs and outputs, as TensorRT names them),
    their dtypes, the scratch a context needs, and contexts (with the allocation strategy, if one was asked)."""

    num_optimization_profiles = 2
    device_memory_size_v2 = 4096

    def __init__(self, session):
        self.session, self.log, self.contexts = session, [], []
        self.tensors = [t.name for t in (*session.get_inputs(), *session.get_outputs())]
        self.types = {t.name: t.type for t in (*session.get_inputs(), *session.get_outputs())}
        self.num_io_tensors = len(self.tensors)

    def get_tensor_name(self, i: int) -> str:
        return self.tensors[i]

    def get_tensor_dtype(self, name: str):
        from types import SimpleNamespace

        return SimpleNamespace(name={"tensor(float)": "FLOAT", "tensor(float16)": "HALF",
                                     "tensor(int64)": "INT64"}[self.types[name]])

    def create_execution_context(self, strategy=None):
        ctx = FakeTrtContext(self.session, self.log)
        ctx.strategy = strategy
        self.contexts.append(ctx)
        return ctx


# --- compiled heads faked, and memory that counts what crosses to the host ----------------------------------

def random_heads(hidden: int, vocab: int, k: int = 3) -> dict:
    """Medusa heads' weights as `specrt train-medusa` keeps them, random."""
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float16)  # noqa: E731
    return {"w1": w(k, hidden, hidden), "b1": w(k, hidden), "w2": w(k, hidden, hidden), "b2": w(k, hidden),
            "vocab": np.arange(min(vocab, 64), dtype=np.int32), "report": {}}


class HostEngine:
    """A compiled heads engine faked by an ONNX Runtime session of the same graph that reads its inputs from, and
    writes its outputs to, the host addresses and shapes TrtHeads set: what reaches TensorRT is what a call needs."""

    num_optimization_profiles = 1
    device_memory_size_v2 = 1024

    def __init__(self, path: Path):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3  # its cache is fed as a copy each run, which ORT warns of
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.io = [*self.session.get_inputs(), *self.session.get_outputs()]
        self.num_io_tensors = len(self.io)
        self.contexts = []

    def get_tensor_name(self, i: int) -> str:
        return self.io[i].name

    def get_tensor_shape(self, name: str):
        return [-1 if isinstance(d, str) else d for d in next(t.shape for t in self.io if t.name == name)]

    def create_execution_context(self, config=None):
        engine = self

        class Context:
            config_ = None

            def __init__(self):
                self.addresses, self.shapes = {}, {}

            def set_optimization_profile_async(self, profile, stream):
                return 0 <= profile < engine.num_optimization_profiles

            def set_device_memory(self, ptr, size):
                self.scratch = (ptr, size)

            def set_tensor_address(self, name, ptr):
                self.addresses[name] = ptr
                return True

            def set_input_shape(self, name, shape):
                self.shapes[name] = tuple(shape)
                return True

            def execute_async_v3(self, stream):
                import ctypes

                types_ = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
                feed = {}
                for i in engine.session.get_inputs():
                    a = np.empty(self.shapes[i.name], types_[i.type])
                    ctypes.memmove(a.ctypes.data, self.addresses[i.name], a.nbytes)
                    feed[i.name] = a
                for o, v in zip(engine.session.get_outputs(), engine.session.run(None, feed)):
                    v = np.ascontiguousarray(v)
                    ctypes.memmove(self.addresses[o.name], v.ctypes.data, v.nbytes)
                return True

        ctx = Context()
        ctx.config_ = config
        self.contexts.append(ctx)
        return ctx


class HostEagleEngine(HostEngine):
    """A compiled EAGLE head faked likewise: its graph with the cache capacity fixed, as build/tensorrt.py compiles
    it, and the prefill and decode profiles (rows up to max_rows and max_width)."""

    num_optimization_profiles = 2

    def __init__(self, path: Path, max_rows: int, max_width: int):
        super().__init__(path)
        self.max = (max_rows, max_width)

    def get_tensor_profile_shape(self, name, profile):
        return [(1, 1), (1, 1), (1, self.max[profile])]

    def get_tensor_dtype(self, name):
        from types import SimpleNamespace

        return SimpleNamespace(name="FLOAT")


class CountingMemory(HostMemory):
    """HostMemory that records every download (device to host) by source address and size."""

    def __init__(self):
        super().__init__()
        self.downloads: list[tuple[int, int]] = []

    def download(self, host: np.ndarray, src: int) -> None:
        self.downloads.append((src, host.nbytes))
        super().download(host, src)

    def fetched(self, start: int, nbytes: int) -> int:
        """Bytes downloaded from [start, start + nbytes)."""
        return sum(n for src, n in self.downloads if start <= src < start + nbytes)


def portable_solo(path, buckets: Buckets):
    """The portable CPU backend's single-stream engine over the random graph at path (one slot of its batch engine)."""
    from specrt.runtime.backends.onnxruntime_portable.batch import PortableBatchEngine
    from specrt.runtime.batch import solo

    return solo(PortableBatchEngine(path, slots=1, num_layers=2, num_kv_heads=2, head_dim=8, vocab_size=96,
                                    hidden_size=32, max_context=600, buckets=buckets))


class GraphRecordingSession:
    """An ONNX Runtime CPU session standing in for a CUDA-EP one with graphs on: it records each run's gpu_graph_id
    and the thread it ran on (the CPU provider ignores the id), and can fail the first captured run it sees."""

    def __init__(self, session, fail_capture: bool = False):
        self.session, self.fail_capture, self.runs = session, fail_capture, []

    def io_binding(self):
        return self.session.io_binding()

    def run_with_iobinding(self, io, run):
        import threading

        gid = int(run.get_run_config_entry("gpu_graph_id"))
        self.runs.append((gid, threading.current_thread().name))
        if gid != -1 and self.fail_capture:
            self.fail_capture = False
            raise RuntimeError("operation not permitted when stream is capturing")
        self.session.run_with_iobinding(io, run)


# --- speculation beside a target on the device (the heads' device path), on the fakes -----------------------

def forced_accept():
    """A sampled mode's `accept` that keeps a path chosen by the round's number, not by p (the draft's first m
    nodes of a chain; a node and its ancestors of a tree; at times none), then the target's most likely token
    after it: rounds with long accepts, which random heads never reach, for the bookkeeping of both paths."""
    from specrt.runtime.verify import VerifyResult

    count = [0]

    def accept(p, draft, rng):
        n, path = draft.tokens.size, []
        count[0] += 1
        node = (count[0] * 3) % (n + 1) - 1 if n else -1
        parents = np.arange(n) - 1 if draft.parents is None else draft.parents
        while node >= 0:
            path.insert(0, node)
            node = int(parents[node])
        idx = np.asarray(path, np.int64)
        row = idx[-1] + 1 if path else 0
        return VerifyResult(draft.tokens[idx], idx, int(p[row].argmax()), bool(path),
                            np.arange(draft.depth()) < idx.size)

    return accept


def speculate(target, proposer, prompt, new_tokens: int, k: int, forced: bool = False):
    """(tokens, every round's draft as (tokens, parents)) of speculative decoding on target with proposer: greedy,
    or with forced, sampled at temperature 1 through forced_accept."""
    from specrt.runtime.control import FixedK
    from specrt.runtime.generate import Stats
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import speculative_decode

    drafts, propose = [], proposer.propose

    def recording(ctx, k):
        d = propose(ctx, k)
        drafts.append((d.tokens.tolist(), None if d.parents is None else d.parents.tolist()))
        return d

    proposer.propose = recording
    sampling = SamplingParams(temperature=1.0 if forced else 0.0)
    extra = {"accept": forced_accept()} if forced else {}
    out, it = [], speculative_decode(target, list(prompt), sampling, np.random.default_rng(0), Stats(),
                                     proposer=proposer, control=FixedK(k), **extra)
    for tokens in it:
        out += tokens
        if len(out) >= new_tokens:
            break
    it.close()
    return out[:new_tokens], drafts


def plain(target, prompt, new_tokens: int) -> list[int]:
    """Greedy target-only decoding's first new_tokens tokens."""
    from specrt.runtime.generate import Stats, plain_decode
    from specrt.runtime.sampling import SamplingParams

    rounds = plain_decode(target, list(prompt), SamplingParams(), np.random.default_rng(0), Stats())
    out = list(itertools.islice(itertools.chain.from_iterable(rounds), new_tokens))  # no round past the last token
    rounds.close()
    return out


def fake_target(path: Path, backend: str):
    """A single-stream device engine of backend's (one slot of its batch engine class) over the random portable graph
    at path, in CountingMemory."""
    from specrt.runtime.batch import solo

    return solo(fake_batch(path, backend, slots=1))


def hidden_fetched(target) -> int:
    """Bytes of the single-stream target's hidden states that came back to the host."""
    b = target.batch
    return b.memory.fetched(b.out_hidden, b.max_prompt * b.geometry.hidden_size * 4)


# --- several streams over a batch engine on the device (batch.DeviceSlotEngine), on the fakes ------------------

def fake_batch(path: Path, backend: str, slots: int = 3):
    """A device batch engine of backend's class (OrtCudaBatchEngine, TrtBatchEngine) over the random portable
    graph at path, in CountingMemory."""
    import onnxruntime as ort

    from specrt.runtime.backends.device.geometry import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.backends.tensorrt.batch import TrtBatchEngine

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    geometry = Geometry(2, 2, 8, 32, 96, 600, "fp32")
    buckets = Buckets.for_engine(600, 64, geometric=True, pad_logits=True)
    if backend == "onnxruntime-cuda":
        return OrtCudaBatchEngine(session, CountingMemory(), geometry, buckets, slots=slots, name="t", device="cpu")
    return TrtBatchEngine(FakeTrtEngine(session), CountingMemory(), geometry, buckets, slots=slots, max_prompt=600,
                          name="t", width_exact=True, graphs=False, graphs_note="test")


def batch_hidden_fetched(batch) -> int:
    """Bytes of the batch's hidden states (its shared output, or the slots' device copies) that came to the host."""
    row, m = batch.geometry.hidden_size * 4, batch.memory
    shared = max(batch.slots * batch.max_pass_tokens, batch.max_prompt) * row
    return m.fetched(batch.out_hidden, shared) + m.fetched(batch.slot_hidden, batch.slots * batch._slot_rows * row)


def speculate_batch(batch, proposers, prompts, new_tokens: int, k: int, forced: bool = False,
                    prefill_chunk: int = 0):
    """speculate's (tokens, drafts) of each stream, the streams run at once over slots 0.. of batch (a thread each,
    every pass batched by one Scheduler; prompts longer than prefill_chunk read in chunks while the others
    decode), and the slot engines."""
    import threading

    from specrt.runtime.batch import Scheduler, slot_engine

    scheduler = Scheduler()
    scheduler.prefill_chunk = prefill_chunk
    engines = [slot_engine(batch, s, scheduler) for s in range(len(proposers))]
    for s in range(len(engines)):  # all in before the first pass: it batches every prompt
        scheduler.join(s)
    out, errors = [None] * len(engines), []

    def one(s):
        try:
            out[s] = speculate(engines[s], proposers[s], prompts[s], new_tokens, k, forced)
        except BaseException as e:  # noqa: BLE001 -- raised in the test's thread
            errors.append(e)
        finally:
            scheduler.leave(s)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert scheduler.rows > scheduler.passes  # rows of several streams shared calls
    return out, engines


def batch_sabotages(chunk: bool) -> tuple:
    """Ways a batch engine could hand a slot the wrong hidden rows, each applied to the engine: a test of the device
    path must see its drafts change under every one."""
    def other_slot(batch):  # each slot reads the next slot's rows
        at = batch.hidden_address
        batch.hidden_address = lambda slot, row: at((slot + 1) % batch.slots, row)

    def stale(batch):  # each slot's rows stay those of its first pass
        keep, done = batch._keep_hidden, set()
        batch._keep_hidden = lambda r, src: None if r.slot in done else (done.add(r.slot), keep(r, src))

    def no_offset(batch):  # a chunk's rows copied over the slot's first ones
        keep = batch._keep_hidden
        batch._keep_hidden = lambda r, src: keep(replace(r, hidden_at=0), src)

    return (other_slot, stale) + ((no_offset,) if chunk else ())


def eagle_heads_agree(gpu, cpu, hidden: int, vocab: int, rng, reopen) -> None:
    """A device EAGLE head against the CPU head, capacity 320: a prompt of 37 rows (run in chunks), a chain step and a
    tree level, the same inputs through both, agree (tokens exactly); then the device head's first 30 positions,
    saved and loaded into a fresh one (reopen()), are read as the CPU head reads its own; 321 positions are refused."""

    def step(lo: int, rows: int, heads=(gpu, cpu)):
        feats = rng.standard_normal((rows, hidden)).astype(np.float32)
        toks = rng.integers(0, vocab, rows)
        mask = np.where(np.arange(320)[None, :] <= lo + np.arange(rows)[:, None], np.float32(0), np.float32(-1e9))
        outs = [h.run(feats, toks, np.arange(lo, lo + rows), lo, mask) for h in heads]
        for a, b in zip(*outs):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
        assert (outs[0][1] == outs[1][1]).all()
        for h in heads:
            h.length = lo + rows

    step(0, 37)
    step(37, 1)
    step(38, 4)
    saved = gpu.save_prefix(30)
    assert saved.length == 30
    again = reopen()
    again.load_prefix(saved)
    cpu.length = 30
    step(30, 3, (again, cpu))
    with pytest.raises(SpecrtError, match="do not fit its 320"):
        gpu.reserve(321)
    gpu.close()
