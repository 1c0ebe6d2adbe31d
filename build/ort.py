"""ONNX Runtime backend: standard decoder ONNX -> CPU engine (fp32 | int8 | int4).

Two rewrites, both ORT-specific and therefore here, not in export/:
1. each `specrt.CachedAttention` function call becomes com.microsoft.GroupQueryAttention with the
   same inputs (the function was written to that signature), so past/present share one buffer and
   attention cost follows total_sequence_length, not max_context;
2. weight quantization with onnxruntime.quantization's MatMulNBits quantizer (int4, or int8 blocks).
Graph fusions (SimplifiedLayerNormalization, ...) are applied offline at the EXTENDED level, which
is portable across CPUs; then each residual Add feeding a norm becomes SkipSimplifiedLayerNormalization
(ORT's own fusion skips it: our graph carries no shape info), and that graph is what the engine ships.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

from ..errors import SpecrtError
from ..onnx_files import save_with_external_data

PRECISIONS = ("fp32", "int8", "int4", "int4-fp32")


@dataclass(frozen=True)
class OrtPrecision:
    name: str
    bits: int | None  # weight bits; None = fp32
    accuracy_level: int  # MatMulNBits compute type: 0 = fp32 (width-exact), 4 = int8 activations
    # ORT session config entries the runtime applies to this engine (recorded in the manifest).
    session_config: tuple[tuple[str, str], ...] = ()
    block_size: int = 32  # weights per quantization block (scale + zero point)
    method: str = "rtn"  # "rtn": round to nearest; "gptq": calibrated (build/gptq.py)
    screen: bool = False  # an 8-bit lm_head beside the fp32 one for exact greedy argmax (build/screen.py)


# Weight-only asymmetric blocks through MatMulNBits, the lm_head included (a large share of a small model's
# weights). int8 and int4 use int8 compute, the fast kernels, which are not width-exact; int4-fp32 keeps fp32
# compute, slower but width-exact, so speculative output equals that engine's own plain output
# (docs/design-notes.md, "Quantized compute types").
# int4 is GPTQ in blocks of 64: closer to fp32 than round-to-nearest in blocks of 32, and faster than blocks
# of 32, with fewer scales to apply in the int8 kernel (docs/design-notes.md, "GPTQ block size").
ORT_PRECISIONS = {
    # Smaller work blocks in the intra-op thread pool: faster fp32 decode steps, no gain on int4, so not there
    # (docs/design-notes.md, "fp32 thread-pool block base").
    # The logit screen: greedy passes read the lm_head in 8 bits and rescore the few tokens that can win in fp32.
    "fp32": OrtPrecision("fp32", None, 0, (("session.dynamic_block_base", "4"),), screen=True),
    "int8": OrtPrecision("int8", 8, 4),
    "int4": OrtPrecision("int4", 4, 4, block_size=64, method="gptq"),
    "int4-fp32": OrtPrecision("int4-fp32", 4, 0, block_size=64, method="gptq"),
}


BUILD_FORMAT = 7  # bump when the rewrites below change what an engine contains


def build_key(prec: OrtPrecision) -> str:
    """Short hash of everything that decides a built engine, for caching."""
    import hashlib

    from .gptq import recipe_key

    calibration = recipe_key() if prec.method == "gptq" else ()
    tools = build_versions()  # ORT's optimizer and quantizers write the saved graph: an upgrade rebuilds
    recipe = f"{BUILD_FORMAT}:{prec!r}:{calibration}:{tools}"
    if prec.screen:
        from .screen import BLOCK, FORMAT

        recipe += f":screen-{BLOCK}-{FORMAT}"
    return hashlib.sha256(recipe.encode()).hexdigest()[:10]


def build_versions() -> dict:
    """The tools that shape a built engine (recorded per engine in the manifest, part of build_key)."""
    from ..manifest import tool_versions

    return tool_versions(("onnx", "onnxruntime"))


def precision(name: str) -> OrtPrecision:
    if name not in ORT_PRECISIONS:
        raise ValueError(f"unknown precision '{name}'; choose one of: {', '.join(PRECISIONS)}")
    return ORT_PRECISIONS[name]


def fuse_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace specrt.CachedAttention calls by GroupQueryAttention; drops the function body."""
    props = {p.key: p.value for p in model.metadata_props}
    heads, kv_heads = int(props["specrt.num_heads"]), int(props["specrt.num_kv_heads"])
    head_dim = int(props["specrt.head_dim"])
    scale = float(props.get("specrt.attention_scale", head_dim ** -0.5))  # the family's (export/families.py)
    if head_dim % 16:
        raise SpecrtError(f"head_dim {head_dim} is not a multiple of 16, which ONNX Runtime's fused rotary "
                          "attention requires; this model cannot be built for onnxruntime")
    rotary = next((i.dims[1] for i in model.graph.initializer if i.name == "rope.cos"), head_dim // 2)
    if rotary % 8:
        raise SpecrtError(f"this model turns {2 * rotary} of its {head_dim} head dimensions by RoPE (partial rotary), "
                          "and ONNX Runtime's fused rotary attention turns multiples of 16; build it with --backend "
                          "onnxruntime-portable instead")
    for node in model.graph.node:
        if node.domain == "specrt" and node.op_type == "CachedAttention":
            qkv, pk, pv, seqlens, total, cos, sin, pos, bias = node.input
            del node.input[:]
            # GQA: query holds packed QKV (key/value empty); RoPE at explicit position_ids (trees).
            node.input.extend([qkv, "", "", pk, pv, seqlens, total, cos, sin, pos, bias])
            node.domain, node.op_type = "com.microsoft", "GroupQueryAttention"
            node.attribute.extend([helper.make_attribute("num_heads", heads),
                                   helper.make_attribute("kv_num_heads", kv_heads),
                                   helper.make_attribute("do_rotary", 1),
                                   helper.make_attribute("scale", scale)])
    del model.functions[:]
    kept = [o for o in model.opset_import if o.domain not in ("specrt", "com.microsoft")]
    del model.opset_import[:]
    model.opset_import.extend(kept + [helper.make_opsetid("com.microsoft", 1)])
    return model


def fuse_skip_norm(model: onnx.ModelProto) -> onnx.ModelProto:
    """Residual Add + SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization (one kernel, one
    pass over the hidden state; the Add's sum stays available as its fourth output), identical tokens
    (docs/design-notes.md, "Skip-norm fusion")."""
    from onnxruntime.transformers.fusion_skiplayernorm import FusionSkipLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    for name in ("fusion_base", "onnx_model", "onnxruntime.transformers"):  # its modules log under bare names
        logging.getLogger(name).setLevel(logging.WARNING)
    wrapped = OnnxModel(model)
    # shape_infer=False: every residual Add here joins two [batch, seq, hidden] tensors, no broadcast.
    FusionSkipLayerNormalization(wrapped, "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                                 shape_infer=False).apply()
    wrapped.topological_sort()
    return wrapped.model


def quantize(model: onnx.ModelProto, prec: OrtPrecision, hessians: dict | None = None) -> onnx.ModelProto:
    """Weight-only quantization of every constant MatMul. With `hessians` (weight name -> X^T X), those
    weights are GPTQ'd in blocks of prec.block_size first; the others get round-to-nearest in blocks of 32."""
    if prec.bits is None:
        return model
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from .gptq import gptq

    for name in ("onnxruntime.quantization", "onnxruntime.quantization.matmul_nbits_quantizer"):
        logging.getLogger(name).setLevel(logging.WARNING)
    done = []
    if hessians:
        inits = {i.name: i for i in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "MatMul" and node.input[1] in hessians:
                tensor = inits[node.input[1]]
                tensor.CopyFrom(numpy_helper.from_array(
                    gptq(numpy_helper.to_array(tensor), hessians[node.input[1]], prec.block_size), tensor.name))
                done.append(node.name)
    others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in done]
    # GPTQ'd weights in their blocks first; then the rest, in blocks of 32 if GPTQ was meant for them too.
    passes = [(prec.block_size, others), (32, [])] if hessians is not None else [(prec.block_size, [])]
    for block, exclude in passes:
        quantizer = MatMulNBitsQuantizer(model, bits=prec.bits, block_size=block, is_symmetric=False,
                                         accuracy_level=prec.accuracy_level or None, nodes_to_exclude=exclude)
        quantizer.process()
        model = quantizer.model.model
    blocks = [a.i for n in model.graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "block_size"]
    if blocks.count(prec.block_size) < len(done):  # passes select by node name: names must be unique
        raise RuntimeError(f"{len(done)} GPTQ weights but {blocks.count(prec.block_size)} MatMulNBits in blocks "
                           f"of {prec.block_size}; the graph's node names are not unique")
    return model


def build_ort_engine(src_onnx: Path, dst_onnx: Path, prec: OrtPrecision,
                     calibration: list[list[int]] | None = None) -> dict:
    """Write an optimized ORT engine at dst_onnx (+ .data beside it). Returns facts for the manifest.

    A "gptq" precision needs `calibration`: token id sequences the fp32 graph is run on once each."""
    quantized = prec.bits is not None
    facts: dict = {}
    hessians = None
    if prec.method == "gptq":
        from .gptq import MAX_K, hessians as collect

        if not calibration:
            raise ValueError(f"precision {prec.name} is calibrated (GPTQ): pass calibration token sequences")
        hessians, tokens = collect(fuse_attention(onnx.load(str(src_onnx), load_external_data=False)),
                                   src_onnx.parent, calibration)
        facts["quantization"] = {"method": "gptq", "block_size": prec.block_size, "gptq_weights": len(hessians),
                                 "calibration_sequences": len(calibration), "calibration_tokens": tokens,
                                 "others": f"round to nearest, blocks of 32 (inputs wider than {MAX_K})"}
    elif quantized:
        facts["quantization"] = {"method": "rtn", "block_size": prec.block_size}
    # fp32 rewrites only the graph here: the weights stay where export wrote them (no 2x copy in memory).
    model = quantize(fuse_attention(onnx.load(str(src_onnx), load_external_data=quantized)), prec, hessians)
    del hessians
    import onnxruntime as ort

    # quantized: beside the engine; fp32: beside the source, so its external-data references resolve
    tmp = dst_onnx.with_suffix(".raw.onnx") if quantized else src_onnx.parent / f".raw-{os.getpid()}-{dst_onnx.name}"
    opt = dst_onnx.with_name(dst_onnx.stem + ".opt.onnx")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(opt)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", opt.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:  # every intermediate file goes in the finally below, also when a save fails (a full disk)
        if quantized:
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=tmp.name + ".data", size_threshold=1024)
        else:
            onnx.save_model(model, str(tmp))
        del model
        ort.InferenceSession(str(tmp), so, providers=["CPUExecutionProvider"])
        optimized = fuse_skip_norm(onnx.load(str(opt)))
        if prec.screen:
            from .screen import add_screen

            screen = add_screen(optimized)  # rewrites the lm_head in place (None: hidden size not in blocks)
            if screen is not None:
                facts["screen"] = screen
        # Weights re-written by onnx rather than kept as ORT saved them: decoding from ORT's own file is
        # slower, for a reason not pinned down (docs/design-notes.md, "Engine weights saved by onnx").
        save_with_external_data(optimized, dst_onnx, all_tensors_to_one_file=True)
    finally:
        for leftover in (tmp, opt, Path(str(opt) + ".data")) + ((Path(str(tmp) + ".data"),) if quantized else ()):
            if os.path.exists(leftover):
                os.remove(leftover)
    ops: dict[str, int] = {}
    for node in optimized.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return {"op_counts": dict(sorted(ops.items())), "session_config": dict(prec.session_config), **facts}
