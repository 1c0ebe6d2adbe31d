"""The speculative loop: propose -> verify (one target pass) -> commit (KV) -> observe.

Contract: `speculative_decode` is a decode strategy for `Generator.stream(decode=...)`: it yields
the tokens of each round and knows nothing about text or stop conditions. Whatever a proposer
drafts, every emitted token comes from `verify`/`verify_greedy` on the target's own logits, so
greedy output equals target-only greedy output and sampled output has the target's distribution
(on width-exact engines: a K-token pass must give the logits of K one-token passes; where the
manifest says it does not, e.g. int8 activations, Stats.exact is False).

Glossary: pending = context tokens not yet in the target's cache (one, or the prompt on round 1);
k = draft length asked for (a tree's depth; 0 = plain decoding); tau = tokens per round. `AdaptiveK` picks k;
`make_decoder` maps a --speculate name to a proposer, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import SpecrtError
from ..manifest import Manifest
from .engine import OrtEngine
from .generate import Stats, plain_decode
from .proposers import Context, DraftModel, PromptLookup, Proposer
from .proposers.hybrid import LookupMedusa
from .proposers.medusa import Medusa, MedusaHeads
from .sampling import SamplingParams, probs_from_logits
from .tree import ancestry
from .verify import Draft, verify, verify_greedy, verify_typical

MAX_DRAFT_TOKENS = 32
MODES = ("off", "prompt-lookup", "draft", "medusa", "lookup+medusa", "auto")


def speculative_decode(engine: OrtEngine, prompt: list[int], sampling: SamplingParams, rng: np.random.Generator,
                       stats: Stats, *, proposer: Proposer, control, width_exact: bool = True,
                       accept=verify) -> Iterator[list[int]]:
    """accept: the sampled-mode verification (`verify`, lossless; `verify_typical` only on the
    explicit, lossy opt-in, which Stats.exact and Stats.lossy report)."""
    ctx = Context(prompt, engine.max_context + 1)
    ctx.target = engine
    engine.rewind(0)
    proposer.start(ctx, sampling, rng)
    control.start()
    probs = None if sampling.greedy else np.empty((engine.max_pass_tokens, engine.vocab_size), np.float32)
    drafted, accepted = np.zeros(engine.max_pass_tokens, np.int64), np.zeros(engine.max_pass_tokens, np.int64)
    stats.proposer = proposer.name
    try:
        while True:
            # 1. propose up to k tokens after the context (k = 0: this round is plain decoding)
            t0 = time.perf_counter()
            bucket = proposer.bucket(ctx)
            room = engine.max_context - ctx.length  # draft nodes the cache still has places for
            k = min(control.k(bucket), room)
            draft = proposer.propose(ctx, k)
            if draft.tokens.size > room:  # a tree of depth <= k can hold more nodes than fit (at the context end)
                draft = _first(draft, room)
            # 2. verify: one target pass over the pending token(s) + the n draft nodes gives p [n + 1, V]
            t1 = time.perf_counter()
            pending = ctx.ids[engine.length:]
            P, n = len(pending), draft.tokens.size
            pos, mask = (None, None) if draft.parents is None else tree_inputs(engine.length, P, draft.parents)
            logits = engine.forward(np.concatenate([pending, draft.tokens]), pos, mask, num_logits=n + 1)
            if sampling.greedy:
                result = verify_greedy(logits.argmax(axis=1), draft)
            else:
                result = accept(probs_from_logits(logits, sampling, out=probs[: n + 1]), draft, rng)
            # 3. commit the pending tokens and the accepted path; rejected nodes are overwritten later
            t2 = time.perf_counter()
            path = None if draft.parents is None else np.concatenate([np.arange(P), P + result.path])
            engine.commit(P + result.num_accepted, path)
            # 4. observe: the proposer syncs its state, the controller learns acceptance and costs
            proposer.observe(result)
            control.observe(asked=k, width=P + n, result=result, draft_s=t1 - t0, verify_s=t2 - t1, first=P > 1,
                            bucket=bucket)
            d = result.acceptance.size
            drafted[:d] += 1
            accepted[:d] += result.acceptance
            stats.rounds += 1
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.exact &= (width_exact or n == 0) and not result.lossy
            stats.lossy |= result.lossy
            out = result.tokens
            ctx.extend(out)
            yield out.tolist()
    finally:  # the Generator closes us when it stops: write the per-position acceptance once
        used = drafted > 0
        stats.acceptance_by_position = np.round(accepted[used] / drafted[used], 4).tolist()


def _first(draft: Draft, n: int) -> Draft:
    """The first n nodes of a draft: a chain's prefix, or a subtree (parents come before children)."""
    cut = lambda a: None if a is None else a[:n]  # noqa: E731
    return Draft(draft.tokens[:n], cut(draft.parents), cut(draft.q))


@lru_cache(maxsize=64)
def _tree_layout(parents: bytes, P: int) -> tuple[np.ndarray, np.ndarray]:
    depth, anc = ancestry(np.frombuffer(parents, np.int64))      # depth 1 = a root child
    n = depth.size
    offsets = np.concatenate([np.arange(P), P - 1 + depth])       # a root child sits right after the pending
    mask = np.zeros((P + n, P + n), np.float32)                   # pending tokens: causal (the graph adds it)
    mask[P:, P:] = np.where(anc, 0.0, -np.inf)                    # nodes see the pending tokens and ancestors
    return offsets, mask


def tree_inputs(length: int, P: int, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """positions [P + n] (= length + depth, pending first) and additive tree_mask [P + n, P + n]."""
    offsets, mask = _tree_layout(np.ascontiguousarray(parents, np.int64).tobytes(), P)
    return length + offsets, mask


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


@dataclass(frozen=True)
class SpeculativeConfig:
    draft_tokens: int | None = None         # fixed k; None = adaptive
    lossy_typical: bool = False             # Medusa's typical acceptance when sampling: NOT lossless
    ngram_sizes: tuple[int, ...] = (6, 4, 3, 2, 1)
    lookup_max_tokens: int = 16
    draft_max_tokens: int = 8
    draft_sampled: bool | None = None       # draft model: None = sample iff the request samples


def _prompt_lookup(manifest: Manifest, precision: str, threads: int, cfg: SpeculativeConfig) -> Proposer:
    sizes = cfg.ngram_sizes
    if cfg.draft_tokens is not None:
        # a fixed K drafts K tokens after any match; after a 1-token match the first is right ~22% of the
        # time (measured on the shipped prompts), which only pays with the short drafts AdaptiveK picks
        sizes = tuple(n for n in sizes if n >= 2) or sizes
    return PromptLookup(sizes, cfg.draft_tokens or cfg.lookup_max_tokens)


def _draft_model(manifest: Manifest, precision: str, threads: int, cfg: SpeculativeConfig) -> Proposer:
    drafts = [e for e in manifest.engines.values() if e.role == "draft"]
    if not drafts:
        raise SpecrtError(f"engine set '{manifest.root}' has no draft engine; rebuild it with "
                          "`specrt engines --source TARGET --draft DRAFT` or use --speculate prompt-lookup")
    e = next((d for d in drafts if d.precision == precision), drafts[0])
    eng = OrtEngine.from_entry(manifest.root, e, threads, taking_turns=True)
    return DraftModel(eng, cfg.draft_tokens or cfg.draft_max_tokens, cfg.draft_sampled)


def _medusa(manifest: Manifest, precision: str, threads: int, cfg: SpeculativeConfig) -> Proposer:
    heads = [e for e in manifest.engines.values() if e.role == "medusa"]
    if not heads:
        raise SpecrtError(f"engine set '{manifest.root}' has no Medusa heads; rebuild it with "
                          "`specrt engines --medusa-heads heads/smollm2-135m.npz` or use --speculate prompt-lookup")
    e = heads[0]
    return Medusa(MedusaHeads(manifest.root / e.file, threads=1), [tuple(p) for p in e.raw["medusa"]["tree"]])


def _lookup_medusa(manifest: Manifest, precision: str, threads: int, cfg: SpeculativeConfig) -> Proposer:
    return LookupMedusa(_prompt_lookup(manifest, precision, threads, cfg), _medusa(manifest, precision, threads, cfg))


# --speculate NAME -> proposer factory: the one place a method name picks code
PROPOSERS: dict[str, Callable[..., Proposer]] = {"prompt-lookup": _prompt_lookup, "draft": _draft_model,
                                                 "medusa": _medusa, "lookup+medusa": _lookup_medusa}


def resolve_mode(mode: str, manifest: Manifest, precision: str = "fp32") -> str:
    """The --speculate name 'auto' stands for on this engine set (other names are returned as they are).

    'auto' picks the draft model when the set has one, else lookup+medusa with heads at fp32, else
    prompt lookup."""
    if mode not in MODES:
        raise SpecrtError(f"unknown --speculate '{mode}'; choose one of: {', '.join(MODES)}")
    if mode != "auto":
        return mode
    roles = manifest.roles
    # measured on the bench prompts (BENCHMARKS.md, session 5): at fp32 lookup+medusa 1.59-1.61x, prompt
    # lookup 1.56x, Medusa alone 1.11x over plain; at int4 the heads (trained on fp32 hidden states, ~4% of
    # a 7.6 ms step) add nothing: 3.38x vs 3.42x. A draft model, where the set has one, beats all of them.
    heads = "medusa" in roles and manifest.engine("target", precision).precision == "fp32"
    return "draft" if "draft" in roles else "lookup+medusa" if heads else "prompt-lookup"


def make_decoder(mode: str, manifest: Manifest, precision: str = "fp32", *, threads: int = 0,
                 config: SpeculativeConfig = SpeculativeConfig()):
    """A decode strategy for Generator.stream(decode=...): plain for 'off', else the speculative loop
    ('auto': see resolve_mode). The returned callable keeps the proposer and the measured pass costs
    across requests. A draft model's target should be loaded with Generator(..., taking_turns=True)."""
    k = config.draft_tokens
    if k is not None and not 1 <= k <= MAX_DRAFT_TOKENS:
        raise SpecrtError(f"--draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k}; omit it for adaptive K")
    target = manifest.engine("target", precision)
    mode = resolve_mode(mode, manifest, precision)
    if mode == "off":
        return plain_decode
    proposer = PROPOSERS[mode](manifest, precision, threads, config)
    if k is not None:
        control = FixedK(k)
    elif not proposer.adaptive:  # it sized its drafts itself (Medusa's tree, at build time): on or off
        control = GatedK(proposer.max_tokens)
    else:
        control = AdaptiveK(proposer.max_tokens, target.width_exact, buckets=proposer.buckets)

    def decode(engine, prompt, sampling, rng, stats):
        return speculative_decode(engine, prompt, sampling, rng, stats, proposer=proposer, control=control,
                                  width_exact=target.width_exact,
                                  accept=verify_typical if config.lossy_typical else verify)

    decode.proposer, decode.control = proposer, control
    return decode
