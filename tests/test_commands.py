"""The CLI's plumbing (specrt/cli/commands.py): every user mistake is one `error:` line and exit 2, from the command
class alone; the command modules import without specrt.cli.main; a command makes its plan (the manifest loaded,
the target looked up, 'auto' resolved: runtime/plan.py) once."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest
import typer
from typer.testing import CliRunner

from specrt.cli.commands import Command, Group
from specrt.errors import SpecrtError

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
COMMAND_MODULES = ("specrt.cli.main", "specrt.cli.serve", "specrt.server.ray_serve", "specrt.bench.command",
                   "specrt.cli.generate", "specrt.cli.train")


def one_error_line(r, *words):
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_each_command_module_imports_first_and_without_the_cli(module):
    code = f"import sys, {module}\nassert {module!r} == 'specrt.cli.main' or 'specrt.cli.main' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=120)


def test_the_commands_fail_in_one_line_without_the_cli():
    code = """
import sys
import typer
from typer.testing import CliRunner
from specrt.bench.command import bench, bench_serve
from specrt.cli.commands import Command, Group
from specrt.cli.generate import generate
from specrt.server.ray_serve import serve_ray
from specrt.cli.serve import serve

app = typer.Typer(cls=Group)
for fn in (bench, bench_serve, generate, serve, serve_ray):
    app.command(name=fn.__name__, cls=Command)(fn)
for args, says in ((["generate"], "exactly one of --prompt"), (["serve", "--port", "0"], "--port must be in"),
                   (["serve_ray", "--replicas", "0"], "--replicas must be >= 1"),
                   (["bench", "--hf-assistant", "/nonexistent"], "--hf-assistant"),
                   (["bench_serve", "--health-timeout", "0"], "--health-timeout must be > 0")):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and r.output.startswith("error: ") and says in r.output, (args, r.output)
assert "specrt.cli.main" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=120)


def _app(fn):
    app = typer.Typer(cls=Group, add_completion=False, pretty_exceptions_enable=False)
    app.command(cls=Command)(fn)
    app.command(name="other", cls=Command)(lambda: None)
    return app


@pytest.mark.parametrize("raised, says", [
    (SpecrtError("the engines are gone; rebuild them"), "error: the engines are gone; rebuild them"),
    (ValueError("top_p must be in (0, 1]\nmore detail"), "error: top_p must be in (0, 1]"),
    (KeyboardInterrupt(), "error: interrupted"),
    (OSError(errno.ENOSPC, "No space left on device", "/x/model.onnx.data"), "error: no space left on the disk "
                                                                            "holding '/x/model.onnx.data'"),
    (RuntimeError("onnxruntime: No space left on device"), "error: no space left on the disk;"),
])
def test_the_command_class_turns_user_mistakes_into_one_line(raised, says):
    def run():
        raise raised

    line = one_error_line(CliRunner().invoke(_app(run), ["run"]))
    assert line.startswith(says), line


def test_other_failures_are_not_hidden():
    def run():
        raise RuntimeError("a bug")

    r = CliRunner().invoke(_app(run), ["run"])
    assert isinstance(r.exception, RuntimeError) and r.exit_code == 1


def test_bad_flags_are_one_line_in_the_words_of_the_checks_by_hand():
    def run(n: int = typer.Option(1, "--n", "-n", min=1), port: int = typer.Option(80, "--port", min=1, max=65535),
            x: float = typer.Option(0.0, "--x", max=1.0)):
        pass

    app = _app(run)
    one_error_line(CliRunner().invoke(app, ["run", "-n", "0"]), "--n must be >= 1, got 0")
    one_error_line(CliRunner().invoke(app, ["run", "--port", "70000"]), "--port must be in 1..65535, got 70000")
    one_error_line(CliRunner().invoke(app, ["run", "--x", "2"]), "--x must be <= 1.0, got 2")
    one_error_line(CliRunner().invoke(app, ["run", "--n", "two"]), "'--n'", "integer")
    one_error_line(CliRunner().invoke(app, ["run", "--bogus"]), "No such option: --bogus")
    one_error_line(CliRunner().invoke(app, ["rnu"]), "No such command 'rnu'", "run")
    one_error_line(CliRunner().invoke(app, ["--bogus"]), "No such option: --bogus")


def test_specrt_flags_checked_by_typer():
    from specrt.cli import app

    for args, says in ((["info", "--parallel", "0"], "--parallel must be >= 1, got 0"),
                       (["generate", "--prompt", "hi", "--max-new-tokens", "0"],
                        "--max-new-tokens must be >= 1, got 0; e.g. --max-new-tokens 256"),
                       (["generate", "--prompt", "hi", "--seed", "-3"],
                        "--seed must be >= 0, got -3; omit it for a random seed"),
                       (["bench", "--per-category", "0"], "--per-category must be >= 1"),
                       (["bench", "--repeat-calls", "-1"], "--repeat-calls must be >= 0, got -1; 0 = off"),
                       (["train-medusa", "--vocab", "-1"], "--vocab must be >= 0, got -1; 0 = the full vocabulary"),
                       (["serve", "--suffix-scope", "tenant"],
                        "--suffix-scope must be one of server, api-key, conversation, got 'tenant'"),
                       (["serve-ray", "--suffix-scope", "user"], "--suffix-scope must be one of")):
        one_error_line(CliRunner().invoke(app, args), says)
    r = CliRunner().invoke(app, [])  # a bare `specrt` still shows the help
    assert "Usage" in r.output and "error:" not in r.output


@pytest.fixture
def counted(monkeypatch):
    """What a command decides about its engine set, counted: manifests loaded (every reference to load_manifest in
    specrt's modules), --speculate names resolved (any name, 'auto' or not) and lookups of the target's entry."""
    import specrt.bench.command  # noqa: F401
    import specrt.cli.main  # noqa: F401
    import specrt.manifest
    import specrt.runtime.batch_session  # noqa: F401
    import specrt.runtime.plan
    import specrt.runtime.session  # noqa: F401

    calls = {"manifest": 0, "resolve": 0, "target": 0}
    load0, resolve0 = specrt.manifest.load_manifest, specrt.runtime.plan.resolve_mode
    engine0 = specrt.manifest.Manifest.engine

    def load(root):
        calls["manifest"] += 1
        return load0(root)

    def resolve(mode, *args, **kwargs):
        calls["resolve"] += 1
        return resolve0(mode, *args, **kwargs)

    def engine(self, role, precision=None):
        calls["target"] += role == "target"
        return engine0(self, role, precision)

    for mod in [m for name, m in sys.modules.items() if name.startswith("specrt")]:
        if vars(mod).get("load_manifest") is load0:
            monkeypatch.setattr(mod, "load_manifest", load)
        if vars(mod).get("resolve_mode") is resolve0:
            monkeypatch.setattr(mod, "resolve_mode", resolve)
    monkeypatch.setattr(specrt.manifest.Manifest, "engine", engine)
    return calls


ONCE = {"manifest": 1, "resolve": 1, "target": 1}  # the plan, made once (runtime/plan.py)


@pytest.mark.parametrize("extra", [[], ["--compare-plain"]])
def test_generate_makes_its_plan_once(tiny_engines, counted, extra):
    from specrt.cli import app

    r = CliRunner().invoke(app, ["generate", "--engines", str(tiny_engines), "--prompt", "one two one two",
                                 "--max-new-tokens", "3", "--json", "--threads", "1", *extra])
    assert r.exit_code == 0, r.output
    assert counted == ONCE


@pytest.mark.parametrize("extra", [[], ["--parallel", "2"], ["--speculate", "prompt-lookup", "--parallel", "3"]])
def test_serve_startup_makes_its_plan_once(tiny_engines, counted, monkeypatch, extra):
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi.testclient import TestClient

    from specrt.cli import app

    ready = {}

    def serve_until_loaded(self, *args, **kwargs):  # instead of listening: the app's startup, until the load ends
        server = self.config.app.state.server
        with TestClient(self.config.app):
            t = time.time()
            while server.session is None and server.load_error is None and time.time() - t < 60:
                time.sleep(0.02)
        ready["mode"] = server.session and server.session.mode

    monkeypatch.setattr(uvicorn.Server, "run", serve_until_loaded)
    r = CliRunner().invoke(app, ["serve", "--engines", str(tiny_engines), "--threads", "1", *extra])
    assert r.exit_code == 0, r.output
    # auto on a set without a draft model or heads, else what was asked
    assert ready["mode"] == ("prompt-lookup" if "--speculate" in extra else "lookup/suffix")
    assert counted == ONCE
