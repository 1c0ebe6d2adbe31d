"""docs/architecture.md, "Stages meet only through files". runtime/ imports nothing from export/ or build/, build/
nothing from export/ or runtime/, export/ nothing from build/ or runtime/; what they share (the graph's
interface, text corpora, errors, the manifest) lives in specrt/ itself. A static check of every import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"runtime": {"export", "build"}, "build": {"export", "runtime"}, "export": {"build", "runtime"}}


def _stage_imports(path: Path, stage: str) -> set[str]:
    """The other stages a file of `stage` imports (relative `..x` or absolute `specrt.x`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            depth = len(path.relative_to(REPO / stage).parts)   # runtime/x.py: 1, runtime/proposers/x.py: 2
            if node.level == depth + 1 and node.module:         # from ..export.graph (out of the stage)
                out.add(node.module.split(".")[0])
            elif node.level == 0 and (node.module or "").startswith("specrt."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("specrt.")}
    return out


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_stages_do_not_import_each_other(stage):
    bad = {str(p.relative_to(REPO)): sorted(_stage_imports(p, stage) & FORBIDDEN[stage])
           for p in sorted((REPO / stage).rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    (tmp_path / "build" / "sub").mkdir(parents=True)
    (tmp_path / "build" / "sub" / "a.py").write_text("from ...runtime.engine import X\nfrom ..gptq import Y\n")
    assert _stage_imports(tmp_path / "build" / "sub" / "a.py", "build") == {"runtime"}


# The runtime core sees engines only through runtime/engine.py's contract and registry (docs/architecture.md,
# "The runtime core sees engines through one contract").
CORE = ["speculative.py", "verify.py", "generate.py", "sampling.py", "control.py", "tree.py", "session.py",
        "plan.py", "tokenizer.py", "engine.py", "proposers"]


def _backend_imports(path: Path) -> set[str]:
    """Backend modules (runtime/backends/<x>) and backend libraries a file imports; the registry itself
    (`from .backends import backend`) is the one allowed way in."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            names = [f"{node.module}.{a.name}" for a in node.names] if parts[-1] == "backends" else [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            parts = n.split(".")
            after = parts[parts.index("backends") + 1:] if "backends" in parts else []
            if parts[0] in ("onnxruntime", "tensorrt", "cuda") or (after and after != ["backend"]):
                found.add(n)
    return found


def test_the_runtime_core_imports_no_backend_module():
    files = [p for c in CORE
             for p in ([REPO / "runtime" / c] if c.endswith(".py") else (REPO / "runtime" / c).rglob("*.py"))]
    bad = {str(p.relative_to(REPO)): _backend_imports(p) for p in files}
    assert not {k: v for k, v in bad.items() if v}
    # the check sees one
    assert _backend_imports(REPO / "runtime" / "backends" / "onnxruntime_cpu" / "session.py") == {"onnxruntime"}
    assert "specrt.runtime.backends.reference" in _backend_imports(REPO / "tests" / "test_backends.py")
