"""Every family of export/families.py, as a tiny random checkpoint made here with transformers (whose modeling code is
the reference): the fused fp32 engine and the portable fp32 graph match PyTorch, are width-exact, decode every
proposer's greedy output equal to plain, stay exact past a sliding window; each family's fp16 portable graph compiles
with TensorRT for RTX; unsupported families and features are refused from config.json before any weight loads."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tiny import make_tokenizer

VOCAB, HIDDEN, LAYERS, CONTEXT, WINDOW = 512, 64, 4, 128, 8
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# model_type -> (config class, model class, what differs from COMMON): each family's features, windows of WINDOW
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3)),  # Llama 3.x
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(attention_bias=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=WINDOW, layer_types=MIXED, query_pre_attn_scalar=24, final_logit_softcapping=20.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    # Phi-4-mini's partial rotary (0.75); ONNX Runtime's fused rotary turns multiples of 16 dims (head_dim 64 here)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75, sliding_window=2 * WINDOW,
                                                  hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                                  head_dim=64)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 1, 0, 1])),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                            attention_multiplier=0.1, logits_scaling=2.5)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}
PROMPT = "def add(a, b):\n    return a + b\nThe quick brown fox"
STEPS = 24  # greedy tokens: prompt + generation run past every window


def make_family(out: Path, family: str, seed: int = 0) -> Path:
    """A tiny random checkpoint of `family` with a tokenizer: norms (q/k norms too) random around their identity,
    the lm_head sharpened so the output depends on the context (tests/tiny.py), the pad row zero as transformers
    leaves it."""
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # (1 + w) norms start at 0, the others at 1: move both off it
                p.add_(torch.randn(p.shape) * 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
        model.lm_head.weight.mul_(8.0)
        model.model.embed_tokens.weight[0].zero_()
    model.save_pretrained(str(out))
    make_tokenizer(out, VOCAB)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory):
    """family -> its checkpoint, PyTorch model, and the fp32 sets: fused (onnxruntime, the same model as its draft)
    and portable."""
    import torch
    from transformers import AutoModelForCausalLM

    from specrt.pipeline import EngineSetRequest, make_engine_set

    fam = request.param
    root = tmp_path_factory.mktemp(fam)
    ckpt = make_family(root / "ckpt", fam)
    heads = dict(medusa_heads=_medusa_file(root / "heads.npz", ckpt), eagle_head=_eagle_file(root / "eagle.npz", ckpt))
    quiet = dict(log=lambda m: None)
    fused = make_engine_set(EngineSetRequest(str(ckpt), "fused", ("fp32",), CONTEXT, root / "sets",
                                             draft_source=str(ckpt), draft_precisions=("fp32",), **heads), **quiet)
    portable = make_engine_set(EngineSetRequest(str(ckpt), "portable", ("fp32",), CONTEXT, root / "sets",
                                                backend="onnxruntime-portable", **heads), **quiet)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return {"family": fam, "ckpt": ckpt, "model": model, "fused": fused, "portable": portable, "root": root}


def _medusa_file(path: Path, ckpt: Path) -> Path:
    """Medusa heads as `specrt train-medusa` writes them, random (their drafts are poor; exactness must hold)."""
    import json

    from transformers import AutoConfig

    from specrt.export.medusa import HEADS_FORMAT
    from gpu_fakes import random_heads

    heads = random_heads(AutoConfig.from_pretrained(str(ckpt)).hidden_size, VOCAB, 3)
    np.savez(path, **{n: heads[n] for n in ("w1", "b1", "w2", "b2", "vocab")},
             report=json.dumps({"format": HEADS_FORMAT, "rank_acc": [[0.5, 0.2, 0.1, 0.05]] * 3}))
    return path


def _eagle_file(path: Path, ckpt: Path) -> Path:
    """An EAGLE head as `specrt train-eagle` writes it, random, shaped by the family's config (HeadShape.of)."""
    import torch
    from transformers import AutoConfig

    from specrt.export.eagle import HeadShape, make_head, save_head

    shape = HeadShape.of(AutoConfig.from_pretrained(str(ckpt)))
    torch.manual_seed(0)
    save_head(path, make_head(shape), np.arange(VOCAB), {"shape": shape.__dict__})
    return path


def _engine(root: Path):
    from specrt.manifest import load_manifest
    from specrt.runtime.engine import open_engine

    m = load_manifest(root)
    return open_engine(m.root, m.engine("target", "fp32"))


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids, np.int64)[None])).logits[0].numpy()


def _greedy(eng, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding one token per pass after a prefill -> (tokens, logit rows [len(prompt) + steps - 1, V])."""
    eng.rewind(0)
    rows = [eng.forward(prompt, num_logits=len(prompt)).copy()]
    eng.commit(len(prompt))
    tokens = [int(rows[0][-1].argmax())]
    for _ in range(steps - 1):
        rows.append(eng.forward(np.array(tokens[-1:])).copy())
        eng.commit(1)
        tokens.append(int(rows[-1][-1].argmax()))
    return np.array(tokens), np.concatenate(rows)


@pytest.mark.parametrize("backend", ["fused", "portable"])
def test_logits_match_pytorch_past_every_window(built, backend):
    """Prefill and one-token steps past the sliding window (WINDOW << prompt + STEPS) equal PyTorch's logits."""
    eng = _engine(built[backend])
    prompt = np.random.default_rng(0).integers(3, VOCAB, 20)
    tokens, rows = _greedy(eng, prompt, STEPS)
    full = np.concatenate([prompt, tokens[:-1]])
    assert len(full) > 2 * WINDOW
    ref = _torch_logits(built["model"], full)
    assert np.abs(rows - ref).max() < 1e-4, built["family"]


@pytest.mark.parametrize("backend", ["fused", "portable"])
def test_a_k_token_pass_equals_k_one_token_passes(built, backend):
    eng = _engine(built[backend])
    ids = np.random.default_rng(1).integers(3, VOCAB, 30)
    eng.rewind(0)
    eng.forward(ids[:14], num_logits=1)
    eng.commit(14)
    wide = eng.forward(ids[14:], num_logits=16).copy()
    narrow = []
    for t in ids[14:]:
        narrow.append(eng.forward(np.array([t])).copy())
        eng.commit(1)
    assert np.abs(wide - np.concatenate(narrow)).max() < 1e-4


@pytest.mark.parametrize("backend, modes", [("fused", ("prompt-lookup", "suffix", "draft", "medusa", "eagle")),
                                            ("portable", ("prompt-lookup", "suffix", "medusa", "eagle"))])
def test_every_proposer_decodes_what_plain_decoding_does(built, backend, modes):
    from specrt.runtime.session import load

    plain = load(built[backend], "fp32", "off").generate(PROMPT + PROMPT, max_new_tokens=STEPS)
    for mode in modes:
        spec = load(built[backend], "fp32", mode).generate(PROMPT + PROMPT, max_new_tokens=STEPS)
        assert list(spec.token_ids) == list(plain.token_ids), (built["family"], mode)


def test_the_set_records_the_family_and_its_per_layer_facts(built):
    import json

    from specrt.manifest import load_manifest

    m = load_manifest(built["fused"])
    assert m.engine("target", "fp32").architecture == built["family"]
    (export,) = (built["root"] / "sets" / ".cache").glob("export-*")
    spec = json.loads((export / "export.json").read_text())["spec"]
    assert len(spec["layer_window"]) == LAYERS and len(spec["layer_rope"]) == LAYERS
    windows = {"qwen3": [0, 0, WINDOW, WINDOW], "mistral": [WINDOW] * 4, "gemma3_text": [WINDOW, 0, WINDOW, WINDOW],
               "phi3": [2 * WINDOW] * 4}.get(built["family"], [0] * 4)
    assert spec["layer_window"] == windows
    if built["family"] == "smollm3":
        assert spec["layer_rope"] == [0, 0, -1, 0]
    if built["family"] == "gemma3_text":  # local and global RoPE bases, full layers scaled
        assert len({spec["layer_rope"][i] for i in range(LAYERS)}) == 2
    if built["family"] == "phi3":
        assert spec["rotary_dim"] == 48


@pytest.mark.slow
def test_the_fp16_portable_graph_compiles_with_tensorrt_for_rtx(built, tmp_path):
    """One small compile per family, as tests/test_tensorrt_rtx.py runs them (sm89, ahead of time on the CPU)."""
    import json

    try:
        import tensorrt_rtx_bindings  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("TensorRT for RTX is not installed (`pip install 'specrt[tensorrt-rtx]'`)")
    from specrt.build.tensorrt import TENSORRT_RTX, build_engine
    from specrt.export.portable import write_portable

    (export,) = (built["root"] / "sets" / ".cache").glob("export-*")
    facts = json.loads((export / "export.json").read_text())
    graph = tmp_path / "target-fp16.onnx"
    write_portable(export / "model.onnx", facts["spec"], CONTEXT, "fp16", graph)
    out = build_engine(graph, tmp_path / "target.engine", max_prompt=32, max_width=8, max_capacity=CONTEXT + 8,
                       compiler=TENSORRT_RTX, gpu_archs=("sm89",))
    assert out["engine_bytes"] > 0


def test_ministral_exports_with_its_per_layer_windows(tmp_path):
    """Ministral (the Mistral row's per-layer form): export's own parity check against PyTorch runs the golden prompt
    and 32 greedy tokens, far past the window, through the reference attention function."""
    from specrt.export.exporter import export_checkpoint
    from specrt.export.sources import resolve

    FAMILIES["ministral"] = ("MinistralConfig", "MinistralForCausalLM", dict(sliding_window=WINDOW, layer_types=MIXED))
    try:
        ckpt = make_family(tmp_path / "ckpt", "ministral")
    finally:
        del FAMILIES["ministral"]
    facts = export_checkpoint(resolve(str(ckpt)), tmp_path / "exp", CONTEXT, log=lambda m: None)
    assert list(facts["spec"]["layer_window"]) == [WINDOW, 0, WINDOW, WINDOW]
    assert facts["parity"]["max_abs_logit_diff"] < 1e-4 and facts["parity"]["greedy_agreement"] == 1.0


# --- refusals, from config.json before any weight loads ------------------------------------------------------------

@pytest.mark.parametrize("family, change, says", [
    ("llama", {"model_type": "gpt_neox"}, "cannot read the config|architecture 'gpt_neox' is not supported"),
    ("llama", {"mlp_bias": True}, "llama: mlp_bias"),
    ("llama", {"hidden_act": "relu"}, "llama: activation 'relu'"),
    ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "llama: RoPE type 'proportional'"),
    ("gemma3_text", {"hidden_activation": "gelu"}, "gemma3_text: activation 'gelu' \\(hidden_activation"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "gemma3_text: attn_logit_softcapping"),
    ("qwen3", {"layer_types": ["chunked_attention"] * LAYERS}, "qwen3: layer type 'chunked_attention'"),
])
def test_unsupported_families_and_features_are_refused_before_any_weight_loads(tmp_path, monkeypatch, family,
                                                                                  change, says):
    import json
    import re

    from specrt.errors import SpecrtError
    from specrt.export import exporter, sources
    from specrt.pipeline import EngineSetRequest, make_engine_set

    ckpt = make_family(tmp_path / "ckpt", family)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **change}))
    monkeypatch.setattr(exporter, "load", lambda src: pytest.fail("weights loaded before the family check"))
    monkeypatch.setattr(sources, "fingerprint", lambda src: pytest.fail("weights hashed before the family check"))
    with pytest.raises(SpecrtError) as e:
        make_engine_set(EngineSetRequest(str(ckpt), "x", ("fp32",), CONTEXT, tmp_path / "sets"), log=lambda m: None)
    msg = str(e.value)
    assert "\n" not in msg and re.search(says, msg), msg
    assert not (tmp_path / "sets" / "x").exists()
    assert not list((tmp_path / "sets" / ".cache").glob("export-*/model.onnx"))


def test_the_cli_refuses_an_unsupported_feature_in_one_line_with_exit_2(tmp_path):
    import json
    import subprocess
    import sys

    ckpt = make_family(tmp_path / "ckpt", "olmo2")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "engines", "--source", str(ckpt), "--out",
                        str(tmp_path / "eng")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [r.stderr.strip().splitlines()[-1]] and "olmo2: activation 'gelu'" in errors[0], r.stderr
