"""Speculation chosen by load: `LoadK` chooses each stream's draft length per round from the batch's measured pass
costs by (rows, width) (batch.BatchCosts) and every stream's observed acceptance, to maximise tokens per second
over the batch (`LoadPlanner`).
"""

from __future__ import annotations


from .batch import BatchCosts, Scheduler
from .choice import Source, SourceTable, expected_tokens
from .control import Acceptance, AdaptiveK, Round


class _Memo:
    """One plan's pass costs: every stream asks for the same few (rows, width) cells, and a fitted cell is not free
    (the plan runs on every round, under the GIL every stream's loop needs)."""

    def __init__(self, cost: BatchCosts):
        self.cost, self.cells, self.seen = cost, cost.cells, {}

    def __call__(self, B: int, W: int) -> float:
        key = (B, W)
        t = self.seen.get(key)
        if t is None:
            t = self.seen[key] = self.cost(B, W)
        return t


class LoadPlanner:
    """Chooses every stream's draft length for the round, to maximise the batch's tokens per second from its
    measured pass costs t(B, W) (rows, width) and each stream's acceptance (LoadK.expected) and draft cost.

    Backends that pad every row to the round's widest (`wide_rows_alone` False): one width W for the batch,

        max_W  sum_s E_s(k_s(W)) / (t(B, W) + sum_s d_s k_s(W)),   k_s(W) = stream s's longest draft that fits W,

    W at most twice the widest pass of B rows measured so far (a plan widens as its costs are measured).

    Backends that batch one-token rows only (ONNX Runtime CPU's GroupQueryAttention): a stream s that drafts k runs
    its own pass of width w_s(k) while the other B - 1 share a one-token pass, and at most one stream drafts a round
    (so the others wait for one pass of its own at most):

        rate = (B - 1 + E_s(k)) / (t(B - 1, 1) + t(1, w_s(k)) + d_s k).

    A choice must beat plain decoding by MARGIN. Alone, drafting pays as it does for AdaptiveK; in a batch the
    one-token pass costs little more for B rows than for one while the machine is memory-bound, so a draft that
    pays alone stops paying once its pass of its own costs more than the tokens it adds (BENCHMARKS.md, "How do
    several streams share the CPU?"). The plan is made once per round (the first stream to ask) and kept, unless a
    stream asks with another catch-up surcharge than it was made with (its draft model fell behind since:
    runtime/choice.py)."""

    MARGIN = 1.05

    def __init__(self, scheduler: Scheduler, batch, max_width: int):
        self.scheduler, self.batch, self.max_width = scheduler, batch, max_width
        self.members: dict[int, "LoadK"] = {}
        self._plan: dict[int, int] = {}
        self._made_at = -1
        self._made_for: dict[int, float] = {}  # each member's surcharge (LoadK.a) the plan was made with

    def k(self, member: int) -> int:
        if (self._made_at != self.scheduler.passes or member not in self._plan
                or self._made_for.get(member) != self.members[member].a):  # a catch-up came due since: again
            active = {m: c for m, c in self.members.items() if m in self.scheduler.active}
            active.setdefault(member, self.members[member])
            cost = _Memo(self.scheduler.costs_of(self.batch))
            self._plan = (self._alone(active, cost) if self.batch.wide_rows_alone
                          else self._common(active, cost))
            self._made_at = self.scheduler.passes
            self._made_for = {m: c.a for m, c in active.items()}
        return self._plan[member]

    def lone_cost(self):
        """t(1, w): seconds of one stream's pass of width w, as this batch measured it."""
        cost = _Memo(self.scheduler.costs_of(self.batch))
        return lambda w: cost(1, max(1, round(w)))

    def _common(self, active: dict, cost) -> dict[int, int]:
        B, tables = len(active), {m: c.table() for m, c in active.items()}
        runs_at = self.batch.pass_width  # a backend that pads to its buckets
        best_w, best = 1, self.MARGIN * B / cost(B, runs_at(1))
        # widen a step at a time: at most twice the widest pass of this many rows measured so far, since a cost
        # extrapolated far past what was measured can be off by half (and one wrong wide pass costs many rounds)
        widest = max((W for (b, W), (_, n) in cost.cells.items() if b == B and n and W <= self.max_width),
                     default=1)
        for W in range(2, min(self.max_width, 2 * widest) + 1):
            gain = draft = 0.0
            for m, c in active.items():
                k = c.fits(W)
                gain += tables[m][k]
                draft += c.d * k + (c.a * tables[m][k] if k else 0.0)
            rate = gain / (cost(B, runs_at(W)) + draft)
            if rate > best:
                best_w, best = W, rate
        return {m: c.fits(best_w) for m, c in active.items()}

    def _alone(self, active: dict, cost) -> dict[int, int]:
        plan = {m: 0 for m in active}
        own = {}  # each stream's best draft on a pass of its own: (k, the batch's tokens per second with it)
        B = len(active)
        base, rest = B / cost(B, 1), cost(B - 1, 1) if B > 1 else 0.0
        # its own pass, drafting and its catch-up spread over the rest of its request (choice.SourceTable.surcharge)
        secs = lambda c, k, e: cost(1, max(2, round(c.width[k]))) + c.d * k + c.a * e  # noqa: E731
        for m, c in active.items():
            # could a draft pay at all, were every token of it kept? If not, acceptance need not be re-measured
            c.hopeless = B > 1 and (B + c.k_max) / (rest + secs(c, c.k_max, 1 + c.k_max)) <= self.MARGIN * base
            if c.hopeless:
                own[m] = (0, 0.0)
                continue
            table, best = c.table(), (0, 0.0)
            for k in range(1, c.k_max + 1):  # the k that gives the batch the most tokens per second
                rate = (B + table[k] - 1) / (rest + secs(c, k, table[k]))
                if table[k] > 1.0 and rate > best[1]:
                    best = (k, rate)
            own[m] = best
        # one pass of its own a round at most: the others wait for one at most (inter-token latency). The stream
        # whose draft gives the batch the best rate, if that beats plain decoding; alone this is AdaptiveK's choice
        chosen, top = None, self.MARGIN * base
        for m, (k, rate) in own.items():
            if k and rate > top:
                chosen, top = m, rate
        if chosen is not None:
            plan[chosen] = own[chosen][0]
        return plan


class LoadK:
    """A stream's controller under LoadPlanner (the control.Controller protocol): its acceptance per bucket, its
    pass width per draft length and its draft cost are its own; the width is the batch's."""

    KEEP, PRIOR_N, ALPHA0, RATE, PROBE = 0.85, 1.0, 0.5, 0.3, 32
    KEEP_PAIR = AdaptiveK.KEEP_PAIR

    def __init__(self, planner: LoadPlanner, member: int, k_max: int, buckets: int = 1, pair: bool = False,
                 sources: tuple[Source, ...] | None = None):
        """pair: a model pair's acceptance, kept across requests over a longer window (as AdaptiveK's); sources: the
        drafters of a proposer that has several (as AdaptiveK's)."""
        sources = sources or (Source("", buckets, pair),)
        self.planner, self.member, self.k_max = planner, member, k_max
        self.drafters = SourceTable(sources, k_max)
        self.of, self.buckets, self.given = self.drafters.of, len(self.drafters.of), self.drafters.given
        self.carry = any(s.pair for s in sources) or self.buckets > 1
        self.acceptance = Acceptance(self.buckets, k_max, self.drafters.keeps(self.KEEP, self.KEEP_PAIR), self.PRIOR_N,
                                     self.ALPHA0)
        self.bucket = 0
        self.since_draft = 0
        self.rounds = 0        # decode rounds observed (the clock of the source retries)
        self.retry = False     # the chosen source is being tried again: draft at least one token
        self.hopeless = False  # the planner found no draft could pay in the batch as it is now, even all kept
        self.a = 0.0           # the current source's surcharge per token kept (its catch-up; SourceTable.surcharge)
        planner.members[member] = self

    @property
    def d(self) -> float:
        """Draft seconds per drafted token of the current bucket's source."""
        return self.drafters.ds[self.of[self.bucket]]

    @property
    def width(self) -> list[float]:
        return self.drafters.widths[self.of[self.bucket]]

    def choose(self, buckets: list[int], unread: list[int] | None = None) -> int:
        """Which source drafts this round (choice.SourceTable.choose), by each one's rate on a pass of its own."""
        i, self.retry = self.drafters.choose(buckets, self.acceptance.alpha, self.planner.lone_cost(), self.rounds,
                                             unread=unread)
        if self.retry:
            self.acceptance.forget(buckets[i])
        return i

    def start(self) -> None:
        self.since_draft = 0
        self.a = 0.0
        self.drafters.start()
        if not self.carry:
            self.acceptance.reset()

    def fits(self, W: int) -> int:
        """The longest draft whose pass fits width W."""
        k = 0
        while k < self.k_max and self.width[k + 1] <= W + 1e-9:
            k += 1
        return k

    def table(self) -> list[float]:
        """E(k), k = 0..k_max: expected tokens of a round that asks for k (its bucket's acceptance)."""
        return expected_tokens(self.acceptance.alpha(self.bucket), self.given[self.bucket])

    def k(self, bucket: int = 0, unread: int = 0) -> int:
        self.bucket = bucket
        self.a = self.drafters.surcharge(self.of[bucket], unread)
        k = self.planner.k(self.member)
        # re-measure now and then (acceptance changes with the text); a probe in a batch costs a pass of its own
        # that every stream waits for, so the batch as a whole probes about once every PROBE rounds; not while a
        # catch-up would first cost more than it could win
        probe = self.since_draft >= self.PROBE * max(1, len(self.planner.scheduler.active))
        affords = not self.a or self.drafters.affords(self.a, self.planner.lone_cost())
        if k == 0 and (self.retry or not self.hopeless and probe) and affords:
            k = 1
        self.retry = False
        return k

    def observe(self, r: Round) -> None:
        self.acceptance.observe(r.bucket, r.result.acceptance)
        self.drafters.made(1 + r.result.num_accepted + r.forced)
        if r.prefill:
            return
        self.rounds += 1
        self.drafters.observe(r.bucket, r.asked, r.drafted, r.width, r.draft_s, self.rounds, r.caught, r.catchup_s)
        self.since_draft = self.since_draft + 1 if r.asked == 0 else 0
