"""The speculative loop: propose -> verify (one target pass) -> commit (KV) -> observe.

Contract: `speculative_decode` is a decode strategy for `Generator.stream(decode=...)`: it yields
the tokens of each round and knows nothing about text or stop conditions. Whatever a proposer
drafts, every emitted token comes from `verify`/`verify_greedy` on the target's own logits, so
greedy output equals target-only greedy output and sampled output has the target's distribution
(on width-exact engines: a K-token pass must give the logits of K one-token passes; where the
manifest says it does not, e.g. int8 activations, Stats.exact is False).

More: docs/runtime-notes.md, "Module notes: runtime/speculative.py".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from ..errors import SpecrtError
from ..manifest import Manifest
from .constraint import constraint
from .control import AdaptiveK, Controller, FixedK, GatedK, Round
from .engine import Engine, EngineOptions, open_eagle, open_engine, open_heads
from .generate import Decoder, PlainDecoder, Stats
from .grammar import Grammar
from .methods import METHODS
from .plan import Plan, SpeculativeConfig, make_plan
from .proposers import Context, DraftModel, HiddenRows, PromptLookup, Proposer
from .proposers.eagle import Eagle
from .proposers.hybrid import Fallback
from .proposers.medusa import Medusa
from .proposers.sources import Sources
from .proposers.suffix import SuffixDecoding, SuffixStores
from .sampling import SamplingParams, probs_from_logits
from .tree import tree_layout
from .verify import Draft, VerifyResult, verify, verify_greedy, verify_typical

def speculative_decode(engine: Engine, prompt: list[int], sampling: SamplingParams, rng: np.random.Generator,
                       stats: Stats, *, proposer: Proposer, control: Controller, accept=verify,
                       grammar: Grammar | None = None, store_key: str | None = None) -> Iterator[list[int]]:
    """accept: the sampled-mode verification (`verify`, lossless; `verify_typical` only on the
    explicit, lossy opt-in, which Stats.exact and Stats.lossy report). grammar: every row the target's pass
    returns is masked to what the grammar allows after that row's context (runtime/constraint.py). store_key: the
    request's scope in the stores a proposer keeps across requests (suffix decoding's earlier answers)."""
    engine.rewind(stats.cached_tokens)  # KV reuse (Generator.keep_cache): the first pass feeds the rest
    ctx = Context(prompt, engine.max_context + 1, cached=stats.cached_tokens, store_key=store_key,
                  target_capacity=engine.capacity)
    hidden = HiddenRows.open(engine, proposer.reads_hidden)  # the rows each pass gives heads that read them
    proposer.start(ctx, sampling, rng)
    control.start()
    check, target = constraint(grammar, engine, sampling.greedy, stats), Verifier(engine, sampling, rng, accept)
    tally = ByPosition(engine.max_pass_tokens)
    stats.proposer = proposer.name
    first = proposer.reads_prompt  # the first round is the target's alone (see Proposer)
    try:
        while True:
            # 1. propose up to k tokens after the context (k = 0: this round is plain decoding), after the tokens
            #    the constraint leaves no choice about (this round's pass takes them along, undrafted)
            t0 = time.perf_counter()
            forced = check.forced(ctx)
            bucket = proposer.bucket(ctx)
            room = engine.max_context - ctx.length  # draft nodes the cache still has places for
            k = 0 if first or forced else min(control.k(bucket, proposer.unread(ctx)), room)
            first = False
            draft = proposer.propose(ctx, k)
            if draft.tokens.size > room:  # a tree of depth <= k can hold more nodes than fit (at the context end)
                draft = draft.first(room)
            draft = check.draft(draft)  # a chain stops at its first token the constraint forbids
            # 2. verify: one target pass over the pending token(s) + the n draft nodes gives p [n + 1, V]
            t1 = time.perf_counter()
            pending = ctx.ids[engine.length:]
            P, n = len(pending), draft.tokens.size
            result = check.verify(target, pending, draft)
            # 3. commit the pending tokens and the accepted path; rejected nodes are overwritten later
            t2 = time.perf_counter()
            engine.commit(P + result.num_accepted, None if draft.parents is None else
                          np.concatenate([np.arange(P), P + result.path]))
            check.advance(result.tokens)
            # 4. observe: the proposer syncs its state, the controller and the stats learn from the round
            proposer.observe(result, hidden)
            caught = proposer.catchup_s
            r = Round(bucket, k, n, P + n, result, t1 - t0 - caught, t2 - t1, P > 1, caught, proposer.catchup_n,
                      len(forced))
            control.observe(r)
            stats.observe(r, engine.width_exact)
            if n:  # which drafter drafted (auto's choice)
                by = stats.drafted_by_source
                by[proposer.source(bucket)] = by.get(proposer.source(bucket), 0) + 1
            tally.add(result.acceptance)
            ctx.extend(result.tokens, committed=engine.length)
            yield forced + result.tokens.tolist()
    finally:  # the Generator closes us when it stops
        tally.write(stats)


class Verifier:
    """Step 2 of the loop: one target pass over the pending tokens and a draft's nodes, and what it keeps."""

    def __init__(self, engine: Engine, sampling: SamplingParams, rng: np.random.Generator, accept=verify):
        self.engine, self.sampling, self.rng, self.accept = engine, sampling, rng, accept
        self.probs = None if sampling.greedy else np.empty((engine.max_pass_tokens, engine.vocab_size), np.float32)

    def inputs(self, pending: np.ndarray, draft: Draft) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The pass's tokens, and a tree's positions and mask (None for a chain)."""
        pos, mask = (None, None) if draft.parents is None else tree_inputs(self.engine.length, len(pending),
                                                                            draft.parents)
        return np.concatenate([pending, draft.tokens]), pos, mask

    def __call__(self, pending: np.ndarray, draft: Draft) -> VerifyResult:
        tokens, pos, mask = self.inputs(pending, draft)
        rows = draft.tokens.size + 1
        if self.sampling.greedy:  # argmax(): exact, through the logit screen where the engine has one
            return verify_greedy(self.engine.argmax(tokens, pos, mask, num_logits=rows), draft)
        return self.sampled(self.engine.forward(tokens, pos, mask, num_logits=rows), draft)

    def sampled(self, logits: np.ndarray, draft: Draft) -> VerifyResult:
        """The sampled-mode verification of the pass's logits [n + 1, V]."""
        n = draft.tokens.size
        return self.accept(probs_from_logits(logits, self.sampling, out=self.probs[: n + 1]), draft, self.rng)


class ByPosition:
    """Per draft position, rounds that drafted it and that kept it: written to Stats once, with the denominators,
    so runs pool by counts (a bench's mean of rates weighs a 1-round run fully)."""

    def __init__(self, positions: int):
        self.drafted, self.accepted = np.zeros(positions, np.int64), np.zeros(positions, np.int64)

    def add(self, acceptance: np.ndarray) -> None:
        d = acceptance.size
        self.drafted[:d] += 1
        self.accepted[:d] += acceptance

    def write(self, stats: Stats) -> None:
        used = self.drafted > 0
        stats.acceptance_by_position = np.round(self.accepted[used] / self.drafted[used], 4).tolist()
        stats.drafted_by_position = self.drafted[used].tolist()


def tree_inputs(length: int, P: int, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """positions [P + n] (= length + offset, pending first) and additive tree_mask [P + n, P + n] (tree.tree_layout)."""
    offsets, mask = tree_layout(parents, P)
    return length + offsets, mask


class Opener:
    """How make_decoder opens the engines a proposer runs: each on its own, on the target's backend. A batch
    (runtime/batch_session.py) gives each stream a slot of a shared draft engine instead."""

    def engine(self, root, entry, options: EngineOptions) -> Engine:
        return open_engine(root, entry, options)

    def heads(self, root, entry, options: EngineOptions):
        return open_heads(root, entry, options)

    def eagle(self, root, entry, options: EngineOptions):
        return open_eagle(root, entry, options)

    def suffix_store(self, cfg: "SpeculativeConfig") -> SuffixStores | None:
        """The stores of earlier answers a suffix proposer drafts from (None: the request's own text only)."""
        return SuffixStores(int(cfg.suffix_cache_mib * 2**20), SUFFIX_DEPTH) if cfg.suffix_cache_mib > 0 else None


OPEN = Opener()


def _prompt_lookup(manifest: Manifest, precision: str, options: EngineOptions, cfg: SpeculativeConfig,
                   opener: Opener = OPEN) -> Proposer:
    sizes = cfg.ngram_sizes
    if cfg.draft_tokens is not None:  # a fixed K after a 1-token match rarely pays (docs/runtime-notes.md,
        sizes = tuple(n for n in sizes if n >= 2) or sizes  # "Prompt lookup with a fixed K")
    return PromptLookup(sizes, cfg.draft_tokens or cfg.lookup_max_tokens)


def _suffix(manifest: Manifest, precision: str, options: EngineOptions, cfg: SpeculativeConfig,
            opener: Opener = OPEN) -> Proposer:
    return SuffixDecoding(opener.suffix_store(cfg), SUFFIX_DEPTH, factor=cfg.suffix_factor,
                          threshold=cfg.suffix_threshold, max_tokens=cfg.draft_tokens or cfg.lookup_max_tokens)


SUFFIX_DEPTH = 32  # substrings the tries count: a match of up to 16 tokens, and 16 more to draft


def proposer_entry(manifest: Manifest, role: str, precision: str):
    """The engine of a proposer role (draft, medusa, eagle) that runs beside a target at `precision`: the one at
    that precision, else the first; None where the set has none."""
    found = [e for e in manifest.engines.values() if e.role == role]
    return next((e for e in found if e.precision == precision), found[0] if found else None)


def draft_entry(manifest: Manifest, precision: str):
    """The draft engine `--speculate draft` runs: the draft at the target's precision, else the first one."""
    entry = proposer_entry(manifest, "draft", precision)
    if entry is None:
        raise SpecrtError(f"engine set '{manifest.root}' has no draft engine; rebuild it with "
                          "`specrt engines --source TARGET --draft DRAFT` or use --speculate prompt-lookup")
    return entry


def _draft_model(manifest: Manifest, precision: str, options: EngineOptions, cfg: SpeculativeConfig,
                 opener: Opener = OPEN) -> Proposer:
    eng = opener.engine(manifest.root, draft_entry(manifest, precision), replace(options, taking_turns=True))
    return DraftModel(eng, cfg.draft_tokens or cfg.draft_max_tokens, cfg.draft_sampled)


def _heads_entry(manifest: Manifest, role: str, what: str, fix: str, precision: str = "fp32"):
    """The set's entry of a heads role (at the target's precision, else the first), or the one-line error naming
    how to get one."""
    entry = proposer_entry(manifest, role, precision)
    if entry is None:
        raise SpecrtError(f"engine set '{manifest.root}' has no {what}; rebuild it with {fix}")
    return entry


def _medusa(manifest: Manifest, precision: str, options: EngineOptions, cfg: SpeculativeConfig,
            opener: Opener = OPEN) -> Proposer:
    e = _heads_entry(manifest, "medusa", "Medusa heads", "`specrt engines --medusa-heads heads/smollm2-135m.npz` "
                     "or use --speculate prompt-lookup", precision)
    return Medusa(opener.heads(manifest.root, e, options), [tuple(p) for p in e.medusa["tree"]])


EAGLE_MAX_NODES = 24  # the widest tree a round may verify; each round picks how many of its best nodes pay


def _eagle(manifest: Manifest, precision: str, options: EngineOptions, cfg: SpeculativeConfig,
           opener: Opener = OPEN) -> Proposer:
    e = _heads_entry(manifest, "eagle", "EAGLE head", "`specrt engines --eagle-head heads/smollm2-135m-eagle.npz` "
                     "or use --speculate medusa")
    cost = None if cfg.eagle_nodes else e.eagle.get("pass_seconds_by_width")  # a fixed size, or per round
    return Eagle(opener.eagle(manifest.root, e, options), cfg.draft_tokens or cfg.eagle_depth, tree=cfg.eagle_tree,
                 beam=cfg.eagle_beam, nodes=cfg.eagle_nodes or EAGLE_MAX_NODES, pass_cost=cost)


# a drafter's name in the method table (runtime/methods.py) -> the builder of its proposer
DRAFTERS: dict[str, Callable[..., Proposer]] = {"prompt-lookup": _prompt_lookup, "suffix": _suffix,
                                                 "draft": _draft_model, "medusa": _medusa, "eagle": _eagle}


def build_proposer(mode: str, manifest: Manifest, precision: str, options: EngineOptions, cfg: SpeculativeConfig,
                   opener: Opener = OPEN) -> Proposer:
    """The proposer of a --speculate method: its one drafter, its two as a Fallback (primary, then secondary), or the
    proposers of the methods it chooses among (Sources)."""
    method = METHODS[mode]
    if method.sources:
        return Sources(mode, [build_proposer(m, manifest, precision, options, cfg, opener) for m in method.sources])
    parts = [DRAFTERS[d](manifest, precision, options, cfg, opener) for d in method.drafters]
    return parts[0] if len(parts) == 1 else Fallback(mode, *parts)


class SpeculativeDecoder(Decoder):
    """A decode strategy for Generator.stream(decode=...): the speculative loop with one proposer and one
    controller, kept across requests (the controller's measured pass costs and per-bucket acceptance)."""

    def __init__(self, proposer: Proposer, control: Controller, accept=verify):
        self.proposer, self.control, self.accept = proposer, control, accept
        self.name = proposer.name

    def __call__(self, engine: Engine, prompt: list[int], sampling: SamplingParams, rng: np.random.Generator,
                 stats: Stats, grammar: Grammar | None = None, store_key: str | None = None) -> Iterator[list[int]]:
        return speculative_decode(engine, prompt, sampling, rng, stats, proposer=self.proposer, control=self.control,
                                  accept=self.accept, grammar=grammar, store_key=store_key)


def make_decoder(mode: str, manifest: Manifest, precision: str = "fp32", *,
                 options: EngineOptions = EngineOptions(), config: SpeculativeConfig = SpeculativeConfig(),
                 opener: Opener = OPEN, controller: Callable[[Proposer], Controller] | None = None):
    """The decoder of a --speculate name on a loaded set, its plan made here (runtime/plan.py; 'auto' resolved):
    decoder_of(make_plan(...)). Front ends make the plan once and call decoder_of."""
    return decoder_of(make_plan(manifest, precision, mode, options, config), opener, controller)


def decoder_of(plan: Plan, opener: Opener = OPEN, controller: Callable[[Proposer], Controller] | None = None):
    """The decoder of a plan: PlainDecoder for 'off', else a SpeculativeDecoder. Engines it opens (a draft model,
    heads) use the plan's options, on the target's backend, through `opener`. controller: makes the controller when
    no fixed --draft-tokens is asked (default: AdaptiveK, or GatedK for a proposer that sizes its own drafts)."""
    if plan.method is None:
        return PlainDecoder()
    k, config = plan.config.draft_tokens, plan.config
    proposer = build_proposer(plan.mode, plan.manifest, plan.precision, plan.options, config, opener)
    if k is not None:
        control = FixedK(k)
    elif controller is not None:
        control = controller(proposer)
    elif not proposer.adaptive:  # it sized its drafts itself (Medusa's tree, at build time): on or off
        control = GatedK(proposer.max_tokens)
    else:
        control = AdaptiveK(proposer.max_tokens, plan.target.width_exact, sources=proposer.sources)
    proposer.take_choice(control.choose)  # several drafters (Sources): the controller picks the one each round
    return SpeculativeDecoder(proposer, control, verify_typical if config.lossy_typical else verify)
