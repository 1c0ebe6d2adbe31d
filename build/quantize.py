"""FP8, INT8 and INT4-AWQ engines of the portable graph: explicit QuantizeLinear/DequantizeLinear around every
GEMM, the form TensorRT's strongly typed networks take precision from and ONNX Runtime's CPU provider executes as
written (session.disable_quant_qdq=1 keeps it fake-quant instead of fusing into integer kernels), so the accuracy
measured here is the accuracy of the graph TensorRT compiles.

More: docs/design-notes.md, "Module notes: build/quantize.py".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .int4 import AWQ_ROWS, awq_scale, fit_scale, int4_block, quantize_int4

FORMAT = 4  # bump when the Q/DQ recipe changes: cached quantized graphs are keyed on it
PRECISIONS = {"fp8": ("float8_e4m3fn", 448.0), "int8": ("int8", 127.0), "int4-awq": ("int4", 7.0)}
WEIGHT_ONLY = ("int4-awq",)
# int8's SmoothQuant alpha: a few down_proj input channels set a per-tensor int8 scale otherwise; with the outlier
# channels in float, less migration pays (docs/design-notes.md, "INT8 outlier activations")
SMOOTHQUANT_ALPHA = 0.8
SMOOTHQUANT_ALPHA_SPLIT = 0.5
# input channels per activation kept in float by default (LLM.int8()'s split; BENCHMARKS.md, "What do FP8, INT8
# and INT4-AWQ cost in accuracy?"): int8's per-tensor scale is otherwise set by a few channels hundreds of times
# the rest
DEFAULT_OUTLIERS = {"int8": 16}


def smoothquant_alpha(precision: str, outliers: int) -> float | None:
    """The SmoothQuant migration a target at `precision` is built with (int8 only; less with the outlier split)."""
    if precision != "int8":
        return None
    return SMOOTHQUANT_ALPHA_SPLIT if outliers else SMOOTHQUANT_ALPHA


def outliers_for(precision: str, asked: int | None) -> int:
    """The outlier channels a target at `precision` keeps in float: what was asked (None: the precision's
    default); none for a precision whose activations are float anyway (int4-awq)."""
    from ..interface import ACTIVATION_QDQ

    if precision not in ACTIVATION_QDQ:
        return 0
    return DEFAULT_OUTLIERS.get(precision, 0) if asked is None else asked


def gemm_weights(model) -> dict[str, tuple[str, str]]:
    """MatMul node name -> (activation input, constant weight) for every MatMul over a 2-D initializer."""
    inits = {t.name: t for t in model.graph.initializer}
    return {n.name: (n.input[0], n.input[1]) for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2}


def lm_head_gemms(model) -> tuple[str, ...]:
    """The lm_head's GEMM (by its weight: the fp16 graph leaves the node unnamed; or named for the logits)."""
    from ..interface import LOGITS

    return tuple(n for n, (_, w) in gemm_weights(model).items() if w == LM_HEAD_WEIGHT or LOGITS in n)


LM_HEAD_WEIGHT = "lm_head.weight_t"  # the portable graph's lm_head initializer (export/portable.py)


def gemm_layers(model) -> dict[str, int]:
    """Constant-weight GEMM name -> its decoder layer: the portable graph names each layer's fused QKV
    `layers.<i>.qkv` and writes the layer's other GEMMs after it; the lm_head (after the last layer) is left out."""
    out, layer, head = {}, None, lm_head_gemms(model)
    for name in gemm_weights(model):
        if name.startswith("layers.") and name.endswith(".qkv"):
            layer = int(name.split(".")[1])
        if layer is not None and name not in head:
            out[name] = layer
    return out


GEMM_KINDS = ("qkv", "o", "gateup", "down")  # a decoder layer's GEMMs in the portable graph, in order


def check_float_gemms(kinds: tuple[str, ...]) -> None:
    """--float-gemms' kinds, checked before any work (one line)."""
    from ..errors import SpecrtError

    bad = [k for k in kinds if k not in GEMM_KINDS]
    if bad:
        raise SpecrtError(f"--float-gemms: unknown GEMM kind '{bad[0]}'; use some of {', '.join(GEMM_KINDS)}")
    if kinds and set(kinds) == set(GEMM_KINDS):
        raise SpecrtError("--float-gemms names every GEMM kind, which keeps the whole model in float; build fp16 "
                          "instead")


def float_kind_gemms(model, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """Every layer's GEMMs of the given kinds (mixed precision: kept in float), e.g. ("down",): the down_proj
    GEMMs, whose inputs hold the outlier activations INT8 loses most on (BENCHMARKS.md, "What do FP8, INT8 and
    INT4-AWQ cost in accuracy?")."""
    check_float_gemms(kinds)
    layers = gemm_layers(model)
    seen: dict[int, int] = {}
    out = []
    for g, i in layers.items():  # each layer's GEMMs come in GEMM_KINDS' order
        j = seen.get(i, 0)
        seen[i] = j + 1
        if j < len(GEMM_KINDS) and GEMM_KINDS[j] in kinds:
            out.append(g)
    return tuple(out)


def float_layer_gemms(model, n: int) -> tuple[str, ...]:
    """The GEMMs of the first n and last n decoder layers (mixed precision: kept in float)."""
    from ..errors import SpecrtError

    layers = gemm_layers(model)
    count = max(layers.values(), default=-1) + 1
    if n and 2 * n >= count:
        raise SpecrtError(f"--float-layers {n} keeps all {count} layers in float; use at most {(count - 1) // 2}")
    return tuple(g for g, i in layers.items() if i < n or i >= count - n)


def calibrate(onnx_path: Path, feeds, sample_rows: int = 0, seed: int = 0) -> dict[str, dict]:
    """Statistics of every GEMM's activation input over the calibration passes (the fp32 portable graph, run with
    those tensors as extra outputs; the copy is written beside onnx_path, to find its weights, then removed):
    activation -> {"amax": max |x| per input channel [K], "mean_abs": mean |x| per channel [K], "rows": a uniform
    sample of at most sample_rows positions [R, K], the same positions for every activation of a pass's shape
    (AWQ's search reads them)}. seed: the samples'."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path), load_external_data=False)
    acts = sorted({a for a, _ in gemm_weights(model).values()})
    inputs = {i.name for i in model.graph.input}  # a GEMM over a graph input (the heads' hidden) reads the feed
    known = {o.name for o in model.graph.output} | inputs
    for a in acts:
        if a not in known:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(a))
    probe = Path(onnx_path).with_name(f".calibrate-{Path(onnx_path).name}")
    onnx.save_model(model, str(probe))
    fetched = [a for a in acts if a not in inputs]
    rng = np.random.default_rng(seed)
    stats: dict[str, dict] = {}
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3  # past and present are separate arrays here: TensorScatter's copy warning is moot
        session = ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"])
        for feed in feeds:
            keys: dict[int, np.ndarray] = {}  # by row count: activations of a pass share their sample's positions
            values = dict(zip(fetched, session.run(fetched, feed))) | {a: feed[a] for a in acts if a in inputs}
            for name in acts:
                value = values[name]
                x = value.reshape(-1, value.shape[-1]).astype(np.float32)
                st = stats.setdefault(name, {"amax": np.zeros(x.shape[1], np.float32),
                                             "abs_sum": np.zeros(x.shape[1], np.float64), "count": 0,
                                             "rows": np.zeros((0, x.shape[1]), np.float32),
                                             "keys": np.zeros(0)})
                ax = np.abs(x)
                st["amax"] = np.maximum(st["amax"], ax.max(axis=0))
                st["abs_sum"] += ax.sum(axis=0)
                st["count"] += len(x)
                if sample_rows:  # a reservoir by random priority (one draw per activation; the first's is kept)
                    k = keys.setdefault(len(x), rng.random(len(x)))
                    allk, allx = np.concatenate([st["keys"], k]), np.concatenate([st["rows"], x])
                    top = np.argsort(allk)[:sample_rows]
                    st["keys"], st["rows"] = allk[top], allx[top]
    finally:
        probe.unlink(missing_ok=True)
    return {a: {"amax": st["amax"], "mean_abs": (st["abs_sum"] / max(st["count"], 1)).astype(np.float32),
                "rows": st["rows"]} for a, st in stats.items()}


def insert_qdq(onnx_path: Path, out: Path, precision: str, calib: dict[str, dict], keep: tuple[str, ...] = (),
               smooth: float | None = None, outliers: int = 0, log=lambda m: None) -> dict:
    """Write the Q/DQ graph of the portable graph at onnx_path (fp32 or fp16: the activation base, whose float type
    every scale, smoothing factor and float weight takes) to out (+ out.data). calib: calibrate's statistics by
    activation name (int4-awq needs its rows). keep: MatMul names left unquantized (e.g. the lm_head). smooth:
    SmoothQuant's alpha (int8): each input channel j of an activation is divided by s_j = amax_x[j]^alpha /
    amax_w[j]^(1 - alpha) (a Mul before its Q/DQ) and the weight's row j multiplied by it, moving the outliers'
    range into the weights, which are quantized per output channel. int4-awq searches that s per activation
    (awq_scale). outliers (fp8/int8): per activation, the input channels with the largest calibrated amax (after
    migration) stay float, LLM.int8()'s decomposition: X W = Q/DQ(X[:, rest]) DQ(W[rest]) + X[:, top] W[top], two
    Gathers along the channels, a float GEMM of `outliers` rows and an Add, so the activation's scale is set by the
    rest. -> facts: the GEMMs quantized, those kept, the activations left float."""
    from onnx import helper, numpy_helper

    from ..onnx_files import load_with_weights

    if outliers and precision in WEIGHT_ONLY:
        raise ValueError("outlier channels are for fp8 and int8 (int4-awq leaves its activations float)")
    model = load_with_weights(onnx_path)  # weights in memory: they are rewritten
    inits = {t.name: t for t in model.graph.initializer}
    gemms, head = gemm_weights(model), lm_head_gemms(model)
    fdt = np.dtype(helper.tensor_dtype_to_np_dtype(inits[next(iter(gemms.values()))[1]].data_type))
    readers: dict[str, list[str]] = {}  # activation -> the weights of the GEMMs quantized over it
    for name, (act, weight) in gemms.items():
        if name not in keep:
            readers.setdefault(act, []).append(weight)
    migrate, awq = _migrations(precision, readers, inits, calib, smooth, fdt, log)
    qdq = _QdqGraph(precision, fdt, calib, migrate, _outlier_split(readers, calib, migrate, outliers))
    for node in model.graph.node:
        if node.name not in gemms or node.name in keep:
            qdq.nodes.append(node)
        else:
            act, weight = gemms[node.name]
            qdq.gemm(node, act, weight, numpy_helper.to_array(inits.pop(weight)).astype(np.float32))
    _write_qdq(model, qdq, inits, precision, out)
    return _qdq_facts(qdq, gemms, head, precision, smooth, outliers, awq)


def _migrations(precision: str, readers: dict, inits: dict, calib: dict, smooth: float | None, fdt,
                log) -> tuple[dict, dict]:
    """Per activation, the factors s [K] its channels are divided by (SmoothQuant's, or AWQ's search), rounded to
    what the graph's float type holds; and AWQ's facts per activation."""
    from onnx import numpy_helper

    migrate, awq = {}, {}  # activation -> s [K]; activation -> its AWQ search's facts
    if smooth is not None:
        for act, weights in readers.items():
            w_rows = np.max([np.abs(numpy_helper.to_array(inits[w])).max(axis=1) for w in weights], axis=0)
            migrate[act] = (np.maximum(calib[act]["amax"], 1e-5) ** smooth / np.maximum(w_rows.astype(np.float32),
                                                                                       1e-5) ** (1 - smooth))
    if precision == "int4-awq":
        for i, (act, weights) in enumerate(readers.items()):
            w = np.concatenate([numpy_helper.to_array(inits[n]).astype(np.float32) for n in weights], axis=1)
            scale, awq[act] = awq_scale(calib[act]["rows"], calib[act]["mean_abs"], w, int4_block(len(w)))
            if awq[act]["alpha"] is not None:  # else plain rounding measured best: no Mul
                migrate[act] = scale
            if (i + 1) % max(1, len(readers) // 10) == 0:
                log(f"AWQ scale search: {i + 1}/{len(readers)} activations")
    for act, m in migrate.items():  # the graph divides by 1/s in its float type: the weights take exactly that s
        migrate[act] = 1.0 / fit_scale(1.0 / m, fdt).astype(np.float32)
    return migrate, awq


def _outlier_split(readers: dict, calib: dict, migrate: dict, outliers: int) -> dict:
    """activation -> (its `outliers` input channels of largest amax after migration, the rest), both sorted."""
    split = {}
    for act in readers if outliers else ():
        amax = calib[act]["amax"] / migrate[act] if act in migrate else calib[act]["amax"]
        if outliers < len(amax):
            top = np.sort(np.argsort(amax, kind="stable")[-outliers:])
            split[act] = (top, np.setdiff1d(np.arange(len(amax)), top))
    return split


class _QdqGraph:
    """The rewritten nodes and new initializers, a GEMM at a time (insert_qdq)."""

    def __init__(self, precision: str, fdt, calib: dict, migrate: dict, split: dict):
        import ml_dtypes
        from onnx import TensorProto

        self.precision, self.fdt, self.calib, self.migrate, self.split = precision, fdt, calib, migrate, split
        qtype, self.qmax = PRECISIONS[precision]
        self.weight_only = precision in WEIGHT_ONLY
        self.np_q = np.dtype(getattr(ml_dtypes, qtype)) if qtype != "int8" else np.dtype(np.int8)
        self.onnx_q = TensorProto.FLOAT8E4M3FN if precision == "fp8" else TensorProto.INT8
        self.done, self.new_inits, self.nodes, self.sources, self.blocks = [], [], [], {}, set()

    def gemm(self, node, act: str, weight: str, w: np.ndarray) -> None:
        """The GEMM over its dequantized weight and its activation's source (Q/DQ'd, migrated, split)."""
        from onnx import helper

        w_dq = self._weight(node.name, act, weight, w)
        if act not in self.sources:  # one migration Mul (and one Q/DQ pair) per activation, shared by its GEMMs
            self.sources[act] = self._activation(act)
        source = self.sources[act]
        if act in self.split:
            self.nodes += [helper.make_node("MatMul", [source, w_dq], [node.name + ".rest_out"], name=node.name),
                           helper.make_node("MatMul", [act + ".top", weight + ".top"], [node.name + ".top_out"],
                                            name=node.name + ".top"),
                           helper.make_node("Add", [node.name + ".rest_out", node.name + ".top_out"],
                                            list(node.output), name=node.name + ".add")]
        else:
            self.nodes.append(helper.make_node("MatMul", [source, w_dq], list(node.output), name=node.name))
        self.done.append(node.name)

    def _weight(self, name: str, act: str, weight: str, w: np.ndarray) -> str:
        """The weight quantized (its outlier rows kept float, its rows migrated) and its DequantizeLinear."""
        from onnx import helper, numpy_helper

        if act in self.split:  # the outlier rows stay float, unmigrated; the rest go on as the whole would
            top, rest = self.split[act]
            self.new_inits.append(numpy_helper.from_array(w[top].astype(self.fdt), weight + ".top"))
            w = w[rest]
        if act in self.migrate:
            w = w * (self.migrate[act][self.split[act][1]] if act in self.split else self.migrate[act])[:, None]
        if self.weight_only:
            block = int4_block(len(w))
            self.blocks.add(block)
            q, s_w = quantize_int4(w, block, self.fdt)
            dq = dict(axis=0, block_size=block)
        else:
            s_w = fit_scale(np.abs(w).max(axis=0) / self.qmax, self.fdt)  # [N], per output channel
            q = w / s_w.astype(np.float32)
            q = np.rint(q) if self.precision == "int8" else q                       # E4M3 rounds to nearest
            q, dq = np.clip(q, -self.qmax, self.qmax), dict(axis=1)
        self.new_inits += [numpy_helper.from_array(q.astype(self.np_q), weight + ".q"),
                           numpy_helper.from_array(s_w, weight + ".scale")]
        self.nodes.append(helper.make_node("DequantizeLinear", [weight + ".q", weight + ".scale"], [weight + ".dq"],
                                           name=f"{name}.w_dq", **dq))
        return weight + ".dq"

    def _activation(self, act: str) -> str:
        """The activation as its GEMMs read it: its quantized channels gathered, migrated and Q/DQ'd."""
        from onnx import helper, numpy_helper

        source, amax_c, m = act, self.calib[act]["amax"], self.migrate.get(act)
        if act in self.split:  # the float channels, and the rest that is quantized
            top, rest = self.split[act]
            self.new_inits += [numpy_helper.from_array(top.astype(np.int64), act + ".top_idx"),
                               numpy_helper.from_array(rest.astype(np.int64), act + ".rest_idx")]
            self.nodes += [helper.make_node("Gather", [act, act + ".top_idx"], [act + ".top"], axis=-1,
                                            name=f"{act}.top"),
                           helper.make_node("Gather", [act, act + ".rest_idx"], [act + ".rest"], axis=-1,
                                            name=f"{act}.rest")]
            source, amax_c, m = act + ".rest", amax_c[rest], None if m is None else m[rest]
        if m is not None:
            self.new_inits.append(numpy_helper.from_array((1.0 / m).astype(self.fdt), act + ".smooth"))
            self.nodes.append(helper.make_node("Mul", [source, act + ".smooth"], [act + ".s"], name=f"{act}.smooth"))
            source = act + ".s"
        if not self.weight_only:
            a_scale = act.replace("/", "_") + ".a_scale"
            amax = float((amax_c / m).max() if m is not None else amax_c.max())
            self.new_inits.append(numpy_helper.from_array(fit_scale(np.array(amax / self.qmax), self.fdt), a_scale))
            self.nodes += [helper.make_node("QuantizeLinear", [source, a_scale], [act + ".q"],
                                            output_dtype=self.onnx_q, name=f"{act}.q"),
                           helper.make_node("DequantizeLinear", [act + ".q", a_scale], [act + ".dq"],
                                            name=f"{act}.dq")]
            source = act + ".dq"
        return source


def _write_qdq(model, qdq: _QdqGraph, inits: dict, precision: str, out: Path) -> None:
    """The model with the rewritten nodes, the untouched initializers and the new ones, to out (+ out.data)."""
    from onnx import helper

    from ..onnx_files import save_with_external_data

    del model.graph.node[:]
    model.graph.node.extend(qdq.nodes)
    for opset in model.opset_import:  # float8 Q/DQ needs opset 19, int4 and blocked DQ 21 (the heads are at 17)
        if opset.domain in ("", "ai.onnx") and opset.version < 21:
            opset.version = 21
    kept_inits = [t for t in model.graph.initializer if t.name in inits]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept_inits + qdq.new_inits)
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, "specrt.precision": precision})
    save_with_external_data(model, Path(out))


def _qdq_facts(qdq: _QdqGraph, gemms: dict, head: tuple[str, ...], precision: str, smooth: float | None,
               outliers: int, awq: dict) -> dict:
    """insert_qdq's facts for the manifest."""
    kept = [n for n in gemms if n not in qdq.done]
    method = (f"Q/DQ {precision}: weights per output channel, activations per tensor (amax), symmetric"
              if not qdq.weight_only else f"Q/DQ {precision}: int4 weights in symmetric blocks along K "
              f"(AWQ-lite scales, {AWQ_ROWS} calibration rows), activations float")
    if qdq.split:
        method += f"; the {outliers} input channels of largest amax per activation in float"
    facts = {"method": method, "gemms_quantized": len(qdq.done), "gemms_kept": kept,
             "lm_head_kept": any(n in head for n in kept), "smoothquant_alpha": smooth,
             "outlier_channels": outliers if qdq.split else 0}
    if awq:
        alphas = [a["alpha"] for a in awq.values()]
        gain = [a["mse"] / a["mse_rtn"] for a in awq.values() if a["mse_rtn"] > 0]
        facts["awq"] = {"block_sizes": sorted(qdq.blocks), "alphas": {str(a): alphas.count(a) for a in
                                                                      sorted(set(alphas), key=str)},
                        "mse_vs_rtn_median": round(float(np.median(gain)), 4) if gain else None}
    return facts
