"""The portable decoder graph: standard ONNX ops only (opset 24), every inner shape fixed by the input shapes.

What TensorRT's ONNX parser and ONNX Runtime's CUDA graphs both need (docs/design-notes.md, "The portable
graph"): no com.microsoft ops and no shape computed from a value, so a (pass width W, cache capacity C) pair
is one static shape. It is written from the initializers of the export's own graph (export/graph.py); the
interface is specrt/interface.py's (PORTABLE_*).
More: docs/design-notes.md, "Module notes: export/portable.py".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..interface import (ATTENTION_MASK, GREEDY_TOKENS, HIDDEN_STATES, INPUT_IDS, LOGITS, LOGITS_INDICES,
                         PORTABLE_DTYPES, POSITION_IDS, WRITE_INDICES, past_name, portable_signature, present_name)
from .graph import _Graph, read_initializers
from .layers import embed, facts, layer_rope, layer_weight_names, rope_names, softcap, window_biases
from .layers import layer as decoder_layer

OPSET = 24
IR_VERSION = 10
FORMAT = 3  # bump when this graph changes: the pipeline keys its cache on it
_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64}


def weight_names(spec: dict) -> list[str]:
    """The initializers of the export's graph that the portable graph is written from."""
    s = facts(spec)
    names = ["embed_tokens.weight", "lm_head.weight_t", "model.norm.weight"]
    names += [n for pair in rope_names(s) for n in pair]
    for i in range(s["num_layers"]):
        names += layer_weight_names(s, i)
    return names


def write_portable(export_onnx: Path, spec: dict, max_context: int, precision: str, out: Path) -> None:
    """The portable graph of the export at export_onnx (model.onnx) -> out (+ out.data), at precision fp32|fp16.
    spec: the export's facts["spec"] (DecoderSpec as a dict)."""
    names = weight_names(spec)
    weights = dict(zip(names, read_initializers(export_onnx, *names)))
    model = build_portable_decoder(spec, weights, max_context, precision, Path(str(out) + ".data"))
    onnx.save_model(model, str(out))


def build_portable_decoder(spec: dict, weights: dict[str, np.ndarray], max_context: int, precision: str = "fp32",
                           data_path: Path | None = None) -> onnx.ModelProto:
    """weights: the export graph's initializers by name (weight_names); data_path: stream them to this file."""
    s = facts(spec)
    dtype = PORTABLE_DTYPES[precision]
    np_dtype, onnx_dtype = np.dtype(dtype), _TYPES[dtype]
    n, kv, d, layers = s["num_heads"], s["num_kv_heads"], s["head_dim"], s["num_layers"]
    g = _Graph(data_path)
    w = lambda name: g.const(name, np.ascontiguousarray(weights[name], np_dtype))  # noqa: E731
    i64 = lambda name, v: g.const(name, np.array(v, np.int64))  # noqa: E731
    eps = float(s["rms_norm_eps"])

    fp32 = np_dtype == np.float32
    if fp32:
        eps_c, two, axes = g.const("rms_eps", np.array(eps, np.float32)), g.const("two", np.array(2.0, np.float32)), \
            i64("axes_last", [-1])

    def rmsnorm(x: str, weight: str, name: str = "") -> str:
        if not fp32:  # one op, its statistics in float32 (stash_type): squares of fp16 activations overflow
            return g.op("RMSNormalization", [x, w(weight)], axis=-1, epsilon=eps, stash_type=1, name=name)
        # fp32: the pattern ONNX Runtime fuses with the residual Add into one kernel (SkipSimplifiedLayerNorm)
        var = g.op("ReduceMean", [g.op("Pow", [x, two]), axes], keepdims=1)
        normed = g.op("Div", [x, g.op("Sqrt", [g.op("Add", [var, eps_c])])])
        return g.op("Mul", [normed, w(weight)], name=name)

    mask = g.op("Cast", [ATTENTION_MASK], to=onnx_dtype) if onnx_dtype != TensorProto.FLOAT else ATTENTION_MASK
    masks = {0: mask}
    if any(s["layer_window"]):
        capacity = g.op("Gather", [g.op("Shape", [ATTENTION_MASK]), i64("idx3", 3)], axis=0)  # cache slots
        masks = window_biases(g, s, mask, POSITION_IDS, capacity, np_dtype)
    shape_qkv, shape_out = i64("shape_qkv", [0, 0, n + 2 * kv, d]), i64("shape_out", [0, 0, n * d])
    split_qk_v, split_q_k = i64("split_qk_v", [n + kv, kv]), i64("split_q_k", [n, kv])
    ropes = {pair: (w(pair[0]), w(pair[1])) for pair in rope_names(s)}  # [max_context, rotary_dim / 2]
    rot = {"rotary_embedding_dim": s["rotary_dim"]} if s["rotary_dim"] < d else {}

    def attend(i: int, qkv: str) -> str:
        # one Reshape and Transpose for q|k|v, one RotaryEmbedding for q|k: fewer nodes per layer
        qkv4 = g.op("Transpose", [g.op("Reshape", [qkv, shape_qkv])], perm=[0, 2, 1, 3])  # [B, n+2kv, S, D]
        qk, v4 = g.op("Split", [qkv4, split_qk_v], n_out=2, axis=1)
        cos, sin = ropes[layer_rope(s, i)]
        q4, k4 = g.op("Split", [g.op("RotaryEmbedding", [qk, cos, sin, POSITION_IDS], **rot), split_q_k],
                      n_out=2, axis=1)
        key, value = past_name(i, "key"), past_name(i, "value")
        g.op("TensorScatter", [key, k4, WRITE_INDICES], axis=-2, name=present_name(i, "key"))
        g.op("TensorScatter", [value, v4, WRITE_INDICES], axis=-2, name=present_name(i, "value"))
        att = g.op("Attention", [q4, present_name(i, "key"), present_name(i, "value"), masks[s["layer_window"][i]]],
                   scale=float(s["attention_scale"]), name=f"layers.{i}.attn")
        return g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), shape_out])

    x = embed(g, s, g.op("Gather", [w("embed_tokens.weight"), INPUT_IDS], axis=0, name="embed"), np_dtype)
    for i in range(layers):
        x = decoder_layer(g, s, i, x, rmsnorm, w, attend, i64, np_dtype)
    final = rmsnorm(x, "model.norm.weight", name=HIDDEN_STATES if fp32 else "final_norm")
    if not fp32:
        g.op("Cast", [final], to=TensorProto.FLOAT, name=HIDDEN_STATES)
    rows = g.op("Gather", [final, LOGITS_INDICES], axis=1)  # [B, N, H]
    capped = bool(s["final_softcap"])
    raw = LOGITS if fp32 and not capped else "logits_raw" if fp32 else "logits_half"
    logits = g.op("MatMul", [rows, w("lm_head.weight_t")], name=raw)
    g.nodes[-1].name = LOGITS  # every precision's GEMMs have one set of names (build/quantize.py keeps them by name)
    logits = softcap(g, s, logits, LOGITS if fp32 else "logits_capped", np_dtype)
    if not fp32:
        g.op("Cast", [logits], to=TensorProto.FLOAT, name=LOGITS)
        g.nodes[-1].name = LOGITS + ".cast"  # node names stay unique (TensorRT names its layers by them)
    g.op("ArgMax", [LOGITS], axis=-1, keepdims=0, name=GREEDY_TOKENS)

    sizes = {"num_kv_heads": kv, "head_dim": d, "hidden_size": s["hidden_size"], "vocab_size": s["vocab_size"]}
    sig_in, sig_out = portable_signature(layers, sizes, dtype)
    inputs, outputs = ([helper.make_tensor_value_info(name, _TYPES[t], dims) for name, dims, t in sig]
                       for sig in (sig_in, sig_out))
    g.close()
    graph = helper.make_graph(g.nodes, "specrt_portable_decoder", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, producer_name="specrt", opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {
        "specrt.num_heads": str(n), "specrt.num_kv_heads": str(kv), "specrt.head_dim": str(d),
        "specrt.num_layers": str(layers), "specrt.max_context": str(max_context), "specrt.precision": precision,
        "specrt.portable_format": str(FORMAT),
    })
    return model
