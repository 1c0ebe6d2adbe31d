"""The ONNX Runtime CPU backend (`onnxruntime`): decoder engines of the export's GroupQueryAttention graph, Medusa
and EAGLE heads.

A decoder engine is a batch engine (batch.py), a single stream its one slot (batch.OrtSoloEngine). Buffers (cache,
logits) are allocated once; every pass binds them by pointer through IOBinding, and past and present are the same
buffer, so there is one host sync per pass and no per-step copy. The sessions: session.py; the heads: heads.py.
"""

from __future__ import annotations

from ..protocol import Runtime
from .batch import OrtSoloEngine, open_batch
from .heads import open_eagle, open_heads

RUNTIME = Runtime(open_batch=open_batch, open_heads=open_heads, open_eagle=open_eagle, solo=OrtSoloEngine)
