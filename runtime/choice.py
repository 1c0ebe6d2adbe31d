"""The drafters a controller keeps apart, and which one drafts each round (auto's sources: the set's draft model or
heads, prompt lookup, suffix decoding of earlier answers; docs/voice.md, "auto learns from the workload").

Each source is a row of `SourceTable`: its buckets of the controller's acceptance (the controller's `Acceptance`
keeps them, per bucket), its draft seconds per token, its pass width per draft length, how often it has a draft
when asked, and when it last drafted. A proposer with one source (every method but auto's) has a one-row table and
is never asked to choose. With several (runtime/proposers/sources.py), each round the source whose bucket promises
the most tokens per second drafts: the first (the base drafter) unless another beats it by SWITCH. A source that
has not drafted for RETRY rounds is tried again with its bucket's acceptance forgotten: what made it lose may have
changed (a script that starts repeating makes earlier answers right).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Source:
    """One drafter of a proposer: its name, how many buckets it uses (its part of the controller's, in order) and
    whether its acceptance is a model pair's (kept over a longer window)."""

    name: str
    buckets: int
    pair: bool = False


def expected_tokens(alpha: list[float], given: float = 1.0) -> list[float]:
    """E(k), k = 0..len(alpha): tokens a round that asks for k keeps, 1 + given sum_{j<=k} prod_{i<=j} alpha_i;
    given = how often a draft comes when asked (a round without one is a plain round)."""
    out, gain, run = [1.0], 0.0, 1.0
    for a in alpha:
        run *= a
        gain += run
        out.append(1.0 + given * gain)
    return out


def best_draft(expected: list[float], cost, width: list[float], d: float) -> tuple[int, float]:
    """(the k >= 1 of the most tokens per second E(k) / (t(w_k) + d k), the first of equals; that rate)."""
    best_k, best = 0, 0.0
    for k in range(1, len(expected)):
        rate = expected[k] / (cost(width[k]) + d * k)
        if rate > best:
            best_k, best = k, rate
    return best_k, best


class SourceTable:
    SWITCH = 1.1   # another source drafts once it promises this much more than the first
    RETRY = 32     # rounds without a draft of its after which a source is tried again, from the prior
    RATE = 0.3     # EMA rate of the draft cost, the pass widths and how often a draft is given

    def __init__(self, sources: tuple[Source, ...], k_max: int):
        self.sources = sources
        self.of = [i for i, s in enumerate(sources) for _ in range(s.buckets)]  # bucket -> its source
        self.ds = [0.0] * len(sources)                                        # draft seconds per drafted token
        self.widths = [[1.0 + k for k in range(k_max + 1)] for _ in sources]  # pass width of a k-draft
        self.given = [1.0] * len(self.of)                                     # P(a draft | asked), per bucket
        self.last = [0] * len(sources)                                        # the round it last drafted

    def keeps(self, keep: float, keep_pair: float) -> list[float]:
        """The acceptance window of each bucket: a model pair's is longer."""
        return [keep_pair if self.sources[s].pair else keep for s in self.of]

    def observe(self, bucket: int, asked: int, drafted: int, width: int, draft_s: float, now: int) -> None:
        """A decode round that asked `bucket`'s source for `asked` tokens and got `drafted` nodes."""
        if asked <= 0:
            return
        rate, s = self.RATE, self.of[bucket]
        self.given[bucket] += rate * (float(drafted > 0) - self.given[bucket])
        if drafted:
            self.ds[s] += rate * (draft_s / asked - self.ds[s])
            self.widths[s][asked] += rate * (width - self.widths[s][asked])
            self.last[s] = now

    def rate(self, bucket: int, alpha: list[float], cost) -> float:
        s = self.of[bucket]
        return best_draft(expected_tokens(alpha, self.given[bucket]), cost, self.widths[s], self.ds[s])[1]

    def choose(self, buckets: list[int], alpha, cost, now: int, off=lambda b: False) -> tuple[int, bool]:
        """(which source drafts, given each one's bucket now; whether it is a retry, its bucket's acceptance to be
        forgotten). alpha(bucket): the controller's estimates; cost(w): a pass's seconds; off(bucket): switched off."""
        for i, b in enumerate(buckets):
            s = self.of[b]
            if now - self.last[s] >= self.RETRY and self.given[b] >= 0.5 and not off(b):
                self.last[s] = now
                return i, True
        rates = [0.0 if off(b) else self.rate(b, alpha(b), cost) for b in buckets]
        best = max(range(len(rates)), key=rates.__getitem__)
        return (best if rates[best] > self.SWITCH * rates[0] else 0), False
