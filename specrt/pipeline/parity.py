"""Parity of a portable graph between backends, through Polygraphy's comparator, so any check can be rerun with
`polygraphy run`: the inputs are real passes of the static-shape protocol (a prefill over an empty cache, then a
4-token verification pass over the cache it wrote), saved in Polygraphy's JSON format.

    specrt parity ENGINES --save-inputs passes.json
    polygraphy run ENGINES/target-fp32.onnx --onnxrt --trt --load-inputs passes.json --atol 1e-3 --rtol 1e-3

Runners: "onnxrt-cpu" (ONNX Runtime's CPU provider, all graph optimizations: the reference), "onnxrt-cpu-basic"
(basic optimizations only: whether ONNX Runtime's fusions move the numbers), "onnxrt-cuda" (onnxruntime-gpu) and
"tensorrt" (an engine Polygraphy builds from the same graph, strongly typed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SpecrtError
from ..interface import (ATTENTION_MASK, INPUT_IDS, KV_KINDS, LOGITS_INDICES, PORTABLE_DTYPES, POSITION_IDS,
                         WRITE_INDICES, past_name, present_name)

VERIFY_WIDTH = 4


def prefill_feed(entry, tokens: np.ndarray, capacity: int, cache: dict | None = None, length: int = 0,
                 num_logits: int = 1) -> dict[str, np.ndarray]:
    """The inputs of one pass as the runtime feeds them: tokens at [length, length + n) over a cache laid out for
    `capacity` positions (cache: its arrays by input name; None = empty), padded to the protocol's width."""
    from ..runtime.static_shapes import Buckets, PassInputs

    tokens = np.asarray(tokens, np.int64)
    width = VERIFY_WIDTH if len(tokens) <= VERIFY_WIDTH else len(tokens)
    p = PassInputs(Buckets((width,), (capacity,))).plan(length, tokens, None, None, num_logits, capacity)
    if cache is None:
        dtype = np.dtype(PORTABLE_DTYPES[entry.precision])
        cache = {past_name(i, k): np.zeros((1, entry.num_kv_heads, capacity, entry.head_dim), dtype)
                 for i in range(entry.num_layers) for k in KV_KINDS}
    return {INPUT_IDS: p.tokens[None].copy(), POSITION_IDS: p.positions[None].copy(),
            ATTENTION_MASK: p.mask.reshape(1, 1, p.width, capacity).copy(),
            WRITE_INDICES: np.array([length], np.int64), LOGITS_INDICES: p.logits_rows.copy(), **cache}


def protocol_feeds(onnx_path: Path, entry, prompt: np.ndarray, capacity: int = 256) -> list[dict[str, np.ndarray]]:
    """Two passes as the runtime feeds them: prompt [n] over an empty cache laid out for `capacity` positions,
    then VERIFY_WIDTH tokens over the cache the first pass wrote (computed here on the CPU reference)."""
    import onnxruntime as ort

    n, W = len(prompt), VERIFY_WIDTH
    if n + W > capacity:
        raise SpecrtError(f"a parity prompt of {n} tokens does not fit a {capacity}-position layout; shorten it")
    prefill = prefill_feed(entry, prompt, capacity)
    so = ort.SessionOptions()
    so.log_severity_level = 3  # past and present are separate arrays here: TensorScatter's copy warning is moot
    session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outs = dict(zip(names, session.run(None, prefill)))
    cache = {past_name(i, k): outs[present_name(i, k)] for i in range(entry.num_layers) for k in KV_KINDS}
    return [prefill, prefill_feed(entry, np.resize(prompt[-W:], W), capacity, cache, n, W)]


def _onnxrt(providers: list[str], basic: bool = False):
    """A Polygraphy ONNX Runtime runner factory on these providers (basic: graph optimizations at BASIC only)."""

    def make(name: str, path: str):
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

        import onnxruntime as ort

        if not set(providers) <= set(ort.get_available_providers()):
            raise SpecrtError(f"runner {name} needs onnxruntime-gpu with CUDA; this onnxruntime has "
                              f"{', '.join(ort.get_available_providers())}")
        level = {"graph_optimization_level": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC} if basic else {}
        return OnnxrtRunner(SessionFromOnnx(path, providers=providers, **level), name=name)

    return make


def _tensorrt(name: str, path: str):
    from ..build.tensorrt import require_tensorrt

    require_tensorrt()
    from polygraphy.backend.trt import EngineFromNetwork, NetworkFromOnnxPath, TrtRunner

    return TrtRunner(EngineFromNetwork(NetworkFromOnnxPath(path, strongly_typed=True)), name=name)


MAKERS = {"onnxrt-cpu": _onnxrt(["CPUExecutionProvider"]), "onnxrt-cpu-basic": _onnxrt(["CPUExecutionProvider"], True),
          "onnxrt-cuda": _onnxrt(["CUDAExecutionProvider"]), "tensorrt": _tensorrt}  # each runner's factory
RUNNERS = tuple(MAKERS)


def _runner(name: str, onnx_path: Path):
    if name not in MAKERS:
        raise SpecrtError(f"unknown parity runner '{name}'; choose from {', '.join(RUNNERS)}")
    return MAKERS[name](name, str(onnx_path))


def compare(onnx_path: Path, feeds: list[dict], runners=("onnxrt-cpu", "onnxrt-cpu-basic"), atol: float = 1e-3,
            rtol: float = 1e-3) -> dict:
    """Run every runner on the feeds through Polygraphy's Comparator -> {"passed": bool, "max_abs_logit_diff":
    {runner: float} against the first runner, "runners": [...]}."""
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.logger import G_LOGGER

    G_LOGGER.severity = G_LOGGER.WARNING  # its per-tensor statistics would bury the result
    built = [_runner(r, onnx_path) for r in runners]
    results = Comparator.run(built, data_loader=feeds)
    accuracy = Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=atol, rtol=rtol))
    runs = list(results.items())
    ref = runs[0][1]
    diffs = {}
    for name, outs in runs[1:]:
        diffs[name] = max(float(np.abs(np.asarray(a["logits"], np.float64) - np.asarray(b["logits"], np.float64))
                                .max()) for a, b in zip(ref, outs))
    return {"passed": bool(accuracy), "runners": list(runners), "max_abs_logit_diff": diffs}
