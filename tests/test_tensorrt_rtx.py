"""TensorRT for RTX compiles for real here, without a GPU: the tiny model's portable graphs at every precision, a
draft model, Medusa heads (fp32 and Q/DQ) and the EAGLE head through `specrt engines --backend tensorrt-rtx`, each a
real parser and builder run that fails the test on any error; what the manifest records of it; the one-line
refusals (bad --gpu-arch, fp8 where an architecture lacks it, a parser or builder failure, the library missing);
and the runtime's checks of an engine against the GPU it is opened on, its compiled heads against fakes. Regular
TensorRT's heads go through the same build with this module standing in for `tensorrt` (a GPU faked). Running an
engine needs a GPU TensorRT for RTX supports (tests/gpu/check.sh)."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

from specrt.errors import SpecrtError
from gpu_fakes import HostEagleEngine as _HostEagleEngine
from gpu_fakes import eagle_heads_agree
from gpu_fakes import HostEngine as _HostEngine
from gpu_fakes import random_heads as _random_heads

try:
    import tensorrt_rtx_bindings  # noqa: F401
except ImportError:  # CI installs it (make venv): there a missing compiler is a failure, not a skip
    if os.environ.get("CI"):
        raise
    pytest.skip("TensorRT for RTX is not installed (`pip install 'specrt[tensorrt-rtx]'`)", allow_module_level=True)

pytestmark = pytest.mark.slow  # engine compiles: left out of the quick tier

PRECISIONS = ("fp32", "fp16", "fp8", "int8", "int4-awq")


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    from tiny import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-draft", "llama", seed=0, noise=0.5)


def random_heads_file(path: Path, hidden: int = 64, vocab: int = 384, k: int = 3) -> Path:
    """A Medusa heads file as `specrt train-medusa` writes it, with random weights."""
    from specrt.export.medusa import HEADS_FORMAT

    heads = _random_heads(hidden, vocab, k)
    np.savez(path, **{n: heads[n] for n in ("w1", "b1", "w2", "b2", "vocab")},
             report=json.dumps({"format": HEADS_FORMAT, "rank_acc": [[0.5, 0.2, 0.1, 0.05]] * k}))
    return path


def random_eagle_file(path: Path, tiny_dir: Path) -> Path:
    """An EAGLE head file as `specrt train-eagle` writes it, with random weights, for the tiny model."""
    import torch
    from transformers import AutoConfig

    from specrt.export.eagle import HeadShape, make_head, save_head

    config = AutoConfig.from_pretrained(str(tiny_dir))
    shape = HeadShape.of(config)
    torch.manual_seed(0)
    save_head(path, make_head(shape), np.arange(config.vocab_size), {"shape": shape.__dict__})
    return path


@pytest.fixture(scope="module")
def rtx_set(tiny_dir, draft_dir, tmp_path_factory):
    """The tiny Llama at every precision, a draft at fp32 and fp16, Medusa heads and an EAGLE head, compiled for
    sm89 (Ada): (set, log lines)."""
    from specrt.pipeline import EngineSetRequest, make_engine_set

    out, said = tmp_path_factory.mktemp("rtx"), []
    path = make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-rtx", PRECISIONS, 256, out,
                                            draft_source=str(draft_dir), draft_precisions=("fp32", "fp16"),
                                            medusa_heads=random_heads_file(out / "heads.npz"),
                                            eagle_head=random_eagle_file(out / "eagle.npz", tiny_dir),
                                            backend="tensorrt-rtx", calibration_texts=4, quality_floor=0.0,
                                            gpu_archs=("sm89",)), log=said.append)
    return path, said


def test_every_precision_and_the_draft_compile_and_the_manifest_says_what_was_compiled(rtx_set):
    from specrt.build.tensorrt import onnx_sha256
    from specrt.manifest import load_manifest

    path, said = rtx_set
    m = load_manifest(path)
    heads = ["medusa-fp32", "medusa-fp8", "medusa-int8", "medusa-int4-awq"]
    assert sorted(m.engines) == sorted([f"target-{p}" for p in PRECISIONS] + ["draft-fp32", "draft-fp16"] + heads
                                       + ["eagle-fp32"])
    assert not list(path.glob("*.onnx*"))  # the set ships engines only
    for e in m.engines.values():
        b = e.build
        assert e.backend == "tensorrt-rtx" and e.files == [e.file] and e.file == f"{e.name}.engine"
        assert b["compiler"] == "tensorrt-rtx" and b["version"] == tensorrt_rtx_bindings.__version__
        assert b["gpu_archs"] == ["sm89"] and b["engine_bytes"] == (path / e.file).stat().st_size > 100_000
        assert b["build_s"] > 0 and len(b["onnx_sha256"]) == 64 and "log" not in b
        assert e.memory["weights_bytes"] == b["engine_bytes"]
        if e.role == "medusa":  # one profile of 1..64 rows; their tau measured with the ONNX heads on the CPU
            assert b["profiles"] == {"heads": {"rows": [1, 1, 64]}} and e.quality["drafting"]["tau"] >= 1.0
            continue
        if e.role == "eagle":  # the fp32 graph (standard ops), its attention decomposable like the target's
            assert set(b["profiles"]) == {"prefill", "decode"} and b["decomposable_attention"] == 1
            assert e.eagle["topk"] == 8 and e.eagle["pass_seconds_by_width"]
            continue
        assert e.parity["checked_on"].startswith("onnxruntime-portable")  # the very graph, on the CPU
        assert (b["decomposable_attention"] > 0) == (e.precision == "fp32")  # fp32 attention only; 2 layers
        assert e.build_versions["tensorrt-rtx"] == b["version"]
    assert m.engines["target-fp8"].build["activation_base"] == "float16"  # the Q/DQ precisions over fp16
    assert m.engines["target-int8"].quality["top1"] > 0  # measured on the CPU, on the graph compiled
    # the sha256 recorded is the graph's the engine was compiled from: the cached portable fp16 graph's
    cache = next((path.parent / ".cache").glob("export-*/portable-v*/target-fp16.onnx"))
    assert m.engines["target-fp16"].build["onnx_sha256"] == onnx_sha256(cache)
    assert sum("compiling" in s for s in said) == len(m.engines)


def test_info_shows_the_compiler_and_targets(rtx_set):
    from typer.testing import CliRunner

    from specrt.cli import app

    r = CliRunner().invoke(app, ["info", str(rtx_set[0])])
    assert r.exit_code == 0, r.output
    assert f"compiled: target-fp8 by TensorRT for RTX {tensorrt_rtx_bindings.__version__} for sm89" in r.output


def test_a_set_under_another_name_reuses_the_compiled_engines(rtx_set, tiny_dir):
    from specrt.pipeline import EngineSetRequest, make_engine_set

    path, said = rtx_set
    again: list[str] = []
    make_engine_set(EngineSetRequest(str(tiny_dir), "tiny-rtx-again", ("fp16",), 256, path.parent,
                                     backend="tensorrt-rtx", gpu_archs=("sm89",)), log=again.append)
    assert not any("compiling" in s for s in again) and any("target-fp16:" in s for s in again)


@pytest.mark.parametrize("precision", ["fp32", "fp8", "int8", "int4-awq"])
def test_medusa_heads_compile(precision, tmp_path):
    """Medusa heads in the form the portable sets ship (per-head 2-D GEMMs; Q/DQ at the set's precision)."""
    from specrt.build.quantize import calibrate, insert_qdq
    from specrt.build.tensorrt import TENSORRT_RTX, build_engine
    from specrt.export.medusa import export_heads_onnx
    from specrt.interface import HEADS_HIDDEN

    hidden, vocab = 64, 384
    lm_head = np.random.default_rng(1).standard_normal((vocab, hidden)).astype(np.float32)
    graph = tmp_path / "heads-fp32.onnx"
    export_heads_onnx(_random_heads(hidden, vocab), lm_head, graph, topk=4, per_head=True)
    if precision != "fp32":
        feeds = [{HEADS_HIDDEN: np.random.default_rng(i).standard_normal((8, hidden)).astype(np.float32)}
                 for i in range(2)]
        calib = calibrate(graph, feeds, sample_rows=64)
        graph, src = tmp_path / f"heads-{precision}.onnx", graph
        insert_qdq(src, graph, precision, calib)
    facts = build_engine(graph, tmp_path / "heads.engine", max_prompt=64, max_width=64, max_capacity=64,
                         compiler=TENSORRT_RTX, gpu_archs=("sm89",), heads=True)
    assert facts["engine_bytes"] > 0 and facts["profiles"] == {"heads": {"rows": [1, 1, 64]}}


# --- refusals -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--gpu-arch", "sm90"], "--gpu-arch sm90 is not an architecture TensorRT for RTX compiles for (Hopper"),
    (["--gpu-arch", "sm86,sm89", "--precisions", "fp16,fp8"], "fp8 needs FP8 tensor cores, which sm86 lack"),
    (["--precisions", "fp8"], "which sm80, sm86 lack; build fp8 with --gpu-arch sm89,sm120"),  # the default set
    (["--gpu-arch", ","], "--gpu-arch is empty"),
    (["--gpu-arch", "sm75", "--precisions", "fp16,int4-awq"], "int4-awq does not compile for sm75 (TensorRT for RTX "
                                                              "has no INT4 weights there)"),
    (["--gpu-arch", "sm75,sm86", "--precisions", "fp32"], "fp32 does not compile for sm75"),
    (["--precisions", "int4"], "builds precisions fp32, fp16, fp8, int8, int4-awq, not int4"),
])
def test_bad_gpu_archs_and_precisions_are_one_line_before_any_work(tiny_dir, tmp_path, args, says):
    from typer.testing import CliRunner

    from specrt.cli import app

    r = CliRunner().invoke(app, ["engines", "--source", str(tiny_dir), "--backend", "tensorrt-rtx",
                                 "--out", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_gpu_arch_is_refused_for_a_backend_that_builds_where_it_runs(tiny_dir, tmp_path):
    from typer.testing import CliRunner

    from specrt.cli import app

    r = CliRunner().invoke(app, ["engines", "--source", str(tiny_dir), "--backend", "onnxruntime-portable",
                                 "--gpu-arch", "sm89", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--gpu-arch is for --backend tensorrt-rtx" in r.output, r.output


def test_tensorrt_rtx_missing_is_one_line_naming_the_install(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from specrt.cli import app

    monkeypatch.setitem(sys.modules, "tensorrt_rtx_bindings", None)  # import fails as if not installed
    r = CliRunner().invoke(app, ["engines", "--source", str(tiny_dir), "--backend", "tensorrt-rtx",
                                 "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and "pip install 'specrt[tensorrt-rtx]'" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_builder_failure_is_one_line_naming_the_engine_and_the_log(portable_engines, tmp_path, monkeypatch):
    """fp32 attention without its decomposable mark is what both compilers refuse: the error names the engine,
    the compiler's own reason and the log that holds the rest."""
    from specrt.build import tensorrt
    from specrt.manifest import load_manifest

    monkeypatch.setattr(tensorrt, "mark_decomposable", lambda trt, network: 0)
    graph = portable_engines / load_manifest(portable_engines).engine("target", "fp32").file
    with pytest.raises(SpecrtError) as e:
        tensorrt.build_engine(graph, tmp_path / "t.engine", max_prompt=64, max_width=8, max_capacity=320,
                              compiler=tensorrt.TENSORRT_RTX, gpu_archs=("sm89",), name="target-fp32")
    msg = _one_line(e)
    assert "could not build target-fp32" in msg and "decomposable" in msg and "t.engine.log" in msg
    assert "Attention" in (tmp_path / "t.engine.log").read_text() and not (tmp_path / "t.engine").exists()


def test_a_parser_failure_names_the_node(tmp_path):
    from onnx import TensorProto, helper

    from specrt.build.tensorrt import TENSORRT_RTX, build_engine

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("FusedThing", ["x"], ["y"], name="layers.0.fused", domain="com.example")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)])
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(SpecrtError) as e:
        build_engine(tmp_path / "bad.onnx", tmp_path / "bad.engine", max_prompt=8, max_width=4, max_capacity=64,
                     compiler=TENSORRT_RTX, heads=True, name="medusa-fp32")
    msg = _one_line(e)
    assert "cannot parse medusa-fp32" in msg and "node 'layers.0.fused' (FusedThing)" in msg and "bad.onnx" in msg


# --- the runtime's checks before it deserializes -------------------------------------------------------------

def _rtx_entry(tmp_path, **build):
    from specrt.manifest import EngineEntry

    (tmp_path / "t.engine").write_bytes(b"\0" * 64)
    return EngineEntry(name="target-fp16", role="target", file="t.engine", backend="tensorrt-rtx", precision="fp16",
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=96,
                       max_context=256, build={"compiler": "tensorrt-rtx", "version": "1.7.1.116",
                                               "gpu_archs": ["sm89", "sm120"], **build})


@pytest.mark.parametrize("here, build, says", [
    ("9.0", {}, "this GPU (compute capability 9.0) is not one TensorRT for RTX runs on"),
    ("8.6", {}, "was compiled for sm89, sm120, and this GPU is sm86; rebuild the set with `specrt engines "
                "--backend tensorrt-rtx --gpu-arch sm89,sm120,sm86`"),
    ("8.9", {"version": "1.6.0.1"}, "built with TensorRT for RTX 1.6.0.1, this is"),
    ("8.9", {"compiler": "tensorrt"}, "was compiled by TensorRT, and its entry names the tensorrt-rtx backend"),
])
def test_an_engine_for_another_gpu_or_version_is_refused(tmp_path, monkeypatch, here, build, says):
    from specrt.runtime.backends.tensorrt import engine as backend
    from specrt.runtime.engine import open_engine

    monkeypatch.setattr(backend, "require_device", lambda name: None)
    monkeypatch.setattr(backend, "compute_capability", lambda device=0: here)
    with pytest.raises(SpecrtError) as e:
        open_engine(tmp_path, _rtx_entry(tmp_path, **build))
    assert says in _one_line(e)
    if here == "9.0":
        assert "--backend tensorrt" in str(e.value)


def test_the_library_header_check_is_one_line_with_its_reasons(tmp_path):
    import tensorrt_rtx_bindings as trt

    from specrt.runtime.backends.tensorrt.rtx import check_validity

    D = trt.EngineInvalidityDiagnostics
    runtime = types.SimpleNamespace(engine_header_size=64, get_engine_validity=lambda b: (
        trt.EngineValidity.INVALID, int(D.VERSION_MISMATCH) | int(D.UNSUPPORTED_CC)))
    with pytest.raises(SpecrtError) as e:
        check_validity(trt, runtime, b"\0" * 128, _rtx_entry(tmp_path))
    assert "(version mismatch, unsupported cc); rebuild the engine set with `specrt engines --backend " \
           "tensorrt-rtx" in _one_line(e)
    runtime.get_engine_validity = lambda b: (trt.EngineValidity.INVALID, int(D.OLD_CUDA_DRIVER))
    with pytest.raises(SpecrtError, match="old cuda driver\\); update the NVIDIA driver"):
        check_validity(trt, runtime, b"\0" * 128, _rtx_entry(tmp_path))
    runtime.get_engine_validity = lambda b: (trt.EngineValidity.VALID, 0)
    check_validity(trt, runtime, b"\0" * 128, _rtx_entry(tmp_path))  # passes


class FakeRuntimeCache:
    def __init__(self):
        self.blob = b""

    def deserialize(self, blob) -> bool:
        if not bytes(blob).startswith(b"cache:"):
            return False
        self.blob = bytes(blob)
        return True

    def serialize(self):
        return self.blob + b"+more"


class FakeRuntimeConfig:
    def __init__(self):
        self.cache, self.strategy = None, None
        self.dynamic_shapes_kernel_specialization_strategy = self.cuda_graph_strategy = None

    def create_runtime_cache(self):
        return FakeRuntimeCache()

    def set_runtime_cache(self, cache) -> bool:
        self.cache = cache
        return True

    def set_execution_context_allocation_strategy(self, strategy) -> None:
        self.strategy = strategy


def test_the_runtime_config_and_its_cache_file(tmp_path):
    """rtx_runtime_config: EAGER specialization, the library's own graphs off, USER_MANAGED scratch, the runtime
    cache read from its file (a file of another machine is dropped) and written back whole at close."""
    import tensorrt_rtx_bindings as trt

    from specrt.runtime.backends.tensorrt.rtx import RuntimeCache, rtx_runtime_config

    path = tmp_path / ".cache" / "tensorrt-rtx" / "runtime.bin"
    engine = types.SimpleNamespace(create_runtime_config=FakeRuntimeConfig)
    cache = RuntimeCache(trt, path)
    config = rtx_runtime_config(trt, engine, cache)
    assert config.dynamic_shapes_kernel_specialization_strategy == \
        trt.DynamicShapesKernelSpecializationStrategy.EAGER
    assert config.cuda_graph_strategy == trt.CudaGraphStrategy.DISABLED
    assert config.strategy == trt.ExecutionContextAllocationStrategy.USER_MANAGED and config.cache is cache.cache
    cache.cache.blob = b"cache:1"
    cache.save()
    assert path.read_bytes() == b"cache:1+more" and not list(path.parent.glob("*.part"))
    again = RuntimeCache(trt, path)
    rtx_runtime_config(trt, engine, again)
    assert again.cache.blob == b"cache:1+more"  # read back
    path.write_bytes(b"another machine's")
    third = RuntimeCache(trt, path)
    rtx_runtime_config(trt, engine, third)
    assert not path.exists() and third.cache.blob == b""  # dropped, compiled anew, saved at close


def test_the_set_records_parity_and_quality_like_the_portable_set(rtx_set):
    """Parity against PyTorch and quality against fp32, measured on the graph each engine was compiled from: the
    same figures the portable set of the same inputs records."""
    path, _ = rtx_set
    raw = json.loads((path / "manifest.json").read_text())["engines"]
    fp32 = raw["target-fp32"]["parity"]
    assert fp32["greedy_agreement_vs_torch"] == 1.0 and fp32["max_abs_logit_diff_vs_torch"] < 1e-3
    assert raw["draft-fp32"]["quality"]["drafting"]["against"] == "target-fp32"


@pytest.mark.parametrize("token_input", [False, True])
def test_compiled_heads_on_the_device_propose_what_the_onnx_heads_do(tmp_path, token_input):
    """TrtHeads (every buffer in HostMemory, TensorRT faked by a session of the same graph at the addresses it was
    given) against OrtHeads on the CPU: the same candidates for every row, with and without the token input."""
    from specrt.export.medusa import export_heads_onnx
    from specrt.runtime.backends.device.memory import HostMemory
    from specrt.runtime.backends.onnxruntime_cpu.heads import OrtHeads
    from specrt.runtime.backends.tensorrt.heads import TrtHeads

    hidden, vocab = 64, 384
    rng = np.random.default_rng(3)
    heads = _random_heads(hidden, vocab)
    if token_input:
        heads["a"] = (rng.standard_normal((hidden, hidden)) * 0.1).astype(np.float16)
    graph = tmp_path / "heads.onnx"
    export_heads_onnx(heads, rng.standard_normal((vocab, hidden)).astype(np.float32), graph, topk=4)
    fake, config = _HostEngine(graph), object()
    trt_heads = TrtHeads(fake, HostMemory(), "medusa-fp32", runtime_config=config)
    cpu_heads = OrtHeads(graph)
    assert (trt_heads.heads, trt_heads.topk) == (cpu_heads.heads, cpu_heads.topk) == (3, 4)
    assert fake.contexts[0].config_ is config and fake.contexts[0].scratch[1] == 1024
    row = trt_heads.memory.alloc(hidden * 4)  # a target's hidden row on the device
    for i in range(5):
        h, t = rng.standard_normal(hidden).astype(np.float32), int(rng.integers(0, vocab))
        np.testing.assert_array_equal(trt_heads(h, t), cpu_heads(h, t))
        trt_heads.memory.upload(row, h)
        np.testing.assert_array_equal(trt_heads(row, t), cpu_heads(h, t))  # read there: copied on the device
    trt_heads.close()


def test_the_compiled_eagle_head_on_the_device_drafts_what_the_onnx_head_does(tiny_dir, tmp_path):
    """TrtEagleHead (every buffer in HostMemory, TensorRT faked by a session of the same graph at the addresses it was
    given) against OrtEagleHead on the CPU: the same next features and top-k for a prompt longer than the prefill
    profile (run in chunks), chain steps and a tree level, and after its cache is saved and loaded back."""
    from transformers import AutoConfig

    from specrt.build.tensorrt import fix_capacity
    from specrt.export.eagle import HeadShape, export_eagle_onnx
    from specrt.runtime.backends.device.memory import HostMemory
    from specrt.runtime.backends.onnxruntime_cpu.heads import OrtEagleHead
    from specrt.runtime.backends.tensorrt.heads import TrtEagleHead

    config = AutoConfig.from_pretrained(str(tiny_dir))
    shape = HeadShape.of(config)
    head = random_eagle_file(tmp_path / "eagle.npz", tiny_dir)
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((config.vocab_size, config.hidden_size)).astype(np.float32)
    graph = tmp_path / "eagle-fp32.onnx"
    export_eagle_onnx(head, embed, embed.copy(), graph, 256, 8)
    (tmp_path / "eagle-fixed.onnx").write_bytes(fix_capacity(graph, 320))
    dims = dict(hidden=config.hidden_size, kv_heads=shape.kv_heads, head_dim=shape.head_dim, topk=8)
    fake = _HostEagleEngine(tmp_path / "eagle-fixed.onnx", max_rows=16, max_width=4)
    gpu = TrtEagleHead(fake, HostMemory(), name="eagle-fp32", runtime_config=object(), **dims)
    cpu = OrtEagleHead(graph, capacity=320, **dims)
    cpu.reserve(320)
    assert gpu.capacity == cpu.capacity == 320 and len(fake.contexts) == 2

    # the prompt in the prefill profile's 16 rows at a time, a chain step in the decode profile, a tree level
    eagle_heads_agree(gpu, cpu, config.hidden_size, config.vocab_size, rng, lambda: TrtEagleHead(
        _HostEagleEngine(tmp_path / "eagle-fixed.onnx", 16, 4), HostMemory(), name="eagle-fp32", **dims))


# --- regular TensorRT's heads: the same build, on the GPU that builds (TensorRT for RTX standing in) -----------

@pytest.fixture(scope="module")
def tensorrt_heads_set(tiny_dir, tiny_engines, tmp_path_factory):
    """A regular `tensorrt` set's heads compiled by compile_set, TensorRT for RTX's module standing in for `tensorrt`
    (a real parser and builder run: it builds without a GPU) on a GPU faked as sm89: its target already an engine
    (built on the GPU before its checks: left as it is), its Medusa heads and EAGLE head as the pipeline writes them
    (build_medusa, build_eagle's eagle-fp32; the target's pass costs given). -> (set, compile cache, ONNX graphs
    kept aside, log lines)."""
    import shutil

    from specrt.build import tensorrt as build_trt
    from specrt.export.sources import fingerprint, resolve
    from specrt.manifest import EngineEntry
    from specrt.pipeline import eagle as pipeline_eagle
    from specrt.pipeline import tree_sizing
    from specrt.pipeline.portable import compile_set

    out = tmp_path_factory.mktemp("tensorrt-heads")
    tmp, graphs, said = out / "set", out / "graphs", []
    tmp.mkdir()
    fp = fingerprint(resolve(str(tiny_dir)))
    cache = next((tiny_engines.parent / ".cache").glob(f"export-{fp[:16]}-ctx256-*"))
    facts = json.loads((cache / "export.json").read_text())
    costs = lambda *a: [[1, 0.01], [64, 0.03]]  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tree_sizing, "target_pass_costs", costs)
        mp.setattr(pipeline_eagle, "target_pass_costs", costs)
        medusa = tree_sizing.build_medusa(random_heads_file(out / "heads.npz"), cache, facts, tmp, said.append, 0, {},
                                          "tensorrt")
        eagle = pipeline_eagle.build_eagle(random_eagle_file(out / "eagle.npz", tiny_dir), cache, facts, tmp,
                                           said.append, {}, backend="tensorrt")
        shutil.copytree(tmp, graphs)
        (tmp / "target-fp16.engine").write_bytes(b"an engine built on the GPU")
        s = facts["spec"]
        target = EngineEntry(name="target-fp16", role="target", file="target-fp16.engine", files=["target-fp16.engine"],
                             backend="tensorrt", precision="fp16", num_layers=s["num_layers"],
                             num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                             hidden_size=s["hidden_size"], vocab_size=s["vocab_size"], max_context=256)
        (tmp / "manifest.json").write_text(json.dumps({"engines": {e.name: e.to_dict()
                                                                   for e in (target, medusa, eagle)}}))
        mp.setitem(sys.modules, "tensorrt", tensorrt_rtx_bindings)
        mp.setattr(build_trt, "compute_capability", lambda: "8.9")
        compile_set(tmp, "tensorrt", None, out / "compiled", said.append)
    return tmp, out / "compiled", graphs, said


def test_a_tensorrt_sets_heads_compile_on_its_gpu_with_the_same_build(tensorrt_heads_set):
    from specrt.build.tensorrt import COMPILE_FORMAT, MAX_BATCH

    path, compiled, _, said = tensorrt_heads_set
    version = tensorrt_rtx_bindings.__version__
    engines = json.loads((path / "manifest.json").read_text())["engines"]
    assert engines["target-fp16"]["file"] == "target-fp16.engine" and "build" not in engines["target-fp16"]
    assert sorted(p.name for p in path.iterdir()) == ["eagle-fp32.engine", "manifest.json", "medusa-fp32.engine",
                                                      "target-fp16.engine"]  # no ONNX left
    for name in ("medusa-fp32", "eagle-fp32"):
        e, b = engines[name], engines[name]["build"]
        assert e["backend"] == "tensorrt" and e["file"] == f"{name}.engine" and e["files"] == [e["file"]]
        # what the runtime checks of a regular TensorRT engine: its compiler, version and the GPU it was built on
        assert (b["compiler"], b["version"], b["tensorrt"], b["compute_capability"]) == ("tensorrt", version,
                                                                                       version, "8.9")
        assert "gpu_archs" not in b and "log" not in b and e["build_versions"]["tensorrt"] == version
        assert e["memory"]["weights_bytes"] == b["engine_bytes"] == (path / e["file"]).stat().st_size > 100_000
        assert f"compiling {name} with TensorRT {version} on this GPU (sm89)" in said
    assert engines["medusa-fp32"]["build"]["profiles"] == {"heads": {"rows": [1, 1, 64]}}
    eagle = engines["eagle-fp32"]
    assert set(eagle["build"]["profiles"]) == {"prefill", "decode"} and eagle["build"]["decomposable_attention"] == 1
    assert eagle["precision"] == "fp32" and eagle["eagle"]["topk"] == 8
    # cached per TensorRT version and GPU architecture, as the targets' engines are; its kernel timings kept
    folder = compiled / f"tensorrt-{version}-c{COMPILE_FORMAT}-sm89-b{MAX_BATCH}"
    assert len(list(folder.glob("*.engine"))) == 2 and (folder / "tensorrt.cache").is_file()
    assert not any("compiling target" in s for s in said)


def test_the_runtime_opens_a_tensorrt_sets_compiled_heads_on_the_device(tensorrt_heads_set, monkeypatch):
    """The entries compile_set wrote pass the runtime's checks of a regular TensorRT engine (its version, the GPU it
    was built for) and open as on-device heads, TrtHeads and TrtEagleHead (TensorRT's runtime faked: the engine
    deserialized is a session of the graph compiled, on HostMemory); the Medusa candidates equal the ONNX heads'.
    A set built before its heads were compiled keeps them on ONNX Runtime's CPU provider."""
    from types import SimpleNamespace

    from specrt.build.tensorrt import fix_capacity
    from specrt.manifest import EngineEntry
    from specrt.runtime.backends.tensorrt import engine as backend
    from specrt.runtime.backends.tensorrt import heads as tensorrt_heads
    from specrt.runtime.backends.device.memory import HostMemory
    from specrt.runtime.backends.onnxruntime_cpu.heads import OrtHeads
    from specrt.runtime.engine import open_eagle, open_heads

    path, _, graphs, _ = tensorrt_heads_set
    raw = json.loads((path / "manifest.json").read_text())["engines"]
    entries = {name: EngineEntry.from_dict(name, raw[name]) for name in ("medusa-fp32", "eagle-fp32")}
    (graphs / "eagle-fixed.onnx").write_bytes(fix_capacity(graphs / "eagle-fp32.onnx", 320))
    fakes = {(path / "medusa-fp32.engine").read_bytes(): lambda: _HostEngine(graphs / "medusa-fp32.onnx"),
             (path / "eagle-fp32.engine").read_bytes(): lambda: _HostEagleEngine(graphs / "eagle-fixed.onnx", 256, 64)}

    class Logger:
        WARNING = 2

        def __init__(self, severity):
            pass

    runtime = SimpleNamespace(deserialize_cuda_engine=lambda blob: fakes[bytes(blob)]())
    strategies = SimpleNamespace(USER_MANAGED="USER_MANAGED")
    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__=tensorrt_rtx_bindings.__version__,
                                                                 Logger=Logger, Runtime=lambda logger: runtime,
                                                                 ExecutionContextAllocationStrategy=strategies))
    monkeypatch.setattr(backend, "require_device", lambda name: None)
    monkeypatch.setattr(backend, "compute_capability", lambda device=0: "8.9")
    monkeypatch.setattr(tensorrt_heads, "on_own_memory", lambda make: make(HostMemory()))
    heads = open_heads(path, entries["medusa-fp32"])
    head = open_eagle(path, entries["eagle-fp32"])
    assert isinstance(heads, tensorrt_heads.TrtHeads) and heads.on_device
    assert isinstance(head, tensorrt_heads.TrtEagleHead) and head.on_device
    assert (head.capacity, head.max_rows, head.max_width, head.topk) == (320, 256, 64, 8)
    onnx_heads = OrtHeads(graphs / "medusa-fp32.onnx")
    rng = np.random.default_rng(0)
    for _ in range(3):
        h, t = rng.standard_normal(64).astype(np.float32), int(rng.integers(0, 384))
        np.testing.assert_array_equal(heads(h, t), onnx_heads(h, t))
    monkeypatch.setattr(backend, "compute_capability", lambda device=0: "9.0")  # another GPU: refused in one line
    with pytest.raises(SpecrtError, match="built for compute capability 8.9, this GPU is 9.0"):
        open_heads(path, entries["medusa-fp32"])
    old = EngineEntry.from_dict("medusa-fp32", {**raw["medusa-fp32"], "file": "medusa-fp32.onnx",
                                                "files": ["medusa-fp32.onnx"]})
    assert isinstance(open_heads(graphs, old), OrtHeads)
