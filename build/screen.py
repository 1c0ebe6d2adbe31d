"""The logit screen of fp32 engines: exact greedy tokens without reading the whole fp32 lm_head each pass.

The lm_head is a large share of a small model's weights and a CPU decode step is memory-bound, so
reading it is a visible part of every step (docs/design-notes.md, "Logit screen cost"). Greedy decoding
needs only the argmax of the logits, and almost every token is far from winning. So the engine's lm_head
becomes If(approx_logits): the fp32 MatMul as before (sampling, parity checks: every caller that needs the
distribution), or this screen, all inside the graph:

1. approximate logits through an 8-bit copy of the lm_head (MatMulNBits, blocks of `BLOCK`, int8 compute:
   a quarter of the bytes);
2. a proven bound per token r on |approx_r - exact_r|, from the two error sources:
   weights:     |h . (w_r - w^_r)|  <= ||h||_2 ||w_r - w^_r||_2                      (Cauchy-Schwarz)
   activations: |(h - h^) . w^_r|   <= ||h - h^||_2 ||w^_r||_2, and ||h - h^||_2 <= sqrt(block) / 254 *
                sqrt(sum_b max|h_b|^2): the int8 kernel (MLAS CompInt8) quantizes h per block of `block`
                values with scale max|h_b| / 127, so each value moves by at most half a step;
   plus a margin for the kernel's float rounding (1e-4 of ||h|| ||w^_r||, well above what float32 loses:
   docs/design-notes.md, "Logit screen bound"),
   all times 1.001 (the per-token norms are stored in float32);
3. every token whose approx + bound reaches max_s(approx_s - bound_s) is a candidate (no other can win);
4. the candidates' exact fp32 logits from their rows of the fp32 lm_head, and the argmax among them (ties:
   the lowest token id, as ArgMax over the whole row).

ORT runs only the branch taken (an If costs next to nothing), so fp32 passes cost what they did; on real
text only a handful of tokens per row stay candidates. Past MAX_CANDIDATES in a pass (unusual hidden
states loosen the bound) the fp32 lm_head is read after all. The bound holds only for the kernel it was
derived for, so `specrt engines` checks it against the built engine on real hidden states
(specrt/pipeline/checks.py check_screen) and the runtime uses the screen only on the CPU family and onnxruntime
version it was checked with (runtime/backends/onnxruntime_cpu/).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..interface import APPROX_INPUT as INPUT, GREEDY_OUTPUT as OUTPUT, LOGITS  # the engine's contract

BLOCK = 32  # fewer scale bytes than 16, far fewer candidates than 64 (docs/design-notes.md, "Logit screen block size")
# more (row, token) candidates in a pass: reading the fp32 lm_head is cheaper than rescoring them
# (docs/design-notes.md, "Logit screen candidate limit")
MAX_CANDIDATES = 1024
FORMAT = 8  # bump when the screen's graph or its build check changes (part of the fp32 engines' build key)
SLACK = 1.0 + 1e-3
ROUNDING = 1e-4


def bounds(hidden: np.ndarray, weight_err: np.ndarray, qnorm: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """[n, V]: the bound of step 2 for hidden [n, H], in numpy (the graph computes the same in float32)."""
    h = np.asarray(hidden, np.float64)
    n, H = h.shape
    hn = np.linalg.norm(h, axis=1, keepdims=True)
    blockmax = np.abs(h).reshape(n, H // block, block).max(axis=2)
    da = math.sqrt(block) / 254.0 * np.linalg.norm(blockmax, axis=1, keepdims=True)
    return SLACK * (hn * weight_err[None] + (da + ROUNDING * hn) * qnorm[None])


def _lm_head(model: onnx.ModelProto) -> tuple[onnx.NodeProto, onnx.TensorProto]:
    node = next((n for n in model.graph.node if list(n.output) == [LOGITS]), None)
    inits = {i.name: i for i in model.graph.initializer}
    if node is None or node.op_type != "MatMul" or node.input[1] not in inits:
        raise ValueError(f"no fp32 MatMul lm_head producing '{LOGITS}' in this graph")
    return node, inits[node.input[1]]


def quantize_rows(w_t: np.ndarray, block: int = BLOCK) -> tuple[onnx.NodeProto, list[onnx.TensorProto], np.ndarray]:
    """w_t [H, V] fp32 -> (MatMulNBits node reading 'X', its initializers, the dequantized rows [V, H] float64)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for name in ("onnxruntime.quantization", "onnxruntime.quantization.matmul_nbits_quantizer"):
        logging.getLogger(name).setLevel(logging.WARNING)
    H, V = w_t.shape
    g = helper.make_graph([helper.make_node("MatMul", ["X", "screen.lm_head"], ["Y"], name="screen.lm_head_q8")],
                          "lm_head", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, "n", H])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, "n", V])],
                          [numpy_helper.from_array(w_t, "screen.lm_head")])
    q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), bits=8,
                             block_size=block, is_symmetric=False, accuracy_level=4)
    q.process()
    node = next(n for n in q.model.model.graph.node if n.op_type == "MatMulNBits")
    inits = list(q.model.model.graph.initializer)
    arr = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in inits}
    qb = arr[node.input[1]].reshape(V, H // block, block)
    scales, zp = (arr[name].reshape(V, H // block, 1) for name in node.input[2:4])
    return node, inits, ((qb - zp) * scales).reshape(V, H)


def add_screen(model: onnx.ModelProto, block: int = BLOCK) -> dict | None:
    """Rewrite the fp32 lm_head of `model` (loaded with its weights) into If(approx_logits, screen, fp32),
    with a second output `greedy_tokens` [batch, n] (the screen: batch 1 only, as the runtime runs).
    Returns the screen's manifest facts, or None (and leaves the model alone) where the hidden size is not a
    multiple of `block` or the logits are not the lm_head's product (soft-capped: docs/families.md)."""
    if any(LOGITS in n.output and n.op_type != "MatMul" for n in model.graph.node):
        return None
    node, weight = _lm_head(model)
    w_t = numpy_helper.to_array(weight)
    H, V = w_t.shape
    if H % block:
        return None
    qnode, qinits, deq = quantize_rows(w_t, block)
    rows = np.ascontiguousarray(w_t.T)
    rows_name = _tied_embedding(model, rows)
    weight_err, qnorm = (np.linalg.norm(rows - deq, axis=1).astype(np.float32),
                         np.linalg.norm(deq, axis=1).astype(np.float32))
    B = next(b for b in (64, 32, 16, 8, 4, 2, 1) if V % b == 0)  # tokens per block of the candidate search
    consts = {"screen.err_norm": np.stack([weight_err, qnorm]),                    # [2, V]: per-token bound terms
              "screen.by_block": np.array([0, V // B, B], np.int64),
              "screen.rows_of_block": np.array([-1, B], np.int64),
              "screen.blocks_per_row": np.array(V // B, np.int64), "screen.B": np.array(B, np.int64),
              "screen.ax2": np.array([2], np.int64), "screen.ninf": np.array(-np.inf, np.float32),
              "screen.blocks": np.array([0, H // block, block], np.int64),
              "screen.act": np.array(math.sqrt(block) / 254.0, np.float32),
              "screen.rounding": np.array(ROUNDING, np.float32), "screen.slack": np.array(SLACK, np.float32),
              "screen.ax0": np.array([0], np.int64), "screen.ax1": np.array([1], np.int64),
              "screen.i0": np.array(0, np.int64), "screen.i1": np.array(1, np.int64),
              "screen.max_candidates": np.array(MAX_CANDIDATES, np.int64)}
    if not rows_name:  # untied: the fp32 rows the candidates are rescored from, laid out [V, H]
        rows_name, consts["screen.rows"] = "screen.rows", rows
    x = node.input[0]
    qnode.input[0] = x
    qnode.output[0] = "screen.logits"
    N = helper.make_node
    f32 = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
    i64 = lambda name: helper.make_tensor_value_info(name, TensorProto.INT64, None)  # noqa: E731
    # Rescoring k candidates gathers k scattered fp32 rows: where the bound is loose (unusual hidden states)
    # the fp32 lm_head is cheaper. That MatMul sits in a first-level If (second If below): ORT pre-packs the
    # weights of a MatMul in a subgraph, but not in a subgraph's subgraph.
    # NonZero over all [n, V] flags walks every element, so candidates are found by blocks: the blocks whose
    # largest upper bound reaches the floor, then the tokens within those blocks.
    # (docs/design-notes.md, "Logit screen candidate limit" and "Logit screen graph layout")
    rescore = [
        N("Gather", [rows_name, "screen.cand_tok"], ["screen.w"], axis=0),               # [k, H] fp32 rows
        N("Gather", ["screen.h", "screen.cand_row"], ["screen.hk"], axis=0),
        N("Mul", ["screen.w", "screen.hk"], ["screen.wh"]),
        N("ReduceSum", ["screen.wh", "screen.ax1"], ["screen.exact"], keepdims=0),      # [k] exact logits
        # the argmax of each row among its candidates ([n, k], not [n, V]): candidates come row by row, tokens
        # ascending, so ArgMax's first maximum is the lowest token id, as ArgMax over the whole row picks
        N("Range", ["screen.i0", "screen.n", "screen.i1"], ["screen.rows_n"]),
        N("Unsqueeze", ["screen.rows_n", "screen.ax1"], ["screen.rows_n1"]),            # [n, 1]
        N("Equal", ["screen.rows_n1", "screen.cand_row"], ["screen.mine"]),             # [n, k]
        N("Where", ["screen.mine", "screen.exact", "screen.ninf"], ["screen.S"]),
        N("ArgMax", ["screen.S"], ["screen.j"], axis=1, keepdims=0),                   # [n]
        N("Gather", ["screen.cand_tok", "screen.j"], ["screen.best"], axis=0),
        N("Unsqueeze", ["screen.best", "screen.ax0"], ["screen.best1"]),               # [1, n]
    ]
    skip = [N("Constant", [], ["screen.none"], value=helper.make_tensor("none", TensorProto.INT64, [1, 1], [0]))]
    screen = [
        qnode,
        N("Squeeze", ["screen.logits", "screen.ax0"], ["screen.A"]),                    # [n, V]
        N("Shape", ["screen.A"], ["screen.shape"]),
        N("Gather", ["screen.shape", "screen.i0"], ["screen.n"], axis=0),
        N("Squeeze", [x, "screen.ax0"], ["screen.h"]),                                  # [n, H]
        N("ReduceL2", ["screen.h"], ["screen.hn"], axes=[1], keepdims=1),               # [n, 1]
        N("Abs", ["screen.h"], ["screen.habs"]),
        N("Reshape", ["screen.habs", "screen.blocks"], ["screen.hb"]),
        N("ReduceMax", ["screen.hb"], ["screen.bmax"], axes=[2], keepdims=0),           # [n, H / block]
        N("ReduceL2", ["screen.bmax"], ["screen.bn"], axes=[1], keepdims=1),
        N("Mul", ["screen.bn", "screen.act"], ["screen.dh"]),                           # ||h - h^|| bound
        N("Mul", ["screen.hn", "screen.rounding"], ["screen.hr"]),
        N("Add", ["screen.dh", "screen.hr"], ["screen.c0"]),
        N("Mul", ["screen.c0", "screen.slack"], ["screen.c"]),
        N("Mul", ["screen.hn", "screen.slack"], ["screen.a"]),
        N("Concat", ["screen.a", "screen.c"], ["screen.ac"], axis=1),                   # [n, 2]
        N("MatMul", ["screen.ac", "screen.err_norm"], ["screen.bound"]),                # [n, V]: a werr + c qnorm
        N("Sub", ["screen.A", "screen.bound"], ["screen.lo"]),
        N("ReduceMax", ["screen.lo"], ["screen.floor"], axes=[1], keepdims=1),           # [n, 1]
        N("Add", ["screen.A", "screen.bound"], ["screen.hi"]),
        N("Reshape", ["screen.hi", "screen.by_block"], ["screen.hib"]),                 # [n, V / B, B]
        N("ReduceMax", ["screen.hib"], ["screen.hi_block"], axes=[2], keepdims=1),      # [n, V / B, 1]
        N("Unsqueeze", ["screen.floor", "screen.ax1"], ["screen.floor3"]),              # [n, 1, 1]
        N("GreaterOrEqual", ["screen.hi_block", "screen.floor3"], ["screen.blk_ok3"]),
        N("Squeeze", ["screen.blk_ok3", "screen.ax2"], ["screen.blk_ok"]),
        N("NonZero", ["screen.blk_ok"], ["screen.blk"]),                                # [2, b]: (row, block)
        N("Gather", ["screen.blk", "screen.i0"], ["screen.blk_row"], axis=0),
        N("Gather", ["screen.blk", "screen.i1"], ["screen.blk_id"], axis=0),
        N("Mul", ["screen.blk_row", "screen.blocks_per_row"], ["screen.blk_off"]),
        N("Add", ["screen.blk_off", "screen.blk_id"], ["screen.blk_flat"]),
        N("Reshape", ["screen.hi", "screen.rows_of_block"], ["screen.hi_rows"]),        # [n V / B, B]
        N("Gather", ["screen.hi_rows", "screen.blk_flat"], ["screen.hi_b"], axis=0),    # [b, B]
        N("Gather", ["screen.floor", "screen.blk_row"], ["screen.floor_b"], axis=0),    # [b, 1]
        N("GreaterOrEqual", ["screen.hi_b", "screen.floor_b"], ["screen.in_b"]),
        N("NonZero", ["screen.in_b"], ["screen.cand_b"]),                               # [2, k]: (block, column)
        N("Gather", ["screen.cand_b", "screen.i0"], ["screen.cand_j"], axis=0),
        N("Gather", ["screen.cand_b", "screen.i1"], ["screen.cand_col"], axis=0),
        N("Gather", ["screen.blk_row", "screen.cand_j"], ["screen.cand_row"], axis=0),
        N("Gather", ["screen.blk_id", "screen.cand_j"], ["screen.cand_blk"], axis=0),
        N("Mul", ["screen.cand_blk", "screen.B"], ["screen.cand_base"]),
        N("Add", ["screen.cand_base", "screen.cand_col"], ["screen.cand_tok"]),         # [k]
        N("Shape", ["screen.cand_tok"], ["screen.cand_shape"]),
        N("Gather", ["screen.cand_shape", "screen.i0"], ["screen.k"], axis=0),
        N("Greater", ["screen.k", "screen.max_candidates"], ["screen.too_many"]),
        N("If", ["screen.too_many"], ["screen.tokens"], name="screen.rescore",
          then_branch=helper.make_graph(skip, "skip", [], [i64("screen.none")]),
          else_branch=helper.make_graph(rescore, "rescore", [], [i64("screen.best1")])),
    ]
    not_screened = [N("Constant", [], ["screen.no_logits"],
                      value=helper.make_tensor("e", TensorProto.FLOAT, [1, 1, 1], [0.0])),
                    N("Constant", [], ["screen.no_tokens"],
                      value=helper.make_tensor("t", TensorProto.INT64, [1, 1], [0])),
                    N("Constant", [], ["screen.yes"], value=helper.make_tensor("y", TensorProto.BOOL, [], [True]))]
    b = lambda name: helper.make_tensor_value_info(name, TensorProto.BOOL, None)  # noqa: E731
    first = N("If", [INPUT], ["screen.out_logits", "screen.out_tokens", "screen.need_fp32"], name="screen",
              then_branch=helper.make_graph(screen, "screen", [], [f32("screen.logits"), i64("screen.tokens"),
                                                                    b("screen.too_many")]),
              else_branch=helper.make_graph(not_screened, "fp32", [], [f32("screen.no_logits"), i64("screen.no_tokens"),
                                                                       b("screen.yes")]))
    exact = [N("MatMul", [x, weight.name], ["logits_fp32"], name="logits_fp32"),
             N("ArgMax", ["logits_fp32"], ["greedy_fp32"], axis=2, keepdims=0)]        # [batch, n]
    keep = [N("Identity", ["screen.out_logits"], ["screened_logits"]),
            N("Identity", ["screen.out_tokens"], ["screened_tokens"])]
    branch = N("If", ["screen.need_fp32"], [LOGITS, OUTPUT], name=LOGITS,
               then_branch=helper.make_graph(exact, "exact", [], [f32("logits_fp32"), i64("greedy_fp32")]),
               else_branch=helper.make_graph(keep, "screened", [], [f32("screened_logits"), i64("screened_tokens")]))
    nodes = list(model.graph.node)
    i = nodes.index(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes[:i] + [first, branch] + nodes[i + 1:])
    model.graph.initializer.extend(qinits + [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model.graph.input.append(helper.make_tensor_value_info(INPUT, TensorProto.BOOL, []))
    model.graph.output.append(helper.make_tensor_value_info(OUTPUT, TensorProto.INT64, ["batch", "num_logits"]))
    return {"block_size": block, "method": "8-bit lm_head (MatMulNBits, int8 compute) + proven bound + fp32 rescoring",
            "rows": rows_name}


def _tied_embedding(model: onnx.ModelProto, rows: np.ndarray) -> str:
    """The name of the embedding initializer equal to the lm_head rows ('' if untied)."""
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Gather" and n.input[0] in inits:
            t = inits[n.input[0]]
            if list(t.dims) == list(rows.shape) and np.array_equal(numpy_helper.to_array(t), rows):
                return t.name
    return ""
