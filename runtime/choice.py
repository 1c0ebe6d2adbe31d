"""The drafters a controller keeps apart, and which one drafts each round (auto's sources: the set's draft model or
heads, prompt lookup, suffix decoding of earlier answers; docs/voice.md, "auto learns from the workload").

Each source is a row of `SourceTable`: its buckets of the controller's acceptance (the controller's `Acceptance`
keeps them, per bucket), its draft seconds per token, its pass width per draft length, how often it has a draft
when asked, and when it last drafted. A proposer with one source (every method but auto's) has a one-row table and
is never asked to choose. With several (runtime/proposers/sources.py), each round the source whose bucket promises
the most tokens per second drafts: the first (the base drafter) unless another beats it by SWITCH. A source that
has not drafted for RETRY rounds is tried again with its bucket's acceptance forgotten: what made it lose may have
changed (a script that starts repeating makes earlier answers right).

A source that must first read context it has not seen (a draft model that sat out while the others drafted: its
catch-up prefill) pays that once, for the rest of the request: its rate counts the catch-up's seconds spread over
the tokens the request is expected to have left (`Remaining`), and it is not retried while that costs more than
a tenth of a pass per token; until a catch-up was measured none is charged, so a first one runs and measures it
(docs/voice.md, "The draft's catch-up is a cost").
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


def best_draft(expected: list[float], cost, width: list[float], d: float, a: float = 0.0) -> tuple[int, float]:
    """(the k >= 1 of the most tokens per second E(k) / (t(w_k) + d k + a E(k)), the first of equals; that rate).
    a: seconds per token kept that drafting at all costs (a catch-up spread over the rest of the request)."""
    best_k, best = 0, 0.0
    for k in range(1, len(expected)):
        rate = expected[k] / (cost(width[k]) + d * k + a * expected[k])
        if rate > best:
            best_k, best = k, rate
    return best_k, best


class Remaining:
    """Tokens a request is expected to have left: the mean length of the requests before it (an EMA, from a prior)
    less what it has made, and at least as many as it has made (one past the mean is likely as long again)."""

    PRIOR, RATE = 128.0, 0.3

    def __init__(self):
        self.mean, self.made = self.PRIOR, 0

    def start(self) -> None:
        if self.made:
            self.mean += self.RATE * (self.made - self.mean)
        self.made = 0

    def __call__(self) -> float:
        return max(self.mean - self.made, float(self.made), 1.0)


class SourceTable:
    SWITCH = 1.1   # another source drafts once it promises this much more than the first
    RETRY = 32     # rounds without a draft of its after which a source is tried again, from the prior
    RATE = 0.3     # EMA rate of the draft cost, the pass widths and how often a draft is given
    AFFORD = 0.1   # a retry or an exploring draft only while its catch-up costs at most this many passes a token

    def __init__(self, sources: tuple[Source, ...], k_max: int):
        self.sources = sources
        self.of = [i for i, s in enumerate(sources) for _ in range(s.buckets)]  # bucket -> its source
        self.ds = [0.0] * len(sources)                                        # draft seconds per drafted token
        self.widths = [[1.0 + k for k in range(k_max + 1)] for _ in sources]  # pass width of a k-draft
        self.given = [1.0] * len(self.of)                                     # P(a draft | asked), per bucket
        self.last = [0] * len(sources)                                        # the round it last drafted
        self.caught_s = [0.0] * len(sources)    # its catch-ups' seconds and context tokens (decayed sums; a
        self.caught_n = [0.0] * len(sources)    # fixed part of each is then spread by size, not per catch-up)
        self.left = Remaining()

    def start(self) -> None:
        """A new request."""
        self.left.start()

    def surcharge(self, source: int, unread: int) -> float:
        """Seconds per token kept that a draft of `source` costs now besides its rounds: reading `unread` context
        tokens first, spread over the tokens the request is expected to have left."""
        if unread <= 0 or not self.caught_n[source]:  # none measured: the first catch-up is how it is measured
            return 0.0
        return unread * self.caught_s[source] / self.caught_n[source] / self.left()

    def affords(self, a: float, cost) -> bool:
        """Whether a draft with surcharge `a` may be tried without a measured reason to (a retry, an exploration)."""
        return a <= self.AFFORD * cost(1)

    def keeps(self, keep: float, keep_pair: float) -> list[float]:
        """The acceptance window of each bucket: a model pair's is longer."""
        return [keep_pair if self.sources[s].pair else keep for s in self.of]

    def made(self, tokens: int) -> None:
        """Tokens a round of this request gave (its prefill round's too)."""
        self.left.made += tokens

    def observe(self, bucket: int, asked: int, drafted: int, width: int, draft_s: float, now: int,
                caught: int = 0, catchup_s: float = 0.0) -> None:
        """A decode round that asked `bucket`'s source for `asked` tokens and got `drafted` nodes, after reading
        `caught` unseen context tokens in catchup_s."""
        if asked <= 0:
            return
        rate, s = self.RATE, self.of[bucket]
        if caught:
            self.caught_s[s] = (1 - rate) * self.caught_s[s] + catchup_s
            self.caught_n[s] = (1 - rate) * self.caught_n[s] + caught
        self.given[bucket] += rate * (float(drafted > 0) - self.given[bucket])
        if drafted:
            self.ds[s] += rate * (draft_s / asked - self.ds[s])
            self.widths[s][asked] += rate * (width - self.widths[s][asked])
            self.last[s] = now

    def rate(self, bucket: int, alpha: list[float], cost, a: float = 0.0) -> float:
        s = self.of[bucket]
        return best_draft(expected_tokens(alpha, self.given[bucket]), cost, self.widths[s], self.ds[s], a)[1]

    def choose(self, buckets: list[int], alpha, cost, now: int, off=lambda b: False,
               unread: list[int] | None = None) -> tuple[int, bool]:
        """(which source drafts, given each one's bucket now; whether it is a retry, its bucket's acceptance to be
        forgotten). alpha(bucket): the controller's estimates; cost(w): a pass's seconds; off(bucket): switched off;
        unread: the context tokens each source would read before drafting (None: none)."""
        a = [self.surcharge(self.of[b], n) for b, n in zip(buckets, unread or [0] * len(buckets))]
        for i, b in enumerate(buckets):
            s = self.of[b]
            if (now - self.last[s] >= self.RETRY and self.given[b] >= 0.5 and not off(b)
                    and self.affords(a[i], cost)):
                self.last[s] = now
                return i, True
        rates = [0.0 if off(b) else self.rate(b, alpha(b), cost, a[i]) for i, b in enumerate(buckets)]
        best = max(range(len(rates)), key=rates.__getitem__)
        return (best if rates[best] > self.SWITCH * rates[0] else 0), False
