"""The GPU backends (TensorRT, onnxruntime-cuda) where no GPU is: they refuse in one line that names the fix, and
everything of theirs that is not a CUDA call runs here. The device copies (relayout across capacity buckets, tree
commits) are planned by pure functions and run on cuda_memory.HostMemory, which refuses overlapping copies; both
engine classes run a random portable graph at HostMemory's raw addresses (ONNX Runtime through a CPU session,
TensorRT through a fake execution context that runs that session with the shapes and addresses it was given),
pass for pass equal to the portable CPU backend. The checks that need a GPU are in tests/gpu/check.py
(tests/gpu/check.sh); the tests here that need one skip without it."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from specrt.errors import SpecrtError
from specrt.interface import KV_KINDS, PORTABLE_CACHE_DIMS, PORTABLE_INPUTS, past_name, portable_signature
from specrt.manifest import EngineEntry
from specrt.runtime.backends import cuda_memory
from specrt.runtime.backends.cuda_memory import Copy2D, DeviceCache, HostMemory, commit_plan, relayout_plan
from specrt.runtime.engine import EngineOptions, open_engine
from specrt.runtime.static_shapes import Buckets, relayout

REPO = Path(__file__).resolve().parents[1]


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _entry(backend: str, file: str, **extra) -> EngineEntry:
    return EngineEntry(name="target-fp16", role="target", file=file, backend=backend, precision="fp16",
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=96,
                       max_context=600, **extra)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


# --- refusals -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(_has("tensorrt"), reason="TensorRT is installed here")
def test_require_tensorrt_is_one_line_naming_the_install():
    from specrt.build.tensorrt import build_engine, require_tensorrt

    with pytest.raises(SpecrtError) as e:
        require_tensorrt()
    assert "pip install tensorrt-cu12" in _one_line(e)
    with pytest.raises(SpecrtError) as e:  # the build refuses before touching its arguments
        build_engine(Path("missing.onnx"), Path("x.engine"), max_prompt=8, max_width=4, max_capacity=64,
                     timing_cache=Path("t.cache"))
    assert "pip install tensorrt-cu12" in _one_line(e)


@pytest.mark.skipif(_has("tensorrt"), reason="TensorRT is installed here")
def test_a_tensorrt_engine_here_is_one_line(tmp_path):
    (tmp_path / "target-fp16.engine").write_bytes(b"not an engine")
    entry = _entry("tensorrt", "target-fp16.engine", build={"tensorrt": "10.15.1", "compute_capability": "9.0"})
    with pytest.raises(SpecrtError) as e:
        open_engine(tmp_path, entry)
    assert "TensorRT is not installed" in _one_line(e) and "pip install" in str(e.value)
    from specrt.runtime.backends import tensorrt

    with pytest.raises(SpecrtError, match="TensorRT is not installed"):  # several streams: the same line
        tensorrt.open_batch(tmp_path, entry, EngineOptions(), 4)


@pytest.mark.skipif(_has("cuda.bindings"), reason="cuda-bindings is installed here")
def test_the_gpu_backends_name_cuda_bindings_where_it_is_missing():
    with pytest.raises(SpecrtError) as e:
        cuda_memory.require_device("tensorrt")
    assert "pip install cuda-bindings" in _one_line(e)
    assert cuda_memory.device_count()[0] == 0


def _identity_model(path: Path) -> Path:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


@pytest.mark.filterwarnings("ignore::UserWarning")  # ORT: "Specified provider 'CUDAExecutionProvider' is not..."
def test_onnxruntime_cuda_refuses_a_cpu_only_onnxruntime(tmp_path, monkeypatch):
    import onnxruntime as ort

    from specrt.runtime.backends import onnxruntime_cuda

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(SpecrtError) as e:  # through the registry, as the loader opens it
        open_engine(tmp_path, _entry("onnxruntime-cuda", "target-fp16.onnx"))
    msg = _one_line(e)
    assert msg.startswith("onnxruntime-cuda: this onnxruntime runs on the CPU only (providers: ")
    assert "pip install onnxruntime-gpu" in msg and "--backend onnxruntime-portable" in msg
    with pytest.raises(SpecrtError, match="runs on the CPU only"):  # several streams: the same line
        onnxruntime_cuda.open_batch(tmp_path, _entry("onnxruntime-cuda", "target-fp16.onnx"), EngineOptions(), 2)
    with pytest.raises(SpecrtError, match="runs on the CPU only"):  # Medusa heads run on the CUDA EP too
        onnxruntime_cuda.open_heads(tmp_path, _entry("onnxruntime-cuda", "medusa-fp32.onnx"))
    # a session that asked for CUDA and got the CPU (ORT falls back with a warning) is refused the same way
    model = _identity_model(tmp_path / "id.onnx")
    session = ort.InferenceSession(str(model), providers=[("CUDAExecutionProvider", {"device_id": "0"})])
    assert session.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(SpecrtError, match="runs on the CPU only"):
        onnxruntime_cuda.require_cuda_provider(session.get_providers())
    # ... which is what open_session checks once the session exists (here: a provider list that claims CUDA)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(SpecrtError) as e:
        onnxruntime_cuda.open_session(model, stream=0)
    assert "providers: CPUExecutionProvider" in _one_line(e)


def test_tensorrt_profiles_cover_every_portable_input():
    from specrt.build.tensorrt import profile_shapes

    sig, _ = portable_signature(2, {"num_kv_heads": 2, "head_dim": 8, "hidden_size": 32, "vocab_size": 96}, "float16")
    network = {name: tuple(d if isinstance(d, int) else -1 for d in dims) for name, dims, _ in sig}
    network[past_name(0, "key")] = (-1, 2, 664, 8)  # a capacity the graph fixes keeps its size
    shapes = profile_shapes(network, seq=(1, 8, 64), logits=(1, 8, 64), capacity=(256, 664, 664))
    assert set(shapes) == set(network)
    assert shapes["attention_mask"] == ((1, 1, 1, 256), (1, 1, 8, 664), (1, 1, 64, 664))
    assert shapes["logits_indices"] == ((1,), (8,), (64,)) and shapes["write_indices"] == ((1,), (1,), (1,))
    assert shapes[past_name(0, "key")] == ((1, 2, 664, 8),) * 3
    assert shapes[past_name(1, "value")] == ((1, 2, 256, 8), (1, 2, 664, 8), (1, 2, 664, 8))
    assert len(PORTABLE_CACHE_DIMS) == 4 and {n for n, _, _ in PORTABLE_INPUTS} <= set(shapes)
    with pytest.raises(SpecrtError, match="not one of a portable decoder's"):
        profile_shapes({"tree_mask": (-1, -1, -1)}, (1, 1, 1), (1, 1, 1), (1, 1, 1))
    batched = profile_shapes(network, seq=(1, 8, 64), logits=(1, 8, 64), capacity=(664, 664, 664), batch=(1, 1, 8))
    assert batched["input_ids"] == ((1, 1), (1, 8), (8, 64)) and batched["write_indices"] == ((1,), (1,), (8,))
    assert batched[past_name(0, "key")] == ((1, 2, 664, 8), (1, 2, 664, 8), (8, 2, 664, 8))
    assert batched["logits_indices"] == ((1,), (8,), (64,))  # one set of rows for the whole batch


def test_the_cache_capacity_is_fixed_in_the_graph_tensorrt_parses(tmp_path):
    from specrt.build.tensorrt import fix_capacity

    path = tmp_path / "portable.onnx"
    _random_portable(path, max_context=300)
    model = onnx.load_model_from_string(fix_capacity(path, 364))
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in [*model.graph.input, *model.graph.output]}
    assert dims[past_name(1, "value")] == ["batch", 2, 364, 8] and dims["attention_mask"] == ["batch", 1, "seq", 364]
    # the weights stay in the .data file beside the graph, where the parser reads them
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer)


# --- device copies ------------------------------------------------------------------------------------------

def test_host_memory_refuses_overlapping_copies():
    m = HostMemory()
    base = m.alloc(64)
    m.copy2d(Copy2D(base + 32, 8, base, 8, 8, 2))  # rows apart: fine
    with pytest.raises(AssertionError, match="overlapping"):
        m.copy2d(Copy2D(base + 4, 8, base, 8, 8, 1))


def test_commit_plans_go_direct_unless_a_destination_meets_a_source():
    row, cap, heads = 16, 32, 3
    direct = commit_plan(1000, 9000, heads, row, cap, np.array([10, 12, 14]), np.array([10, 11, 12]))
    assert [(c.src - 1000, c.dst - 1000) for c in direct] == [(12 * row, 11 * row), (14 * row, 12 * row)]
    assert all(c.height == heads and c.spitch == c.dpitch == cap * row for c in direct)
    via = commit_plan(1000, 9000, heads, row, cap, np.array([10, 12, 13]), np.array([10, 11, 12]))  # 12,13 -> 11,12
    assert len(via) == 2 and via[0].dst == 9000 and via[1].src == 9000 and via[0].width == 2 * row
    assert commit_plan(1000, 9000, heads, row, cap, np.array([4, 5]), np.array([4, 5])) == []
    assert relayout_plan(1000, 9000, heads, row, 256, 256, 40) == [] and relayout_plan(1000, 9000, 2, 8, 4, 8, 0) == []


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_cache_copies_match_static_shapes(dtype):
    """Random capacity changes and tree commits on a DeviceCache over HostMemory against the numpy reference:
    static_shapes.relayout for the layout, fancy-index assignment for the commits."""
    rng = np.random.default_rng(0)
    layers, heads, dim, caps = 2, 3, 4, (8, 16, 24)
    cache = DeviceCache(HostMemory(), layers, heads, dim, dtype, caps[-1])
    ref = [[np.zeros(heads * caps[-1] * dim, dtype) for _ in KV_KINDS] for _ in range(layers)]
    views = [[relayout(b, heads, dim, 0, caps[0], 0) for b in layer] for layer in ref]
    cache.relayout(caps[0], 0)
    length = 0
    for step in range(60):
        cap = cache.capacity
        if rng.random() < 0.3:  # a new layout, keeping what is committed
            new = int(rng.choice([c for c in caps if c >= length]))
            cache.relayout(new, length)
            views = [[relayout(b, heads, dim, cap, new, length) for b in layer] for layer in ref]
            cap = new
        n = int(rng.integers(1, cap - length + 1)) if cap > length else 0
        if n:  # a pass writes n rows (same values into both), then a tree commit of an ascending path
            rows = rng.standard_normal((layers, 2, heads, n, dim)).astype(dtype)
            for i in range(layers):
                for k in range(2):
                    views[i][k][0, :, length:length + n] = rows[i, k]
                    host = cache.read(i, k)
                    host[0, :, length:length + n] = rows[i, k]
                    cache.memory.upload(cache.ptrs[i][k], host)
            keep = int(rng.integers(0, n + 1))
            path = np.sort(rng.choice(n, keep, replace=False))
            cache.commit(length, path)
            src, dst = length + path, length + np.arange(keep)
            for layer in views:
                for v in layer:
                    v[:, :, dst] = v[:, :, src]
            length += keep
        if rng.random() < 0.1:
            length = int(rng.integers(0, length + 1))  # rewind
        for i in range(layers):
            for k in range(2):
                np.testing.assert_array_equal(cache.read(i, k)[:, :, :length], views[i][k][:, :, :length])


# --- the ONNX Runtime engine class on the CPU -------------------------------------------------------------

def _random_portable(out: Path, layers: int = 2, hidden: int = 32, heads: int = 4, kv: int = 2, vocab: int = 96,
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


def _portable_solo(path, buckets: Buckets):
    """The portable CPU backend's single-stream engine over the random graph at path (one slot of its batch engine)."""
    from specrt.runtime.backends.onnxruntime_portable_batch import PortableBatchEngine
    from specrt.runtime.batch import solo

    return solo(PortableBatchEngine(path, slots=1, num_layers=2, num_kv_heads=2, head_dim=8, vocab_size=96,
                                    hidden_size=32, max_context=600, buckets=buckets))


@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "tensorrt", "tensorrt-rtx"])
def test_the_gpu_engine_classes_equal_the_portable_cpu_backend(tmp_path, backend):
    """The single-stream engines of both GPU backends, one slot of OrtCudaBatchEngine and of TrtBatchEngine (every
    buffer in HostMemory; ORT bound to it by address, TensorRT faked by a context that runs ORT at the addresses and
    shapes it was given) against the portable CPU backend's engine with the same widths and capacities: prefill,
    decode, partial accepts, token trees, hidden states, a wide uncaptured prefill that moves the committed cache to
    a larger capacity, and a rewind. Same graph and inputs: equal outputs."""
    import onnxruntime as ort

    from specrt.runtime.backends.cuda_engine import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.backends.tensorrt_batch import TrtBatchEngine
    from specrt.runtime.batch import solo

    path = tmp_path / "target-fp32.onnx"
    _random_portable(path)
    buckets = Buckets.for_engine(600, 64, geometric=True, pad_logits=True)
    ref = _portable_solo(path, Buckets(buckets.widths, buckets.capacities))  # its own logits rows
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    geometry = Geometry(2, 2, 8, 32, 96, 600, "fp32")
    if backend == "tensorrt":
        fake = FakeTrtEngine(session)
        eng = solo(TrtBatchEngine(fake, HostMemory(), geometry, buckets, slots=1, max_prompt=600, name="t",
                                  width_exact=True, graphs=False, graphs_note="test", strategy="USER_MANAGED"))
        # both contexts draw on one scratch buffer of the size the engine asks, allocated once
        assert [c.strategy for c in fake.contexts] == ["USER_MANAGED"] * 2
        assert fake.contexts[0].scratch == fake.contexts[1].scratch == (eng.batch._trt.scratch, 4096)
    elif backend == "tensorrt-rtx":  # the same engine class, its contexts made from TensorRT for RTX's config
        from specrt.runtime.backends.tensorrt import RuntimeCache

        fake, config = FakeTrtEngine(session), object()
        saved = []
        cache = RuntimeCache(None, tmp_path / "runtime.bin")
        cache.save = lambda: saved.append(True)
        eng = solo(TrtBatchEngine(fake, HostMemory(), geometry, buckets, slots=1, max_prompt=600, name="t",
                                  width_exact=True, graphs=False, graphs_note="test", keep=(cache,),
                                  runtime_config=config))
        assert [c.strategy for c in fake.contexts] == [config] * 2
        assert fake.contexts[0].scratch == fake.contexts[1].scratch == (eng.batch._trt.scratch, 4096)
    else:
        eng = solo(OrtCudaBatchEngine(session, HostMemory(), geometry, buckets, slots=1, name="t", device="cpu"))
        assert eng.description == "onnxruntime-cuda t, no CUDA graphs (device cpu)"
    assert eng.max_pass_tokens == 64
    rng = np.random.default_rng(1)
    tree = np.where(np.array([[0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 1, 0]]),
                    -np.inf, 0.0).astype(np.float32)  # parents -1, 0, 0, 1, 2 (causality comes on top)
    depth = np.array([0, 1, 1, 2, 2])

    def both(call, *args, **kw):
        out = [np.array(getattr(e, call)(*args, **kw)) for e in (ref, eng)]
        np.testing.assert_array_equal(out[1], out[0])
        if ref.with_hidden:
            np.testing.assert_array_equal(eng.hidden, ref.hidden)
        return out[0]

    def each(call, *args):
        for e in (ref, eng):
            getattr(e, call)(*args)

    each("reserve", 40)
    both("forward", rng.integers(0, 96, 37), num_logits=3)
    each("commit", 37)
    for _ in range(3):
        token = both("argmax", both("argmax", np.array([5])))
        each("commit", 1)
    both("forward", token, num_logits=1)
    each("commit", 1)
    both("forward", rng.integers(0, 96, 5), num_logits=5)
    each("commit", 2)  # a partial accept: the rest is garbage the next pass overwrites
    for _ in range(2):
        both("forward", rng.integers(0, 96, 5), ref.length + depth, tree, num_logits=5)
        each("commit", 3, np.array([0, 2, 4]))
    eng.enable_hidden(device_only=True)  # heads on this GPU read the rows there: nothing is copied back
    both("argmax", rng.integers(0, 96, 3), num_logits=2)
    each("rewind", ref.length)
    assert len(eng.hidden) == 0 and eng.with_hidden
    each("enable_hidden")
    both("argmax", rng.integers(0, 96, 3), num_logits=2)
    for r in range(3):  # the rows the device address points at are the rows copied back
        row = np.empty(32, np.float32)
        eng.batch.memory.download(row, eng.hidden_address(r))
        np.testing.assert_array_equal(row, ref.hidden[r])
    each("commit", 3)
    assert ref.capacity == eng.capacity == 256
    both("forward", rng.integers(0, 96, 240), num_logits=4)  # wider than any bucket: past 256, relaid out
    each("commit", 240)
    assert ref.capacity == eng.capacity == 512 and ref.length == 292
    both("forward", rng.integers(0, 96, 5), ref.length + depth, tree, num_logits=5)
    each("commit", 2, np.array([0, 1]))
    for i in range(2):
        for k in range(2):
            np.testing.assert_array_equal(eng.batch.cache.read(i, k)[:, :, :ref.length],
                                          ref.batch.cache[i][k][:, :, :ref.length])
    # KV reuse across sequences: save, overwrite with another sequence, load back: the same next logits
    snaps = [e.save_prefix(e.length) for e in (ref, eng)]
    probe = rng.integers(0, 96, 3)
    before = both("forward", probe, num_logits=3)
    each("rewind", 0)
    both("forward", rng.integers(0, 96, 50), num_logits=1)
    each("commit", 50)
    for e, snap in zip((ref, eng), snaps):
        e.load_prefix(snap)
    assert ref.length == eng.length == snaps[0].length == 294
    np.testing.assert_array_equal(both("forward", probe, num_logits=3), before)
    each("rewind", 20)
    both("forward", rng.integers(0, 96, 4), num_logits=4)
    with pytest.raises(ValueError):
        eng.forward(np.zeros(3, np.int64), num_logits=4)
    if backend.startswith("tensorrt"):  # decode passes on the decode profile's context, the wide one on the prefill's
        assert {(p, w) for p, w, _ in fake.log} == {(1, 64), (1, 1), (1, 8), (1, 4), (0, 240)}
    if backend == "tensorrt-rtx":
        eng.close()
        assert saved == [True]  # the runtime cache is written back at close


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


@pytest.mark.parametrize("fail_capture", [False, True])
def test_onnxruntime_cuda_graph_runs_warm_up_and_stay_on_one_thread(tmp_path, fail_capture):
    """With graphs on: a shape's first pass runs uncaptured (gpu_graph_id -1) before its own id, later passes run
    its id alone, every run on the engine's one worker thread; a captured run that fails turns graphs off, says
    why, and the pass runs again uncaptured. Outputs equal the portable CPU backend's either way."""
    import onnxruntime as ort

    from specrt.runtime.backends.cuda_engine import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.batch import solo

    path = tmp_path / "target-fp32.onnx"
    _random_portable(path)
    buckets = Buckets.for_engine(600, 64, geometric=True, pad_logits=True)
    ref = _portable_solo(path, Buckets(buckets.widths, buckets.capacities))
    session = GraphRecordingSession(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), fail_capture)
    eng = solo(OrtCudaBatchEngine(session, HostMemory(), Geometry(2, 2, 8, 32, 96, 600, "fp32"), buckets, slots=1,
                                  name="t", device="cpu"))
    eng.batch.graphs = True  # as on a GPU: device "cpu" turns them off
    eng.batch._start(session, "cpu")
    rng = np.random.default_rng(3)
    for e in (ref, eng):
        e.reserve(40)
    prompt = rng.integers(0, 96, 30)
    np.testing.assert_array_equal(eng.forward(prompt, num_logits=2), ref.forward(prompt, num_logits=2))
    for e in (ref, eng):
        e.commit(30)
    token = np.array([7])
    for _ in range(3):
        want = ref.argmax(token).copy()
        np.testing.assert_array_equal(eng.argmax(token), want)
        token = want
        for e in (ref, eng):
            e.commit(1)
    ids, threads = [gid for gid, _ in session.runs], {name for _, name in session.runs}
    assert len(threads) == 1 and threads.pop().startswith("specrt-cuda-t")
    if fail_capture:  # the prompt's captured run failed: rerun uncaptured, and no graphs from then on
        assert ids == [-1, 1, -1, -1, -1, -1] and not eng.batch.graphs
        assert "no CUDA graphs (capture failed at width 32, capacity 256 (operation not permitted" in eng.description
    else:  # the prompt (width 32), then three one-token passes: each new shape uncaptured once, then its id
        assert ids == [-1, 1, -1, 2, 2, 2] and eng.batch.graphs
    eng.close()


def test_tensorrt_buckets_follow_the_engine_profile():
    from specrt.runtime.backends.tensorrt import trt_buckets

    class Engine:
        def __init__(self, static: int):
            self.static = static

        def get_tensor_shape(self, name):
            return (-1, 2, self.static, 8)

    fixed = trt_buckets(Engine(704), 600, 64, "e")
    assert fixed.capacities == (704,) and fixed.widths[-1] == 64 and fixed.pad_logits
    with pytest.raises(SpecrtError, match="dynamic cache capacity, which TensorRT's KV-cache update cannot take"):
        trt_buckets(Engine(-1), 600, 64, "e")
    with pytest.raises(SpecrtError, match="holds 600 cache positions, fewer than max_context 600 "):
        trt_buckets(Engine(600), 600, 64, "e")


def test_tensorrt_io_is_checked_against_the_buffers():
    """An engine tensor without a buffer, or a cache in another precision than the entry's, is one line at open."""
    from types import SimpleNamespace

    from specrt.runtime.backends.tensorrt import check_io

    class Engine:
        def __init__(self, names, cache):
            self.names, self.cache = names, cache
            self.num_io_tensors = len(names)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_dtype(self, name):
            return SimpleNamespace(name=self.cache)

    names = ["input_ids", "past_key_values.0.key"]
    check_io(Engine(names, "FLOAT"), dict.fromkeys(names, 1), np.float32, "e")
    check_io(Engine(names, "HALF"), dict.fromkeys(names, 1), np.float16, "e")
    with pytest.raises(SpecrtError, match="has a tensor 'extra' this specrt does not bind"):
        check_io(Engine([*names, "extra"], "FLOAT"), dict.fromkeys(names, 1), np.float32, "e")
    with pytest.raises(SpecrtError, match="keeps its cache in HALF, its manifest entry says FLOAT"):
        check_io(Engine(names, "HALF"), dict.fromkeys(names, 1), np.float32, "e")


def test_a_tensorrt_engine_of_another_version_or_gpu_is_refused(tmp_path, monkeypatch):
    import sys
    import types

    from specrt.runtime.backends import tensorrt as backend

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.16.0.1"))
    monkeypatch.setattr(backend, "require_device", lambda name: None)
    monkeypatch.setattr(backend, "compute_capability", lambda device=0: "9.0")
    (tmp_path / "t.engine").write_bytes(b"")
    with pytest.raises(SpecrtError) as e:
        backend.open_engine(tmp_path, _entry("tensorrt", "t.engine", build={"tensorrt": "10.15.1.29"}))
    assert "built with TensorRT 10.15.1.29, this is 10.16.0.1" in _one_line(e) and "--backend tensorrt" in str(e.value)
    with pytest.raises(SpecrtError) as e:
        backend.open_engine(tmp_path, _entry("tensorrt", "t.engine",
                                             build={"tensorrt": "10.16.0.1", "compute_capability": "8.9"}))
    assert "built for compute capability 8.9, this GPU is 9.0" in _one_line(e)


# --- the GPU check script -------------------------------------------------------------------------------------

def test_the_gpu_check_says_there_is_no_gpu_here_and_passes():
    if cuda_memory.device_count()[0]:
        pytest.skip("a CUDA device is here: run tests/gpu/check.sh itself")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    r = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "check.sh"), "--json", os.devnull], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu check: no NVIDIA GPU here")


def test_device_memory_round_trip_on_a_gpu():
    if not cuda_memory.device_count()[0]:
        pytest.skip("no CUDA device here (tests/gpu/check.sh runs the GPU checks where there is one)")
    m = cuda_memory.CudaMemory()
    try:
        a = m.alloc(64)
        host = np.arange(8, dtype=np.int64)
        m.upload(a, host)
        out = m.host((8,), np.int64)
        m.download(out, a)
        m.sync()
        np.testing.assert_array_equal(out, host)
    finally:
        m.close()


def test_a_wheel_carried_in_parts_is_joined_and_checked(tmp_path):
    """tests/gpu/carry.py: parts that fit a call, joined back bit for bit; a missing or damaged part is named."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("carry", Path(__file__).parent / "gpu" / "carry.py")
    carry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(carry)
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(os.urandom(10_000))
    parts = tmp_path / "parts"
    parts.mkdir()
    m = carry.split(wheel, parts, 3_000)
    assert [p["bytes"] for p in m["parts"]] == [3000, 3000, 3000, 1000]
    joined = carry.assemble(parts, tmp_path / "there")
    assert joined.read_bytes() == wheel.read_bytes() and joined.name == wheel.name
    (parts / "part-02").write_bytes(b"x" * 3000)
    with pytest.raises(SystemExit, match="part-02 is damaged"):
        carry.assemble(parts, tmp_path / "there")
    (parts / "part-02").unlink()
    with pytest.raises(SystemExit, match="part-02 is missing"):
        carry.assemble(parts, tmp_path / "there")
    assert 0 < carry.travelling_bytes() < 64 << 20   # what travels with every call leaves room for parts


@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "tensorrt"])
def test_the_gpu_batch_engines_equal_the_portable_cpu_batch_engine(tmp_path, backend):
    """OrtCudaBatchEngine and TrtBatchEngine (every buffer in HostMemory; ORT bound to it by address, TensorRT faked
    by a context that runs ORT at the addresses and shapes it was given) against PortableBatchEngine, their CPU
    reference, round by round over 3 slots: prefills alone and batched, a one-token row beside a chain and a token
    tree with an idle slot in range, tree commits, a prefill that relays every slot out to a larger capacity, and a
    snapshot restored over another sequence. Same graph and inputs: the same outputs and cache rows."""
    import onnxruntime as ort

    from specrt.runtime.backends.cuda_engine import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.backends.onnxruntime_portable_batch import PortableBatchEngine
    from specrt.runtime.backends.tensorrt_batch import TrtBatchEngine
    from specrt.runtime.batch import PassRow
    from specrt.runtime.engine import tree_moves

    path = tmp_path / "target-fp32.onnx"
    _random_portable(path)
    buckets = Buckets.for_engine(600, 64, geometric=True, pad_logits=True)
    ref = PortableBatchEngine(path, slots=3, num_layers=2, num_kv_heads=2, head_dim=8, vocab_size=96, hidden_size=32,
                              max_context=600, buckets=Buckets(buckets.widths, buckets.capacities), batch_width=64)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    geometry = Geometry(2, 2, 8, 32, 96, 600, "fp32")
    if backend == "tensorrt":
        fake = FakeTrtEngine(session)
        eng = TrtBatchEngine(fake, HostMemory(), geometry, buckets, slots=3, max_prompt=600, name="t",
                             width_exact=True, graphs=False, graphs_note="test")
    else:
        eng = OrtCudaBatchEngine(session, HostMemory(), geometry, buckets, slots=3, name="t", device="cpu")
        assert eng.description == "onnxruntime-cuda t, 3 slots, no CUDA graphs (device cpu)"
    assert eng.batch_width == 64
    rng = np.random.default_rng(3)
    tree = np.where(np.array([[0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 1, 0]]),
                    -np.inf, 0.0).astype(np.float32)  # parents -1, 0, 0, 1, 2
    depth = np.array([0, 1, 1, 2, 2])

    def round_(*asks):
        """asks: (slot, tokens, tree?, num_logits, greedy); the rows' outputs, equal on both engines."""
        outs = []
        for e in (ref, eng):
            rows = []
            for slot, tokens, is_tree, k, greedy in asks:
                L = e.lengths[slot]
                pos = L + depth if is_tree else L + np.arange(len(tokens))
                rows.append(PassRow(slot, np.asarray(tokens, np.int64), pos, tree if is_tree else None, k, greedy))
            e.run(rows)
            outs.append([(r.out, r.hidden) for r in rows])
        for (a, ha), (b, hb) in zip(*outs):
            if a.dtype == np.int64:
                np.testing.assert_array_equal(b, a)
            else:
                np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
            if ref.with_hidden:
                np.testing.assert_allclose(hb, ha, atol=1e-5, rtol=0)
        return outs[0]

    def commit(slot, n, path=None):
        for e in (ref, eng):
            if path is not None and (moves := tree_moves(e.lengths[slot], n, path)) is not None:
                e.move(slot, *moves)
            e.lengths[slot] += n

    def same_caches():
        for s in range(3):
            for i in range(2):
                for k in range(2):
                    n = ref.lengths[s]
                    np.testing.assert_array_equal(eng.cache.read(i, k, s)[:, :, :n], ref.cache[i][k][s:s + 1, :, :n])

    round_((0, rng.integers(0, 96, 37), False, 3, False))           # a prefill that fits a batched pass
    commit(0, 37)
    round_((2, rng.integers(0, 96, 100), False, 1, True))           # a prefill wider than the batch: alone
    commit(2, 100)
    round_((0, [5], False, 1, True), (2, rng.integers(0, 96, 5), False, 5, False))  # slot 1 idle in range
    commit(0, 1)
    commit(2, 2)                                                    # a partial accept
    for e in (ref, eng):
        e.enable_hidden()
    round_((2, rng.integers(0, 96, 5), True, 5, False), (0, [7], False, 1, True))
    commit(2, 3, np.array([0, 2, 4]))
    commit(0, 1)
    same_caches()
    assert ref.capacity == eng.capacity == 256
    round_((1, rng.integers(0, 96, 30), False, 1, True), (0, [3], False, 1, True))
    commit(1, 30)
    commit(0, 1)
    round_((1, rng.integers(0, 96, 240), False, 2, False))          # 30 + 240 > 256: every slot relaid out
    commit(1, 240)
    assert ref.capacity == eng.capacity == 512
    round_((0, [1], False, 1, True), (2, [2], False, 1, False))     # slot 1 idle, holding 270 positions
    commit(0, 1)
    commit(2, 1)
    same_caches()
    probe = rng.integers(0, 96, 3)
    snaps = [e.snapshot(2, e.lengths[2]) for e in (ref, eng)]      # a slot other than 0: its own rows
    before = round_((2, probe, False, 3, False))[0][0]
    for e in (ref, eng):                                            # another sequence in slot 2 ...
        e.lengths[2] = 0
    round_((2, rng.integers(0, 96, 50), False, 1, True))
    commit(2, 50)
    for e, snap in zip((ref, eng), snaps):                          # ... and the first one back
        e.restore(2, snap)
        e.lengths[2] = snap.length
    after = round_((2, probe, False, 3, False), (1, [9], False, 1, True), (0, [4, 4], False, 2, True))
    np.testing.assert_allclose(after[0][0], before, atol=1e-5, rtol=0)
    same_caches()
    if backend == "tensorrt":  # batched passes on the decode profile, the prefills alone on the prefill one
        assert {p for p, w, _ in fake.log if w > 64} == {0} and {p for p, w, _ in fake.log if w <= 64} == {1}
    # a shape's first pass captures its graph: no cost for the planner; the next one is timed, by the rows asked
    asks = [PassRow(s, np.arange(9), eng.lengths[s] + np.arange(9), None, 1, True) for s in (0, 2)]
    first, again = eng.run(asks), eng.run(asks)
    assert first[0][0] is None and first[0][1:] == (2, 16) and again[0][0] > 0 and again[0][1:] == (2, 16)
    with pytest.raises(ValueError, match="logits"):
        eng.run([PassRow(0, np.arange(3), eng.lengths[0] + np.arange(3), None, 4, False)])


def test_a_tensorrt_batch_engine_refuses_slots_off_the_256_byte_boundary(tmp_path):
    """TensorRT takes tensor addresses on 256-byte boundaries: a batch engine whose per-sequence cache is not a
    multiple of 256 bytes (build/tensorrt.py rounds the capacity so none is) cannot bind a prefill at its slot."""
    import onnxruntime as ort

    from specrt.runtime.backends.cuda_engine import Geometry
    from specrt.runtime.backends.tensorrt_batch import TrtBatchEngine

    path = tmp_path / "target-fp32.onnx"
    _random_portable(path)
    fake = FakeTrtEngine(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    geometry = Geometry(2, 2, 8, 32, 96, 600, "fp32")  # 2 heads x 32 bytes a position
    widths = Buckets.for_engine(600, 64, geometric=True, pad_logits=True).widths
    with pytest.raises(SpecrtError, match="holds 42368 bytes of cache a sequence, not a multiple of 256"):
        TrtBatchEngine(fake, HostMemory(), geometry, Buckets(widths, (662,), pad_logits=True), slots=2,
                       max_prompt=600, name="t", width_exact=True, graphs=False, graphs_note="test")
    one = TrtBatchEngine(fake, HostMemory(), geometry, Buckets(widths, (662,), pad_logits=True), slots=1,
                         max_prompt=600, name="t", width_exact=True, graphs=False, graphs_note="test")
    one.close()
    TrtBatchEngine(fake, HostMemory(), geometry, Buckets(widths, (704,), pad_logits=True), slots=2, max_prompt=600,
                   name="t", width_exact=True, graphs=False, graphs_note="test").close()


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

    out, it = [], plain_decode(target, list(prompt), SamplingParams(), np.random.default_rng(0), Stats())
    for tokens in it:
        out += tokens
        if len(out) >= new_tokens:
            break
    it.close()
    return out[:new_tokens]


def fake_target(path: Path, backend: str):
    """A single-stream device engine of backend's (one slot of its batch engine class) over the random portable graph
    at path, in CountingMemory."""
    from specrt.runtime.batch import solo

    return solo(fake_batch(path, backend, slots=1))


def hidden_fetched(target) -> int:
    """Bytes of the single-stream target's hidden states that came back to the host."""
    b = target.batch
    return b.memory.fetched(b.out_hidden, b.max_prompt * b.geometry.hidden_size * 4)


def test_ort_cuda_heads_read_the_hidden_row_by_address_as_the_cpu_heads_read_it(tmp_path):
    """OrtCudaHeads (bound through IOBinding; "cpu" addresses in HostMemory here, as the engine tests run) against
    OrtHeads: the same candidates from a host row and from the row's device address, with and without the token
    input."""
    import onnxruntime as ort

    from specrt.export.medusa import export_heads_onnx
    from specrt.runtime.backends.onnxruntime_cpu import OrtHeads
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaHeads

    rng = np.random.default_rng(3)
    for token_input in (False, True):
        heads = random_heads(32, 96)
        if token_input:
            heads["a"] = (rng.standard_normal((32, 32)) * 0.1).astype(np.float16)
        graph = tmp_path / f"heads-{token_input}.onnx"
        export_heads_onnx(heads, rng.standard_normal((96, 32)).astype(np.float32), graph, topk=4)
        gpu = OrtCudaHeads(ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]), device="cpu")
        cpu, memory = OrtHeads(graph), HostMemory()
        assert (gpu.heads, gpu.topk) == (cpu.heads, cpu.topk) == (3, 4) and gpu.on_device
        row = memory.alloc(32 * 4)
        for _ in range(4):
            h, t = rng.standard_normal(32).astype(np.float32), int(rng.integers(0, 96))
            np.testing.assert_array_equal(gpu(h, t), cpu(h, t))
            memory.upload(row, h)
            np.testing.assert_array_equal(gpu(row, t), cpu(h, t))


# --- several streams over a batch engine on the device (batch.DeviceSlotEngine), on the fakes ------------------

def fake_batch(path: Path, backend: str, slots: int = 3):
    """A device batch engine of backend's class (OrtCudaBatchEngine, TrtBatchEngine) over the random portable
    graph at path, in CountingMemory."""
    import onnxruntime as ort

    from specrt.runtime.backends.cuda_engine import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.backends.tensorrt_batch import TrtBatchEngine

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


@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "tensorrt"])
def test_a_gpu_batch_engine_keeps_each_device_slots_hidden_rows_on_the_device(tmp_path, backend):
    """Slots whose readers are on the device (enable_hidden(slot, device_only=True)) against the same passes with
    every slot's rows downloaded: each device slot's copy holds exactly its own rows of its last pass (a batched
    pass with an idle slot in range, a prefill run alone after it in the same call, a chunk at its offset), none of
    them downloaded; a host slot beside them still gets PassRow.hidden; a slot engine refuses rows past its last
    pass."""
    import ctypes
    from types import SimpleNamespace

    from specrt.runtime.batch import DeviceSlotEngine, PassRow, Scheduler, slot_engine

    path = tmp_path / "target-fp32.onnx"
    _random_portable(path)
    host, dev = fake_batch(path, backend), fake_batch(path, backend)
    host.enable_hidden()
    dev.enable_hidden(0, device_only=True)
    dev.enable_hidden(2, device_only=True)
    dev.enable_hidden(1)  # a host reader beside them
    rng = np.random.default_rng(4)

    def copy_of(slot, n):  # the device copy, read without a download
        out = np.empty((n, 32), np.float32)
        ctypes.memmove(out.ctypes.data, dev.hidden_address(slot, 0), out.nbytes)
        return out

    def round_(*asks):
        """asks: (slot, tokens, hidden_at); rows of both engines, committed."""
        got = []
        for e in (host, dev):
            rows = [PassRow(s, np.asarray(t, np.int64), e.lengths[s] + np.arange(len(t)), None, 1, True,
                            hidden_at=at) for s, t, at in asks]
            e.run(rows)
            got.append(rows)
            for s, t, _ in asks:
                e.lengths[s] += len(t)
        for (s, t, at), a, b in zip(asks, *got):
            np.testing.assert_array_equal(b.out, a.out)
            if s == 1:
                np.testing.assert_array_equal(b.hidden, a.hidden)
            else:
                assert b.hidden is None
                np.testing.assert_array_equal(copy_of(s, at + len(t))[at:], a.hidden)
        return got[0]

    round_((0, rng.integers(0, 96, 37), 0), (2, rng.integers(0, 96, 9), 0), (1, rng.integers(0, 96, 100), 0))
    round_((2, rng.integers(0, 96, 5), 0), (0, [3], 0))                     # slot 1 idle in range
    first = round_((0, rng.integers(0, 96, 16), 0), (2, [4], 0))[0].hidden  # a prefill's first chunk ...
    round_((0, rng.integers(0, 96, 16), 16), (1, [5], 0), (2, [6], 0))     # ... and its next, at its offset
    np.testing.assert_array_equal(copy_of(0, 32)[:16], first)               # the first chunk's rows kept beside it
    round_((2, rng.integers(0, 96, 120), 0), (0, [1, 2], 0))               # a pass alone after a batched one
    assert batch_hidden_fetched(dev) > 0 and dev.memory.fetched(dev.slot_hidden, 3 * dev._slot_rows * 128) == 0
    only = fake_batch(path, backend)
    for s in range(3):
        only.enable_hidden(s, device_only=True)
    only.run([PassRow(s, np.arange(1, 6 + s), np.arange(5 + s), None, 1, True) for s in range(3)])
    assert batch_hidden_fetched(only) == 0
    cpu = SimpleNamespace(max_context=600, vocab_size=96, max_pass_tokens=64, width_exact=True, description="cpu",
                          screen=False, rows_on_device=False)  # a batch engine without device rows (ORT CPU)
    engine = slot_engine(only, 1, Scheduler())
    assert isinstance(engine, DeviceSlotEngine) and not hasattr(slot_engine(cpu, 0, Scheduler()), "hidden_address")
    engine.enable_hidden(device_only=True)
    engine.argmax(np.arange(4))
    assert engine.hidden_rows == 4 and list(engine.hidden_addresses([0, 3])) == [only.hidden_address(1, 0),
                                                                                 only.hidden_address(1, 3)]
    with pytest.raises(ValueError, match="not of its last pass"):
        engine.hidden_address(4)


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
    from specrt.errors import SpecrtError

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
