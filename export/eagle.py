"""EAGLE heads (EAGLE-1/2): a one-layer draft model over the target's own features, trained on the CPU.

At head position i the input is [f_i ; e(x_{i+1})]: the target's feature (final-norm hidden state) at i and the
embedding of the token after it. fc maps it to the hidden size, one decoder layer (attention over the earlier
positions, with its own KV cache at run time, then a SwiGLU MLP) predicts f_{i+1}, and the target's own lm_head
rows (frozen, shared; a reduced vocabulary, as EAGLE-3's draft vocabulary) read the token after x_{i+1} from it.
Drafting continues autoregressively on features: the next input is [predicted feature ; e(drafted token)].

Training (export/train/eagle.py, on export/train/eagle_data.py's features) minimises EAGLE's loss: SmoothL1 between
predicted and true features plus w_cls times the cross-entropy against the target's distribution over the reduced
vocabulary; its `evaluate` replays chain drafting as the runtime drafts, on the benchmark's prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EAGLE_FORMAT = 3  # the engine graph: int8 weights, a cache layout that follows the context
# options a checkpoint resumes across: a larger --budget-minutes continues a run where it stopped
RESUMABLE = ("budget_s", "ckpt_seconds", "threads")


@dataclass(frozen=True)
class HeadShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    rms_eps: float

    @classmethod
    def of(cls, config) -> "HeadShape":
        """From a transformers config of the target."""
        from .families import rope_theta

        heads = config.num_attention_heads
        return cls(config.hidden_size, heads, getattr(config, "num_key_value_heads", heads),
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size,
                   rope_theta(config), float(config.rms_norm_eps))


@dataclass(frozen=True)
class EagleTrainConfig:
    vocab: int = 8192            # the reduced draft vocabulary: the most frequent target choices in the data
    lr: float = 1e-3
    batch_tokens: int = 4096     # positions per optimizer step (whole sequences)
    max_epochs: int = 20
    budget_s: float = 1200.0     # wall-clock training budget
    w_cls: float = 0.1           # EAGLE's weight of the classification loss against the feature regression
    noise: float = 0.2           # uniform noise on input features (EAGLE), as a fraction of their std
    seed: int = 0
    threads: int = 0
    ckpt_seconds: float = 120.0
    fuse: bool = False           # EAGLE-3's input: low, middle and high (final-norm) target features, fused by fc
    ttt_steps: int = 1           # training-time test: train this many chained draft steps (1 = teacher forcing)


def make_head(shape: HeadShape, fuse: bool = False):
    """The head as a torch module (imported lazily: export/ is the only torch user). fuse: EAGLE-3's input, the
    target's [low ; middle ; high] features through a linear map to the hidden size; a drafted position has no low
    and middle features, so it reads [0 ; 0 ; predicted feature] (the map starts as the identity on the high
    third: an untrained fusion is EAGLE-1)."""
    from .eagle_module import Head

    return Head(shape, fuse)


def save_head(path: Path, head, vocab: np.ndarray, report: dict) -> None:
    """The committed form: float16 weights, the draft vocabulary and the report (JSON)."""
    sd = {k: v.detach().numpy().astype(np.float16) for k, v in head.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, vocab=vocab.astype(np.int32), report=json.dumps(report), **{f"w.{k}": v for k, v in sd.items()})
    tmp.rename(path)


def head_arrays(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
    """save_head's file as numpy: (weights by state_dict name, float32; vocab; report)."""
    with np.load(path) as f:
        weights = {k[2:]: f[k].astype(np.float32) for k in f.files if k.startswith("w.")}
        return weights, f["vocab"].astype(np.int64), json.loads(str(f["report"]))


def export_eagle_onnx(head_file: Path, embed: np.ndarray, lm_head: np.ndarray, out: Path, max_context: int,
                      topk: int = 8) -> dict:
    """A trained head (save_head's file) as an engine in the portable style (standard ONNX, opset 24, fp32):

      features [1, W, H], input_ids [1, W] (the token after each position), position_ids [1, W],
      attention_mask [1, 1, W, C] additive, write_indices [1]; past/present.0.key|value [1, kv, C, D] (one buffer)
        -> hidden_states [1, W, H] (the predicted next features), draft_tokens / draft_logprobs [1, W, topk]

    C (symbolic; at most max_context + 64: a chain or tree of draft steps past the context) is the cache layout's
    length, which the runtime keeps near the context (attention reads every slot). fc's token half is folded into a
    [V, H] float16 table (embed @ W_e: one row gathered per position); the readout is the target's lm_head rows of
    the draft vocabulary, log-softmaxed over them."""
    import onnx
    from onnx import TensorProto, helper

    from ..interface import (ATTENTION_MASK, EAGLE_FEATURES, EAGLE_LOGPROBS, EAGLE_TOKENS, HIDDEN_STATES,
                             INPUT_IDS, POSITION_IDS, WRITE_INDICES, past_name, present_name)
    from .graph import _Graph
    from .portable import IR_VERSION, OPSET

    w, vocab, report = head_arrays(head_file)
    S = HeadShape(**report["shape"])
    H, n, kv, D = S.hidden, S.heads, S.kv_heads, S.head_dim
    if embed.shape[1] != H or lm_head.shape[1] != H or vocab.max() >= lm_head.shape[0]:
        raise ValueError(f"the EAGLE head (hidden {H}) does not fit this target (embed {embed.shape}, lm_head "
                         f"{lm_head.shape}); retrain it with `specrt train-eagle`")
    C = max_context + 64
    g = _Graph(Path(str(out) + ".data"))
    f32 = lambda name, a: g.const(name, np.ascontiguousarray(a, np.float32))  # noqa: E731
    i64 = lambda name, v: g.const(name, np.array(v, np.int64))  # noqa: E731
    fc = w["fc.weight"]  # [H, 2H]: features first, then the token embedding
    tok = g.op("Cast", [g.op("Gather", [g.const("token_table", (embed.astype(np.float32) @ fc[:, H:].T)
                                                .astype(np.float16)), INPUT_IDS], axis=0)], to=TensorProto.FLOAT)
    x = g.op("Add", [g.op("Add", [g.op("MatMul", [EAGLE_FEATURES, f32("fc_f_t", fc[:, :H].T)]), tok]),
                     f32("fc_b", w["fc.bias"])])
    eps, two, axes = f32("eps", np.array(S.rms_eps)), f32("two", np.array(2.0)), i64("axes", [-1])

    def rmsnorm(v: str, weight: str) -> str:
        var = g.op("ReduceMean", [g.op("Pow", [v, two]), axes], keepdims=1)
        return g.op("Mul", [g.op("Div", [v, g.op("Sqrt", [g.op("Add", [var, eps])])]), f32(weight, w[weight])])

    qkv_t = np.concatenate([w["q.weight"], w["k.weight"], w["v.weight"]], 0).T
    qkv = g.op("MatMul", [rmsnorm(x, "norm1.weight"), f32("qkv_t", qkv_t)])
    qkv4 = g.op("Transpose", [g.op("Reshape", [qkv, i64("shape_qkv", [0, 0, n + 2 * kv, D])])], perm=[0, 2, 1, 3])
    qk, v4 = g.op("Split", [qkv4, i64("split_qk_v", [n + kv, kv])], n_out=2, axis=1)
    inv = 1.0 / (S.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    ang = np.arange(C, dtype=np.float64)[:, None] * inv
    rot = g.op("RotaryEmbedding", [qk, f32("cos", np.cos(ang)), f32("sin", np.sin(ang)), POSITION_IDS])
    q4, k4 = g.op("Split", [rot, i64("split_q_k", [n, kv])], n_out=2, axis=1)
    g.op("TensorScatter", [past_name(0, "key"), k4, WRITE_INDICES], axis=-2, name=present_name(0, "key"))
    g.op("TensorScatter", [past_name(0, "value"), v4, WRITE_INDICES], axis=-2, name=present_name(0, "value"))
    att = g.op("Attention", [q4, present_name(0, "key"), present_name(0, "value"), ATTENTION_MASK])
    att = g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), i64("shape_out", [0, 0, n * D])])
    x = g.op("Add", [x, g.op("MatMul", [att, f32("o_t", w["o.weight"].T)])])
    gu_t = np.concatenate([w["gate.weight"], w["up.weight"]], 0).T
    gate, up = g.op("Split", [g.op("MatMul", [rmsnorm(x, "norm2.weight"), f32("gate_up_t", gu_t)]),
                              i64("split_gu", [S.intermediate] * 2)], n_out=2, axis=2)
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    g.op("Add", [x, g.op("MatMul", [act, f32("down_t", w["down.weight"].T)])], name=HIDDEN_STATES)
    logp = g.op("LogSoftmax", [g.op("MatMul", [HIDDEN_STATES, f32("readout_t", lm_head[vocab].T)])], axis=-1)
    g.op("TopK", [logp, i64("k", [topk])], n_out=2, axis=-1, name="topk")
    g.nodes[-1].output[:] = [EAGLE_LOGPROBS, "topk_idx"]
    g.op("Gather", [g.const("vocab", vocab), "topk_idx"], axis=0, name=EAGLE_TOKENS)

    inputs, outputs = _io(H, kv, D, topk)
    g.close()
    graph = helper.make_graph(g.nodes, "specrt_eagle_head", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, producer_name="specrt", opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.save_model(model, str(out))
    return {"hidden_size": H, "num_kv_heads": kv, "head_dim": D, "capacity": C, "topk": topk,
            "draft_vocab": int(len(vocab)), "eagle_format": EAGLE_FORMAT, "report": report}


def _io(H: int, kv: int, D: int, topk: int) -> tuple[list, list]:
    """The head engine's inputs and outputs (specrt/interface.py), the cache's capacity symbolic: the runtime's
    layout follows the context."""
    from onnx import TensorProto, helper

    from ..interface import EAGLE_INPUTS, EAGLE_OUTPUTS, past_name, present_name

    dims = {"hidden_size": H, "topk": topk, "batch": 1}
    types = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64}
    inputs = [helper.make_tensor_value_info(name, types[t], [dims.get(d, d) for d in shape])
              for name, shape, t in EAGLE_INPUTS]
    outputs = [helper.make_tensor_value_info(name, types[t], [dims.get(d, d) for d in shape])
               for name, shape, t in EAGLE_OUTPUTS]
    cache = [1, kv, "capacity", D]
    for kind in ("key", "value"):
        inputs.append(helper.make_tensor_value_info(past_name(0, kind), TensorProto.FLOAT, cache))
        outputs.append(helper.make_tensor_value_info(present_name(0, kind), TensorProto.FLOAT, cache))
    return inputs, outputs
