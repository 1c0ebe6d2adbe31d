"""Write a Llama/Qwen2 decoder as a standard ONNX graph with a static KV cache.

Its inputs and outputs (names and shapes: specrt/interface.py) let a token tree share positions and a draft be
rejected for free: the new tokens' K/V are written at [seqlens_k + 1 - seq, seqlens_k + 1), and the next pass
passes a smaller seqlens_k and overwrites. Attention is one ONNX local function, `specrt.CachedAttention`, in
standard ops; build/ swaps it for the fused backend kernel.
More: docs/design-notes.md, "Module notes: export/graph.py".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..interface import (HIDDEN_STATES, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP, POSITION_IDS, SEQLENS_K,
                         TOTAL_SEQUENCE_LENGTH, TREE_MASK, decoder_signature, past_name, present_name)
from ..onnx_files import read_initializers  # noqa: F401  (export's callers read weights through it)
from . import layers
from .layers import facts, layer_rope, layer_weight_names, rope_names, window_biases
from .spec import DecoderSpec

OPSET = 17
FUNCTION_DOMAIN = "specrt"
ATTENTION_OP = "CachedAttention"
INT64_MAX = np.iinfo(np.int64).max
# The signature of com.microsoft.GroupQueryAttention (packed QKV, do_rotary=1, shared buffer), so
# build/ can swap the function for the fused kernel one-to-one.
ATTENTION_INPUTS = ("packed_qkv", "past_key", "past_value", "seqlens_k", "total_sequence_length",
                    "cos_cache", "sin_cache", "position_ids", "attention_bias")


class _Graph:
    """Tiny node/initializer accumulator so the decoder below reads like the model.

    With `data_path`, weights go straight to that external-data file as they are made, so export
    memory stays at the checkpoint plus one tensor instead of the torch weights, the fused copies and
    the protobuf copy at once (docs/design-notes.md, "Streaming export weights").
    """

    MIN_EXTERNAL = 1024  # bytes; smaller tensors stay inline

    def __init__(self, data_path: Path | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0
        self._data = open(data_path, "wb") if data_path is not None else None
        self._data_name = data_path.name if data_path is not None else ""
        self._names: set[str] = set()

    def close(self) -> None:
        if self._data is not None:
            self._data.close()

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str = "", **attrs):
        self._n += 1
        base = name or f"{op_type.lower()}_{self._n}"
        outs = [f"{base}_out{i}" if n_out > 1 else base for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain, **attrs))
        return outs if n_out > 1 else outs[0]

    def const(self, name: str, array: np.ndarray) -> str:
        if name in self._names:  # shared constants (split sizes, shapes) are written once
            return name
        self._names.add(name)
        array = array if array.flags.c_contiguous else array.copy()  # ascontiguousarray would turn 0-d into 1-d
        if self._data is None or array.nbytes < self.MIN_EXTERNAL:
            self.inits.append(numpy_helper.from_array(array, name))
            return name
        offset = self._data.seek(0, 2)
        pad = -offset % 64  # aligned, like onnx's own external-data writer
        self._data.write(b"\0" * pad)
        self._data.write(array.tobytes())
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self._data_name), ("offset", str(offset + pad)), ("length", str(array.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self.inits.append(t)
        return name


def _attention_function(sp: dict) -> onnx.FunctionProto:
    """Reference RoPE + attention over a shared static cache, in standard ops (see module docstring). RoPE turns the
    first rotary_dim dimensions of each head (partial rotary) and leaves the rest."""
    n, kv, d, rot = sp["num_heads"], sp["num_kv_heads"], sp["head_dim"], sp["rotary_dim"]
    rep = n // kv
    g = _Graph()
    consts: dict[str, str] = {}

    def c(name: str, v, dt=np.int64) -> str:  # function bodies hold constants as nodes, created once
        if name not in consts:
            consts[name] = g.op("Constant", [], name=name, value=numpy_helper.from_array(np.array(v, dt), name))
        return consts[name]

    s = g.op("Gather", [g.op("Shape", ["packed_qkv"]), c("i1", 1)], axis=0)
    q, k, v = g.op("Split", ["packed_qkv", c("split_qkv", [n * d, kv * d, kv * d])], n_out=3, axis=2)
    # RoPE (rotate-half) at explicit positions: cos/sin rows [B, 1, S, D/2] broadcast over heads.
    ax1 = c("ax1", [1])
    cos = g.op("Unsqueeze", [g.op("Gather", ["cos_cache", "position_ids"], axis=0), ax1])
    sin = g.op("Unsqueeze", [g.op("Gather", ["sin_cache", "position_ids"], axis=0), ax1])

    def heads(x: str, h: int, rotate: bool) -> str:  # [B, S, h*D] -> [B, h, S, D]
        x4 = g.op("Transpose", [g.op("Reshape", [x, c(f"shape_h{h}", [0, 0, h, d])])], perm=[0, 2, 1, 3])
        if not rotate:
            return x4
        if rot < d:
            x4, rest = g.op("Split", [x4, c("split_rot", [rot, d - rot])], n_out=2, axis=3)
        x1, x2 = g.op("Split", [x4, c("split_half", [rot // 2, rot // 2])], n_out=2, axis=3)
        lo = g.op("Sub", [g.op("Mul", [x1, cos]), g.op("Mul", [x2, sin])])
        hi = g.op("Add", [g.op("Mul", [x2, cos]), g.op("Mul", [x1, sin])])
        return g.op("Concat", [lo, hi] + ([rest] if rot < d else []), axis=3)

    q4, k4, v4 = heads(q, n, True), heads(k, kv, True), heads(v, kv, False)
    # Write positions: start_b = seqlens_k[b] + 1 - S, then start_b + [0, S).
    one = c("one", 1)
    start = g.op("Sub", [g.op("Add", [g.op("Cast", ["seqlens_k"], to=TensorProto.INT64), one]), s])
    ar = g.op("Range", [c("zero", 0), s, one])
    slot = g.op("Add", [g.op("Unsqueeze", [start, ax1]), g.op("Unsqueeze", [ar, c("ax0", [0])])])  # [B,S]
    idx = g.op("Expand", [g.op("Unsqueeze", [slot, c("ax13", [1, 3])]), g.op("Shape", [k4])])
    g.op("ScatterElements", ["past_key", idx, k4], axis=2, name="present_key")
    g.op("ScatterElements", ["past_value", idx, v4], axis=2, name="present_value")
    # Attend over [0, T): the slice is what keeps cost proportional to the real length.
    t = g.op("Cast", [g.op("Reshape", ["total_sequence_length", c("shape1", [1])])], to=TensorProto.INT64)
    zero1 = c("zero1", [0])
    ax2 = c("ax2", [2])
    kt = g.op("Slice", ["present_key", zero1, t, ax2])
    vt = g.op("Slice", ["present_value", zero1, t, ax2])

    def repeat(x: str) -> str:  # [B, KV, T, D] -> [B, N, T, D]
        if rep == 1:
            return x
        x5 = g.op("Unsqueeze", [x, ax2])
        shp = g.op("Shape", [x5])
        big = g.op("Concat", [g.op("Slice", [shp, zero1, ax2]), c("rep", [rep]),
                              g.op("Slice", [shp, c("three", [3]), c("five", [5])])], axis=0)
        return g.op("Reshape", [g.op("Expand", [x5, big]), c("shape_rep", [0, n, -1, d])])

    scores = g.op("Mul", [g.op("MatMul", [q4, g.op("Transpose", [repeat(kt)], perm=[0, 1, 3, 2])]),
                          c("scale", sp["attention_scale"], np.float32)])
    # Causal over cache slots: key j visible to query i of batch b iff j <= start_b + i.
    j = g.op("Range", [c("zero_b", 0), g.op("Squeeze", [t]), one])
    allowed = g.op("LessOrEqual", [g.op("Unsqueeze", [j, c("ax01", [0, 1])]),
                                   g.op("Unsqueeze", [slot, c("ax2b", [2])])])
    causal = g.op("Where", [allowed, c("f0", 0.0, np.float32), c("ninf", -np.inf, np.float32)])
    scores = g.op("Add", [g.op("Add", [scores, g.op("Unsqueeze", [causal, ax1])]), "attention_bias"])
    probs = g.op("Softmax", [scores], axis=-1)
    out = g.op("Transpose", [g.op("MatMul", [probs, repeat(vt)])], perm=[0, 2, 1, 3])
    g.op("Reshape", [out, c("shape_out", [0, 0, n * d])], name="output")
    return helper.make_function(
        FUNCTION_DOMAIN, ATTENTION_OP, inputs=list(ATTENTION_INPUTS),
        outputs=["output", "present_key", "present_value"],
        nodes=g.nodes, opset_imports=[helper.make_opsetid("", OPSET)],
    )


def canonical_weights(s: dict, weights: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Layer i's weights in the fused graph's layout (layers.layer_weight_names): q|k|v and gate|up fused and
    transposed, (1 + w) norms, the residual multiplier in o_proj and down_proj."""
    p = f"model.layers.{i}."
    w = weights.__getitem__
    r = np.float32(s["residual_scale"])
    if s["fused_projections"]:
        qkv, gu = w(p + "self_attn.qkv_proj.weight").T, w(p + "mlp.gate_up_proj.weight").T
    else:
        qkv = np.concatenate([w(p + f"self_attn.{k}_proj.weight").T for k in "qkv"], axis=1)
        gu = np.concatenate([w(p + "mlp.gate_proj.weight").T, w(p + "mlp.up_proj.weight").T], axis=1)
    out = {p + "self_attn.qkv_proj.weight_t": qkv, p + "self_attn.o_proj.weight_t": w(p + "self_attn.o_proj.weight").T,
           p + "mlp.gate_up_proj.weight_t": gu, p + "mlp.down_proj.weight_t": w(p + "mlp.down_proj.weight").T}
    if r != 1:
        for k in ("self_attn.o_proj.weight_t", "mlp.down_proj.weight_t"):
            out[p + k] = out[p + k] * r
    if s["qkv_bias"]:
        out[p + "self_attn.qkv_proj.bias"] = (w(p + "self_attn.qkv_proj.bias") if s["fused_projections"] else
                                               np.concatenate([w(p + f"self_attn.{k}_proj.bias") for k in "qkv"]))
    if s["o_bias"]:
        out[p + "self_attn.o_proj.bias"] = w(p + "self_attn.o_proj.bias") * r
    norms = [n for n in layer_weight_names(s, i) if n.endswith("norm.weight")]
    out.update({n: w(n) + np.float32(s["norm_offset"]) for n in norms})
    return out


def build_decoder(spec: DecoderSpec, weights: dict[str, np.ndarray], max_context: int,
                  data_path: Path | None = None) -> onnx.ModelProto:
    """weights: the Hugging Face state dict as float32 numpy arrays (names as in transformers).
    data_path: stream weights to this external-data file (save the model beside it, without
    save_as_external_data); None keeps them inline (tiny models, tests)."""
    spec.check_max_context(max_context)  # before any weight is written: past it the graph would silently differ
    s = facts(spec)
    g = _Graph(data_path)
    n, kv, d, h = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    i64 = lambda name, v: g.const(name, np.array(v, np.int64))  # noqa: E731

    embed = g.const("embed_tokens.weight", weights["model.embed_tokens.weight"])
    lm = weights["model.embed_tokens.weight"] if spec.tie_word_embeddings else weights["lm_head.weight"]
    # The transpose is folded into a constant so weight-only quantizers see a const MatMul weight.
    lm_head = g.const("lm_head.weight_t", lm.T * np.float32(s["logit_scale"]) if s["logit_scale"] != 1 else lm.T)
    tables = spec.rope_tables_at(max_context)
    names = rope_names(s)
    if len(names) > len(tables):  # NoPE layers: the identity rotation
        tables.append((np.ones_like(tables[0][0]), np.zeros_like(tables[0][1])))
    for (cn, sn), (cos_t, sin_t) in zip(names, tables):
        g.const(cn, cos_t), g.const(sn, sin_t)  # [max_context, rotary_dim / 2]
    eps = g.const("rms_eps", np.array(spec.rms_norm_eps, np.float32))
    two = g.const("two", np.array(2.0, np.float32))

    def rmsnorm(x: str, weight: str) -> str:  # the pattern ORT fuses into SimplifiedLayerNormalization
        var = g.op("ReduceMean", [g.op("Pow", [x, two])], axes=[-1], keepdims=1)
        normed = g.op("Div", [x, g.op("Sqrt", [g.op("Add", [var, eps])])])
        return g.op("Mul", [normed, g.const(weight, canon[weight])])

    # The tree mask covers the new tokens only; pad it with zeros over the past: [B, 1, S, T].
    seq = g.op("Gather", [g.op("Shape", [INPUT_IDS]), i64("idx1", 1)], axis=0)
    t = g.op("Cast", [TOTAL_SEQUENCE_LENGTH], to=TensorProto.INT64)
    pad_left = g.op("Unsqueeze", [g.op("Sub", [t, seq]), i64("ax0", [0])])
    pads = g.op("Concat", [i64("zeros2", [0, 0]), pad_left, i64("zeros3", [0, 0, 0])], axis=0)
    bias = g.op("Unsqueeze", [g.op("Pad", [TREE_MASK, pads]), i64("ax1", [1])], name="attention_bias")
    biases = window_biases(g, s, bias, POSITION_IDS, t, np.float32)

    def attend(i: int, qkv: str) -> str:
        cos, sin = layer_rope(s, i)
        attn, _, _ = g.op(ATTENTION_OP, [qkv, past_name(i, "key"), past_name(i, "value"), SEQLENS_K,
                                         TOTAL_SEQUENCE_LENGTH, cos, sin, POSITION_IDS, biases[s["layer_window"][i]]],
                          n_out=3, domain=FUNCTION_DOMAIN, name=f"layers.{i}.attn")
        g.nodes[-1].output[1], g.nodes[-1].output[2] = present_name(i, "key"), present_name(i, "value")
        return attn

    x = layers.embed(g, s, g.op("Gather", [embed, INPUT_IDS], name="embed"), np.float32)
    for i in range(spec.num_layers):
        canon = canonical_weights(s, weights, i)
        x = layers.layer(g, s, i, x, rmsnorm, lambda name: g.const(name, canon[name]), attend, i64, np.float32)
    canon = {"model.norm.weight": weights["model.norm.weight"] + np.float32(s["norm_offset"])}
    rmsnorm(x, "model.norm.weight")
    g.nodes[-1].output[0] = HIDDEN_STATES
    n_keep = g.op("Unsqueeze", [g.op("Neg", [NUM_LOGITS_TO_KEEP]), i64("ax0b", [0])])
    last = g.op("Slice", [HIDDEN_STATES, n_keep, i64("int_max", [INT64_MAX]), i64("ax1c", [1])])
    logits = g.op("MatMul", [last, lm_head], name=LOGITS)
    if s["final_softcap"]:
        logits = g.nodes[-1].output[0] = "logits_uncapped"
        layers.softcap(g, s, logits, LOGITS, np.float32)

    types = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "int32": TensorProto.INT32}
    sig_in, sig_out = decoder_signature(spec.num_layers, {"num_kv_heads": kv, "head_dim": d, "hidden_size": h,
                                                          "vocab_size": spec.vocab_size})
    inputs, outputs = ([helper.make_tensor_value_info(name, types[dtype], dims) for name, dims, dtype in sig]
                       for sig in (sig_in, sig_out))
    g.close()
    graph = helper.make_graph(g.nodes, "specrt_decoder", inputs, outputs, initializer=g.inits)
    model = helper.make_model(
        graph, functions=[_attention_function(s)], producer_name="specrt",
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(FUNCTION_DOMAIN, 1)],
    )
    model.ir_version = 9
    # Self-describing: build/ needs the head counts and the attention scale to pick the fused kernel's attributes.
    helper.set_model_props(model, {
        "specrt.num_heads": str(n), "specrt.num_kv_heads": str(kv), "specrt.head_dim": str(d),
        "specrt.num_layers": str(spec.num_layers), "specrt.max_context": str(max_context),
        "specrt.attention_scale": repr(s["attention_scale"]),
    })
    return model
