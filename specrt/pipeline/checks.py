"""The checks a built engine passes before it enters a set: parity with PyTorch, width-exactness and the
logit screen's bound. Each opens the engine through runtime_link.open_built_engine and reads the export's
golden tensors (golden.npz: input_ids, logits and greedy_tokens, written by export/exporter.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SpecrtError
from .runtime_link import open_built_engine

WIDTH_TOLERANCE = 1e-3  # max |logit diff| of a width-exact engine (docs/pipeline-notes.md, "Width-exactness")


def check_engine(path: Path, facts: dict, golden_path: Path, session_config=None, backend: str = "onnxruntime",
                 precision: str = "fp32") -> dict:
    """Engine vs PyTorch golden tensors: max |Δlogit|, greedy agreement, and width-exactness
    (one K-token pass against K one-token passes; int8-activation kernels fail this)."""
    from ..export.exporter import greedy_agreement

    g = np.load(golden_path)
    eng = open_built_engine(path, facts, session_config, backend=backend, precision=precision)
    ids, ref = g["input_ids"], g["logits"]
    logits = eng.forward(ids, num_logits=len(ids)).copy()
    eng.commit(len(ids))
    rows = [logits[-1]]
    for _ in range(len(g["greedy_tokens"]) - 1):
        rows.append(eng.forward(np.array([rows[-1].argmax()]))[-1].copy())
        eng.commit(1)
    tokens = [int(r.argmax()) for r in rows]
    agree = greedy_agreement(rows, g["greedy_tokens"])
    k = min(8, len(tokens))
    eng.rewind(len(ids))
    wide = eng.forward(np.array(tokens[:k]), num_logits=k).copy()
    eng.rewind(len(ids))
    narrow = []
    for t in tokens[:k]:
        narrow.append(eng.forward(np.array([t])).copy())
        eng.commit(1)
    width = float(np.abs(wide - np.concatenate(narrow)).max())
    return {"max_abs_logit_diff_vs_torch": float(np.abs(logits - ref).max()),
            "greedy_agreement_vs_torch": agree["agreement"], "greedy_divergence_gap_vs_torch": agree["divergence_gap"],
            "width_max_abs_diff": width, "width_exact": width <= WIDTH_TOLERANCE}


def require_parity(name: str, parity: dict) -> None:
    """An fp32 engine (fp32 weights and compute) must match PyTorch; quantized engines only record it."""
    from ..export.exporter import parity_problem

    problem = parity_problem(parity["max_abs_logit_diff_vs_torch"], parity["greedy_agreement_vs_torch"],
                             parity.get("greedy_divergence_gap_vs_torch"))
    if problem:
        raise SpecrtError(f"the {name} engine does not match PyTorch: {problem}; the ONNX Runtime build of this "
                          "checkpoint is wrong, please report it (with `pip list | grep onnx`)")


def check_screen(path: Path, facts: dict, golden_path: Path, screen: dict, session_config=None) -> dict:
    """The logit screen's bound (build/screen.py) against this machine's int8 kernel, on real hidden states:
    the golden prompt and its greedy continuation, one position per pass as decoding runs it (a pass of all
    rows at once would pass the candidate limit and fall back to the fp32 lm_head, checking nothing), each
    position fp32 then screened, every row against every token. The runtime uses the screen only where this
    held ("holds"): no error past the bound, the screened tokens equal to the argmax of exact fp32 logits
    (numpy's, which sum in another order than the fp32 pass; the fp32 pass's own argmax is recorded beside
    it, and could differ only at a tie within ~1e-5), and at least half the rows screened, not fallen back."""
    from ..build.screen import bounds
    from ..export.graph import read_initializers

    g = np.load(golden_path)
    eng = open_built_engine(path, facts, session_config)
    eng.enable_hidden()
    ids = np.concatenate([g["input_ids"], g["greedy_tokens"]]).astype(np.int64)[: eng.max_pass_tokens]
    n, V = len(ids), eng.vocab_size
    exact, approx = np.empty((n, V), np.float32), np.empty((n, V), np.float32)
    hidden, screened = np.empty((n, facts["spec"]["hidden_size"]), np.float32), np.empty(n, np.int64)
    for i in range(n):  # a pass does not commit: both passes write position i, then it is kept
        exact[i] = eng.forward(ids[i:i + 1])[0]
        approx[i] = eng.forward(ids[i:i + 1], approx=True)[0]
        hidden[i], screened[i] = eng.hidden[0], eng.greedy[0]
        eng.commit(1)
    rows, (weight_err, qnorm) = read_initializers(path, screen["rows"], "screen.err_norm")
    truth = hidden @ rows.T
    bound = bounds(hidden, weight_err, qnorm, screen["block_size"])
    real = ~(approx == exact).all(axis=1)  # a fallen-back row is the same one-row fp32 pass: equal bit for bit
    ratio = _error_over_bound(np.abs(approx - truth)[real], bound[real]) if real.any() else None
    candidates = (approx + bound >= (approx - bound).max(axis=1, keepdims=True)).sum(axis=1)
    agree = bool((screened == truth.argmax(axis=1)).all())
    return {"rows": n, "screened_rows": int(real.sum()), "max_error_over_bound": ratio and round(ratio, 4),
            "candidates_per_row_median": float(np.median(candidates[real])) if real.any() else None,
            "argmax_equal": agree, "argmax_equal_fp32_pass": bool((screened == exact.argmax(axis=1)).all()),
            "holds": bool(real.sum() * 2 >= n and ratio is not None and ratio <= 1.0 and agree)}



def _error_over_bound(err: np.ndarray, bound: np.ndarray) -> float:
    """The largest error / bound. An all-zero lm_head row (the pad row transformers zeroes, tied) has bound 0: it is
    left out of the ratio, and holds only if its error is 0 too (else inf)."""
    zero = bound == 0
    ratios = np.where(zero, np.where(err == 0, 0.0, np.inf), err / np.where(zero, 1.0, bound))
    return float(ratios.max())


def screen_fallback_reason(check: dict) -> str:
    """Why a screen check did not hold, in a clause."""
    if check["screened_rows"] * 2 < check["rows"]:
        return f"only {check['screened_rows']} of {check['rows']} rows were screened"
    if not check["argmax_equal"]:
        return "its tokens differ from the fp32 argmax"
    return f"the int8 kernel's error reached {check['max_error_over_bound']} of the proven bound"
