"""make_engine_set: source -> engines/<name>/ (export, build, check, manifest), atomically.

Steps whose inputs did not change are skipped: exports are cached under engines/.cache keyed by
the source fingerprint and export options; built engines are cached next to their export; an
engine set whose manifest already records the same inputs is left as it is. The set is written
to a temp folder beside the target and renamed into place, so a failure leaves nothing half-written.
This module sits above export/, build/ and runtime/ and is the only one that uses all three.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SpecrtError
from .manifest import SCHEMA_VERSION, file_sha256, load_manifest, tool_versions

EXPORT_FORMAT = 2  # bump when export/graph.py changes the graph it writes
MIN_CONTEXT = 64    # the export's parity check decodes a ~16-token golden prompt + 32 tokens


@dataclass(frozen=True)
class EngineSetRequest:
    source: str
    name: str
    precisions: tuple[str, ...] = ("fp32",)
    max_context: int = 4096
    out_root: Path = Path("engines")
    draft_source: str | None = None  # a smaller model with the same tokenizer: entries draft-<prec>
    draft_precisions: tuple[str, ...] = ("fp32",)
    medusa_heads: Path | None = None  # a heads file from `specrt train-medusa`: entry medusa-fp32
    medusa_tree_nodes: int = 0        # 0 = the size that maximises expected tokens per measured pass second


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]specrt[/] {msg}")


def check_destination(out_root: Path, name: str) -> None:
    """An engine set goes to out_root/name: out_root a folder (created if missing), name one plain folder name."""
    if out_root.exists() and not out_root.is_dir():
        raise SpecrtError(f"--out '{out_root}' is a file, not a folder; pass a folder (it is created if missing)")
    if not name or name in (".", "..") or name.startswith(".") or any(c in name for c in "/\\"):
        raise SpecrtError(f"engine set name '{name}' is not a plain folder name (no '/', '\\', '..' or leading '.', "
                          "which is kept for the build cache); pass e.g. --name mymodel")


def make_engine_set(req: EngineSetRequest, log=_say) -> Path:
    """Export (cached per source, context and tool versions), build every requested engine, write the
    manifest, and move the set into req.out_root / req.name in one rename -> that path. Validates the
    request before any work; skips everything when the set there was built from the same inputs and still
    loads; one build per out_root at a time. Errors are one-line SpecrtErrors and leave no partial set."""
    from .build.ort import build_key, precision
    from .export.sources import fingerprint, resolve, vocab_size

    check_destination(Path(req.out_root), req.name)
    built = req.precisions + (req.draft_precisions if req.draft_source else ())
    for p in built:
        precision(p)  # validates before any work
    if req.max_context < MIN_CONTEXT:
        raise SpecrtError(f"--max-context {req.max_context} is too small; use at least {MIN_CONTEXT} (default 4096)")
    src = resolve(req.source)
    dsrc = resolve(req.draft_source) if req.draft_source else None
    if dsrc is not None:  # from the configs, before minutes of export; the tokenizers are compared after it
        _check_same_vocab(req, vocab_size(src), vocab_size(dsrc))
    final = req.out_root / req.name
    log(f"fingerprinting {src.path.name}")
    fp = fingerprint(src)

    recipes = sorted(build_key(precision(p)) for p in built)  # a changed recipe (or ORT version) rebuilds
    tools = _export_tools()
    key = [fp, sorted(req.precisions), req.max_context, EXPORT_FORMAT, tools, recipes, SCHEMA_VERSION]
    if dsrc is not None:
        log(f"fingerprinting {dsrc.path.name}")
        dfp = fingerprint(dsrc)
        key += [dfp, sorted(req.draft_precisions)]
    if req.medusa_heads is not None:
        if not Path(req.medusa_heads).is_file():
            raise SpecrtError(f"Medusa heads file '{req.medusa_heads}' not found; train it with `make heads`")
        from .export.medusa import HEADS_ENGINE, TREE_TOLERANCE

        key += [file_sha256(Path(req.medusa_heads)), req.medusa_tree_nodes, TREE_TOLERANCE, TREE_COSTS, HEADS_ENGINE]
    inputs_key = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    with _one_build_at_a_time(Path(req.out_root), log):
        if _up_to_date(final, inputs_key):
            log(f"{final} is up to date")
            return final
        return _make(req, final, inputs_key, fp, dfp if dsrc is not None else None, src, dsrc, tools, log)


def _make(req: EngineSetRequest, final: Path, inputs_key: str, fp: str, dfp: str | None, src, dsrc, tools: str,
          log) -> Path:
    cache = req.out_root / ".cache" / f"export-{fp[:16]}-ctx{req.max_context}-v{EXPORT_FORMAT}-t{tools}"
    facts = _cached_export(src, cache, req.max_context, log)
    roles = [("target", cache, facts, req.precisions)]
    if dsrc is not None:
        dcache = req.out_root / ".cache" / f"export-{dfp[:16]}-ctx{req.max_context}-v{EXPORT_FORMAT}-t{tools}"
        roles.append(("draft", dcache, _cached_export(dsrc, dcache, req.max_context, log), req.draft_precisions))
        _check_same_tokenizer(req, cache, dcache, facts, roles[1][2])
    req.out_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{req.name}-", dir=req.out_root))
    tmp.chmod(0o755)
    try:
        engines = {}
        for role, rcache, rfacts, precs in roles:
            for p in precs:
                engines[f"{role}-{p}"] = _build_engine(role, p, rcache, rfacts, tmp, log)
        if req.medusa_heads is not None:
            engines["medusa-fp32"] = _build_medusa(Path(req.medusa_heads), cache, facts, tmp, log,
                                                   req.medusa_tree_nodes, engines)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(cache / f, tmp / f)
        manifest = {
            "schema_version": SCHEMA_VERSION, "name": req.name, "inputs_key": inputs_key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": facts["source"], "export_parity": facts["parity"], "versions": facts["versions"],
            "tokenizer": {"file": "tokenizer.json", "sha256": file_sha256(tmp / "tokenizer.json"),
                          "chat_template": _chat_template(cache), "bos_token": facts["bos_token"],
                          "eos_token_ids": facts["eos_token_ids"]},
            "engines": engines,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _swap_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {final}")
    return final


def _export_tools() -> str:
    """Short hash of the versions that shape an export (torch runs the golden pass, transformers converts
    the checkpoint and GGUF files, onnx writes the graph): an upgrade re-exports instead of reusing."""
    packages = ("torch", "transformers", "gguf", "onnx")
    found = tool_versions(packages)
    versions = {pkg: found.get(pkg) for pkg in packages}   # None = not installed
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:8]


@contextmanager
def _one_build_at_a_time(out_root: Path, log):
    """An exclusive lock on out_root/.cache/.lock for a build or a prune: two runs building the same set
    raced on the export cache and the .part files (review: 3 of 5 concurrent tries failed), and a prune
    could delete what a build was writing. A second run waits, then usually finds the set up to date."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    (out_root / ".cache").mkdir(parents=True, exist_ok=True)
    with open(out_root / ".cache" / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another specrt build or prune in {out_root} to finish")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _up_to_date(final: Path, inputs_key: str) -> bool:
    """The set at final was built from these inputs and still loads: every file its manifest lists is there
    and its tokenizer is the recorded one (a set missing a file is rebuilt, as the load error tells users)."""
    try:
        return load_manifest(final).raw.get("inputs_key") == inputs_key
    except SpecrtError:
        return False


def _build_engine(role: str, p: str, cache: Path, facts: dict, tmp: Path, log) -> dict:
    """Build (or reuse) <role>-<p>.onnx in the export cache, link it into tmp, check it -> manifest entry."""
    from .build.ort import build_key, build_ort_engine, build_versions, precision

    bdir = cache / f"build-{build_key(precision(p))}"  # a changed build recipe never reuses a stale engine
    bdir.mkdir(exist_ok=True)
    built, facts_file = bdir / f"{role}-{p}.onnx", bdir / f"{role}-{p}.json"
    if not built.is_file():
        prec = precision(p)
        calibration = None
        if prec.method == "gptq":
            calibration = _calibration(cache, facts)
            log(f"building onnxruntime {role} engine at {p} (GPTQ: one fp32 pass over {len(calibration)} "
                "calibration texts, then the weights)")
        else:
            log(f"building onnxruntime {role} engine at {p}")
        t0 = time.time()
        part = bdir / f".part-{role}-{p}.onnx"
        try:  # `built` appears last, by rename: it marks a complete build
            info = build_ort_engine(cache / "model.onnx", part, prec, calibration)
            info["build_seconds"] = round(time.time() - t0, 1)
            facts_file.write_text(json.dumps(info))
            os.replace(str(part) + ".data", str(built) + ".data")
            _rewrite_data_location(part, built)
        except BaseException:  # a failed or interrupted build leaves no partial engine in the cache
            for leftover in (part, Path(str(part) + ".data"), built, Path(str(built) + ".data"), facts_file):
                leftover.unlink(missing_ok=True)
            raise
    for f in (built, Path(str(built) + ".data")):
        _link(f, tmp / f.name)
    info = json.loads(facts_file.read_text())
    log(f"checking {role}-{p} against PyTorch")
    parity = check_engine(tmp / built.name, facts, cache / "golden.npz", info.get("session_config"))
    if precision(p).bits is None:  # fp32 weights and compute: must match PyTorch (quantized engines only record it)
        from .export.exporter import parity_problem

        problem = parity_problem(parity["max_abs_logit_diff_vs_torch"], parity["greedy_agreement_vs_torch"],
                                 parity.get("greedy_divergence_gap_vs_torch"))
        if problem:
            raise SpecrtError(f"the {role}-{p} engine does not match PyTorch: {problem}; the ONNX Runtime build of this "
                              "checkpoint is wrong, please report it (with `pip list | grep onnx`)")
    entry = _entry(facts, p, built.name, info, parity)
    if "screen" in entry["build"]:
        screen = entry["screen"] = entry["build"].pop("screen")
        screen["check"] = check_screen(tmp / built.name, facts, cache / "golden.npz", screen, info.get("session_config"))
        if not screen["check"]["holds"]:
            log(f"warning: the logit screen did not pass its check on this machine ({screen['check']}); {role}-{p} "
                "will decode greedy passes with its full fp32 lm_head. Please report it (with `pip list | grep onnx`)")
    entry["role"], entry["tokenizer_sha256"] = role, file_sha256(cache / "tokenizer.json")
    entry["build_versions"] = build_versions()   # the set's "versions" are the export's
    return entry


def source_name(source: str) -> str:
    """What an engine set or a heads file made from `source` is called by default: an embedded name as it
    is, a model folder or .gguf file by its file name (lower case)."""
    return source if "/" not in source and not source.endswith(".gguf") else Path(source).stem.lower()


def default_heads(source: str) -> Path | None:
    """The committed heads for an embedded default (heads/<name>.npz beside the package), if any."""
    path = Path(__file__).resolve().parents[1] / "heads" / f"{source}.npz"
    return path if path.is_file() else None


def _build_medusa(heads_path: Path, cache: Path, facts: dict, tmp: Path, log, nodes: int, built: dict) -> dict:
    """Medusa heads as a tiny ONNX engine over the target's hidden state (role "medusa"). built: the set's
    engine entries so far (the tree is sized from the target's pass costs, through its logit screen where
    that was checked, as decoding runs them)."""
    from .export.graph import read_initializers
    from .export.medusa import choose_tree, export_heads_onnx, load_heads, tree_from_accuracies
    from .build.ort import precision
    from .runtime.backends.onnxruntime_cpu import screen_unusable
    from .runtime.tree import compile_tree

    log(f"building Medusa heads engine from {heads_path}")
    heads = load_heads(heads_path)
    lm_head = read_initializers(cache / "model.onnx", "lm_head.weight_t")[0].T    # [V, H]
    report = heads["report"]
    targets = sorted(f for f in os.listdir(tmp) if f.startswith("target-") and f.endswith(".onnx"))
    target = "target-fp32.onnx" if "target-fp32.onnx" in targets else targets[0]
    name = target[:-len(".onnx")]
    entry = built[name]
    screen = screen_unusable(entry.get("screen"), entry.get("build_versions")) is None  # the runtime's own rule
    cost = _plausible_pass_costs(tmp / target, facts, precision(name[len("target-"):]).session_config,
                                 log, golden=cache / "golden.npz", screen=screen)
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
    return {"role": "medusa", "file": "medusa-fp32.onnx", "files": ["medusa-fp32.onnx"], "backend": "onnxruntime",
            "precision": "fp32", "num_layers": 0, "num_heads": 0, "num_kv_heads": 0, "head_dim": 0,
            "hidden_size": s["hidden_size"], "vocab_size": s["vocab_size"], "max_context": facts["max_context"],
            "inputs": {"hidden": ["batch", s["hidden_size"], "float32"],
                       **({"token": ["batch", "int64"]} if info["token_input"] else {})},
            "outputs": {"candidates": ["batch", info["heads"], info["topk"], "int64"],
                        "scores": ["batch", info["heads"], info["topk"], "float32"]},
            "medusa": {**info, "tree": [list(p) for p in tree], "tree_choice": choice,
                       "pass_seconds_by_width": cost, "heads_file": heads_path.name,
                       "heads_sha256": file_sha256(heads_path),
                       "training": {k: v for k, v in report.items() if k not in ("tree_order", "tree_values", "rank_acc")},
                       "rank_acc": report.get("rank_acc")}}


def _calibration(cache: Path, facts: dict) -> list[list[int]]:
    """GPTQ's calibration: stdlib code as raw text, stdlib doc questions through the chat template."""
    from .build.gptq import MAX_TOKENS, calibration_texts
    from .runtime.tokenizer import Message, TextCodec

    codec = TextCodec(cache / "tokenizer.json", _chat_template(cache), facts["bos_token"], tuple(facts["eos_token_ids"]))
    limit = min(MAX_TOKENS, facts["max_context"])
    seqs = [codec.encode(codec.render_chat([Message("user", text)]) if kind == "chat" else text)[:limit]
            for kind, text in calibration_texts()]
    return [s for s in seqs if s]


def _engine(path: Path, facts: dict, session_config=None, screen: bool = False):
    from .runtime.backends.onnxruntime_cpu import OrtEngine

    s = facts["spec"]
    return OrtEngine(path, num_layers=s["num_layers"], num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                     vocab_size=s["vocab_size"], max_context=facts["max_context"], session_config=dict(session_config or {}),
                     screen=screen)


def _pass_costs(path: Path, facts: dict, session_config, golden: Path, screen: bool,
                widths=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48), positions: int = 8) -> list[tuple[int, float]]:
    """Seconds of a w-token greedy verification pass as the loop runs it (`argmax`: through the logit screen up
    to its row limit when `screen`), at `positions` consecutive decode positions of real text (the golden
    prompt, then its greedy continuation, repeated): the screen's cost depends on the hidden states (a soup of
    one token made its rescoring ~10x busier, and a pass that repeats the same position is cheaper than
    decoding). The median over positions and interleaved repetitions, made non-decreasing in w. A first sweep is
    not timed: once, in a fresh session, one-token passes ran 17.3 ms at first against 14.7 warm, and the curve
    came out flat (8 tokens at 1.50 steps against 1.66-1.81). What remains is the machine's drift: six warm
    measurements on the AVX2 VM put a 4-token pass at 1.19-1.39 steps (BENCHMARKS "Session 13")."""
    eng = _engine(path, facts, session_config, screen)
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
    `warmup` untimed repetitions first. Shared by the Medusa tree's sizing and `specrt.bench.ceiling`."""
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


TREE_COSTS = 4  # how the tree's pass costs are measured (4: as 3, after an untimed warm-up sweep; 3: greedy decode passes over real text, screened; 1-2: np.ones tokens, fp32 path); in the key
MIN_WIDTH_SLOPE = 0.01   # a CPU pass costs >= 1% of a one-token step per extra token (measured here: ~5% at fp32)
PRIOR_WIDTH_SLOPE = 0.05  # what a quiet machine measured for SmolLM2 fp32 (48 tokens: 3.19 steps)


def _plausible_pass_costs(path: Path, facts: dict, session_config, log, golden: Path, screen: bool,
                          tries: int = 3) -> list[tuple[int, float]]:
    """_pass_costs, measured again when the curve is implausibly flat. On a busy machine every one-token pass
    was slowed and wide passes looked nearly free (48 tokens at 1.14 steps, against 3.19 quiet), which chose a
    36-node tree that decodes slower than the 3-node one. After `tries` flat curves: a linear prior, said so."""
    for _ in range(tries):
        cost = _pass_costs(path, facts, session_config, golden, screen)
        (w0, c0), (w1, c1) = cost[0], cost[-1]
        if c1 / c0 >= 1.0 + MIN_WIDTH_SLOPE * (w1 - w0):
            return cost
    log(f"pass timings look distorted (a {w1}-token pass at {c1 / c0:.2f} one-token steps: a busy machine, or a "
        "model so small that call overhead dominates): "
        f"sizing the Medusa tree with a prior of {PRIOR_WIDTH_SLOPE:.0%} of a step per token. Rebuild on a quiet "
        "machine, or pass --medusa-tree-nodes N")
    return [(w, c0 * (1.0 + PRIOR_WIDTH_SLOPE * (w - w0))) for w, _ in cost]


def _check_same_vocab(req, tv: int | None, dv: int | None) -> None:
    if tv is not None and dv is not None and tv != dv:
        raise SpecrtError(f"draft '{req.draft_source}' has vocabulary size {dv}, target '{req.source}' has {tv}; "
                          "choose a draft from the target's model family (same tokenizer)")


def _check_same_tokenizer(req, cache: Path, dcache: Path, facts: dict, dfacts: dict) -> None:
    """Speculation compares token ids: the draft must share the target's tokenizer exactly."""
    _check_same_vocab(req, facts["spec"]["vocab_size"], dfacts["spec"]["vocab_size"])
    th, dh = file_sha256(cache / "tokenizer.json"), file_sha256(dcache / "tokenizer.json")
    if th != dh:
        raise SpecrtError(f"draft '{req.draft_source}' and target '{req.source}' use different tokenizers "
                          f"(sha256 {dh[:12]}… vs {th[:12]}…); choose a draft with the target's tokenizer")


def _cached_export(src, cache: Path, max_context: int, log) -> dict:
    from .export.exporter import export_checkpoint

    if (cache / "export.json").is_file():
        log(f"export cached in {cache}")
        return json.loads((cache / "export.json").read_text())
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=cache.parent))
    try:
        facts = export_checkpoint(src, tmp, max_context, log=log)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return facts


def check_engine(path: Path, facts: dict, golden_path: Path, session_config=None) -> dict:
    """Engine vs PyTorch golden tensors: max |Δlogit|, greedy agreement, and width-exactness
    (one K-token pass against K one-token passes; int8-activation kernels fail this)."""
    from .export.exporter import greedy_agreement

    g = np.load(golden_path)
    eng = _engine(path, facts, session_config)
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
            "width_max_abs_diff": width, "width_exact": width <= 1e-3}


def check_screen(path: Path, facts: dict, golden_path: Path, screen: dict, session_config=None) -> dict:
    """The logit screen's bound (build/screen.py) against this machine's int8 kernel, on real hidden states:
    the golden prompt and its greedy continuation, one position per pass as decoding runs it (a pass of all
    rows at once would pass the candidate limit and fall back to the fp32 lm_head, checking nothing), each
    position fp32 then screened, every row against every token. The runtime uses the screen only where this
    held ("holds"): no error past the bound, the screened tokens equal to the argmax of exact fp32 logits
    (numpy's, which sum in another order than the fp32 pass; the fp32 pass's own argmax is recorded beside
    it, and could differ only at a tie within ~1e-5), and at least half the rows screened, not fallen back."""
    from .build.screen import bounds
    from .export.graph import read_initializers

    g = np.load(golden_path)
    eng = _engine(path, facts, session_config)
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
    ratio = float((np.abs(approx - truth)[real] / bound[real]).max()) if real.any() else None
    candidates = (approx + bound >= (approx - bound).max(axis=1, keepdims=True)).sum(axis=1)
    agree = bool((screened == truth.argmax(axis=1)).all())
    return {"rows": n, "screened_rows": int(real.sum()), "max_error_over_bound": ratio and round(ratio, 4),
            "candidates_per_row_median": float(np.median(candidates[real])) if real.any() else None,
            "argmax_equal": agree, "argmax_equal_fp32_pass": bool((screened == exact.argmax(axis=1)).all()),
            "holds": bool(real.sum() * 2 >= n and ratio is not None and ratio <= 1.0 and agree)}


def _entry(facts: dict, prec: str, file: str, info: dict, parity: dict) -> dict:
    s = facts["spec"]
    return {
        "role": "target", "file": file, "files": [file, file + ".data"], "backend": "onnxruntime", "precision": prec,
        "num_layers": s["num_layers"], "num_heads": s["num_heads"], "num_kv_heads": s["num_kv_heads"],
        "head_dim": s["head_dim"], "hidden_size": s["hidden_size"], "vocab_size": s["vocab_size"],
        "max_context": facts["max_context"], "architecture": s["architecture"],
        "inputs": {"input_ids": ["batch", "seq", "int64"], "position_ids": ["batch", "seq", "int64"],
                   "tree_mask": ["batch", "seq", "seq", "float32"], "seqlens_k": ["batch", "int32"],
                   "total_sequence_length": ["int32"], "num_logits_to_keep": ["int64"],
                   "past_key_values.{i}.key|value": ["batch", s["num_kv_heads"], "max_context", s["head_dim"], "float32"]},
        "outputs": {"logits": ["batch", "num_logits", s["vocab_size"], "float32"],
                    "hidden_states": ["batch", "seq", s["hidden_size"], "float32"],
                    "present.{i}.key|value": "shares the past buffer"},
        "source_sha256": facts["source"]["sha256"], "parity": parity, "build": info,
        "session_config": info.get("session_config", {}),  # ORT session entries the runtime applies
    }


def _chat_template(cache: Path) -> str | None:
    cfg = json.loads((cache / "tokenizer_config.json").read_text())
    if cfg.get("chat_template"):
        return cfg["chat_template"]
    jinja = cache / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


def _rewrite_data_location(part: Path, built: Path) -> None:
    """The optimized graph names its weights file; point it at the final name."""
    import onnx

    model = onnx.load(str(part), load_external_data=False)
    for t in model.graph.initializer:
        for kv in t.external_data:
            if kv.key == "location":
                kv.value = built.name + ".data"
    onnx.save_model(model, str(part))
    os.replace(part, built)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _swap_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        trash = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    bytes: int
    in_use: bool  # an engine set hard-links files from it (deleting it would cost a rebuild, nothing else)


def _usage(paths) -> tuple[int, bool]:
    """(bytes of the regular files among paths, whether any of them is hard-linked from elsewhere)."""
    size, linked = 0, False
    for f in paths:
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            size += st.st_size
            linked |= st.st_nlink > 1
    return size, linked


LEFTOVER_AGE_S = 3600  # a temp folder untouched this long belongs to a dead run, not to a build in progress


def _leftovers(out_root: Path) -> list[CacheEntry]:
    """Temp folders of runs killed before they could clean up (kill -9, power loss): .tmp-* (a set or an
    export being written) and .old-* (a set being replaced), beside the sets and in .cache, once nothing
    in them changed for LEFTOVER_AGE_S (a build running next to the prune keeps its own)."""
    found = [p for d in (out_root, out_root / ".cache") for pat in (".tmp-*", ".old-*") for p in d.glob(pat)]
    now = time.time()
    return [CacheEntry(p, _usage(p.rglob("*"))[0], False) for p in sorted(found)
            if p.is_dir() and now - max(q.stat().st_mtime for q in [p, *p.iterdir()]) > LEFTOVER_AGE_S]


def cache_entries(out_root: Path) -> list[CacheEntry]:
    """The export and build folders under out_root/.cache. Engine sets hard-link their engines from a
    build folder, so one that no set links is stale: an old build recipe or format, or a set since
    rebuilt. An export folder is in use while any of its builds is. (Where hard links are impossible the
    sets hold copies, nothing in the cache counts as in use, and pruning only costs rebuild time.)
    Leftovers of interrupted runs come first, always stale."""
    entries = _leftovers(out_root)
    for exp in sorted((out_root / ".cache").glob("export-*")):
        builds = [CacheEntry(b, *_usage(b.rglob("*"))) for b in sorted(exp.glob("build-*")) if b.is_dir()]
        own, own_used = _usage(exp.iterdir())  # sets built before build folders linked from the export itself
        entries.append(CacheEntry(exp, own, own_used or any(b.in_use for b in builds)))
        entries += builds
    return entries


def prune_cache(out_root: Path, log=print) -> int:
    """Delete the stale entries of cache_entries; returns the bytes freed. A stale export's builds are
    all stale too and listed after it, so each entry's bytes count once. Leftovers go first: a half-written
    set hard-links builds, which count as in use only until it is gone."""
    with _one_build_at_a_time(out_root, log):
        return _prune(out_root, log)


def _prune(out_root: Path, log) -> int:
    freed = 0
    for listing in (_leftovers, cache_entries):  # the second listing runs after the leftovers are gone
        for e in listing(out_root):
            if not e.in_use:
                if e.path.exists():  # a build of an export removed just before is already gone
                    shutil.rmtree(e.path)
                freed += e.bytes
                log(f"removed {e.path} ({e.bytes / 2**30:.2f} GiB)")
    return freed
