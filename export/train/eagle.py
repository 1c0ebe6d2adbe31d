"""Training and evaluating an EAGLE head (export/eagle.py) on the CPU: teacher forcing on the target's own features,
EAGLE's loss (SmoothL1 on features plus w_cls times the cross-entropy against the target's distribution over the
reduced vocabulary), bounded, checkpointed and resumable; `evaluate` replays chain drafting as the runtime drafts.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..eagle import EAGLE_FORMAT, RESUMABLE, EagleTrainConfig, HeadShape, make_head, save_head


def pick_vocab(labels: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent target choices, sorted by token id (the draft vocabulary)."""
    counts = np.bincount(labels[labels >= 0], minlength=vocab_size)
    if size <= 0 or size >= vocab_size:
        return np.arange(vocab_size, dtype=np.int64)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


def _batches(starts: np.ndarray, batch_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Sequence indices grouped into batches of about batch_tokens positions (similar lengths together)."""
    lengths = np.diff(starts)
    order = np.argsort(lengths + rng.random(len(lengths)) * 8)
    batches, cur, longest = [], [], 0
    for s in order:
        longest = max(longest, int(lengths[s]))
        if cur and longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], int(lengths[s])
        cur.append(int(s))
    if cur:
        batches.append(cur)
    return [batches[i] for i in rng.permutation(len(batches))]


def _pad(data: dict, seqs: list[int], fuse: bool = False):
    """Right-padded torch tensors of a batch: tokens [B, T], features [B, T, H] float32 (fuse: [B, T, 3H], the
    low, middle and high features; the high third is the final-norm feature), mask [B, T] bool."""
    import torch

    st = data["starts"]
    T = max(int(st[s + 1] - st[s]) for s in seqs)
    B, H = len(seqs), data["features"].shape[1]
    if fuse and "layer_features" not in data:
        raise ValueError("this EAGLE data set has no low and middle layer features; regenerate it "
                         "(delete its file under --work)")
    tok = np.zeros((B, T), np.int64)
    feat = np.zeros((B, T, 3 * H if fuse else H), np.float32)
    mask = np.zeros((B, T), bool)
    for b, s in enumerate(seqs):
        a, e = int(st[s]), int(st[s + 1])
        tok[b, : e - a], mask[b, : e - a] = data["tokens"][a:e], True
        feat[b, : e - a, -H:] = data["features"][a:e]
        if fuse:
            feat[b, : e - a, : 2 * H] = data["layer_features"][a:e].reshape(e - a, 2 * H)
    return torch.from_numpy(tok), torch.from_numpy(feat), torch.from_numpy(mask)


def train(data: dict, embed: np.ndarray, lm_head: np.ndarray, shape: HeadShape, out: Path,
          cfg: EagleTrainConfig = EagleTrainConfig(), heldout: dict | None = None, log=print,
          extra: dict | None = None) -> dict:
    """Train a head on a training set (eagle_data.load_set); embed [V, H] and lm_head [V, H] are the target's.
    Resumes from out's checkpoint (out.with_suffix('.ckpt')) when its config matches. Returns the report (with
    `extra`'s entries, e.g. the target's source hash)."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    vocab = pick_vocab(data["labels"], lm_head.shape[0], cfg.vocab)
    W = torch.from_numpy(np.ascontiguousarray(lm_head[vocab], np.float32))            # [Vd, H], frozen
    E = torch.from_numpy(np.ascontiguousarray(embed, np.float32))                     # [V, H], frozen
    head = make_head(shape, cfg.fuse)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    feat_std = float(data["features"][:: max(1, len(data["features"]) // 20000)].astype(np.float32).std())
    ckpt = out.with_suffix(".ckpt")
    state = {"step": 0, "epoch": 0, "elapsed": 0.0, "losses": []}
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        same = lambda c: {k: v for k, v in c.items() if k not in RESUMABLE}  # noqa: E731
        if same(saved["cfg"]) == same(asdict(cfg)) and saved["shape"] == asdict(shape):
            head.load_state_dict(saved["head"])
            opt.load_state_dict(saved["opt"])
            state = saved["state"]
            log(f"resumed at step {state['step']} (epoch {state['epoch']})")
    per_epoch = len(_batches(data["starts"], cfg.batch_tokens, np.random.default_rng(0)))
    total = per_epoch * cfg.max_epochs
    t0, last_ckpt = time.time() - state["elapsed"], time.time()
    done = False
    while state["epoch"] < cfg.max_epochs and not done:
        batches = _batches(data["starts"], cfg.batch_tokens, np.random.default_rng(cfg.seed + state["epoch"]))
        for bi in range(state["step"] % per_epoch, len(batches)):
            tok, feat, mask = _pad(data, batches[bi], cfg.fuse)
            warm, left = min(1.0, (state["step"] + 1) / 50), min(1.0, state["step"] / total)
            lr = cfg.lr * warm * 0.5 * (1 + math.cos(math.pi * left))
            for g in opt.param_groups:
                g["lr"] = lr
            reg, cls = chain_loss(head, tok, feat, mask, E, W, cfg, feat_std, shape.hidden)
            loss = reg + cfg.w_cls * cls
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            state["step"] += 1
            state["losses"].append([round(reg.item(), 5), round(cls.item(), 4)])
            if state["step"] % 50 == 0:
                r = np.mean(state["losses"][-50:], axis=0)
                log(f"epoch {state['epoch'] + 1} step {state['step']}/{total}: reg {r[0]:.4f} cls {r[1]:.3f} "
                    f"lr {lr:.2e}, {time.time() - t0:.0f}s")
            if time.time() - last_ckpt > cfg.ckpt_seconds:
                _checkpoint(ckpt, head, opt, state, cfg, shape, t0)
                last_ckpt = time.time()
            if time.time() - t0 > cfg.budget_s:
                done = True
                break
        else:
            state["epoch"] += 1
    _checkpoint(ckpt, head, opt, state, cfg, shape, t0)
    report = {"format": EAGLE_FORMAT, "config": asdict(cfg), "shape": asdict(shape), "steps": state["step"],
              "epochs": state["epoch"] + (0 if not done else state["step"] % per_epoch / per_epoch),
              "train_s": round(time.time() - t0, 1), "positions": int(len(data["tokens"])), **(extra or {})}
    if heldout is not None:
        report["heldout"] = evaluate(head, heldout, embed, lm_head, vocab)
    save_head(out, head, vocab, report)
    return report


def chain_loss(head, tok, feat, mask, E, W, cfg: EagleTrainConfig, feat_std: float, hidden: int):
    """EAGLE's two losses of a batch (means over its real items), averaged over cfg.ttt_steps chained steps.

    Item m (context x_0..x_{m+1}) first predicts the feature at m + 1 from the real inputs (noised by cfg.noise);
    at step j it has drafted j tokens and predicts the feature at m + 1 + j from its own previous prediction and
    the true token x_{m+1+j} (training-time test), attending as the runtime's drafts do. Items whose step j runs
    past the sequence do not count."""
    import torch

    x_in = feat[:, :-1]
    if cfg.noise:
        x_in = x_in + (torch.rand_like(x_in) - 0.5) * (cfg.noise * feat_std)
    T = tok.shape[1] - 1
    pos = torch.arange(T).expand(tok.shape[0], -1)
    high = feat[..., -hidden:]
    pred, real = head(x_in, E[tok[:, 1:]], pos)
    reg = cls = 0.0
    own = []
    for j in range(cfg.ttt_steps):
        if j:
            nxt = torch.zeros_like(tok[:, 1:])
            nxt[:, : T - j] = tok[:, 1 + j:]
            pred, kv = head.step(pred, E[nxt], pos + j, real, own)
            own.append(kv)
        m = torch.zeros_like(mask[:, 1:])
        m[:, : T - j] = mask[:, 1 + j:]
        target = torch.zeros_like(high[:, 1:])
        target[:, : T - j] = high[:, 1 + j:]
        reg = reg + torch.nn.functional.smooth_l1_loss(pred[m], target[m]) / cfg.ttt_steps
        with torch.no_grad():
            p_t = torch.softmax(target[m] @ W.T, -1)
        cls = cls - (p_t * torch.log_softmax(pred[m] @ W.T, -1)).sum(-1).mean() / cfg.ttt_steps
    return reg, cls


def _checkpoint(path: Path, head, opt, state: dict, cfg, shape, t0) -> None:
    import torch

    state["elapsed"] = time.time() - t0
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state, "cfg": asdict(cfg),
                "shape": asdict(shape)}, tmp)
    tmp.rename(path)


def evaluate(head, data: dict, embed: np.ndarray, lm_head: np.ndarray, vocab: np.ndarray, depth: int = 6,
             answers_only: bool = True) -> dict:
    """Chain drafting replayed on the target's own greedy answers (an eval set from eagle_data.build_eval_set):
    at every answer position, draft `depth` tokens as the runtime would and count how many the target keeps.
    Returns, overall and per kind: acceptance by position (P(token k right | all before right)), the tokens per
    round of a chain of each depth (1 + expected accepted), and the first token's top-1 accuracy."""
    import torch

    W = torch.from_numpy(np.ascontiguousarray(lm_head[vocab], np.float32))
    E = torch.from_numpy(np.ascontiguousarray(embed, np.float32))
    vocab_t = torch.from_numpy(vocab)
    st, kinds = data["starts"], data["kind"]
    runs: dict[str, list[np.ndarray]] = {}
    with torch.no_grad():
        for s in range(len(st) - 1):
            tok, feat, _ = _pad(data, [s], head.fused)
            T = tok.shape[1]
            if T < 3:
                continue
            pos = torch.arange(T - 1)[None]
            pred, real = head(feat[:, :-1], E[tok[:, 1:]], pos)  # item m: context x_0..x_{m+1}, guesses x_{m+2}
            guesses, own = [], []
            for k in range(depth):
                d = vocab_t[(pred @ W.T).argmax(-1)]           # [1, T - 1] drafted token k + 1 of every item
                guesses.append(d[0].numpy())
                if k + 1 < depth:
                    pred, kv = head.step(pred, E[d], pos + k + 1, real, own)
                    own.append(kv)
            x = tok[0].numpy()
            first = max(int(data["prompt"][s]) - 1, 0) if answers_only else 0
            m = np.arange(first, T - 2)  # items whose first guess has a true token to meet
            right = np.zeros((len(m), depth), bool)
            for k in range(depth):
                idx = m + 2 + k
                ok = idx < T
                right[ok, k] = guesses[k][m[ok]] == x[idx[ok]]
            runs.setdefault(str(kinds[s]), []).append(np.cumprod(right, axis=1).astype(bool))
    out = {}
    for kind, parts in sorted(runs.items()) + [("all", [p for ps in runs.values() for p in ps])]:
        r = np.concatenate(parts)
        kept = r.sum(0)
        reached = np.concatenate([[len(r)], kept[:-1]])
        out[kind] = {"positions": int(len(r)), "first_top1": round(float(kept[0] / max(len(r), 1)), 4),
                     "acceptance_by_position": [round(float(a / max(b, 1)), 4) for a, b in zip(kept, reached)],
                     "tau_by_depth": [round(1 + float(r[:, :d].sum(1).mean()), 4) for d in range(1, depth + 1)]}
    return out
