"""The engine seam: a backend registry keyed by the manifest, lazily imported; the numpy reference backend runs
the loop, every proposer, trees and sampling, exactly as ONNX Runtime's engines do; Stream.close()."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.manifest import RUNTIME_BACKENDS, file_sha256
from specrt.runtime.backends import MODULES
from specrt.runtime.backends.reference import random_weights
from specrt.runtime.engine import EngineOptions
from specrt.runtime.methods import METHODS
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.session import load

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def add(a, b):\n    return a + b\n The quick brown fox jumps over the lazy dog. def add(a, b):"


def test_the_loop_imports_no_backend_library():
    code = ("import sys, specrt.runtime.speculative, specrt.runtime.session; "
            "print(sorted(m for m in sys.modules if m.startswith(('onnxruntime', 'specrt.runtime.backends.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_registry_runs_what_the_manifest_may_name():
    assert set(MODULES) == set(RUNTIME_BACKENDS)


# --- an engine set on the reference backend ------------------------------------------------------------------

def _entry(role: str, file: str, spec: dict, **extra) -> dict:
    return {"role": role, "file": file, "files": [file], "backend": "reference", "precision": "fp32",
            "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": spec["hidden"] // 4,
            "hidden_size": spec["hidden"], "vocab_size": spec["vocab"], "max_context": 256,
            "parity": {"width_exact": True}, **extra}


@pytest.fixture(scope="module")
def reference_set(tiny_engines, tmp_path_factory) -> Path:
    """Target, a draft that agrees with it on some tokens, and Medusa heads, all numpy weights, and a random EAGLE
    head (its ONNX graph, on ONNX Runtime's CPU provider beside any target); the tiny set's tokenizer (vocab 384)."""
    import torch

    from specrt.export.eagle import HeadShape, export_eagle_onnx, make_head, save_head

    root = tmp_path_factory.mktemp("reference") / "ref"
    root.mkdir()
    shutil.copy2(tiny_engines / "tokenizer.json", root / "tokenizer.json")
    tok = json.loads((tiny_engines / "manifest.json").read_text())["tokenizer"]
    spec = {"vocab": 384, "hidden": 32}
    target = random_weights(0, spec["vocab"], spec["hidden"])
    rng = np.random.default_rng(1)
    draft = {k: v + (0.3 * v.std() * rng.standard_normal(v.shape) if v.ndim > 1 else 0) for k, v in target.items()}
    np.savez(root / "target.npz", **target)
    np.savez(root / "draft.npz", **draft)
    heads = np.stack([target["lm_head"], draft["lm_head"]])          # [K = 2, H, V]: head k guesses token k + 1 ahead
    np.savez(root / "heads.npz", heads=heads, topk=np.int64(3))
    sha = tok["sha256"]
    tree = [[0], [1], [0, 0], [0, 1], [1, 0]]
    torch.manual_seed(0)
    save_head(root / "eagle.npz", make_head(HeadShape(32, 4, 2, 8, 64, 10000.0, 1e-5)), np.arange(spec["vocab"]),
              {"shape": HeadShape(32, 4, 2, 8, 64, 10000.0, 1e-5).__dict__})
    eagle = export_eagle_onnx(root / "eagle.npz", target["embed"].astype(np.float32),
                              target["lm_head"].T.astype(np.float32), root / "eagle.onnx", 256, 4)
    eagle.pop("report")
    manifest = {"schema_version": 1, "name": "ref", "tokenizer": tok, "source": {"label": "random"},
                "engines": {"target-fp32": _entry("target", "target.npz", spec, tokenizer_sha256=sha),
                            "draft-fp32": _entry("draft", "draft.npz", spec, tokenizer_sha256=sha),
                            "medusa-fp32": _entry("medusa", "heads.npz", spec, medusa={"tree": tree}),
                            "eagle-fp32": {**_entry("eagle", "eagle.onnx", spec, eagle=eagle), "backend": "onnxruntime",
                                           "num_layers": 1, "files": ["eagle.onnx", "eagle.onnx.data"]}}}
    assert file_sha256(root / "tokenizer.json") == sha
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_each_backend_package_opens_what_its_descriptor_says_and_defaults_the_rest(reference_set):
    """specrt/backends.py's `batch` flag is whether the package's RUNTIME opens batch engines (else open_batch is the
    one-line refusal); a backend without an EAGLE head of its own runs the ONNX graph on ONNX Runtime's CPU."""
    import importlib

    from specrt.backends import BACKENDS
    from specrt.manifest import load_manifest
    from specrt.runtime.backends import backend
    from specrt.runtime.backends.onnxruntime_cpu.heads import OrtEagleHead
    from specrt.runtime.backends.protocol import Runtime, one_stream

    for name, b in BACKENDS.items():
        runtime = importlib.import_module(b.module).RUNTIME
        assert isinstance(runtime, Runtime) and (runtime.open_batch is not one_stream) == b.batch, name
    m = load_manifest(reference_set)
    eagle = dataclasses.replace(m.engines["eagle-fp32"], backend="reference")
    head = backend(eagle).open_eagle(m.root, eagle)
    assert isinstance(head, OrtEagleHead) and head.topk == eagle.eagle["topk"]
    with pytest.raises(SpecrtError, match="the reference backend cannot run several streams at once yet; use "
                                          "--parallel 1 or an engine set of onnxruntime, "):
        backend(m.engine("target")).open_batch(m.root, m.engine("target"), EngineOptions(), 2)


def test_reference_engine_is_width_exact_and_keeps_tree_branches_apart(reference_set):
    from specrt.manifest import load_manifest
    from specrt.runtime.engine import open_engine

    m = load_manifest(reference_set)
    eng = open_engine(m.root, m.engine("target"))
    ids = np.arange(5, 17, dtype=np.int64)
    eng.forward(ids[:8])
    eng.commit(8)
    wide = eng.forward(ids[8:], num_logits=4).copy()
    narrow = []
    for t in ids[8:]:
        narrow.append(eng.forward(np.array([t]))[0].copy())
        eng.commit(1)
    assert np.abs(wide - np.array(narrow)).max() < 1e-4
    # a two-branch tree after ids[:8]: [a, b] siblings at the same position, then c under b
    eng.rewind(8)
    a, b, c = 40, 41, 42
    mask = np.zeros((3, 3), np.float32)
    mask[1, 0] = mask[2, 0] = -np.inf
    tree = eng.forward(np.array([a, b, c]), positions=np.array([8, 8, 9]), tree_mask=mask, num_logits=3).copy()
    eng.commit(2, path=np.array([1, 2]))                             # keep the branch b, c
    eng.rewind(8)
    chain = eng.forward(np.array([b, c]), num_logits=2).copy()
    eng.rewind(8)
    alone = eng.forward(np.array([a]))[0].copy()
    assert np.abs(tree[1:] - chain).max() < 1e-4 and np.abs(tree[0] - alone).max() < 1e-4


@pytest.mark.parametrize("mode", [*METHODS, "auto"])
def test_every_proposer_is_exact_on_the_reference_backend(reference_set, mode):
    plain = load(reference_set, speculate="off").generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    session = load(reference_set, speculate=mode)
    spec = session.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert spec.token_ids == plain.token_ids and len(set(plain.token_ids)) > 8
    assert spec.stats.exact and spec.stats.proposer != "off" and spec.stats.engine.startswith("reference")
    assert sum(spec.stats.drafted_by_position) > 0, "the proposer never drafted: nothing was verified"


@pytest.mark.parametrize("mode", ["prompt-lookup", "suffix", "medusa"])
def test_seeded_sampling_with_a_deterministic_drafter_returns_plain_sampling(reference_set, mode):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    plain = load(reference_set, speculate="off").generate(PROMPT, max_new_tokens=40, sampling=sp, ignore_eos=True)
    spec = load(reference_set, speculate=mode).generate(PROMPT, max_new_tokens=40, sampling=sp, ignore_eos=True)
    assert spec.token_ids == plain.token_ids and spec.stats.rounds < plain.stats.rounds


def test_a_sampled_draft_model_runs_on_the_reference_backend(reference_set):
    sp = SamplingParams(temperature=0.8, seed=3)
    out = load(reference_set, speculate="draft").generate(PROMPT, max_new_tokens=30, sampling=sp, ignore_eos=True)
    assert len(out.token_ids) == 30 and out.stats.exact and out.stats.acceptance_by_position


def test_an_engine_of_a_backend_this_specrt_cannot_run_is_one_line(reference_set, tmp_path):
    from specrt.manifest import load_manifest
    from specrt.runtime.engine import open_engine

    m = load_manifest(reference_set)
    bad = dataclasses.replace(m.engine("target"), backend="mystery")  # e.g. a set from a newer specrt
    with pytest.raises(SpecrtError, match="mystery engine, which this specrt cannot run yet") as e:
        open_engine(m.root, bad)
    assert "\n" not in str(e.value)


# --- Stream.close(): cancellation at a round boundary ------------------------------------------------------

@pytest.mark.parametrize("mode", ["off", "prompt-lookup"])
def test_close_stops_the_stream_and_the_engine_serves_the_next_request(tiny_engines, mode):
    session = load(tiny_engines, speculate=mode, options=EngineOptions(threads=1))
    full = session.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    s = session.stream(PROMPT, max_new_tokens=40, ignore_eos=True)
    got = [next(s) for _ in range(3)]
    s.close()
    r = s.result
    assert r.stats.finish_reason == "cancelled" and 3 <= len(r.token_ids) < 40 and r.text == "".join(got)
    assert r.token_ids == full.token_ids[:len(r.token_ids)]
    assert list(s) == []                                                # closed: nothing more comes
    again = session.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert again.token_ids == full.token_ids and again.stats.finish_reason == "length"


def test_close_from_another_thread_stops_at_the_next_round(tiny_engines):
    session = load(tiny_engines, options=EngineOptions(threads=1))
    s = session.stream(PROMPT, max_new_tokens=200, ignore_eos=True)
    seen, started = [], threading.Event()

    def consume():
        for delta in s:
            seen.append(delta)
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    started.wait(30)
    s.close()
    t.join(30)
    assert not t.is_alive() and s.result.stats.finish_reason == "cancelled"
    assert len(s.result.token_ids) < 200


def test_close_before_the_first_round(tiny_engines):
    session = load(tiny_engines, options=EngineOptions(threads=1))
    s = session.stream(PROMPT, max_new_tokens=10)
    s.close()
    assert s.result.stats.finish_reason == "cancelled" and s.result.token_ids == []
    assert session.generate(PROMPT, max_new_tokens=5).stats.finish_reason in ("length", "eos")


# --- KV reuse across requests (Generator.keep_cache) ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["off", "prompt-lookup"])
def test_kv_reuse_across_turns_gives_the_tokens_of_a_fresh_run(tiny_engines, mode):
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.tokenizer import Message

    reuse, fresh = load(tiny_engines, "fp32", mode), load(tiny_engines, "fp32", mode)
    reuse.generator.keep_cache = True
    greedy = SamplingParams(temperature=0.0)
    history = [Message("system", "You are a terse assistant.")]
    for turn, question in enumerate(["Tell me about rivers.", "And lakes?", "Which is deeper?"]):
        history.append(Message("user", question))
        a = reuse.generate(list(history), max_new_tokens=20, sampling=greedy)
        b = fresh.generate(list(history), max_new_tokens=20, sampling=greedy)
        assert list(a.token_ids) == list(b.token_ids) and b.stats.cached_tokens == 0
        if turn:  # the history up to the last answer is in the cache
            assert 0 < a.stats.cached_tokens < a.stats.prompt_tokens
        history.append(Message("assistant", a.text))
    other = reuse.generate("Something else entirely", max_new_tokens=5, sampling=greedy)
    assert other.stats.cached_tokens < 5 and list(other.token_ids) == list(
        fresh.generate("Something else entirely", max_new_tokens=5, sampling=greedy).token_ids)



# --- kept sequences: several conversations on one engine (Generator.prefix_store) --------------------------------

def test_the_prefix_store_evicts_the_least_recently_used_within_its_budget():
    from specrt.runtime.engine import KVSnapshot
    from specrt.runtime.prefix_cache import SAVE_MIN_LOST, Kept, PrefixStore

    def seq(first, n=2 * SAVE_MIN_LOST):  # long enough that no two of these count as one conversation's turns
        return [first] + list(range(1000 * first, 1000 * first + n))

    def kept(ids, nbytes):
        return Kept(list(ids), KVSnapshot(len(ids), [np.zeros(nbytes, np.uint8)]))

    a, b, c = seq(1), seq(2), seq(3)
    store = PrefixStore(250)
    assert store.put(kept(a, 100)) and store.put(kept(b, 100))
    assert store.best(b + [7], len(b)) == (1, len(b)) and store.best([9], 1) == (None, 0)
    assert store.best(a + [4], 5) == (0, 5)  # at most limit
    assert store.holds(a) and not store.holds(a[:-1])
    assert store.put(kept(c, 100))           # over budget: the oldest (a) goes
    assert len(store) == 2 and store.evictions == 1 and store.nbytes == 200 and not store.holds(a)
    assert not store.put(kept([4], 251)) and len(store) == 2  # alone over budget: not kept, nothing evicted
    assert store.put(kept(b + [5, 6], 100)) and len(store) == 2 and not store.holds(b)  # b's next turn replaces it
    kept_c, n = store.claim(c, len(c), 0)  # a request extending c takes it out
    assert kept_c.ids == c and n == len(c) and len(store) == 1


def test_a_kept_sequence_shared_only_in_its_head_stays_kept():
    """claim: a request extending a kept sequence takes it out of the store; one sharing only its head (another
    conversation under the same system prompt) gets it and leaves it kept, so its own conversation finds it."""
    from specrt.runtime.engine import KVSnapshot
    from specrt.runtime.prefix_cache import SAVE_MIN_LOST, Kept, PrefixStore

    system = list(range(100, 120))
    a = system + list(range(500, 500 + 2 * SAVE_MIN_LOST))
    store = PrefixStore(1 << 20)
    store.put(Kept(list(a), KVSnapshot(len(a), [np.zeros(8, np.uint8)])))
    other = system + [7, 8, 9]
    assert store.claim(other, len(other) - 1, longer_than=len(system)) == (None, 0)  # the engine holds as much
    for _ in range(2):  # two conversations under that system prompt, one after the other (or two slots at once)
        kept, n = store.claim(other, len(other) - 1, longer_than=0)
        assert kept.ids == a and n == len(system) and len(store) == 1
    turn = a[:-SAVE_MIN_LOST + 1] + [1, 2]  # a's next turn rewrites fewer than SAVE_MIN_LOST of its tokens
    kept, n = store.claim(turn, len(turn) - 1, longer_than=0)
    assert kept.ids == a and n == len(a) - SAVE_MIN_LOST + 1 and len(store) == 0


def test_another_conversation_under_the_same_system_prompt_leaves_the_first_one_kept(tiny_engines):
    """One engine, a prefix store: conversation A, an unrelated request, then B under A's system prompt (which
    reuses A's head from the store), then A's next turn, which must still find all of A's first turn."""
    from specrt.runtime.prefix_cache import MIB, PrefixStore
    from specrt.runtime.tokenizer import Message

    greedy = SamplingParams(temperature=0.0)
    session = load(tiny_engines, "fp32", "off")
    session.enable_reuse(PrefixStore(64 * MIB))
    fresh = load(tiny_engines, "fp32", "off")
    system = Message("system", "You answer questions about rivers, lakes and seas in one short sentence.")
    a = [system, Message("user", "Which is the longest river of South America, and where does it rise?")]
    first = session.generate(list(a), max_new_tokens=8, sampling=greedy)
    session.generate("Unrelated text that shares nothing with it.", chat=False, max_new_tokens=4, sampling=greedy)
    b = session.generate([system, Message("user", "Name a lake.")], max_new_tokens=4, sampling=greedy)
    assert 0 < b.stats.cached_tokens < first.stats.prompt_tokens - 20  # the system prompt, from A's kept cache
    a += [Message("assistant", first.text), Message("user", "And the second longest?")]
    again = session.generate(list(a), max_new_tokens=8, sampling=greedy)
    assert again.stats.cached_tokens >= first.stats.prompt_tokens
    assert again.token_ids == fresh.generate(list(a), max_new_tokens=8, sampling=greedy).token_ids


def test_save_and_load_prefix_put_a_sequence_back_on_the_cpu_backends(tiny_engines, reference_set):
    for root in (tiny_engines, reference_set):
        eng = load(root).engine
        rng = np.random.default_rng(0)
        eng.rewind(0)
        eng.forward(rng.integers(0, 384, 40))
        eng.commit(40)
        snap = eng.save_prefix(40)
        probe = rng.integers(0, 384, 3)
        before = np.array(eng.forward(probe, num_logits=3))
        eng.rewind(0)
        eng.forward(rng.integers(0, 384, 60))   # another sequence overwrites the cache
        eng.commit(60)
        eng.load_prefix(snap)
        assert eng.length == 40 and snap.nbytes > 0
        np.testing.assert_array_equal(eng.forward(probe, num_logits=3), before)


class _Fed:
    """The tokens a draft engine reads in its first pass of a request (the prompt past what its cache kept); the
    later passes' sizes follow the adaptive draft length, which follows measured times."""

    def __init__(self, engine):
        self.engine, self.count, self._argmax = engine, None, engine.argmax
        engine.argmax = self

    def __call__(self, tokens, *args, **kw):
        if self.count is None:
            self.count = len(tokens)
        return self._argmax(tokens, *args, **kw)


@pytest.mark.parametrize("engines,mode", [("tiny_engines", "off"), ("tiny_engines", "prompt-lookup"),
                                          ("reference_set", "draft")])
def test_two_conversations_taking_turns_keep_their_caches_and_the_tokens_of_a_fresh_run(request, engines, mode):
    """Two conversations alternate on one engine: each turn finds its own history in the store (the target's and
    the draft model's caches), prefills only the new turn, and returns a fresh run's tokens."""
    from specrt.runtime.prefix_cache import MIB, PrefixStore
    from specrt.runtime.tokenizer import Message

    from specrt.runtime.speculative import SpeculativeConfig

    root = request.getfixturevalue(engines)
    # a fixed draft length: the adaptive controller may rightly stop drafting on the tiny pair, and the draft's
    # cache reuse is what is checked here
    config = SpeculativeConfig(draft_tokens=3)
    reuse, fresh = load(root, "fp32", mode, config=config), load(root, "fp32", mode, config=config)
    reuse.generator.keep_cache = True
    store = reuse.generator.prefix_store = PrefixStore(64 * MIB)
    fed = _Fed(reuse.decoder.proposer.engine) if mode == "draft" else None
    fresh_fed = _Fed(fresh.decoder.proposer.engine) if mode == "draft" else None
    greedy = SamplingParams(temperature=0.0)
    talks = {"a": [Message("user", "Tell me about rivers.")], "b": [Message("user", "Write a poem on gears.")]}
    last_prompt = {}
    for turn in range(3):
        for name, history in talks.items():
            if fed is not None:
                fed.count = fresh_fed.count = None
            a = reuse.generate(list(history), max_new_tokens=12, sampling=greedy)
            b = fresh.generate(list(history), max_new_tokens=12, sampling=greedy)
            assert list(a.token_ids) == list(b.token_ids), (turn, name)
            if turn:  # all of the last turn's prompt at least, though the other conversation ran in between
                assert last_prompt[name] <= a.stats.cached_tokens < a.stats.prompt_tokens
                if fed is not None:
                    assert fed.count <= fresh_fed.count - last_prompt[name] + 1
            last_prompt[name] = a.stats.prompt_tokens
            history += [Message("assistant", a.text), Message("user", f"More, part {turn}.")]
    assert len(store) == 1 and store.evictions == 0  # the other conversation; this one is in the engine
