"""The speculative loop's one hook for constraints on the output (a grammar): what a round's pass may emit.

`NoConstraint` (every token allowed) is the default and does nothing; `GrammarConstraint` holds a request's grammar
(runtime/grammar.py): the tokens it forces join the round's pass undrafted, a draft is cut at its first forbidden
token, every row the pass returns is masked, and the matcher moves by what the round emitted
(docs/runtime-notes.md, "Grammars under speculation").
"""

from __future__ import annotations

import time

import numpy as np

from .grammar import MAX_FORCED, Grammar, emitted_allowed, masked
from .verify import Draft, VerifyResult, verify_greedy


class NoConstraint:
    """No constraint: nothing forced, the draft as it is, the target's pass as the verifier reads it."""

    def forced(self, ctx) -> list[int]:
        """Tokens the constraint leaves no choice about, appended to ctx (this round's pass takes them along)."""
        return []

    def draft(self, draft: Draft) -> Draft:
        """The draft to verify."""
        return draft

    def verify(self, target, pending: np.ndarray, draft: Draft) -> VerifyResult:
        """Step 2 through the constraint: target (speculative.Verifier) over pending + the draft's nodes."""
        return target(pending, draft)

    def advance(self, tokens: np.ndarray) -> None:
        """The round emitted tokens."""


class GrammarConstraint(NoConstraint):
    """A request's grammar, timed into stats.grammar_s. Greedy on an engine with a logit screen: the screen's
    tokens wherever the grammar allows each one, else the same pass in full, as in generate._plain_constrained."""

    def __init__(self, grammar: Grammar, engine, greedy: bool, stats):
        self.grammar, self.engine, self.greedy, self.stats = grammar, engine, greedy, stats
        self.screen = self.try_screen = greedy and engine.screen
        self.masks: np.ndarray | None = None
        self.n_forced = 0

    def forced(self, ctx) -> list[int]:
        self.n_forced = 0
        if not self.engine.width_exact:  # a wider pass would not give the same logits
            return []
        t = time.perf_counter()
        forced = self.grammar.forced(min(MAX_FORCED, self.engine.max_context - ctx.length))
        ctx.extend(np.asarray(forced, np.int64))
        self.n_forced = len(forced)
        self.stats.grammar_s += time.perf_counter() - t
        return forced

    def draft(self, draft: Draft) -> Draft:  # a chain stops at its first token the grammar forbids
        t = time.perf_counter()
        draft, self.masks = self.grammar.check_draft(draft, self.greedy)
        self.stats.grammar_s += time.perf_counter() - t
        return draft

    def verify(self, target, pending: np.ndarray, draft: Draft) -> VerifyResult:
        tokens, pos, mask = target.inputs(pending, draft)
        rows, masks = draft.tokens.size + 1, self.masks
        if self.try_screen and len(pending) - self.n_forced == 1:  # the screen's tokens where the grammar allows each
            result = verify_greedy(self.engine.argmax(tokens, pos, mask, num_logits=rows), draft)
            if emitted_allowed(result, masks):
                return result  # else the same pass, in full: the screen's argmax knows no mask
        raw = self.engine.forward(tokens, pos, mask, num_logits=rows)
        logits = masked(raw, masks)
        if not self.greedy:
            return target.sampled(logits, draft)
        result = verify_greedy(logits.argmax(-1), draft)
        self.try_screen = self.screen and bool((raw[result.rows].argmax(-1) == result.tokens).all())
        return result

    def advance(self, tokens: np.ndarray) -> None:
        t = time.perf_counter()
        self.grammar.advance(tokens.tolist())
        self.stats.grammar_s += time.perf_counter() - t


def constraint(grammar: Grammar | None, engine, greedy: bool, stats) -> NoConstraint:
    """The loop's constraint of a request: its grammar's, or none."""
    return NoConstraint() if grammar is None else GrammarConstraint(grammar, engine, greedy, stats)
