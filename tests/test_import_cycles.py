"""No import circles in specrt/, runtime/, build/, export/ or bench/ (docs/architecture.md, "No import circles").

The graph is read statically (ast, no import runs): an edge A -> B for every import in A that names module B,
at module level, inside functions and under `if TYPE_CHECKING:` alike (a lazy import only hides a circle).
`from pkg import name` points at pkg.name where that is a module, else at pkg; importing pkg.mod does not add an
edge to pkg's own __init__ (the package is a folder, not a dependency of its members)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"specrt": "specrt", "runtime": "specrt.runtime", "build": "specrt.build", "export": "specrt.export",
         "bench": "specrt.bench"}


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file of every module under the roots (a package by its __init__.py)."""
    out = {}
    for folder, package in ROOTS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _imported(node, name: str, is_package: bool) -> list[str]:
    """The dotted modules one import statement of module `name` names (before filtering to ours)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = (name if is_package else name.rpartition(".")[0]).split(".")
    if node.level:
        base = base[:len(base) - node.level + 1]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    return [pkg] + [f"{pkg}.{a.name}" for a in node.names]


def graph(repo: Path = REPO) -> dict[str, set[str]]:
    mods = modules(repo)
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        out = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                named = _imported(node, name, path.name == "__init__.py")
                subs = [m for m in named[1:] if m in mods] if isinstance(node, ast.ImportFrom) else []
                out.update(subs or [m for m in named[:1 if isinstance(node, ast.ImportFrom) else None] if m in mods])
        out.discard(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return found


def test_no_import_circles():
    assert cycles(graph()) == []


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (in `if`/`try` blocks too): defs, classes, assignments, imports."""
    out, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + [
                n for h in getattr(node, "handlers", []) for n in h.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def missing_names(repo: Path = REPO) -> list[str]:
    """Each `from specrt.x import name` (or relative) whose module is not ours or does not define the name."""
    mods = modules(repo)
    defined = {name: _defined(ast.parse(path.read_text())) for name, path in mods.items()}
    missing = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            pkg, *subs = _imported(node, name, path.name == "__init__.py")
            if node.level == 0 and not pkg.startswith("specrt."):
                continue
            if pkg not in mods:
                missing.append(f"{path.relative_to(repo)}:{node.lineno} {pkg}")
                continue
            missing += [f"{path.relative_to(repo)}:{node.lineno} {sub}" for sub in subs
                        if sub not in mods and sub.rpartition(".")[2] not in defined[pkg] | {"*"}]
    return missing


def test_every_import_of_ours_names_what_exists():
    """A moved name fails here, not in the one command that imports it lazily."""
    assert missing_names() == []


def test_the_check_sees_a_circle(tmp_path):
    for folder in ROOTS:
        (tmp_path / folder).mkdir()
    (tmp_path / "runtime" / "sub").mkdir()
    (tmp_path / "runtime" / "sub" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "sub" / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "runtime" / "sub" / "b.py").write_text("from ..c import h\n")
    (tmp_path / "runtime" / "c.py").write_text("from specrt.runtime.sub import a\nfrom ..errors import E\n")
    (tmp_path / "specrt" / "errors.py").write_text("import os\n")
    edges = graph(tmp_path)
    assert edges["specrt.runtime.sub.b"] == {"specrt.runtime.c"}
    assert edges["specrt.runtime.c"] == {"specrt.runtime.sub.a", "specrt.errors"}
    assert cycles(edges) == [["specrt.runtime.c", "specrt.runtime.sub.a", "specrt.runtime.sub.b"]]
    (tmp_path / "specrt" / "errors.py").write_text("import os\nif os.name:\n    E = 1\n")
    (tmp_path / "specrt" / "cli.py").write_text("def f():\n    from .errors import E, F\n    from .gone import G\n"
                                                 "    from .runtime.sub import a, z\n")
    assert [m for m in missing_names(tmp_path) if m.startswith("specrt/")] == [
        "specrt/cli.py:2 specrt.errors.F", "specrt/cli.py:3 specrt.gone", "specrt/cli.py:4 specrt.runtime.sub.z"]
