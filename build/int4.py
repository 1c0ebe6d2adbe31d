"""INT4 weights in symmetric blocks along K, and AWQ-lite's per-channel scale search (ModelOpt's awq_lite recipe,
written here because ModelOpt's and onnxruntime's AWQ quantizers do not install beside our pins: docs/design-notes.md,
"Module notes: build/quantize.py"). build/quantize.py writes them into the graph."""

from __future__ import annotations

import numpy as np

AWQ_BLOCK = 128            # rows of K per int4 scale (ModelOpt's and TensorRT-LLM's default); smaller where K needs it
AWQ_ROWS = 512             # calibration positions per activation the scale search measures the error on
AWQ_ALPHAS = tuple(round(a * 0.1, 1) for a in range(11))


def int4_block(k: int) -> int:
    """The int4 block size for a GEMM of K inputs: AWQ_BLOCK, or the largest power of two below it dividing K
    (at least 8)."""
    from ..errors import SpecrtError

    b = AWQ_BLOCK
    while b > 8 and k % b:
        b //= 2
    if k % b:
        raise SpecrtError(f"a GEMM with {k} inputs cannot be split into int4 blocks of 8 or more; build this model "
                          "at fp8 or int8 instead of int4-awq")
    return b


def quantize_int4(w: np.ndarray, block: int, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] -> (q [K, N] in -8..7, scale [K / block, N] in scale_dtype): symmetric blocks along K, scale =
    amax / 7, rounded to scale_dtype before q is computed from it (so DQ(q, scale) is what was measured)."""
    k, n = w.shape
    s = fit_scale(np.abs(w.reshape(k // block, block, n)).max(axis=1) / 7.0, scale_dtype)
    q = np.clip(np.rint(w / np.repeat(s.astype(np.float32), block, axis=0)), -8, 7)
    return q, s


def fit_scale(s: np.ndarray, dtype) -> np.ndarray:
    """Positive scales in `dtype` (the graph's float type: a DQ's output type is its scale's), within its normal
    range (an fp16 scale of 1e-12 would be 0, one of 1e5 infinite)."""
    info = np.finfo(dtype)
    return np.clip(np.asarray(s, np.float32), info.tiny, info.max).astype(dtype)


def awq_scale(x: np.ndarray, mean_abs: np.ndarray, w: np.ndarray, block: int) -> tuple[np.ndarray, dict]:
    """AWQ-lite for one activation: x [R, K] calibration rows, w [K, N] the weights of every GEMM reading it side
    by side -> the per-channel scale s [K] (x / s times quantize(s * w)) with the least mean squared output error
    over the alpha grid, and the search's facts."""
    k, n = w.shape
    blocks = np.abs(w).reshape(k // block, block, n)  # each weight relative to its block's amax, averaged over N
    w_mean = (blocks / np.maximum(blocks.max(axis=1, keepdims=True), 1e-12)).reshape(k, n).mean(axis=1)
    ref = x @ w

    def error(s: np.ndarray) -> float:
        q, sc = quantize_int4(w * s[:, None], block)
        return float(np.mean(((x / s) @ (q * np.repeat(sc, block, axis=0)) - ref) ** 2))

    best = (error(np.ones(k, np.float32)), None, np.ones(k, np.float32))  # plain round-to-nearest
    rtn = best[0]
    for alpha in AWQ_ALPHAS:
        s = np.clip(np.maximum(mean_abs, 1e-12) ** alpha / np.maximum(w_mean, 1e-12) ** (1 - alpha), 1e-4, 1e4)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        err = error(s)
        if err < best[0]:
            best = (err, alpha, s)
    return best[2], {"alpha": best[1], "mse": best[0], "mse_rtn": rtn}
