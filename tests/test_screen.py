"""The logit screen of fp32 engines (build/screen.py): exact greedy tokens through an 8-bit lm_head."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt.build.screen import add_screen, bounds
from specrt.export.graph import read_initializers
from specrt.runtime.backends.onnxruntime_cpu.session import screen_unusable


def _lm_head_model(rows: np.ndarray, tied: bool):
    """Just an lm_head: h [1, n, H] -> logits [1, n, V] (+ an embedding Gather of the same rows when tied)."""
    V, H = rows.shape
    nodes = [helper.make_node("MatMul", ["h", "lm_head.weight_t"], ["logits"], name="logits")]
    inits = [numpy_helper.from_array(np.ascontiguousarray(rows.T), "lm_head.weight_t")]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "n", V])]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "n", H])]
    if tied:
        nodes.append(helper.make_node("Gather", ["embed_tokens.weight", "ids"], ["embed"], name="embed"))
        inits.append(numpy_helper.from_array(rows.copy(), "embed_tokens.weight"))
        inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "n"]))
        outputs.append(helper.make_tensor_value_info("embed", TensorProto.FLOAT, [1, "n", H]))
    g = helper.make_graph(nodes, "lm_head", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _rows_with_near_ties(V=2048, H=128, seed=0):
    """Random rows, where every 8th row is a near copy of the row before it: their logits differ by ~1e-3,
    far below what the 8-bit lm_head can resolve, so only the fp32 rescoring can tell them apart; every
    64th is an exact copy."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0, 0.05, (V, H)).astype(np.float32)
    rows[8::8] = rows[7::8][: len(rows[8::8])] + rng.normal(0, 2e-4, rows[8::8].shape).astype(np.float32)
    # exact copies: a true tie, which the lowest id wins (ArgMax's rule)
    rows[16::64] = rows[15::64][: len(rows[16::64])]
    return rows


# V = 2040 is no multiple of 64: the candidate search then runs over blocks of 8 tokens
@pytest.mark.parametrize("tied,V", [(True, 2048), (False, 2048), (False, 2040)])
def test_screened_argmax_is_the_exact_argmax(tied, V):
    rows = _rows_with_near_ties(V)
    V, H = rows.shape
    model = _lm_head_model(rows, tied)
    facts = add_screen(model)
    assert facts["rows"] == ("embed_tokens.weight" if tied else "screen.rows")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    # hidden states aimed at the near-tied pairs (the hard case), plus plain random ones, with outliers
    pick = rng.integers(0, V // 8, 96) * 8 + 7
    h = np.concatenate([rows[pick] * 40 + rng.normal(0, 0.3, (96, H)), rng.normal(0, 1, (64, H))]).astype(np.float32)
    h[:, 3] *= 12.0  # an outlier channel, as real hidden states have (it widens its quantization block)
    feeds = {"h": h[None]}
    if tied:
        feeds["ids"] = np.zeros((1, len(h)), np.int64)
    approx, screened = sess.run(["logits", "greedy_tokens"], {**feeds, "approx_logits": np.array(True)})[:2]
    exact, plain = sess.run(["logits", "greedy_tokens"], {**feeds, "approx_logits": np.array(False)})[:2]
    truth = h @ rows.T
    # the bound holds for every row and token, and is not vacuous
    ratio = np.abs(approx[0] - truth) / bounds(h, read_weight_err(model), read_qnorm(model))
    assert ratio.max() <= 1.0 and ratio.max() > 0.01
    # the 8-bit logits alone get some of the near ties wrong; the screen gets every row right
    assert (approx[0].argmax(axis=1) != truth.argmax(axis=1)).sum() >= 5
    np.testing.assert_array_equal(screened[0], truth.argmax(axis=1))
    np.testing.assert_array_equal(plain[0], exact[0].argmax(axis=1))  # the fp32 branch: plain argmax
    np.testing.assert_allclose(exact[0], truth, atol=1e-4)


def _err_norm(model):
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "screen.err_norm"))


def read_weight_err(model):
    return _err_norm(model)[0]


def read_qnorm(model):
    return _err_norm(model)[1]


def test_hidden_size_not_in_blocks_keeps_the_plain_lm_head():
    model = _lm_head_model(np.ones((64, 48), np.float32), tied=False)
    assert add_screen(model) is None
    assert [n.op_type for n in model.graph.node] == ["MatMul"]


def test_screen_is_used_only_where_its_check_held(monkeypatch):
    ok = {"block_size": 32, "check": {"holds": True}}
    here = {"onnxruntime": ort.__version__}
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert screen_unusable(ok, here) is None
    assert "without" in screen_unusable(None, here)
    assert "did not hold" in screen_unusable({"check": {"holds": False}}, here)
    assert "rebuild" in screen_unusable(ok, {"onnxruntime": "0.0.1"})
    monkeypatch.setenv("SPECRT_LOGIT_SCREEN", "0")
    assert "SPECRT_LOGIT_SCREEN" in screen_unusable(ok, here)
    monkeypatch.delenv("SPECRT_LOGIT_SCREEN")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert "x86-64" in screen_unusable(ok, here)


def test_engine_set_screen_checked_and_exact(tiny_engines):
    """The tiny set's fp32 engine carries a screen whose bound held at build; greedy decoding through it
    gives the fp32 engine's own tokens, plain and speculative."""
    import json

    from specrt.runtime.generate import Generator
    from specrt.runtime.speculative import make_decoder

    entry = json.loads((tiny_engines / "manifest.json").read_text())["engines"]["target-fp32"]
    check = entry["screen"]["check"]
    assert check["holds"] and check["argmax_equal"] and check["screened_rows"] * 2 >= check["rows"]
    assert 0.0 < check["max_error_over_bound"] <= 1.0  # the 8-bit path really ran, and its bound held
    assert read_initializers(tiny_engines / entry["file"], "screen.err_norm")[0].shape == (2, entry["vocab_size"])
    gen = Generator.load(tiny_engines)
    assert gen.engine.screen, gen.engine.screen_note
    prompts = ["the quick brown fox", "a b c a b c a b", "hello"]
    for decode in (None, make_decoder("prompt-lookup", gen.manifest)):
        for prompt in prompts:
            gen.engine.screen = True
            on = gen.generate(prompt, max_new_tokens=40, decode=decode, chat=False).token_ids
            gen.engine.screen = False
            off = gen.generate(prompt, max_new_tokens=40, decode=decode, chat=False).token_ids
            assert on == off and len(on) > 0


def test_a_zero_lm_head_row_is_left_out_of_the_bound_check(tmp_path, monkeypatch):
    """transformers zeroes the pad row of the embedding; tied, it is an lm_head row whose bound is 0 and whose error
    is 0: the build check once read 0/0 = NaN there, and the set fell back to the full lm_head without saying why."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from specrt.pipeline import EngineSetRequest, make_engine_set
    from tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2", seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[0].zero_()
    assert model.config.tie_word_embeddings and not model.lm_head.weight[0].any()
    model.save_pretrained(str(ckpt))
    said = []
    out = make_engine_set(EngineSetRequest(str(ckpt), "zero-row", ("fp32",), 128, tmp_path / "sets"), log=said.append)
    check = json.loads((out / "manifest.json").read_text())["engines"]["target-fp32"]["screen"]["check"]
    assert check["holds"] and 0.0 < check["max_error_over_bound"] <= 1.0, check
    assert not [m for m in said if "logit screen" in m]
    # a check that does not hold falls back to the full lm_head, and says so in one line
    from specrt.pipeline import checks

    monkeypatch.setattr(checks, "_error_over_bound", lambda err, bound: 1.5)
    said.clear()
    out = make_engine_set(EngineSetRequest(str(ckpt), "fallback", ("fp32",), 128, tmp_path / "sets"), log=said.append)
    (line,) = [m for m in said if "logit screen" in m]
    assert "full fp32 lm_head" in line and "1.5 of the proven bound" in line and "\n" not in line
    entry = json.loads((out / "manifest.json").read_text())["engines"]["target-fp32"]
    assert entry["screen"]["check"]["holds"] is False
