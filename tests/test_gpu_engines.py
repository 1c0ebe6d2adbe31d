"""The GPU engine classes against the portable CPU backend: both engine classes (and their batch engines) run a random
portable graph at HostMemory's raw addresses (ONNX Runtime through a CPU session, TensorRT through a fake execution
context that runs that session with the shapes and addresses it was given), pass for pass equal to the portable CPU
backend; CUDA graph runs, profiles, I/O checks and the engines refused."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.backends.device.memory import HostMemory
from specrt.runtime.static_shapes import Buckets
from gpu_fakes import FakeTrtEngine, GraphRecordingSession, gpu_entry, one_line, portable_solo, random_portable


@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "tensorrt", "tensorrt-rtx"])
def test_the_gpu_engine_classes_equal_the_portable_cpu_backend(tmp_path, backend):
    """The single-stream engines of both GPU backends, one slot of OrtCudaBatchEngine and of TrtBatchEngine (every
    buffer in HostMemory; ORT bound to it by address, TensorRT faked by a context that runs ORT at the addresses and
    shapes it was given) against the portable CPU backend's engine with the same widths and capacities: prefill,
    decode, partial accepts, token trees, hidden states, a wide uncaptured prefill that moves the committed cache to
    a larger capacity, and a rewind. Same graph and inputs: equal outputs."""
    import onnxruntime as ort

    from specrt.runtime.backends.device.geometry import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.backends.tensorrt.batch import TrtBatchEngine
    from specrt.runtime.batch import solo

    path = tmp_path / "target-fp32.onnx"
    random_portable(path)
    buckets = Buckets.for_engine(600, 64, geometric=True, pad_logits=True)
    ref = portable_solo(path, Buckets(buckets.widths, buckets.capacities))  # its own logits rows
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
        from specrt.runtime.backends.tensorrt.rtx import RuntimeCache

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


@pytest.mark.parametrize("fail_capture", [False, True])
def test_onnxruntime_cuda_graph_runs_warm_up_and_stay_on_one_thread(tmp_path, fail_capture):
    """With graphs on: a shape's first pass runs uncaptured (gpu_graph_id -1) before its own id, later passes run
    its id alone, every run on the engine's one worker thread; a captured run that fails turns graphs off, says
    why, and the pass runs again uncaptured. Outputs equal the portable CPU backend's either way."""
    import onnxruntime as ort

    from specrt.runtime.backends.device.geometry import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.batch import solo

    path = tmp_path / "target-fp32.onnx"
    random_portable(path)
    buckets = Buckets.for_engine(600, 64, geometric=True, pad_logits=True)
    ref = portable_solo(path, Buckets(buckets.widths, buckets.capacities))
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
    from specrt.runtime.backends.tensorrt.engine import trt_buckets

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

    from specrt.runtime.backends.tensorrt.engine import check_io

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

    from specrt.runtime.backends.tensorrt import engine as backend
    from specrt.runtime.engine import open_engine

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.16.0.1"))
    monkeypatch.setattr(backend, "require_device", lambda name: None)
    monkeypatch.setattr(backend, "compute_capability", lambda device=0: "9.0")
    (tmp_path / "t.engine").write_bytes(b"")
    with pytest.raises(SpecrtError) as e:
        open_engine(tmp_path, gpu_entry("tensorrt", "t.engine", build={"tensorrt": "10.15.1.29"}))
    assert "built with TensorRT 10.15.1.29, this is 10.16.0.1" in one_line(e) and "--backend tensorrt" in str(e.value)
    with pytest.raises(SpecrtError) as e:
        open_engine(tmp_path, gpu_entry("tensorrt", "t.engine",
                                             build={"tensorrt": "10.16.0.1", "compute_capability": "8.9"}))
    assert "built for compute capability 8.9, this GPU is 9.0" in one_line(e)


@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "tensorrt"])
def test_the_gpu_batch_engines_equal_the_portable_cpu_batch_engine(tmp_path, backend):
    """OrtCudaBatchEngine and TrtBatchEngine (every buffer in HostMemory; ORT bound to it by address, TensorRT faked
    by a context that runs ORT at the addresses and shapes it was given) against PortableBatchEngine, their CPU
    reference, round by round over 3 slots: prefills alone and batched, a one-token row beside a chain and a token
    tree with an idle slot in range, tree commits, a prefill that relays every slot out to a larger capacity, and a
    snapshot restored over another sequence. Same graph and inputs: the same outputs and cache rows."""
    import onnxruntime as ort

    from specrt.runtime.backends.device.geometry import Geometry
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaBatchEngine
    from specrt.runtime.backends.onnxruntime_portable.batch import PortableBatchEngine
    from specrt.runtime.backends.tensorrt.batch import TrtBatchEngine
    from specrt.runtime.batch import PassRow
    from specrt.runtime.engine import tree_moves

    path = tmp_path / "target-fp32.onnx"
    random_portable(path)
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

    from specrt.runtime.backends.device.geometry import Geometry
    from specrt.runtime.backends.tensorrt.batch import TrtBatchEngine

    path = tmp_path / "target-fp32.onnx"
    random_portable(path)
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
