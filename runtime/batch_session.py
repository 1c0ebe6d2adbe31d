"""A Session for several streams at once (`load(..., parallel=N)`, `specrt serve --parallel N`).

N slots over one batch engine of the target (and one of the draft model, for --speculate draft): each slot has its
own Generator (its KV cache row, the sequence it holds for the next turn) and its own decoder (proposer and
controller), and its streams run in the caller's threads; runtime/batch.py's Scheduler puts their passes together.
A stream takes a free slot when it starts (the one whose last sequence shares most of its prompt), so a
conversation's next turn finds its prefix in the slot or in the shared prefix store, and more streams than slots
wait for one. Draft lengths follow the batch's load (batch.LoadK) unless --draft-tokens fixes them. A prompt
longer than `prefill_chunk` tokens is read in passes of that many while the others decode between them (chunked
prefill: a long prompt delays the other streams' next token by one chunk, not by all of it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SpecrtError
from .backends import backend
from .batch import Scheduler, slot_engine
from .load_k import LoadK, LoadPlanner
from .engine import EngineOptions
from .generate import Generator, Result, Stats, Stream
from .plan import MAX_DRAFT_TOKENS, Plan, PlanView
from .prefix_cache import PrefixStore
from .sampling import SamplingParams
from .speculative import Opener, decoder_of, draft_entry
from .tokenizer import Message, TextCodec

# Tokens of a chunk of a prefill while other streams decode: each of their tokens waits for at most one chunk;
# a smaller chunk costs the prefilling stream more rounds (docs/benchmarks-history.md, "Does chunked prefill keep
# the other streams flowing?")
PREFILL_CHUNK = 128


class _Shared:
    """One heads engine for every slot (a call is stateless; one at a time)."""

    def __init__(self, heads):
        self._heads, self._lock = heads, threading.Lock()
        self.heads, self.topk = heads.heads, heads.topk
        self.on_device = heads.on_device  # heads on the GPU read each slot's rows by address

    def __call__(self, hidden, token):
        with self._lock:
            return self._heads(hidden, token)


class _SlotOpener(Opener):
    def __init__(self, session: "BatchSession", slot: int):
        self.session, self.slot = session, slot

    def engine(self, root, entry, options):
        return slot_engine(self.session.batch_of(entry, options), self.slot, self.session.scheduler)

    def heads(self, root, entry, options):
        s = self.session
        if s._heads is None:
            s._heads = _Shared(super().heads(root, entry, options))
        return s._heads

    def suffix_store(self, cfg):
        s = self.session  # one store the streams share: each drafts from the others' answers too
        if s._suffix is None:
            s._suffix = super().suffix_store(cfg)
        return s._suffix


@dataclass
class _Slot:
    generator: Generator
    decoder: object


@dataclass
class SlotPool:
    """Free slots; a request takes the one whose last sequence shares the longest prefix with its prompt."""

    slots: int
    held: Callable[[int], list[int]]               # slot -> the token ids its cache holds
    _free: list[int] = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self):
        self._free = list(range(self.slots))

    def acquire(self, ids) -> int:
        from .prefix_cache import common_prefix

        with self._cv:
            while not self._free:
                self._cv.wait()
            best = max(self._free, key=lambda s: (common_prefix(self.held(s), ids, len(ids)), -self._free.index(s)))
            self._free.remove(best)
            return best

    def release(self, slot: int) -> None:
        with self._cv:
            self._free.append(slot)  # least recently used first
            self._cv.notify()

    @property
    def busy(self) -> int:
        with self._cv:
            return self.slots - len(self._free)


class BatchSession(PlanView):
    """Session's interface (stream, generate, engine, manifest, precision, mode) over `parallel` slots."""

    def __init__(self, plan: Plan, parallel: int, prefill_chunk: int | None = None):
        if parallel < 1:
            raise SpecrtError(f"--parallel must be >= 1, got {parallel}")
        prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        check_prefill_chunk(prefill_chunk)
        manifest = plan.manifest
        self.plan, self.parallel = plan, parallel
        self.scheduler = Scheduler()
        self.scheduler.prefill_chunk = prefill_chunk
        self._batches: dict[str, object] = {}
        self._heads = None
        self._suffix = None
        self.batch = self.batch_of(plan.target, plan.options)
        codec = TextCodec(manifest.root / manifest.tokenizer_file, manifest.chat_template, manifest.bos_token,
                          manifest.eos_token_ids)
        self.planner = LoadPlanner(self.scheduler, self.batch, 1 + MAX_DRAFT_TOKENS)
        self.slots: list[_Slot] = []
        for s in range(parallel):
            gen = Generator(plan, engine=slot_engine(self.batch, s, self.scheduler), codec=codec)
            control = (lambda p, s=s: LoadK(self.planner, s, p.max_tokens, sources=p.sources))
            self.slots.append(_Slot(gen, decoder_of(plan, _SlotOpener(self, s), control)))
        self.pool = SlotPool(parallel, lambda s: self.slots[s].generator._held)
        self.prefix_store: PrefixStore | None = None
        # Each stream's loop runs in a thread of its own and hands its deltas over through a queue, so a caller that
        # is slow to read one (speech synthesis between deltas) does not hold up the batch, whose next pass waits
        # for every stream. False: the caller's own thread runs it (the server's workers, which never wait).
        self.detach = True

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

    def batch_of(self, entry, options: EngineOptions):
        """The batch engine of a manifest entry (the target's, a draft model's), opened once."""
        if entry.name not in self._batches:
            # an unknown backend, or one without batch engines: its one-line error
            self._batches[entry.name] = backend(entry).open_batch(self.manifest.root, entry, options, self.parallel)
        return self._batches[entry.name]

    @property
    def engine(self):
        return self.slots[0].generator.engine

    @property
    def decoder(self):
        return self.slots[0].decoder

    @property
    def codec(self):
        return self.slots[0].generator.codec  # one TextCodec, shared by the slots

    def enable_reuse(self, store: PrefixStore | None) -> None:
        """KV reuse across requests: each slot keeps its last sequence, others go to `store` (shared)."""
        self.prefix_store = store
        for s in self.slots:
            s.generator.keep_cache = True
            s.generator.prefix_store = store

    def stash(self) -> None:
        pass  # each stream stashes its slot's sequence before the slot is free again (_run)

    def stream(self, prompt: str | list[Message], *, max_new_tokens: int = 256,
               sampling: SamplingParams = SamplingParams(), stop: tuple[str, ...] = (), chat: bool = True,
               ignore_eos: bool = False, grammar=None, tools: list[dict] | None = None,
               store_key: str | None = None, template_kwargs: dict | None = None) -> Stream:
        ids = self.slots[0].generator.prepare(prompt, chat, max_new_tokens, tools, template_kwargs)
        stream = Stream(iter(()))
        run = self._run(ids, stream, dict(max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                                          ignore_eos=ignore_eos, grammar=grammar, store_key=store_key))
        stream._it = _detached(run, stream) if self.detach else run
        return stream

    def grammar(self, source: str):
        """A fresh matcher for one request's stream(grammar=...) (Generator.grammar)."""
        return self.slots[0].generator.grammar(source)

    def grammar_literal(self, text: str) -> str:
        """How a grammar writes `text` for this tokenizer (grammar.GrammarTokenizer.literal)."""
        return self.slots[0].generator.grammar_tokenizer().literal(text)

    def generate(self, prompt: str | list[Message], **kwargs) -> Result:
        s = self.stream(prompt, **kwargs)
        for _ in s:
            pass
        return s.result

    def _run(self, ids, stream: Stream, kw: dict):
        slot = self.pool.acquire(ids)
        try:
            if stream.cancelled:  # closed while it waited for a slot
                stream.result = Result("", [], Stats(prompt_tokens=len(ids), finish_reason="cancelled"))
                return
            s = self.slots[slot]
            self.scheduler.join(slot)
            try:
                yield from s.generator.run_ids(ids, stream, decode=s.decoder, **kw)
            finally:
                self.scheduler.leave(slot)
                s.generator.stash()  # before another stream may take the slot
        finally:
            self.pool.release(slot)


def _detached(run, stream: Stream):
    """`run`'s deltas, produced in a thread of its own (BatchSession.detach). Closing this stops the run at its next
    round boundary and waits for it, so the stream's result is the run's own."""
    import queue

    items: queue.Queue = queue.Queue()

    def produce():
        try:
            for delta in run:
                items.put(("delta", delta))
            items.put(("done", None))
        except BaseException as e:  # noqa: BLE001 -- raised in the reader's thread
            items.put(("error", e))

    thread = threading.Thread(target=produce, name="specrt-stream", daemon=True)
    thread.start()
    over = False
    try:
        while True:
            kind, value = items.get()
            if kind == "delta":
                yield value
                continue
            over = True
            if kind == "error":
                raise value
            return
    finally:
        if not over:  # closed early: the run stops at its next round boundary
            stream.cancelled = True
        thread.join()


def check_prefill_chunk(tokens: int) -> None:
    if tokens < 0:
        raise SpecrtError(f"--prefill-chunk must be >= 0 tokens (0 = each prompt in one pass), got {tokens}")


def load_batch(plan: Plan, parallel: int, prefill_chunk: int | None = None) -> BatchSession:
    """session.open_session's half for parallel > 1."""
    if plan.mode == "draft":
        draft_entry(plan.manifest, plan.precision)  # no draft engine: one line now
    return BatchSession(plan, parallel, prefill_chunk)
