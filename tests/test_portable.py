"""The portable graph (export/portable.py) and its CPU backend (runtime/backends/onnxruntime_portable/): the same
tokens as today's graph, width-exact, trees kept apart, the padded static-shape protocol equal to unpadded passes,
standard ONNX ops inside onnx-tensorrt's operator table, and `specrt engines --backend` refusing what it cannot do."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from specrt.manifest import load_manifest
from specrt.runtime.engine import open_engine
from specrt.runtime.static_shapes import Buckets, PassInputs

TABLE = json.loads((Path(__file__).parent / "data" / "onnx_tensorrt_operators.json").read_text())
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n", "Hello, how are you today?"]


def _engine(root: Path, precision: str = "fp32", buckets: Buckets | None = None):
    m = load_manifest(root)
    e = open_engine(m.root, m.engine("target", precision))
    if buckets is not None:  # the same engine under another bucketing
        from specrt.runtime.backends.onnxruntime_portable.batch import PortableBatchEngine
        from specrt.runtime.batch import solo

        entry = m.engine("target", precision)
        e = solo(PortableBatchEngine(m.root / entry.file, slots=1, num_layers=entry.num_layers,
                                     num_kv_heads=entry.num_kv_heads, head_dim=entry.head_dim,
                                     vocab_size=entry.vocab_size, hidden_size=entry.hidden_size,
                                     max_context=entry.max_context, precision=precision, buckets=buckets,
                                     huge_pages=True))
    return e


@pytest.mark.parametrize("mode", ["off", "prompt-lookup"])
def test_portable_fp32_gives_todays_fp32_tokens(tiny_engines, portable_engines, mode):
    from specrt.runtime.session import load

    today, portable = load(tiny_engines, "fp32", mode), load(portable_engines, "fp32", mode)
    assert "onnxruntime-portable" in portable.engine.description
    for prompt in PROMPTS:
        a, b = today.generate(prompt, max_new_tokens=40), portable.generate(prompt, max_new_tokens=40)
        assert list(a.token_ids) == list(b.token_ids)


def test_portable_fp16_speculation_equals_its_own_plain_decoding(portable_engines):
    from specrt.runtime.session import load

    plain, spec = load(portable_engines, "fp16", "off"), load(portable_engines, "fp16", "prompt-lookup")
    for prompt in PROMPTS:
        assert list(plain.generate(prompt, max_new_tokens=40).token_ids) == \
            list(spec.generate(prompt, max_new_tokens=40).token_ids)


def test_the_manifest_records_parity_and_memory(portable_engines):
    m = load_manifest(portable_engines)
    fp32, fp16 = m.engine("target", "fp32"), m.engine("target", "fp16")
    assert fp32.backend == "onnxruntime-portable" and fp32.width_exact
    assert fp32.parity["max_abs_logit_diff_vs_torch"] < 1e-4
    assert fp16.memory["kv_bytes_per_position"] * 2 == fp32.memory["kv_bytes_per_position"] == \
        fp32.num_layers * 2 * fp32.num_kv_heads * fp32.head_dim * 4
    assert fp16.memory["weights_bytes"] < 0.6 * fp32.memory["weights_bytes"]
    assert fp16.quality["top1"] >= 0.9 and 0 < fp16.quality["kl"] < 0.01 and fp32.quality is None  # fp16 rounds


def test_a_k_token_pass_equals_k_one_token_passes(portable_engines):
    e = _engine(portable_engines)
    prompt = np.arange(20, 50)
    e.forward(prompt)
    e.commit(len(prompt))
    draft = np.array([5, 9, 11, 200, 3, 7, 42])
    wide = e.forward(draft, num_logits=len(draft)).copy()
    e.rewind(len(prompt))
    narrow = []
    for t in draft:
        narrow.append(e.forward(np.array([t]))[0].copy())
        e.commit(1)
    assert np.abs(wide - np.array(narrow)).max() < 1e-4


def test_a_tree_pass_equals_branch_by_branch_decoding(portable_engines):
    """Two branches after a shared root; each branch's logits equal a chain pass over that branch, and
    committing one branch's path leaves the cache a chain pass over it would."""
    e = _engine(portable_engines)
    prompt = np.arange(30, 60)
    e.forward(prompt)
    e.commit(len(prompt))
    L = len(prompt)
    tokens = np.array([7, 8, 9, 10, 11])       # 7 -> (8 -> 9) and 7 -> (10 -> 11)
    parents = [-1, 0, 1, 0, 3]
    positions = L + np.array([0, 1, 2, 1, 2])
    mask = np.full((5, 5), -np.inf, np.float32)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = 0.0
            j = parents[j]
    tree = e.forward(tokens, positions, mask, num_logits=5).copy()
    for branch in ([0, 1, 2], [0, 3, 4]):
        e.rewind(L)
        chain = e.forward(tokens[branch], num_logits=3)
        assert np.abs(chain - tree[branch]).max() < 1e-4
    e.rewind(L)
    e.forward(tokens, positions, mask, num_logits=5)
    e.commit(3, np.array([0, 3, 4]))
    after_tree = e.forward(np.array([99]))[0].copy()
    e.rewind(L)
    e.forward(tokens[[0, 3, 4]], num_logits=3)
    e.commit(3)
    assert np.abs(e.forward(np.array([99]))[0] - after_tree).max() < 1e-4


def test_padded_passes_equal_unpadded_ones(portable_engines):
    """The static-shape protocol (widths 1, 2, 4, 8, ..., capacities every 256) against one width per pass size
    and a single large capacity: the same logits, pass for pass, as the context grows past a capacity bucket."""
    padded = _engine(portable_engines, buckets=Buckets((1, 4, 8, 64), (96, 192, 320)))
    exact = _engine(portable_engines, buckets=Buckets(tuple(range(1, 65)), (256 + 64,)))
    rng = np.random.default_rng(0)
    for e in (padded, exact):
        e.reserve(1)
    assert padded.capacity == 96
    seq = rng.integers(0, 300, 240)
    pos, worst = 0, 0.0
    for n in (3, 1, 5, 2, 7, 6, 30, 3, 64, 5, 9, 1):
        a = padded.forward(seq[pos:pos + n], num_logits=min(n, 4)).copy()
        b = exact.forward(seq[pos:pos + n], num_logits=min(n, 4)).copy()
        assert padded.argmax(seq[pos:pos + n], num_logits=1)[0] == b[-1].argmax()
        worst = max(worst, float(np.abs(a - b).max()))
        for e in (padded, exact):
            e.commit(n - 1)  # the last token is "rejected": its slot is garbage the next pass overwrites
        pos += n - 1
    assert padded.capacity == 192  # the padded engine moved to a larger layout on the way, keeping the cache
    assert worst < 1e-4


def test_the_mask_of_a_padded_pass():
    b = Buckets((1, 4), (16, 24))
    p = PassInputs(b).plan(length=5, tokens=np.array([1, 2]), positions=None, tree_mask=None, num_logits=2,
                           capacity=16)
    assert p.width == 4 and p.tokens.tolist() == [1, 2, 0, 0] and p.positions.tolist() == [5, 6, 6, 6]
    visible = p.mask == 0
    assert visible[0].nonzero()[0].tolist() == [0, 1, 2, 3, 4, 5]          # the cache, then itself
    assert visible[1].nonzero()[0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert visible[2].nonzero()[0].tolist() == [7] and visible[3].nonzero()[0].tolist() == [8]  # pads: own slot
    assert p.logits_rows.tolist() == [0, 1] and p.write_index == 5
    assert b.width(3) == 4 and b.width(9) == 9 and b.capacity(17) == 24
    with pytest.raises(ValueError):
        b.capacity(25)


def test_capacity_buckets_cover_max_context_plus_the_widest_pad():
    cpu, gpu = Buckets.for_engine(4096, 64), Buckets.for_engine(4096, 64, geometric=True, pad_logits=True)
    assert cpu.widths == (1, 2, 4, 8, 16, 32, 64) and cpu.capacities[-1] == gpu.capacities[-1] == 4096 + 64
    assert gpu.capacities == (256, 512, 1024, 2048, 4096, 4160) and len(cpu.capacities) == 17


# --- onnx-tensorrt's operator table ------------------------------------------------------------------------------

_ELEM = {onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.BFLOAT16: "BF16",
         onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.BOOL: "BOOL",
         onnx.TensorProto.INT8: "INT8", onnx.TensorProto.UINT8: "UINT8", onnx.TensorProto.FLOAT8E4M3FN: "FP8",
         onnx.TensorProto.INT4: "INT4"}


def tensorrt_violations(model: onnx.ModelProto) -> list[str]:
    """Where a graph leaves the pinned operator table: a domain other than ONNX's, an opset out of range, an op
    not supported, a data type not listed, or a restriction of the table broken (those our graphs could meet)."""
    out = []
    opsets = {o.domain: o.version for o in model.opset_import}
    if not TABLE["opset"]["min"] <= opsets.get("", 0) <= TABLE["opset"]["max"]:
        out.append(f"opset {opsets.get('')}")
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type for v in (*inferred.graph.value_info, *inferred.graph.input,
                                                   *inferred.graph.output)}
    types |= {t.name: onnx.TypeProto.Tensor(elem_type=t.data_type, shape=onnx.TensorShapeProto(
        dim=[onnx.TensorShapeProto.Dimension(dim_value=d) for d in t.dims])) for t in model.graph.initializer}
    consts = {t.name: t for t in model.graph.initializer}
    rank = lambda name: len(types[name].shape.dim)  # noqa: E731
    for node in model.graph.node:
        where = f"{node.op_type} {node.name}"
        if node.domain not in ("", "ai.onnx"):
            out.append(f"{where}: domain {node.domain}")
            continue
        spec = TABLE["operators"].get(node.op_type)
        if spec is None:
            out.append(f"{where}: not in the table")
            continue
        elem = _ELEM.get(types[node.input[0]].elem_type, "?") if node.input and node.input[0] in types else None
        if elem is not None and elem not in spec["types"]:
            out.append(f"{where}: type {elem}")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Attention":
            if len(node.input) > 4 or len(node.output) > 1 or {"softcap", "qk_matmul_output_mode"} & set(attrs):
                out.append(f"{where}: past/present inputs or outputs, softcap or qk_matmul_output_mode")
            if any(rank(i) != 4 for i in node.input[:4]):
                out.append(f"{where}: Q, K, V and the mask must be 4-D")
        if node.op_type == "TensorScatter" and (attrs.get("axis", -2) != -2 or rank(node.input[0]) != 4
                                                or rank(node.input[1]) != 4):
            out.append(f"{where}: 4-D past and update, axis -2")
        if node.op_type in ("Squeeze", "Unsqueeze", "Slice", "ReduceMean", "ReduceMax", "ReduceSum") and \
                len(node.input) > 1 and any(i and i not in consts for i in node.input[1:]):
            out.append(f"{where}: axes/starts must be initializers")
        if node.op_type == "TopK" and (attrs.get("sorted", 1) != 1 or
                                       int(onnx.numpy_helper.to_array(consts[node.input[1]]).max()) >= 3840):
            out.append(f"{where}: sorted, K < 3840")
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2] and \
                onnx.numpy_helper.to_array(consts[node.input[2]]).astype(np.float32).any():
            out.append(f"{where}: the zero point must be zero")
        if node.op_type == "RotaryEmbedding" and types[node.input[3]].elem_type != onnx.TensorProto.INT64:
            out.append(f"{where}: position_ids must be INT64")
    return out


def test_the_portable_graphs_stay_inside_onnx_tensorrts_operator_table(portable_engines):
    m = load_manifest(portable_engines)
    for entry in m.engines.values():
        model = onnx.load(str(m.root / entry.file), load_external_data=False)
        assert tensorrt_violations(model) == [], entry.name
    assert TABLE["tensorrt"] == "10.15" and "TensorScatter" in TABLE["operators"]


def test_the_table_check_sees_todays_contrib_graph(tiny_engines):
    m = load_manifest(tiny_engines)
    model = onnx.load(str(m.root / m.engine("target", "fp32").file), load_external_data=False)
    found = tensorrt_violations(model)
    assert any("GroupQueryAttention" in v and "domain com.microsoft" in v for v in found)


def test_heads_of_a_medusa_set_check_too(tmp_path):
    from specrt.export.medusa import export_heads_onnx

    rng = np.random.default_rng(0)
    H, V, K = 16, 50, 2
    heads = {"w1": rng.standard_normal((K, H, H)), "b1": np.zeros((K, H)), "w2": rng.standard_normal((K, H, H)),
             "b2": np.zeros((K, H)), "vocab": np.arange(V)}
    export_heads_onnx(heads, rng.standard_normal((V, H)), tmp_path / "m.onnx", 4, 2)
    assert tensorrt_violations(onnx.load(str(tmp_path / "m.onnx"))) == []


# --- what `specrt engines --backend` refuses ------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--backend", "tensorrt"], "TensorRT is not installed"),
    (["--backend", "onnxruntime-cuda"], "onnxruntime-gpu"),
    (["--backend", "bogus"], "--backend 'bogus'"),
    (["--backend", "onnxruntime-portable", "--precisions", "int4"], "not int4"),
    (["--backend", "onnxruntime-portable", "--precisions", "fp32,fp8", "--calibration-texts", "0"],
     "--calibration-texts 0"),
    (["--backend", "onnxruntime-portable", "--precisions", "int4-awq", "--quality-floor", "1.5"],
     "--quality-floor 1.5"),
    (["--backend", "onnxruntime-portable", "--precisions", "fp32,fp8", "--float-layers", "-1"], "--float-layers -1"),
    (["--backend", "onnxruntime-portable", "--precisions", "fp32,int8", "--float-gemms", "up"], "GEMM kind 'up'"),
    (["--backend", "onnxruntime-portable", "--precisions", "fp32,int8", "--outlier-channels", "-1"],
     "--outlier-channels -1"),
    (["--precisions", "fp32", "--outlier-channels", "8"], "--outlier-channels applies to fp8 and int8 targets"),
    (["--backend", "onnxruntime-portable", "--precisions", "fp32,int4-awq", "--outlier-channels", "8"],
     "--outlier-channels applies to fp8 and int8 targets"),
])
def test_engines_refuses_a_backend_it_cannot_build_in_one_line(tiny_dir, tmp_path, args, says):
    from typer.testing import CliRunner

    from specrt.cli import app

    r = CliRunner().invoke(app, ["engines", "--source", str(tiny_dir), "--out", str(tmp_path), *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], r.output
    assert not any(tmp_path.iterdir()) or [p.name for p in tmp_path.iterdir()] == [".cache"]


def test_polygraphy_compares_runners_on_protocol_passes(portable_engines, tmp_path):
    from polygraphy.json import load_json, save_json

    from specrt.pipeline.parity import compare, protocol_feeds

    m = load_manifest(portable_engines)
    entry = m.engine("target", "fp32")
    feeds = protocol_feeds(m.root / entry.file, entry, np.arange(3, 23))
    assert feeds[0]["input_ids"].shape == (1, 20) and feeds[1]["input_ids"].shape == (1, 4)
    assert feeds[1]["write_indices"].tolist() == [20] and np.abs(feeds[1]["past_key_values.0.key"]).sum() > 0
    save_json(feeds, str(tmp_path / "passes.json"))  # what `specrt parity --save-inputs` writes for polygraphy run
    assert len(load_json(str(tmp_path / "passes.json"))) == 2
    res = compare(m.root / entry.file, feeds)
    assert res["passed"] and res["max_abs_logit_diff"]["onnxrt-cpu-basic"] < 1e-4


def test_growing_near_the_largest_layout_and_a_wide_prefill_with_padded_logits(portable_engines):
    e = _engine(portable_engines, buckets=Buckets((1, 4, 8, 64), (96, 192, 320), pad_logits=True))
    e.forward(np.arange(100) % 300, num_logits=3)  # wider than any captured width: its logits are not padded
    e.commit(100)
    assert e.capacity == 192
    e.forward(np.arange(50) % 300)  # padded to 64: 164 slots
    e.commit(50)
    assert e.capacity == 192
    e.forward(np.arange(64) % 300)  # 150 + 64 > 192, and twice 192 is past the largest layout
    e.commit(64)
    assert e.capacity == 320 and e.length == 214
    assert e.argmax(np.array([1, 2, 3]), num_logits=3).shape == (3,)


# --- FP8 / INT8 Q/DQ engines ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized_engines(tiny_dir, tiny_engines, tmp_path_factory) -> Path:
    """fp32/fp8/int8/int4-awq targets with fp32, fp8 and int4-awq drafts (a noisy copy of the target)."""
    from tiny import make_checkpoint

    from specrt.pipeline import EngineSetRequest, make_engine_set

    draft = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-noisy", "llama", seed=0, noise=0.3)
    return make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-qdq", ("fp32", "fp8", "int8", "int4-awq"), 512,
                                            tiny_engines.parent, str(draft), ("fp32", "fp8", "int4-awq"),
                                            backend="onnxruntime-portable", calibration_texts=8, quality_floor=0.5),
                           log=lambda m: None)


def test_drafts_record_their_acceptance_for_the_fp32_target(quantized_engines):
    m = load_manifest(quantized_engines)
    for p in ("fp32", "fp8", "int4-awq"):
        d = m.engine("draft", p).quality["drafting"]
        assert d["against"] == "target-fp32" and 1.0 <= d["tau"] <= 1 + d["draft_tokens"]
        assert len(d["acceptance_by_position"]) == d["draft_tokens"] and 0 < d["acceptance_by_position"][0] <= 1
        h = d["humaneval"]  # the HumanEval problems that fit the 512-token context
        assert h["prompts"] >= 1 and 1.0 <= h["tau"] <= 1 + d["draft_tokens"] and "HumanEval" in h["text"]
    assert m.engine("draft", "fp8").quality["top1"] > 0.5


def test_qdq_engines_record_their_quality_and_stay_in_the_operator_table(quantized_engines):
    from collections import Counter

    m = load_manifest(quantized_engines)
    for p, qtype in (("fp8", onnx.TensorProto.FLOAT8E4M3FN), ("int8", onnx.TensorProto.INT8),
                     ("int4-awq", onnx.TensorProto.INT4)):
        e = m.engine("target", p)
        assert 0.5 <= e.quality["top1"] <= 1 and e.quality["kl"] >= 0 and e.quality["positions"] > 100
        assert e.session_config == {"session.disable_quant_qdq": "1"} and e.build["gemms_quantized"] > 0
        g = e.quality["greedy_bench"]
        assert g["prompts"] >= 1 and len(g["first_divergence"]) == g["prompts"] and 0 <= g["identical"] <= g["prompts"]
        model = onnx.load(str(m.root / e.file), load_external_data=False)
        ops = Counter(n.op_type for n in model.graph.node)
        if p == "int4-awq":  # weight-only: a blocked DQ per GEMM weight, the activations float
            assert ops["QuantizeLinear"] == 0 and ops["DequantizeLinear"] == e.build["gemms_quantized"]
            blocked = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
            assert all(onnx.helper.get_attribute_value(a) in e.build["awq"]["block_sizes"]
                       for n in blocked for a in n.attribute if a.name == "block_size")
            assert ops["Mul"] > 0 and e.build["awq"]["mse_vs_rtn_median"] <= 1.0  # AWQ never loses to rounding
        else:
            assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > ops["QuantizeLinear"]
        weights = {t.data_type for t in model.graph.initializer if t.name.endswith(".q")}
        assert weights == {qtype}
        assert tensorrt_violations(model) == [], p
        assert e.build["lm_head_kept"] and (e.build["smoothquant_alpha"] is not None) == (p == "int8")


def test_a_qdq_engine_decodes_and_does_not_call_its_speculation_exact(quantized_engines):
    from specrt.runtime.session import load

    for p in ("fp8", "int8", "int4-awq"):
        assert not load_manifest(quantized_engines).engine("target", p).width_exact
        plain, spec = load(quantized_engines, p, "off"), load(quantized_engines, p, "prompt-lookup")
        a, b = plain.generate(PROMPTS[1], max_new_tokens=24), spec.generate(PROMPTS[1], max_new_tokens=24)
        assert len(a.token_ids) == 24 or a.stats.finish_reason == "stop"
        assert a.stats.exact and b.stats.exact == (not any(b.stats.drafted_by_position))  # exact: nothing drafted


def test_a_build_below_the_quality_floor_fails_in_one_line(tiny_dir, tmp_path):
    from typer.testing import CliRunner

    from specrt.cli import app

    r = CliRunner().invoke(app, ["engines", "--source", str(tiny_dir), "--out", str(tmp_path), "--backend",
                                 "onnxruntime-portable", "--precisions", "fp32,int8", "--calibration-texts", "4",
                                 "--quality-floor", "0.9999", "--max-context", "256"])
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--quality-floor 1.00" in errors[0] and "held-out" in errors[0], r.output
    assert [p.name for p in tmp_path.iterdir()] == [".cache"]


def test_quant_report_tables_every_precision(quantized_engines, tmp_path):
    from typer.testing import CliRunner

    from specrt.cli import app

    r = CliRunner().invoke(app, ["quant-report", str(quantized_engines), "--out", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    report = (tmp_path / "q" / "report.md").read_text()
    for name in ("target-fp32", "target-fp8", "target-int8", "target-int4-awq", "draft-fp32", "draft-fp8",
                 "draft-int4-awq"):
        assert f"| {name} | onnxruntime-portable |" in report
    assert (tmp_path / "q" / "quality.png").stat().st_size > 1000



@pytest.mark.parametrize("draft", ["draft-fp8", "draft-int4-awq"])
def test_a_quantized_draft_keeps_the_fp32_targets_greedy_output(quantized_engines, draft):
    from dataclasses import replace

    from specrt.runtime.session import load
    from specrt.runtime.speculative import SpeculativeConfig

    m = load_manifest(quantized_engines)
    only = replace(m, engines={k: e for k, e in m.engines.items() if k in ("target-fp32", draft)})  # that draft
    plain = load(only, "fp32", "off")
    spec = load(only, "fp32", "draft", config=SpeculativeConfig(draft_tokens=4))
    for prompt in PROMPTS[:3]:
        a, b = plain.generate(prompt, max_new_tokens=40), spec.generate(prompt, max_new_tokens=40)
        assert b.token_ids == a.token_ids and b.stats.exact
        assert sum(b.stats.drafted_by_position) > 0  # it drafted


def test_a_draft_model_batches_beside_its_target_on_the_portable_backend(quantized_engines):
    """--parallel with --speculate draft on a portable set: target and draft each run as one batch engine, and
    every stream's greedy output is the target's plain output."""
    from dataclasses import replace

    from test_batch import GREEDY, gathering, run_threads

    from specrt.runtime.session import load
    from specrt.runtime.speculative import SpeculativeConfig

    m = load_manifest(quantized_engines)
    only = replace(m, engines={k: e for k, e in m.engines.items() if k in ("target-fp32", "draft-fp32")})
    plain = load(only, "fp32", "off")
    jobs = [(PROMPTS[0], 40, 0.0), (PROMPTS[1], 30, 0.0), (PROMPTS[2], 36, 0.005)]
    want = [plain.generate(p, max_new_tokens=n, sampling=GREEDY, ignore_eos=True).token_ids for p, n, _ in jobs]
    batched = gathering(load(only, "fp32", "draft", config=SpeculativeConfig(draft_tokens=3), parallel=3), 3)
    assert run_threads(batched, jobs) == want
    draft = batched._batches["draft-fp32"]
    assert type(draft).__name__ == "PortableBatchEngine"
    assert any(B > 1 for B, _ in batched.scheduler.costs_of(draft).cells)  # the draft's rows went together too


@pytest.mark.slow
def test_the_fp8_sensitivity_scan_keeps_each_group_in_float(portable_engines, capsys):
    import json

    from experiments.qdq_sensitivity import main

    cache = next(p for p in (portable_engines.parent / ".cache").glob("export-*ctx256*")
                 if list(p.glob("portable-v*/target-fp32.onnx")))
    main([str(cache), "--calibration-texts", "4"])
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert [r["variant"] for r in rows][:5] == ["none kept", "qkv kept", "o kept", "gateup kept", "down kept"]
    n = rows[0]["of"]
    assert rows[0]["gemms_kept"] == 1 and all(r["gemms_kept"] == 1 + (n - 1) // 4 for r in rows[1:5])
    assert all(0 < r["top1"] <= 1 and r["kl"] >= 0 for r in rows)
    by = {r["variant"].split(" (")[0]: r for r in rows}
    assert by["weights only"]["kl"] < rows[0]["kl"] and by["activations only"]["kl"] < rows[0]["kl"]  # half float


def test_dropping_weight_qdq_gives_back_the_float_weights_smoothed_or_not(portable_engines, tmp_path):
    """The scan's activations-only variant: each weight's DequantizeLinear replaced by the float weight (times the
    SmoothQuant migration where an activation has one). With the activations' Q/DQ dropped too, what is left is
    the fp32 graph (with its migration Mul): the same logits."""
    import json

    import onnxruntime as ort

    from experiments.qdq_sensitivity import drop_activation_qdq, drop_weight_qdq
    from specrt.build.quantize import gemm_weights, insert_qdq
    from specrt.interface import LOGITS
    from specrt.pipeline.parity import prefill_feed
    from specrt.pipeline.runtime_link import provisional_entry

    cache = next(p for p in (portable_engines.parent / ".cache").glob("export-*ctx256*")
                 if list(p.glob("portable-v*/target-fp32.onnx")))
    fp32 = next(cache.glob("portable-v*/target-fp32.onnx"))
    model = onnx.load(str(fp32), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    calib = {a: {"amax": np.full(inits[w].dims[0], 3.0, np.float32)} for a, w in gemm_weights(model).values()}
    facts = json.loads((cache / "export.json").read_text())
    feed = prefill_feed(provisional_entry(fp32, facts, backend="onnxruntime-portable"),
                        np.arange(5, 17), 256, num_logits=4)
    want = ort.InferenceSession(str(fp32)).run([LOGITS], feed)[0]
    for smooth in (None, 0.5):
        out = tmp_path / f"s{smooth}" / "q.onnx"
        out.parent.mkdir()
        insert_qdq(fp32, out, "fp8", calib, keep=(LOGITS,), smooth=smooth)
        drop_weight_qdq(out, fp32)
        ops = collections.Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
        assert ops["QuantizeLinear"] == ops["DequantizeLinear"] > 0  # only the activations' pairs are left
        drop_activation_qdq(out)
        got = ort.InferenceSession(str(out)).run([LOGITS], feed)[0]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def test_dropping_activation_qdq_leaves_the_weights_quantized(quantized_engines, tmp_path):
    import shutil

    from experiments.qdq_sensitivity import drop_activation_qdq

    m = load_manifest(quantized_engines)
    src = m.root / m.engine("target", "fp8").file
    out = tmp_path / src.name  # its weights' file keeps the name the graph records
    shutil.copy(src, out)
    shutil.copy(str(src) + ".data", str(out) + ".data")
    before = collections.Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
    drop_activation_qdq(out)
    after = collections.Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
    assert before["QuantizeLinear"] > 0 and after["QuantizeLinear"] == 0
    assert after["DequantizeLinear"] == before["DequantizeLinear"] - before["QuantizeLinear"] == after["MatMul"] - 1
    import onnxruntime as ort

    ort.InferenceSession(str(out))  # still a graph


def test_int4_blocks_and_awq_scales_on_outlier_channels():
    from specrt.build.quantize import awq_scale, int4_block, quantize_int4
    from specrt.errors import SpecrtError

    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 32)).astype(np.float32)
    q, s = quantize_int4(w, 128)
    assert s.shape == (2, 32) and q.min() >= -8 and q.max() <= 7
    assert np.abs(q * np.repeat(s, 128, axis=0) - w).max() <= s.max() / 2 + 1e-6  # round to nearest
    x = rng.standard_normal((512, 256)).astype(np.float32)
    x[:, :4] *= 50  # a few outlier input channels, as LLM activations have
    scale, facts = awq_scale(x, np.abs(x).mean(axis=0), w, 128)
    assert facts["alpha"] is not None and facts["mse"] < 0.8 * facts["mse_rtn"]  # AWQ protects the outliers
    assert scale[:4].min() > np.median(scale)
    assert (int4_block(576), int4_block(896)) == (64, 128)
    with pytest.raises(SpecrtError, match="int4 blocks"):
        int4_block(100)


@pytest.mark.slow
def test_float_layers_keep_the_first_and_last_layers_gemms_in_float(tmp_path):
    from tiny import make_checkpoint

    from specrt.errors import SpecrtError
    from specrt.pipeline import EngineSetRequest, make_engine_set

    src = make_checkpoint(tmp_path / "tiny-3", "llama", seed=1, layers=3)
    req = EngineSetRequest(str(src), "mixed", ("fp32", "fp8"), 256, tmp_path / "engines",
                           backend="onnxruntime-portable", calibration_texts=4, quality_floor=0.5, float_layers=1)
    m = load_manifest(make_engine_set(req, log=lambda m: None))
    b = m.engine("target", "fp8").build
    model = onnx.load(str(m.root / m.engine("target", "fp8").file), load_external_data=False)
    kept = set(b["gemms_kept"])
    assert b["float_layers"] == 1 and "logits" in kept and "layers.0.qkv" in kept and "layers.2.qkv" in kept
    assert "layers.1.qkv" not in kept and b["gemms_quantized"] == len(kept) // 2  # 4 GEMMs a layer: 1 of 3 left
    quantized = {n.name.removesuffix(".w_dq") for n in model.graph.node if n.name.endswith(".w_dq")}
    assert len(quantized) == b["gemms_quantized"] and "layers.1.qkv" in quantized and not quantized & kept
    with pytest.raises(SpecrtError, match="--float-layers 2 keeps all 3 layers"):
        make_engine_set(EngineSetRequest(**{**req.__dict__, "name": "all-float", "float_layers": 2}),
                        log=lambda m: None)
    # --float-gemms down: every layer's down_proj (its 4th GEMM) in float, the rest quantized
    from specrt.build.quantize import gemm_layers

    req = EngineSetRequest(**{**req.__dict__, "name": "down-float", "float_layers": 0, "float_gemms": ("down",)})
    m = load_manifest(make_engine_set(req, log=lambda m: None))
    b = m.engine("target", "fp8").build
    fp32 = onnx.load(str(m.root / m.engine("target", "fp32").file), load_external_data=False)
    layer = gemm_layers(fp32)
    downs = {g for j, g in enumerate(layer) if j % 4 == 3}
    assert b["float_gemms"] == ["down"] and set(b["gemms_kept"]) == downs | {"logits"} and len(downs) == 3
    assert b["gemms_quantized"] == 9
    from specrt.bench.quant_report import rows

    assert {r["engine"]: r["kept_float"] for r in rows(m)} == {"target-fp32": None,
                                                               "target-fp8": "down, lm_head (4 of 13)"}
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    for f in m.root.iterdir():  # every file of the set readable as the rest (onnx writes external data 0600)
        assert stat.S_IMODE(f.stat().st_mode) & 0o444 == 0o444 & ~umask, f.name
    with pytest.raises(SpecrtError, match="every GEMM kind"):
        make_engine_set(EngineSetRequest(**{**req.__dict__, "name": "x", "float_gemms": ("qkv", "o", "gateup",
                                                                                         "down")}),
                        log=lambda m: None)
    # --outlier-channels 2 on an int8 target: every quantized GEMM splits off its input's 2 largest channels
    req = EngineSetRequest(**{**req.__dict__, "name": "outliers", "precisions": ("fp32", "int8"), "float_gemms": (),
                              "outlier_channels": 2})
    m = load_manifest(make_engine_set(req, log=lambda m: None))
    b = m.engine("target", "int8").build
    model = onnx.load(str(m.root / m.engine("target", "int8").file), load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert b["outlier_channels"] == 2 and ops["Gather"] >= 2 * b["gemms_quantized"]  # + the embedding's
    assert {n.name for n in model.graph.node if n.op_type == "MatMul" and n.name.endswith(".top")} == \
        {g + ".top" for g in gemm_layers(fp32)}
    assert {r["engine"]: r["kept_float"] for r in rows(m)}["target-int8"] == \
        "lm_head (1 of 13); 2 outlier channels an input"
    assert tensorrt_violations(model) == []


def test_info_sums_the_memory_of_the_proposers_each_target_runs(quantized_engines):
    from typer.testing import CliRunner

    from specrt.cli import app

    r = CliRunner().invoke(app, ["info", str(quantized_engines)])
    assert r.exit_code == 0, r.output
    lines = {ln.split(" with ")[0].split()[-1]: ln for ln in r.output.splitlines()
             if ln.startswith("memory at max context")}
    assert "with draft-fp8:" in lines["target-fp8"] and "with draft-int4-awq:" in lines["target-int4-awq"]
    assert "with draft-fp32:" in lines["target-int8"]  # no int8 draft: the runtime runs the first one
    import re

    r4 = CliRunner().invoke(app, ["info", str(quantized_engines), "--parallel", "4"])
    assert r4.exit_code == 0, r4.output
    line = next(ln for ln in r4.output.splitlines() if ln.startswith("memory at max context, target-fp32"))
    one, four, kv = (float(x) for x in re.search(r": (\d+) MiB.*; 4 streams at once: (\d+) MiB \((\d+) MiB", line)
                     .groups())
    assert abs(four - (one + 3 * kv)) <= 2  # the weights once, a KV cache a stream (rounded MiB)
    bad = CliRunner().invoke(app, ["info", str(quantized_engines), "--parallel", "0"])
    assert bad.exit_code == 2 and "--parallel must be >= 1" in bad.output


def test_streams_on_a_gpu_count_the_hidden_rows_their_heads_read():
    """`specrt info --parallel`: on a GPU backend with Medusa or EAGLE heads each stream adds the device copy of its
    slot's hidden rows (max_context x hidden x float32); a CPU set, or a GPU set without heads, adds nothing."""
    from types import SimpleNamespace as E

    from specrt.manifest import stream_hidden_bytes

    target = dict(role="target", max_context=4096, hidden_size=1536)
    for backend in ("tensorrt", "tensorrt-rtx", "onnxruntime-cuda"):
        for head in ("medusa", "eagle"):
            assert stream_hidden_bytes([E(backend=backend, **target), E(role=head, backend=backend)]) == 4096 * 1536 * 4
        assert stream_hidden_bytes([E(backend=backend, **target), E(role="draft", backend=backend)]) == 0
    for backend in ("onnxruntime", "onnxruntime-portable"):
        assert stream_hidden_bytes([E(backend=backend, **target), E(role="medusa", backend=backend)]) == 0


def test_outlier_channels_stay_float_and_the_rest_sets_the_int8_scale(tmp_path):
    """insert_qdq(outliers=N) on one GEMM whose input has 3 channels 500x the others: the N largest-amax channels go
    through a float GEMM (their part of the output exact), the rest through int8 Q/DQ at a scale set by the rest
    alone, so the output error drops by orders of magnitude against plain per-tensor W8A8; SmoothQuant applies
    to the rest only."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specrt.build.quantize import insert_qdq

    rng = np.random.default_rng(0)
    K, N, big = 64, 32, [5, 17, 40]  # big enough that the weights go to the .data file
    w = rng.standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="gemm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
                              [numpy_helper.from_array(w, "w")])
    src = tmp_path / "g.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(src))
    x = rng.standard_normal((256, K)).astype(np.float32)
    x[:, big] *= 500
    calib = {"x": {"amax": np.abs(x).max(axis=0)}}

    def run(outliers, smooth=None, feed=x):
        out = tmp_path / f"q{outliers}-{smooth}.onnx"
        facts = insert_qdq(src, out, "int8", calib, outliers=outliers, smooth=smooth)
        return ort.InferenceSession(str(out)).run(["y"], {"x": feed})[0], facts, onnx.load(str(out))

    want = x @ w
    plain, _, _ = run(0)
    for smooth in (None, 0.8):
        got, facts, model = run(3, smooth)
        ops = collections.Counter(n.op_type for n in model.graph.node)
        assert ops["Gather"] == 2 and ops["Add"] == 1 and facts["outlier_channels"] == 3
        assert np.abs(got - want).max() < 0.01 * np.abs(plain - want).max()
    only_top = np.zeros_like(x)
    only_top[:, big] = x[:, big]
    got, _, _ = run(3, feed=only_top)  # the rest quantizes to zero: what is left is the float GEMM's, exactly
    np.testing.assert_allclose(got, only_top @ w, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="outlier channels are for fp8 and int8"):
        insert_qdq(src, tmp_path / "a.onnx", "int4-awq",
                   {"x": {**calib["x"], "rows": x, "mean_abs": np.abs(x).mean(0)}}, outliers=2)


def test_qdq_engines_keep_an_fp16_cache_and_older_fp32_based_sets_are_refused_at_load(quantized_engines, tmp_path):
    """The Q/DQ precisions quantize over the fp16 activation base (attention and the cache in fp16, as the GPU
    kernels take them); a set whose Q/DQ engine records an fp32 cache (built before) is one line at load."""
    import json
    import shutil

    from specrt.errors import SpecrtError

    m = load_manifest(quantized_engines)
    fp8 = m.engine("target", "fp8")
    assert fp8.build["activation_base"] == "float16"
    model = onnx.load(str(m.root / fp8.file), load_external_data=False)
    cache = next(i for i in model.graph.input if i.name.startswith("past_key_values."))
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    old = tmp_path / "old"
    shutil.copytree(quantized_engines, old)
    raw = json.loads((old / "manifest.json").read_text())
    inputs = raw["engines"]["target-fp8"]["inputs"]
    inputs[next(k for k in inputs if k.startswith("past_key_values."))][-1] = "float32"
    (old / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(SpecrtError, match="'target-fp8' keeps its KV cache in float32.*rebuild the engine set"):
        load_manifest(old)
