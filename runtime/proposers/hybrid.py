"""Fallback: one proposer where the context repeats itself, another everywhere else (lookup+medusa, suffix+medusa,
lookup+eagle: runtime/methods.py names the pairs).

The two drafters are right in different places: a prompt-lookup match of 2+ tokens copies text the
model is about to repeat (summaries, code edits), and is then a far surer guess than the heads;
with no such match (chat, translation) prompt lookup drafts nothing or a 1-token guess that is right less
often than Medusa's first head (docs/runtime-notes.md, "lookup+medusa: which drafter when").
So each round takes the primary's draft after a match of at least `min_match` tokens, else the secondary's.
Buckets are the primary's (one per match size, then "no match"), so the adaptive controller sizes its drafts per
match size as for the primary alone, and for the secondary's buckets caps its depth (0 = off) from their own
acceptance and pass costs. The secondary observes every pass, so heads are ready whenever a round has no match.
"""

from __future__ import annotations

from ..verify import Draft, VerifyResult
from .base import Context, HiddenRows, Proposer


class Fallback(Proposer):
    adaptive = True

    def __init__(self, name: str, primary: Proposer, secondary: Proposer, min_match: int = 2):
        """primary: a proposer that drafts from matches (its `match_sizes`: the match length each bucket starts at);
        secondary: the one that drafts when it matched fewer than min_match tokens."""
        self.name, self.primary, self.secondary = name, primary, secondary
        self.buckets = primary.buckets
        self.max_tokens = max(primary.max_tokens, secondary.max_tokens)
        # buckets >= first_secondary: a match shorter than min_match, or none
        self.first_secondary = sum(1 for n in primary.match_sizes if n >= min_match)
        # the secondary drafts nothing before it has read a pass (heads) or the prompt: the primary's rule decides
        self.reads_prompt = primary.reads_prompt
        self.reads_hidden = secondary.reads_hidden or primary.reads_hidden
        self._keep = [p for p in (primary, secondary) if p.keeps_state]
        self.keeps_state = bool(self._keep)

    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        self.primary.start(ctx, sampling, rng)
        self.secondary.start(ctx, sampling, rng)

    def bucket(self, ctx: Context) -> int:
        return self.primary.bucket(ctx)

    def propose(self, ctx: Context, k: int) -> Draft:
        if self.primary.bucket(ctx) < self.first_secondary:
            self.secondary.propose(ctx, 0)  # no draft (nor heads run) this round; it still tracks the pass
            return self.primary.propose(ctx, k)
        return self.secondary.propose(ctx, k)

    def observe(self, result: VerifyResult, hidden: HiddenRows | None = None) -> None:
        self.primary.observe(result, hidden)
        self.secondary.observe(result, hidden)

    def save_state(self, limit: int) -> "States":
        return States([p.save_state(limit) for p in self._keep])

    def load_state(self, ids, state: "States") -> None:
        for p, s in zip(self._keep, state):
            p.load_state(ids, s)


class States(list):
    """save_state's copies of the parts that keep a cache, in order."""

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self)
