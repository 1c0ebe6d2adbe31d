"""Training and evaluation data for EAGLE heads: token sequences with the target's features at every position.

A feature is the target's final-norm hidden state (what its lm_head reads, and what the target engine returns as
`hidden_states`). One teacher-forced forward pass gives the features of every position of a sequence at once, so
most of the data is packaged text read by the target (stdlib source code and the pydoc topics' prose); the rest
is the target's own greedy answers to chat prompts (MT-bench questions the benchmark does not ask, prompts made
from stdlib docstrings), the text drafting meets at run time. The evaluation set is the benchmark's own prompts
(bench/data/default.jsonl) answered greedily by the target, never trained on. The dataset file's arrays:
More: docs/design-notes.md, "Module notes: export/train/eagle_data.py".
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...corpora import code_texts, doc_prompts, heldout_mtbench_ids, mtbench_questions

DATA_FORMAT = 1


def fuse_layers(num_layers: int) -> tuple[int, int]:
    """EAGLE-3's low and middle layers (its third, high feature is the final-norm feature): the outputs of decoder
    layers 2 and num_layers // 2, as the next layer's input norm reads them."""
    return 2, num_layers // 2


@dataclass(frozen=True)
class EagleDataConfig:
    max_new_tokens: int = 128
    doc_prompts: int = 240
    mtbench: bool = True
    code_chunks: int = 240
    prose_chunks: int = 240
    text_tokens: int = 384       # teacher-forced chunks are cut to this many tokens
    batch: int = 24
    seed: int = 0
    limit: int = 0               # keep at most this many chat prompts (0 = all; smoke tests use a few)
    layer_features: bool = False  # also keep EAGLE-3's low and middle features (for EagleTrainConfig.fuse)


def _prose_texts(n: int, rng: np.random.Generator) -> list[str]:
    """English prose from the Python docs shipped with the interpreter (pydoc_data.topics)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    chunks = [text[i: i + 1600] for i in range(0, len(text) - 1600, 1600)]
    return [chunks[j] for j in rng.permutation(len(chunks))[:n]]


def _chat_prompts(cfg: EagleDataConfig, rng: np.random.Generator) -> list[str]:
    held = set(heldout_mtbench_ids())
    prompts = [t for qid, t in mtbench_questions() if qid not in held] if cfg.mtbench else []
    prompts += doc_prompts(cfg.doc_prompts, rng)
    return prompts[: cfg.limit or None]


def _key(src, cfg, what: str) -> str:
    from ..sources import fingerprint

    facts = asdict(cfg)
    if not cfg.layer_features:  # the data without them is what format 1 always was: keep its caches valid
        del facts["layer_features"]
    return hashlib.sha256(json.dumps([fingerprint(src), facts, what, DATA_FORMAT]).encode()).hexdigest()[:16]


def build_train_set(src, cache: Path, cfg: EagleDataConfig = EagleDataConfig(), log=print) -> Path:
    """Generate (or reuse) the training set at cache/eagle-train-<key>.npz."""
    path = cache / f"eagle-train-{_key(src, cfg, 'train')}.npz"
    if path.is_file():
        log(f"EAGLE training data cached: {path}")
        return path
    from ..sources import load

    model, tok = load(src)
    rng = np.random.default_rng(cfg.seed)
    seqs: list[tuple[list[int], int, str]] = []
    t0 = time.time()
    chats = [[{"role": "user", "content": t}] for t in _chat_prompts(cfg, rng)]
    for ids, p in _answers(model, tok, chats, cfg.max_new_tokens, cfg.batch, log, t0):
        seqs.append((ids, p, "chat"))
    for kind, texts in (("code", code_texts(cfg.code_chunks, rng)), ("prose", _prose_texts(cfg.prose_chunks, rng))):
        for text in texts:
            ids = tok(text, add_special_tokens=False)["input_ids"][: cfg.text_tokens]
            if len(ids) > 8:
                seqs.append((ids, 0, kind))
    return _save(model, seqs, path, log, t0, cfg.layer_features)


def build_eval_set(src, cache: Path, prompts_file: Path, max_new_tokens: int = 128, batch: int = 24,
                   log=print, layer_features: bool = False) -> Path:
    """The benchmark's prompts answered greedily by the target (cache/eagle-eval-<key>.npz), kind = category."""
    rows = [json.loads(ln) for ln in Path(prompts_file).read_text().splitlines() if ln.startswith("{")]
    cfg = {"file": hashlib.sha256(Path(prompts_file).read_bytes()).hexdigest()[:16], "new": max_new_tokens}
    path = cache / f"eagle-eval-{_key(src, EagleDataConfig(layer_features=layer_features), json.dumps(cfg))}.npz"
    if path.is_file():
        log(f"EAGLE evaluation data cached: {path}")
        return path
    from ..sources import load

    model, tok = load(src)
    t0 = time.time()
    answers = _answers(model, tok, [r["messages"] for r in rows], max_new_tokens, batch, log, t0)
    return _save(model, [(ids, p, r["category"]) for (ids, p), r in zip(answers, rows)], path, log, t0,
                 layer_features)


def _answers(model, tok, chats: list[list[dict]], max_new_tokens: int, batch: int, log,
             t0) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer token ids, prompt length) per chat, in order (batched generate, left padded)."""
    import torch

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    eos = set(np.atleast_1d(model.generation_config.eos_token_id or tok.eos_token_id).tolist())
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths: little padding
    out: dict[int, tuple[list[int], int]] = {}
    for b in range(0, len(order), batch):
        part = order[b: b + batch]
        enc = tok([texts[i] for i in part], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            rows = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
        P = enc["input_ids"].shape[1]
        for i, row in zip(part, rows.tolist()):
            ids = tok(texts[i], add_special_tokens=False)["input_ids"]
            gen = row[P:]
            cut = next((k + 1 for k, x in enumerate(gen) if x in eos), len(gen))
            out[i] = (ids + gen[:cut], len(ids))
        log(f"answers {len(out)}/{len(texts)}, {time.time() - t0:.0f}s")
    return [out[i] for i in range(len(texts))]


def _save(model, seqs, path: Path, log, t0, layer_features: bool = False) -> Path:
    """Teacher-forced features and argmax labels of every sequence; written atomically."""
    import torch

    feats, labels, layer_feats = [], [], []
    layers = model.model.layers
    fused = fuse_layers(len(layers))
    with torch.no_grad():
        for i, (ids, _, _) in enumerate(seqs):
            out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=layer_features)
            h = out.last_hidden_state[0]
            feats.append(h.numpy().astype(np.float16))
            if layer_features:  # hidden_states[j + 1] is decoder layer j's output; layer j + 1's input norm reads it
                layer_feats.append(np.stack([layers[j + 1].input_layernorm(out.hidden_states[j + 1][0]).numpy()
                                             for j in fused], 1).astype(np.float16))
            labels.append(model.lm_head(h).argmax(-1).numpy().astype(np.int32))
            if (i + 1) % 100 == 0:
                log(f"features {i + 1}/{len(seqs)} sequences, {time.time() - t0:.0f}s")
    lengths = [len(ids) for ids, _, _ in seqs]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.npz")
    np.savez(tmp, tokens=np.concatenate([np.asarray(ids, np.int32) for ids, _, _ in seqs]),
             starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
             prompt=np.array([p for _, p, _ in seqs], np.int32), features=np.concatenate(feats),
             labels=np.concatenate(labels), kind=np.array([k for _, _, k in seqs]),
             **({"layer_features": np.concatenate(layer_feats)} if layer_features else {}))
    tmp.rename(path)
    log(f"{len(seqs)} sequences, {sum(lengths)} positions -> {path} ({time.time() - t0:.0f}s)")
    return path


def load_set(path: Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}
