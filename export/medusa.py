"""Medusa-1 heads: the heads file, and the heads as an ONNX engine (training: export/train/medusa.py).

Head k (k = 1..K) reads the target's final-norm hidden state h_t and guesses the token k places
past the target's own next token:   logits_k = E_sub · (x + W2_k · SiLU(W1_k · x + b1_k) + b2_k)

with x = h (Medusa-1, `token_input=False`) or x = h + A · e(y_t) (default): e(y_t) is the lm_head row of
the target's next token y_t, already decided when the heads run, so the heads need not guess it again.
E_sub are rows of the target's lm_head, shared and frozen, over a reduced vocabulary.
More: docs/design-notes.md, "Module notes: export/medusa.py".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import SpecrtError
from ..interface import HEADS_CANDIDATES, HEADS_HIDDEN, HEADS_SCORES, HEADS_TOKEN

HEADS_FORMAT = 1
# the heads engine's graph (3: only the heads the tree reads; 2 had a probs output, not kept); in engine sets' build key
HEADS_ENGINE = 3


def load_heads(path: Path) -> dict:
    if not Path(path).is_file():
        raise SpecrtError(f"Medusa heads file '{path}' not found; "
                          "train it with `specrt train-medusa` (or `make heads`)")
    d = np.load(path)
    report = json.loads(str(d["report"]))
    if report.get("format") != HEADS_FORMAT:
        raise SpecrtError(f"'{path}' has heads format {report.get('format')}, expected {HEADS_FORMAT}; "
                          "retrain with `make heads`")
    return {k: d[k] for k in ("w1", "b1", "w2", "b2", "vocab", "a") if k in d} | {"report": report}


def export_heads_onnx(heads: dict, lm_head: np.ndarray, out: Path, topk: int, depth: int | None = None,
                      per_head: bool = False) -> dict:
    """The first `depth` heads (the ones a tree of that depth reads; None = all) as a tiny engine over
    the target's hidden state (standard ONNX, fp32):

      hidden [batch, H] (+ token [batch] int64, the pending token, for token-input heads)
        -> candidates [batch, K, topk] int64 target token ids, best first
           scores     [batch, K, topk] float32 head logits
    Weights: W1, W2 of each head, E_sub (the lm_head rows of the reduced vocabulary) and, for
    token-input heads, the table lm_head · A [V, H] in float16 (one row is gathered per round).
    per_head: each head's two layers as 2-D MatMuls over their own [H, H] weights (the same function), the form
    build/quantize.py puts Q/DQ around (per-channel weight scales of a 2-D GEMM, as TensorRT's FP8 GEMMs take)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if depth is not None:  # heads past the tree's depth would be computed every round and never read
        # (docs/design-notes.md, "Medusa heads engine depth")
        heads = {k: v[:depth] if k in ("w1", "b1", "w2", "b2") else v for k, v in heads.items()}
    K, H, _ = heads["w1"].shape
    vocab = heads["vocab"].astype(np.int64)
    if lm_head.shape[1] != H or vocab.max() >= lm_head.shape[0]:
        raise SpecrtError(f"heads (hidden {H}, vocab ids < {vocab.max() + 1}) do not fit this target "
                          f"(lm_head {tuple(lm_head.shape)}); retrain them with `specrt train-medusa`")
    f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("w1", f32(heads["w1"])), ("b1", f32(heads["b1"])[:, None, :]), ("w2", f32(heads["w2"])),
        ("b2", f32(heads["b2"])[:, None, :]), ("e_sub_t", f32(lm_head[vocab].T)), ("vocab", vocab),
        ("k", np.array([topk], np.int64)), ("ax1", np.array([1], np.int64)))]
    n = helper.make_node
    inputs = [helper.make_tensor_value_info(HEADS_HIDDEN, TensorProto.FLOAT, ["batch", H])]
    x_in, pre = HEADS_HIDDEN, []
    if "a" in heads:
        table = (lm_head.astype(np.float32) @ heads["a"].astype(np.float32)).astype(np.float16)
        inits.append(numpy_helper.from_array(table, "token_table"))
        inputs.append(helper.make_tensor_value_info(HEADS_TOKEN, TensorProto.INT64, ["batch"]))
        pre = [n("Gather", ["token_table", HEADS_TOKEN], ["tok16"]),
               n("Cast", ["tok16"], ["tok32"], to=TensorProto.FLOAT),
               n("Add", [HEADS_HIDDEN, "tok32"], ["hx"])]
        x_in = "hx"
    if per_head:
        del inits[:4]  # the stacked w1, b1, w2, b2: per-head ones instead
        nodes = pre + _per_head_nodes(x_in, K, inits, f32(heads["w1"]), f32(heads["b1"]), f32(heads["w2"]),
                                      f32(heads["b2"]))
        nodes += [n("MatMul", ["y", "e_sub_t"], ["logits"], name="heads.lm_head"),
                  n("TopK", ["logits", "k"], [HEADS_SCORES, "idx"], axis=-1),
                  n("Gather", ["vocab", "idx"], [HEADS_CANDIDATES])]
    else:
        nodes = pre + _stacked_nodes(x_in)
        inits.append(numpy_helper.from_array(np.array([2], np.int64), "ax2"))
    graph = helper.make_graph(
        nodes, "medusa_heads", inputs,
        [helper.make_tensor_value_info(HEADS_CANDIDATES, TensorProto.INT64, ["batch", K, topk]),
         helper.make_tensor_value_info(HEADS_SCORES, TensorProto.FLOAT, ["batch", K, topk])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="specrt")
    onnx.checker.check_model(model)
    onnx.save_model(model, str(out))
    return {"heads": int(K), "hidden_size": int(H), "topk": int(topk), "vocab_subset": int(len(vocab)),
            "token_input": "a" in heads}


def _stacked_nodes(x_in: str) -> list:
    """All heads in one batched MatMul per layer over stacked [K, H, H] weights."""
    from onnx import helper

    n = helper.make_node
    return [
        n("Unsqueeze", [x_in, "ax1"], ["x"]),                         # [B, 1, H]: broadcasts over heads
        n("Unsqueeze", ["x", "ax1"], ["x4"]),                         # [B, 1, 1, H]
        n("MatMul", ["x4", "w1"], ["a"]), n("Add", ["a", "b1"], ["a1"]),   # [B, K, 1, H]
        n("Sigmoid", ["a1"], ["sg"]), n("Mul", ["a1", "sg"], ["act"]),      # SiLU
        n("MatMul", ["act", "w2"], ["r"]), n("Add", ["r", "b2"], ["r1"]), n("Add", ["r1", "x4"], ["y4"]),
        n("Squeeze", ["y4", "ax2"], ["y"]),                           # [B, K, H]
        n("MatMul", ["y", "e_sub_t"], ["logits"]),                    # [B, K, V']
        n("TopK", ["logits", "k"], [HEADS_SCORES, "idx"], axis=-1),
        n("Gather", ["vocab", "idx"], [HEADS_CANDIDATES]),
    ]


def _per_head_nodes(x_in: str, K: int, inits: list, w1, b1, w2, b2) -> list:
    """Head k: y_k = x + SiLU(x W1_k + b1_k) W2_k + b2_k with 2-D MatMuls; the heads stacked into y [B, K, H]."""
    from onnx import helper, numpy_helper

    n, nodes = helper.make_node, []
    for k in range(K):
        inits += [numpy_helper.from_array(w1[k], f"w1.{k}"), numpy_helper.from_array(b1[k], f"b1.{k}"),
                  numpy_helper.from_array(w2[k], f"w2.{k}"), numpy_helper.from_array(b2[k], f"b2.{k}")]
        nodes += [n("MatMul", [x_in, f"w1.{k}"], [f"a.{k}"], name=f"head{k}.w1"),
                  n("Add", [f"a.{k}", f"b1.{k}"], [f"a1.{k}"]),
                  n("Sigmoid", [f"a1.{k}"], [f"sg.{k}"]), n("Mul", [f"a1.{k}", f"sg.{k}"], [f"act.{k}"]),
                  n("MatMul", [f"act.{k}", f"w2.{k}"], [f"r.{k}"], name=f"head{k}.w2"),
                  n("Add", [f"r.{k}", f"b2.{k}"], [f"r1.{k}"]), n("Add", [f"r1.{k}", x_in], [f"y2.{k}"]),
                  n("Unsqueeze", [f"y2.{k}", "ax1"], [f"y.{k}"])]       # [B, 1, H]
    nodes.append(n("Concat", [f"y.{k}" for k in range(K)], ["y"], axis=1))  # [B, K, H]
    return nodes
