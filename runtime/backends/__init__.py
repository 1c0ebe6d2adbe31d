"""Backend registry: the manifest's `backend` field -> the module that runs engines of that kind.

Each module exposes `open_engine(root, entry, options) -> Engine` and `open_heads(root, entry, options) ->
Heads` (runtime/engine.py), the ONNX Runtime CPU and CUDA and the TensorRT ones `open_eagle` too, and is imported
only when an engine of its kind opens, so the loop, `--help` and the CPU tests never import a backend library they do
not use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ...backends import BACKENDS
from ...errors import SpecrtError

MODULES = {name: b.module for name, b in BACKENDS.items()}  # specrt/backends.py describes each


def backend(entry) -> ModuleType:
    """The module of entry.backend, imported now."""
    name = entry.backend
    if name not in MODULES:
        raise SpecrtError(f"engine '{entry.name}' is a {name} engine, which this specrt cannot run yet (it runs: "
                          f"{', '.join(MODULES)}); rebuild the engine set with `specrt engines`")
    return importlib.import_module(MODULES[name])
