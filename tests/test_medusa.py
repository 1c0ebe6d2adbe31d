"""Medusa: training smoke test on a tiny model (loss goes down, a checkpoint resumes), the heads
engine, and greedy Medusa output equal to target-only greedy at fp32."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.tree import compile_tree


@pytest.fixture(scope="module")
def tiny_heads(tiny_dir, tmp_path_factory):
    """Self-distillation data from the tiny Llama, heads trained in two bounded runs (the second resumes)."""
    import torch

    from specrt.export.medusa import TrainConfig, train_heads
    from specrt.export.medusa_data import DataConfig, build_dataset
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
    return {"data": data, "first": first, "second": second, "logs": logs, "out": out / "run"}


def test_training_loss_goes_down_and_resumes(tiny_heads):
    first, second, logs = tiny_heads["first"], tiny_heads["second"], tiny_heads["logs"]
    assert first["steps"] == 60 < second["steps"]
    assert any(m.startswith(f"resumed at step {first['steps']}/") for m in logs)
    assert second["final_loss"] < 0.8 * second["first_loss"]
    assert len(second["top1"]) == 3 and all(0 <= a <= b <= 1 for a, b in zip(second["top1"], second["top5"]))
    assert (tiny_heads["out"] / "heads.npz").is_file()


def test_data_labels_are_the_targets_own_next_tokens(tiny_heads):
    d = np.load(tiny_heads["data"])
    lab = d["labels"]
    assert lab.shape[1] == 3 and d["hidden"].shape[0] == lab.shape[0] and d["hidden"].dtype == np.float16
    # head k+1's label at t is head k's label at t + 1 (same sequence)
    both = (lab[:-1, 1] >= 0) & (lab[1:, 0] >= 0)
    assert both.any() and (lab[:-1, 1][both] == lab[1:, 0][both]).all()


def test_heads_engine_matches_numpy(tiny_heads, tmp_path):
    import onnxruntime as ort

    from specrt.export.medusa import export_heads_onnx, load_heads

    heads = load_heads(tiny_heads["out"] / "heads.npz")
    K, H, _ = heads["w1"].shape
    lm = np.random.default_rng(0).standard_normal((384, H)).astype(np.float32)
    export_heads_onnx(heads, lm, tmp_path / "m.onnx", topk=3)
    h = np.random.default_rng(1).standard_normal((1, H)).astype(np.float32)
    tok = np.array([7])
    cand = ort.InferenceSession(str(tmp_path / "m.onnx")).run(["candidates"], {"hidden": h, "token": tok})[0][0]
    f = {k: heads[k].astype(np.float32) for k in ("w1", "b1", "w2", "b2", "a")}
    x = h + (lm[tok] @ f["a"]).astype(np.float16).astype(np.float32)      # the table is stored in float16
    a = x @ f["w1"] + f["b1"][:, None]
    y = x + (a / (1 + np.exp(-a))) @ f["w2"] + f["b2"][:, None]            # [K, 1, H]
    ref = heads["vocab"][np.argsort(-(y[:, 0] @ lm[heads["vocab"]].T), axis=1)[:, :3]]
    assert (cand == ref).all()


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
    return Generator.load(path, "fp32", threads=1)


def test_greedy_medusa_equals_target_greedy(medusa_gen):
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import make_decoder

    gen = medusa_gen
    assert gen.manifest.engine("medusa").raw["medusa"]["training"]["heads"] == 3
    taus = []
    for prompt in ("def add(a, b):", "The quick brown fox", "Hello, how are you?"):
        plain = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams())
        med = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(),
                           decode=make_decoder("medusa", gen.manifest, "fp32", threads=1))
        assert med.token_ids == plain.token_ids
        assert med.stats.proposer == "medusa"
        taus.append(med.stats.tau)
        auto = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(),
                            decode=make_decoder("auto", gen.manifest, "fp32", threads=1))
        assert auto.token_ids == plain.token_ids and auto.stats.proposer == "lookup+medusa"
    assert max(taus) > 1.0  # the heads were accepted at least sometimes


def test_sampling_is_exact_unless_lossy_typical_is_asked(medusa_gen):
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import SpeculativeConfig, make_decoder

    m = medusa_gen.manifest
    sp = SamplingParams(temperature=0.8, seed=3)
    exact = medusa_gen.generate("def add(a, b):", max_new_tokens=24, sampling=sp,
                                decode=make_decoder("medusa", m, "fp32", threads=1))
    lossy = medusa_gen.generate("def add(a, b):", max_new_tokens=24, sampling=sp,
                                decode=make_decoder("medusa", m, "fp32", threads=1,
                                                    config=SpeculativeConfig(lossy_typical=True)))
    assert exact.stats.exact and not lossy.stats.exact


def test_lookup_medusa_routes_by_match_and_stays_exact(medusa_gen):
    """lookup+medusa: prompt lookup's chain after a match of >= 2 tokens, Medusa's tree otherwise;
    greedy output equals target-only greedy, and both kinds of draft occur on a repetitive prompt."""
    from specrt.runtime.proposers.hybrid import LookupMedusa
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.speculative import make_decoder

    gen = medusa_gen
    decode = make_decoder("lookup+medusa", gen.manifest, "fp32", threads=1)
    hybrid = decode.proposer
    assert isinstance(hybrid, LookupMedusa) and hybrid.first_medusa == 4  # sizes 6, 4, 3, 2 look up
    kinds = {"chain": 0, "tree": 0}
    propose = hybrid.propose

    def counting(ctx, k):
        d = propose(ctx, k)
        if d.tokens.size:
            kinds["tree" if d.parents is not None else "chain"] += 1
            assert (d.parents is None) == (hybrid.bucket(ctx) < hybrid.first_medusa)
        return d

    hybrid.propose = counting
    for prompt in ("def add(a, b):\n    return a + b\n\ndef add(a, b):", "The quick brown fox", "1, 2, 3, 1, 2, 3, 1, 2,"):
        plain = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams())
        out = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(), decode=decode)
        assert out.token_ids == plain.token_ids and out.stats.proposer == "lookup+medusa"
    assert kinds["chain"] > 0 and kinds["tree"] > 0, kinds
    # auto takes it at fp32 only: at int4 the heads (trained on fp32 hidden states) measured no gain
    assert make_decoder("auto", gen.manifest, "fp32", threads=1).proposer.name == "lookup+medusa"
    assert make_decoder("auto", gen.manifest, "int4", threads=1).proposer.name == "prompt-lookup"
