"""The Medusa engine of a set: the heads as a tiny ONNX graph, with the token tree sized from the target's
measured pass costs (docs/pipeline-notes.md, "Pass-cost sizing of the Medusa tree").
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..interface import heads_io_description
from ..manifest import EngineEntry, engine_memory, file_sha256
from .runtime_link import open_built_engine

# How the tree's pass costs are measured; part of the inputs key, so a change re-sizes the trees of existing
# sets (its versions: docs/pipeline-notes.md, "Pass-cost sizing of the Medusa tree").
TREE_COSTS = 4
# An extra token costs a CPU pass at least MIN_WIDTH_SLOPE of a one-token step; flatter curves are distorted and
# give way to PRIOR_WIDTH_SLOPE, a quiet machine's (docs/pipeline-notes.md, "Implausibly flat pass costs").
MIN_WIDTH_SLOPE = 0.01
PRIOR_WIDTH_SLOPE = 0.05


def build_medusa(heads_path: Path, cache: Path, facts: dict, tmp: Path, log, nodes: int,
                 built: dict[str, EngineEntry], backend: str = "onnxruntime") -> EngineEntry:
    """Medusa heads as a tiny ONNX engine over the target's hidden state (role "medusa"). built: the set's
    engine entries so far (the tree is sized from the target's pass costs, through its logit screen where
    the runtime will use it, as decoding runs them). nodes > 0: a fixed tree size instead of the measured one."""
    from ..export.layers import head_lm_head
    from ..export.medusa import export_heads_onnx, load_heads
    from ..export.medusa_tree import choose_tree, tree_from_accuracies
    from ..runtime.tree import compile_tree

    log(f"building Medusa heads engine from {heads_path}")
    heads = load_heads(heads_path)
    lm_head = head_lm_head(cache, facts["spec"])    # [V, H]
    report = heads["report"]
    cost = target_pass_costs(built, cache, facts, tmp, log)
    if "tree_order" in report:
        order, values = report["tree_order"], report["tree_values"]
    else:  # heads trained without the joint measurement: assume independent heads
        order = tree_from_accuracies(np.array(report["rank_acc"]), 48)
        values = [float(np.prod([report["rank_acc"][d][r] for d, r in enumerate(p)])) for p in order]
    tree, choice = choose_tree(order, values, lambda w: float(np.interp(w, *zip(*cost))))
    if nodes > 0:  # a fixed size asked for (the measured choice stays in the manifest for comparison)
        tree, choice["nodes_asked"] = tuple(tuple(p) for p in order[:nodes]), nodes
        choice["expected_tokens"] = round(1.0 + float(np.sum(values[:nodes])), 3)
    log(f"Medusa tree: {len(tree)} nodes (measured best: {choice['best_nodes']}; the smallest within "
        f"{choice['tolerance']:.0%} of it: {choice['nodes']}), expected {choice['expected_tokens']} tokens per round")
    compiled = compile_tree(tree)
    info = export_heads_onnx(heads, lm_head, tmp / "medusa-fp32.onnx", compiled.max_rank, compiled.max_depth)
    s = facts["spec"]
    inputs, outputs = heads_io_description(s["hidden_size"], info["heads"], info["topk"], info["token_input"])
    entry = EngineEntry(
        name="medusa-fp32", role="medusa", file="medusa-fp32.onnx", files=["medusa-fp32.onnx"], backend=backend,
        precision="fp32", num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0, hidden_size=s["hidden_size"],
        vocab_size=s["vocab_size"], max_context=facts["max_context"], inputs=inputs, outputs=outputs,
        medusa={**info, "tree": [list(p) for p in tree], "tree_choice": choice,
                "pass_seconds_by_width": cost, "heads_file": heads_path.name,
                "heads_sha256": file_sha256(heads_path),
                "training": {k: v for k, v in report.items() if k not in ("tree_order", "tree_values", "rank_acc")},
                "rank_acc": report.get("rank_acc")})
    return entry.with_memory(engine_memory(entry, tmp))


def target_pass_costs(built: dict[str, EngineEntry], cache: Path, facts: dict, tmp: Path, log) -> list:
    """The set's target pass seconds by width ([[width, seconds], ...]), measured on its fp32 target (else its first
    target) as decoding runs it: what sizes a Medusa tree at build time and an EAGLE tree each round."""
    targets = sorted(name for name, e in built.items() if e.role == "target")
    target = built["target-fp32"] if "target-fp32" in built else built[targets[0]]
    return _plausible_pass_costs(tmp / target.file, facts, log, golden=cache / "golden.npz", entry=target)


def _pass_costs(path: Path, facts: dict, golden: Path, entry: EngineEntry,
                widths=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48), positions: int = 8) -> list[tuple[int, float]]:
    """Seconds of a w-token greedy verification pass as the loop runs it (`argmax`: through the logit screen up to its
    row limit where the runtime uses it on this entry's engine), at `positions` consecutive decode positions of real
    text (the golden prompt, then its greedy continuation, repeated), because the screen's cost depends on the
    hidden states. The median over positions and interleaved repetitions, made non-decreasing in w, after one
    untimed sweep that warms the session up (docs/pipeline-notes.md, "Pass-cost sizing of the Medusa tree")."""
    eng = open_built_engine(path, facts, entry=entry)
    g = np.load(golden)
    prompt, text = g["input_ids"].astype(np.int64), g["greedy_tokens"].astype(np.int64)
    P = len(prompt)
    widths = [w for w in widths if P + positions + w <= facts["max_context"]]
    ids = np.concatenate([prompt, np.resize(text, positions + max(widths))])
    eng.forward(prompt)
    eng.commit(P)
    med = time_passes(eng, ids, P, widths, positions, reps=3, warmup=1)
    return [(w, round(c, 5)) for w, c in zip(widths, np.maximum.accumulate(med))]


def time_passes(eng, ids: np.ndarray, start: int, widths, positions: int, reps: int, warmup: int = 0) -> list[float]:
    """Median seconds of a w-token greedy pass (`argmax`, as the loop runs it) for each w in widths, timed at
    `positions` consecutive decode positions of ids after `start` (the cache holds ids[:start]; each pass is
    fed the text that follows, and one token of it is committed) in `reps` repetitions, widths interleaved;
    `warmup` untimed repetitions first. Shared by the Medusa tree's sizing and `experiments/ceiling.py`."""
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(warmup + reps):
        for w in widths:
            eng.rewind(start)
            for i in range(start, start + positions):
                t0 = time.perf_counter()
                eng.argmax(ids[i:i + w], num_logits=w)
                if rep >= warmup:
                    times[w].append(time.perf_counter() - t0)
                eng.commit(1)
    return [float(np.median(times[w])) for w in widths]


def _plausible_pass_costs(path: Path, facts: dict, log, golden: Path, entry: EngineEntry,
                          tries: int = 3) -> list[tuple[int, float]]:
    """_pass_costs, measured again when the curve is implausibly flat (a busy machine slows every one-token
    pass, so wide passes look nearly free and a tree too large is chosen). After `tries` flat curves: a
    linear prior, said so (docs/pipeline-notes.md, "Implausibly flat pass costs")."""
    for _ in range(tries):
        cost = _pass_costs(path, facts, golden, entry)
        (w0, c0), (w1, c1) = cost[0], cost[-1]
        if c1 / c0 >= 1.0 + MIN_WIDTH_SLOPE * (w1 - w0):
            return cost
    log(f"pass timings look distorted (a {w1}-token pass at {c1 / c0:.2f} one-token steps: a busy machine, or a "
        "model so small that call overhead dominates): "
        f"sizing the Medusa tree with a prior of {PRIOR_WIDTH_SLOPE:.0%} of a step per token. Rebuild on a quiet "
        "machine, or pass --medusa-tree-nodes N")
    return [(w, c0 * (1.0 + PRIOR_WIDTH_SLOPE * (w - w0))) for w, _ in cost]
