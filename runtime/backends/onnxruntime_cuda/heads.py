"""Heads on the CUDA EP beside the target: Medusa heads (OrtCudaHeads) reading the target's hidden row where it lies,
and the EAGLE head (OrtCudaEagleHead, a device.eagle.DeviceEagleHead) on a stream and memory of its own."""

from __future__ import annotations

import numpy as np

from ....errors import SpecrtError, first_line
from ....interface import EAGLE_FEATURES, HEADS_CANDIDATES, HEADS_HIDDEN, HEADS_TOKEN, KV_KINDS, present_name
from ..device.eagle import OUTPUTS, DeviceEagleHead
from ..device.memory import Memory
from .session import EAGLE_ROWS


class OrtCudaHeads:
    """runtime/engine.py's Heads over a heads graph on the CUDA EP, through one IOBinding: the hidden row bound by its
    device address (a target's row on this GPU, batch.DeviceSlotEngine.hidden_address, read in place: ORT's
    IOBinding takes a raw buffer pointer, onnxruntime.ai/docs/api/python/api_summary.html "IOBinding") or from the
    host array given, the token from the host, and the candidates bound to a host buffer, which ORT fills as a run's
    last step. The target's pass ended in a sync and ORT's run syncs its own stream, so the row is read before the
    next pass writes it. device: "cuda", or "cpu" with a CPU session (the tests)."""

    on_device = True  # takes hidden rows by device address (proposers/medusa.py)

    def __init__(self, session, device: str = "cuda"):
        self.session, self.device = session, device
        shape = next(o.shape for o in session.get_outputs() if o.name == HEADS_CANDIDATES)  # [rows, K, topk]
        self.heads, self.topk = int(shape[1]), int(shape[2])
        inputs = {i.name: i for i in session.get_inputs()}
        self.hidden_size = int(inputs[HEADS_HIDDEN].shape[1])
        self._token = HEADS_TOKEN in inputs
        self._h, self._t = np.zeros((1, self.hidden_size), np.float32), np.zeros(1, np.int64)
        self._out = np.zeros((1, self.heads, self.topk), np.int64)
        self._io = session.io_binding()
        self._io.bind_output(HEADS_CANDIDATES, "cpu", 0, np.int64, list(self._out.shape), self._out.ctypes.data)

    def __call__(self, hidden: np.ndarray | int, token: int) -> np.ndarray:
        io = self._io
        if isinstance(hidden, (int, np.integer)):
            io.bind_input(HEADS_HIDDEN, self.device, 0, np.float32, [1, self.hidden_size], int(hidden))
        else:
            self._h[0] = hidden
            io.bind_cpu_input(HEADS_HIDDEN, self._h)
        if self._token:
            self._t[0] = token
            io.bind_cpu_input(HEADS_TOKEN, self._t)
        self.session.run_with_iobinding(io)
        return self._out[0].copy()


class OrtCudaEagleHead(DeviceEagleHead):
    """device.eagle.DeviceEagleHead over the EAGLE head's graph on the CUDA EP: one IOBinding binds every input,
    output and cache buffer by its device address (rebound when a call's row count changes), and ORT runs on the
    memory's stream without a sync of its own (`user_compute_stream`, onnxruntime.ai/docs/execution-providers/
    CUDA-ExecutionProvider.html), so uploads, run and downloads are ordered on one stream and a call ends in one
    sync. One static capacity (the entry's): the buffers and masks are allocated once. device: "cuda", or "cpu"
    with HostMemory and a CPU session (the tests)."""

    def __init__(self, session, memory: Memory, *, name: str, hidden: int, kv_heads: int, head_dim: int, topk: int,
                 capacity: int, max_rows: int = EAGLE_ROWS, device: str = "cuda"):
        import onnxruntime as ort

        inputs = [i.name for i in session.get_inputs()]
        if EAGLE_FEATURES not in inputs:
            raise SpecrtError(f"engine '{name}' is not an EAGLE head graph (its inputs: {', '.join(inputs)}); "
                              "rebuild the engine set with `specrt engines --eagle-head`")
        self.session, self.device = session, device
        self._addresses = self._setup(memory, name=name, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim,
                                      topk=topk, capacity=capacity, max_rows=min(max_rows, capacity))
        self._io, self._rows = session.io_binding(), 0
        self._run_options = ort.RunOptions()
        if device == "cuda":  # the call syncs once after its downloads, on the same stream
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def _launch(self, W: int) -> None:
        if self._rows != W:
            io, dev, addresses = self._io, self.device, self._addresses
            for name, shape in self._shapes(W).items():
                io.bind_input(name, dev, 0, self._dtype(name), list(shape), addresses[name])
            for name in OUTPUTS:
                shape = [1, W, self._host[name].shape[1]]
                io.bind_output(name, dev, 0, self._host[name].dtype, shape, addresses[name])
            for kind in KV_KINDS:  # in place: the past buffer is the present one
                io.bind_output(present_name(0, kind), dev, 0, np.float32, list(self._cache_shape),
                               addresses[present_name(0, kind)])
            self._rows = W
        try:
            self.session.run_with_iobinding(self._io, self._run_options)
        except MemoryError:
            raise
        except Exception as e:
            raise SpecrtError(f"onnxruntime-cuda failed EAGLE head '{self.name}' on {W} rows ({first_line(e)})") \
                from None

    def _dtype(self, name: str):
        return self._host[name].dtype if name in self._host else np.float32  # the cache is float32

    def close(self) -> None:
        self._io, self.session = None, None  # before the device memory they are bound to
        super().close()
