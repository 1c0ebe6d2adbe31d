"""The reference backend: a small pre-norm decoder (RMSNorm, grouped-query attention with RoPE, SiLU MLP) in
numpy, float64 inside. It is the engine contract's executable spec, for tests: no ONNX Runtime, so the loop,
the proposers, trees and sampling are shown to run on any engine that honours runtime/engine.py, and their
exactness to hold there too.

Weights: one .npz per engine (`embed` [V, H], `lm_head` [H, V], `norm` [H]; per layer i `l{i}.norm1`,
`l{i}.wq` [H, heads*D], `l{i}.wk`/`l{i}.wv` [H, kv_heads*D], `l{i}.wo` [heads*D, H], `l{i}.norm2`,
`l{i}.w1` [H, F], `l{i}.w2` [F, H]); heads: `heads` [K, H, V], `topk` (scalar). `random_weights` makes them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ....errors import SpecrtError
from ...engine import ContextFullError, EngineOptions, KVSnapshot, restore_views, snapshot_views
from ..protocol import Runtime


def open_engine(root: Path, entry, options: EngineOptions = EngineOptions()) -> "ReferenceEngine":
    return ReferenceEngine(Path(root) / entry.file, num_heads=entry.num_heads, num_kv_heads=entry.num_kv_heads,
                           max_context=entry.max_context, width_exact=entry.width_exact, name=entry.name)


def open_heads(root: Path, entry, options: EngineOptions = EngineOptions()) -> "ReferenceHeads":
    return ReferenceHeads(Path(root) / entry.file)


RUNTIME = Runtime(single=open_engine, open_heads=open_heads)  # one stream only: no batch engine


def random_weights(seed: int, vocab: int, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                   sharpen: float = 8.0) -> dict[str, np.ndarray]:
    """Random decoder weights whose output depends on the whole context (a sharpened lm_head: a near-uniform
    random init would make every cache bug invisible)."""
    g = np.random.default_rng(seed)
    d = hidden // heads
    w = lambda *s: g.standard_normal(s) / np.sqrt(s[0])  # noqa: E731
    out = {"embed": g.standard_normal((vocab, hidden)), "lm_head": w(hidden, vocab) * sharpen, "norm": np.ones(hidden)}
    for i in range(layers):
        out |= {f"l{i}.norm1": np.ones(hidden), f"l{i}.wq": w(hidden, heads * d), f"l{i}.wk": w(hidden, kv_heads * d),
                f"l{i}.wv": w(hidden, kv_heads * d), f"l{i}.wo": w(heads * d, hidden), f"l{i}.norm2": np.ones(hidden),
                f"l{i}.w1": w(hidden, 2 * hidden), f"l{i}.w2": w(2 * hidden, hidden)}
    return out


def _rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * weight


def _rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [heads, n, D] rotated by positions [n] (rotate-half convention, base 10000)."""
    half = x.shape[-1] // 2
    angle = positions[:, None] * 10000.0 ** (-np.arange(half) / half)        # [n, D/2]
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class ReferenceEngine:
    max_pass_tokens = 64
    hidden_on_device = False  # hidden rows on the host only

    def __init__(self, path: Path, *, num_heads: int, num_kv_heads: int, max_context: int, width_exact: bool = True,
                 name: str = "reference"):
        try:
            with np.load(path) as f:
                self.w = {k: f[k].astype(np.float64) for k in f.files}
        except (OSError, ValueError) as e:
            raise SpecrtError(f"cannot load engine '{path}' ({e}); rebuild the engine set") from None
        self.vocab_size, hidden = self.w["embed"].shape
        self.layers = sum(1 for k in self.w if k.endswith(".wq"))
        self.heads, self.kv_heads = num_heads, num_kv_heads
        self.head_dim = self.w["l0.wq"].shape[1] // num_heads
        self.max_context, self.width_exact, self.name = max_context, width_exact, name
        self.description = f"reference {name}"
        self.screen = False  # argmax reads the full lm_head
        self.cache = np.zeros((self.layers, 2, num_kv_heads, max_context, self.head_dim))
        self.length, self.capacity = 0, max_context
        self.with_hidden = False
        self.hidden = np.zeros((0, hidden), np.float32)

    def reserve(self, positions: int) -> None:
        pass  # one layout of max_context positions

    def enable_hidden(self) -> None:
        self.with_hidden = True

    def argmax(self, tokens, positions=None, tree_mask=None, num_logits: int = 1) -> np.ndarray:
        return self.forward(tokens, positions, tree_mask, num_logits).argmax(axis=1)

    def forward(self, tokens, positions=None, tree_mask=None, num_logits: int = 1) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64)
        n, start = len(tokens), self.length
        if start + n > self.max_context:
            raise ContextFullError(f"context full: {start} + {n} tokens exceed max_context {self.max_context}; "
                                   "shorten the prompt or lower --max-new-tokens")
        if not 1 <= num_logits <= min(n, self.max_pass_tokens):
            raise ValueError(f"a pass returns 1..min(n, {self.max_pass_tokens}) logits, asked {num_logits} of {n}")
        pos = np.arange(start, start + n) if positions is None else np.asarray(positions, np.int64)
        mask = np.triu(np.full((n, n), -np.inf), 1)                           # causal among the new tokens
        if tree_mask is not None:
            mask = mask + np.asarray(tree_mask, np.float64).reshape(n, n)
        full = np.concatenate([np.zeros((n, start)), mask], axis=1)            # [n, start + n]: the cache is visible
        group, D, w = self.heads // self.kv_heads, self.head_dim, self.w
        x = w["embed"][tokens]
        for i in range(self.layers):
            h = _rms(x, w[f"l{i}.norm1"])
            q = _rope((h @ w[f"l{i}.wq"]).reshape(n, self.heads, D).transpose(1, 0, 2), pos)
            k = _rope((h @ w[f"l{i}.wk"]).reshape(n, self.kv_heads, D).transpose(1, 0, 2), pos)
            self.cache[i, 0, :, start:start + n] = k
            self.cache[i, 1, :, start:start + n] = (h @ w[f"l{i}.wv"]).reshape(n, self.kv_heads, D).transpose(1, 0, 2)
            keys = np.repeat(self.cache[i, 0, :, :start + n], group, axis=0)  # [heads, start + n, D]
            values = np.repeat(self.cache[i, 1, :, :start + n], group, axis=0)
            scores = q @ keys.transpose(0, 2, 1) / np.sqrt(D) + full
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            att = (scores / scores.sum(-1, keepdims=True)) @ values            # [heads, n, D]
            x = x + att.transpose(1, 0, 2).reshape(n, -1) @ w[f"l{i}.wo"]
            h = _rms(x, w[f"l{i}.norm2"]) @ w[f"l{i}.w1"]
            x = x + (h / (1.0 + np.exp(-h))) @ w[f"l{i}.w2"]
        out = _rms(x, w["norm"])
        if self.with_hidden:
            self.hidden = out.astype(np.float32)
        return (out[n - num_logits:] @ w["lm_head"]).astype(np.float32)

    def commit(self, n: int, path=None) -> None:
        if path is not None:
            src = self.length + np.asarray(path, np.int64)
            self.cache[:, :, :, self.length:self.length + n] = self.cache[:, :, :, src]
        self.length += n

    def rewind(self, length: int = 0) -> None:
        self.length = length

    def save_prefix(self, length: int) -> KVSnapshot:
        return snapshot_views([kind for layer in self.cache for kind in layer], min(length, self.length))

    def load_prefix(self, snapshot: KVSnapshot) -> None:
        restore_views([kind for layer in self.cache for kind in layer], snapshot)
        self.length = snapshot.length


class ReferenceHeads:
    """Medusa heads as plain linear maps of the hidden state: candidates[k] = top-k of hidden @ heads[k]."""

    on_device = False  # takes host rows (proposers/medusa.py, eagle.py)

    def __init__(self, path: Path):
        with np.load(path) as f:
            self.w, self.topk = f["heads"].astype(np.float64), int(f["topk"])
        self.heads = self.w.shape[0]

    def __call__(self, hidden: np.ndarray, token: int) -> np.ndarray:
        scores = np.einsum("h,khv->kv", np.asarray(hidden, np.float64), self.w)
        return np.argsort(-scores, axis=1, kind="stable")[:, : self.topk].astype(np.int64)
