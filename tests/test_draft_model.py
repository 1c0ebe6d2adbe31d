"""DraftModel: engine sets with a draft, exact greedy output, the draft cache following the target, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specrt.runtime.engine import EngineOptions
from specrt.errors import SpecrtError
from specrt.manifest import load_manifest
from specrt.pipeline import EngineSetRequest, make_engine_set

PROMPT = "Speculative decoding drafts tokens and verifies them in one pass."
QUIET = dict(log=lambda m: None)


@pytest.fixture(scope="session")
def pair_engines(tiny_dir, tmp_path_factory) -> Path:
    """Tiny Llama target + a noisy copy of it as the draft (right on some tokens, wrong on others):
    one engine set."""
    from tiny import make_checkpoint

    draft = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-draft", "llama", seed=0, noise=0.3)
    out = tmp_path_factory.mktemp("pair")
    return make_engine_set(EngineSetRequest(str(tiny_dir), "pair", ("fp32",), 256, out, str(draft)), **QUIET)


@pytest.fixture(scope="session")
def self_engines(tiny_dir, tmp_path_factory) -> Path:
    """The target as its own draft: every greedy draft token is accepted (bonus + catch-up paths)."""
    out = tmp_path_factory.mktemp("self")
    return make_engine_set(EngineSetRequest(str(tiny_dir), "self", ("fp32",), 256, out, str(tiny_dir)), **QUIET)


def _generate(engines, mode="draft", k=None, n=48, **kw):
    from specrt.runtime.generate import Generator
    from specrt.runtime.speculative import SpeculativeConfig, make_decoder

    gen = Generator.load(engines, "fp32", EngineOptions(threads=1))
    dec = None if mode == "off" else make_decoder(mode, gen.manifest, config=SpeculativeConfig(draft_tokens=k))
    return gen.generate(PROMPT, max_new_tokens=n, decode=dec, **kw)


def test_manifest_records_target_and_draft(pair_engines):
    m = load_manifest(pair_engines)
    roles = {name: e.role for name, e in m.engines.items()}
    assert roles == {"target-fp32": "target", "draft-fp32": "draft"}
    assert all(e.raw["tokenizer_sha256"] == m.tokenizer_sha256 for e in m.engines.values())


@pytest.mark.parametrize("k", [None, 1, 4])
def test_greedy_draft_equals_target_only(pair_engines, k):
    plain = _generate(pair_engines, "off")
    spec = _generate(pair_engines, "draft", k)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.proposer == "draft" and spec.stats.exact
    assert len(set(plain.token_ids)) > 8, "the tiny target must not repeat itself, or the cache is untested"
    acc = spec.stats.acceptance_by_position
    assert 0.0 < acc[0] < 1.0, f"the draft must be right on some tokens and wrong on others: {acc}"


def test_target_and_draft_stop_spinning_between_turns(pair_engines, tiny_engines):
    """Sessions that take turns must not spin on the cores the other one needs (engine.TAKING_TURNS);
    a lone target keeps ORT's default (spinning after a Run makes back-to-back plain steps faster)."""
    from specrt.runtime.session import load

    def entry(engine, key="session.force_spinning_stop") -> str:
        return engine.batch.session.get_session_options().get_session_config_entry(key)

    session = load(pair_engines, "fp32", "draft", EngineOptions(threads=1))   # the loader decides: taking turns
    assert entry(session.engine) == "1" and entry(session.decoder.proposer.engine) == "1"
    assert entry(session.engine, "session.dynamic_block_base") == "4"  # the manifest's own settings stay
    for lone in (load(tiny_engines, "fp32", "auto", EngineOptions(threads=1)),
                 load(pair_engines, "fp32", "off", EngineOptions(threads=1))):  # plain on a pair set
        with pytest.raises(RuntimeError):  # ORT raises for an entry that was never set
            entry(lone.engine)


def test_self_draft_accepts_everything_and_follows_the_target(self_engines):
    plain = _generate(self_engines, "off", n=40)
    spec = _generate(self_engines, "draft", 4, n=40)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.tau > 3.0                      # 4 accepted + bonus per round, minus the tail
    assert spec.stats.acceptance_by_position[:4] == [1.0, 1.0, 1.0, 1.0]
    auto = _generate(self_engines, "auto", n=40)     # auto: the draft model beside prompt lookup and suffix decoding
    assert auto.token_ids == plain.token_ids and auto.stats.proposer == "draft/lookup/suffix"
    assert auto.stats.drafted_by_source.get("draft", 0) > 0


def test_draft_cache_tracks_accepted_tokens(pair_engines):
    """The first round is the target's alone (the first token waits for the target's prefill only, not the
    draft's); after each later round the draft cache holds a prefix of the context: the context minus what it
    has not fed yet (the last token, plus the last draft token after a full acceptance)."""
    from specrt.runtime.generate import Stats
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import FixedK, make_decoder, speculative_decode

    from specrt.runtime.generate import Generator

    gen = Generator.load(pair_engines, "fp32", EngineOptions(threads=1))
    proposer = make_decoder("draft", gen.manifest).proposer
    ids = gen.prompt_ids(PROMPT)
    ctx_tokens = list(ids)
    rounds = speculative_decode(gen.engine, ids, SamplingParams(), np.random.default_rng(0), Stats(),
                                proposer=proposer, control=FixedK(3))
    for i, out in zip(range(12), rounds):
        ctx_tokens += out
        lag = len(ctx_tokens) - proposer.engine.length
        assert (len(out) == 1 and proposer.engine.length == 0) if i == 0 else lag in (1, 2)
        assert gen.engine.length == len(ctx_tokens) - 1   # the target has all but the last token
    rounds.close()


def test_sampled_drafting_keeps_q(pair_engines):
    from specrt.runtime.generate import Generator
    from specrt.runtime.proposers import Context
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import make_decoder

    gen = Generator.load(pair_engines, "fp32", EngineOptions(threads=1))
    proposer = make_decoder("draft", gen.manifest).proposer
    ctx = Context(gen.prompt_ids(PROMPT), 256)
    proposer.start(ctx, SamplingParams(temperature=0.8, top_k=20, seed=1), np.random.default_rng(1))
    d = proposer.propose(ctx, 3)
    assert d.q is not None and d.q.shape == (3, gen.engine.vocab_size)
    assert np.allclose(d.q.sum(1), 1.0) and (d.q[np.arange(3), d.tokens] > 0).all()


# --- bad input: each a one-line SpecrtError, and a non-zero exit from the CLI ---------------------

def test_vocab_mismatch_is_an_error_at_build(tiny_dir, tmp_path):
    from tiny import make_checkpoint

    other = make_checkpoint(tmp_path / "v320", "llama", seed=3, layers=1, vocab=320)
    with pytest.raises(SpecrtError, match="vocabulary size 320"):
        make_engine_set(EngineSetRequest(str(tiny_dir), "bad", ("fp32",), 256, tmp_path / "e", str(other)), **QUIET)


def test_tokenizer_mismatch_is_an_error_at_build(tiny_dir, tiny_qwen_dir, tmp_path):
    # same vocabulary size and source files, but transformers re-saves Qwen2's tokenizer with its own
    # pre-tokenizer and normalizer: the ids would differ, so the pair is refused
    with pytest.raises(SpecrtError, match="different tokenizers"):
        make_engine_set(EngineSetRequest(str(tiny_dir), "bad", ("fp32",), 256, tmp_path / "e", str(tiny_qwen_dir)),
                        **QUIET)


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_tokenizer_hash_mismatch_is_an_error_at_load(pair_engines, tmp_path):
    bad = _edited_copy(pair_engines, tmp_path / "tok", lambda m: m["engines"]["draft-fp32"].update(
        tokenizer_sha256="0" * 64))
    with pytest.raises(SpecrtError, match="different tokenizer") as e:
        load_manifest(bad)
    assert "\n" not in str(e.value)


def test_mixed_vocab_in_manifest_is_an_error_at_load(pair_engines, tmp_path):
    bad = _edited_copy(pair_engines, tmp_path / "voc", lambda m: m["engines"]["draft-fp32"].update(vocab_size=999))
    with pytest.raises(SpecrtError, match="vocabulary"):
        load_manifest(bad)


def test_draft_without_target_is_an_error(pair_engines, tmp_path):
    bad = _edited_copy(pair_engines, tmp_path / "nt", lambda m: m["engines"].pop("target-fp32"))
    with pytest.raises(SpecrtError, match="no target"):
        load_manifest(bad)
    r = CliRunner().invoke(_app(), ["generate", "--engines", str(bad), "--prompt", "hi", "--speculate", "draft"])
    assert r.exit_code != 0 and "no target" in r.output


def _app():
    from specrt.cli import app

    return app


@pytest.mark.parametrize("args, msg", [
    (["--speculate", "draft"], "no draft engine"),
    (["--speculate", "prompt-lookup", "--draft-tokens", "0"], "--draft-tokens must be in"),
    (["--speculate", "auto", "--draft-tokens", "100000"], "--draft-tokens must be in"),
    (["--speculate", "medusa-9"], "unknown --speculate"),
])
def test_cli_bad_speculation_input(tiny_engines, args, msg):
    r = CliRunner().invoke(_app(), ["generate", "--engines", str(tiny_engines), "--prompt", "hi", *args])
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0]


def test_cli_json_reports_speculation_stats(pair_engines):
    r = CliRunner().invoke(_app(), ["generate", "--engines", str(pair_engines), "--prompt", PROMPT, "--json",
                                    "--speculate", "auto", "--max-new-tokens", "24", "--threads", "1"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output.strip().splitlines()[-1])["stats"]
    assert stats["proposer"] == "draft/lookup/suffix" and stats["tau"] >= 1.0 and stats["exact"] is True
    assert set(stats["drafted_by_source"]) <= {"draft", "prompt-lookup", "suffix"}
    assert isinstance(stats["acceptance_by_position"], list) and stats["draft_s"] > 0 and stats["verify_s"] > 0


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.slow
def test_sampled_draft_model_has_the_target_distribution(pair_engines, k):
    """Sampled drafting with q from a different (random) model: accepts, residual recoveries and
    bonus tokens all occur; the first two emitted tokens must still follow the target exactly."""
    from test_speculative import assert_same_distribution, first_two_counts, target_joint

    from specrt.runtime.generate import Generator
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import FixedK, make_decoder, speculative_decode

    gen = Generator.load(pair_engines, "fp32", EngineOptions(threads=1))
    prompt = gen.prompt_ids(PROMPT)
    params = SamplingParams(temperature=1.0, top_k=3)
    proposer = make_decoder("draft", gen.manifest).proposer
    joint = target_joint(gen, prompt, params)
    counts = first_two_counts(gen, prompt, params, lambda *a: speculative_decode(
        *a, proposer=proposer, control=FixedK(k)), 1500)
    assert_same_distribution(counts, joint)


def test_draft_model_streams_in_a_batch_keep_their_output(pair_engines):
    """--speculate draft with --parallel 2: the draft model is a batch engine too (its one-token passes batched);
    each stream's greedy tokens equal plain decoding's."""
    from test_batch import GREEDY, PROMPTS, gathering, run_threads

    from specrt.runtime.session import load

    jobs = [(PROMPTS[0], 60, 0.0), (PROMPTS[2], 50, 0.0), (PROMPTS[3], 40, 0.0)]
    alone = load(pair_engines, "fp32", "off")
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    batched = gathering(load(pair_engines, "fp32", "draft", parallel=2), 2)
    assert run_threads(batched, jobs) == want
    assert len(batched._batches) == 2  # target and draft


def test_a_new_turn_is_caught_up_apart_and_not_counted_as_drafting(self_engines, monkeypatch):
    """Turn 2 of a conversation with KV reuse: the draft reads the turn's unread tokens in a pass of its own before
    its first draft step, reported as Round.catchup_s and left out of the round's draft seconds (the controllers'
    cost of a drafted token); later rounds (1-2 unread tokens) draft without one. The pair's acceptance is kept
    across turns, and the output is the target's (docs/voice.md, "Why auto drafted little on voice turns")."""
    from specrt.runtime import speculative
    from specrt.runtime.control import Round
    from specrt.runtime.prefix_cache import PrefixStore
    from specrt.runtime.proposers.draft_model import CATCHUP_APART
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.speculative import SpeculativeConfig
    from specrt.runtime.tokenizer import Message

    rounds: list[Round] = []

    class Logged(Round):
        def __init__(self, *args):
            super().__init__(*args)
            rounds.append(self)

    monkeypatch.setattr(speculative, "Round", Logged)
    greedy = SamplingParams(temperature=0.0)
    session = load(self_engines, "fp32", "draft", EngineOptions(threads=1), SpeculativeConfig(draft_tokens=3))
    session.enable_reuse(PrefixStore(64 << 20))
    draft = session.decoder.proposer.engine
    fed, argmax = [], draft.argmax
    monkeypatch.setattr(draft, "argmax", lambda tokens, *a, **kw: fed.append(len(tokens)) or argmax(tokens, *a, **kw))
    chat = [Message("user", PROMPT)]
    chat += [Message("assistant", session.generate(chat, max_new_tokens=12, sampling=greedy).text),
             Message("user", "And what comes after that, in a few more words? " * 2)]
    fed.clear(), rounds.clear()
    second = session.generate(chat, max_new_tokens=16, sampling=greedy)
    drafted = [r for r in rounds if r.asked]
    assert drafted[0].catchup_s > 0.0 and fed[0] > CATCHUP_APART, (fed, drafted[0])
    assert all(r.catchup_s == 0.0 for r in drafted[1:]) and max(fed[1:]) <= 2, fed
    assert second.stats.cached_tokens > 0
    assert second.stats.draft_s >= sum(r.draft_s + r.catchup_s for r in drafted) - 1e-9  # the stats keep it all
    plain = load(self_engines, "fp32", "off", EngineOptions(threads=1)).generate(chat, max_new_tokens=16,
                                                                                   sampling=greedy)
    assert second.token_ids == plain.token_ids
    assert load(self_engines, "fp32", "auto", EngineOptions(threads=1)).decoder.control.carry  # a pair's profile
