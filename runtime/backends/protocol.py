"""What a backend package (runtime/backends/<name>/) gives the registry: its RUNTIME, how it opens a batch engine,
Medusa heads and an EAGLE head, with defaults for what it lacks (docs/architecture.md, "Backends as packages")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...errors import SpecrtError
from ..batch import solo
from ..engine import EngineOptions


def one_stream(root: Path, entry, options: EngineOptions, slots: int):
    """open_batch's default: a backend that runs one stream only refuses several in one line."""
    from ...backends import BACKENDS

    able = [n for n, b in BACKENDS.items() if b.precisions and b.batch]
    raise SpecrtError(f"the {entry.backend} backend cannot run several streams at once yet; "
                      f"use --parallel 1 or an engine set of {', '.join(able)}")


def cpu_heads(root: Path, entry, options: EngineOptions = EngineOptions()):
    """open_heads' default: Medusa heads on ONNX Runtime's CPU provider (standard ops: they run beside any target)."""
    from .onnxruntime_cpu.heads import open_heads

    return open_heads(root, entry, options)


def cpu_eagle(root: Path, entry, options: EngineOptions = EngineOptions()):
    """open_eagle's default: the EAGLE head's ONNX graph on ONNX Runtime's CPU provider."""
    from .onnxruntime_cpu.heads import open_eagle

    return open_eagle(root, entry, options)


@dataclass(frozen=True)
class Runtime:
    """A backend's entry points. open_batch(root, entry, options, slots) -> BatchEngine (runtime/engine.py); solo:
    the single-stream Engine over a batch engine of one slot; single: the single-stream engine of a backend without
    batch engines (the reference), whose open_batch is the default refusal."""

    open_batch: Callable = one_stream
    open_heads: Callable = cpu_heads
    open_eagle: Callable = cpu_eagle
    solo: Callable = solo
    single: Callable | None = None

    def open_engine(self, root: Path, entry, options: EngineOptions = EngineOptions()):
        """A single stream: slot 0 of a batch engine of one slot whose passes run at once."""
        if self.single is not None:
            return self.single(root, entry, options)
        return self.solo(self.open_batch(root, entry, options, 1))
