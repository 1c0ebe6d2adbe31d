"""The decoder layer both graphs write (export/graph.py: the fused CPU graph; export/portable.py: the portable
graph), from the family facts of a DecoderSpec: norm placement, q/k norms, activation, embedding scale, sliding
windows and logit soft-capping. Each graph passes its own RMSNorm, weight constants and attention; the weights are
already in the fused layout, with (1 + w) norms, the residual multiplier and the logit scale folded in
(graph.canonical_weights), so the portable graph, written from the fused graph's initializers, gets them too.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, fields, is_dataclass

import numpy as np

from .families import NORM_PLACES


def facts(spec) -> dict:
    """A DecoderSpec, or its dict from an export.json (older sets lack the per-family fields), as a full dict."""
    from .spec import DecoderSpec

    d = asdict(spec) if is_dataclass(spec) else dict(spec)
    for f in fields(DecoderSpec):
        if f.name not in d and f.default is not MISSING:
            d[f.name] = f.default
    n = d["num_layers"]
    d["rotary_dim"] = d["rotary_dim"] or d["head_dim"]
    d["rope_freqs"] = d["rope_freqs"] or ((tuple(d.get("rope_inv_freq", ())), d.get("rope_scaling", 1.0)),)
    d["layer_rope"] = tuple(d["layer_rope"]) or (0,) * n
    d["layer_window"] = tuple(d["layer_window"]) or (0,) * n
    d["attention_scale"] = d["attention_scale"] or float(d["head_dim"]) ** -0.5
    return d


def head_lm_head(cache, spec) -> np.ndarray:
    """The lm_head rows [V, H] as transformers holds them (the graph's carry the logit scale), for the Medusa and EAGLE
    heads, which are trained on the PyTorch model's."""
    from ..onnx_files import read_initializers

    (lm_head_t,) = read_initializers(cache / "model.onnx", "lm_head.weight_t")
    scale = facts(spec)["logit_scale"]
    return lm_head_t.T if scale == 1 else lm_head_t.T / np.float32(scale)


def layer_weight_names(s: dict, i: int) -> list[str]:
    """The initializers of layer i of the fused graph (fused layout), in the order the layer reads them."""
    p = f"model.layers.{i}."
    norms = [p + n + ".weight" for n in NORM_PLACES[s["norms"]] if n]
    names = norms + [p + "self_attn.qkv_proj.weight_t", p + "self_attn.o_proj.weight_t",
                     p + "mlp.gate_up_proj.weight_t", p + "mlp.down_proj.weight_t"]
    names += [p + "self_attn.qkv_proj.bias"] if s["qkv_bias"] else []
    names += [p + "self_attn.o_proj.bias"] if s["o_bias"] else []
    names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"] if s["qk_norm"] != "none" else []
    return names


def rope_names(s: dict) -> list[tuple[str, str]]:
    """(cos, sin) initializer names per RoPE table, then the identity table of NoPE layers where any."""
    names = [("rope.cos", "rope.sin") if k == 0 else (f"rope.cos.{k}", f"rope.sin.{k}")
             for k in range(len(s["rope_freqs"]))]
    return names + ([("rope.cos.none", "rope.sin.none")] if -1 in s["layer_rope"] else [])


def layer_rope(s: dict, i: int) -> tuple[str, str]:
    return rope_names(s)[s["layer_rope"][i]]  # -1: the identity table, last


def embed(g, s: dict, x: str, dtype) -> str:
    if s["embed_scale"] == 1.0:
        return x
    return g.op("Mul", [x, g.const("embed_scale", np.array(s["embed_scale"], dtype))])


def window_biases(g, s: dict, bias: str, positions: str, n_slots: str, dtype) -> dict[int, str]:
    """{window: the attention bias [B, 1, S, slots] with every key `window` or more positions behind its query
    masked}; 0 -> the bias as given. Cache slot j holds position j for every committed token; a pass's own tokens
    sit at or after their positions, so the rule is exact while a tree is shallower than the window
    (docs/families.md, "Sliding windows")."""
    out = {0: bias}
    wins = sorted({w for w in s["layer_window"] if w})
    if not wins:
        return out
    i64 = lambda name, v: g.const(name, np.array(v, np.int64))  # noqa: E731
    slots = g.op("Range", [i64("win.zero", 0), n_slots, i64("win.one", 1)])
    pos = g.op("Unsqueeze", [positions, i64("win.ax13", [1, 3])])  # [B, 1, S, 1]
    dist = g.op("Sub", [pos, slots])  # [B, 1, S, slots]: how far back each key is
    ninf = g.const("win.ninf", np.array(-np.inf, dtype))
    for w in wins:
        far = g.op("GreaterOrEqual", [dist, i64(f"win.w{w}", w)])
        out[w] = g.op("Where", [far, ninf, bias], name=f"window_bias_{w}")
    return out


def qk_norm(g, s: dict, i: int, qkv: str, norm, i64) -> str:
    """RMSNorm of q and k (per head, or over the whole projection), before RoPE; v untouched."""
    if s["qk_norm"] == "none":
        return qkv
    n, kv, d = s["num_heads"], s["num_kv_heads"], s["head_dim"]
    p = f"model.layers.{i}.self_attn."
    q, k, v = g.op("Split", [qkv, i64("qkn.split", [n * d, kv * d, kv * d])], n_out=3, axis=2)
    if s["qk_norm"] == "head":
        q = g.op("Reshape", [norm(g.op("Reshape", [q, i64("qkn.q4", [0, 0, n, d])]), p + "q_norm.weight"),
                             i64("qkn.q3", [0, 0, n * d])])
        k = g.op("Reshape", [norm(g.op("Reshape", [k, i64("qkn.k4", [0, 0, kv, d])]), p + "k_norm.weight"),
                             i64("qkn.k3", [0, 0, kv * d])])
    else:
        q, k = norm(q, p + "q_norm.weight"), norm(k, p + "k_norm.weight")
    return g.op("Concat", [q, k, v], axis=2)


def activation(g, s: dict, gate: str, dtype) -> str:
    if s["activation"] == "silu":
        return g.op("Mul", [gate, g.op("Sigmoid", [gate])])
    # gelu_tanh: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's approximate="tanh"
    c = lambda name, v: g.const(name, np.array(v, dtype))  # noqa: E731
    x3 = g.op("Mul", [g.op("Mul", [gate, gate]), gate])
    inner = g.op("Mul", [g.op("Add", [gate, g.op("Mul", [x3, c("gelu.c3", 0.044715)])]),
                         c("gelu.k", np.sqrt(2.0 / np.pi))])
    return g.op("Mul", [g.op("Mul", [gate, c("gelu.half", 0.5)]),
                        g.op("Add", [g.op("Tanh", [inner]), c("gelu.one", 1.0)])])


def layer(g, s: dict, i: int, x: str, norm, weight, attend, i64, dtype) -> str:
    """One decoder layer: x -> x. norm(x, weight name); weight(name) -> constant; attend(i, packed qkv) -> output."""
    p = f"model.layers.{i}."
    a_in, a_out, m_in, m_out = (p + n + ".weight" if n else None for n in NORM_PLACES[s["norms"]])
    h = norm(x, a_in) if a_in else x
    qkv = g.op("MatMul", [h, weight(p + "self_attn.qkv_proj.weight_t")], name=f"layers.{i}.qkv")
    if s["qkv_bias"]:
        qkv = g.op("Add", [qkv, weight(p + "self_attn.qkv_proj.bias")])
    o = g.op("MatMul", [attend(i, qk_norm(g, s, i, qkv, lambda t, name: norm(t, name), i64)),
                        weight(p + "self_attn.o_proj.weight_t")], name=f"layers.{i}.o")
    if s["o_bias"]:
        o = g.op("Add", [o, weight(p + "self_attn.o_proj.bias")])
    x = g.op("Add", [x, norm(o, a_out) if a_out else o])
    h = norm(x, m_in) if m_in else x
    gate, up = g.op("Split", [g.op("MatMul", [h, weight(p + "mlp.gate_up_proj.weight_t")], name=f"layers.{i}.gateup"),
                              i64("split_gu", [s["intermediate_size"]] * 2)], n_out=2, axis=2)
    down = g.op("MatMul", [g.op("Mul", [activation(g, s, gate, dtype), up]), weight(p + "mlp.down_proj.weight_t")],
                name=f"layers.{i}.down")
    return g.op("Add", [x, norm(down, m_out) if m_out else down])


def softcap(g, s: dict, logits: str, out: str, dtype) -> str:
    """tanh(logits / c) * c where the family caps its logits (final_logit_softcapping); else logits as given."""
    if not s["final_softcap"]:
        return logits
    c = g.const("softcap", np.array(s["final_softcap"], dtype))
    capped = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, c])]), c], name=out)
    g.nodes[-1].name = out + ".softcap"  # node names stay unique: the lm_head's MatMul is named after its output
    return capped
