"""Prompt sets for `specrt bench`: JSONL, one case per line.

Schema (one JSON object per line; blank lines and lines starting with `//` are skipped):

    {"id": "code-03",                      # unique string
     "category": "code",                   # one of CATEGORIES (the Spec-Bench split)
     "messages": [{"role": "user", "content": "..."}, ...],   # a chat, rendered with the
                                           # engine set's template (multi-turn allowed)
     "max_new_tokens": 128}                # > 0

Every mistake raises a one-line SpecrtError naming the file and line, and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecrtError

CATEGORIES = ("chat", "code", "summarize", "qa", "math", "translation")
DEFAULT_PROMPTS = Path(__file__).parent / "data" / "default.jsonl"
_KEYS = {"id", "category", "messages", "max_new_tokens"}


@dataclass(frozen=True)
class PromptCase:
    id: str
    category: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs
    max_new_tokens: int

    def as_dict(self) -> dict:
        return {"id": self.id, "category": self.category, "max_new_tokens": self.max_new_tokens,
                "messages": [{"role": r, "content": c} for r, c in self.messages]}


def parse_case(obj, where: str) -> PromptCase:
    """One decoded JSON value -> PromptCase; `where` is "file:line" for the error message."""
    if not isinstance(obj, dict):
        raise SpecrtError(f"{where}: expected a JSON object with keys {sorted(_KEYS)}")
    missing, extra = _KEYS - obj.keys(), obj.keys() - _KEYS
    if missing:
        raise SpecrtError(f"{where}: missing key(s) {sorted(missing)}; each line needs {sorted(_KEYS)}")
    if extra:
        raise SpecrtError(f"{where}: unknown key(s) {sorted(extra)}; allowed keys are {sorted(_KEYS)}")
    if not isinstance(obj["id"], str) or not obj["id"]:
        raise SpecrtError(f'{where}: "id" must be a non-empty string')
    if obj["category"] not in CATEGORIES:
        raise SpecrtError(f'{where}: unknown category {obj["category"]!r}; use one of {", ".join(CATEGORIES)}')
    n = obj["max_new_tokens"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecrtError(f'{where}: "max_new_tokens" must be a positive integer, got {n!r}')
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise SpecrtError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(msgs):
        if (not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["role"], str)
                or not isinstance(m["content"], str)):
            raise SpecrtError(f'{where}: message {i} must be {{"role": str, "content": str}} and nothing else')
        if m["role"] not in ("system", "user", "assistant"):
            raise SpecrtError(f'{where}: message {i} has role {m["role"]!r}; use system, user or assistant')
    if msgs[-1]["role"] != "user":
        raise SpecrtError(f"{where}: the last message must have role 'user' (the model answers it)")
    return PromptCase(obj["id"], obj["category"], tuple((m["role"], m["content"]) for m in msgs), n)


def load_prompts(path: Path) -> list[PromptCase]:
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise SpecrtError(f"prompt file '{path}' not found; pass an existing JSONL file to --prompts") from None
    except IsADirectoryError:
        raise SpecrtError(f"prompt file '{path}' is a folder; pass a JSONL file to --prompts") from None
    except UnicodeDecodeError:
        raise SpecrtError(f"prompt file '{path}' is not UTF-8; re-save it as UTF-8") from None
    cases, seen = [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecrtError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); "
                              "each line must be one complete JSON object") from None
        case = parse_case(obj, where)
        if case.id in seen:
            raise SpecrtError(f"{where}: duplicate id {case.id!r} (first on line {seen[case.id]}); make ids unique")
        seen[case.id] = lineno
        cases.append(case)
    if not cases:
        raise SpecrtError(f"prompt file '{path}' has no prompts; add JSONL lines like "
                          '{"id": "c1", "category": "chat", "messages": [...], "max_new_tokens": 64}')
    return cases


def select(cases: list[PromptCase], *, categories: tuple[str, ...] | None = None,
           per_category: int | None = None, max_new_tokens: int | None = None) -> list[PromptCase]:
    """Filter by category, keep the first `per_category` of each, cap max_new_tokens (file order kept)."""
    if categories is not None:
        bad = [c for c in categories if c not in CATEGORIES]
        if bad:
            raise SpecrtError(f"unknown category {bad[0]!r}; use one of {', '.join(CATEGORIES)}")
    counts: dict[str, int] = {}
    out = []
    for c in cases:
        if categories is not None and c.category not in categories:
            continue
        counts[c.category] = counts.get(c.category, 0) + 1
        if per_category is not None and counts[c.category] > per_category:
            continue
        if max_new_tokens is not None and c.max_new_tokens > max_new_tokens:
            c = PromptCase(c.id, c.category, c.messages, max_new_tokens)
        out.append(c)
    if not out:
        raise SpecrtError("no prompts left after filtering; check --categories against the prompt file")
    return out
