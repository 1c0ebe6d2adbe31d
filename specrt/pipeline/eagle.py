"""The EAGLE engine of a set: a trained head (`specrt train-eagle`) written as an ONNX graph with its own KV cache
(export/eagle.py), from the target's own embedding and lm_head, with the target's measured pass costs for sizing
the dynamic tree at run time.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import zipfile
from pathlib import Path

from ..errors import SpecrtError
from ..manifest import EngineEntry, engine_memory, file_sha256
from .tree_sizing import target_pass_costs

TOPK = 8  # children per expanded node of the dynamic tree, and what a chain reads (its best)
NAME = "eagle-int8"
NAME_FILE = NAME + ".onnx"
COMPILED = "eagle-fp32"  # a set whose head runs on the GPU: the standard-op graph, not int8's


def on_gpu(backend: str) -> bool:
    """Whether a `backend` set runs its EAGLE head on the GPU beside the target (entry eagle-fp32, standard ops):
    compiled by a TensorRT compiler, or on ONNX Runtime's CUDA EP, as its target graph runs there (int8's dynamic
    quantization is ORT's CPU recipe: onnxruntime.ai/docs/performance/model-optimizations/quantization.html).
    Elsewhere eagle-int8 runs on ONNX Runtime's CPU provider."""
    from ..backends import BACKENDS

    return BACKENDS[backend].gpu


def check_head(head_path: Path) -> None:
    """Refuse, before any build work, a head the runtime cannot drive: an EAGLE-3 head (EagleTrainConfig.fuse)
    reads the target's low and middle layer features, which no target engine outputs yet."""
    from ..export.eagle import head_arrays

    try:
        _, _, report = head_arrays(head_path)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise SpecrtError(f"'{head_path}' is not an EAGLE head file ({e}); train one with `specrt train-eagle`")
    if (report.get("config") or {}).get("fuse"):
        raise SpecrtError(f"EAGLE head '{head_path}' reads fused target layers (EAGLE-3), which target engines do "
                          "not output yet; train a head without fuse (`specrt train-eagle`)")


def build_eagle(head_path: Path, cache: Path, facts: dict, tmp: Path, log,
                built: dict[str, EngineEntry], backend: str | None = None) -> EngineEntry:
    """Entry eagle-int8 (role "eagle"; int8 weights): runs on ONNX Runtime's CPU provider beside any target
    backend. backend (a set whose head runs on the GPU: on_gpu): entry eagle-fp32 of that backend instead, the
    fp32 graph of standard ops (RotaryEmbedding, TensorScatter, Attention) that a TensorRT compiler takes (int8's
    DynamicQuantizeLinear and MatMulInteger nodes do not parse) and compile_set (portable.py) compiles beside the
    target, or that the CUDA EP runs as it is."""
    from ..export.eagle import export_eagle_onnx, head_arrays
    from ..export.graph import read_initializers
    from ..export.layers import head_lm_head

    log(f"building the EAGLE head engine from {head_path}")
    _, _, report = head_arrays(head_path)
    s = facts["spec"]
    if report["shape"]["hidden"] != s["hidden_size"]:
        raise SpecrtError(f"EAGLE head '{head_path}' has hidden size {report['shape']['hidden']}, the target "
                          f"{s['hidden_size']}; train one for this target with `specrt train-eagle`")
    made_for = report.get("target_source_sha256")
    if made_for is not None and made_for != facts["source"]["sha256"]:
        raise SpecrtError(f"EAGLE head '{head_path}' was trained on another checkpoint than this target; train one "
                          "for it with `specrt train-eagle`")
    (embed,) = read_initializers(cache / "model.onnx", "embed_tokens.weight")
    standard = backend is not None
    name, precision = (COMPILED, "fp32") if standard else (NAME, "int8")
    work = tmp if standard else Path(tempfile.mkdtemp(prefix="eagle-", dir=tmp))  # standard: the graph as written
    graph = work / (COMPILED + ".onnx")
    info = export_eagle_onnx(head_path, embed, head_lm_head(cache, s), graph, facts["max_context"], TOPK)
    if not standard:
        # int8 weights (dynamic activations): a draft step reads a quarter of the bytes, 5x faster on the CPU
        # (docs/design-notes.md, "The EAGLE head in int8"); drafts stay lossless, the target verifies them
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quiet = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process is for CNNs
        try:
            quantize_dynamic(str(graph), str(tmp / NAME_FILE), weight_type=QuantType.QInt8,
                             per_channel=True, op_types_to_quantize=["MatMul"], use_external_data_format=True)
        finally:
            logging.getLogger().setLevel(quiet)
        shutil.rmtree(work)
    files = sorted(p.name for p in tmp.iterdir() if p.name.startswith(name + ".onnx"))
    cost = target_pass_costs(built, cache, facts, tmp, log)
    training = info.pop("report")
    sh = training["shape"]
    entry = EngineEntry(
        name=name, role="eagle", file=name + ".onnx", files=files, backend=backend or "onnxruntime",
        precision=precision, num_layers=1, num_heads=sh["heads"], num_kv_heads=sh["kv_heads"],
        head_dim=sh["head_dim"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
        max_context=facts["max_context"],
        eagle={**info, "head_file": head_path.name, "head_sha256": file_sha256(head_path),
               "target_source_sha256": facts["source"]["sha256"], "pass_seconds_by_width": cost,
               "training": {k: v for k, v in training.items() if k != "shape"}})
    return entry.with_memory(engine_memory(entry, tmp))
