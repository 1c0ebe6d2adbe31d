"""The proposer contract, its defaults, and what the loop hands a proposer to read.

A proposer drafts up to k tokens after the context; the speculative loop verifies them against
the target in one pass and tells the proposer what was accepted. Proposers never see logits of
the target and never emit tokens themselves, so whatever they propose, the output is the target's.
They are handed what they read: the context (with how much of it the target's cache holds) and,
for heads that read the target's hidden states, the rows of each pass (HiddenRows).
"""

from __future__ import annotations

import numpy as np

from ..control import Source
from ..sampling import SamplingParams
from ..verify import Draft, VerifyResult


class Context:
    """Prompt + emitted tokens in one int64 buffer allocated once per request.

    ids:       [length] view of the tokens so far (prompt first). The last ones may not be in the
               target's KV cache yet (the loop feeds them with the next pass).
    committed: how many of them the target's cache holds (the loop keeps it; 0 outside the loop).
    """

    def __init__(self, prompt: list[int] | np.ndarray, capacity: int, *, cached: int = 0,
                 store_key: str | None = None, target_capacity: int | None = None):
        self.buf = np.empty(max(capacity, len(prompt)), np.int64)
        self.buf[: len(prompt)] = prompt
        self.length = len(prompt)
        self.prompt_length = len(prompt)
        self.cached = cached        # prompt tokens the target kept from the last request (KV reuse; 0 when off)
        self.committed = cached     # context tokens in the target's cache
        self.store_key = store_key  # the request's scope for stores kept across requests (suffix decoding's answers)
        self.target_capacity = target_capacity  # positions the target's cache is laid out for (None: outside the loop)

    @property
    def ids(self) -> np.ndarray:
        return self.buf[: self.length]

    def extend(self, tokens: np.ndarray, committed: int | None = None) -> None:
        """Append tokens; committed: the target's cache now holds that many of the context."""
        n = len(tokens)
        if self.length + n > self.buf.size:  # only past max_context; the engine refuses first
            self.buf = np.concatenate([self.buf, np.empty(max(n, self.buf.size), np.int64)])
        self.buf[self.length: self.length + n] = tokens
        self.length += n
        if committed is not None:
            self.committed = committed


class HiddenRows:
    """The target's final-norm hidden states of its last pass, as the loop hands them to a proposer whose heads
    read them (Medusa, EAGLE): host rows, or (device) the rows' addresses on the target's GPU, for heads there,
    so that no row crosses to the host."""

    def __init__(self, engine, device: bool):
        self._engine, self.device = engine, device

    @classmethod
    def open(cls, engine, wants: str | None) -> "HiddenRows | None":
        """Opt the engine in for a proposer's `reads_hidden` (None: it reads none)."""
        if wants is None:
            return None
        device = wants == "device" and engine.hidden_on_device
        engine.enable_hidden(device_only=True) if device else engine.enable_hidden()
        return cls(engine, device)

    def __len__(self) -> int:
        return self._engine.hidden_rows if self.device else self._engine.hidden.shape[0]

    def row(self, i: int):
        """Row i of the last pass: a host copy, or its device address."""
        return self._engine.hidden_address(i) if self.device else self._engine.hidden[i].copy()

    def rows(self, rows: np.ndarray):
        """Those rows of the last pass: a host copy [n, hidden], or their device addresses [n]."""
        return self._engine.hidden_addresses(rows) if self.device else self._engine.hidden[rows]


class Proposer:
    """What every proposer is, with the defaults most take; a subclass sets name and max_tokens and drafts."""

    name: str        # what --speculate calls it; reported as Stats.proposer
    max_tokens: int  # the most tokens one draft may hold (the adaptive controller's ceiling)
    # True: the draft length follows the adaptive controller (AdaptiveK, a chain model); False: the
    # proposer sized its drafts itself (Medusa's tree, chosen at build time) and always gets max_tokens
    adaptive = True
    # Drafts of different kinds are right at different rates (a 6-token prompt-lookup match is a
    # surer guess than a 1-token one): the controller keeps acceptance per bucket, 0..buckets - 1
    buckets = 1
    # True: it must read the prompt before it can draft (a draft model's own prefill); the loop then runs the
    # first round on the target alone, so the first token waits for the target's prefill only
    reads_prompt = False
    # the target's hidden rows it reads (observe's `hidden`): None, "host", or "device" (its heads take device
    # addresses: the rows stay on the target's GPU where the target gives them so, else come to the host)
    reads_hidden: str | None = None
    # True: it keeps a cache of its own that follows the target's across requests (save_state, load_state)
    keeps_state = False
    # True: how often its drafts are kept is the model pair's more than the text's (a draft model), so the
    # controller carries its measured acceptance from request to request (short voice turns would otherwise
    # each start from the prior; docs/voice.md, "Why auto drafted little on voice turns")
    pair_acceptance = False
    # seconds the last propose spent reading context it had not seen yet (a draft model's catch-up prefill of a
    # new turn), included in the loop's draft time but not in the controller's cost of a drafted token; and the
    # context tokens it read then
    catchup_s = 0.0
    catchup_n = 0

    @property
    def sources(self) -> tuple[Source, ...]:
        """Its drafters as the controller keeps them apart (several: runtime/proposers/sources.py)."""
        return (Source(self.name, self.buckets, self.pair_acceptance),)

    def source(self, bucket: int) -> str:
        """The name of the drafter a bucket's drafts come from (Stats.drafted_by_source)."""
        return self.name

    def take_choice(self, choose) -> None:
        """The controller's choice of drafter per round, for a proposer of several (Sources); one drafter has none."""

    def bucket(self, ctx: Context) -> int:
        """The bucket of the draft the next propose(ctx, k) would make; called just before it."""
        return 0

    def unread(self, ctx: Context) -> int:
        """Context tokens a propose(ctx, k >= 1) now would read in a catch-up first (the controller charges them:
        runtime/choice.py, SourceTable.surcharge)."""
        return 0

    def start(self, ctx: Context, sampling: SamplingParams | None = None, rng: np.random.Generator | None = None):
        """A new request: forget the previous one (cache, index)."""

    def propose(self, ctx: Context, k: int) -> Draft:
        """Up to k tokens (a chain or a tree with depth <= k) after ctx.ids; may be empty. Near the end
        of the context the loop keeps only a tree's first nodes, as many as the cache has room for."""
        raise NotImplementedError

    def observe(self, result: VerifyResult, hidden: HiddenRows | None = None) -> None:
        """What the target kept of the last draft (called once per propose, before ctx grows); hidden: the rows of
        that pass, for a proposer that reads them."""

    def save_state(self, limit: int):
        """Its cache for KV reuse (Generator.prefix_store): its first `limit` positions at most (keeps_state)."""
        raise NotImplementedError

    def load_state(self, ids, state) -> None:
        """Put a save_state copy back; ids: the sequence it was saved from."""
        raise NotImplementedError


class HeldTokens:
    """For proposers with a cache of their own that follows the target's across requests (a draft model, an EAGLE
    head): which tokens that cache holds, position by position. During a request it holds a prefix of the
    request's context (follow), whose ids grow as the request runs; after a load_state, of the kept sequence's."""

    keeps_state = True
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
