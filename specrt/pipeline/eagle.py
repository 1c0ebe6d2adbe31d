"""The EAGLE engine of a set: a trained head (`specrt train-eagle`) written as an ONNX graph with its own KV cache
(export/eagle.py), from the target's own embedding and lm_head, with the target's measured pass costs for sizing
the dynamic tree at run time.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecrtError
from ..manifest import EngineEntry, engine_memory, file_sha256
from .tree_sizing import _plausible_pass_costs

TOPK = 8  # children per expanded node of the dynamic tree, and what a chain reads (its best)


def build_eagle(head_path: Path, cache: Path, facts: dict, tmp: Path, log,
                built: dict[str, EngineEntry]) -> EngineEntry:
    """Entry eagle-fp32 (role "eagle"): runs on ONNX Runtime's CPU provider beside any target backend."""
    from ..export.eagle import export_eagle_onnx, head_arrays
    from ..export.graph import read_initializers

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
    embed, lm_head_t = read_initializers(cache / "model.onnx", "embed_tokens.weight", "lm_head.weight_t")
    info = export_eagle_onnx(head_path, embed, lm_head_t.T, tmp / "eagle-fp32.onnx", facts["max_context"], TOPK)
    targets = sorted(name for name, e in built.items() if e.role == "target")
    target = built["target-fp32"] if "target-fp32" in built else built[targets[0]]
    cost = _plausible_pass_costs(tmp / target.file, facts, log, golden=cache / "golden.npz", entry=target)
    training = info.pop("report")
    sh = training["shape"]
    entry = EngineEntry(
        name="eagle-fp32", role="eagle", file="eagle-fp32.onnx", files=["eagle-fp32.onnx", "eagle-fp32.onnx.data"],
        backend="onnxruntime", precision="fp32", num_layers=1, num_heads=sh["heads"], num_kv_heads=sh["kv_heads"],
        head_dim=sh["head_dim"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
        max_context=facts["max_context"],
        eagle={**info, "head_file": head_path.name, "head_sha256": file_sha256(head_path),
               "target_source_sha256": facts["source"]["sha256"], "pass_seconds_by_width": cost,
               "training": {k: v for k, v in training.items() if k != "shape"}})
    return entry.with_memory(engine_memory(entry, tmp))
