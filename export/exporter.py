"""export_checkpoint: source -> ONNX + tokenizer + golden tensors + parity figures, or a loud failure."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..errors import SpecrtError
from ..manifest import tool_versions
from .sources import Source, fingerprint, load
from .stops import stop_token_ids

GOLDEN_VERSION = 1
GOLDEN_PROMPT = "Speculative decoding keeps the target distribution exactly. Write a haiku about rivers."
GREEDY_TOKENS = 32
# fp32 export vs PyTorch; a correct graph is far inside it (docs/design-notes.md, "Export parity threshold")
MAX_ABS_LOGIT_DIFF = 1e-2
# Greedy agreement is the share of the 32 greedy tokens *before the first divergence*, so one flip
# decides it: a flip at token 3 reads 3/32 although every later token had another context. No fraction
# is a robust threshold: a true near-tie (two logits within float noise) can flip at any token. The
# gate asks instead whether the flip is explainable: where both runs saw the same context, logits
# each within MAX_ABS_LOGIT_DIFF of PyTorch's can swap the top two only if the engine's own logits for
# its token and PyTorch's are within 2 * MAX_ABS_LOGIT_DIFF. A wider gap there is a wrong graph.
NEAR_TIE = 2 * MAX_ABS_LOGIT_DIFF


def export_checkpoint(src: Source, out_dir: Path, max_context: int, log=print) -> dict:
    """src -> out_dir/model.onnx (+ .data), golden.npz, tokenizer files and export.json; returns the facts
    written to export.json (spec, source hash, parity, versions). Fails with a SpecrtError when the model
    or the context is one this static graph cannot reproduce, or when parity against PyTorch is off."""
    import onnx

    from .graph import build_decoder
    from .sources import check_family
    from .spec import DecoderSpec

    t0 = time.time()
    check_family(src)  # from config.json, before any weight loads
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"loading {src.label}")
    model, tokenizer = load(src)
    spec = DecoderSpec.from_hf(model, max_context)   # refuses a context this model cannot be exported for
    ids = np.array(tokenizer(GOLDEN_PROMPT)["input_ids"], np.int64) % spec.vocab_size
    if len(ids) + GREEDY_TOKENS > max_context:  # the parity check decodes the golden prompt + its greedy tokens
        raise SpecrtError(f"--max-context {max_context} is too small to check this export (the golden prompt is "
                          f"{len(ids)} tokens + {GREEDY_TOKENS} decoded); use at least {len(ids) + GREEDY_TOKENS}")
    log("computing PyTorch golden tensors")
    ref_logits, greedy = torch_greedy(model, ids, GREEDY_TOKENS)
    np.savez(out_dir / "golden.npz", version=np.int64(GOLDEN_VERSION), input_ids=ids,
             logits=ref_logits, greedy_tokens=greedy)

    log("writing ONNX")
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    proto = build_decoder(spec, weights, max_context, data_path=out_dir / "model.onnx.data")
    del weights, model
    onnx.save_model(proto, str(out_dir / "model.onnx"))
    del proto
    tokenizer.save_pretrained(str(out_dir))

    log("checking ONNX against PyTorch")
    parity = onnx_parity(out_dir / "model.onnx", spec, ids, ref_logits, greedy, max_context)
    problem = parity_problem(parity["max_abs_logit_diff"], parity["greedy_agreement"], parity["greedy_divergence_gap"])
    if problem:
        raise SpecrtError(f"export parity failed: {problem}; this checkpoint's architecture variant is not "
                          "handled, please report it")
    facts = {
        "spec": asdict(spec), "source": {"label": src.label, "kind": src.kind, "path": str(src.path),
                                          "sha256": fingerprint(src)},
        "max_context": max_context, "parity": parity, "versions": tool_versions(),
        "export_seconds": round(time.time() - t0, 1),
        "eos_token_ids": stop_token_ids(tokenizer, src), "bos_token": tokenizer.bos_token,
    }
    (out_dir / "export.json").write_text(json.dumps(facts, indent=1))
    return facts


def torch_greedy(model, ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain argmax decoding with the model's own cache; no generate() logits processors (which
    would, e.g., suppress EOS) so the tokens are exactly what the graph must reproduce."""
    import warnings

    import torch

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values naming churn in transformers 5.x
        out = model(torch.from_numpy(ids[None]), use_cache=True)
        logits = out.logits[0].float().numpy()
        tokens = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return logits, np.array(tokens, np.int64)


def onnx_parity(path: Path, spec, ids: np.ndarray, ref_logits: np.ndarray, greedy: np.ndarray,
                max_context: int) -> dict:
    """Run the standard graph (function inlined by ORT, cache passed in and out, no sharing)."""
    import onnxruntime as ort

    from ..interface import KV_KINDS, LOGITS, chain_feeds, past_name, present_name

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cache_shape = (1, spec.num_kv_heads, max_context, spec.head_dim)
    past = {past_name(i, k): np.zeros(cache_shape, np.float32) for i in range(spec.num_layers) for k in KV_KINDS}
    names = [o.name for o in sess.get_outputs()]

    def run(tokens: np.ndarray, start: int, n_logits: int) -> np.ndarray:
        outs = dict(zip(names, sess.run(None, chain_feeds(tokens, start, n_logits, past))))
        for i in range(spec.num_layers):
            for k in KV_KINDS:
                past[past_name(i, k)] = outs[present_name(i, k)]
        return outs[LOGITS][0]

    logits = run(ids, 0, len(ids))
    diff = float(np.abs(logits - ref_logits).max())
    rows = [logits[-1]]
    for pos in range(len(ids), len(ids) + len(greedy) - 1):
        rows.append(run(np.array([rows[-1].argmax()], np.int64), pos, 1)[-1])
    agree = greedy_agreement(rows, greedy)
    return {"max_abs_logit_diff": diff, "greedy_agreement": agree["agreement"],
            "greedy_divergence_gap": agree["divergence_gap"], "greedy_tokens_checked": len(greedy)}


def greedy_agreement(rows, ref: np.ndarray) -> dict:
    """rows: [n] logit rows [vocab] of a greedy run (token i = rows[i].argmax()); ref [n]: PyTorch's tokens.
    -> agreement (share before the first divergence) and divergence_gap: the run's own logit of its token
    minus that of PyTorch's token at the first divergence (None if none); see NEAR_TIE."""
    tokens = np.array([int(r.argmax()) for r in rows])
    i = first_divergence(tokens, ref)
    gap = float(rows[i][tokens[i]] - rows[i][ref[i]]) if i < min(len(tokens), len(ref)) else None
    return {"agreement": i / len(ref), "divergence_gap": gap}


def parity_problem(max_abs_logit_diff: float, agreement: float, divergence_gap: float | None) -> str | None:
    """What is wrong with an fp32 graph's parity figures against PyTorch, or None."""
    if not max_abs_logit_diff <= MAX_ABS_LOGIT_DIFF:
        return f"max |Δlogit| {max_abs_logit_diff:.3g} > {MAX_ABS_LOGIT_DIFF}"
    if agreement < 1 and not (divergence_gap is not None and divergence_gap <= NEAR_TIE):
        gap = "?" if divergence_gap is None else f"{divergence_gap:.3g}"
        return (f"greedy decoding agrees with PyTorch's for only {agreement:.0%} of the tokens and leaves it where "
                f"the two tokens' logits are {gap} apart (a near-tie is <= {NEAR_TIE})")
    return None


def first_divergence(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mism = np.nonzero(a[:n] != b[:n])[0]
    return int(mism[0]) if len(mism) else n
