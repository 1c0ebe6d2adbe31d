"""The TensorRT backends (`tensorrt` and `tensorrt-rtx`, one code): a serialized engine of the portable graph
(build/tensorrt.py) with one CUDA graph per (pass width, cache capacity); the descriptor's compiler
(specrt/backends.py) says which TensorRT opens it.

engine.py opens and checks a serialized engine, batch.py is its batch engine (a single stream its one slot), heads.py
its compiled Medusa and EAGLE heads, rtx.py what TensorRT for RTX adds at run time.

More: docs/runtime-notes.md, "Module notes: runtime/backends/tensorrt/".
"""

from __future__ import annotations

from ..protocol import Runtime
from .batch import open_batch
from .heads import open_eagle, open_heads

RUNTIME = Runtime(open_batch=open_batch, open_heads=open_heads, open_eagle=open_eagle)
