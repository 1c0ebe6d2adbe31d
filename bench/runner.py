"""The benchmark loop: every contender on every prompt, repetitions interleaved, then figures.

1. resolve modes -> contenders; load each (a peer that cannot run is skipped with a note)
2. warm up each contender once (first prompt, a few tokens): builds caches, page-ins, thread pools
3. for rep in reps: for case in prompts: for contender in a seeded random order: run, record a Trace
   (interleaving spreads machine noise over all modes alike; the shuffle removes order and neighbour bias)
4. figures per (mode, category) and per mode over all prompts, against `plain-fp32` of the same run
More: docs/bench-notes.md, "Module notes: bench/runner.py".
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SpecrtError, first_line
from ..manifest import load_manifest
from . import contenders
from .isolate import Isolated, WorkerError
from .peers import Unavailable
from .prompts import DEFAULT_PROMPTS, PromptCase, load_prompts, select

QUICK_MAX_NEW_TOKENS = 32
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class BenchConfig:
    engines: Path
    prompts: Path = DEFAULT_PROMPTS
    modes: str | None = None  # comma-separated; None = contenders.default_modes
    categories: tuple[str, ...] | None = None
    reps: int = 3
    threads: int = 0  # 0 = all cores, resolved to a number every contender gets
    quick: bool = False  # 1 prompt per category, max_new_tokens capped at 32, core modes (contenders.QUICK)
    per_category: int | None = None
    max_new_tokens: int | None = None  # cap every prompt's budget
    hf_assistant: Path | None = None
    # "listed" or "reversed". Sessions created later in the process decode faster, so whoever loads first is
    # handicapped; the report names the order (docs/design-notes.md, "Session load order").
    load_order: str = "listed"
    # every contender generates exactly max_new_tokens: tok/s then compares engines at equal lengths (two int4
    # models stop at different EOS positions, and a short answer's tok/s is mostly its prefill)
    ignore_eos: bool = False
    # each contender in a worker process of its own (bench/isolate.py): no load-order effect, nothing shared
    isolate: bool = False
    compare: tuple[Path, ...] = ()  # more engine sets, their modes named <mode>@<folder> (e.g. a portable set)


def first_divergence(ref: list[int], out: list[int]) -> int | None:
    """Index of the first token where `out` differs from `ref` (a length mismatch counts); None = equal."""
    for i, (a, b) in enumerate(zip(ref, out)):
        if a != b:
            return i
    return None if len(ref) == len(out) else min(len(ref), len(out))


def _cases(cfg: BenchConfig) -> list[PromptCase]:
    cases = load_prompts(cfg.prompts)
    per_cat = cfg.per_category if cfg.per_category is not None else (1 if cfg.quick else None)
    cap = cfg.max_new_tokens if cfg.max_new_tokens is not None else (QUICK_MAX_NEW_TOKENS if cfg.quick else None)
    return select(cases, categories=cfg.categories, per_category=per_cat, max_new_tokens=cap)


def run_bench(cfg: BenchConfig, log=print, manifest=None) -> dict:
    """Run the benchmark -> the results dict. manifest: cfg.engines' Manifest when the caller loaded it already."""
    if cfg.reps < 1:
        raise SpecrtError(f"--reps must be >= 1, got {cfg.reps}")
    if cfg.load_order not in ("listed", "reversed"):
        raise SpecrtError(f"--load-order must be 'listed' or 'reversed', got '{cfg.load_order}'")
    manifest = manifest or load_manifest(Path(cfg.engines))
    others = {Path(p).name: load_manifest(Path(p)) for p in cfg.compare}
    cases = _cases(cfg)
    names = contenders.parse_modes(cfg.modes, manifest, cfg.quick, others)
    threads = cfg.threads or os.cpu_count() or 1
    # Every contender runs with its own defaults: OMP_WAIT_POLICY is left as the caller set it (the report
    # records it). PASSIVE slowed llama.cpp 2.5-3x (docs/benchmarks-history.md, "Against llama.cpp at its own
    # defaults"); with --isolate no contender's spinning threads share a process with another's.
    from ..runtime.tokenizer import Message, TextCodec

    codec = TextCodec(manifest.root / manifest.tokenizer_file, manifest.chat_template, manifest.bos_token,
                      manifest.eos_token_ids)
    prompt_ids = {c.id: codec.encode(codec.render_chat([Message(r, t) for r, t in c.messages])) for c in cases}
    context = max(len(prompt_ids[c.id]) + c.max_new_tokens for c in cases)
    limit = manifest.engine("target", "fp32").max_context
    for c in cases:
        if len(prompt_ids[c.id]) + c.max_new_tokens > limit:
            raise SpecrtError(f"prompt {c.id!r} needs {len(prompt_ids[c.id])} + {c.max_new_tokens} tokens but the "
                              f"engines hold {limit}; shorten it, lower --max-new-tokens or rebuild with a larger "
                              "--max-context")
    ck = contenders.checkpoint(manifest, threads, cfg.hf_assistant, context, cfg.ignore_eos)
    ck.cache.mkdir(parents=True, exist_ok=True)

    live, notes = [], []
    try:
        _load(cfg, names, manifest, others, ck, cases[0], prompt_ids, live, notes, log)
        t_start = time.perf_counter()
        runs, failed = _interleave(cfg, cases, prompt_ids, live, notes, log)
    finally:
        for c in live:  # workers of --isolate (in-process contenders have nothing to close)
            if isinstance(c, Isolated):
                c.close()
    live = [c for c in live if c.name not in failed]
    runs = [r for r in runs if r["mode"] not in failed]
    # agreement against the reference's greedy output (first repetition)
    ref = {r["case"]: r["token_ids"] for r in runs if r["mode"] == contenders.REFERENCE and r["rep"] == 0}
    for r in runs:
        r["first_divergence"] = first_divergence(ref[r["case"]], r["token_ids"])
    modes = sorted((c.name for c in live), key=names.index)  # tables in the listed order, whatever the load order
    summary = summarize(runs, modes, cases)
    caveats = [] if cfg.ignore_eos else length_caveats(runs, modes, contenders.our_modes(manifest))
    meta = _meta(cfg, manifest, threads, cases, time.perf_counter() - t_start)
    if any("medusa" in (r["proposer"] or "") for r in runs):  # medusa, lookup+medusa, an auto that resolved to one
        meta["medusa"] = medusa_accuracy(manifest)
    return {"meta": meta, "notes": notes, "caveats": caveats,
            "modes": modes, "load_order": [c.name for c in live], "cases": [c.as_dict() for c in cases],
            "summary": summary, "runs": runs}


def _load(cfg: BenchConfig, names, manifest, others, ck, first: PromptCase, prompt_ids, live: list, notes: list,
          log) -> None:
    """Load and warm up every contender into `live`; one that cannot run here is a note, not a failure."""
    for name in (names if cfg.load_order == "listed" else names[::-1]):
        t0 = time.perf_counter()
        base, m = contenders.split_mode(name, manifest, others)
        c = Isolated(base, m.root, ck) if cfg.isolate else contenders.make(base, m, ck)
        loaded = False
        try:
            c.load(log=log)
            c.run(prompt_ids[first.id], first.messages, WARMUP_TOKENS)
            loaded = True
        except Exception as e:
            peer = name in contenders.PEERS
            if not (peer or isinstance(e, Unavailable)):  # our own modes must run: a bug to see
                if isinstance(e, WorkerError):
                    log(e.detail)  # the worker's traceback
                raise
            if name == contenders.REFERENCE:
                raise SpecrtError(f"the reference {name} cannot run: {e}") from None
            # a peer is someone else's code on our checkpoint: whatever it raises (llama.cpp's ValueError
            # "Failed to load model", a crash in its worker) costs its column, as a missing package does
            why = str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {_one_line(e)}"
            notes.append(f"{name}: skipped ({why})")
            log(f"skip {name}: {e}")
            continue
        finally:
            if not loaded and isinstance(c, Isolated):  # not in `live`, so run_bench's cleanup would miss it
                c.close()
        c.name = name  # `<mode>@<folder>` for another set's mode (its worker, if any, started under the base name)
        live.append(c)
        log(f"loaded {name} in {time.perf_counter() - t0:.1f}s")


def _interleave(cfg: BenchConfig, cases, prompt_ids, live: list, notes: list, log) -> tuple[list[dict], set[str]]:
    """cfg.reps x every prompt x every live contender, in a seeded random order per prompt."""
    runs, failed = [], set()
    t_start = time.perf_counter()
    order_rng = np.random.default_rng(0)
    for rep in range(cfg.reps):
        for case in cases:
            # a fresh (seeded) order per prompt: a rotation kept each mode behind the same neighbour every
            # time, and whatever that neighbour leaves behind (torch's threads, evicted caches) hit one mode
            # (docs/design-notes.md, "Bench call order")
            for c in [live[i] for i in order_rng.permutation(len(live))]:
                if c.name in failed:
                    continue
                try:
                    tr = c.run(prompt_ids[case.id], case.messages, case.max_new_tokens)
                except Exception as e:  # a peer breaking mid-run costs its column, not the whole run
                    if c.name not in contenders.PEERS:
                        if isinstance(e, WorkerError):
                            log(e.detail)
                        raise
                    failed.add(c.name)
                    notes.append(f"{c.name}: dropped, failed on {case.id} ({type(e).__name__}: {_one_line(e)})")
                    log(notes[-1])
                    continue
                runs.append({"mode": c.name, "case": case.id, "category": case.category, "rep": rep,
                             "prompt_tokens": len(prompt_ids[case.id]), "new_tokens": len(tr.token_ids),
                             "total_s": tr.total_s, "tok_s": len(tr.token_ids) / tr.total_s if tr.total_s else 0.0,
                             "ttft_s": tr.t_tokens[0] if tr.t_tokens else None,
                             "gaps_s": np.diff(tr.t_tokens).tolist(), "tau": tr.tau,
                             "acceptance": list(tr.acceptance), "rounds": tr.rounds, "drafted": list(tr.drafted),
                             "accepted": list(tr.accepted), "proposer": tr.proposer, "token_ids": tr.token_ids})
        log(f"rep {rep + 1}/{cfg.reps} done ({time.perf_counter() - t_start:.0f}s)")
    return runs, failed


def _one_line(e: Exception) -> str:
    return first_line(e, "no message")[:160]


def median_by_case(runs: list[dict], key: str) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r["case"], []).append(r[key])
    return {k: statistics.median(v) for k, v in by.items()}


def decode_tok_s(run: dict) -> float | None:
    """Tokens after the first round / time after it: decoding speed with prefill (TTFT) left out. The
    first round's tokens all arrive at TTFT (gaps of 0 between them) and are not counted."""
    ttft, gaps = run["ttft_s"], run["gaps_s"]
    first = next((i for i, g in enumerate(gaps) if g > 0), len(gaps))  # tokens after the first one in round 1
    n_after = len(gaps) - first
    return n_after / (run["total_s"] - ttft) if ttft is not None and n_after > 0 and run["total_s"] > ttft else None


def paired_speedup(runs: list[dict], ref_runs: list[dict],
                   speed=lambda r: r["tok_s"]) -> tuple[float | None, list[str]]:
    """Geometric mean over cases of the median over reps of speed(run) / speed(reference run of the same
    rep); and the cases left out because no rep has both speeds > 0 (0 new tokens: tok/s 0, whose log
    would make the mean 0; or speed None: nothing to decode after the first round)."""
    by_case = paired_ratios(runs, ref_runs, speed)
    med = [v for v in by_case.values() if v is not None]
    left_out = [c for c, v in by_case.items() if v is None]
    return (round(float(np.exp(np.mean(np.log(med)))), 3) if med else None), left_out


def paired_ratios(runs: list[dict], ref_runs: list[dict], speed=lambda r: r["tok_s"]) -> dict[str, float | None]:
    """Per case: the median over reps of speed(run) / speed(reference run of the same rep); None when no
    rep has both speeds > 0."""
    ref = {(r["case"], r["rep"]): speed(r) for r in ref_runs}
    ratios: dict[str, list[float]] = {}
    for r in runs:
        a, b = speed(r), ref.get((r["case"], r["rep"]))
        ratios.setdefault(r["case"], [])
        if a and b:  # None or 0 on either side: no ratio from this rep
            ratios[r["case"]].append(a / b)
    return {c: (statistics.median(v) if v else None) for c, v in ratios.items()}


def pooled_tau_acceptance(runs: list[dict]) -> tuple[float | None, list[float], bool]:
    """tau = tokens / target passes and acceptance at position i = kept / drafted at i, summed over runs
    (a mean of per-run rates weighs a 2-round run like a 40-round one). Runs saved before the counts
    existed (no "rounds"): the old unweighted means of per-run figures, and False for the report to say so."""
    spec = [r for r in runs if r["tau"] is not None]
    if not all(r.get("rounds") for r in spec):
        acc_rows = [r["acceptance"] for r in spec if r["acceptance"]]
        width = max((len(a) for a in acc_rows), default=0)
        acceptance = [round(statistics.mean(a[i] for a in acc_rows if len(a) > i), 4) for i in range(width)]
        return (round(statistics.mean(r["tau"] for r in spec), 3) if spec else None), acceptance, False
    if not spec:
        return None, [], True
    width = max(len(r["drafted"]) for r in spec)
    drafted, kept = np.zeros(width), np.zeros(width)
    for r in spec:  # a run's counts cover the positions it drafted at all (a prefix)
        drafted[: len(r["drafted"])] += r["drafted"]
        kept[: len(r["accepted"])] += r["accepted"]
    tau = sum(r["tau"] * r["rounds"] for r in spec) / sum(r["rounds"] for r in spec)  # tau x rounds = tokens
    return round(tau, 3), np.round(kept / drafted, 4).tolist(), True


def _figures(runs: list[dict], ref_runs: list[dict]) -> dict:
    tok = median_by_case(runs, "tok_s")
    speedup, left_out = paired_speedup(runs, ref_runs)
    decode_speedup, _ = paired_speedup(runs, ref_runs, decode_tok_s)
    gaps = [g for r in runs for g in r["gaps_s"]]
    ttft = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
    tau, acceptance, pooled = pooled_tau_acceptance(runs)
    div = {r["case"]: r["first_divergence"] for r in runs if r["rep"] == 0}
    diverged = [d for d in div.values() if d is not None]
    proposers = sorted({r["proposer"] for r in runs if r.get("proposer")})
    return {
        "cases": len(tok), "tok_s": round(statistics.mean(tok.values()), 2),
        "speedup": speedup, "decode_speedup": decode_speedup, "speedup_left_out": left_out,
        "tau": tau, "acceptance": acceptance, "pooled": pooled, "proposer": ", ".join(proposers) or None,
        "ttft_ms": round(1000 * statistics.median(ttft), 1) if ttft else None,
        "gap_p50_ms": round(1000 * float(np.percentile(gaps, 50)), 2) if gaps else None,
        "gap_p99_ms": round(1000 * float(np.percentile(gaps, 99)), 2) if gaps else None,
        "identical": f"{len(div) - len(diverged)}/{len(div)}",
        "first_divergence": min(diverged) if diverged else None,
        "new_tokens": round(statistics.mean(r["new_tokens"] for r in runs), 1),
    }


LENGTH_TOLERANCE = 0.1  # answers whose mean lengths differ by more than this fraction are different answers


def length_caveats(runs: list[dict], modes: list[str], ours: dict[str, tuple[str, str]]) -> list[str]:
    """Speculative modes whose answers differ in length from plain decoding at the same precision (an engine that
    is not width-exact: speculation changes the text, and where it stops). tok/s counts the prefill, so a shorter
    answer reads slower though it is finished sooner: such a comparison needs equal lengths (--ignore-eos).
    ours: our mode names -> (strategy, precision) (contenders.our_modes; peers are not in it)."""
    out = []
    for m in modes:
        strategy, prec = ours.get(m, ("plain", ""))
        plain = f"plain-{prec}"
        if strategy in ("plain", contenders.FULL_HEAD) or plain not in modes:
            continue
        mean = lambda mode, case: statistics.mean(  # noqa: E731
            r["new_tokens"] for r in runs if r["mode"] == mode and r["case"] == case)
        cases = sorted({r["case"] for r in runs if r["mode"] == m})
        off = [c for c in cases if abs(mean(m, c) - mean(plain, c)) > LENGTH_TOLERANCE * max(mean(plain, c), 1)]
        if off:
            out.append(f"{m}: its answers differ in length from {plain}'s on {len(off)} of {len(cases)} prompts "
                       f"({', '.join(off[:4])}{', ...' if len(off) > 4 else ''}): the {prec} engine is not "
                       "width-exact, so speculation changes the text and where it stops, and tok/s (prefill included) "
                       "then compares different answers; compare the two at equal lengths with --ignore-eos")
    return out


def summarize(runs: list[dict], modes: list[str], cases: list[PromptCase]) -> list[dict]:
    """One row per (mode, category) plus (mode, 'all')."""
    cats = list(dict.fromkeys(c.category for c in cases))
    ref = [r for r in runs if r["mode"] == contenders.REFERENCE]
    rows = []
    for m in modes:
        mine = [r for r in runs if r["mode"] == m]
        for cat in cats + ["all"]:
            sel = [r for r in mine if cat in ("all", r["category"])]
            rsel = [r for r in ref if cat in ("all", r["category"])]
            if sel:
                rows.append({"mode": m, "category": cat, **_figures(sel, rsel)})
    return rows


def medusa_accuracy(manifest) -> dict | None:
    """The heads' held-out accuracy from training (manifest: medusa.training.top1/top5, one per head; head k
    guesses the token k places past the target's next one), beside the acceptance the bench measured."""
    heads = [e for e in manifest.engines.values() if e.role == "medusa"]  # the speculative loop uses the first
    t = (heads[0].raw.get("medusa", {}).get("training") or {}) if heads else {}
    if "top1" not in t:
        return None
    return {"engine": heads[0].name, "top1": t["top1"], "top5": t.get("top5"),
            "heldout_positions": t.get("heldout_positions")}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("specrt", "onnxruntime", "onnxruntime-genai", "llama-cpp-python", "torch", "transformers", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meta(cfg: BenchConfig, manifest, threads: int, cases, bench_s: float) -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "engines": str(manifest.root), "engine_set": manifest.name,
            "prompts": str(cfg.prompts), "cases": len(cases), "reps": cfg.reps, "quick": cfg.quick,
            "threads": threads, "cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "versions": _versions(), "bench_s": round(bench_s, 1), "reference": contenders.REFERENCE,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "ignore_eos": cfg.ignore_eos,
            "isolate": cfg.isolate}
