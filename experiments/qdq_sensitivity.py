"""Which GEMMs, kept in float, buy back an FP8 engine's accuracy: the portable graph of an export over the build's
fp16 activation base (calibrated through the fp32 graph), FP8 Q/DQ inserted with one group of GEMMs (by kind, or
the first and last layers) left unquantized each time, each measured against fp32 as the build measures it
(teacher-forced top-1 and KL on held-out stdlib code). The last variant quantizes the weights alone, every
activation left float: the ceiling of any treatment of the activations; the "activations only" variant keeps every
weight float, the ceiling of any treatment of the weights (GPTQ's error compensation on the FP8 grid among them).
--clip-percentile clips the activations' calibrated ranges (int8 and fp8 alike).

    python -m experiments.qdq_sensitivity engines/.cache/export-<key>   # prints one JSON line per variant
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from specrt.interface import ACTIVATION_QDQ


def drop_activation_qdq(path: Path) -> None:
    """The Q/DQ graph at path with its activations' QuantizeLinear/DequantizeLinear pairs removed (weights stay
    quantized): each GEMM reads its float input again."""
    from specrt.onnx_files import load_with_weights, save_with_external_data

    model = load_with_weights(path)
    nodes = list(model.graph.node)
    quantized = {n.output[0]: n.input[0] for n in nodes if n.op_type == "QuantizeLinear"}  # weights have none
    pairs = {n.output[0]: quantized[n.input[0]] for n in nodes
             if n.op_type == "DequantizeLinear" and n.input[0] in quantized}
    kept = [n for n in nodes if n.op_type != "QuantizeLinear" and n.output[0] not in pairs]
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = pairs.get(name, name)
    used = {name for n in kept for name in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]  # the activations' scales go with their Q/DQ
    del model.graph.node[:]
    model.graph.node.extend(kept)
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    save_with_external_data(model, path)


def drop_weight_qdq(path: Path, fp32: Path) -> None:
    """The Q/DQ graph at path with its weights float again (those of the float graph it was made from at `fp32`,
    fp32 or the fp16 base, in its type, times the
    SmoothQuant migration where an activation has one; activations stay quantized): each weight's
    DequantizeLinear becomes that float weight."""
    from onnx import numpy_helper

    from specrt.onnx_files import load_with_weights, save_with_external_data

    model = load_with_weights(path)
    source = {t.name: t for t in load_with_weights(fp32).graph.initializer}
    inits = {t.name: t for t in model.graph.initializer}
    nodes = list(model.graph.node)
    weight_dq = {n.output[0]: n for n in nodes if n.op_type == "DequantizeLinear" and n.name.endswith(".w_dq")}
    act_of = {n.input[1]: n.input[0] for n in nodes if n.op_type == "MatMul" and n.input[1] in weight_dq}
    kept = [n for n in nodes if n.output[0] not in weight_dq]
    dropped = {i for n in weight_dq.values() for i in n.input}
    new = [t for t in model.graph.initializer if t.name not in dropped]
    for out, node in weight_dq.items():  # the DQ's output name (weight + ".dq") now names the float weight
        w = numpy_helper.to_array(source[node.input[0][:-len(".q")]])
        act = act_of[out].removesuffix(".dq")  # the GEMM reads its activation's DQ output, act + ".dq"
        if act + ".smooth" in inits:  # the Mul divides the activation by s: the weight's rows carry s
            w = w / numpy_helper.to_array(inits[act + ".smooth"])[:, None]
        new.append(numpy_helper.from_array(w.astype(numpy_helper.to_array(source[node.input[0][:-len(".q")]]).dtype),
                                           out))
    del model.graph.node[:]
    model.graph.node.extend(kept)
    del model.graph.initializer[:]
    model.graph.initializer.extend(new)
    save_with_external_data(model, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_cache", type=Path, help="an export's cache folder (engines/.cache/export-...), built "
                    "with `specrt engines --backend onnxruntime-portable`")
    ap.add_argument("--precision", default="fp8", choices=ACTIVATION_QDQ)
    ap.add_argument("--calibration-texts", type=int, default=32)
    ap.add_argument("--clip-percentile", type=float, default=100.0, metavar="P",
                    help="clip every activation's calibrated range at the P-th percentile of its tokens' max |x| "
                         "(4,096 sampled tokens; 100 = the max, as the build does)")
    ap.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                    help="SmoothQuant's migration strength (default: the build's for this precision and "
                         "--outlier-channels; fp8 has none)")
    ap.add_argument("--outlier-channels", type=int, default=0, metavar="N",
                    help="keep each activation's N input channels of largest amax in float (LLM.int8()'s split)")
    ap.add_argument("--variants", default="", metavar="PREFIX[,PREFIX...]",
                    help="run only the variants whose label starts with one of these (e.g. 'weights only,none')")
    args = ap.parse_args(argv)

    import onnx

    from specrt.build.gptq import calibration_texts as texts
    from specrt.build.quantize import GEMM_KINDS as KINDS
    from specrt.build.quantize import (calibrate, float_kind_gemms, gemm_layers, insert_qdq, lm_head_gemms,
                                       smoothquant_alpha)
    from specrt.pipeline.parity import prefill_feed
    from specrt.interface import QDQ_BASE
    from specrt.pipeline.portable import _portable_graph
    from specrt.pipeline.quality import _sequences, calibration_for, measure_quality
    from specrt.pipeline.runtime_link import provisional_entry

    cache = args.export_cache
    facts = json.loads((cache / "export.json").read_text())
    from specrt.export.portable import FORMAT

    fp32 = cache / f"portable-v{FORMAT}" / "target-fp32.onnx"  # the graph today's build quantizes, not an older one
    if not fp32.exists():
        raise SystemExit(f"error: no portable fp32 graph under {cache}; build it with "
                         "`specrt engines --backend onnxruntime-portable`")
    base = _portable_graph("target", QDQ_BASE, cache, facts, print, fp32.parent)  # the build's activation base
    model = onnx.load(str(base), load_external_data=False)
    layer = gemm_layers(model)
    layers = list(layer)
    last = max(layer.values())
    entry = provisional_entry(fp32, facts, backend="onnxruntime-portable")
    seqs = _sequences([t for _, t in texts(args.calibration_texts)], cache, facts)
    clip = args.clip_percentile < 100
    calib = calibrate(fp32, (prefill_feed(entry, s, 512) for s in seqs), sample_rows=4096 if clip else 0)
    calib = calibration_for(base, fp32, calib)
    if clip:
        for st in calib.values():
            st["amax"] = np.minimum(st["amax"], np.percentile(np.abs(st["rows"]).max(axis=1), args.clip_percentile))
    variants = {"none kept": []} | {f"{k} kept": list(float_kind_gemms(model, (k,))) for k in KINDS}
    variants[f"layers 0, 1, {last - 1}, {last} kept"] = [n for n in layers if layer[n] in (0, 1, last - 1, last)]
    variants["weights only (every activation float)"] = []
    variants["activations only (every weight float)"] = []
    labels = list(variants)
    if args.variants:
        wanted = tuple(v.strip() for v in args.variants.split(","))
        variants = {k: v for k, v in variants.items() if k.startswith(wanted)}
        if not variants:
            raise SystemExit(f"error: no variant starts with {args.variants!r}; the labels: {', '.join(labels)}")
    if args.outlier_channels and any(k.startswith("activations only") for k in variants):
        raise SystemExit("error: the activations-only variant reads whole weights; with --outlier-channels, pick "
                         "other --variants")
    smooth = args.smoothquant if args.smoothquant is not None else smoothquant_alpha(args.precision,
                                                                                     args.outlier_channels)
    with tempfile.TemporaryDirectory() as tmp:
        for label, keep in variants.items():
            t = time.time()
            out = Path(tmp) / "variant.onnx"
            insert_qdq(base, out, args.precision, calib, keep=(*keep, *lm_head_gemms(model)),
                       smooth=smooth, outliers=args.outlier_channels)
            if label.startswith("weights only"):
                drop_activation_qdq(out)
            elif label.startswith("activations only"):
                drop_weight_qdq(out, base)
            q = measure_quality(out, fp32, facts, "onnxruntime-portable", args.precision, cache)
            print(json.dumps({"variant": label, "gemms_kept": len(keep) + 1, "of": len(layers) + 1,
                              "top1": q["top1"], "kl": q["kl"], "seconds": round(time.time() - t)}), flush=True)


if __name__ == "__main__":
    main()
