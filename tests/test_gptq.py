"""GPTQ for the int4 engines: the algorithm against round-to-nearest, and its calibration plumbing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest


def _rtn(w: np.ndarray, block: int) -> np.ndarray:
    """Round to nearest on the same grid GPTQ uses (asymmetric 4-bit groups of `block` rows, zero in range)."""
    k = w.shape[0]
    out = np.empty_like(w)
    for i in range(0, k, block):
        g = w[i:i + block]
        lo, hi = np.minimum(g.min(0), 0), np.maximum(g.max(0), 0)
        s = np.where(hi > lo, (hi - lo) / 15, 1.0)
        z = np.round(-lo / s)
        out[i:i + block] = (np.clip(np.round(g / s) + z, 0, 15) - z) * s
    return out


def _export_of(engines):
    """The export folder the set's int4 engine was built from (its build folder holds the same file, hard-linked):
    other tests' exports may share the cache."""
    from specrt.manifest import load_manifest

    m = load_manifest(engines)
    ino = (m.root / m.engine("target", "int4").file).stat().st_ino
    return next(e for e in (engines.parent / ".cache").glob("export-*")
                if any(f.stat().st_ino == ino for f in e.glob("build-*/*")))


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    from specrt.build.gptq import gptq

    rng = np.random.default_rng(0)
    k, n, block = 192, 40, 64
    # correlated inputs with uneven channel scales, like a decoder's hidden states
    x = rng.standard_normal((4000, k)) @ rng.standard_normal((k, k)) * rng.uniform(0.2, 3.0, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q = gptq(w, x.T @ x, block)
    assert q.dtype == np.float32 and q.shape == w.shape

    def err(m):
        return float(np.sum((x @ (m.astype(np.float64) - w)) ** 2))

    rtn = err(_rtn(w.astype(np.float64), block))
    assert err(q) < 0.6 * rtn, (err(q), rtn)  # an algorithm that propagates no error equals RTN here
    for i in range(0, k, block):  # every group of every column stays on a 16-level grid
        assert max(len(np.unique(np.round(q[i:i + block, j], 6))) for j in range(n)) <= 16


def test_gptq_keeps_dead_inputs_at_zero_and_handles_a_partial_group():
    from specrt.build.gptq import gptq

    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, 80))
    x[:, 5] = 0.0  # an input channel that is never active
    w = rng.standard_normal((80, 8)).astype(np.float32)
    h = x.T @ x
    q = gptq(w, h, 64)  # 80 rows: one full group of 64 and a partial one of 16
    assert np.all(q[5] == 0) and np.isfinite(q).all()
    assert max(len(np.unique(np.round(q[64:, j], 6))) for j in range(8)) <= 16
    d, r = q.astype(np.float64) - w, _rtn(np.concatenate([w, np.zeros((48, 8), np.float32)]), 64)[:80] - w
    assert np.einsum("ij,ik,kj->", d, h, d) < np.einsum("ij,ik,kj->", r, h, r)
    # lazy batches are a reordering of the same updates: any batch size gives the same weights
    np.testing.assert_allclose(gptq(w, h, 16, lazy=16), gptq(w, h, 16, lazy=64), rtol=1e-5, atol=1e-6)


def test_quantize_puts_gptq_weights_in_their_blocks_and_the_rest_in_blocks_of_32(tiny_engines):
    from specrt.build.ort import fuse_attention, precision, quantize

    cache = _export_of(tiny_engines)
    model = fuse_attention(onnx.load(str(cache / "model.onnx")))
    k = next(i for i in model.graph.initializer if i.name == "lm_head.weight_t").dims[0]
    out = quantize(model, precision("int4"), {"lm_head.weight_t": np.eye(k)})
    blocks = {n.name: next(a.i for a in n.attribute if a.name == "block_size")
              for n in out.graph.node if n.op_type == "MatMulNBits"}
    assert blocks.pop("logits_Q4") == 64, blocks
    assert blocks and set(blocks.values()) == {32}


def test_hessians_are_the_gram_matrices_of_the_matmul_inputs(tiny_engines):
    from specrt.build.gptq import hessians
    from specrt.build.ort import fuse_attention
    from specrt.manifest import load_manifest

    m = load_manifest(tiny_engines)
    entry = m.engine("target", "int4")
    q = entry.raw["build"]["quantization"]
    assert q["method"] == "gptq" and q["block_size"] == 64 and q["calibration_sequences"] > 0, q
    assert q["gptq_weights"] == 4 * entry.raw["num_layers"] + 1  # qkv, o, gate_up, down per layer + lm_head
    graph = onnx.load(str(m.root / entry.file), load_external_data=False).graph
    blocks = {a.i for node in graph.node if node.op_type == "MatMulNBits"
              for a in node.attribute if a.name == "block_size"}
    assert blocks == {64}

    # the lm_head's input is the final hidden state at every position: its Gram matrix is checkable
    cache = _export_of(tiny_engines)
    model = fuse_attention(onnx.load(str(cache / "model.onnx"), load_external_data=False))
    seqs = [[1, 5, 9, 12, 7], [3, 3, 8]]
    grams, tokens = hessians(model, cache, seqs)
    assert tokens == 8
    from specrt.runtime.engine import EngineOptions, open_engine

    fp32 = m.engine("target", "fp32")
    eng = open_engine(m.root, fp32, EngineOptions(threads=1))
    eng.enable_hidden()
    hidden = []
    for s in seqs:
        eng.rewind(0)
        eng.forward(np.asarray(s, np.int64))
        hidden.append(eng.hidden.astype(np.float64))
    hid = np.concatenate(hidden)
    np.testing.assert_allclose(grams["lm_head.weight_t"], hid.T @ hid, rtol=1e-4, atol=1e-4)


def test_lm_head_is_calibrated_from_hidden_states_with_weights_left_on_disk(tiny_engines, tmp_path):
    """Real exports keep every weight in an external file and the calibration graph is loaded without it:
    finding the lm_head's unsliced input must read nothing but the Slice's axes."""
    from specrt.build.gptq import _unsliced, matmul_weights

    cache = _export_of(tiny_engines)
    model = onnx.load(str(cache / "model.onnx"))
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data",
                    size_threshold=64)  # norms and weights external, one-number constants inline (like real exports)
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    wanted, all_rows = _unsliced(model, matmul_weights(model))
    assert all_rows and wanted["hidden_states"] == ["lm_head.weight_t"]


def test_gptq_precision_without_calibration_is_an_error(tmp_path):
    from specrt.build.ort import build_ort_engine, precision

    with pytest.raises(ValueError, match="calibration"):
        build_ort_engine(tmp_path / "model.onnx", tmp_path / "out.onnx", precision("int4"))
    assert not list(tmp_path.iterdir())
