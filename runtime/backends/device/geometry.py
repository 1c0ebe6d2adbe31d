"""What both GPU backends share besides their batch engine (device/batch.py, which a single stream runs on too: its
one slot): the geometry of the decoder a backend lays its buffers out for, whether to capture CUDA graphs, and the
widest pass an engine takes.

SPECRT_CUDA_GRAPHS=0 in the environment (read at open) runs every pass without graphs: the GPU check compares the
two, and it is the switch to flip if a driver misbehaves with graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ....errors import SpecrtError
from ....interface import PORTABLE_DTYPES

GRAPHS_ENV = "SPECRT_CUDA_GRAPHS"


def graphs_wanted() -> tuple[bool, str | None]:
    """(capture CUDA graphs, why not): off where SPECRT_CUDA_GRAPHS=0."""
    if os.environ.get(GRAPHS_ENV, "1") == "0":
        return False, f"{GRAPHS_ENV}=0"
    return True, None


def check_prompt(engine, n: int) -> None:
    """A pass of n tokens is no wider than the engine takes (its widest uncaptured prefill): else one line."""
    if n > engine.max_prompt:
        raise SpecrtError(f"a pass of {n} tokens is wider than engine '{engine.name}' takes ({engine.max_prompt}); "
                          "shorten the prompt, or rebuild the engines with a larger --max-context")


@dataclass(frozen=True)
class Geometry:
    """The sizes of a portable decoder an engine needs to lay out its buffers (from the manifest entry)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    precision: str  # fp32 | fp16: the cache's dtype (PORTABLE_DTYPES)

    @classmethod
    def of(cls, entry) -> "Geometry":
        if entry.precision not in PORTABLE_DTYPES:
            raise SpecrtError(f"engine '{entry.name}' has precision '{entry.precision}'; the GPU backends run "
                              f"{', '.join(PORTABLE_DTYPES)} portable engines; rebuild the set with `specrt engines`")
        return cls(entry.num_layers, entry.num_kv_heads, entry.head_dim, entry.hidden_size, entry.vocab_size,
                   entry.max_context, entry.precision)

    @property
    def cache_dtype(self) -> np.dtype:
        return np.dtype(PORTABLE_DTYPES[self.precision])
