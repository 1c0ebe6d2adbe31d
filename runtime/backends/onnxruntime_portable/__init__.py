"""The ONNX Runtime portable backend (`onnxruntime-portable`): the portable graph (export/portable.py) on ONNX
Runtime's CPU provider, through the same padded static-shape protocol the GPU backends capture as CUDA graphs
(runtime/static_shapes.py).

It is the parity reference of the GPU backends: the graph TensorRT and the CUDA EP compile, run here on the
CPU, pass for pass as they run it (same widths, capacities, masks and padding). Its decoder engines are batch
engines (batch.py), a single stream their one slot: each (layer, key|value) cache buffer is allocated once and bound
as both the graph's past input and its present output, so TensorScatter writes in place; logits, greedy tokens and
hidden states land in reused buffers; one host sync per pass. Medusa heads are the default ONNX Runtime CPU ones.
"""

from __future__ import annotations

from ..protocol import Runtime
from .batch import open_batch

RUNTIME = Runtime(open_batch=open_batch)
