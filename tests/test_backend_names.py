"""A backend is a row in specrt/backends.py (docs/architecture.md, "The runtime core sees engines through one
contract"): outside that file no code compares anything with a backend's name (`x == "tensorrt"`, `x in
("onnxruntime", ...)`, `match` cases); what differs between backends is a flag of its descriptor. A static check
of every comparison in specrt/, runtime/, build/, export/ and bench/ (names used as values, e.g. a default
backend or a label, are not branches)."""

from __future__ import annotations

import ast
from pathlib import Path

from specrt.backends import BACKENDS

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("specrt", "runtime", "build", "export", "bench")
ALLOWED = {Path("specrt/backends.py")}


def _names(node) -> set[str]:
    """The backend names a comparison's operand spells out (a string, or a tuple, list or set of them)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in BACKENDS}


def branches(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            names = set().union(*(_names(n) for n in (node.left, *node.comparators)))
        elif isinstance(node, ast.match_case):
            names = {n.value.value for n in ast.walk(node.pattern)
                     if isinstance(n, ast.MatchValue) and isinstance(n.value, ast.Constant)
                     and n.value.value in BACKENDS}
        else:
            continue
        out += [f"{path.relative_to(REPO)}:{node.lineno if hasattr(node, 'lineno') else node.pattern.lineno} "
                f"{sorted(names)}"] if names else []
    return out


def test_no_code_branches_on_a_backend_name():
    found = [b for folder in FOLDERS for p in sorted((REPO / folder).rglob("*.py"))
             if p.relative_to(REPO) not in ALLOWED for b in branches(p)]
    assert found == []


def test_the_check_sees_a_branch(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    f = tmp_path / "a.py"
    f.write_text('if backend == "tensorrt":\n    pass\nok = b in ("onnxruntime-cuda", "x")\nlabel = "reference"\n'
                 'match name:\n    case "onnxruntime":\n        pass\nif runner == "onnxrt-cpu":\n    pass\n')
    assert branches(f) == ["a.py:1 ['tensorrt']", "a.py:3 ['onnxruntime-cuda']", "a.py:6 ['onnxruntime']"]
