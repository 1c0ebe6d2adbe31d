"""The TensorRT backends' batch engine: `slots` sequences a pass on the decode profile (runtime/batch.py)."""

from __future__ import annotations

from pathlib import Path

from ....errors import SpecrtError
from ....interface import INPUT_IDS, KV_KINDS, past_name, present_name
from ...engine import EngineOptions
from ...static_shapes import Buckets
from ..device.batch import DeviceBatchEngine
from ..device.geometry import Geometry, graphs_wanted
from .engine import DECODE, PREFILL, REBUILD, TrtContexts, buffer_addresses, deserialize, on_own_memory, pass_shapes


def open_batch(root: Path, entry, options: EngineOptions, slots: int) -> "TrtBatchEngine":
    """`slots` sequences of a manifest entry's TensorRT engine (runtime/batch.py's batch engine): the engine's
    decode profile must take that many sequences a pass (build/tensorrt.py's MAX_BATCH)."""
    engine, buckets, max_prompt, keep, strategy, config = deserialize(root, entry)
    most = int(engine.get_tensor_profile_shape(INPUT_IDS, DECODE)[2][0])
    if most < slots:
        raise SpecrtError(f"engine '{entry.name}' takes {most} sequence(s) a pass, fewer than --parallel {slots}; "
                          f"use --parallel {most}, or rebuild the set here with `specrt engines --backend tensorrt` "
                          "(engines take up to 8)")
    graphs, note = graphs_wanted()
    opened = on_own_memory(lambda memory: TrtBatchEngine(
        engine, memory, Geometry.of(entry), buckets, slots=slots, max_prompt=max_prompt, name=entry.name,
        width_exact=entry.width_exact, graphs=graphs, graphs_note=note, keep=keep, strategy=strategy,
        runtime_config=config))
    opened.backend = entry.backend
    return opened


class TrtBatchEngine(DeviceBatchEngine):
    """device.batch.DeviceBatchEngine over a TensorRT engine: batched passes on the decode profile (one CUDA graph per
    (rows, width, capacity)), a prefill alone on the prefill profile with its cache addresses at its slot."""

    backend = "tensorrt"

    def __init__(self, engine, memory, geometry: Geometry, buckets: Buckets, *, slots: int, max_prompt: int,
                 name: str, width_exact: bool, graphs: bool, graphs_note: str | None, keep: tuple = (),
                 strategy=None, runtime_config=None):
        super().__init__(memory, geometry, buckets, slots=slots, name=name, width_exact=width_exact, graphs=graphs,
                         graphs_note=graphs_note, max_prompt=max_prompt)
        self._keep, self.engine = keep, engine
        stride = self.cache.slot_ptr(0, 1)
        if slots > 1 and stride % 256:  # TensorRT takes tensor addresses on 256-byte boundaries only
            raise SpecrtError(f"engine '{name}' holds {stride} bytes of cache a sequence, not a multiple of 256, so "
                              f"its slots cannot be bound one by one; {REBUILD}")
        self._trt = TrtContexts(engine, memory, name, buffer_addresses(self), geometry.cache_dtype, strategy,
                                runtime_config, keep)
        self._prefill_at: tuple[int, int] | None = (0, self.capacity)  # the slot and layout its cache addresses hold

    def _launch(self, rows: int, width: int, capacity: int, logits_rows: int, slot: int | None,
                graph: bool) -> None:
        if slot is None:
            self._trt.run(DECODE, pass_shapes(self.geometry, rows, width, capacity, logits_rows),
                          (rows, width, capacity), graph)
        else:
            if self._prefill_at != (slot, capacity):
                for i, layer in enumerate(self.cache.ptrs):
                    for kind, ptr in zip(KV_KINDS, layer):
                        at = self.cache.slot_ptr(ptr, slot)
                        self._trt.set_address(PREFILL, past_name(i, kind), at)
                        self._trt.set_address(PREFILL, present_name(i, kind), at)
                self._prefill_at = (slot, capacity)
            self._trt.run(PREFILL, pass_shapes(self.geometry, 1, width, capacity, logits_rows), (), False)
        if self._trt.note:
            self.graphs, self.graphs_note = False, self._trt.note

    def close(self) -> None:
        self._trt.close()
        super().close()
