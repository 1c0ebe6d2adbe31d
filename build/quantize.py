"""FP8 and INT8 engines of the portable graph: explicit QuantizeLinear/DequantizeLinear around every GEMM, the
form TensorRT's strongly typed networks take precision from and ONNX Runtime's CPU provider executes as written
(session.disable_quant_qdq=1 keeps it fake-quant instead of fusing into integer kernels), so the accuracy measured
here is the accuracy of the graph TensorRT compiles.

    weights      per output channel, symmetric (zero point 0): W ~ DQ(Wq, s_w[n], axis=1)
    activations  per tensor, symmetric, scale = calibrated amax / (448 for E4M3, 127 for int8): X ~ DQ(Q(X, s_a))
    where        the MatMuls with a constant weight (QKV, O, gate|up, down, and the lm_head unless kept in fp32);
                 attention, the mask, softmax, RoPE and the norms stay in the graph's float type
    int8 only    SmoothQuant: each activation channel divided by s_j (a Mul before its Q), the weight row multiplied

Our own insertion rather than onnxruntime.quantization's quantize_static: its float8 path accepts only the
Distribution calibrator, whose scale is not the amax and which stacks every calibration tensor, so it fails on
the protocol's passes of different widths; and int8 uses the same code so the two differ only in the type.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FORMAT = 2  # bump when the Q/DQ recipe changes: cached quantized graphs are keyed on it
PRECISIONS = {"fp8": ("float8_e4m3fn", 448.0), "int8": ("int8", 127.0)}
# int8's SmoothQuant alpha: per-tensor int8 activations alone lose half the top-1 tokens on SmolLM2, whose
# down_proj inputs reach ~500x the median GEMM input (docs/design-notes.md, "INT8 outlier activations")
SMOOTHQUANT_ALPHA = 0.8


def gemm_weights(model) -> dict[str, tuple[str, str]]:
    """MatMul node name -> (activation input, constant weight) for every MatMul over a 2-D initializer."""
    inits = {t.name: t for t in model.graph.initializer}
    return {n.name: (n.input[0], n.input[1]) for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2}


def calibrate_amax(onnx_path: Path, feeds) -> dict[str, np.ndarray]:
    """max |x| per input channel [K] of every GEMM's activation input over the calibration passes (the fp32
    portable graph, run with those tensors as extra outputs; the copy is written beside onnx_path, to find its
    weights, then removed)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path), load_external_data=False)
    acts = sorted({a for a, _ in gemm_weights(model).values()})
    known = {o.name for o in model.graph.output}
    for a in acts:
        if a not in known:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(a))
    probe = Path(onnx_path).with_name(f".calibrate-{Path(onnx_path).name}")
    onnx.save_model(model, str(probe))
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3  # past and present are separate arrays here: TensorScatter's copy warning is moot
        session = ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"])
        amax: dict[str, np.ndarray] = {}
        for feed in feeds:
            for name, value in zip(acts, session.run(acts, feed)):
                channels = np.abs(value).reshape(-1, value.shape[-1]).max(axis=0)
                amax[name] = np.maximum(amax[name], channels) if name in amax else channels
    finally:
        probe.unlink(missing_ok=True)
    return amax


def insert_qdq(onnx_path: Path, out: Path, precision: str, amax: dict[str, np.ndarray], keep: tuple[str, ...] = (),
               smooth: float | None = None) -> dict:
    """Write the Q/DQ graph of the fp32 portable graph at onnx_path to out (+ out.data). amax: calibrate_amax's.
    keep: MatMul names left unquantized (e.g. the lm_head). smooth: SmoothQuant's alpha (int8): each input channel
    j of an activation is divided by s_j = amax_x[j]^alpha / amax_w[j]^(1 - alpha) (a Mul before its Q/DQ) and
    the weight's row j multiplied by it, moving the outliers' range into the weights, which are quantized per
    output channel. -> facts: the GEMMs quantized, those kept, the activations left float."""
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ..interface import LOGITS
    from ..onnx_files import load_with_weights

    qtype, qmax = PRECISIONS[precision]
    np_q = np.dtype(getattr(ml_dtypes, qtype)) if qtype != "int8" else np.dtype(np.int8)
    onnx_q = TensorProto.FLOAT8E4M3FN if precision == "fp8" else TensorProto.INT8
    model = load_with_weights(onnx_path)  # weights in memory: they are rewritten
    inits = {t.name: t for t in model.graph.initializer}
    gemms = gemm_weights(model)
    done, new_inits, scales = [], [], {}
    nodes = []
    migrate = {}  # activation -> s [K]
    if smooth is not None:
        rows: dict[str, np.ndarray] = {}
        for name, (act, weight) in gemms.items():
            if name not in keep:
                w_rows = np.abs(numpy_helper.to_array(inits[weight])).max(axis=1)
                rows[act] = np.maximum(rows[act], w_rows) if act in rows else w_rows
        for act, w_rows in rows.items():
            migrate[act] = (np.maximum(amax[act], 1e-5) ** smooth / np.maximum(w_rows, 1e-5) ** (1 - smooth)
                            ).astype(np.float32)
    tensor_amax = {a: float((amax[a] / migrate[a]).max() if a in migrate else amax[a].max()) for a in amax}
    for node in model.graph.node:
        if node.name not in gemms or node.name in keep:
            nodes.append(node)
            continue
        act, weight = gemms[node.name]
        w = numpy_helper.to_array(inits.pop(weight)).astype(np.float32)
        if act in migrate:
            w = w * migrate[act][:, None]
        s_w = np.maximum(np.abs(w).max(axis=0), 1e-12) / qmax                   # [N], per output channel
        q = w / s_w
        wq = np.clip(np.rint(q), -qmax, qmax).astype(np_q) if precision == "int8" else \
            np.clip(q, -qmax, qmax).astype(np_q)                                 # E4M3 rounds to nearest
        new_inits += [numpy_helper.from_array(wq, weight + ".q"), numpy_helper.from_array(s_w.astype(np.float32),
                                                                                            weight + ".scale")]
        w_dq = weight + ".dq"
        nodes.append(helper.make_node("DequantizeLinear", [weight + ".q", weight + ".scale"], [w_dq], axis=1,
                                      name=f"{node.name}.w_dq"))
        if act not in scales:  # one Q/DQ pair per activation, shared by the GEMMs that read it
            scales[act] = act.replace("/", "_") + ".a_scale"
            new_inits.append(numpy_helper.from_array(np.array(max(tensor_amax[act], 1e-12) / qmax, np.float32),
                                                     scales[act]))
            source = act
            if act in migrate:
                new_inits.append(numpy_helper.from_array(1.0 / migrate[act], act + ".smooth"))
                nodes.append(helper.make_node("Mul", [act, act + ".smooth"], [act + ".s"], name=f"{act}.smooth"))
                source = act + ".s"
            nodes.append(helper.make_node("QuantizeLinear", [source, scales[act]], [act + ".q"], output_dtype=onnx_q,
                                          name=f"{act}.q"))
            nodes.append(helper.make_node("DequantizeLinear", [act + ".q", scales[act]], [act + ".dq"],
                                          name=f"{act}.dq"))
        nodes.append(helper.make_node("MatMul", [act + ".dq", w_dq], list(node.output), name=node.name))
        done.append(node.name)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    kept_inits = [t for t in model.graph.initializer if t.name in inits]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept_inits + new_inits)
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, "specrt.precision": precision})
    onnx.save_model(model, str(out), save_as_external_data=True, location=Path(out).name + ".data",
                    size_threshold=1024)
    kept = [n for n in gemms if n not in done]
    return {"method": f"Q/DQ {precision}: weights per output channel, activations per tensor (amax), symmetric",
            "gemms_quantized": len(done), "gemms_kept": kept, "lm_head_kept": any(LOGITS in n for n in kept),
            "smoothquant_alpha": smooth}
