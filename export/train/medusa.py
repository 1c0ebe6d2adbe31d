"""Training Medusa heads (export/medusa.py describes them) on self-distillation data, target frozen.

Training is bounded (a wall-clock budget, stop early at `max_epochs`), prints progress, saves a resumable
checkpoint (heads + optimizer + step) every `ckpt_seconds`, and ends with a held-out accuracy table per head:
top-1, top-5 and the accuracy of each rank (which shapes the tree).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...errors import SpecrtError
from ..medusa import HEADS_FORMAT
from ..medusa_tree import tree_order


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
    hidden, labels, held, pending, usable, data_path = _read(data_paths, cfg)
    K = labels.shape[1]
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
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt.pt"
    state = _resume(ckpt, heads, opt, cfg, data_path, total, log)
    w = torch.tensor([cfg.head_decay ** k for k in range(K)])
    lab = torch.from_numpy(sub[labels])          # [N, K] subset indices, -1 = ignore
    hid = torch.from_numpy(hidden)

    def loss_of(idx):  # each head's cross-entropy on its label, head k weighted head_decay ** (k - 1)
        z = heads(hid[idx].float(), emb[pend[idx]]) @ E.T        # [K, B, V']
        y = lab[idx].T                                           # [K, B]
        ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-1,
                                               reduction="none").view(K, -1)
        valid = (y >= 0).float()
        return ((ce * valid).sum(1) / valid.sum(1).clamp(min=1) * w).sum()

    step = _steps(opt, loss_of, tr, cfg, state, total, lambda: _save_ckpt(ckpt, heads, opt, state, cfg, data_path),
                  log)
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


def _read(data_paths: Path | list[Path], cfg: TrainConfig):
    """The dataset file(s) as training reads them: (hidden, labels, heldout, pending, usable, data_path)."""
    paths = [Path(p) for p in (data_paths if isinstance(data_paths, (list, tuple)) else [data_paths])]
    parts = [np.load(p) for p in paths]
    hidden = np.concatenate([d["hidden"] for d in parts])
    labels = np.concatenate([d["labels"] for d in parts]).astype(np.int64)
    held = np.concatenate([d["heldout"] for d in parts])
    # the pending token at t (the target's choice after t) is head 1's label at t - 1; a sequence's
    # first position has none (boundaries are safe: a sequence's last rows have no head-1 label)
    pending = np.concatenate([[-1], labels[:-1, 0]])
    usable = (labels >= 0).any(1) & ((pending >= 0) | (not cfg.token_input))
    return hidden, labels, held, pending, usable, ",".join(str(p) for p in paths)


def _resume(ckpt: Path, heads, opt, cfg: TrainConfig, data_path: str, total: int, log) -> dict:
    """The training state: a fresh one, or the checkpoint's (its heads and optimizer loaded) when there is one."""
    import torch

    if not ckpt.is_file():
        return {"step": 0, "elapsed": 0.0, "losses": []}
    saved = torch.load(ckpt, weights_only=False)
    if _trajectory(saved["config"]) != _trajectory(asdict(cfg)) or saved["data"] != str(data_path):
        raise SpecrtError(f"checkpoint {ckpt} is from another config or dataset; delete it to start over")
    heads.load_state_dict(saved["heads"])
    opt.load_state_dict(saved["opt"])
    state = saved["state"]
    log(f"resumed at step {state['step']}/{total} ({state['elapsed']:.0f}s trained)")
    return state


def _steps(opt, loss_of, tr: np.ndarray, cfg: TrainConfig, state: dict, total: int, save, log) -> int:
    """The optimizer steps from state["step"] until the budget, the stop step or `total`; a checkpoint (save())
    every ckpt_seconds, at the end and on Ctrl-C. Returns the last step; `state` holds the losses and time."""
    steps_per_epoch = len(tr) // cfg.batch
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
            loss = loss_of(idx)
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
                save()
                t_ckpt = now
    except KeyboardInterrupt:  # keep what was trained: the next run resumes here, not at the last minute's checkpoint
        state.update(elapsed=time.time() - t_start)
        save()
        log(f"interrupted: checkpoint saved at step {state['step']}; run the same command again to resume")
        raise
    state.update(step=step, elapsed=time.time() - t_start)
    save()
    return step


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
