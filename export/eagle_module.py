"""The EAGLE head as a torch module (export/eagle.py's make_head builds it; torch loads only with this module)."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Head(nn.Module):
    """export/eagle.py's make_head: the layer over [feature ; token embedding], its rollout step for training.
    shape: export/eagle.py's HeadShape (not imported here: eagle.py imports this module)."""

    def __init__(self, shape, fuse: bool = False):
        super().__init__()
        S = self.S = shape
        self.group = S.heads // S.kv_heads
        self.fc = nn.Linear(2 * S.hidden, S.hidden)
        self.fused = fuse
        if fuse:
            self.fuse = nn.Linear(3 * S.hidden, S.hidden)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, 2 * S.hidden:] = torch.eye(S.hidden)
                self.fuse.bias.zero_()
        self.norm1, self.norm2 = RMSNorm(S.hidden, S.rms_eps), RMSNorm(S.hidden, S.rms_eps)
        self.q = nn.Linear(S.hidden, S.heads * S.head_dim, bias=False)
        self.k = nn.Linear(S.hidden, S.kv_heads * S.head_dim, bias=False)
        self.v = nn.Linear(S.hidden, S.kv_heads * S.head_dim, bias=False)
        self.o = nn.Linear(S.heads * S.head_dim, S.hidden, bias=False)
        self.gate = nn.Linear(S.hidden, S.intermediate, bias=False)
        self.up = nn.Linear(S.hidden, S.intermediate, bias=False)
        self.down = nn.Linear(S.intermediate, S.hidden, bias=False)
        inv = 1.0 / (S.rope_theta ** (torch.arange(0, S.head_dim, 2, dtype=torch.float32) / S.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x, pos):  # x [B, h, T, D], pos [B, T]
        ang = pos[:, None, :, None].float() * self.inv_freq
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        half = self.S.head_dim // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def project(self, feat, emb, pos):
        """-> residual x [B, T, H] and q [B, heads, T, D], k, v [B, heads, T, D] (kv heads repeated)."""
        B, T, _ = feat.shape
        x = self.fc(torch.cat([feat, emb], -1))
        h = self.norm1(x)
        q = self._rope(self.q(h).view(B, T, self.S.heads, self.S.head_dim).transpose(1, 2), pos)
        k = self._rope(self.k(h).view(B, T, self.S.kv_heads, self.S.head_dim).transpose(1, 2), pos)
        v = self.v(h).view(B, T, self.S.kv_heads, self.S.head_dim).transpose(1, 2)
        return x, q, k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)

    def finish(self, x, att):  # att [B, heads, T, D]
        B, T, _ = x.shape
        x = x + self.o(att.transpose(1, 2).reshape(B, T, -1))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    def real(self, feat):
        """The target's features at real positions ([B, T, 3H] when fused) -> the layer's feature input."""
        return self.fuse(feat) if self.fused else feat

    def drafted(self, pred):
        """A predicted feature [B, T, H] -> the feature input of a drafted position."""
        if not self.fused:
            return pred
        return pred @ self.fuse.weight[:, 2 * self.S.hidden:].T + self.fuse.bias

    def forward(self, feat, emb, pos):
        """The causal pass over real inputs: predicted features [B, T, H], and (k, v) for rollouts."""
        x, q, k, v = self.project(self.real(feat), emb, pos)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.finish(x, att), (k, v)

    def step(self, feat, emb, pos, real, own):
        """One rollout step for every item m at once: item m attends to the real keys 0..m and to its own
        earlier rollout keys (own: list of (k, v), each [B, heads, T, D]). feat: the predicted features of
        the step before. Returns (predicted features, this step's (k, v)); append the latter to own."""
        x, q, k, v = self.project(self.drafted(feat), emb, pos)
        K, V = real
        T = q.shape[2]
        scale = 1.0 / math.sqrt(self.S.head_dim)
        scores = (q @ K.transpose(-1, -2)) * scale
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        mine = [(q * kk).sum(-1, keepdim=True) * scale for kk, _ in own + [(k, v)]]
        p = torch.softmax(torch.cat([scores] + mine, -1), -1)
        att = p[..., :T] @ V
        for i, (_, vv) in enumerate(own + [(k, v)]):
            att = att + p[..., T + i: T + i + 1] * vv
        return self.finish(x, att), (k, v)
