"""The GPU check (run it through tests/gpu/check.sh): does each GPU backend build, open, match the CPU, replay its
CUDA graphs faithfully, and how fast is it. One summary table, also written as JSON with --json PATH.

1. the reference: --engines DIR (an onnxruntime-portable set), or one built here with `specrt engines --backend
   onnxruntime-portable` from --source (default: a tiny random Llama from tests/tiny.py, with a noisy copy of
   it as --draft), fp32, fp16 and the Q/DQ precisions QDQ; a set carried from elsewhere needs no export
   toolchain here;
2. the GPU sets, made from the reference's portable graphs: onnxruntime-cuda (the same files, its own manifest)
   where onnxruntime-gpu has CUDA; tensorrt (build/tensorrt.py on each graph) where tensorrt imports;
   tensorrt-rtx (the same, by TensorRT for RTX for this GPU's architecture) where it imports and the GPU is one it
   supports (sm75-sm121: not Hopper; the cell says so);
3. per backend: parity against the CPU fp32 engine (teacher-forced greedy agreement over STEPS tokens and max
   |Δlogit|, at fp32 and fp16; each Q/DQ engine against the CPU running its own graph); CUDA-graph replay (a
   script of passes at changing lengths, widths, a tree and a capacity change, against the same script with
   SPECRT_CUDA_GRAPHS=0: max |Δ|); ms per greedy pass at widths 1 and 8 with and without graphs; 4 streams at
   once (--parallel 4) against the same answers one by one (identical tokens, throughput ratio); tokens/s
   speedup of prompt lookup and of the draft model over plain decoding.

Every cell is computed on its own: a failure or a missing library reads "failed: ..." or "skipped: ..." there and
the rest goes on. Past the time budget (--budget, default 540 s) the remaining cells read "skipped: out of time".
Only the public runtime API is used (runtime.session.load, runtime.engine.open_engine and the Engine contract);
SPECRT_CUDA_GRAPHS=0 (read when an engine opens) is how the no-graph engines are opened.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
STEPS = 64
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 4 + "def add(a, b):"
NO_GPU = "gpu check: no NVIDIA GPU here ({}); nothing to check"
QDQ = ("fp8", "int4-awq")  # does a GPU's kernel give a Q/DQ graph's own numerics (the CPU runs it as written)
# Imports specrt from this checkout whether or not it is installed (the package maps specrt.runtime to runtime/...).
SHIM = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import specrt; "
        f"specrt.__path__.append({str(REPO)!r}); ")
exec(SHIM)


def gpus() -> tuple[int, str]:
    """(CUDA devices, why none): cuda-bindings first, then torch."""
    from specrt.runtime.backends.device.memory import device_count

    n, why = device_count()
    if n:
        return n, ""
    try:
        import torch
    except ImportError:
        return 0, why
    if torch.cuda.is_available():  # the backends will say what they miss (cuda-bindings, say)
        return torch.cuda.device_count(), ""
    return 0, "neither cuda-bindings nor torch sees a CUDA device"


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Table:
    """rows x columns of short strings; `cell` runs one measurement and records its value or why it has none."""

    def __init__(self, budget: Budget):
        self.rows: dict[str, dict[str, str]] = {}
        self.details: dict[str, object] = {}
        self.budget = budget

    def cell(self, row: str, col: str, fn, need_s: float = 5.0):
        if self.budget.left() < need_s:
            value, result = "skipped: out of time", None
        else:
            try:
                result = fn()
                value = result if isinstance(result, str) else _fmt(result)
            except Skip as e:
                value, result = f"skipped: {e}", None
            except Exception as e:  # a cell's failure is that cell's value
                value, result = f"failed: {type(e).__name__}: {_line(e)}", None
        self.rows.setdefault(row, {})[col] = value
        print(f"  {row} / {col}: {value}", file=sys.stderr, flush=True)
        return result

    def render(self) -> str:
        cols = sorted({c for r in self.rows.values() for c in r}, key=COLUMNS.index)
        width = [max(len("check"), *map(len, self.rows))] + [
            max(len(c), *(len(r.get(c, "")) for r in self.rows.values())) for c in cols]
        line = lambda cells: " | ".join(s.ljust(w) for s, w in zip(cells, width))  # noqa: E731
        out = [line(["check", *cols]), "-+-".join("-" * w for w in width)]
        out += [line([row, *(vals.get(c, "") for c in cols)]) for row, vals in self.rows.items()]
        return "\n".join(out)


class Skip(Exception):
    pass


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else "")[:160]


def _fmt(x) -> str:
    if isinstance(x, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in x.items())
    if isinstance(x, float):
        return f"{x:.3g}"
    return getattr(x, "description", str(x))  # an engine: what it runs on


COLUMNS = ["onnxruntime-portable (CPU)", "onnxruntime-cuda", "tensorrt", "tensorrt-rtx"]


def specrt_cli(args: list[str], timeout: float) -> str:
    """Run `specrt ARGS` from this checkout -> its last stdout line; a failure raises with its last stderr line."""
    r = subprocess.run([sys.executable, "-c", SHIM + "from specrt.cli import app; app()", *args],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError((r.stderr.strip().splitlines() or ["no output"])[-1])
    return r.stdout.strip().splitlines()[-1]


def build_reference(args, work: Path, budget: Budget) -> Path:
    """The CPU portable set: --engines, else built from --source (default: tiny checkpoints)."""
    if args.engines:
        return Path(args.engines)
    source, draft = args.source, args.draft
    if source is None:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny import make_checkpoint

        source = str(make_checkpoint(work / "tiny-llama", "llama", seed=0))
        draft = draft or str(make_checkpoint(work / "tiny-draft", "llama", seed=0, noise=0.2))  # agrees at times
    cmd = ["engines", "--source", source, "--backend", "onnxruntime-portable", "--precisions",
           ",".join(("fp32", "fp16") + QDQ),
           "--max-context", str(args.max_context), "--out", str(work / "sets"), "--name", "reference",
           "--medusa-heads", "none"] + (["--draft", draft] if draft else [])
    return Path(specrt_cli(cmd, timeout=max(budget.left() - 120, 60)))


def derive_set(ref: Path, out: Path, backend: str, convert=None) -> Path:
    """A copy of the reference set whose target/draft engines run on `backend`: files linked, the manifest
    rewritten; convert(entry_dict, out) -> entry_dict may build new files (TensorRT), None leaves the engine out."""
    out.mkdir(parents=True, exist_ok=True)
    for f in ref.iterdir():
        if f.is_file() and f.name != "manifest.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    manifest = json.loads((ref / "manifest.json").read_text())
    for name, entry in list(manifest["engines"].items()):
        if entry["role"] in ("target", "draft") and entry["backend"] == "onnxruntime-portable":
            entry["backend"] = backend
            made = convert(entry, out) if convert is not None else {}
            if made is None:  # this backend cannot build it here: its cells say the set has no such engine
                del manifest["engines"][name]
            else:
                entry.update(made)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def tensorrt_entry(entry: dict, out: Path) -> dict:
    from specrt.build.tensorrt import build_engine

    engine = out / (Path(entry["file"]).stem + ".engine")
    facts = build_engine(out / entry["file"], engine, max_prompt=min(entry["max_context"], 2048), max_width=64,
                         max_capacity=entry["max_context"] + 64, timing_cache=out / "tensorrt.cache")
    return {"file": engine.name, "files": [engine.name], "build": {**(entry.get("build") or {}), **facts}}


def tensorrt_rtx_entry(entry: dict, out: Path) -> dict | None:
    """None for a precision TensorRT for RTX does not compile for this GPU (fp8 before Ada, ...): left out."""
    from specrt.build.tensorrt import ARCH_LACKS, TENSORRT_RTX, build_engine
    from specrt.runtime.backends.device.memory import compute_capability

    engine = out / (Path(entry["file"]).stem + ".engine")
    arch = "sm" + compute_capability(0).replace(".", "")
    if entry["precision"] in ARCH_LACKS.get(arch, {}):
        return None
    facts = build_engine(out / entry["file"], engine, max_prompt=min(entry["max_context"], 2048), max_width=64,
                         max_capacity=entry["max_context"] + 64, compiler=TENSORRT_RTX, gpu_archs=(arch,))
    return {"file": engine.name, "files": [engine.name], "build": {**(entry.get("build") or {}), **facts}}


def open_entry(root: Path, role: str, precision: str, graphs: bool = True):
    from specrt.manifest import load_manifest
    from specrt.runtime.engine import EngineOptions, open_engine

    entry = load_manifest(root).engine(role, precision)
    os.environ["SPECRT_CUDA_GRAPHS"] = "1" if graphs else "0"  # read when the engine opens
    try:
        return open_engine(root, entry, EngineOptions(huge_pages=False))
    finally:
        os.environ.pop("SPECRT_CUDA_GRAPHS", None)


def close(engine) -> None:
    getattr(engine, "close", lambda: None)()


def prompt_ids(root: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    return np.array(Tokenizer.from_file(str(root / "tokenizer.json")).encode(PROMPT).ids, np.int64)


def parity(ref, eng, prompt: np.ndarray) -> dict:
    """Teacher-forced greedy decoding of STEPS tokens on both (the reference's tokens feed both): agreement, max
    |Δlogit|."""
    for e in (ref, eng):
        e.rewind(0)
        e.reserve(len(prompt) + STEPS + 1)
    logits = [e.forward(prompt).copy() for e in (ref, eng)]
    agree, worst = 0, float(np.abs(logits[0] - logits[1]).max())
    for e in (ref, eng):
        e.commit(len(prompt))
    for _ in range(STEPS):
        token = int(logits[0][-1].argmax())
        agree += int(logits[1][-1].argmax()) == token
        logits = [e.forward(np.array([token])).copy() for e in (ref, eng)]
        worst = max(worst, float(np.abs(logits[0] - logits[1]).max()))
        for e in (ref, eng):
            e.commit(1)
    return {"agree": f"{agree}/{STEPS}", "max|Δ|": worst}


def replay_script(e, vocab: int, prompt: np.ndarray) -> list[np.ndarray]:
    """Passes at changing lengths, widths (each bucket twice: captured, then replayed), a token tree, partial
    accepts, a capacity change and a rewind; every output copied."""
    rng, out = np.random.default_rng(0), []
    e.rewind(0)
    e.reserve(len(prompt) + 64)
    out.append(e.forward(prompt, num_logits=3).copy())
    e.commit(len(prompt))
    for w in (1, 1, 1, 2, 3, 5, 8, 8, 1, 16, 16, 1, 4):
        out.append(e.forward(rng.integers(0, vocab, w), num_logits=w).copy())
        e.commit(int(rng.integers(1, w + 1)))
    parents_mask = np.where(np.tril(np.ones((5, 5))) * np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                                                   [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]), 0, -np.inf)
    for _ in range(2):
        out.append(e.forward(rng.integers(0, vocab, 5), e.length + np.array([0, 1, 1, 2, 2]),
                             parents_mask.astype(np.float32), num_logits=5).copy())
        e.commit(3, np.array([0, 2, 4]))
    long = min(250, e.max_context - e.length - 40)  # past the first capacity bucket: the cache moves
    out.append(e.forward(rng.integers(0, vocab, long), num_logits=1).copy())
    e.commit(long)
    for w in (1, 4, 1, 8):
        out.append(e.argmax(rng.integers(0, vocab, w), num_logits=w).copy())
        e.commit(1)
    e.rewind(10)
    for w in (1, 2, 1):
        out.append(e.forward(rng.integers(0, vocab, w), num_logits=w).copy())
        e.commit(w)
    return out


def graph_replay(root: Path, precision: str, prompt: np.ndarray) -> dict:
    runs = []
    for graphs in (True, False):
        e = open_entry(root, "target", precision, graphs)
        try:
            runs.append((e.description, replay_script(e, e.vocab_size, prompt)))
        finally:
            close(e)
    if "no CUDA graphs" in runs[0][0]:
        raise Skip(runs[0][0])
    worst = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(runs[0][1], runs[1][1]))
    return {"passes": len(runs[0][1]), "max|Δ|": worst, "equal": worst == 0.0}


def ms_per_pass(root: Path, precision: str, graphs: bool) -> str:
    e = open_entry(root, "target", precision, graphs)
    try:
        got = []
        for width in (1, 8):
            tokens = np.ones(width, np.int64)
            e.rewind(0)
            e.reserve(64)
            e.argmax(np.arange(16, dtype=np.int64))
            e.commit(16)
            for _ in range(5):  # warm-up (and capture)
                e.argmax(tokens, num_logits=width)
            t0 = time.perf_counter()
            for _ in range(100):
                e.argmax(tokens, num_logits=width)
            got.append(f"W={width} {(time.perf_counter() - t0) * 10:.3f}")
        return ", ".join(got)
    finally:
        close(e)


def speedup(root: Path, precision: str, mode: str, cache: dict) -> dict:
    """tok/s of `mode` over plain decoding (same target, 128 new tokens, greedy), and its tau."""
    from specrt.manifest import load_manifest
    from specrt.runtime.engine import EngineOptions
    from specrt.runtime.session import load

    manifest = load_manifest(root)
    if mode == "draft" and "draft" not in manifest.roles:
        raise Skip("the set has no draft model")
    shared = cache.setdefault("shared", {})
    result = {}
    for m in ("off", mode):
        if m in cache:
            result[m] = cache[m]
            continue
        session = load(manifest, precision, m, EngineOptions(huge_pages=False), shared=shared)
        session.generate(PROMPT, max_new_tokens=16, ignore_eos=True)  # warm-up: graphs, lazy init
        stats = session.generate(PROMPT, max_new_tokens=128, ignore_eos=True).stats
        result[m] = cache[m] = stats
    off, on = result["off"], result[mode]
    return {"x": on.tok_s / off.tok_s, "tau": on.tau, "tok/s": f"{off.tok_s:.0f}->{on.tok_s:.0f}"}


def parallel(root: Path, precision: str, streams: int = 4) -> dict:
    """`streams` greedy answers at once (--parallel) against the same answers one after another: tokens identical
    to each stream's answer alone, and the throughput ratio."""
    import threading

    from specrt.manifest import load_manifest
    from specrt.runtime.engine import EngineOptions
    from specrt.runtime.session import load

    manifest, options = load_manifest(root), EngineOptions(huge_pages=False)
    prompts = [PROMPT.replace("add", f"add{i}") for i in range(streams)]
    alone = load(manifest, precision, "off", options)
    alone.generate(PROMPT, max_new_tokens=8, ignore_eos=True)  # warm-up
    t = time.perf_counter()
    want = [alone.generate(p, max_new_tokens=64, ignore_eos=True).token_ids for p in prompts]
    one_by_one = time.perf_counter() - t
    del alone
    batched = load(manifest, precision, "off", options, parallel=streams)
    batched.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    got: list = [None] * streams

    def one(i):
        got[i] = batched.generate(prompts[i], max_new_tokens=64, ignore_eos=True).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    together = time.perf_counter() - t
    return {"x": one_by_one / together, "identical": f"{sum(a == b for a, b in zip(got, want))}/{streams}"}


def environment() -> dict[str, str]:
    """The GPU, driver and the libraries the backends need, as found."""
    out = {}
    for name, fn in (
            ("gpu", lambda: subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()),
            ("onnxruntime", lambda: (lambda ort: f"{ort.__version__} {ort.get_available_providers()}")(
                __import__("onnxruntime"))),
            ("tensorrt", lambda: __import__("tensorrt").__version__),
            ("tensorrt-rtx", lambda: __import__("tensorrt_rtx_bindings").__version__),
            ("cuda-bindings", lambda: __import__("cuda.bindings", fromlist=["x"]).__version__),
            ("torch", lambda: __import__("torch").__version__)):
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = f"missing ({type(e).__name__}: {_line(e)})"
    return out


def run(args, table: Table, work: Path, budget: Budget) -> None:
    """Fill the table: the reference set, the GPU sets, then each measurement per backend (section 3 above)."""
    import onnxruntime as ort

    from specrt.manifest import load_manifest

    cpu, cuda, trt, rtx = COLUMNS
    ref = table.cell("build/open", cpu, lambda: build_reference(args, work, budget), need_s=60)
    if ref is None:
        return

    def make_cuda():
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Skip(f"onnxruntime {ort.__version__} has no CUDA provider (carry onnxruntime-gpu)")
        return derive_set(ref, work / "sets" / "cuda", "onnxruntime-cuda")

    def make_trt():
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            raise Skip("tensorrt is not installed") from None
        return derive_set(ref, work / "sets" / "tensorrt", "tensorrt", tensorrt_entry)

    def make_rtx():
        from specrt.build.tensorrt import GPU_ARCHS
        from specrt.runtime.backends.device.memory import compute_capability

        try:
            import tensorrt_rtx_bindings  # noqa: F401
        except ImportError:
            raise Skip("tensorrt-rtx is not installed (pip install '.[tensorrt-rtx]')") from None
        here = compute_capability(0)
        if "sm" + here.replace(".", "") not in GPU_ARCHS:
            raise Skip(f"TensorRT for RTX does not run on compute capability {here} (it targets "
                       f"{', '.join(GPU_ARCHS)})")
        return derive_set(ref, work / "sets" / "tensorrt-rtx", "tensorrt-rtx", tensorrt_rtx_entry)

    sets = {cpu: ref, cuda: table.cell("build/open", cuda, make_cuda, need_s=30),
            trt: table.cell("build/open", trt, make_trt, need_s=30),
            rtx: table.cell("build/open", rtx, make_rtx, need_s=30)}
    sets = {col: root for col, root in sets.items() if isinstance(root, Path)}
    for col, root in sets.items():
        table.rows["build/open"][col] = "built " + root.name
    prompt = prompt_ids(ref)
    reference = table.cell("parity fp32 vs CPU fp32", cpu, lambda: open_entry(ref, "target", "fp32"))
    if reference is not None:
        table.rows["parity fp32 vs CPU fp32"][cpu] = "(the reference)"

    def check_parity(col: str, root: Path, p: str):
        if reference is None:
            raise Skip("no reference engine")
        e = open_entry(root, "target", p)
        try:
            table.details[f"{col} {p}"] = e.description
            return parity(reference, e, prompt)
        finally:
            close(e)

    def check_qdq(col: str, root: Path, p: str):
        """The GPU engine of a Q/DQ graph against the CPU running the same graph as written."""
        if p not in {e.precision for e in load_manifest(ref).engines.values()}:
            raise Skip(f"the reference set has no {p} engine")
        cpu_p, e = open_entry(ref, "target", p), open_entry(root, "target", p)
        try:
            return parity(cpu_p, e, prompt)
        finally:
            close(e)
            close(cpu_p)

    gpu_sets = {col: root for col, root in sets.items() if col != cpu}
    for col, root in gpu_sets.items():
        for p in ("fp32", "fp16"):
            table.cell(f"parity {p} vs CPU fp32", col, lambda: check_parity(col, root, p), need_s=20)
        for p in QDQ:
            table.cell(f"parity {p} vs CPU {p} (same graph)", col, lambda: check_qdq(col, root, p), need_s=20)
        table.cell("graph replay = no graphs (fp16)", col, lambda: graph_replay(root, "fp16", prompt), need_s=30)
    for col, root in sets.items():
        for graphs in (True, False) if col != cpu else (False,):
            table.cell(f"ms/pass fp16, {'graphs' if graphs else 'no graphs'}", col,
                       lambda: ms_per_pass(root, "fp16", graphs), need_s=20)
    for col, root in sets.items():
        table.cell("4 streams (--parallel 4) vs one by one (fp16)", col, lambda: parallel(root, "fp16"), need_s=40)
    for col, root in sets.items():
        runs: dict = {}  # plain decoding's stats, measured once per backend
        for mode in ("prompt-lookup", "draft"):
            table.cell(f"speedup {mode} (fp16)", col, lambda: speedup(root, "fp16", mode, runs), need_s=40)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", help="an onnxruntime-portable engine set (default: build a tiny one)")
    ap.add_argument("--source", help="checkpoint to build the reference from (default: tiny random Llama)")
    ap.add_argument("--draft", help="draft checkpoint for the reference set")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--json", help="write the table here as JSON")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check")
    args = ap.parse_args()
    n, why = gpus()
    if not n:
        print(NO_GPU.format(why or "no CUDA device"))
        return 0
    budget = Budget(args.budget)
    table = Table(budget)
    table.details.update(environment())
    work = Path(tempfile.mkdtemp(prefix="specrt-gpu-check-"))
    try:
        run(args, table, work, budget)
    except Exception as e:  # whatever broke outside a cell: the table so far, and what broke
        table.rows.setdefault("the check itself", {})[COLUMNS[0]] = f"failed: {type(e).__name__}: {_line(e)}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table.render())
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table.rows, "details": table.details}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
