"""Quantized portable engines (fp8, int8, int4-awq) and Medusa heads: calibrated on packaged texts, Q/DQ inserted
by build/quantize.py, and their quality against the set's fp32 engine measured at build time on held-out text,
teacher-forced: the share of positions whose top-1 token agrees and the mean KL(fp32 || quantized). A build whose
top-1 agreement falls below the floor fails in one line naming the figure and the option. Drafts and heads also
get their tau for the fp32 target.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..errors import SpecrtError
from .runtime_link import open_built_engine

QDQ_SESSION = {"session.disable_quant_qdq": "1"}  # ONNX Runtime runs the Q/DQ graph as written (fake-quant)
HELDOUT_TEXTS, MAX_TOKENS = 16, 256
QUALITY_FORMAT = 1  # bump when what measure_quality measures changes: figures kept beside cached graphs are keyed on it
DRAFTING_FORMAT = 2  # bump when what _acceptance measures changes: engine sets are keyed on it
# the least top-1 agreement with fp32 on held-out text a build keeps, by precision, unless --quality-floor says;
# int4 weights cost more (SmolLM2's shipped GPTQ int4 agrees ~80%: docs/benchmarks-history.md, "int4 accuracy")
DEFAULT_FLOORS = {"fp16": 0.85, "fp8": 0.85, "int8": 0.85, "int4-awq": 0.70}


def _sequences(texts, cache: Path, facts: dict) -> list[np.ndarray]:
    from .engines import export_codec

    codec = export_codec(cache, facts)
    limit = min(MAX_TOKENS, facts["max_context"] - 64)
    encoded = (codec.encode(t)[:limit] for t in texts)
    return [np.asarray(ids, np.int64) for ids in encoded if ids]


def build_quantized(fp32_graph: Path, out: Path, precision: str, cache: Path, facts: dict, entry, log,
                    calibration_texts: int, lm_head_fp32: bool = True, float_layers: int = 0,
                    float_gemms: tuple[str, ...] = (), outliers: int = 0, base_graph: Path | None = None) -> dict:
    """out (+ .data): the Q/DQ graph of base_graph (the activation base: the fp16 portable graph; None = fp32_graph)
    at `precision`, calibrated through fp32_graph on `calibration_texts` packaged texts (stdlib code and doc
    questions, never the bench's prompts) -> its build facts. float_layers: the first and last that many decoder
    layers keep their GEMMs in float; float_gemms: every layer's GEMMs of these kinds (build.quantize.GEMM_KINDS)
    too; outliers: per activation, its input channels of largest amax kept in float (build.quantize.insert_qdq).
    Written whole or not at all."""
    import onnx

    from ..build.gptq import calibration_texts as texts
    from ..build.quantize import float_kind_gemms, float_layer_gemms, lm_head_gemms
    from .parity import prefill_feed

    base_graph = base_graph or fp32_graph
    model = onnx.load(str(base_graph), load_external_data=False)
    keep = tuple(dict.fromkeys(float_layer_gemms(model, float_layers) + float_kind_gemms(model, float_gemms)))
    keep += lm_head_gemms(model) if lm_head_fp32 else ()
    seqs = _sequences([t for _, t in texts(calibration_texts)], cache, facts)
    log(f"calibrating {precision} activations on {len(seqs)} texts")
    info = _write_qdq(fp32_graph, out, precision, (prefill_feed(entry, s, 512) for s in seqs), keep, log, outliers,
                      base_graph)
    info["calibration_texts"], info["float_layers"], info["float_gemms"] = len(seqs), float_layers, list(float_gemms)
    info["activation_base"] = onnx_float_type(base_graph)
    out.with_suffix(".json").write_text(json.dumps(info))
    return info


def onnx_float_type(path: Path) -> str:
    """The float type of a portable graph's KV cache (its activation base): "float32" or "float16"."""
    import onnx

    from ..interface import past_name

    model = onnx.load(str(path), load_external_data=False)
    info = next(i for i in model.graph.input if i.name == past_name(0, "key"))
    return str(onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))


def calibration_for(base_graph: Path, fp32_graph: Path, calib: dict) -> dict:
    """calibrate's statistics of fp32_graph by the activation names of base_graph (another portable graph of the
    same model: the graphs share weight names, not every activation's)."""
    import onnx

    from ..build.quantize import gemm_weights

    if Path(base_graph) == Path(fp32_graph):
        return calib
    by_weight = {w: a for a, w in gemm_weights(onnx.load(str(fp32_graph), load_external_data=False)).values()}
    return {a: calib[by_weight[w]] for a, w in gemm_weights(onnx.load(str(base_graph), load_external_data=False))
            .values() if by_weight.get(w) in calib}


def _write_qdq(fp32_graph: Path, out: Path, precision: str, feeds, keep: tuple[str, ...], log,
               outliers: int = 0, base_graph: Path | None = None) -> dict:
    """out (+ .data), whole or not at all: base_graph (None = fp32_graph) with Q/DQ inserted around its GEMMs but
    those in keep, the statistics `precision` needs calibrated on fp32_graph over feeds (each activation found in
    the base graph by the weights that read it) -> insert_qdq's facts."""
    from ..build.quantize import AWQ_ROWS, WEIGHT_ONLY, calibrate, insert_qdq, smoothquant_alpha

    calib = calibrate(fp32_graph, feeds, sample_rows=AWQ_ROWS if precision in WEIGHT_ONLY else 0)
    base_graph = base_graph or fp32_graph
    calib = calibration_for(base_graph, fp32_graph, calib)
    part = Path(tempfile.mkdtemp(prefix=".part-", dir=out.parent))
    try:
        info = insert_qdq(base_graph, part / out.name, precision, calib, keep=keep,
                          smooth=smoothquant_alpha(precision, outliers), outliers=outliers, log=log)
        shutil.move(str(part / (out.name + ".data")), str(out) + ".data")
        shutil.move(str(part / out.name), str(out))
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return info


def measure_quality(path: Path, fp32_path: Path, facts: dict, backend: str, precision: str, cache: Path) -> dict:
    """Teacher-forced on held-out stdlib code: top-1 agreement and mean KL of the engine at path against fp32."""
    from ..corpora import heldout_code_texts

    seqs = _sequences(heldout_code_texts(HELDOUT_TEXTS), cache, facts)
    ref = open_built_engine(fp32_path, facts, backend=backend, precision="fp32")
    got = open_built_engine(path, facts, QDQ_SESSION, backend=backend, precision=precision)
    agree, kl, n = 0, 0.0, 0
    for seq in seqs:
        a, b = _logits(ref, seq), _logits(got, seq)
        agree += int((a.argmax(1) == b.argmax(1)).sum())
        lp, lq = _log_softmax(a), _log_softmax(b)
        kl += float((np.exp(lp) * (lp - lq)).sum())
        n += len(seq)
    return {"top1": round(agree / n, 4), "kl": float(f"{kl / n:.4g}"), "positions": n, "texts": len(seqs),
            "against": "fp32", "text": "held-out stdlib source, teacher-forced",
            "greedy_bench": _greedy_on_bench(ref, got, cache, facts)}


BENCH_TOKENS = 32


def _greedy_on_bench(ref, got, cache: Path, facts: dict) -> dict:
    """Plain greedy decoding of the first bench prompt of each category, BENCH_TOKENS tokens, by both engines:
    how many prompts give identical tokens, and where the others first diverge."""
    from ..corpora import BENCH_PROMPTS
    from ..export.exporter import first_divergence
    from ..runtime.tokenizer import Message
    from .engines import export_codec

    if not BENCH_PROMPTS.is_file():
        return {"prompts": 0}
    codec = export_codec(cache, facts)
    firsts: dict[str, list] = {}
    for line in BENCH_PROMPTS.read_text(encoding="utf-8").splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            firsts.setdefault(case["category"], case["messages"])
    divergences = []
    for messages in firsts.values():
        ids = np.asarray(codec.encode(codec.render_chat([Message(m["role"], m["content"]) for m in messages])),
                         np.int64)
        if len(ids) + BENCH_TOKENS > facts["max_context"]:
            continue
        runs = []
        for engine in (ref, got):
            engine.rewind(0)
            token, out = int(engine.argmax(ids)[0]), []
            engine.commit(len(ids))
            for _ in range(BENCH_TOKENS):
                out.append(token)
                token = int(engine.argmax(np.array([token]))[0])
                engine.commit(1)
            runs.append(out)
        divergences.append(first_divergence(np.array(runs[0]), np.array(runs[1])))
    return {"prompts": len(divergences), "tokens": BENCH_TOKENS,
            "identical": sum(d == BENCH_TOKENS for d in divergences), "first_divergence": divergences}


def _logits(engine, seq: np.ndarray) -> np.ndarray:
    """Logits of every position of seq, in passes of at most max_pass_tokens."""
    engine.rewind(0)
    out, step = [], engine.max_pass_tokens
    for i in range(0, len(seq), step):
        chunk = seq[i:i + step]
        out.append(engine.forward(chunk, num_logits=len(chunk)).astype(np.float64))
        engine.commit(len(chunk))
    return np.concatenate(out)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def require_quality(name: str, quality: dict, precision: str, floor: float | None) -> None:
    """floor None: the precision's default (DEFAULT_FLOORS)."""
    floor = DEFAULT_FLOORS.get(precision, 0.85) if floor is None else floor
    if quality["top1"] < floor:
        raise SpecrtError(f"{name} agrees with fp32 on {quality['top1']:.1%} of held-out tokens "
                          f"(KL {quality['kl']:.3f}), below --quality-floor {floor:.2f}; lower the floor to keep it, "
                          "or build another precision")


DRAFT_PROMPTS, DRAFT_TOKENS, DRAFT_K = 6, 48, 4


def draft_acceptance(root: Path, target: str, draft: str) -> dict:
    """How well the draft engine `draft` of the set at root drafts for its fp32 target `target`: greedy, K =
    DRAFT_K tokens a round (see _acceptance)."""
    from ..runtime.speculative import SpeculativeConfig

    return _acceptance(root, target, draft, "draft", SpeculativeConfig(draft_tokens=DRAFT_K))


def heads_acceptance(root: Path, target: str, heads: str) -> dict:
    """The same for the Medusa heads engine `heads`, its tree as built."""
    from ..runtime.speculative import SpeculativeConfig

    return _acceptance(root, target, heads, "medusa", SpeculativeConfig())


def _acceptance(root: Path, target: str, proposer: str, mode: str, config) -> dict:
    """Greedy decoding of DRAFT_TOKENS tokens per prompt by `target` with only the engine `proposer` beside it,
    on held-out stdlib code (the first 96 tokens of each of DRAFT_PROMPTS texts as a raw prompt) and, under
    "humaneval", on the first HumanEval problems (their code as a raw prompt) -> tau and acceptance by position,
    pooled over each set's prompts."""
    import json
    from dataclasses import replace

    from ..corpora import HUMANEVAL_PROMPTS, heldout_code_texts
    from ..manifest import load_manifest
    from ..runtime.session import load

    m = load_manifest(root)
    only = replace(m, engines={k: e for k, e in m.engines.items() if k in (target, proposer)})
    session = load(only, m.engines[target].precision, mode, config=config)
    codec, context = session.generator.codec, m.engines[target].max_context
    room = min(96, context // 2 - DRAFT_TOKENS)
    out = _drafting(session, [codec.decode(codec.encode(t)[:room]) for t in heldout_code_texts(DRAFT_PROMPTS)],
                    "held-out stdlib code, raw")
    if HUMANEVAL_PROMPTS.is_file():  # the problem's code as a raw prompt: the model writes the body (a chat
        # request's first DRAFT_TOKENS tokens only copy the prompt's signature back, which every draft gets right)
        cases = [json.loads(ln) for ln in HUMANEVAL_PROMPTS.read_text(encoding="utf-8").splitlines()
                 if ln.startswith("{")][:DRAFT_PROMPTS]
        codes = [c["messages"][-1]["content"].split("```python\n", 1)[-1].rsplit("\n```", 1)[0] + "\n"
                 for c in cases]
        fits = [c for c in codes if len(codec.encode(c)) + DRAFT_TOKENS + 64 <= context]
        if fits:
            out["humaneval"] = _drafting(session, fits, "HumanEval problems, raw (the function body)")
    return {**out, "against": target}


def _drafting(session, prompts: list[str], text: str) -> dict:
    from ..runtime.sampling import SamplingParams

    rounds = produced = 0
    kept, drafted = np.zeros(0), np.zeros(0)
    for prompt in prompts:
        r = session.generator.generate(prompt, decode=session.decoder, max_new_tokens=DRAFT_TOKENS,
                                       sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        st = r.stats
        rounds, produced = rounds + st.rounds, produced + len(r.token_ids)
        n = len(st.drafted_by_position)
        if n > len(drafted):
            kept, drafted = np.pad(kept, (0, n - len(kept))), np.pad(drafted, (0, n - len(drafted)))
        drafted[:n] += st.drafted_by_position
        kept[:n] += np.round(np.asarray(st.acceptance_by_position) * st.drafted_by_position)
    return {"tau": round(produced / rounds, 3) if rounds else None, "draft_tokens": len(drafted),
            "acceptance_by_position": [round(float(a), 3) for a in kept / np.maximum(drafted, 1)],
            "prompts": len(prompts), "text": text}


def build_quantized_heads(precision: str, fp32_entry, heads_path: Path, target_entry, cache: Path, facts: dict,
                          tmp: Path, log, calibration_texts: int):
    """medusa-<precision>: the heads of fp32_entry with Q/DQ GEMMs (build/quantize.py), each head's layers as 2-D
    MatMuls (export_heads_onnx per_head), calibrated on the fp32 target's hidden states over the packaged texts
    (`target_entry`, already in tmp) -> its manifest entry; its acceptance is measured once the set is written."""
    from dataclasses import replace

    from ..build.gptq import calibration_texts as texts
    from ..export.layers import head_lm_head
    from ..export.medusa import export_heads_onnx, load_heads
    from ..interface import HEADS_HIDDEN, HEADS_TOKEN
    from ..manifest import engine_memory

    name = f"medusa-{precision}"
    heads, info = load_heads(heads_path), fp32_entry.medusa
    lm_head = head_lm_head(cache, facts["spec"])
    part = Path(tempfile.mkdtemp(prefix=".part-", dir=tmp))
    try:
        graph = part / "heads-fp32.onnx"
        export_heads_onnx(heads, lm_head, graph, info["topk"], info["heads"], per_head=True)
        seqs = _sequences([t for _, t in texts(calibration_texts)], cache, facts)
        log(f"calibrating {name} on the target's hidden states over {len(seqs)} texts")
        target = open_built_engine(tmp / target_entry.file, facts, entry=target_entry)
        target.enable_hidden()
        feeds = []
        for seq in seqs:
            target.rewind(0)
            for i in range(0, len(seq) - 1, target.max_pass_tokens):
                chunk = seq[i:i + target.max_pass_tokens]
                target.forward(chunk, num_logits=1)
                target.commit(len(chunk))
                n = min(len(chunk), len(seq) - 1 - i)  # the heads read h[t] with the token t + 1
                feed = {HEADS_HIDDEN: np.ascontiguousarray(target.hidden[:n], np.float32)}
                if info.get("token_input"):
                    feed[HEADS_TOKEN] = seq[i + 1:i + 1 + n].astype(np.int64)
                feeds.append(feed)
        out = tmp / f"{name}.onnx"
        facts_q = _write_qdq(graph, out, precision, feeds, (), log)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    entry = replace(fp32_entry, name=name, precision=precision, file=out.name, files=[out.name, out.name + ".data"],
                    session_config=dict(QDQ_SESSION), build={**facts_q, "calibration_texts": len(seqs)},
                    memory=None)
    return entry.with_memory(engine_memory(entry, tmp))
