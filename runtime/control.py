"""Draft-length controllers of the speculative loop: how many tokens to ask the proposer for each round.

A `Controller` gets `start()` per request, `k(bucket)` per round and `observe(round)` with the loop's `Round`
record after the target's pass. Three controllers: `FixedK` (--draft-tokens K), `GatedK` (a proposer that
sizes its own draft, e.g. Medusa's tree: only on/off by measured speed) and `AdaptiveK` (k from observed
acceptance per bucket and the target's measured pass costs; the default). They are built from three small
models: `Acceptance` (per-bucket, per-position acceptance), `PassCost` (seconds of a w-token pass) and
`Backoff` (switched off for a while after losing, longer each time).

Plain Python floats and lists, not numpy: this runs between two target passes, where a few dozen small
numpy calls cost a visible share of a step (docs/runtime-notes.md, "Controller bookkeeping in plain floats").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .choice import Source, SourceTable, best_draft, expected_tokens
from .verify import VerifyResult


@dataclass(frozen=True, slots=True)
class Round:
    """What one round of the loop did, for the controller and the stats."""

    bucket: int            # the proposer's kind of draft (runtime/proposers/base.py)
    asked: int             # draft length asked of the proposer (0 = a plain round)
    drafted: int           # draft nodes it gave (a tree may hold more than `asked`; 0 = none)
    width: int             # tokens in the target's pass: pending + draft nodes
    result: VerifyResult
    draft_s: float         # drafting only: the proposer's catch-up on unread context is catchup_s
    verify_s: float
    prefill: bool          # the pass fed the prompt (round 1): its cost says nothing about a decode pass
    catchup_s: float = 0.0
    caught: int = 0        # context tokens the proposer's catch-up read in catchup_s
    forced: int = 0        # tokens the constraint forced before the pass (they are the request's too)


class Controller(Protocol):
    def start(self) -> None:
        """A new request."""

    def k(self, bucket: int = 0, unread: int = 0) -> int:
        """The draft length to ask for this round (0 = plain decoding); unread: context tokens the proposer would
        read before drafting (Proposer.unread)."""

    def observe(self, r: Round) -> None:
        """What the round asked, cost and kept."""

    def choose(self, buckets: list[int], unread: list[int] | None = None) -> int:
        """Which of several drafters drafts this round, given each one's bucket and unread context (0: the base)."""


class Acceptance:
    """alpha_i = P(draft position i accepted | position i - 1 accepted) per bucket, from decayed counts of the
    bucket's recent rounds: (hits + prior_n alpha_{i-1}) / (tries + prior_n), so a position with little data
    leans on the one before it, then on alpha0."""

    def __init__(self, buckets: int, k_max: int, keep: float | list[float] = 0.85, prior_n: float = 1.0,
                 alpha0: float = 0.5):
        """keep: the decay of the counts per round, one for all buckets or one per bucket."""
        self.buckets, self.k_max, self.prior_n, self.alpha0 = buckets, k_max, prior_n, alpha0
        self.keeps = list(keep) if isinstance(keep, (list, tuple)) else [keep] * buckets
        self.reset()

    def reset(self) -> None:
        self.hits = [[0.0] * self.k_max for _ in range(self.buckets)]
        self.tries = [[0.0] * self.k_max for _ in range(self.buckets)]

    def forget(self, bucket: int) -> None:
        self.hits[bucket], self.tries[bucket] = [0.0] * self.k_max, [0.0] * self.k_max

    def alpha(self, bucket: int) -> list[float]:
        out, prior, N = [], self.alpha0, self.prior_n
        for h, n in zip(self.hits[bucket], self.tries[bucket]):  # past the deepest measured position:
            prior = (h + N * prior) / (n + N)                     # follow it, not alpha0
            out.append(prior)
        return out

    def observe(self, bucket: int, acceptance) -> None:
        """acceptance [depth] bool of one round; positions up to the first rejection were tried."""
        if not acceptance.size:
            return
        r = acceptance.size if acceptance.all() else int(acceptance.argmin()) + 1
        keep = self.keeps[bucket]
        hits, tries = [h * keep for h in self.hits[bucket]], [n * keep for n in self.tries[bucket]]
        for i, a in enumerate(acceptance[:r].tolist()):
            tries[i] += 1.0
            hits[i] += a
        self.hits[bucket], self.tries[bucket] = hits, tries


class PassCost:
    """t(w), seconds of a w-token target pass: an EMA per width once `trust` passes back it, else a decayed
    least-squares line a + b (w - 1) over recent passes (with the prior slope b/a = beta until several widths
    were seen; relative units before any pass was measured)."""

    def __init__(self, beta: float, max_width: int = 64, decay: float = 0.95, rate: float = 0.1, trust: int = 10):
        self.beta, self.decay, self.rate, self.trust = beta, decay, rate, trust
        self.sums = [0.0] * 5                    # decayed [n, sum x, sum x^2, sum t, sum x t], x = width - 1
        self.t = [0.0] * (max_width + 1)         # EMA pass seconds per width ...
        self.seen = [0] * (max_width + 1)        # ... and how many passes back it

    def __call__(self, w: float) -> float:
        wi = min(max(int(round(w)), 1), len(self.t) - 1)
        if self.seen[wi] >= self.trust:
            return self.t[wi]
        n, sx, sxx, st, sxt = self.sums
        if n < 1e-9:
            return 1.0 + self.beta * (w - 1)
        mx = sx / n
        var = sxx / n - mx * mx
        if var < 0.5 or n < 4:                   # (nearly) one width seen: keep the prior slope, fit the scale
            a = st / (n + self.beta * sx)
            b = self.beta * a
        else:
            b = max((sxt / n - mx * st / n) / var, 0.0)
            a = max(st / n - b * mx, 1e-6)
        return a + b * (w - 1)

    def observe(self, width: int, seconds: float) -> None:
        x, dec = width - 1, self.decay
        self.sums = [s * dec + v for s, v in zip(self.sums, (1.0, x, x * x, seconds, x * seconds))]
        w = min(width, len(self.t) - 1)
        self.t[w] = seconds if self.seen[w] == 0 else self.t[w] + self.rate * (seconds - self.t[w])
        self.seen[w] += 1


class Backoff:
    """Per bucket: off until a round number after a loss, for `first` rounds, doubling up to `longest` while
    it keeps losing; `forgive` restores the first length after a winning stretch."""

    def __init__(self, buckets: int = 1, first: int = 16, longest: int = 256):
        self.first, self.longest = first, longest
        self.until = [0] * buckets               # off while round < until (0 = on)
        self.length = [first] * buckets

    def off(self, bucket: int, now: int) -> bool:
        return now < self.until[bucket]

    def came_back(self, bucket: int) -> bool:
        """True once, on the first call after a backoff ran out (the caller then re-measures)."""
        if self.until[bucket]:
            self.until[bucket] = 0
            return True
        return False

    def lose(self, bucket: int, now: int) -> None:
        self.until[bucket] = now + self.length[bucket]
        self.length[bucket] = min(2 * self.length[bucket], self.longest)

    def forgive(self, bucket: int) -> None:
        self.length[bucket] = self.first

    def remaining(self, now: int) -> list[int]:
        return [max(u - now, 0) for u in self.until]


class FixedK:
    """--draft-tokens K: always ask for K tokens."""

    def __init__(self, k: int):
        self.fixed = k

    def start(self) -> None:
        pass

    def k(self, bucket: int = 0, unread: int = 0) -> int:
        return self.fixed

    def choose(self, buckets: list[int], unread: list[int] | None = None) -> int:
        return 0  # a fixed --draft-tokens drafts with the base drafter only

    def observe(self, r: Round) -> None:
        pass


class GatedK:
    """For proposers that size their drafts themselves (Medusa's tree, chosen at build time): ask for the whole
    draft, but check that it pays. Tokens per second of draft rounds (decayed sums over ~20 rounds, draft time
    included) against plain rounds (forced every PROBE rounds); judged every JUDGE draft rounds once WARM were
    seen: slower than plain by more than MARGIN, and it backs off (docs/runtime-notes.md, "Medusa on/off gate")."""

    KEEP, RATE, PROBE, WARM, JUDGE, MARGIN, BACKOFF0, BACKOFF_MAX = 0.95, 0.2, 32, 16, 8, 0.95, 16, 256

    def __init__(self, k: int):
        self.fixed = k
        self.t_plain = 0.0                       # EMA seconds of a plain round (0 = not measured yet)
        self.rounds, self.since_plain = 0, 0
        self.backoff = Backoff(1, self.BACKOFF0, self.BACKOFF_MAX)
        self._fresh()

    def _fresh(self) -> None:
        self.tokens, self.seconds, self.n_draft = 0.0, 0.0, 0   # decayed sums over draft rounds, their count

    def start(self) -> None:
        self.since_plain = 0

    def k(self, bucket: int = 0, unread: int = 0) -> int:
        if self.backoff.off(0, self.rounds):
            return 0
        if self.since_plain >= self.PROBE or (not self.t_plain and self.n_draft >= 2):
            return 0                             # measure plain decoding now and then
        return self.fixed

    def choose(self, buckets: list[int], unread: list[int] | None = None) -> int:
        return 0  # a proposer that sizes its own drafts is one drafter

    @property
    def speedup(self) -> float:
        """Measured tokens per second of draft rounds over plain rounds (1.0 until both are measured)."""
        if not self.t_plain or not self.seconds:
            return 1.0
        return self.tokens / self.seconds * self.t_plain

    def observe(self, r: Round) -> None:
        if r.prefill:
            return
        self.rounds += 1
        secs = r.draft_s + r.verify_s
        if r.width == 1:                         # plain round (asked 0, or an empty draft)
            self.t_plain = secs if not self.t_plain else self.t_plain + self.RATE * (secs - self.t_plain)
            self.since_plain = 0
            return
        self.since_plain += 1
        self.tokens = self.tokens * self.KEEP + r.result.num_accepted + 1
        self.seconds = self.seconds * self.KEEP + secs
        self.n_draft += 1
        if self.n_draft < self.WARM or self.n_draft % self.JUDGE or not self.t_plain:
            return
        if self.speedup < self.MARGIN:           # drafting loses: plain for a while, then measure afresh
            self.backoff.lose(0, self.rounds)
            self._fresh()
        elif self.n_draft >= 4 * self.WARM:      # a long winning stretch forgives earlier losses
            self.backoff.forgive(0)


class AdaptiveK:
    """Choose k each round to maximise the expected tokens per second of a round with a draft:

        k* = argmax_k E(k) / T(k),   E(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i,   T(k) = t(w_k) + d k

    alpha from `Acceptance` (per bucket: the proposer's kind of draft, e.g. prompt lookup's match length),
    t(w) from `PassCost` (prior slope ~0.1 of a step per token on width-exact fp32 kernels, ~0.22 on
    int8-activation ones), w_k the pass width a k-draft gives (1 + k for chains, more for trees), d the draft
    seconds per token. Everything is conditional on a draft existing: an empty draft (no prompt-lookup match)
    is a plain round and costs nothing. k = 0 is plain decoding (E = 1, T = t(1)); a plain round is forced
    early and then every PROBE rounds so t(1) is measured, not extrapolated. A bucket is judged when it is
    asked for a draft: when no k > 0 beats plain by MARGIN, it backs off (`Backoff`), then is retried for
    EXPLORE of its rounds from the prior alpha before it is judged again (stale costs and acceptance must be
    re-measured).
    """

    ALPHA0, RATE, DECAY, MARGIN, BACKOFF0, BACKOFF_MAX, PROBE, EXPLORE = 0.5, 0.3, 0.95, 1.1, 16, 256, 32, 3
    KEEP, PRIOR_N = 0.85, 1.0                   # acceptance counts: a window of ~7 rounds per bucket ...
    KEEP_PAIR = 0.97                             # ... ~30 for a draft model's, steadier than the text's
    COST_RATE, TRUST = 0.1, 10                   # pass times are noisy (shared CPUs): average over ~10,
    # and trust a width's own average over the fitted line only after TRUST passes of that width
    FORGIVE = 32                                 # winning rounds in a row that reset a bucket's backoff

    def __init__(self, k_max: int, width_exact: bool = True, max_width: int = 64, buckets: int = 1,
                 pair: bool = False, sources: tuple[Source, ...] | None = None):
        """pair: the acceptance is a model pair's (Proposer.pair_acceptance): measured over a longer window and kept
        across requests, as several buckets' are (docs/voice.md, "Why auto drafted little on voice turns").
        sources: the drafters of a proposer that has several (Proposer.sources), each with its buckets, its draft cost
        and its pass widths; `choose` picks the one that drafts each round (docs/voice.md, "auto learns from the
        workload"). None: one source of `buckets` buckets."""
        sources = sources or (Source("", buckets, pair),)
        self.k_max, self.drafters = k_max, SourceTable(sources, k_max)
        self.of, self.buckets = self.drafters.of, len(self.drafters.of)
        self.carry = any(s.pair for s in sources) or self.buckets > 1
        self.acceptance = Acceptance(self.buckets, k_max, self.drafters.keeps(self.KEEP, self.KEEP_PAIR), self.PRIOR_N,
                                     self.ALPHA0)
        self.cost = PassCost(0.1 if width_exact else 0.22, max_width, self.DECAY, self.COST_RATE, self.TRUST)
        self.rounds = 0                          # decode rounds observed (the clock of the backoffs)
        self.reset()

    @property
    def sources(self) -> tuple[Source, ...]:
        return self.drafters.sources

    def start(self) -> None:
        """A new request. Acceptance per bucket carries over from earlier requests when there are several
        buckets (a match length's hit rate is a property of the model more than of the text: the mix of match
        lengths is what differs between texts); one pooled profile is reset, unless it is the model pair's (carry)."""
        self.since_plain = 0
        self.drafters.start()
        if not self.carry:
            self.reset()

    def reset(self) -> None:
        B = self.buckets
        self.acceptance.reset()
        self.backoff = Backoff(B, self.BACKOFF0, self.BACKOFF_MAX)
        self.explore, self.on_rounds = [self.EXPLORE] * B, [0] * B
        self.since_plain = 0

    @property
    def off(self) -> list[int]:
        """Rounds each bucket stays off (0 = on)."""
        return self.backoff.remaining(self.rounds)

    @property
    def alpha(self) -> list[list[float]]:
        """[buckets][k_max] estimated acceptance per draft position."""
        return [self.acceptance.alpha(b) for b in range(self.buckets)]

    def best(self, bucket: int = 0, a: float = 0.0) -> int:
        """The k with the best expected rate for this bucket (0 = plain decoding beats every draft); a: the
        source's surcharge per token kept (SourceTable.surcharge)."""
        src = self.of[bucket]
        width = self.drafters.widths[src]
        k, rate = best_draft(expected_tokens(self.acceptance.alpha(bucket)), self.cost, width, self.drafters.ds[src], a)
        return k if rate > self.MARGIN / self.cost(width[0]) else 0

    def choose(self, buckets: list[int], unread: list[int] | None = None) -> int:
        """Which source drafts this round, given each source's bucket now (choice.SourceTable.choose); a source
        retried after a while is explored from the prior, as a bucket back from its backoff is."""
        off = lambda b: self.backoff.off(b, self.rounds)  # noqa: E731
        i, retry = self.drafters.choose(buckets, self.acceptance.alpha, self.cost, self.rounds, off, unread)
        if retry:
            self.acceptance.forget(buckets[i])
            self.explore[buckets[i]] = self.EXPLORE
        return i

    def k(self, bucket: int = 0, unread: int = 0) -> int:
        if self.since_plain >= self.PROBE or (self.cost.seen[1] < 2 and self.since_plain >= 2):
            return 0
        if self.backoff.off(bucket, self.rounds):
            return 0
        a = self.drafters.surcharge(self.of[bucket], unread)
        if self.backoff.came_back(bucket):       # forget the acceptance that made it stop, explore first
            self.acceptance.forget(bucket)
            self.explore[bucket] = self.EXPLORE
        best = self.best(bucket, a)
        if self.explore[bucket] > 0:             # explore, unless the catch-up first costs more than it could win
            return max(best, 1) if self.drafters.affords(a, self.cost) else 0
        if best == 0 and a and self.best(bucket):
            return 0                             # the catch-up, not the acceptance, loses: no judgement
        if best == 0:                            # judged: no draft length pays, switch this bucket off
            self.backoff.lose(bucket, self.rounds)
            self.on_rounds[bucket] = 0
        return best

    def observe(self, r: Round) -> None:
        acc, bucket = r.result.acceptance, r.bucket
        self.acceptance.observe(bucket, acc)
        self.drafters.made(1 + r.result.num_accepted + r.forced)
        if r.prefill:
            return
        self.rounds += 1
        self.cost.observe(r.width, r.verify_s)
        self.since_plain = 0 if r.width == 1 else self.since_plain + 1
        self.drafters.observe(bucket, r.asked, r.drafted, r.width, r.draft_s, self.rounds, r.caught, r.catchup_s)
        if r.asked > 0 and acc.size:
            if self.explore[bucket] > 0:
                self.explore[bucket] -= 1
            else:                                # it was judged worth a draft when asked
                self.on_rounds[bucket] += 1
                if self.on_rounds[bucket] >= self.FORGIVE:
                    self.on_rounds[bucket] = 0
                    self.backoff.forgive(bucket)
