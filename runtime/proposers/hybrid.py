"""LookupMedusa: prompt lookup where the context repeats itself, Medusa's tree everywhere else (LookupEagle: the
EAGLE head's draft instead of Medusa's; SuffixMedusa: suffix decoding's tree, from earlier answers too, instead of
prompt lookup's).

The two drafters are right in different places: a prompt-lookup match of 2+ tokens copies text the
model is about to repeat (summaries, code edits), and is then a far surer guess than the heads;
with no such match (chat, translation) prompt lookup drafts nothing or a 1-token guess that is right less
often than Medusa's first head (docs/runtime-notes.md, "lookup+medusa: which drafter when").
So each round takes prompt lookup's draft after a match of at least `min_match` tokens, else
Medusa's tree. Buckets are prompt lookup's (one per matched n-gram size, then "no match"), so the
adaptive controller sizes lookup drafts per match size as it does for prompt lookup alone, and for
the Medusa buckets caps the tree's depth (0 = off) from their own acceptance and pass costs.

The heads read the hidden state of the last accepted position of every pass, lookup rounds
included, so Medusa is ready whenever the next round has no match.
"""

from __future__ import annotations

from ..verify import Draft, VerifyResult
from .base import Context
from .medusa import Medusa
from .prompt_lookup import PromptLookup


class LookupMedusa:
    name = "lookup+medusa"
    adaptive = True

    def __init__(self, lookup: PromptLookup, medusa: Medusa, min_match: int = 2):
        """medusa: Medusa's heads, or any proposer that reads the target's passes the same way (an EAGLE head:
        LookupEagle)."""
        self.lookup, self.medusa = lookup, medusa
        self.buckets = lookup.buckets
        self.max_tokens = max(lookup.max_tokens, medusa.max_tokens)
        # buckets >= first_medusa: a match shorter than min_match, or none
        self.first_medusa = sum(1 for n in lookup.match_sizes if n >= min_match)

    def start(self, ctx: Context, sampling=None, rng=None) -> None:
        self.lookup.start(ctx, sampling, rng)
        self.medusa.start(ctx, sampling, rng)

    def bucket(self, ctx: Context) -> int:
        return self.lookup.bucket(ctx)

    def propose(self, ctx: Context, k: int) -> Draft:
        if self.lookup.bucket(ctx) < self.first_medusa:
            self.medusa.propose(ctx, 0)  # no tree (nor heads run) this round; Medusa still tracks the pass
            return self.lookup.propose(ctx, k)
        return self.medusa.propose(ctx, k)

    def observe(self, result: VerifyResult) -> None:
        self.lookup.observe(result)
        self.medusa.observe(result)


class LookupEagle(LookupMedusa):
    """Prompt lookup after a match of 2+ tokens, the EAGLE head's draft otherwise; the head's own cache follows the
    target's across requests (KV reuse) as it does alone."""

    name = "lookup+eagle"

    def save_state(self, limit: int):
        return self.medusa.save_state(limit)

    def load_state(self, ids, state) -> None:
        self.medusa.load_state(ids, state)


class SuffixMedusa(LookupMedusa):
    """Suffix decoding's tree after a match of 2+ tokens (in the request or in earlier answers), Medusa's
    otherwise."""

    name = "suffix+medusa"
    reads_prompt = True  # as suffix decoding alone: its local trie reads the prompt after the first token
