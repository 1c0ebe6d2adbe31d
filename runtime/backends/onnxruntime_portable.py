"""The ONNX Runtime portable backend: the portable graph (export/portable.py) on ONNX Runtime's CPU provider,
through the same padded static-shape protocol the GPU backends capture as CUDA graphs (runtime/static_shapes.py).

It is the parity reference of the GPU backends: the graph TensorRT and the CUDA EP compile, run here on the
CPU, pass for pass as they run it (same widths, capacities, masks and padding). Its decoder engines are batch
engines (onnxruntime_portable_batch.py), a single stream their one slot (open_engine): each (layer, key|value) cache
buffer is allocated once and bound as both the graph's past input and its present output, so TensorScatter
writes in place; logits, greedy tokens and hidden states land in reused buffers; one host sync per pass.
"""

from __future__ import annotations

from pathlib import Path

from ..engine import EngineOptions
from .onnxruntime_cpu import OrtHeads

MAX_PASS_TOKENS = 64


def open_engine(root: Path, entry, options: EngineOptions = EngineOptions()):
    """The portable decoder engine a manifest entry describes: a single stream, slot 0 of a batch engine of one slot
    (onnxruntime_portable_batch.py) whose passes run at once (batch.SoloEngine)."""
    from ..batch import solo
    from .onnxruntime_portable_batch import open_batch as _open

    return solo(_open(root, entry, options, 1, huge_pages=options.huge_pages))


def open_batch(root: Path, entry, options: EngineOptions, slots: int):
    """Several streams at once over the portable graph (runtime/backends/onnxruntime_portable_batch.py)."""
    from .onnxruntime_portable_batch import open_batch as _open

    return _open(root, entry, options, slots)


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()) -> OrtHeads:
    """Medusa heads: their graph is standard ops already, the same on every backend."""
    return OrtHeads(Path(root) / entry.file, threads=1, session_config=entry.session_config)
