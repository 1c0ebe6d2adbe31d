"""The engine graph's interface, shared by export/, build/ and runtime/: input and output names a decoder graph
and its logit screen use, and the feeds of one chain pass for callers that drive a graph with onnxruntime
directly (export parity, GPTQ calibration). The runtime binds the same names through IOBinding (runtime/engine.py).
Kept here, outside the stages, so no stage imports another (shared/design.md).
"""

from __future__ import annotations

import numpy as np

APPROX_INPUT, GREEDY_OUTPUT = "approx_logits", "greedy_tokens"  # an fp32 engine's logit screen (build/screen.py)


def chain_feeds(tokens, start: int, n_logits: int, past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs of one pass of a decoder graph over `tokens` at positions [start, start + n), as a chain
    (no tree), for callers that drive the graph with onnxruntime directly (export parity, calibration)."""
    n = len(tokens)
    return {"input_ids": np.asarray(tokens, np.int64)[None], "position_ids": np.arange(start, start + n, dtype=np.int64)[None],
            "tree_mask": np.zeros((1, n, n), np.float32), "seqlens_k": np.array([start + n - 1], np.int32),
            "total_sequence_length": np.array(start + n, np.int32),
            "num_logits_to_keep": np.array(n_logits, np.int64), **past}
