"""Medusa-1 heads: train on self-distillation data (target frozen), evaluate, save, export to ONNX.

Head k (k = 1..K) reads the target's final-norm hidden state h_t and guesses the token k places
past the target's own next token:   logits_k = E_sub · (x + W2_k · SiLU(W1_k · x + b1_k) + b2_k)

with x = h (Medusa-1, `token_input=False`) or x = h + A · e(y_t) (default): e(y_t) is the lm_head
row of the target's next token y_t, which is already decided when the heads run (it is the token
the verification pass just emitted), so the heads need not guess it again. One shared H x H matrix
lifts held-out head-1 top-1 well above plain Medusa-1 (figures in heads/README.md).

E_sub are rows of the target's lm_head, shared and frozen: a full lm_head copy per head would cost
memory and time every token (docs/design-notes.md, "Medusa heads share the lm_head"). The heads score
only a reduced vocabulary, the `vocab` most frequent target choices in the training data: on CPU the
lm_head product dominates both training and drafting, and tokens the target rarely emits are rarely
worth a tree node (coverage and accuracy are reported per size). W2 starts at zero, so training starts
from "every head guesses the next token" instead of noise.

Training is bounded (a wall-clock budget, stop early at `max_epochs`), prints progress, saves a
resumable checkpoint (heads + optimizer + step) every `ckpt_seconds`, and ends with a held-out
accuracy table per head: top-1, top-5 and the accuracy of each rank (which shapes the tree).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import SpecrtError
from ..interface import HEADS_CANDIDATES, HEADS_HIDDEN, HEADS_SCORES, HEADS_TOKEN
from .medusa_tree import tree_order

HEADS_FORMAT = 1
# the heads engine's graph (3: only the heads the tree reads; 2 had a probs output, not kept); in engine sets' build key
HEADS_ENGINE = 3


@dataclass(frozen=True)
class TrainConfig:
    vocab: int = 4096            # reduced vocabulary size (0 = the full vocabulary)
    batch: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_epochs: int = 4
    budget_s: float = 1500.0     # wall-clock training budget
    stop_step: int = 0           # stop (checkpointed, resumable) at this step; 0 = run to the end
    ckpt_seconds: float = 60.0
    head_decay: float = 0.8      # loss weight of head k: decay ** (k - 1) (Medusa)
    ranks: int = 10              # per-rank held-out accuracy for ranks < this
    seed: int = 0
    threads: int = 0             # torch threads (0 = torch's default)
    token_input: bool = True     # heads also read the pending token (see the module docstring)


def _torch_heads(K: int, H: int, token_input: bool):
    import torch

    class MedusaHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(K, H, H) / math.sqrt(H))
            self.b1 = torch.nn.Parameter(torch.zeros(K, 1, H))
            self.w2 = torch.nn.Parameter(torch.zeros(K, H, H))
            self.b2 = torch.nn.Parameter(torch.zeros(K, 1, H))
            self.a = torch.nn.Parameter(torch.zeros(H, H)) if token_input else None

        def forward(self, h, e=None):  # h [B, H], e [B, H] pending-token embedding -> [K, B, H]
            x = (h if self.a is None else h + e @ self.a).unsqueeze(0)
            return x + torch.nn.functional.silu(x @ self.w1 + self.b1) @ self.w2 + self.b2

    return MedusaHeads()


def train_heads(data_paths: Path | list[Path], lm_head: np.ndarray, out: Path, cfg: TrainConfig = TrainConfig(),
                log=print) -> dict:
    """Train on the dataset file(s) with the target's lm_head [V, H]; write out/heads.npz and
    out/report.json; resume from out/ckpt.pt when it exists. Returns the report."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    paths = [Path(p) for p in (data_paths if isinstance(data_paths, (list, tuple)) else [data_paths])]
    parts = [np.load(p) for p in paths]
    hidden = np.concatenate([d["hidden"] for d in parts])
    labels = np.concatenate([d["labels"] for d in parts]).astype(np.int64)
    held = np.concatenate([d["heldout"] for d in parts])
    data_path = ",".join(str(p) for p in paths)
    N, K = labels.shape
    # the pending token at t (the target's choice after t) is head 1's label at t - 1; a sequence's
    # first position has none (boundaries are safe: a sequence's last rows have no head-1 label)
    pending = np.concatenate([[-1], labels[:-1, 0]])
    usable = (labels >= 0).any(1) & ((pending >= 0) | (not cfg.token_input))
    V, H = lm_head.shape
    if hidden.shape[1] != H:
        raise SpecrtError(f"dataset hidden size {hidden.shape[1]} != lm_head {H}; rebuild the dataset for this target")
    vocab = _pick_vocab(labels[~held], V, cfg.vocab)
    sub = np.full(V + 1, -1, np.int64)          # full id -> subset index (-1 = not scored); sub[-1] for label -1
    sub[vocab] = np.arange(len(vocab))
    tr = np.flatnonzero(~held & usable)
    ev = np.flatnonzero(held & usable)
    if len(tr) < cfg.batch:
        raise SpecrtError(f"only {len(tr)} training positions; generate more data (more prompts or tokens)")
    coverage = float((sub[labels[ev]] >= 0).sum() / max(1, (labels[ev] >= 0).sum()))
    log(f"{len(tr)} train / {len(ev)} held-out positions, {K} heads, vocab {len(vocab)}/{V} "
        f"(held-out label coverage {coverage:.1%})")
    E = torch.from_numpy(np.ascontiguousarray(lm_head[vocab], np.float32))
    emb = torch.from_numpy(np.ascontiguousarray(lm_head, np.float32))   # pending-token features (frozen)
    pend = torch.from_numpy(np.maximum(pending, 0))
    heads = _torch_heads(K, H, cfg.token_input)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(tr) // cfg.batch
    total = steps_per_epoch * cfg.max_epochs
    state = {"step": 0, "elapsed": 0.0, "losses": []}
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt.pt"
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        if _trajectory(saved["config"]) != _trajectory(asdict(cfg)) or saved["data"] != str(data_path):
            raise SpecrtError(f"checkpoint {ckpt} is from another config or dataset; delete it to start over")
        heads.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"resumed at step {state['step']}/{total} ({state['elapsed']:.0f}s trained)")
    w = torch.tensor([cfg.head_decay ** k for k in range(K)])
    lab = torch.from_numpy(sub[labels])          # [N, K] subset indices, -1 = ignore
    hid = torch.from_numpy(hidden)
    t_start, t_ckpt = time.time() - state["elapsed"], time.time()
    step = state["step"]
    end = min(total, cfg.stop_step or total)
    try:
        while step < end and time.time() - t_start < cfg.budget_s:
            epoch, i = divmod(step, steps_per_epoch)
            perm = np.random.default_rng(cfg.seed + epoch).permutation(tr)  # same order after a resume
            idx = perm[i * cfg.batch: (i + 1) * cfg.batch]
            for g in opt.param_groups:  # cosine decay after a short warmup
                g["lr"] = cfg.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / total))
            z = heads(hid[idx].float(), emb[pend[idx]]) @ E.T        # [K, B, V']
            y = lab[idx].T                                           # [K, B]
            ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-1,
                                                   reduction="none").view(K, -1)
            valid = (y >= 0).float()
            loss = ((ce * valid).sum(1) / valid.sum(1).clamp(min=1) * w).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            state["step"] = step              # what a Ctrl-C checkpoint resumes from
            state["losses"].append(round(loss.item(), 4))
            now = time.time()
            if step % 25 == 0 or step == total:
                el = now - t_start
                eta = min(cfg.budget_s - el, el / step * (total - step) if step > state.get("resumed_at", 0) else 0)
                log(f"step {step}/{total} epoch {epoch + 1} loss {np.mean(state['losses'][-25:]):.3f} "
                    f"{el:.0f}s elapsed, ~{max(eta, 0):.0f}s left")
            if now - t_ckpt > cfg.ckpt_seconds or step == total:
                state.update(step=step, elapsed=now - t_start)
                _save_ckpt(ckpt, heads, opt, state, cfg, data_path)
                t_ckpt = now
    except KeyboardInterrupt:  # keep what was trained: the next run resumes here, not at the last minute's checkpoint
        state.update(elapsed=time.time() - t_start)
        _save_ckpt(ckpt, heads, opt, state, cfg, data_path)
        log(f"interrupted: checkpoint saved at step {state['step']}; run the same command again to resume")
        raise
    state.update(step=step, elapsed=time.time() - t_start)
    _save_ckpt(ckpt, heads, opt, state, cfg, data_path)
    acc = evaluate(heads, hid[ev], emb[pend[ev]], labels[ev], E, vocab, cfg.ranks)
    report = {"format": HEADS_FORMAT, "heads": K, "hidden_size": H, "vocab_size": V, "vocab_subset": len(vocab),
              "heldout_label_coverage": round(coverage, 4), "train_positions": int(len(tr)),
              "heldout_positions": int(len(ev)), "steps": step, "epochs": round(step / steps_per_epoch, 2),
              "train_seconds": round(state["elapsed"], 1),
              "final_loss": float(np.mean(state["losses"][-50:] or [np.nan])),
              "first_loss": float(np.mean(state["losses"][:25] or [np.nan])), "config": asdict(cfg), **acc}
    save_heads(out / "heads.npz", heads, vocab, report)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    log(format_report(report))
    return report


def _trajectory(cfg: dict) -> dict:
    """The settings a resumed run must share (budget, stop step, checkpoint period and threads may change)."""
    return {k: v for k, v in cfg.items() if k not in ("budget_s", "stop_step", "ckpt_seconds", "threads")}


def _pick_vocab(train_labels: np.ndarray, V: int, size: int) -> np.ndarray:
    if size <= 0 or size >= V:
        return np.arange(V, dtype=np.int64)
    counts = np.bincount(train_labels[train_labels >= 0], minlength=V)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


def _save_ckpt(path: Path, heads, opt, state: dict, cfg: TrainConfig, data_path: Path) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "state": state, "config": asdict(cfg),
                "data": str(data_path)}, tmp)
    tmp.replace(path)


def evaluate(heads, hid, emb, labels: np.ndarray, E, vocab: np.ndarray, ranks: int) -> dict:
    """Held-out accuracy per head: top1, top5, rank_acc[k][r] = P(rank r is the label), and the
    tree order: nodes in the order a greedy tree builder adds them, each with its empirical value
    P(every head on its path is right at its rank), measured jointly on the same positions (heads
    are far from independent: when head 1 is right, head 2 is right more often)."""
    import torch

    K = labels.shape[1]
    label_rank = np.full(labels.shape, ranks, np.int64)   # [N, K] rank of the label, `ranks` = not in top
    with torch.no_grad():
        for s in range(0, len(labels), 1024):
            top = (heads(hid[s: s + 1024].float(), emb[s: s + 1024]) @ E.T).topk(ranks, dim=-1).indices.numpy()
            hit = vocab[top] == labels[s: s + 1024].T[..., None]
            label_rank[s: s + 1024] = np.where(hit.any(-1), hit.argmax(-1), ranks).T
    valid = labels >= 0
    rank_acc = np.stack([np.bincount(label_rank[valid[:, k], k], minlength=ranks + 1)[:ranks]
                         / max(1, valid[:, k].sum()) for k in range(K)])
    order, values = tree_order(label_rank, ranks)
    return {"top1": np.round(rank_acc[:, 0], 4).tolist(), "top5": np.round(rank_acc[:, :5].sum(1), 4).tolist(),
            "rank_acc": np.round(rank_acc, 4).tolist(), "tree_order": [list(p) for p in order],
            "tree_values": np.round(values, 5).tolist()}


def format_report(r: dict) -> str:
    rows = [f"head {k + 1}: top-1 {a:.1%}  top-5 {b:.1%}" for k, (a, b) in enumerate(zip(r["top1"], r["top5"]))]
    return (f"held-out accuracy ({r['heldout_positions']} positions, vocab {r['vocab_subset']}, "
            f"coverage {r['heldout_label_coverage']:.1%}, loss {r['first_loss']:.2f} -> {r['final_loss']:.2f}, "
            f"{r['train_seconds']:.0f}s):\n  " + "\n  ".join(rows))


def save_heads(path: Path, heads, vocab: np.ndarray, report: dict) -> None:
    """Heads file: float16 weights (x @ w layout), the vocabulary subset, the report as JSON."""
    sd = {k: v.detach().numpy() for k, v in heads.state_dict().items()}
    extra = {"a": sd["a"].astype(np.float16)} if "a" in sd else {}
    np.savez(path, w1=sd["w1"].astype(np.float16), b1=sd["b1"][:, 0].astype(np.float16),
             w2=sd["w2"].astype(np.float16), b2=sd["b2"][:, 0].astype(np.float16),
             vocab=vocab.astype(np.int32), report=json.dumps(report), **extra)


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
