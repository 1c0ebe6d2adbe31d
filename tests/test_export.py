"""Export parity: ONNX vs PyTorch on tiny Llama and Qwen2; the KV-cache contract of the engine."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from tiny import make_checkpoint


def _engine_for(tmp_path, arch, seed):
    from specrt.build.ort import build_ort_engine, precision
    from specrt.export.exporter import export_checkpoint
    from specrt.export.sources import resolve
    from specrt.runtime.backends.onnxruntime_cpu.batch import OrtBatchEngine
    from specrt.runtime.batch import solo

    ckpt = make_checkpoint(tmp_path / arch, arch, seed=seed)
    facts = export_checkpoint(resolve(str(ckpt)), tmp_path / "exp", 128, log=lambda m: None)
    built = build_ort_engine(tmp_path / "exp" / "model.onnx", tmp_path / "fp32.onnx", precision("fp32"))
    # every residual Add went into a SkipSimplifiedLayerNormalization (2 per layer); only the first norm stays
    ops = built["op_counts"]
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * facts["spec"]["num_layers"], ops
    assert ops.get("SimplifiedLayerNormalization") == 1, ops
    # Qwen2's qkv bias
    assert ops.get("Add", 0) == (facts["spec"]["num_layers"] if facts["spec"]["qkv_bias"] else 0), ops
    s = facts["spec"]
    eng = solo(OrtBatchEngine(tmp_path / "fp32.onnx", slots=1, num_layers=s["num_layers"],
                              num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"], vocab_size=s["vocab_size"],
                              max_context=128, huge_pages=True))
    return ckpt, facts, eng


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("qwen2", 1)])
def test_parity_and_cache_contract(tmp_path, arch, seed):
    import torch
    from transformers import AutoModelForCausalLM

    ckpt, facts, eng = _engine_for(tmp_path, arch, seed)
    # 1. export parity figures are recorded and tight
    assert facts["parity"]["max_abs_logit_diff"] < 1e-4
    assert facts["parity"]["greedy_agreement"] == 1.0
    ids = np.random.default_rng(seed).integers(0, facts["spec"]["vocab_size"], 24)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None])).logits[0].numpy()
    # 2. one full forward equals PyTorch
    full = eng.forward(ids, num_logits=len(ids)).copy()
    assert np.abs(full - ref).max() < 1e-4
    # 3. prefill + N single steps equals the full forward
    eng.rewind(0)
    steps = [eng.forward(ids[:10], num_logits=10).copy()]
    eng.commit(10)
    for t in ids[10:]:
        steps.append(eng.forward(np.array([t])).copy())
        eng.commit(1)
    assert np.abs(np.concatenate(steps) - full).max() < 1e-4
    # 4. rewind then decode equals a fresh decode, even after garbage was written past the rewind point
    eng.rewind(12)
    eng.forward(np.array([3, 4, 5, 6]), num_logits=4)  # rejected draft: written, never committed
    again = eng.forward(ids[12:], num_logits=len(ids) - 12).copy()
    assert np.abs(again - full[12:]).max() < 1e-4
    # 5. a cache laid out for fewer positions gives the same logits, and grows past them keeping its contents
    eng.batch.CAPACITY_STEP = 8
    eng.rewind(0)
    eng.reserve(9)
    assert eng.capacity == 16
    eng.forward(ids[:10], num_logits=10)
    eng.commit(10)
    eng.reserve(1)  # never below what is committed
    assert eng.capacity == 16
    grown = [eng.forward(ids[10:18], num_logits=8).copy()]  # 18 > 16: relaid out, the first 10 copied
    eng.commit(8)
    assert eng.capacity == 32
    grown += [eng.forward(ids[18:], num_logits=len(ids) - 18).copy()]
    assert np.abs(np.concatenate(grown) - full[10:]).max() < 1e-4
    eng.rewind(0)
    eng.reserve(10 ** 6)
    assert eng.capacity == eng.max_context == 128


def test_tree_mask_matches_branch_by_branch(tmp_path):
    """Two sibling branches in one pass (shared positions, tree mask) equal decoding each branch."""
    _, facts, eng = _engine_for(tmp_path, "llama", 0)
    ids = np.random.default_rng(2).integers(0, facts["spec"]["vocab_size"], 8)
    eng.forward(ids, num_logits=1)
    eng.commit(len(ids))
    a, b, c = 11, 22, 33  # tree: root -> a -> c ; root -> b
    tokens = np.array([a, b, c])
    positions = np.array([8, 8, 9])
    mask = np.full((3, 3), -np.inf, np.float32)
    for i, anc in enumerate([[0], [1], [0, 2]]):
        mask[i, anc] = 0.0
    tree = eng.forward(tokens, positions=positions, tree_mask=mask, num_logits=3).copy()
    branch_ac = eng.forward(np.array([a, c]), num_logits=2).copy()
    branch_b = eng.forward(np.array([b]), num_logits=1).copy()
    assert np.abs(tree[[0, 2]] - branch_ac).max() < 1e-4
    assert np.abs(tree[1] - branch_b[0]).max() < 1e-4
    # committing the path [b] compacts its KV entry into place
    eng.forward(tokens, positions=positions, tree_mask=mask, num_logits=3)
    eng.commit(1, path=np.array([1]))
    nxt = eng.forward(np.array([5])).copy()
    eng.rewind(len(ids))
    eng.forward(np.array([b]))
    eng.commit(1)
    assert np.abs(eng.forward(np.array([5])) - nxt).max() < 1e-4


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_weights_in_a_hf_folder_are_one_line(tmp_path, tiny_dir, damage):
    import shutil

    from specrt.errors import SpecrtError
    from specrt.export.sources import load, resolve

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    w = ckpt / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2] if damage == "truncated" else np.random.default_rng(0).bytes(4096))
    with pytest.raises(SpecrtError, match="cannot load .*SafetensorError.*re-download"):
        load(resolve(str(ckpt)))


def test_greedy_gate_tolerates_near_ties_only():
    from specrt.export.exporter import NEAR_TIE, greedy_agreement, parity_problem

    ref = np.array([3, 1, 2, 0])
    rows = np.zeros((4, 5), np.float32)
    rows[np.arange(4), ref] = 5.0
    assert greedy_agreement(list(rows), ref) == {"agreement": 1.0, "divergence_gap": None}
    rows[1, 4] = 5.0 + NEAR_TIE / 4  # token 1: the run picks 4 where PyTorch picked 1, by a hair
    agree = greedy_agreement(list(rows), ref)
    assert agree["agreement"] == 0.25 and agree["divergence_gap"] == pytest.approx(NEAR_TIE / 4, rel=1e-3)
    assert parity_problem(1e-5, agree["agreement"], agree["divergence_gap"]) is None  # a near-tie: 25% is fine
    rows[1, 4] = 7.0  # a clear preference PyTorch did not have: a wrong graph
    agree = greedy_agreement(list(rows), ref)
    assert "greedy decoding agrees" in parity_problem(1e-5, agree["agreement"], agree["divergence_gap"])
    assert "max |Δlogit|" in parity_problem(0.5, 1.0, None)


def test_export_fails_on_greedy_disagreement(tmp_path, tiny_dir, monkeypatch):
    import specrt.export.exporter as exporter
    from specrt.errors import SpecrtError
    from specrt.export.sources import resolve

    monkeypatch.setattr(exporter, "onnx_parity", lambda *a: {"max_abs_logit_diff": 1e-5, "greedy_agreement": 0.5,
                                                               "greedy_divergence_gap": 3.0,
                                                               "greedy_tokens_checked": 32})
    with pytest.raises(SpecrtError, match="export parity failed: greedy decoding agrees .* 50%"):
        exporter.export_checkpoint(resolve(str(tiny_dir)), tmp_path / "exp", 128, log=lambda m: None)


def test_built_fp32_engine_is_gated_on_parity(tmp_path, tiny_dir, monkeypatch):
    """An fp32 engine that strays from PyTorch fails the build and writes no set; quantized ones only record it."""
    import specrt.pipeline as pipeline
    from specrt.errors import SpecrtError

    bad = {"max_abs_logit_diff_vs_torch": 2e-3, "greedy_agreement_vs_torch": 0.125,
           "greedy_divergence_gap_vs_torch": 1.5, "width_max_abs_diff": 0.0, "width_exact": True}
    monkeypatch.setattr(pipeline.checks, "check_engine", lambda *a: dict(bad))
    out = tmp_path / "eng"
    with pytest.raises(SpecrtError, match="target-fp32 engine does not match PyTorch: greedy decoding agrees"):
        pipeline.make_engine_set(pipeline.EngineSetRequest(str(tiny_dir), "t", ("fp32",), 128, out), log=lambda m: None)
    assert sorted(p.name for p in out.iterdir()) == [".cache"]
    path = pipeline.make_engine_set(pipeline.EngineSetRequest(str(tiny_dir), "t", ("int8",), 128, out),
                                    log=lambda m: None)
    assert (path / "manifest.json").is_file()


def test_context_limit_is_a_clear_error(tmp_path):
    from specrt.runtime.engine import ContextFullError

    _, _, eng = _engine_for(tmp_path, "llama", 0)
    with pytest.raises(ContextFullError, match="max_context"):
        eng.forward(np.zeros(129, np.int64))


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").is_dir(), reason="needs Linux with THP")
def test_huge_page_advice_covers_large_anonymous_memory():
    from specrt.runtime.hugepages import HUGE, _subtract, advise_huge_pages, anonymous_mappings

    assert _subtract([(0, 10), (20, 30)], [(2, 4), (6, 8), (9, 25)]) == [(0, 2), (4, 6), (8, 9), (25, 30)]

    def vm_flags(address: int) -> list[str]:  # /proc/self/smaps: "hg" = MADV_HUGEPAGE was given
        lines = Path("/proc/self/smaps").read_text().splitlines()
        for i, line in enumerate(lines):
            span = line.split()[0]
            if "-" in span and all(c in "0123456789abcdef-" for c in span):
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= address < hi:
                    return next(x for x in lines[i + 1:] if x.startswith("VmFlags:")).split()[1:]
        raise AssertionError(f"no mapping holds {address:#x}")

    def anonymous(size: int) -> np.ndarray:  # touched anonymous memory numpy did not allocate (numpy advises its own)
        view = np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
        view[:] = 1
        return view

    host = anonymous(16 * HUGE)  # the host's memory, there before the engine
    before = anonymous_mappings()
    block = anonymous(16 * HUGE)  # 32 MiB, like pre-packed weights
    assert advise_huge_pages(since=before) >= 8 * HUGE
    assert int(block.sum()) == block.size  # contents unchanged by the advice
    middle = block.nbytes // 2  # (the kernel may have merged block and host into one mapping: ranges count)
    assert "hg" in vm_flags(block.ctypes.data + middle) and "hg" not in vm_flags(host.ctypes.data + middle)


# Architecture variants: each must either reproduce PyTorch at every position up to max_context or be refused.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 128}
ROPES = {"linear": {"rope_type": "linear", "factor": 4.0}, "dynamic": {"rope_type": "dynamic", "factor": 4.0},
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
         "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128}, "longrope": LONGROPE}


def _model(arch: str, **overrides):
    """A tiny random model whose config differs from tiny.py's by `overrides`; biases drawn
    large so a dropped one shows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False)
    cls, cfg_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[arch]
    model = cls(cfg_cls(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # output that depends on the context, as in tiny.py
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _variant(out: Path, arch: str, **overrides) -> Path:
    from tiny import make_tokenizer

    _model(arch, **overrides).save_pretrained(str(out))
    make_tokenizer(out, 384)
    return out


@pytest.mark.parametrize("rope", [None, *ROPES])
def test_rope_tables_equal_pytorch_up_to_the_context_limit(rope):
    """Golden-prompt parity sees ~60 positions; the tables must hold at every position export allows."""
    import torch

    from specrt.export.spec import DecoderSpec

    model = _model("llama", rope_scaling=ROPES.get(rope))
    spec = DecoderSpec.from_hf(model)
    n = spec.rope_max_context  # 512 (the model's positions), longrope 128
    spec.check_max_context(n)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, n, 16), torch.arange(n)[None])
    ours = spec.rope_tables(n)
    assert np.abs(cos[0, :, :8].numpy() - ours[0]).max() < 1e-4 and np.abs(sin[0, :, :8].numpy() - ours[1]).max() < 1e-4


@pytest.mark.parametrize("arch,overrides,max_context,match", [
    ("llama", dict(rope_scaling=LONGROPE), 256, r"'longrope' switches .* past 128 .*--max-context <= 128$"),
])
def test_export_refuses_lengths_where_pytorch_changes_behaviour(tmp_path, arch, overrides, max_context, match):
    """Longrope's long factors only act past a length: export once passed parity there and was wrong beyond it;
    now it names the largest --max-context that is exact. (Sliding windows are exported: tests/test_families.py.)"""
    from specrt.errors import SpecrtError
    from specrt.export.exporter import export_checkpoint
    from specrt.export.sources import resolve

    ckpt = _variant(tmp_path / "ckpt", arch, **overrides)
    with pytest.raises(SpecrtError, match=match):
        export_checkpoint(resolve(str(ckpt)), tmp_path / "exp", max_context, log=lambda m: None)


@pytest.mark.parametrize("arch,overrides,max_context", [
    ("llama", dict(rope_scaling=LONGROPE), 128),  # longrope within its original length: short factors only
    ("qwen2", dict(use_sliding_window=False, sliding_window=32, max_window_layers=1), 256),  # as Qwen2.5 ships
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2), 256),  # no layer slides
    ("qwen2", dict(use_sliding_window=True, sliding_window=256, max_window_layers=0), 256),  # window never binds
])
def test_limits_that_do_not_bind_are_accepted(arch, overrides, max_context):
    from specrt.export.spec import DecoderSpec

    DecoderSpec.from_hf(_model(arch, **overrides), max_context)


def test_unchecked_rope_type_is_refused():
    from specrt.export.spec import DecoderSpec, UnsupportedModelError

    model = _model("llama", rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match=r"llama: RoPE type 'proportional' \(supported: default"):
        DecoderSpec.from_hf(model)


def test_llama_attention_bias_includes_o_proj(tmp_path):
    """attention_bias=True biases o_proj as well as q/k/v; dropping it failed parity as 'variant not handled'."""
    from specrt.export.exporter import export_checkpoint
    from specrt.export.sources import resolve

    ckpt = _variant(tmp_path / "ckpt", "llama", attention_bias=True)
    facts = export_checkpoint(resolve(str(ckpt)), tmp_path / "exp", 128, log=lambda m: None)
    assert facts["spec"]["qkv_bias"] and facts["spec"]["o_bias"]
    assert facts["parity"]["max_abs_logit_diff"] < 1e-4 and facts["parity"]["greedy_agreement"] == 1.0


@pytest.mark.parametrize("scaling,rope_freqs,problem", [
    (None, False, None), ("none", False, None),
    ("linear", False, "llama.rope.scaling.type = linear"), (None, True, "a rope_freqs.weight tensor"),
])
def test_gguf_with_rope_scaling_is_refused(tmp_path, scaling, rope_freqs, problem):
    """transformers' GGUF loader ignores Llama/Qwen2 RoPE scaling: PyTorch and ONNX would agree, both wrong."""
    import re

    import gguf

    from specrt.errors import SpecrtError
    from specrt.export.sources import resolve

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if scaling is not None:
        w.add_string("llama.rope.scaling.type", scaling)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.ones(4, np.float32))  # Llama 3.1+ as llama.cpp converts it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if problem is None:
        assert resolve(str(path)).kind == "gguf"
        return
    with pytest.raises(SpecrtError, match=re.escape(problem) + ".*export from the model's Hugging Face directory"):
        resolve(str(path))
