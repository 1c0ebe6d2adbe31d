"""Medusa: training smoke test on a tiny model (loss goes down, a checkpoint resumes to the same
heads), the heads engine, and greedy Medusa output equal to target-only greedy at fp32 on trees
whose nodes are accepted, rejected and accepted past the first sibling."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.engine import EngineOptions
from specrt.runtime.tree import compile_tree


@pytest.fixture(scope="module")
def tiny_heads(tiny_dir, tmp_path_factory):
    """Self-distillation data from the tiny Llama, heads trained in two bounded runs (the second resumes)."""
    import torch

    from specrt.export.train.medusa import TrainConfig, train_heads
    from specrt.export.train.medusa_data import DataConfig, build_dataset
    from specrt.export.sources import load, resolve

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("medusa")
    src = resolve(str(tiny_dir))
    data = build_dataset(src, out / "cache", DataConfig(heads=3, max_new_tokens=24, doc_prompts=6, code_chunks=6,
                                                        batch=8, mtbench_limit=10), log=lambda m: None)
    lm_head = load(src)[0].lm_head.weight.detach().numpy()
    logs: list[str] = []
    # the first run stops early (at a step, not a time budget: a quiet machine finished 258 steps in 0.3 s)
    cfg = TrainConfig(vocab=256, batch=32, lr=3e-3, max_epochs=6, budget_s=120.0, stop_step=60, ranks=4)
    first = train_heads(data, lm_head, out / "run", cfg, log=logs.append)   # checkpoint, stop
    second = train_heads(data, lm_head, out / "run", TrainConfig(**{**cfg.__dict__, "stop_step": 0}),
                         log=logs.append)
    whole = train_heads(data, lm_head, out / "whole", TrainConfig(**{**cfg.__dict__, "stop_step": 0}),
                        log=lambda m: None)                                  # the same seed, never stopped
    return {"data": data, "first": first, "second": second, "whole": whole, "logs": logs, "out": out / "run",
            "lm_head": lm_head}


def test_training_loss_goes_down_and_resumes(tiny_heads):
    first, second, logs = tiny_heads["first"], tiny_heads["second"], tiny_heads["logs"]
    assert first["steps"] == 60 < second["steps"]
    assert any(m.startswith(f"resumed at step {first['steps']}/") for m in logs)
    assert second["final_loss"] < 0.8 * second["first_loss"]
    assert len(second["top1"]) == 3 and all(0 <= a <= b <= 1 for a, b in zip(second["top1"], second["top5"]))
    # stop + resume is the uninterrupted run: weights, optimizer state and data order all carry over
    resumed, whole = (np.load(tiny_heads["out"].parent / d / "heads.npz") for d in ("run", "whole"))
    assert second["steps"] == tiny_heads["whole"]["steps"]
    for k in ("w1", "b1", "w2", "b2", "a"):
        np.testing.assert_allclose(resumed[k].astype(np.float32), whole[k].astype(np.float32), atol=1e-3, err_msg=k)


def test_data_labels_are_the_targets_own_next_tokens(tiny_heads):
    """Head k's label at position t is y[t + k], y[t] = the target's choice after t (greedy chat
    continuations and teacher-forced code alike): the argmax of its lm_head on the stored hidden
    state of position t + k."""
    d = np.load(tiny_heads["data"])
    lab, hid = d["labels"], d["hidden"].astype(np.float32)
    assert lab.shape[1] == 3 and hid.shape[0] == lab.shape[0] and d["hidden"].dtype == np.float16
    y = (hid @ tiny_heads["lm_head"].T).argmax(1)
    for k in range(1, 4):
        t = np.flatnonzero(lab[:, k - 1] >= 0)   # a label exists only where t + k is in the same sequence
        assert t.size > 500 and (lab[t, k - 1] == y[t + k]).mean() > 0.98, k


def test_heads_engine_matches_numpy(tiny_heads, tmp_path):
    import onnxruntime as ort

    from specrt.export.medusa import export_heads_onnx, load_heads

    heads = load_heads(tiny_heads["out"] / "heads.npz")
    K, H, _ = heads["w1"].shape
    lm = np.random.default_rng(0).standard_normal((384, H)).astype(np.float32)
    h = np.random.default_rng(1).standard_normal((1, H)).astype(np.float32)
    tok = np.array([7])
    f = {k: heads[k].astype(np.float32) for k in ("w1", "b1", "w2", "b2", "a")}
    x = h + (lm[tok] @ f["a"]).astype(np.float16).astype(np.float32)      # the table is stored in float16
    a = x @ f["w1"] + f["b1"][:, None]
    y = x + (a / (1 + np.exp(-a))) @ f["w2"] + f["b2"][:, None]            # [K, 1, H]
    ref = heads["vocab"][np.argsort(-(y[:, 0] @ lm[heads["vocab"]].T), axis=1)[:, :3]]
    for depth in (None, 2):                     # all heads, or the first two (all a tree of depth 2 reads)
        export_heads_onnx(heads, lm, tmp_path / "m.onnx", topk=3, depth=depth)
        cand = ort.InferenceSession(str(tmp_path / "m.onnx")).run(["candidates"], {"hidden": h, "token": tok})[0][0]
        assert cand.shape == (depth or K, 3) and (cand == ref[:depth or K]).all()


def test_loop_tree_inputs_match_the_compiler():
    from specrt.runtime.speculative import tree_inputs
    from specrt.runtime.tree import DEFAULT_TREE

    t = compile_tree(DEFAULT_TREE)
    pos, mask = tree_inputs(100, 1, t.parents)
    assert (pos == 100 + t.positions).all()
    causal = np.tri(t.size + 1, dtype=bool)  # the graph applies causality on top of either mask
    assert (((mask == 0) & causal) == (t.mask == 0)).all()


@pytest.fixture(scope="module")
def medusa_gen(tiny_dir, tiny_heads, tmp_path_factory):
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from specrt.runtime.generate import Generator

    path = make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-medusa", ("fp32", "int4"), 256,
                                            tmp_path_factory.mktemp("engines"),
                                            medusa_heads=tiny_heads["out"] / "heads.npz"), log=lambda m: None)
    return Generator.load(path, "fp32", EngineOptions(threads=1))


def test_greedy_medusa_equals_target_greedy(medusa_gen):
    """The engine set's own heads and tree, through make_decoder. These tiny heads are rarely right on
    these prompts (and the tree chosen for them is a chain): acceptance is tested with ReplayHeads."""
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import make_decoder

    gen = medusa_gen
    assert gen.manifest.engine("medusa").raw["medusa"]["training"]["heads"] == 3
    for prompt in ("def add(a, b):", "The quick brown fox", "Hello, how are you?"):
        plain = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams())
        med = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(),
                           decode=make_decoder("medusa", gen.manifest, "fp32", options=EngineOptions(threads=1)))
        assert med.token_ids == plain.token_ids
        assert med.stats.proposer == "medusa"
        auto = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(),
                            decode=make_decoder("auto", gen.manifest, "fp32", options=EngineOptions(threads=1)))
        assert auto.token_ids == plain.token_ids and auto.stats.proposer == "lookup+medusa/suffix"


class ReplayHeads:
    """Stands in for a heads engine that is right where a table says. It knows the target's greedy
    sequence `seq` and the hidden state hid[t] of each of its positions; given a hidden state, it
    finds its position t and ranks head k's true token seq[t + 2 + k] at rank[t, k] among wrong
    candidates (rank >= topk: not a candidate). A call whose hidden state is no position's, or whose
    pending token is not seq[t + 1], is a miss: Medusa must pass the hidden state of the last
    accepted position and the token the target chose after it."""

    heads, topk, on_device = 3, 2, False

    def __init__(self, seq: list[int], hid: np.ndarray, vocab: int):
        self.seq, self.hid, self.vocab = np.array(seq + [0] * 4), hid, vocab   # padded: past the end is never verified
        self.rank = np.random.default_rng(0).choice(3, (len(seq), self.heads), p=[0.5, 0.25, 0.25])
        self.calls, self.misses = 0, 0

    def __call__(self, hidden: np.ndarray, token: int) -> np.ndarray:
        d = np.abs(self.hid - hidden).max(axis=1)
        t = int(d.argmin())
        self.calls += 1
        self.misses += bool(d[t] > 1e-3 or self.seq[t + 1] != token)
        truth = self.seq[t + 2: t + 2 + self.heads]
        cand = (truth[:, None] + 1 + np.arange(self.topk)) % self.vocab     # wrong tokens
        hit = np.flatnonzero(self.rank[t] < self.topk)
        cand[hit, self.rank[t, hit]] = truth[hit]
        return cand


# siblings at depths 1 and 2: 6 nodes, depth 3, so near the context end a tree is deeper than wide
TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))


@pytest.fixture(scope="module")
def replay(medusa_gen):
    """A prompt, target-only greedy decoding of it until the context (256) is full, and the hidden
    state of every position from one pass over prompt + output."""
    from specrt.runtime.sampling import SamplingParams

    prompt = "The quick brown fox"
    plain = medusa_gen.generate(prompt, max_new_tokens=1000, sampling=SamplingParams(), ignore_eos=True)
    seq = medusa_gen.prompt_ids(prompt) + plain.token_ids
    eng = medusa_gen.engine
    eng.enable_hidden()
    eng.rewind(0)
    eng.forward(np.array(seq, np.int64))
    hid = eng.hidden.copy()
    eng.rewind(0)
    return prompt, plain, seq, hid


@pytest.mark.parametrize("mode", ["medusa", "lookup+medusa"])
def test_medusa_trees_equal_target_greedy_to_the_end_of_the_context(medusa_gen, replay, mode):
    """Medusa (and lookup+medusa) on a tree with siblings, heads right at rank 0, at rank 1 or not at
    all (ReplayHeads), decoding until the context is full: the output is target-only greedy's and
    ends the same way ("context": the loop cuts the last trees to the room left; it raised
    ContextFullError when a 6-node tree of depth <= k met 3 free places). Rounds accept all, some
    or none of a path, nodes past the first sibling are accepted, and the heads always read the
    hidden state of the last accepted position (tree node or lookup chain) with its next token."""
    from specrt.runtime.proposers import PromptLookup
    from specrt.runtime.proposers.hybrid import Fallback
    from specrt.runtime.proposers.medusa import Medusa
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import FixedK, speculative_decode

    prompt, plain, seq, hid = replay
    assert plain.stats.finish_reason == "context" and len(seq) == medusa_gen.engine.max_context
    heads = ReplayHeads(seq, hid, medusa_gen.engine.vocab_size)
    medusa = Medusa(heads, TREE)
    proposer = medusa if mode == "medusa" else Fallback(mode, PromptLookup((6, 4, 3, 2, 1), 3), medusa)
    rounds = []                                   # [draft, free places, result] of every Medusa round
    propose, observe, room = medusa.propose, medusa.observe, lambda ctx: medusa_gen.engine.max_context - ctx.length
    medusa.propose = lambda ctx, k: rounds.append([propose(ctx, k), room(ctx)]) or rounds[-1][0]
    medusa.observe = lambda result, hidden: (rounds[-1].append(result), observe(result, hidden))
    out = medusa_gen.generate(prompt, max_new_tokens=1000, sampling=SamplingParams(), ignore_eos=True,
                              decode=lambda *a: speculative_decode(*a, proposer=proposer, control=FixedK(3)))
    assert out.token_ids == plain.token_ids and out.stats.finish_reason == "context"
    assert heads.calls > 10 and heads.misses == 0
    trees = [(d, free, r) for d, free, r in rounds if d.parents is not None]
    accepted = [r.num_accepted for _, _, r in trees]
    assert min(accepted) == 0 and max(accepted) == 3 and 1 in accepted, accepted
    rank = medusa.trees[3].rank
    assert sum(rank[r.path].max() > 0 for _, _, r in trees if r.num_accepted) >= 3   # (1,), (0, 1) or (1, 0) kept
    if mode == "medusa":
        assert any(d.tokens.size > free for d, free, _ in trees)  # a tree met the end of the context
    else:  # the output settles into a cycle, where lookup drafts: trees read hidden states after its chains
        assert any(a[0].parents is None and a[2].num_accepted and b[0].parents is not None
                   for a, b in zip(rounds, rounds[1:]))


def test_sampling_is_exact_unless_lossy_typical_is_asked(medusa_gen):
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import SpeculativeConfig, make_decoder

    m = medusa_gen.manifest
    sp = SamplingParams(temperature=0.8, seed=3)
    exact = medusa_gen.generate("def add(a, b):", max_new_tokens=24, sampling=sp,
                                decode=make_decoder("medusa", m, "fp32", options=EngineOptions(threads=1)))
    lossy = medusa_gen.generate("def add(a, b):", max_new_tokens=24, sampling=sp,
                                decode=make_decoder("medusa", m, "fp32", options=EngineOptions(threads=1),
                                                    config=SpeculativeConfig(lossy_typical=True)))
    assert exact.stats.exact and not exact.stats.lossy
    assert not lossy.stats.exact and lossy.stats.lossy and lossy.stats.as_dict()["lossy"] is True
    # the label is earned: Medusa's drafts carry no q, so seeded sampling through them is plain seeded sampling
    plain = medusa_gen.generate("def add(a, b):", max_new_tokens=24, sampling=sp,
                                decode=make_decoder("off", m, "fp32", options=EngineOptions(threads=1)))
    assert list(exact.token_ids) == list(plain.token_ids)


def test_cli_labels_lossy_typical_as_lossy_not_as_width(medusa_gen):
    """--lossy-typical on a width-exact fp32 engine: the stats line says why the output is not exact."""
    import json

    from typer.testing import CliRunner

    from specrt.cli import app

    args = ["generate", "--engines", str(medusa_gen.manifest.root), "--prompt", "def add(a, b):", "--threads", "1",
            "--speculate", "medusa", "--temperature", "0.8", "--seed", "3", "--max-new-tokens", "12"]
    r = CliRunner().invoke(app, args + ["--lossy-typical"])
    assert r.exit_code == 0, r.output
    assert "LOSSY (typical acceptance)" in r.output and "width-exact" not in r.output
    r = CliRunner().invoke(app, args + ["--lossy-typical", "--json"])
    stats = json.loads(r.output.strip().splitlines()[-1])["stats"]
    assert stats["lossy"] is True and stats["exact"] is False
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "LOSSY" not in r.output and "width-exact" not in r.output


def test_lookup_medusa_routes_by_match_and_stays_exact(medusa_gen):
    """lookup+medusa: prompt lookup's chain after a match of >= 2 tokens, Medusa's tree otherwise;
    greedy output equals target-only greedy, and both kinds of draft occur on a repetitive prompt."""
    from specrt.runtime.proposers import PromptLookup
    from specrt.runtime.proposers.hybrid import Fallback
    from specrt.runtime.proposers.medusa import Medusa
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import make_decoder

    gen = medusa_gen
    decode = make_decoder("lookup+medusa", gen.manifest, "fp32", options=EngineOptions(threads=1))
    hybrid = decode.proposer
    assert isinstance(hybrid, Fallback) and hybrid.first_secondary == 4  # sizes 6, 4, 3, 2 look up
    assert isinstance(hybrid.primary, PromptLookup) and isinstance(hybrid.secondary, Medusa)
    kinds = {"chain": 0, "tree": 0}
    propose = hybrid.propose

    def counting(ctx, k):
        d = propose(ctx, k)
        if d.tokens.size:
            kinds["tree" if d.parents is not None else "chain"] += 1
            assert (d.parents is None) == (hybrid.bucket(ctx) < hybrid.first_secondary)
        return d

    hybrid.propose = counting
    for prompt in ("def add(a, b):\n    return a + b\n\ndef add(a, b):", "The quick brown fox",
                   "1, 2, 3, 1, 2, 3, 1, 2,"):
        plain = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams())
        out = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(), decode=decode)
        assert out.token_ids == plain.token_ids and out.stats.proposer == "lookup+medusa"
    assert kinds["chain"] > 0 and kinds["tree"] > 0, kinds
    # auto takes it at fp32 only: at int4 the heads (trained on fp32 hidden states) measured no gain
    auto32 = make_decoder("auto", gen.manifest, "fp32", options=EngineOptions(threads=1)).proposer
    assert [p.name for p in auto32.parts] == ["lookup+medusa", "suffix"]          # beside suffix decoding
    auto4 = make_decoder("auto", gen.manifest, "int4", options=EngineOptions(threads=1)).proposer
    assert [p.name for p in auto4.parts] == ["prompt-lookup", "suffix"]


def test_suffix_medusa_routes_by_match_and_stays_exact(medusa_gen):
    """suffix+medusa: suffix decoding's tree after a match of >= 2 tokens (here or in earlier answers), Medusa's
    otherwise; greedy output equals target-only greedy, and both draft."""
    from specrt.runtime.proposers.hybrid import Fallback
    from specrt.runtime.proposers.medusa import Medusa
    from specrt.runtime.proposers.suffix import SuffixDecoding
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import make_decoder

    gen = medusa_gen
    decode = make_decoder("suffix+medusa", gen.manifest, "fp32", options=EngineOptions(threads=1))
    hybrid = decode.proposer
    assert isinstance(hybrid, Fallback) and hybrid.first_secondary == 4 and hybrid.reads_prompt  # 16, 8, 4, 2
    assert isinstance(hybrid.primary, SuffixDecoding) and isinstance(hybrid.secondary, Medusa)
    kinds = {"suffix": 0, "medusa": 0}
    propose = hybrid.propose

    def counting(ctx, k):
        d = propose(ctx, k)
        if d.tokens.size:
            kinds["suffix" if hybrid.bucket(ctx) < hybrid.first_secondary else "medusa"] += 1
        return d

    hybrid.propose = counting
    for prompt in ("def add(a, b):\n    return a + b\n\ndef add(a, b):", "The quick brown fox",
                   "1, 2, 3, 1, 2, 3, 1, 2,", "The quick brown fox"):
        plain = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams())
        out = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(), decode=decode)
        assert out.token_ids == plain.token_ids and out.stats.proposer == "suffix+medusa"
    assert kinds["suffix"] > 0 and kinds["medusa"] > 0, kinds


def test_corrupt_heads_engine_is_one_line(medusa_gen, tmp_path):
    """A damaged medusa-fp32.onnx is a one-line error naming the file at load, like the target's."""
    import shutil

    from specrt.errors import SpecrtError
    from specrt.runtime.speculative import make_decoder

    broken = tmp_path / "broken"
    shutil.copytree(medusa_gen.manifest.root, broken)
    f = broken / "medusa-fp32.onnx"
    f.write_bytes(f.read_bytes()[:200])
    from specrt.runtime.generate import Generator

    gen = Generator.load(broken, "fp32", EngineOptions(threads=1))
    with pytest.raises(SpecrtError, match=r"cannot load engine .*medusa-fp32\.onnx.*rebuild"):
        make_decoder("medusa", gen.manifest, "fp32", options=EngineOptions(threads=1))


def test_heads_of_another_hidden_size_are_an_error_at_load(medusa_gen, tmp_path):
    import json
    import shutil

    from specrt.errors import SpecrtError
    from specrt.manifest import load_manifest

    broken = tmp_path / "other-heads"
    shutil.copytree(medusa_gen.manifest.root, broken)
    m = json.loads((broken / "manifest.json").read_text())
    name = next(k for k, v in m["engines"].items() if v["role"] == "medusa")
    m["engines"][name]["hidden_size"] += 8
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecrtError, match="different hidden sizes.*train-medusa"):
        load_manifest(broken)


def test_flat_pass_timings_fall_back_to_a_prior(monkeypatch):
    """A busy machine made wide passes look nearly free (48 tokens at 1.14 steps) and chose a 36-node tree:
    implausibly flat timings are measured again, then replaced by the prior, and the log says so."""
    from specrt.pipeline import tree_sizing

    quiet = [(1, 0.02), (2, 0.0206), (8, 0.0274), (48, 0.0638)]
    flat = [(1, 0.02), (2, 0.02), (8, 0.0228), (48, 0.0228)]
    calls, logs = [], []
    monkeypatch.setattr(tree_sizing, "_pass_costs", lambda *a: calls.append(1) or flat)
    cost = tree_sizing._plausible_pass_costs(None, {}, logs.append, None, None)
    assert len(calls) == 3 and "distorted" in logs[0] and "--medusa-tree-nodes" in logs[0]
    assert cost[-1][1] / cost[0][1] == pytest.approx(1 + tree_sizing.PRIOR_WIDTH_SLOPE * 47)
    monkeypatch.setattr(tree_sizing, "_pass_costs", lambda *a: quiet)
    logs.clear()
    assert tree_sizing._plausible_pass_costs(None, {}, logs.append, None, None) == quiet and not logs


def test_ctrl_c_keeps_the_steps_trained_so_far(tiny_heads, tmp_path):
    """An interrupt saves a checkpoint at the last completed step (it used to lose up to a minute of
    training), and the next run resumes from it."""
    import torch

    from specrt.export.train.medusa import TrainConfig, train_heads

    cfg = TrainConfig(vocab=256, batch=32, lr=3e-3, max_epochs=6, budget_s=120.0, ranks=4)

    def interrupt_at_50(msg):
        if msg.startswith("step 50/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(tiny_heads["data"], tiny_heads["lm_head"], tmp_path / "run", cfg, log=interrupt_at_50)
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["state"]["step"] == 50
    logs = []
    train_heads(tiny_heads["data"], tiny_heads["lm_head"], tmp_path / "run", cfg, log=logs.append)
    assert any("resumed" in m and "50" in m for m in logs)


def test_ceiling_medusa_replay_equals_the_loop(medusa_gen, replay, tiny_heads, tmp_path):
    """experiments/ceiling's Medusa replay (ranks from one pass over the output, rounds replayed offline) counts the
    same rounds as the loop really runs with that tree and those heads (greedy, FixedK at the tree's depth):
    with ReplayHeads, whose rounds keep 0 to 3 nodes, siblings included; and through onnx_heads, with the tiny
    set's trained heads."""
    from experiments.ceiling import medusa_ranks, onnx_heads, replay_tree, tree_accepts
    from specrt.export.medusa import export_heads_onnx, load_heads
    from specrt.runtime.backends.onnxruntime_cpu.heads import OrtHeads
    from specrt.runtime.proposers.medusa import Medusa
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import FixedK, speculative_decode

    prompt, _, seq, hid = replay
    P, n = len(medusa_gen.prompt_ids(prompt)), 120
    onnx_path = tmp_path / "heads.onnx"
    export_heads_onnx(load_heads(tiny_heads["out"] / "heads.npz"), tiny_heads["lm_head"], onnx_path, 2)
    table = ReplayHeads(seq, hid, medusa_gen.engine.vocab_size)
    table_batch = lambda h, t: np.stack([table(a, b) for a, b in zip(h, t)])  # noqa: E731
    for heads, batch in ((table, table_batch), (OrtHeads(onnx_path), onnx_heads(onnx_path))):
        ranks = medusa_ranks(batch, hid, seq, P, n, 2)
        assert ranks.shape == (n, 3) and (ranks[0] == 2).all()
        tokens, rounds, cost = replay_tree(ranks, set(TREE), 2.0)
        out = medusa_gen.generate(prompt, max_new_tokens=n, sampling=SamplingParams(), ignore_eos=True,
                                  decode=lambda *a: speculative_decode(*a, proposer=Medusa(heads, TREE),
                                                                       control=FixedK(3)))
        assert out.token_ids == seq[P: P + n]
        assert (tokens, rounds, cost) == (n, out.stats.rounds, 1.0 + 2.0 * (rounds - 1))
        kept, every = tree_accepts(ranks, set(TREE)), tree_accepts(ranks, None, 2)   # the unlimited tree keeps more
        assert (every >= kept).all() and every[0] == 0 and every.max() <= 3
    assert table.misses == 0
    replayed = replay_tree(medusa_ranks(table_batch, hid, seq, P, n, 2), set(TREE), 1.0)
    assert replayed[1] < 0.7 * n           # ReplayHeads' rounds keep about one node in two: the check above had work


def test_medusa_streams_in_a_batch_keep_their_output(medusa_gen):
    """lookup+medusa with --parallel 2 (heads shared by the slots, drafts chosen by load; a draft's pass runs alone):
    each stream's greedy tokens equal plain decoding's."""
    from test_batch import GREEDY, PROMPTS, gathering, run_threads

    from specrt.runtime.session import load

    jobs = [(PROMPTS[0], 60, 0.0), (PROMPTS[2], 50, 0.0), (PROMPTS[3], 40, 0.0)]
    alone = load(medusa_gen.manifest, "fp32", "off")
    want = [alone.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    assert run_threads(gathering(load(medusa_gen.manifest, "fp32", "lookup+medusa", parallel=2), 2), jobs) == want


@pytest.mark.slow
def test_fp8_heads_of_a_portable_set_keep_the_targets_output(tiny_dir, tiny_heads, tmp_path):
    """Heads at the set's Q/DQ precision: per-head 2-D GEMMs with FP8 Q/DQ inside onnx-tensorrt's table,
    calibrated on the target's hidden states, their tau for the fp32 target measured beside the fp32 heads', and
    a target with them still decodes exactly its own greedy output."""
    import onnx
    from dataclasses import replace
    from test_portable import tensorrt_violations

    from specrt.manifest import load_manifest
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from specrt.runtime.session import load

    path = make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-medusa-qdq", ("fp32", "fp8"), 512, tmp_path,
                                            medusa_heads=tiny_heads["out"] / "heads.npz",
                                            backend="onnxruntime-portable", calibration_texts=4, quality_floor=0.5),
                           log=lambda m: None)
    m = load_manifest(path)
    fp8 = m.engines["medusa-fp8"]
    assert fp8.role == "medusa" and fp8.precision == "fp8" and fp8.session_config == {"session.disable_quant_qdq": "1"}
    assert fp8.medusa["tree"] == m.engines["medusa-fp32"].medusa["tree"]
    assert fp8.build["gemms_quantized"] == 2 * fp8.medusa["heads"] + 1  # two layers a head and the lm_head rows
    model = onnx.load(str(path / fp8.file), load_external_data=False)
    assert {t.data_type for t in model.graph.initializer if t.name.endswith(".q")} == {onnx.TensorProto.FLOAT8E4M3FN}
    assert tensorrt_violations(model) == []
    for name in ("medusa-fp32", "medusa-fp8"):
        d = m.engines[name].quality["drafting"]
        assert d["against"] == "target-fp32" and 1.0 <= d["tau"] and d["humaneval"]["prompts"] >= 1
    from specrt.bench.quant_report import rows

    heads = {r["engine"]: r for r in rows(m) if r["role"] == "medusa"}
    assert heads["medusa-fp8"]["draft_tau_kept"] == round(heads["medusa-fp8"]["draft_tau"] /
                                                          heads["medusa-fp32"]["draft_tau"], 3)
    only = replace(m, engines={k: e for k, e in m.engines.items() if k in ("target-fp32", "medusa-fp8")})
    plain, med = load(only, "fp32", "off"), load(only, "fp32", "medusa")
    for prompt in ("def add(a, b):", "The quick brown fox"):
        a, b = plain.generate(prompt, max_new_tokens=32), med.generate(prompt, max_new_tokens=32)
        assert b.token_ids == a.token_ids and b.stats.exact and b.stats.proposer == "medusa"


def test_heads_on_the_targets_gpu_read_the_hidden_row_there():
    """Heads that take a device address (TrtHeads.on_device) beside a target that gives one (a GPU engine): the
    target keeps its hidden states on the device and the heads get the accepted row's address; host heads (or a
    target without addresses) get the row itself."""
    from specrt.runtime.proposers import Context, HiddenRows
    from specrt.runtime.proposers.medusa import Medusa
    from specrt.runtime.verify import VerifyResult

    class Target:
        length, hidden, hidden_on_device = 0, np.arange(12, dtype=np.float32).reshape(3, 4), True

        def enable_hidden(self, device_only=False):
            self.device_only = device_only

        def hidden_address(self, row):
            return 1000 + 16 * row

    class Heads:
        heads, topk = 2, 2

        def __init__(self, on_device):
            self.on_device, self.got = on_device, []

        def __call__(self, hidden, token):
            self.got.append(hidden)
            return np.zeros((2, 2), np.int64)

    for on_device in (True, False):
        heads, target = Heads(on_device), Target()
        medusa = Medusa(heads, [(0,), (0, 0)])
        ctx = Context([1, 2, 3], 16)
        hidden = HiddenRows.open(target, medusa.reads_hidden)  # as the loop does
        medusa.start(ctx)
        assert target.device_only is on_device
        medusa.propose(ctx, 2)
        none = np.array([], np.int64)
        medusa.observe(VerifyResult(none, none, 7, False, np.zeros(0, bool)), hidden)  # row 2 is the last kept
        medusa.propose(ctx, 2)
        got = heads.got[-1]
        assert got == 1000 + 16 * 2 if on_device else (got == target.hidden[2]).all()


@pytest.mark.parametrize("backend", ["tensorrt", "onnxruntime-cuda"])
def test_heads_beside_either_gpu_backends_target_keep_its_hidden_states_on_the_device(tmp_path, backend):
    """Medusa on the host-memory fakes of a GPU backend (a TensorRT target with compiled heads, TrtHeads; a CUDA EP
    target with heads on the CUDA EP, OrtCudaHeads): the device path (the heads read the accepted row by address)
    against the host path of the same heads, round by round through long forced accepts: the same trees and tokens, and
    no hidden row downloaded on the device path (the host path downloads them); greedy output equals plain decoding's. A
    row of the wrong position drafts otherwise."""
    import onnxruntime as ort
    from gpu_fakes import (HostEngine, random_portable, fake_target, hidden_fetched, plain, random_heads,
                                   speculate)

    from specrt.export.medusa import export_heads_onnx
    from specrt.runtime.backends.device.memory import HostMemory
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaHeads
    from specrt.runtime.backends.tensorrt.heads import TrtHeads
    from specrt.runtime.proposers.medusa import Medusa

    random_portable(tmp_path / "target-fp32.onnx")
    graph = tmp_path / "medusa-fp32.onnx"
    export_heads_onnx(random_heads(32, 96), np.random.default_rng(2).standard_normal((96, 32)).astype(np.float32),
                      graph, topk=4)
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
    prompt = np.random.default_rng(5).integers(0, 96, 37)

    def stack(on_device: bool = True):
        target = fake_target(tmp_path / "target-fp32.onnx", backend)
        if backend == "tensorrt":
            heads = TrtHeads(HostEngine(graph), HostMemory(), "medusa-fp32")
        else:
            heads = OrtCudaHeads(ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]), device="cpu")
        if not on_device:
            heads.on_device = False
        return target, Medusa(heads, paths)

    host_target, host = stack(on_device=False)
    want, host_trees = speculate(host_target, host, prompt, 60, 3, forced=True)
    assert not host._device and hidden_fetched(host_target) > 0 and max(len(t) for t, _ in host_trees) == len(paths)
    target, medusa = stack()
    got, trees = speculate(target, medusa, prompt, 60, 3, forced=True)
    assert medusa._device and trees == host_trees and got == want
    assert hidden_fetched(target) == 0 and len(target.hidden) == 0
    target, medusa = stack()
    address = target.hidden_address
    target.hidden_address = lambda row: address(row + 1)
    assert speculate(target, medusa, prompt, 60, 3, forced=True)[1] != host_trees
    target, medusa = stack()
    assert speculate(target, medusa, prompt, 50, 3)[0] == plain(fake_target(tmp_path / "target-fp32.onnx", backend),
                                                                 prompt, 50)


@pytest.mark.parametrize("backend", ["tensorrt", "onnxruntime-cuda"])
@pytest.mark.parametrize("chunk", [0, 16])
def test_heads_on_the_device_read_each_batched_streams_own_rows(tmp_path, backend, chunk):
    """Three Medusa streams at once over a GPU backend's batch engine (fakes; the heads shared by the slots as
    --parallel shares them), one prompt run alone beside the batched ones or, with chunk, read in chunks while the
    others decode: with the heads on the device, each stream's trees and tokens are those of the host path in the
    same batch and of the stream alone beside a single-stream target, through long forced accepts, and no hidden
    row is downloaded; greedy output equals plain decoding's. A stream that reads another slot's rows, or a stale
    pass's, or a chunk's rows copied to the wrong offset, drafts otherwise."""

    import onnxruntime as ort
    from gpu_fakes import (HostEngine, random_portable, batch_hidden_fetched, batch_sabotages, fake_batch,
                                   fake_target, plain, random_heads, speculate, speculate_batch)

    from specrt.export.medusa import export_heads_onnx
    from specrt.runtime.backends.device.memory import HostMemory
    from specrt.runtime.backends.onnxruntime_cuda import OrtCudaHeads
    from specrt.runtime.backends.tensorrt.heads import TrtHeads
    from specrt.runtime.batch_session import _Shared
    from specrt.runtime.proposers.medusa import Medusa

    target_graph = tmp_path / "target-fp32.onnx"
    random_portable(target_graph)
    graph = tmp_path / "medusa-fp32.onnx"
    export_heads_onnx(random_heads(32, 96), np.random.default_rng(2).standard_normal((96, 32)).astype(np.float32),
                      graph, topk=4)
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 96, n) for n in (37, 100, 9)]

    def heads(on_device: bool = True):
        if backend == "tensorrt":
            h = TrtHeads(HostEngine(graph), HostMemory(), "medusa-fp32")
        else:
            h = OrtCudaHeads(ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]), device="cpu")
        h.on_device = on_device
        return _Shared(h)

    def batched(on_device: bool = True, forced: bool = True, sabotage=None):
        batch, shared = fake_batch(target_graph, backend), heads(on_device)
        if sabotage:
            sabotage(batch)
        out, engines = speculate_batch(batch, [Medusa(shared, paths) for _ in prompts], prompts, 40, 3, forced,
                                       chunk)
        return [o[0] for o in out], [o[1] for o in out], batch

    want, host_trees, host_batch = batched(on_device=False)
    assert batch_hidden_fetched(host_batch) > 0 and max(len(t) for d in host_trees for t, _ in d) == len(paths)
    got, trees, batch = batched()
    assert trees == host_trees and got == want and batch_hidden_fetched(batch) == 0
    for s, p in enumerate(prompts):  # each stream alone beside a single-stream target, on the device
        alone = speculate(fake_target(target_graph, backend), Medusa(heads(), paths), p, 40, 3, forced=True)
        assert alone == (want[s], host_trees[s])

    for sabotage in batch_sabotages(chunk):
        assert batched(sabotage=sabotage)[1] != host_trees, sabotage.__name__
    greedy = batched(forced=False)[0]
    assert greedy == [plain(fake_target(target_graph, backend), p, 40) for p in prompts]
