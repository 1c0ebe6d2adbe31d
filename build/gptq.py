"""GPTQ for the int4 engines: calibration Hessians from one fp32 pass per text, then weights quantized
column by column with each rounding error pushed onto the columns not yet quantized (Frantar et al.,
2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", the
lazy-batch form of their Algorithm 1).

Why our own ~25 lines rather than onnxruntime.quantization's GPTQ (neural_compressor/weight_only.py,
ORT 1.32): that one propagates no error. It reads its *upper* Cholesky factor by column
(`Hinv1[i:, i]`, zero below the diagonal), so it returns plain round-to-nearest
(docs/design-notes.md, "GPTQ instead of onnxruntime's").

More: docs/design-notes.md, "Module notes: build/gptq.py".
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..interface import PAST_PREFIX, chain_feeds

MAX_K = 4096  # larger inputs (e.g. a 1.5B model's 8960-wide MLP) would hold a 640 MB Hessian each: RTN
TEXTS = 128  # calibration texts: a chat/raw mix beat fewer raw chunks (docs/design-notes.md, "GPTQ calibration texts")
MAX_TOKENS = 512
RECIPE = (3, TEXTS, MAX_TOKENS, MAX_K)  # in the engines' build key: bump the first when the algorithm changes


def recipe_key() -> str:
    """What decides a GPTQ engine besides the precision: RECIPE and the calibration texts themselves
    (they come from the running Python's stdlib, so another Python version is another engine)."""
    import hashlib

    texts = json.dumps(calibration_texts()).encode()
    return f"{RECIPE}:{hashlib.sha256(texts).hexdigest()[:16]}"


@lru_cache(maxsize=2)
def calibration_texts(n: int = TEXTS) -> list[tuple[str, str]]:
    """("chat", prompt) and ("raw", code) pairs from the Python standard library (local, no downloads),
    never the benchmark's own prompts: half stdlib source chunks, half questions about stdlib docs."""
    from ..corpora import code_texts, doc_prompts

    rng = np.random.default_rng(0)
    return [("raw", t) for t in code_texts(n // 2, rng)] + [("chat", t) for t in doc_prompts(n - n // 2, rng)]


def matmul_weights(model: onnx.ModelProto) -> dict[str, list[str]]:
    """MatMul activation input -> names of the constant weights it multiplies (those GPTQ can take)."""
    inits = {i.name: i for i in model.graph.initializer}
    out: dict[str, list[str]] = {}
    for node in model.graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is not None and len(w.dims) == 2 and w.dims[0] <= MAX_K:
            out.setdefault(node.input[0], []).append(w.name)
    return out


def hessians(model: onnx.ModelProto, model_dir: Path, sequences: list[list[int]]) -> tuple[dict[str, np.ndarray], int]:
    """X^T X of every eligible MatMul's input over the calibration sequences (one prefill each).

    The lm_head sees every position too: its input is a Slice (the last num_logits_to_keep rows) of a graph
    output, the final hidden state, so its Gram comes from that output over all rows while the pass keeps
    one logit. Keeping logits at every position instead gives the same matrix, but computes a
    [tokens x vocab] MatMul per text that only feeds the Gram (docs/design-notes.md, "GPTQ calibration cost").
    `model` is the fp32 graph with its weights still external in `model_dir` (not loaded)."""
    import onnxruntime as ort

    wanted, all_rows = _unsliced(model, matmul_weights(model))
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None) for x in wanted
                              if x not in have)
    path = model_dir / f".calibrate-{os.getpid()}.onnx"  # beside the weights, so their references resolve
    try:
        onnx.save_model(probe, str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    finally:
        path.unlink(missing_ok=True)
    longest = max(len(ids) for ids in sequences)  # a static cache only has to hold the longest text
    past = {i.name: [d if isinstance(d, int) else 1 if d == "batch" else longest for d in i.shape]
            for i in session.get_inputs() if i.name.startswith(PAST_PREFIX)}
    zeros = {name: np.zeros(shape, np.float32) for name, shape in past.items()}
    acc = {w: 0.0 for ws in wanted.values() for w in ws}
    tokens = 0
    for ids in sequences:
        for x, out in zip(wanted, session.run(list(wanted), chain_feeds(ids, 0, 1 if all_rows else len(ids), zeros))):
            out = out.reshape(-1, out.shape[-1])
            gram = (out.T @ out).astype(np.float64)  # a text's Gram in fp32 (fp64: slower, no better), summed in fp64
            for w in wanted[x]:
                acc[w] = acc[w] + gram
        tokens += len(ids)
    return acc, tokens


def _unsliced(model: onnx.ModelProto, wanted: dict[str, list[str]]) -> tuple[dict[str, list[str]], bool]:
    """Re-key inputs that are a sequence-axis Slice of a graph output (the lm_head's: the last
    num_logits_to_keep rows of hidden_states) by that output, which has every row. Also returns whether
    every input now has every row; if not (another graph layout), the passes must keep every logit."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    outputs = {o.name for o in model.graph.output}
    inits = {i.name: i for i in model.graph.initializer}  # weights stay external: read only the axes

    def axes(name: str):
        t = inits.get(name)
        return None if t is None or t.data_location == onnx.TensorProto.EXTERNAL else numpy_helper.to_array(t).tolist()

    out: dict[str, list[str]] = {}
    all_rows = True
    for x, ws in wanted.items():
        node = made_by.get(x)
        if node is not None and node.op_type == "Slice":
            if node.input[0] in outputs and len(node.input) > 3 and axes(node.input[3]) == [1]:
                x = node.input[0]
            else:
                all_rows = False
        out.setdefault(x, []).extend(ws)
    return out, all_rows


def gptq(weight: np.ndarray, hessian: np.ndarray, block_size: int, damp: float = 0.01,
         lazy: int = 128) -> np.ndarray:
    """weight [K, N] (input dim first, as MatMul's B), hessian [K, K] -> the 4-bit asymmetric weight,
    dequantized: groups of `block_size` rows share a scale and zero point (zero always in range)."""
    assert lazy % block_size == 0 or block_size % lazy == 0, "a group must not straddle pending in-batch updates"
    w = weight.astype(np.float64)
    h = hessian.astype(np.float64).copy()
    k = w.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h[np.arange(k), np.arange(k)] += damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: inv(H) = U^T U
    q = np.zeros_like(w)
    for i1 in range(0, k, lazy):
        i2 = min(i1 + lazy, k)
        w1, err, u1 = w[i1:i2].copy(), np.zeros((i2 - i1, w.shape[1])), u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if (i1 + i) % block_size == 0:  # the group's grid, from its columns as updated so far
                group = np.concatenate([w1[i:], w[i2:i1 + i + block_size]])[:block_size]
                lo, hi = np.minimum(group.min(0), 0.0), np.maximum(group.max(0), 0.0)
                scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0)
                zero = np.round(-lo / scale)
            q[i1 + i] = (np.clip(np.round(w1[i] / scale) + zero, 0, 15) - zero) * scale
            err[i] = (w1[i] - q[i1 + i]) / u1[i, i]
            w1[i:] -= np.outer(u1[i, i:], err[i])
        w[i2:] -= u[i1:i2, i2:].T @ err
    return q.astype(weight.dtype)
