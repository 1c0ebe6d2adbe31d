"""Draft-length controllers of the speculative loop: how many tokens to ask the proposer for each round.

`FixedK` (--draft-tokens K), `GatedK` (a proposer that sizes its own draft, e.g. Medusa's tree: only
on/off by measured speed) and `AdaptiveK` (k from observed acceptance per bucket and the target's
measured pass costs; the default). Each has start() per request, k(bucket) per round, and
observe(asked=, width=, result=, draft_s=, verify_s=, first=, bucket=) after the target's pass.
"""

from __future__ import annotations


class FixedK:
    """--draft-tokens K: always ask for K tokens."""

    def __init__(self, k: int):
        self.fixed = k

    def start(self) -> None:
        pass

    def k(self, bucket: int = 0) -> int:
        return self.fixed

    def observe(self, **_) -> None:
        pass


class GatedK:
    """For proposers that size their drafts themselves (Medusa's tree, chosen at build time): ask for
    the whole draft, but check that it pays. Tokens per second of draft rounds (decayed sums over
    ~20 rounds, draft time included) against plain rounds (forced every PROBE rounds); judged every
    JUDGE draft rounds once WARM were seen: when drafting is slower than plain by more than MARGIN,
    plain decoding for `backoff` rounds (doubling to BACKOFF_MAX while it keeps losing), then a fresh
    measurement. Measured need: the shipped Medusa tree ran at 0.90x plain on translation prompts,
    where the heads are rarely right. (A 5-round EMA judged every round switched it off on chat too,
    where it wins 1.07x: a round keeps 0-2 nodes, so short windows dip below the line by chance.)
    """

    KEEP, RATE, PROBE, WARM, JUDGE, MARGIN, BACKOFF0, BACKOFF_MAX = 0.95, 0.2, 32, 16, 8, 0.95, 16, 256

    def __init__(self, k: int):
        self.fixed = k
        self.t_plain = 0.0                       # EMA seconds of a plain round (0 = not measured yet)
        self.rounds, self.since_plain, self.off_until, self.backoff = 0, 0, 0, self.BACKOFF0
        self._fresh()

    def _fresh(self) -> None:
        self.tokens, self.seconds, self.n_draft = 0.0, 0.0, 0   # decayed sums over draft rounds, their count

    def start(self) -> None:
        self.since_plain = 0

    def k(self, bucket: int = 0) -> int:
        if self.rounds < self.off_until:
            return 0
        if self.since_plain >= self.PROBE or (not self.t_plain and self.n_draft >= 2):
            return 0                             # measure plain decoding now and then
        return self.fixed

    @property
    def speedup(self) -> float:
        """Measured tokens per second of draft rounds over plain rounds (1.0 until both are measured)."""
        if not self.t_plain or not self.seconds:
            return 1.0
        return self.tokens / self.seconds * self.t_plain

    def observe(self, *, asked: int, width: int, result, draft_s: float, verify_s: float, first: bool,
                bucket: int = 0) -> None:
        if first:                                # prefill round
            return
        self.rounds += 1
        secs = draft_s + verify_s
        if width == 1:                           # plain round (asked 0, or an empty draft)
            self.t_plain = secs if not self.t_plain else self.t_plain + self.RATE * (secs - self.t_plain)
            self.since_plain = 0
            return
        self.since_plain += 1
        self.tokens = self.tokens * self.KEEP + result.num_accepted + 1
        self.seconds = self.seconds * self.KEEP + secs
        self.n_draft += 1
        if self.n_draft < self.WARM or self.n_draft % self.JUDGE or not self.t_plain:
            return
        if self.speedup < self.MARGIN:           # drafting loses: plain for a while, then measure afresh
            self.off_until = self.rounds + self.backoff
            self.backoff = min(2 * self.backoff, self.BACKOFF_MAX)
            self._fresh()
        elif self.n_draft >= 4 * self.WARM:      # a long winning stretch forgives earlier losses
            self.backoff = self.BACKOFF0


class AdaptiveK:
    """Choose k each round to maximise the expected tokens per second of a round with a draft:

        k* = argmax_k E(k) / T(k),   E(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i,   T(k) = t(w_k) + d k

    alpha_i = P(draft position i accepted | position i - 1 accepted), from decayed counts of this
    bucket's recent rounds (hits + PRIOR_N alpha_{i-1}) / (tries + PRIOR_N): a position with little
    data leans on the one before it, then on ALPHA0. Kept per bucket (the proposer's kind of draft,
    e.g. prompt lookup's match length; one bucket for most proposers). t(w) is the target's measured
    cost of a w-token pass: an EMA per width once TRUST passes back it, else a least-squares line
    a + b (w - 1) over recent passes (prior b/a until several widths were seen: ~0.1 on width-exact
    fp32 kernels, ~0.22 on int8-activation ones). w_k: the pass width a k-draft gives (1 + k for
    chains, more for trees), d: draft seconds per token. Everything is conditional on a draft
    existing: an empty draft (no prompt-lookup match) is a plain round and costs nothing. k = 0 is
    plain decoding (E = 1, T = t(1)); a plain round is forced early and then every PROBE rounds so
    t(1) is measured, not extrapolated. A bucket is judged when it is asked for a draft: when no
    k > 0 beats plain, it is off for `backoff` rounds (doubling to 256 while it keeps losing), then
    retried for EXPLORE of its rounds from the prior alpha before it is judged again (stale costs
    and acceptance must be re-measured).

    Plain Python floats, not numpy: this runs between two target passes, when the pass has just
    streamed the weights through every cache level, and a few dozen small numpy calls measured
    ~0.4 ms there (~80 us warm), 1.5% of an fp32 step and ~5% of an int4 one.
    """

    ALPHA0, RATE, DECAY, MARGIN, BACKOFF0, BACKOFF_MAX, PROBE, EXPLORE = 0.5, 0.3, 0.95, 1.1, 16, 256, 32, 3
    KEEP, PRIOR_N = 0.85, 1.0                   # acceptance counts: a window of ~7 rounds per bucket
    COST_RATE, TRUST = 0.1, 10                   # pass times are noisy (shared CPUs): average over ~10,
    # and trust a width's own average over the fitted line only after TRUST passes of that width

    def __init__(self, k_max: int, width_exact: bool = True, max_width: int = 64, buckets: int = 1):
        self.k_max, self.buckets = k_max, buckets
        self.beta = 0.1 if width_exact else 0.22
        self.sums = [0.0] * 5                    # decayed [n, sum x, sum x^2, sum t, sum x t], x = width - 1
        self.t = [0.0] * (max_width + 1)         # EMA pass seconds per width ...
        self.seen = [0] * (max_width + 1)        # ... and how many passes back it
        self.width = [1.0 + k for k in range(k_max + 1)]  # w_k, k = 0..k_max
        self.d = 0.0                             # draft seconds per drafted token (EMA)
        self.rounds = 0                          # decode rounds observed (the clock of the backoffs)
        self.reset()

    def start(self) -> None:
        """A new request. Acceptance per bucket carries over from earlier requests when there are
        several buckets (a match length's hit rate is a property of the model more than of the
        text: the mix of match lengths is what differs between texts); one pooled profile is reset."""
        self.since_plain = 0
        if self.buckets == 1:
            self.reset()

    def reset(self) -> None:
        B, K = self.buckets, self.k_max
        self.hits, self.tries = [[0.0] * K for _ in range(B)], [[0.0] * K for _ in range(B)]
        self.off_until = [0] * B                 # off while rounds < off_until (0 = on)
        self.backoff, self.explore, self.on_rounds = [self.BACKOFF0] * B, [self.EXPLORE] * B, [0] * B
        self.since_plain = 0

    @property
    def off(self) -> list[int]:
        """Rounds each bucket stays off (0 = on)."""
        return [max(u - self.rounds, 0) for u in self.off_until]

    @property
    def alpha(self) -> list[list[float]]:
        """[buckets][k_max] estimated acceptance per draft position."""
        return [self._alpha(b) for b in range(self.buckets)]

    def _alpha(self, bucket: int) -> list[float]:
        out, prior, N = [], self.ALPHA0, self.PRIOR_N
        for h, n in zip(self.hits[bucket], self.tries[bucket]):  # past the deepest measured position:
            prior = (h + N * prior) / (n + N)                     # follow it, not ALPHA0
            out.append(prior)
        return out

    def pass_cost(self, w: float) -> float:
        """Seconds of a w-token pass (relative units before any pass was measured)."""
        wi = min(max(int(round(w)), 1), len(self.t) - 1)
        if self.seen[wi] >= self.TRUST:
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

    def best(self, bucket: int = 0) -> int:
        """The k with the best expected rate for this bucket (0 = plain decoding beats every draft)."""
        best_k, best_rate = 0, self.MARGIN / self.pass_cost(self.width[0])
        gain, run = 1.0, 1.0
        for k, a in enumerate(self._alpha(bucket), 1):
            run *= a
            gain += run
            rate = gain / (self.pass_cost(self.width[k]) + self.d * k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def k(self, bucket: int = 0) -> int:
        if self.since_plain >= self.PROBE or (self.seen[1] < 2 and self.since_plain >= 2):
            return 0
        if self.off_until[bucket]:
            if self.rounds < self.off_until[bucket]:
                return 0
            # back from a backoff: forget the acceptance that made us stop and measure again (costs
            # and the text may have changed), exploring a few rounds before judging
            self.off_until[bucket] = 0
            self.hits[bucket], self.tries[bucket] = [0.0] * self.k_max, [0.0] * self.k_max
            self.explore[bucket] = self.EXPLORE
        best = self.best(bucket)
        if self.explore[bucket] > 0:
            return max(best, 1)
        if best == 0:                            # judged: no draft length pays, switch this bucket off
            self.off_until[bucket] = self.rounds + self.backoff[bucket]
            self.backoff[bucket] = min(2 * self.backoff[bucket], self.BACKOFF_MAX)
            self.on_rounds[bucket] = 0
        return best

    def observe(self, *, asked: int, width: int, result, draft_s: float, verify_s: float, first: bool,
                bucket: int = 0) -> None:
        acc = result.acceptance
        if acc.size:                             # positions up to the first rejection were tried
            r = acc.size if acc.all() else int(acc.argmin()) + 1
            keep = self.KEEP
            hits, tries = [h * keep for h in self.hits[bucket]], [n * keep for n in self.tries[bucket]]
            for i, a in enumerate(acc[:r].tolist()):
                tries[i] += 1.0
                hits[i] += a
            self.hits[bucket], self.tries[bucket] = hits, tries
        if first:                                # the prefill round's costs say nothing about a decode pass
            return
        self.rounds += 1
        x, dec = width - 1, self.DECAY
        self.sums = [s * dec + v for s, v in zip(self.sums, (1.0, x, x * x, verify_s, x * verify_s))]
        w = min(width, len(self.t) - 1)
        self.t[w] = verify_s if self.seen[w] == 0 else self.t[w] + self.COST_RATE * (verify_s - self.t[w])
        self.seen[w] += 1
        self.since_plain = 0 if width == 1 else self.since_plain + 1
        if asked > 0 and acc.size:
            self.d += self.RATE * (draft_s / asked - self.d)
            self.width[asked] += self.RATE * (width - self.width[asked])
            if self.explore[bucket] > 0:
                self.explore[bucket] -= 1
            else:                                # it was judged worth a draft when asked
                self.on_rounds[bucket] += 1
                if self.on_rounds[bucket] >= 32:  # a long winning streak forgives earlier losses
                    self.on_rounds[bucket], self.backoff[bucket] = 0, self.BACKOFF0
