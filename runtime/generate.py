"""Generator: load an engine set, turn a prompt into a stream of text deltas, then final stats.

The decode strategy (plain, or a speculative loop) is a function that yields the tokens of each
round; this module owns everything around it that is the same for all strategies: chat
formatting, the context check, stop conditions (EOS, stop strings, max_new_tokens), incremental
detokenization and the stats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SpecrtError
from .engine import Engine, EngineOptions, open_engine
from .grammar import MAX_FORCED, Grammar, grammar_tokenizer, masked
from .plan import Plan, make_plan
from .prefix_cache import SAVE_MIN_LOST, Kept, PrefixStore, common_prefix
from .sampling import SamplingParams, probs_from_logits, sample
from .tokenizer import Detokenizer, Message, TextCodec


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    tok_s: float = 0.0  # new tokens / total time, prefill included
    total_s: float = 0.0
    finish_reason: str = ""
    proposer: str = "off"
    rounds: int = 0
    tau: float = 1.0  # tokens emitted per target pass
    acceptance_by_position: list[float] = field(default_factory=list)  # P(draft token i kept | drafted >= i tokens)
    drafted_by_position: list[int] = field(default_factory=list)  # rounds that drafted >= i tokens (pools runs)
    draft_s: float = 0.0
    verify_s: float = 0.0
    exact: bool = True  # False when the engine is not width-exact (int8 activations) and we speculated, or lossy
    lossy: bool = False  # True when a round used the lossy typical acceptance (--lossy-typical), whatever the engine
    logit_screen: bool = False  # greedy passes read the lm_head via the fp32 engine's screen (exact; build/screen.py)
    engine: str = ""  # the target engine and its backend (Engine.description)
    # prompt tokens whose KV the target kept from the previous request (Generator.keep_cache); decoders keep that
    # many positions of the cache and prefill the rest
    cached_tokens: int = 0
    cancel_s: float = 0.0  # cancelled: from Stream.close() to the loop's end (the engine free again)
    queue_s: float = 0.0   # a server's request: waiting for the engine before the loop started (ttft_s excludes it)
    grammar_s: float = 0.0  # a constrained request: time in the grammar engine (masks, draft checks, advancing)
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # rounds with a draft, per drafter (auto's)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}

    def observe(self, r, width_exact: bool) -> None:
        """One speculative round (control.Round): its costs, and whether the output is still exact."""
        self.rounds += 1
        self.draft_s += r.draft_s + r.catchup_s
        self.verify_s += r.verify_s
        self.exact &= (width_exact or r.drafted == 0) and not r.result.lossy
        self.lossy |= r.result.lossy


@dataclass(frozen=True)
class Result:
    text: str
    token_ids: list[int]
    stats: Stats


class Stream:
    """Iterate for text deltas; `.result` holds text, token ids and stats once exhausted or closed.

    close() stops the loop at the next round boundary, from any thread (a voice agent's barge-in): the result
    then says finish_reason="cancelled", and the engine is free for the next request."""

    def __init__(self, it: Iterator[str]):
        self._it, self.result, self.cancelled = it, None, False
        self.closed_at: float | None = None  # perf_counter() of the first close()
        self._lock = threading.Lock()   # held while the loop runs: close() then only raises the flag

    def __iter__(self):
        return self

    def __next__(self) -> str:
        with self._lock:
            return next(self._it)

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.perf_counter()
        self.cancelled = True
        if not self._lock.acquire(blocking=False):
            return             # another thread is inside the loop: it stops at the next round boundary
        try:
            self._it.close()   # not started or paused at a yield: finish now
        finally:
            self._lock.release()
        if self.result is None:  # closed before the first round: nothing ran
            self.result = Result(text="", token_ids=[], stats=Stats(finish_reason="cancelled"))


def plain_decode(engine: Engine, prompt: list[int], sampling: SamplingParams,
                 rng: np.random.Generator, stats: Stats, grammar: Grammar | None = None) -> Iterator[list[int]]:
    """Target-only decoding: one pass, one token. The cache keeps the first stats.cached_tokens positions of the
    prompt (KV reuse: Generator.keep_cache; 0 otherwise); only the rest is prefilled. grammar: each token is drawn
    from the logits the grammar allows (runtime/grammar.py)."""
    engine.rewind(stats.cached_tokens)
    done = engine.length
    if grammar is not None:
        yield from _plain_constrained(engine, np.asarray(prompt[done:], np.int64), sampling, rng, stats, grammar)
        return
    if sampling.greedy:  # argmax(): an engine with a logit screen reads its lm_head in 8 bits, exactly
        token = int(engine.argmax(np.asarray(prompt[done:], np.int64))[0])
        engine.commit(len(prompt) - done)
        while True:
            stats.rounds += 1
            yield [token]
            token = int(engine.argmax(np.array([token], np.int64))[0])
            engine.commit(1)
    logits = engine.forward(np.asarray(prompt[done:], np.int64), num_logits=1)
    engine.commit(len(prompt) - done)
    probs = np.empty((1, engine.vocab_size), np.float32)
    while True:
        token = sample(probs_from_logits(logits[-1:], sampling, out=probs)[0], rng)
        stats.rounds += 1
        yield [token]
        logits = engine.forward(np.array([token], np.int64))
        engine.commit(1)


def _plain_constrained(engine: Engine, pending: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
                       stats: Stats, grammar: Grammar) -> Iterator[list[int]]:
    """plain_decode under a grammar. Tokens the grammar leaves no choice about join the next pass unread (on
    width-exact engines, where a wider pass gives the same logits). Greedy on an engine with a logit screen: the
    screen's token wherever the grammar allows it (it is then the masked argmax), else the same pass read again in
    full; after such a miss, full logits until the model's own argmax agrees with the grammar again
    (docs/runtime-notes.md, "Grammars under speculation")."""
    probs = None if sampling.greedy else np.empty((1, engine.vocab_size), np.float32)
    screen = try_screen = sampling.greedy and engine.screen
    while True:
        t0 = time.perf_counter()
        room = engine.max_context - engine.length - pending.size - 1
        forced = grammar.forced(min(MAX_FORCED, room)) if engine.width_exact else []
        if forced:
            pending = np.concatenate([pending, np.asarray(forced, np.int64)])
        allowed = grammar.allowed()[None]
        stats.grammar_s += time.perf_counter() - t0
        token = -1
        if try_screen and pending.size - len(forced) == 1:  # a miss on a prefill would read it twice
            token = int(engine.argmax(pending)[0])
            if not (token < allowed.shape[1] and allowed[0, token]):
                token = -1  # nothing committed yet: the pass is read again in full below
        if token < 0:
            raw = engine.forward(pending, num_logits=1)[-1:]
            logits = masked(raw, allowed)
            if sampling.greedy:
                token = int(np.argmax(logits[0]))
                try_screen = screen and int(np.argmax(raw[0])) == token
            else:
                token = sample(probs_from_logits(logits, sampling, out=probs)[0], rng)
        engine.commit(pending.size)
        t0 = time.perf_counter()
        grammar.advance([token])
        stats.grammar_s += time.perf_counter() - t0
        stats.rounds += 1
        yield forced + [token]
        pending = np.array([token], np.int64)


class Decoder:
    """A decode strategy object (any callable with plain_decode's signature is one too): its proposer, if any."""

    name, proposer, control = "off", None, None


class PlainDecoder(Decoder):
    """The decode strategy of --speculate off."""

    def __call__(self, engine: Engine, prompt: list[int], sampling: SamplingParams, rng: np.random.Generator,
                 stats: Stats, grammar: Grammar | None = None, store_key: str | None = None) -> Iterator[list[int]]:
        return plain_decode(engine, prompt, sampling, rng, stats, grammar)  # no store to scope


def stop_prefix(text: str, stop) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string (0 if none)."""
    return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)


def _state_holders(decode) -> list:
    """The decoder's proposer, if it keeps a cache of its own (a draft model, an EAGLE head)."""
    p = decode.proposer if isinstance(decode, Decoder) else None
    return [p] if p is not None and p.keeps_state else []


class Generator:
    """One target engine of a set plus its tokenizer: renders chat prompts, streams text, stops at EOS,
    stop strings, the token budget or the context, and reports Stats. How tokens are produced is the
    `decode` strategy's business (plain_decode by default; runtime.speculative for the rest). Reusable
    across requests; not thread-safe (one KV cache)."""

    def __init__(self, plan: Plan, engine: Engine | None = None, codec: TextCodec | None = None):
        """plan: the set, the target entry and its backend options (runtime/plan.py: taking_turns is on when a
        draft model will run between the target's passes). engine, codec: an engine and tokenizer opened already
        (a slot of a batch engine: runtime/batch.py)."""
        manifest = self.manifest = plan.manifest
        self.entry = plan.target
        self.engine = engine if engine is not None else open_engine(manifest.root, self.entry, plan.options)
        self.codec = codec or TextCodec(manifest.root / manifest.tokenizer_file, manifest.chat_template,
                                        manifest.bos_token, manifest.eos_token_ids)
        # KV reuse across requests (off by default: a benchmark repeating a prompt would time no prefill). On, a
        # request keeps the target's cache for the longest prefix its prompt shares with the last request's
        # prompt + output, and prefills only the rest; `_held` is what the cache holds, position by position.
        self.keep_cache = False
        self._held: list[int] = []
        # Other sequences' caches, kept on the host while another one is in the engine (runtime/prefix_cache.py);
        # None = only the sequence in the engine is reused.
        self.prefix_store: PrefixStore | None = None
        self._last_decode = None

    @classmethod
    def load(cls, path: str | Path, precision: str = "fp32", options: EngineOptions = EngineOptions()) -> "Generator":
        return cls(make_plan(path, precision, "off", options))

    def grammar(self, source: str) -> Grammar:
        """A fresh matcher of an llguidance grammar (grammar.json_schema_grammar makes one of a JSON Schema) for
        one request's stream(grammar=...); SpecrtError names what does not compile."""
        return self.grammar_tokenizer().matcher(source)

    def grammar_tokenizer(self):
        """The tokenizer as the grammar engine reads it (grammar.GrammarTokenizer: built once, ~0.4 s)."""
        return grammar_tokenizer(self.codec, self.engine.vocab_size)

    def prompt_ids(self, prompt: str | list[Message], chat: bool = True, tools: list[dict] | None = None,
                   template_kwargs: dict | None = None) -> list[int]:
        """tools: OpenAI's function tools, rendered with a chat (TextCodec.render_chat), as template_kwargs are."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise SpecrtError("the prompt is empty; pass some text with --prompt or a --messages file")
            prompt = [Message("user", prompt)] if chat else self.codec.plain_prompt(prompt)
        text = self.codec.render_chat(prompt, tools, template_kwargs) if isinstance(prompt, list) else prompt
        ids = self.codec.encode(text)
        if not ids:
            raise SpecrtError("the prompt encodes to no tokens; pass some text")
        if len(ids) >= self.engine.max_context:
            raise SpecrtError(f"the prompt has {len(ids)} tokens but the engine's context is "
                              f"{self.engine.max_context}; shorten the prompt or rebuild with a larger --max-context")
        return ids

    def stream(self, prompt: str | list[Message], *, max_new_tokens: int = 256,
               sampling: SamplingParams = SamplingParams(), stop: tuple[str, ...] = (),
               chat: bool = True, decode=None, ignore_eos: bool = False, grammar: Grammar | None = None,
               tools: list[dict] | None = None, store_key: str | None = None,
               template_kwargs: dict | None = None) -> Stream:
        """decode: a strategy like `plain_decode` (the default); speculative decoders plug in here.
        ignore_eos: keep decoding through EOS tokens (kept in token_ids) until max_new_tokens or a stop
        string, like vLLM's `ignore_eos`; for benchmarks that need equal lengths. Logits are not changed.
        grammar: a fresh Grammar (runtime/grammar.py) the output is held to, under any decode strategy.
        tools: OpenAI's function tools, shown to the model with the chat (TextCodec.render_chat).
        store_key: this request's scope in what the decoder keeps across requests (suffix decoding's store of
        earlier answers: requests with the same key share one; None: the one shared by every unkeyed request)."""
        ids = self.prepare(prompt, chat, max_new_tokens, tools, template_kwargs)
        stream = Stream(iter(()))
        stream._it = self.run_ids(ids, stream, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                  decode=decode, ignore_eos=ignore_eos, grammar=grammar, store_key=store_key)
        return stream

    def prepare(self, prompt: str | list[Message], chat: bool, max_new_tokens: int,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """A request's checked prompt tokens (one-line errors before anything runs)."""
        if max_new_tokens < 1:
            raise SpecrtError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return self.prompt_ids(prompt, chat, tools, template_kwargs)

    def run_ids(self, ids: list[int], stream: Stream, *, max_new_tokens: int = 256,
                sampling: SamplingParams = SamplingParams(), stop: tuple[str, ...] = (), decode=None,
                ignore_eos: bool = False, grammar: Grammar | None = None,
                store_key: str | None = None) -> Iterator[str]:
        """The text deltas of a checked prompt's tokens, for `stream` (its close() flag and result)."""
        eos = frozenset() if ignore_eos else self.codec.eos_token_ids
        return self._run(ids, max_new_tokens, sampling, stop, decode or PlainDecoder(), stream, eos, grammar,
                         store_key)

    def generate(self, prompt: str | list[Message], **kwargs) -> Result:
        s = self.stream(prompt, **kwargs)
        for _ in s:
            pass
        return s.result

    def _reuse(self, ids: list[int], decode) -> int:
        """KV reuse: how many leading prompt tokens the target's cache already holds (>= 1 left to prefill). With a
        prefix_store, a kept sequence sharing more of the prompt than the engine's is loaded back into the engine,
        and the engine's, if this request would overwrite much of it and is not kept already (stash), first saved."""
        if not self.keep_cache:
            return 0
        limit = len(ids) - 1
        live = common_prefix(self._held, ids, limit)
        store = self.prefix_store
        if store is None:
            return live
        kept, kept_n = store.claim(ids, limit, live)
        if len(self._held) - live >= SAVE_MIN_LOST:  # this request keeps `live` tokens of it at most
            self._save_live(decode)
        if kept is None:
            return live
        self.engine.load_prefix(kept.target)
        for p in _state_holders(decode):
            if p.name in kept.proposers:
                p.load_state(kept.ids, kept.proposers[p.name])
        self._held = kept.ids
        return kept_n

    def stash(self) -> None:
        """Copy the sequence in the engine into prefix_store now (if it is not there already), so the next request
        that overwrites it finds it kept without waiting for the copy: the server calls this once a request's last
        chunk is out, off the next request's time to first token."""
        if self.keep_cache and self.prefix_store is not None:
            self._save_live(self._last_decode)

    def _save_live(self, decode) -> None:
        n = len(self._held)
        if not n or not self.prefix_store.budget or self.prefix_store.holds(self._held):
            return
        self.prefix_store.put(Kept(np.asarray(self._held, np.int64), self.engine.save_prefix(n),
                                   {p.name: p.save_state(n) for p in _state_holders(decode)}))

    def _run(self, ids, max_new_tokens, sampling, stop, decode, stream: Stream, eos: frozenset,
             grammar: Grammar | None = None, store_key: str | None = None) -> Iterator[str]:
        t0 = time.perf_counter()
        engine = self.engine
        stats = Stats(prompt_tokens=len(ids), logit_screen=engine.screen and sampling.greedy, engine=engine.description)
        room = self.engine.max_context - len(ids)
        budget = min(max_new_tokens, room)
        detok, out, text = Detokenizer(self.codec), [], ""
        reason = "length" if budget == max_new_tokens else "context"
        keep = self._reuse(ids, decode)
        self._last_decode = decode
        engine.rewind(keep)
        stats.cached_tokens = keep
        self._held = []  # until this request ends, the cache holds a mix
        engine.reserve(len(ids) + budget + engine.max_pass_tokens)  # a speculative pass writes past the budget
        extra = {k: v for k, v in (("grammar", grammar), ("store_key", store_key)) if v is not None}
        rounds = decode(engine, ids, sampling, sampling.generator(), stats, **extra)  # a custom decode may take neither
        produced = 0  # every token the target emitted, EOS and any cut by a stop or the budget included
        fed = list(ids)  # the prompt + every emitted token: the committed cache holds a prefix of it
        sent, longest = 0, max(map(len, stop), default=0)  # stops: text[:sent] has been yielded
        try:
            for tokens in rounds:
                produced += len(tokens)
                fed.extend(int(t) for t in tokens)
                if not out:
                    stats.ttft_s = time.perf_counter() - t0
                done = False
                for tok in tokens:
                    if tok in eos:
                        reason, done = "eos", True
                        break
                    out.append(tok)
                    delta = detok.push(tok)
                    if stop:  # a stop may span tokens: hold back any tail that could still become one
                        text += delta
                        start = max(0, len(text) - len(delta) - longest + 1)   # stops ending in this delta
                        hit = min((i for i in (text.find(s, start) for s in stop) if i >= 0), default=-1)
                        if hit >= 0:
                            delta, text, reason, done = text[sent:hit], text[:hit], "stop", True
                        else:
                            keep = len(text) - stop_prefix(text, stop)
                            delta, sent = text[sent:keep], keep
                    if delta:
                        yield delta
                    if done or len(out) >= budget:
                        done = True
                        break
                if done:
                    break
                if stream.cancelled:  # Stream.close() from another thread: stop at this round boundary
                    reason = "cancelled"
                    break
            if stop and reason not in ("stop", "cancelled") and len(text) > sent:
                yield text[sent:]   # no stop came: the held-back tail was text after all
        except GeneratorExit:       # Stream.close() while paused at a yield
            reason = "cancelled"
            raise
        finally:
            rounds.close()
            stats.total_s = time.perf_counter() - t0
            stats.new_tokens = len(out)
            stats.finish_reason = reason
            stats.tok_s = len(out) / stats.total_s if stats.total_s > 0 else 0.0  # prefill included
            stats.tau = produced / stats.rounds if stats.rounds else 0.0  # a round that only emits EOS still counts 1
            if reason == "cancelled" and stream.closed_at is not None:
                stats.cancel_s = max(0.0, time.perf_counter() - stream.closed_at)
            final = text[:sent] if stop and reason == "cancelled" else detok.emitted if not stop else text
            stream.result = Result(text=final, token_ids=out, stats=stats)
            self._held = fed[:engine.length] if self.keep_cache else []
