"""Constrained decoding: a grammar (a JSON Schema, or a Lark grammar) held as a token mask on the target's logits.

llguidance (a Rust matcher with a numpy API and no other dependency) compiles the grammar against the set's own
tokenizer and says, at every position, which tokens may come next. The decode loops (generate.py, speculative.py)
set every other logit to -inf before they sample or take the argmax, so the output is the target's distribution
conditioned on the grammar, token by token: one mask per emitted token in plain decoding, and under speculation
the mask of every row the target's pass returns (`check_draft`), then `advance` by the tokens the round emitted.
More: docs/runtime-notes.md, "Module notes: runtime/grammar.py".
"""

from __future__ import annotations

import json
import threading

import numpy as np

from ..errors import SpecrtError
from .verify import Draft, VerifyResult

INSTALL = "pip install 'specrt[serve]'"

# JSON as a small model writes it: one space after ':' and ',', no free whitespace (llguidance's default admits
# any run of whitespace, which a small model can loop on forever)
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _llg():
    try:
        import llguidance
    except ImportError:
        raise SpecrtError(f"structured output needs llguidance; {INSTALL}") from None
    return llguidance


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar of a JSON Schema (raises SpecrtError for a schema it cannot take)."""
    llg = _llg()
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise SpecrtError(f"not a JSON Schema object ({e})") from None


class GrammarTokenizer:
    """The set's tokenizer as llguidance reads it, built once (about 0.4 s for a 49k vocabulary) and shared by
    every request; vocab_size is the target's logits width (a padded lm_head's extra rows are never allowed)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids):
        llg = _llg()
        self.vocab_size = vocab_size
        self.eos = sorted(eos_token_ids)
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos or None)
        self.words = (vocab_size + 31) // 32

    def literal(self, text: str) -> str:
        """How a grammar writes `text`: the token of its own that llguidance reads as special (Qwen2.5's
        <tool_call>, which a model emits as one token, never spelt out), else a quoted string."""
        ids = self.tok.tokenize_str(text)
        if len(ids) == 1 and self.tok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def check(self, grammar: str) -> str:
        """'' when the grammar compiles for this tokenizer, else the compiler's one-line reason."""
        llg = _llg()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        return messages[0].splitlines()[0] if is_error and messages else ""

    def matcher(self, grammar: str) -> "Grammar":
        reason = self.check(grammar)
        if reason:
            raise SpecrtError(f"the grammar does not compile: {reason}")
        return Grammar(self, grammar)


_LOCK = threading.Lock()


def grammar_tokenizer(codec, vocab_size: int) -> GrammarTokenizer:
    """The GrammarTokenizer of a TextCodec (tokenizer.py), built on first use and kept on it."""
    with _LOCK:
        gt = codec.grammar_tokenizer
        if gt is None or gt.vocab_size != vocab_size:
            gt = codec.grammar_tokenizer = GrammarTokenizer(codec.tokenizer.to_str(), vocab_size,
                                                            codec.eos_token_ids)
        return gt


MAX_FORCED = 16  # forced tokens one pass takes along


class Grammar:
    """One request's matcher: the masks of the next token, and its state as the output grows."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        llg = _llg()
        self.t = tokenizer
        self.m = llg.LLMatcher(tokenizer.tok, grammar, log_level=0)
        if self.m.is_error():
            raise SpecrtError(f"the grammar does not compile: {self.m.get_error()}")
        self._bits = np.empty(tokenizer.words, np.int32)
        self._root: np.ndarray | None = None  # the mask at the current state

    def allowed(self, out: np.ndarray | None = None) -> np.ndarray:
        """[V] bool: the tokens the grammar admits next (EOS alone once it is complete). Kept until the state
        moves: do not write to it."""
        if self._root is None:
            self._root = self._mask()
        if out is None:
            return self._root
        out[:] = self._root
        return out

    def _mask(self, out: np.ndarray | None = None) -> np.ndarray:
        self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.m.is_error():
            raise SpecrtError(f"the grammar failed: {self.m.get_error()}")
        ok = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.t.vocab_size].view(bool)
        if not ok.any() and self.t.eos:  # stopped: only an end of sequence is left to say
            ok[self.t.eos] = True
        if out is None:
            return ok
        out[:] = ok
        return out

    def advance(self, tokens) -> None:
        """Move past emitted tokens (stopping at an end of sequence, after which nothing is read)."""
        for t in tokens:
            if self.m.is_stopped():
                return
            self._root = None
            if not self.m.consume_token(int(t)):
                raise SpecrtError(f"the grammar refused token {int(t)} that its own mask allowed: "
                                  f"{self.m.get_error()}")

    def rollback(self, n: int) -> None:
        """Forget the last n tokens advanced past."""
        self._root = None
        self.m.rollback(n)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` next tokens the grammar leaves no choice about (each the only one its mask admits),
        moved past: they need no logits, so they ride along in the next pass (docs/runtime-notes.md, "Grammars
        under speculation")."""
        out: list[int] = []
        while len(out) < limit and not self.m.is_stopped():
            only = np.flatnonzero(self.allowed())
            if only.size != 1:
                break
            out.append(int(only[0]))
            self.advance(out[-1:])
        return out

    def check_draft(self, draft: Draft, greedy: bool) -> tuple[Draft, np.ndarray]:
        """The draft to verify and the masks [n + 1, V] of the target's rows for it (row 0: after the context,
        row i + 1: after node i). A chain is cut before its first forbidden token (greedy) or just after it
        (sampled: the rejection there still draws from the residual of that token's q, as verify() needs);
        tree nodes stay (a proposer's node indices are kept), those the grammar forbids and their subtrees
        getting the root's mask (a row nobody reaches). The matcher's state is as before."""
        n = draft.tokens.size
        masks = np.empty((n + 1, self.t.vocab_size), bool)
        self.allowed(masks[0])
        if not n:
            return draft, masks
        tokens = draft.tokens.tolist()
        if draft.parents is None:
            depth = 0
            try:
                for i, tok in enumerate(tokens):
                    if not masks[i, tok] or self.m.is_stopped():
                        cut = i if greedy else i + 1
                        masks[i + 1:cut + 1] = masks[0]
                        return draft.first(cut), masks[:cut + 1]
                    self.m.consume_token(tok)
                    depth += 1
                    self._mask(masks[i + 1])
                return draft, masks
            finally:
                self.m.rollback(depth)
        parents = draft.parents.tolist()
        ok = np.zeros(n, bool)
        path: list[int] = []  # the nodes the matcher has consumed, root first
        try:
            for i, tok in enumerate(tokens):
                par = parents[i]
                chain = [] if par < 0 else _ancestry(parents, par)
                if par >= 0 and not ok[par]:
                    masks[i + 1] = masks[0]
                    continue
                common = 0
                while common < min(len(path), len(chain)) and path[common] == chain[common]:
                    common += 1
                if len(path) > common:
                    self.m.rollback(len(path) - common)
                    del path[common:]
                for j in chain[common:]:
                    self.m.consume_token(tokens[j])
                    path.append(j)
                if not masks[par + 1, tok] or self.m.is_stopped():
                    masks[i + 1] = masks[0]
                    continue
                self.m.consume_token(tok)
                path.append(i)
                ok[i] = True
                self._mask(masks[i + 1])
            return draft, masks
        finally:
            if path:
                self.m.rollback(len(path))


def _ancestry(parents: list[int], node: int) -> list[int]:
    """node and its ancestors, root side first."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def emitted_allowed(result: VerifyResult, masks: np.ndarray) -> bool:
    """Every token a greedy verification emitted is allowed by the mask of the row it came from (row 0, then the
    accepted nodes' rows). Then the unmasked argmax of those rows is their masked argmax, so a logit screen's
    greedy tokens are the constrained result (docs/runtime-notes.md, "Grammars under speculation")."""
    tokens = result.tokens
    V = masks.shape[1]
    return bool((tokens < V).all() and masks[result.rows, np.minimum(tokens, V - 1)].all())


def masked(logits: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """A copy of logits [n, V'] with every token the mask rows [n, V] forbid at -inf (V' > V: the extra columns
    too); the engine's own output buffer is left as it is."""
    n, V = masks.shape
    out = np.full((n, logits.shape[1]), -np.inf, np.float32)
    np.copyto(out[:, :V], logits[:n, :V], where=masks)
    return out
