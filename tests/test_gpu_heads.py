"""Heads and batches on the device, on the fakes: heads beside a GPU target read its hidden row by address as the CPU
heads read it, and a GPU batch engine keeps each device slot's hidden rows on the device."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.backends.device.memory import HostMemory
from gpu_fakes import batch_hidden_fetched, fake_batch, random_heads, random_portable


def test_ort_cuda_heads_read_the_hidden_row_by_address_as_the_cpu_heads_read_it(tmp_path):
    """OrtCudaHeads (bound through IOBinding; "cpu" addresses in HostMemory here, as the engine tests run) against
    OrtHeads: the same candidates from a host row and from the row's device address, with and without the token
    input."""
    import onnxruntime as ort

    from specrt.export.medusa import export_heads_onnx
    from specrt.runtime.backends.onnxruntime_cpu.heads import OrtHeads
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
    random_portable(path)
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
