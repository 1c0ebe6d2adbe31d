"""DraftModel: a smaller model with the same tokenizer drafts k tokens autoregressively.

Drafting is greedy (q = None, one-hot) under greedy sampling and sampled otherwise, with q[i],
the distribution token i was drawn from, kept for exact verification (Leviathan et al.): both
go through `probs_from_logits` with the request's SamplingParams.

More: docs/runtime-notes.md, "Module notes: runtime/proposers/draft_model.py".
"""

from __future__ import annotations

import time

import numpy as np

from ...errors import SpecrtError
from ..engine import Engine, KVSnapshot
from ..prefix_cache import common_prefix
from ..sampling import SamplingParams, probs_from_logits, sample
from ..verify import Draft, VerifyResult
from .base import EMPTY, Context, HeldTokens, Proposer

# Unread context tokens (a new turn's) read in a pass of their own before drafting, so that their prefill is timed
# apart (Proposer.catchup_s) and does not count as drafting; the usual one or two after a round stay in the first
# draft step
CATCHUP_APART = 4


class DraftModel(HeldTokens, Proposer):
    name = "draft"
    reads_prompt = True  # its prefill waits until the target's first token is out
    pair_acceptance = True

    def __init__(self, engine: Engine, max_tokens: int = 8, sampled: bool | None = None):
        """sampled: None = sample when the request samples, greedy otherwise; True/False force it."""
        if not 1 <= max_tokens < engine.max_pass_tokens:
            raise SpecrtError(f"draft max_tokens must be in 1..{engine.max_pass_tokens - 1}, got {max_tokens}")
        self.engine, self.max_tokens, self.sampled = engine, max_tokens, sampled
        self._tokens = np.empty(max_tokens, np.int64)
        self._q: np.ndarray | None = None     # [max_tokens, V], allocated on the first sampled request
        self._sample = False
        self._base = 0                        # context length when the last draft was proposed
        engine.forward(np.zeros(1, np.int64))  # ORT initialises lazily: pay it here, not in the first TTFT
        engine.rewind(0)

    def held(self) -> np.ndarray:
        """The tokens the draft's cache holds, position by position (a prefix of the last request's context)."""
        return self.held_tokens(self.engine.length)

    def save_state(self, limit: int) -> KVSnapshot:
        """The draft's cache for KV reuse (Generator.prefix_store): its first min(length, limit) positions."""
        return self.engine.save_prefix(min(self.engine.length, limit))

    def load_state(self, ids, snapshot: KVSnapshot) -> None:
        """Put a save_state copy back; ids: the sequence it was saved from."""
        self.engine.load_prefix(snapshot)
        self.hold(ids, snapshot.length)

    def start(self, ctx: Context, sampling: SamplingParams, rng: np.random.Generator) -> None:
        # KV reuse, where the target reuses too: keep what the cache shares with this prompt (>= 1 token left to
        # feed, for the first logits); otherwise read it all, as a benchmark timing prefills expects
        self.engine.rewind(common_prefix(self.held(), ctx.ids, ctx.length - 1) if ctx.cached else 0)
        self.follow(ctx)
        self.engine.reserve(ctx.target_capacity or self.engine.max_context)
        self.sampling, self.rng = sampling, rng
        self._sample = (not sampling.greedy) if self.sampled is None else self.sampled
        if self._sample and self._q is None:
            self._q = np.empty((self.max_tokens, self.engine.vocab_size), np.float32)

    def unread(self, ctx: Context) -> int:
        n = len(ctx.ids) - self.engine.length
        return n - 1 if n > CATCHUP_APART else 0

    def propose(self, ctx: Context, k: int) -> Draft:
        eng = self.engine
        self._base, self.catchup_s, self.catchup_n = ctx.length, 0.0, 0
        # room: the draft cache must hold the context plus k - 1 drafted tokens
        k = min(k, self.max_tokens, eng.max_context - ctx.length + 1)
        if k < 1:
            return EMPTY
        feed, caught = ctx.ids[eng.length:], self.unread(ctx)
        if caught:
            t0 = time.perf_counter()
            eng.argmax(feed[:caught])
            eng.commit(caught)
            feed, self.catchup_n = feed[caught:], caught
            self.catchup_s = time.perf_counter() - t0
        for i in range(k):
            if self._sample:  # the draft's distribution after the context + tokens[:i]
                q = probs_from_logits(eng.forward(feed), self.sampling, out=self._q[i:i + 1])
                self._tokens[i] = sample(q[0], self.rng)
            else:
                self._tokens[i] = eng.argmax(feed)[0]
            eng.commit(len(feed))
            feed = self._tokens[i:i + 1]
        return Draft(self._tokens[:k], q=self._q[:k] if self._sample else None)

    def observe(self, result: VerifyResult, hidden=None) -> None:
        # keep the context and the accepted draft tokens; rejected ones are overwritten later
        self.engine.rewind(min(self.engine.length, self._base + result.num_accepted))
