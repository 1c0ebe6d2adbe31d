"""Quantized portable engines (fp8, int8): calibrated on packaged texts, Q/DQ inserted by build/quantize.py, and
their quality against the set's fp32 engine measured at build time on held-out text, teacher-forced: the share
of positions whose top-1 token agrees and the mean KL(fp32 || quantized). A build whose top-1 agreement falls
below the floor fails in one line naming the figure and the option.
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
DEFAULT_FLOOR = 0.85  # top-1 agreement with fp32 on held-out text


def _sequences(texts, cache: Path, facts: dict) -> list[np.ndarray]:
    from .engines import export_codec

    codec = export_codec(cache, facts)
    limit = min(MAX_TOKENS, facts["max_context"] - 64)
    encoded = (codec.encode(t)[:limit] for t in texts)
    return [np.asarray(ids, np.int64) for ids in encoded if ids]


def build_quantized(fp32_graph: Path, out: Path, precision: str, cache: Path, facts: dict, entry, log,
                    calibration_texts: int, lm_head_fp32: bool = True) -> dict:
    """out (+ .data): the Q/DQ graph of fp32_graph at `precision`, calibrated on `calibration_texts` packaged texts
    (stdlib code and doc questions, never the bench's prompts) -> its build facts. Written whole or not at all."""
    from ..build.gptq import calibration_texts as texts
    from ..build.quantize import SMOOTHQUANT_ALPHA, calibrate_amax, insert_qdq
    from ..interface import LOGITS
    from .parity import prefill_feed

    seqs = _sequences([t for _, t in texts(calibration_texts)], cache, facts)
    log(f"calibrating {precision} activations on {len(seqs)} texts")
    amax = calibrate_amax(fp32_graph, (prefill_feed(entry, s, 512) for s in seqs))
    part = Path(tempfile.mkdtemp(prefix=".part-", dir=out.parent))
    try:
        info = insert_qdq(fp32_graph, part / out.name, precision, amax, keep=(LOGITS,) if lm_head_fp32 else (),
                          smooth=SMOOTHQUANT_ALPHA if precision == "int8" else None)
        shutil.move(str(part / (out.name + ".data")), str(out) + ".data")
        shutil.move(str(part / out.name), str(out))
    finally:
        shutil.rmtree(part, ignore_errors=True)
    info["calibration_texts"] = len(seqs)
    out.with_suffix(".json").write_text(json.dumps(info))
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


def require_quality(name: str, quality: dict, floor: float) -> None:
    if quality["top1"] < floor:
        raise SpecrtError(f"{name} agrees with fp32 on {quality['top1']:.1%} of held-out tokens "
                          f"(KL {quality['kl']:.3f}), below --quality-floor {floor:.2f}; lower the floor to keep it, "
                          "or build another precision")


DRAFT_PROMPTS, DRAFT_TOKENS, DRAFT_K = 6, 48, 4


def draft_acceptance(root: Path, target: str, draft: str) -> dict:
    """How well the draft engine `draft` of the set at root drafts for its fp32 target `target`: greedy, K =
    DRAFT_K tokens a round, on held-out stdlib code (the first 96 tokens of each text as a raw prompt) ->
    tau and acceptance by position, pooled over the prompts."""
    from dataclasses import replace

    from ..corpora import heldout_code_texts
    from ..manifest import load_manifest
    from ..runtime.sampling import SamplingParams
    from ..runtime.session import load
    from ..runtime.speculative import SpeculativeConfig

    m = load_manifest(root)
    only = replace(m, engines={k: e for k, e in m.engines.items() if k in (target, draft)})
    session = load(only, m.engines[target].precision, "draft", config=SpeculativeConfig(draft_tokens=DRAFT_K))
    codec, room = session.generator.codec, min(96, m.engines[target].max_context // 2 - DRAFT_TOKENS)
    rounds = produced = 0
    kept, drafted = np.zeros(DRAFT_K), np.zeros(DRAFT_K)
    for text in heldout_code_texts(DRAFT_PROMPTS):
        prompt = codec.decode(codec.encode(text)[:room])
        r = session.generator.generate(prompt, decode=session.decoder, max_new_tokens=DRAFT_TOKENS,
                                       sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        st = r.stats
        rounds, produced = rounds + st.rounds, produced + len(r.token_ids)
        n = len(st.drafted_by_position)
        drafted[:n] += st.drafted_by_position
        kept[:n] += np.round(np.asarray(st.acceptance_by_position) * st.drafted_by_position)
    return {"tau": round(produced / rounds, 3) if rounds else None, "draft_tokens": DRAFT_K,
            "acceptance_by_position": [round(float(a), 3) for a in kept / np.maximum(drafted, 1)],
            "prompts": DRAFT_PROMPTS, "against": target}
