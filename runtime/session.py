"""One loader for every front end (the CLI, the bench, the server): an engine set, a precision and a --speculate
name -> a Session that streams answers.

`load` makes the plan (runtime/plan.py: the manifest loaded, the target looked up and 'auto' resolved once, whether
the target takes turns with a draft model on the cores) and `open_session` runs one made already: it opens the
target through the backend registry and builds the decoder (proposer + controller), which keeps what it measured
across requests. A Session serves one request at a time (one KV cache).

More: docs/runtime-notes.md, "Module notes: runtime/session.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..manifest import Manifest
from .engine import Engine, EngineOptions
from .generate import Generator, Result, Stream
from .plan import Plan, PlanView, SpeculativeConfig, make_plan
from .prefix_cache import PrefixStore
from .speculative import decoder_of
from .tokenizer import Message


@dataclass
class Session(PlanView):
    plan: Plan
    generator: Generator
    decoder: object        # PlainDecoder or SpeculativeDecoder: .proposer and .control (None when plain)

    @property
    def engine(self) -> Engine:
        return self.generator.engine

    @property
    def codec(self):
        """The tokenizer and chat template (tokenizer.TextCodec), its tool-call format included."""
        return self.generator.codec

    def stream(self, prompt: str | list[Message], **kwargs) -> Stream:
        """Generator.stream's arguments (max_new_tokens, sampling, stop, chat, ignore_eos), this session's decoder."""
        return self.generator.stream(prompt, decode=self.decoder, **kwargs)

    def generate(self, prompt: str | list[Message], **kwargs) -> Result:
        return self.generator.generate(prompt, decode=self.decoder, **kwargs)

    def grammar(self, source: str):
        """A fresh matcher for one request's stream(grammar=...) (Generator.grammar)."""
        return self.generator.grammar(source)

    def grammar_literal(self, text: str) -> str:
        """How a grammar writes `text` for this tokenizer (grammar.GrammarTokenizer.literal)."""
        return self.generator.grammar_tokenizer().literal(text)

    parallel = 1

    @property
    def prefix_store(self) -> PrefixStore | None:
        return self.generator.prefix_store

    def enable_reuse(self, store: PrefixStore | None) -> None:
        """KV reuse across requests: the sequence in the engine, and others kept in `store` (None: only that one)."""
        self.generator.keep_cache = True
        self.generator.prefix_store = store

    def stash(self) -> None:
        """Copy the sequence in the engine into the prefix store now (Generator.stash)."""
        self.generator.stash()


def load(engines: str | Path | Manifest, precision: str = "fp32", speculate: str = "auto",
         options: EngineOptions = EngineOptions(), config: SpeculativeConfig = SpeculativeConfig(),
         shared: dict | None = None, parallel: int = 1, prefill_chunk: int | None = None) -> Session:
    """Open an engine set for generation: speculate 'auto' (the default) drafts with what the set has, 'off'
    decodes plainly; the plan (runtime/plan.py, make_plan's arguments) is made here, then open_session."""
    return open_session(make_plan(engines, precision, speculate, options, config), shared, parallel, prefill_chunk)


def open_session(plan: Plan, shared: dict | None = None, parallel: int = 1,
                 prefill_chunk: int | None = None) -> Session:
    """A Session that runs a plan made already (nothing is loaded, looked up or resolved again).
    shared: a dict in which sessions of one process share their target (same set, precision and options: the
    bench compares strategies on one engine, each request rewinds it); None = a target of its own.
    parallel > 1: a BatchSession (runtime/batch_session.py) that runs that many streams at once, each from its own
    thread, their passes batched; prefill_chunk: a prompt longer than this is read in passes of that many tokens while
    other streams decode (None: batch_session.PREFILL_CHUNK, 0: in one pass)."""
    if parallel != 1:
        from .batch_session import load_batch

        return load_batch(plan, parallel, prefill_chunk)
    key = (str(plan.manifest.root), plan.precision, plan.options)
    if shared is not None and key in shared:
        generator = shared[key]
    else:
        generator = Generator(plan)
        if shared is not None:
            shared[key] = generator
    return Session(plan, generator, decoder_of(plan))
