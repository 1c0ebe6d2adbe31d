"""Sampling parameters, logit processors and the categorical sampler.

Contract: this module is the *only* place where logits become probabilities.
Plain decoding samples with ``sample(probs_from_logits(logits, params)[0], rng)``
and speculative decoding feeds the very same ``probs_from_logits`` output to
``runtime.verify`` as ``p`` (target) and ``q`` (draft). Sharing one code path
is what makes speculative decoding lossless in practice: the distribution the
verifier protects is bit-for-bit the distribution plain sampling draws from.

More: docs/runtime-notes.md, "Module notes: runtime/sampling.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["SamplingParams", "probs_from_logits", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn target/draft logits into a distribution.

    temperature: 0.0 = greedy (argmax); > 0 divides the logits.
    top_k: keep the k largest logits (ties at the k-th value are kept); 0 = off.
    top_p: keep the smallest set of most-likely tokens whose mass >= top_p
        (ties at the boundary probability are kept); 1.0 = off.
    seed: seed for ``generator()``; None = fresh OS entropy.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0, got {t!r}; "
                "use temperature=0.0 for greedy decoding or e.g. 0.7 for sampling")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(
                f"top_k must be an int >= 0, got {k!r}; use top_k=0 to disable top-k")
        tp = self.top_p
        if isinstance(tp, bool) or not isinstance(tp, (int, float)) or not (0.0 < tp <= 1.0):
            raise ValueError(
                f"top_p must be in (0, 1], got {tp!r}; use top_p=1.0 to disable nucleus sampling")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0):
            raise ValueError(
                f"seed must be None or an int >= 0, got {s!r}; use seed=None for a random seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> np.random.Generator:
        """The one RNG a decode session should thread through sample/verify."""
        return np.random.default_rng(self.seed)


def _bad_row_message(row: np.ndarray, i: int, what: str) -> str:
    # Only runs on the error path, so the V-sized temporaries here are fine.
    if np.isnan(row).any():
        cause = "contains NaN"
    elif np.isposinf(row).any():
        cause = "contains +inf"
    elif np.isneginf(row).all():
        cause = "is all -inf (every token masked)"
    else:
        cause = "overflows to inf after dividing by the temperature"
    return (f"{what} row {i} {cause}; check the model output (fp16 overflow, "
            "uninitialised buffer) or the mask that produced it")


def probs_from_logits(logits: np.ndarray, params: SamplingParams,
                      out: np.ndarray | None = None) -> np.ndarray:
    """Apply temperature, top-k, top-p, softmax; return probabilities.

    logits: [n, V] (or [V]) float; not modified unless ``out is logits``.
    out:    [n, V] float32 buffer to write into (may alias ``logits``); when
            given, the temperature/softmax path allocates nothing V-sized.
            top-k and top-p need one selection/sort temporary per call.
    returns [n, V] float32 (``out`` when given); rows sum to 1.
    Raises ValueError for rows with NaN, +inf, or no finite logit.
    """
    logits = np.asarray(logits)
    if logits.ndim not in (1, 2) or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [n, V] or [V] with V >= 1, got {logits.shape}")
    if out is None:
        out = np.empty(logits.shape, dtype=np.float32)
    elif out.shape != logits.shape or out.dtype != np.float32:
        raise ValueError(f"out must be float32 with shape {logits.shape}, "
                         f"got {out.dtype} {out.shape}; allocate it once with np.empty_like")
    z = logits if logits.ndim == 2 else logits[None]
    o = out if out.ndim == 2 else out[None]
    n, V = z.shape

    # max() propagates NaN and +inf, and is -inf only for an all -inf row, so
    # this one [n] reduction (needed for a stable softmax anyway) validates.
    m = z.max(axis=1)
    if not np.isfinite(m).all():
        i = int(np.flatnonzero(~np.isfinite(m))[0])
        raise ValueError(_bad_row_message(z[i], i, "logits"))

    if params.greedy:
        idx = z.argmax(axis=1)
        o.fill(0.0)
        o[np.arange(n), idx] = 1.0
        return out

    # (z - max) / T: the max maps to exactly 0, so a tiny T cannot produce
    # inf - inf = NaN; very negative values simply underflow to exp() = 0.
    np.subtract(z, m[:, None], out=o, casting="same_kind")
    if params.temperature != 1.0:
        np.divide(o, np.float32(params.temperature), out=o)

    k = params.top_k
    if 0 < k < V:
        # k-th largest value per row; everything strictly below is masked.
        kth = np.partition(o, V - k, axis=1)[:, V - k : V - k + 1]
        o[o < kth] = -np.inf

    np.exp(o, out=o)

    if params.top_p < 1.0:
        for i in range(n):
            _top_p_row(o[i], params.top_p)

    # Row sums are >= 1 (the max entry is exp(0) = 1), so no division by 0.
    np.divide(o, o.sum(axis=1, keepdims=True), out=o)
    return out


def _top_p_row(row: np.ndarray, top_p: float) -> None:
    """Zero, in place, every entry outside the nucleus of unnormalised ``row``.

    The nucleus is {x : row[x] >= t}, t = the smallest value in the shortest
    descending prefix with mass >= top_p * total. Defining it by a value
    threshold (not by sort position) keeps ties at the boundary together, so
    the result does not depend on sort stability.
    """
    vals = row[row > 0.0]                      # after top-k this is only ~k values
    vals = np.sort(vals)[::-1]
    csum = np.cumsum(vals, dtype=np.float64)
    c = int(np.searchsorted(csum, top_p * csum[-1], side="left"))
    t = vals[min(c, vals.size - 1)]
    row[row < t] = 0.0


# Blocks for the two-level inverse-CDF sampler. 1024 keeps the fine search
# cache-resident while the coarse pass is one vectorised reduceat.
_BLOCK = 1024


@lru_cache(maxsize=16)
def _block_starts(V: int) -> np.ndarray:
    return np.arange(0, V, _BLOCK, dtype=np.intp)


def _sample_or_none(row: np.ndarray, rng: np.random.Generator,
                    exclude: tuple[int, ...] | list[int] = ()) -> int | None:
    """Inverse-CDF draw from unnormalised ``row`` with ``exclude`` zeroed.

    row: [V] float, >= 0, need not sum to 1 (sampling u * total is the same as
    normalising first, without a V-sized divide). Returns None when the mass
    left is exactly 0, so callers can decide what that means.

    Two levels, no V-sized temporaries: block sums locate the block holding
    u * total, then a float64 cumsum over that one block locates the token.
    A token with zero mass is never returned: the chosen index i always has
    cdf[i] > target >= cdf[i - 1].
    """
    V = row.shape[0]
    sums = np.add.reduceat(row, _block_starts(V)).astype(np.float64)  # [ceil(V/B)]
    ex_blocks: dict[int, np.ndarray] = {}
    for t in exclude:
        b = int(t) // _BLOCK
        if b not in ex_blocks:
            ex_blocks[b] = row[b * _BLOCK:(b + 1) * _BLOCK].astype(np.float64)
        ex_blocks[b][int(t) - b * _BLOCK] = 0.0
    for b, seg in ex_blocks.items():
        sums[b] = seg.sum()
    total = float(sums.sum())
    if not math.isfinite(total) or total < 0.0:
        raise ValueError("probability row contains NaN, inf or negative mass; "
                         "build it with probs_from_logits (it rejects bad logits)")
    if total == 0.0:
        return None
    csum = np.cumsum(sums)
    target = rng.random() * csum[-1]
    b = int(np.searchsorted(csum, target, side="right"))
    if b >= sums.size:  # rounding put target at the very top: last block with mass
        b = int(np.flatnonzero(sums > 0.0)[-1])
        target = csum[b] - 0.5 * sums[b]
    seg = ex_blocks.get(b)
    if seg is None:
        seg = row[b * _BLOCK:(b + 1) * _BLOCK].astype(np.float64)
    cseg = np.cumsum(seg)
    # Map the position inside the block through the block's own float64 cdf:
    # the float32 block sum and the float64 cumsum differ by rounding, and
    # rescaling (rather than clamping) keeps the within-block draw exact.
    below = csum[b - 1] if b > 0 else 0.0
    frac = (target - below) / sums[b]
    j = int(np.searchsorted(cseg, frac * cseg[-1], side="right"))
    if j >= seg.size:
        j = int(np.flatnonzero(seg > 0.0)[-1])
    return b * _BLOCK + j


def sample(probs_row: np.ndarray, rng: np.random.Generator,
           exclude: tuple[int, ...] | list[int] = ()) -> int:
    """Draw one token from ``probs_row`` [V] (>= 0, normalised or not).

    exclude: tokens treated as probability 0 (the rest is renormalised),
    without a V-sized copy of the row.
    """
    tok = _sample_or_none(probs_row, rng, exclude)
    if tok is None:
        raise ValueError("cannot sample: the probability row has no mass left "
                         "(all zero, or every token with mass is excluded)")
    return tok
