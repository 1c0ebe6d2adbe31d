"""Sources: several drafters side by side, one of them drafting each round (auto's: the set's draft model or heads,
prompt lookup, suffix decoding of earlier answers; runtime/methods.py names the sets).

Which one drafts is the controller's choice (AdaptiveK.choose, LoadK.choose): each source keeps its own buckets
of the controller's, so its acceptance, draft cost and pass widths are measured apart as requests run, and the
round goes to the source whose current kind of draft promises the most tokens per second. On a server whose
requests repeat, suffix decoding's long matches in earlier answers then win the rounds; where they stop paying,
the base drafter takes them back (docs/voice.md, "auto learns from the workload"). The sources that do not draft
a round still see it (propose(ctx, 0), observe), as a Fallback's secondary does, so each is ready when chosen.
"""

from __future__ import annotations

from ..control import Source
from ..verify import Draft, VerifyResult
from .base import Context, HiddenRows, Proposer
from .hybrid import States


class Sources(Proposer):
    adaptive = True

    def __init__(self, name: str, parts: list[Proposer]):
        """parts: the drafters, the base first (it drafts unless another beats it clearly)."""
        self.name, self.parts = name, parts
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + p.buckets)
        self.buckets = self.offsets[-1]
        self.max_tokens = max(p.max_tokens for p in parts)
        self.reads_prompt = any(p.reads_prompt for p in parts)
        self.reads_hidden = next((p.reads_hidden for p in parts if p.reads_hidden), None)
        self._keep = [p for p in parts if p.keeps_state]
        self.keeps_state = bool(self._keep)
        # the controller's (make_decoder); a fixed --draft-tokens keeps the base
        self.choose = lambda buckets, unread: 0
        self.chosen = 0

    def take_choice(self, choose) -> None:
        self.choose = choose

    @property
    def sources(self) -> tuple[Source, ...]:
        return tuple(Source(p.name, p.buckets, p.pair_acceptance) for p in self.parts)

    def source(self, bucket: int) -> str:
        return self.parts[max(i for i, o in enumerate(self.offsets[:-1]) if o <= bucket)].name

    @property
    def catchup_s(self) -> float:
        return self.parts[self.chosen].catchup_s

    @property
    def catchup_n(self) -> int:
        return self.parts[self.chosen].catchup_n

    def unread(self, ctx: Context) -> int:
        return self.parts[self.chosen].unread(ctx)

    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        for p in self.parts:
            p.start(ctx, sampling, rng)
        self.chosen = 0

    def bucket(self, ctx: Context) -> int:
        buckets = [o + p.bucket(ctx) for o, p in zip(self.offsets, self.parts)]
        self.chosen = self.choose(buckets, [p.unread(ctx) for p in self.parts])
        return buckets[self.chosen]

    def propose(self, ctx: Context, k: int) -> Draft:
        for i, p in enumerate(self.parts):
            if i != self.chosen:
                p.propose(ctx, 0)  # no draft (nor heads run) this round; it still tracks the pass
        return self.parts[self.chosen].propose(ctx, k)

    def observe(self, result: VerifyResult, hidden: HiddenRows | None = None) -> None:
        for p in self.parts:
            p.observe(result, hidden)

    def save_state(self, limit: int) -> States:
        return States([p.save_state(limit) for p in self._keep])

    def load_state(self, ids, state: States) -> None:
        for p, s in zip(self._keep, state):
            p.load_state(ids, s)
