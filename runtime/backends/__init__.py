"""Backend registry: the manifest's `backend` field -> the Runtime of the package that runs engines of that kind.

Each backend is a package, runtime/backends/<name>/, whose RUNTIME (protocol.py's Runtime) opens its batch engines,
Medusa heads and EAGLE head (the defaults: ONNX Runtime's CPU heads, no batches); a package is imported only when an
engine of its kind opens, so the loop, `--help` and the CPU tests never import a backend library they do not use.
`device/` holds what the GPU backends share.
"""

from __future__ import annotations

import importlib

from ...backends import BACKENDS
from ...errors import SpecrtError

MODULES = {name: b.module for name, b in BACKENDS.items()}  # specrt/backends.py describes each


def backend(entry):
    """The Runtime (runtime/backends/protocol.py) of entry.backend, its package imported now."""
    name = entry.backend
    if name not in MODULES:
        raise SpecrtError(f"engine '{entry.name}' is a {name} engine, which this specrt cannot run yet (it runs: "
                          f"{', '.join(MODULES)}); rebuild the engine set with `specrt engines`")
    return importlib.import_module(MODULES[name]).RUNTIME
