"""The GPU backends (TensorRT, onnxruntime-cuda) where no GPU is: they refuse in one line that names the fix, and
what TensorRT parses (every portable input in a profile, the cache capacity fixed) is checked here."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from specrt.errors import SpecrtError
from specrt.interface import PORTABLE_CACHE_DIMS, PORTABLE_INPUTS, past_name, portable_signature
from specrt.runtime.backends.device import memory as cuda_memory
from specrt.runtime.engine import EngineOptions, open_engine
from gpu_fakes import gpu_entry, has_module, identity_model, one_line, random_portable


# --- refusals -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(has_module("tensorrt"), reason="TensorRT is installed here")
def test_require_tensorrt_is_one_line_naming_the_install():
    from specrt.build.tensorrt import build_engine, require_tensorrt

    with pytest.raises(SpecrtError) as e:
        require_tensorrt()
    assert "pip install tensorrt-cu12" in one_line(e)
    with pytest.raises(SpecrtError) as e:  # the build refuses before touching its arguments
        build_engine(Path("missing.onnx"), Path("x.engine"), max_prompt=8, max_width=4, max_capacity=64,
                     timing_cache=Path("t.cache"))
    assert "pip install tensorrt-cu12" in one_line(e)


@pytest.mark.skipif(has_module("tensorrt"), reason="TensorRT is installed here")
def test_a_tensorrt_engine_here_is_one_line(tmp_path):
    (tmp_path / "target-fp16.engine").write_bytes(b"not an engine")
    entry = gpu_entry("tensorrt", "target-fp16.engine", build={"tensorrt": "10.15.1", "compute_capability": "9.0"})
    with pytest.raises(SpecrtError) as e:
        open_engine(tmp_path, entry)
    assert "TensorRT is not installed" in one_line(e) and "pip install" in str(e.value)
    from specrt.runtime.backends import tensorrt

    with pytest.raises(SpecrtError, match="TensorRT is not installed"):  # several streams: the same line
        tensorrt.open_batch(tmp_path, entry, EngineOptions(), 4)


@pytest.mark.skipif(has_module("cuda.bindings"), reason="cuda-bindings is installed here")
def test_the_gpu_backends_name_cuda_bindings_where_it_is_missing():
    with pytest.raises(SpecrtError) as e:
        cuda_memory.require_device("tensorrt")
    assert "pip install cuda-bindings" in one_line(e)
    assert cuda_memory.device_count()[0] == 0


@pytest.mark.filterwarnings("ignore::UserWarning")  # ORT: "Specified provider 'CUDAExecutionProvider' is not..."
def test_onnxruntime_cuda_refuses_a_cpu_only_onnxruntime(tmp_path, monkeypatch):
    import onnxruntime as ort

    from specrt.runtime.backends import onnxruntime_cuda

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(SpecrtError) as e:  # through the registry, as the loader opens it
        open_engine(tmp_path, gpu_entry("onnxruntime-cuda", "target-fp16.onnx"))
    msg = one_line(e)
    assert msg.startswith("onnxruntime-cuda: this onnxruntime runs on the CPU only (providers: ")
    assert "pip install onnxruntime-gpu" in msg and "--backend onnxruntime-portable" in msg
    with pytest.raises(SpecrtError, match="runs on the CPU only"):  # several streams: the same line
        onnxruntime_cuda.open_batch(tmp_path, gpu_entry("onnxruntime-cuda", "target-fp16.onnx"), EngineOptions(), 2)
    with pytest.raises(SpecrtError, match="runs on the CPU only"):  # Medusa heads run on the CUDA EP too
        onnxruntime_cuda.open_heads(tmp_path, gpu_entry("onnxruntime-cuda", "medusa-fp32.onnx"))
    # a session that asked for CUDA and got the CPU (ORT falls back with a warning) is refused the same way
    model = identity_model(tmp_path / "id.onnx")
    session = ort.InferenceSession(str(model), providers=[("CUDAExecutionProvider", {"device_id": "0"})])
    assert session.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(SpecrtError, match="runs on the CPU only"):
        onnxruntime_cuda.require_cuda_provider(session.get_providers())
    # ... which is what open_session checks once the session exists (here: a provider list that claims CUDA)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(SpecrtError) as e:
        onnxruntime_cuda.open_session(model, stream=0)
    assert "providers: CPUExecutionProvider" in one_line(e)


def test_tensorrt_profiles_cover_every_portable_input():
    from specrt.build.tensorrt import profile_shapes

    sig, _ = portable_signature(2, {"num_kv_heads": 2, "head_dim": 8, "hidden_size": 32, "vocab_size": 96}, "float16")
    network = {name: tuple(d if isinstance(d, int) else -1 for d in dims) for name, dims, _ in sig}
    network[past_name(0, "key")] = (-1, 2, 664, 8)  # a capacity the graph fixes keeps its size
    shapes = profile_shapes(network, seq=(1, 8, 64), logits=(1, 8, 64), capacity=(256, 664, 664))
    assert set(shapes) == set(network)
    assert shapes["attention_mask"] == ((1, 1, 1, 256), (1, 1, 8, 664), (1, 1, 64, 664))
    assert shapes["logits_indices"] == ((1,), (8,), (64,)) and shapes["write_indices"] == ((1,), (1,), (1,))
    assert shapes[past_name(0, "key")] == ((1, 2, 664, 8),) * 3
    assert shapes[past_name(1, "value")] == ((1, 2, 256, 8), (1, 2, 664, 8), (1, 2, 664, 8))
    assert len(PORTABLE_CACHE_DIMS) == 4 and {n for n, _, _ in PORTABLE_INPUTS} <= set(shapes)
    with pytest.raises(SpecrtError, match="not one of a portable decoder's"):
        profile_shapes({"tree_mask": (-1, -1, -1)}, (1, 1, 1), (1, 1, 1), (1, 1, 1))
    batched = profile_shapes(network, seq=(1, 8, 64), logits=(1, 8, 64), capacity=(664, 664, 664), batch=(1, 1, 8))
    assert batched["input_ids"] == ((1, 1), (1, 8), (8, 64)) and batched["write_indices"] == ((1,), (1,), (8,))
    assert batched[past_name(0, "key")] == ((1, 2, 664, 8), (1, 2, 664, 8), (8, 2, 664, 8))
    assert batched["logits_indices"] == ((1,), (8,), (64,))  # one set of rows for the whole batch


def test_the_cache_capacity_is_fixed_in_the_graph_tensorrt_parses(tmp_path):
    from specrt.build.tensorrt import fix_capacity

    path = tmp_path / "portable.onnx"
    random_portable(path, max_context=300)
    model = onnx.load_model_from_string(fix_capacity(path, 364))
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in [*model.graph.input, *model.graph.output]}
    assert dims[past_name(1, "value")] == ["batch", 2, 364, 8] and dims["attention_mask"] == ["batch", 1, "seq", 364]
    # the weights stay in the .data file beside the graph, where the parser reads them
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer)
