"""The CUDA EP's batch engine: device.batch.DeviceBatchEngine over an ORT session of the portable graph, one IOBinding
and RunOptions per pass shape, a gpu_graph_id per (rows, width, capacity)."""

from __future__ import annotations

import numpy as np

from ....errors import SpecrtError, first_line
from ....interface import (ATTENTION_MASK, GREEDY_TOKENS, HIDDEN_STATES, INPUT_IDS, KV_KINDS, LOGITS, LOGITS_INDICES,
                           POSITION_IDS, WRITE_INDICES, past_name, present_name)
from ...static_shapes import Buckets
from ..device.batch import DeviceBatchEngine
from ..device.geometry import Geometry
from ..device.memory import Memory


class _Bindings:
    """One IOBinding and RunOptions per pass shape over a device batch engine's buffers (device/batch.py's
    DeviceBatchEngine), every one bound by address, a gpu_graph_id per (rows, width, capacity); the runs on one worker
    thread while graphs are on (the module docstring)."""

    def _start(self, session, device: str) -> None:
        self.session, self.device = session, device
        self._bound: dict[tuple, tuple[object, object]] = {}  # pass shape -> (IOBinding, RunOptions)
        self._graph_ids: dict[tuple[int, int, int], int] = {}
        self._warm: set[tuple[int, int, int]] = set()  # (rows, width, capacity) run uncaptured once
        self._worker, self._capturing = None, self.graphs  # the session was made with enable_cuda_graph
        if self.graphs:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"specrt-cuda-{self.name}")

    def _binding(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None, graph: bool):
        import onnxruntime as ort

        key = (rows, width, capacity, logits_rows, slot, graph)
        if key in self._bound:
            return self._bound[key]
        g, io, dev = self.geometry, self.session.io_binding(), self.device
        for name, dtype, shape, ptr in (
                (INPUT_IDS, np.int64, [rows, width], self.tokens),
                (POSITION_IDS, np.int64, [rows, width], self.positions),
                (ATTENTION_MASK, np.float32, [rows, 1, width, capacity], self.mask),
                (WRITE_INDICES, np.int64, [rows], self.write), (LOGITS_INDICES, np.int64, [logits_rows], self.rows)):
            io.bind_input(name, dev, 0, dtype, shape, ptr)
        cache = [rows, g.num_kv_heads, capacity, g.head_dim]
        for i, layer in enumerate(self.cache.ptrs):  # slot None: slots [0, rows); else that slot's part alone
            for kind, ptr in zip(KV_KINDS, layer):
                at = ptr if slot is None else self.cache.slot_ptr(ptr, slot)
                io.bind_input(past_name(i, kind), dev, 0, g.cache_dtype.type, cache, at)
                io.bind_output(present_name(i, kind), dev, 0, g.cache_dtype.type, cache, at)
        io.bind_output(LOGITS, dev, 0, np.float32, [rows, logits_rows, g.vocab_size], self.out_logits)
        io.bind_output(GREEDY_TOKENS, dev, 0, np.int64, [rows, logits_rows], self.out_greedy)
        io.bind_output(HIDDEN_STATES, dev, 0, np.float32, [rows, width, g.hidden_size], self.out_hidden)
        run = ort.RunOptions()
        if self._capturing:  # ids from 1 (ORT takes a run without one as id 0); -1: this run uncaptured
            gid = self._graph_ids.setdefault((rows, width, capacity), len(self._graph_ids) + 1) if graph else -1
            run.add_run_config_entry("gpu_graph_id", str(gid))
        if dev == "cuda":  # we sync once after the downloads, on the same stream
            run.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if width <= self.max_pass_tokens:  # a wide prefill's binding is not kept (once per request)
            self._bound[key] = (io, run)
        return io, run

    def _call(self, io, run) -> None:
        if self._worker is None:
            self.session.run_with_iobinding(io, run)
        else:  # the thread ORT keeps this engine's graphs on
            self._worker.submit(self.session.run_with_iobinding, io, run).result()

    def _run_pass(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None,
                  graph: bool) -> None:
        graph = graph and self.graphs  # off once a capture failed
        shape = f"width {width}" if rows == 1 else f"{rows} x {width} tokens"
        try:
            if graph and (rows, width, capacity) not in self._warm:  # uncaptured once: the arena grows to it
                self._call(*self._binding(rows, width, capacity, logits_rows, slot, False))
                self._warm.add((rows, width, capacity))
            try:
                self._call(*self._binding(rows, width, capacity, logits_rows, slot, graph))
            except MemoryError:
                raise
            except Exception as e:  # ORT's own exception types; a capture fails on its run, not at load
                if not graph:
                    raise
                self.graphs, self.graphs_note = False, f"capture failed at {shape}, capacity {capacity} " \
                    f"({first_line(e)})"
                self._call(*self._binding(rows, width, capacity, logits_rows, slot, False))
        except MemoryError:
            raise
        except Exception as e:
            raise SpecrtError(f"onnxruntime-cuda failed a pass of {shape} over capacity {capacity} "
                              f"({first_line(e)})") from None

    def close(self) -> None:
        """The session, its bindings and the worker go before the device memory and stream they use."""
        if self._worker is not None:
            self._worker.shutdown()
        self._bound, self.session = {}, None
        super().close()


class OrtCudaBatchEngine(_Bindings, DeviceBatchEngine):
    """device.batch.DeviceBatchEngine over an ORT session of the portable graph: one IOBinding and RunOptions per
    pass shape, every buffer bound by address, a gpu_graph_id per (rows, width, capacity). device: where `memory`'s
    addresses live as ORT names it ("cuda"; "cpu" with device.memory.HostMemory and a CPU session, which is how the
    tests run this class without a GPU). max_prompt: the widest pass (default max_context)."""

    backend = "onnxruntime-cuda"

    def __init__(self, session, memory: Memory, geometry: Geometry, buckets: Buckets, *, slots: int, name: str,
                 width_exact: bool = True, graphs: bool = True, graphs_note: str | None = None, device: str = "cuda",
                 max_prompt: int | None = None, batch_width: int | None = None):
        super().__init__(memory, geometry, buckets, slots=slots, name=name, width_exact=width_exact,
                         graphs=graphs and device == "cuda",
                         graphs_note=graphs_note or (None if device == "cuda" else f"device {device}"),
                         max_prompt=max_prompt, batch_width=batch_width)
        self._start(session, device)

    def _launch(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None,
                graph: bool) -> None:
        self._run_pass(rows, width, capacity, logits_rows, slot, graph)
