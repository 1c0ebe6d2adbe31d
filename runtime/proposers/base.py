"""The proposer contract and the token context it reads.

A proposer drafts up to k tokens after the context; the speculative loop verifies them against
the target in one pass and tells the proposer what was accepted. Proposers never see logits of
the target and never emit tokens themselves, so whatever they propose, the output is the target's.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..sampling import SamplingParams
from ..verify import Draft, VerifyResult


class Context:
    """Prompt + emitted tokens in one int64 buffer allocated once per request.

    ids:    [length] view of the tokens so far (prompt first). The last ones may not be in the
            target's KV cache yet (the loop feeds them with the next pass).
    """

    def __init__(self, prompt: list[int] | np.ndarray, capacity: int):
        self.buf = np.empty(max(capacity, len(prompt)), np.int64)
        self.buf[: len(prompt)] = prompt
        self.length = len(prompt)
        self.prompt_length = len(prompt)
        self.target = None  # the target engine, for proposers that read its hidden states (Medusa)
        self.cached = 0     # prompt tokens the target kept from the last request (KV reuse; 0 when off)
        self.store_key = None  # the request's scope for stores kept across requests (suffix decoding's answers)

    @property
    def ids(self) -> np.ndarray:
        return self.buf[: self.length]

    def extend(self, tokens: np.ndarray) -> None:
        n = len(tokens)
        if self.length + n > self.buf.size:  # only past max_context; the engine refuses first
            self.buf = np.concatenate([self.buf, np.empty(max(n, self.buf.size), np.int64)])
        self.buf[self.length: self.length + n] = tokens
        self.length += n


class Proposer(Protocol):
    name: str        # what --speculate calls it; reported as Stats.proposer
    max_tokens: int  # the most tokens one draft may hold (the adaptive controller's ceiling)
    # True: the draft length follows the adaptive controller (AdaptiveK, a chain model); False: the
    # proposer sized its drafts itself (Medusa's tree, chosen at build time) and always gets max_tokens
    adaptive: bool
    # Drafts of different kinds are right at different rates (a 6-token prompt-lookup match is a
    # surer guess than a 1-token one): the controller keeps acceptance per bucket, 0..buckets - 1
    buckets: int
    # True: it must read the prompt before it can draft (a draft model's own prefill); the loop then runs the
    # first round on the target alone, so the first token waits for the target's prefill only. Absent = False.
    reads_prompt: bool

    def bucket(self, ctx: Context) -> int:
        """The bucket of the draft the next propose(ctx, k) would make; called just before it."""

    def start(self, ctx: Context, sampling: SamplingParams, rng: np.random.Generator) -> None:
        """A new request: forget the previous one (cache, index)."""

    def propose(self, ctx: Context, k: int) -> Draft:
        """Up to k tokens (a chain or a tree with depth <= k) after ctx.ids; may be empty. Near the end
        of the context the loop keeps only a tree's first nodes, as many as the cache has room for."""

    def observe(self, result: VerifyResult) -> None:
        """What the target kept of the last draft (called once per propose, before ctx grows)."""


class OneBucket:
    """For proposers whose drafts are all of one kind: the controller keeps one acceptance profile."""

    buckets = 1

    def bucket(self, ctx: Context) -> int:
        return 0


class HeldTokens:
    """For proposers with a cache of their own that follows the target's across requests (a draft model, an EAGLE
    head): which tokens that cache holds, position by position. During a request it holds a prefix of the
    request's context (follow), whose ids grow as the request runs; after a load_state, of the kept sequence's."""

    _held = np.zeros(0, np.int64)
    _ctx: Context | None = None

    def held_tokens(self, length: int) -> np.ndarray:
        ids = self._ctx.ids if self._ctx is not None else self._held
        return ids[:length]

    def follow(self, ctx: Context) -> None:
        self._ctx = ctx

    def hold(self, ids, n: int) -> None:
        self._held, self._ctx = np.asarray(ids[:n], np.int64), None


EMPTY = Draft(np.zeros(0, np.int64))
