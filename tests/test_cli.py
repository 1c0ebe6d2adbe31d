"""User mistakes: one-line error naming the fix, non-zero exit, no traceback, nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import make_checkpoint

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def specrt(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "specrt.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=300)


def assert_user_error(r, *words):
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr  # progress lines may precede it
    for w in words:
        assert w.lower() in errors[0].lower(), errors[0]


def no_leftovers(out: Path):
    if out.exists():
        assert [p.name for p in out.iterdir() if not p.name == ".cache"] == []
        cache = out / ".cache"
        if cache.exists():
            assert not any(p.name.startswith(".tmp") for p in cache.iterdir())


def test_help_works_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from typer.testing import CliRunner\nfrom specrt.cli import app\n"
            "for cmd in ([], ['engines'], ['generate'], ['info']):\n"
            "    r = CliRunner().invoke(app, cmd + ['--help'])\n"
            "    assert r.exit_code == 0, (cmd, r.output)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=120)


def test_runtime_imports_no_torch(tiny_engines):
    code = ("import sys\nfrom specrt.runtime.generate import Generator\n"
            f"g = Generator.load({str(tiny_engines)!r})\ng.generate('hello', max_new_tokens=3)\n"
            "bad = [m for m in ('torch', 'transformers', 'specrt.export', 'specrt.build') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=120)


def test_missing_model_file(tmp_path):
    r = specrt("engines", "--source", tmp_path / "nope.gguf", "--out", tmp_path / "eng")
    assert_user_error(r, "not found")
    no_leftovers(tmp_path / "eng")


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(os.urandom(1000))
    r = specrt("engines", "--source", bad, "--out", tmp_path / "eng")
    assert_user_error(r, "not a GGUF")
    no_leftovers(tmp_path / "eng")


@pytest.mark.slow
def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = specrt("engines", "--source", path, "--out", tmp_path / "eng")
    assert_user_error(r, "supported", "llama")
    no_leftovers(tmp_path / "eng")


def test_unknown_precision(tmp_path, tiny_engines):
    r = specrt("engines", "--source", "smollm2-135m", "--precisions", "fp16", "--out", tmp_path / "eng")
    assert_user_error(r, "unknown precision", "fp32")
    no_leftovers(tmp_path / "eng")
    r = specrt("generate", "--engines", tiny_engines, "--precision", "fp16", "--prompt", "hi")
    assert_user_error(r, "fp16")


@pytest.mark.parametrize("missing", ["tokenizer.json", "target-fp32.onnx", "target-fp32.onnx.data"])
def test_engine_folder_missing_a_file(tmp_path, tiny_engines, missing):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_engines, broken)
    (broken / missing).unlink()
    assert_user_error(specrt("generate", "--engines", broken, "--prompt", "hi"), "missing", missing, "specrt engines")
    if missing == "tokenizer.json":
        assert_user_error(specrt("generate", "--engines", tmp_path / "absent", "--prompt", "hi"), "not found")


@pytest.mark.parametrize("corrupt,words", [("target-fp32.onnx", ["cannot load engine", "target-fp32.onnx", "rebuild"]),
                                           ("target-fp32.onnx.data", ["cannot load engine", "rebuild"]),
                                           ("tokenizer.json", ["tokenizer.json", "rebuild"])])
def test_engine_folder_with_a_corrupt_file(tmp_path, tiny_engines, corrupt, words):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_engines, broken)
    f = broken / corrupt  # copytree copies: writing it leaves the fixture alone
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3] if corrupt.endswith(".data") else os.urandom(len(data)))
    assert_user_error(specrt("generate", "--engines", broken, "--prompt", "hi"), *words)


def test_unreadable_tokenizer_file_is_one_line(tmp_path):
    from specrt.errors import SpecrtError
    from specrt.runtime.tokenizer import TextCodec

    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(SpecrtError, match="tokenizer .* cannot be loaded.*specrt engines"):
        TextCodec(bad, None, None, ())


def _tamper(case: str, m: dict, folder: Path):
    """What a hand edit or another tool might leave in an engine set -> the manifest to write."""
    target = m["engines"]["target-fp32"]
    if case == "not an object":
        return []
    if case == "engines a list":
        m["engines"] = list(m["engines"].values())
    elif case == "tensorrt backend":
        target["backend"] = "tensorrt"
    elif case == "no tokenizer hash":
        del target["tokenizer_sha256"]
    elif case == "tokenizer changed":  # still a valid tokenizer, just not the one the engines were built with
        tok = folder / "tokenizer.json"
        tok.write_text(json.dumps(json.loads(tok.read_text()), indent=2))
    return m


@pytest.mark.parametrize("case,words", [("not an object", ["not an object", "rebuild"]),
                                        ("engines a list", ["wrong type", "rebuild"]),
                                        ("tensorrt backend", ["tensorrt", "not installed"]),
                                        ("no tokenizer hash", ["tokenizer_sha256", "rebuild"]),
                                        ("tokenizer changed", ["tokenizer.json", "sha256", "rebuild"])])
def test_tampered_engine_set(tmp_path, tiny_engines, case, words):
    other = tmp_path / "other"
    shutil.copytree(tiny_engines, other)  # copies, not links: rewriting them leaves the fixture alone
    m = _tamper(case, json.loads((other / "manifest.json").read_text()), other)
    (other / "manifest.json").write_text(json.dumps(m))
    assert_user_error(specrt("generate", "--engines", other, "--prompt", "hi"), *words)
    if case == "not an object":
        assert_user_error(specrt("info", other), *words)


@pytest.mark.slow
def test_engines_rebuilds_a_set_that_no_longer_loads(tiny_dir, tmp_path):
    """`specrt engines` is the fix every load error names: it must not call a broken set up to date."""
    from specrt.pipeline import EngineSetRequest, make_engine_set
    from specrt.runtime.generate import Generator

    req = EngineSetRequest(str(tiny_dir), "t", ("fp32",), 128, tmp_path / "engines")
    path = make_engine_set(req, log=lambda m: None)
    breakages = [lambda: (path / "target-fp32.onnx.data").unlink(),
                 lambda: (path / "manifest.json").write_text("[]"),
                 lambda: (path / "tokenizer.json").unlink() or (path / "tokenizer.json").write_text("{}")]
    for brk in breakages:
        brk()
        said = []
        assert make_engine_set(req, log=said.append) == path
        assert not any("up to date" in m for m in said), said
        assert Generator.load(path).generate("hi", max_new_tokens=2).token_ids
    said = []
    make_engine_set(req, log=said.append)
    assert any("up to date" in m for m in said), said  # an intact set is still skipped


def test_manifest_of_another_schema_version(tmp_path, tiny_engines):
    other = tmp_path / "other"
    shutil.copytree(tiny_engines, other)
    m = json.loads((other / "manifest.json").read_text())
    m["schema_version"] = 99
    (other / "manifest.json").write_text(json.dumps(m))
    assert_user_error(specrt("info", other), "schema version 99", "rebuild")


def test_prompt_longer_than_context(tiny_engines):
    assert_user_error(specrt("generate", "--engines", tiny_engines, "--prompt", "hello world " * 400),
                      "context", "shorten")


def test_empty_prompt(tiny_engines):
    assert_user_error(specrt("generate", "--engines", tiny_engines, "--prompt", "  "), "empty")


@pytest.mark.parametrize("content,words", [(b"[{\"role\": \"user\", ", ["not valid JSON"]),
                                           (b"\xff\xfe\x00bad", ["not UTF-8"]),
                                           (b"{\"role\": \"user\"}", ["non-empty JSON list"])])
def test_bad_messages_file(tmp_path, tiny_engines, content, words):
    f = tmp_path / "m.json"
    f.write_bytes(content)
    assert_user_error(specrt("generate", "--engines", tiny_engines, "--messages", f), *words)


def test_messages_file_edge_cases(tmp_path, tiny_engines):
    from specrt.errors import SpecrtError
    from specrt.runtime.tokenizer import load_messages_file

    with pytest.raises(SpecrtError, match="is a folder"):
        load_messages_file(tmp_path)
    blank = tmp_path / "blank.json"
    blank.write_text(json.dumps([{"role": "system", "content": ""}, {"role": "user", "content": "  \n"}]))
    assert_user_error(specrt("generate", "--engines", tiny_engines, "--messages", blank), "empty")
    assert_user_error(specrt("generate", "--engines", tiny_engines, "--messages", tmp_path), "folder")
    bom = tmp_path / "bom.json"  # what Windows editors save as "UTF-8"
    bom.write_bytes(json.dumps([{"role": "user", "content": "hello"}]).encode("utf-8-sig"))
    assert [m.content for m in load_messages_file(bom)] == ["hello"]
    r = specrt("generate", "--engines", tiny_engines, "--messages", bom, "--max-new-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args,words", [(["--top-p", "1.5"], ["--top-p must", "use --top-p 1.0"]),
                                        (["--temperature", "-1"], ["--temperature must", "use --temperature 0.0"]),
                                        (["--top-k", "-2"], ["--top-k must"]),
                                        (["--seed", "-1"], ["--seed must"]),
                                        (["--max-new-tokens", "0"], ["--max-new-tokens must be >= 1"]),
                                        (["--stop", ""], ["--stop", "empty"])])
def test_bad_sampling_values(tiny_engines, args, words):
    r = specrt("generate", "--engines", tiny_engines, "--prompt", "hi", *args)
    assert_user_error(r, *words)
    assert not any(w in r.stderr for w in ("top_p", "temperature=", "top_k", "max_new_tokens")), r.stderr


def test_help_shows_flags_as_flags_and_lists_precisions():
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "generate", "--help"], capture_output=True, text=True,
                       env={**ENV, "COLUMNS": "250", "TERMINAL_WIDTH": "250"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "<bool>" not in r.stdout and "--json" in r.stdout, r.stdout
    line = next(x for x in r.stdout.splitlines() if "--precision" in x)
    assert all(p in line for p in ("fp32", "int8", "int4", "int4-fp32")), line
    for cmd in ([], ["engines"], ["cache"], ["bench"]):
        out = subprocess.run([sys.executable, "-m", "specrt.cli", *cmd, "--help"], capture_output=True, text=True,
                             env=ENV, timeout=120).stdout
        assert "--help" in out and "<bool>" not in out, (cmd, out)


@pytest.mark.slow
def test_engines_rejects_a_bad_destination(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_user_error(specrt("engines", "--out", afile), "is a file", "folder")
    for name in ("../escaped", "a/b", "..", ".cache"):
        assert_user_error(specrt("engines", "--name", name, "--out", tmp_path / "eng"), "name", "--name")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "eng").exists()


def test_draft_of_another_vocabulary_fails_before_export(tmp_path, tiny_dir, monkeypatch):
    import specrt.export.exporter as exporter
    from specrt.errors import SpecrtError
    from specrt.pipeline import EngineSetRequest, make_engine_set

    draft = make_checkpoint(tmp_path / "draft", "llama", seed=3, vocab=320)
    monkeypatch.setattr(exporter, "export_checkpoint", lambda *a, **k: pytest.fail("exported before the vocab check"))
    with pytest.raises(SpecrtError, match="vocabulary size 320.*has 384"):
        make_engine_set(EngineSetRequest(str(tiny_dir), "pair", ("fp32",), 128, tmp_path / "eng", str(draft)),
                        log=lambda m: None)
    no_leftovers(tmp_path / "eng")


@pytest.mark.slow
def test_train_medusa_rejects_a_part_that_does_not_exist(tmp_path):
    assert_user_error(specrt("train-medusa", "--parts", "9", "--work", tmp_path / "w"), "--parts must be in 1..")
    assert not (tmp_path / "w").exists()


def test_generate_json_and_info(tiny_engines):
    r = specrt("generate", "--engines", tiny_engines, "--prompt", "hello", "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert {"prompt_tokens", "new_tokens", "ttft_s", "tok_s"} <= set(out["stats"])
    assert out["stats"]["new_tokens"] == len(out["token_ids"]) <= 5
    assert out["stats"]["proposer"] == "lookup/suffix"   # the default, auto: no draft model or heads in this set
    r = specrt("info", tiny_engines)
    assert r.returncode == 0 and "target-fp32" in r.stdout


def test_compare_plain_says_in_one_line_what_speculation_bought(tiny_engines):
    args = ("generate", "--engines", tiny_engines, "--prompt", "one two three one two three one two", "--threads", "1",
            "--max-new-tokens", "12", "--ignore-eos", "--compare-plain")
    r = specrt(*args)
    assert r.returncode == 0, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("auto (lookup/suffix): 12 tokens in ") and ", tau " in last, last
    assert "plain: 12 tokens in " in last and "x tokens/s, identical output" in last, last
    out = json.loads(specrt(*args, "--json").stdout)["compare_plain"]
    assert out["identical"] and out["speedup"] > 0 and out["plain_stats"]["proposer"] == "off"
    assert out["proposer"] == "lookup/suffix" and out["tau"] >= 1.0 and out["new_tokens"] == 12
    assert_user_error(specrt(*args, "--speculate", "off"), "--compare-plain", "--speculate off")


@pytest.mark.slow
def test_cache_lists_and_prunes_only_what_no_engine_set_uses(tiny_dir, tmp_path):
    from specrt.pipeline import EngineSetRequest, cache_entries, make_engine_set
    from specrt.runtime.generate import Generator

    out = tmp_path / "engines"
    path = make_engine_set(EngineSetRequest(str(tiny_dir), "t", ("fp32",), 128, out), log=lambda m: None)
    exp = next((out / ".cache").glob("export-*"))
    stale_build = exp / "build-oldrecipe"                      # a build no set links (an old recipe)
    stale_build.mkdir()
    (stale_build / "target-fp32.onnx.data").write_bytes(b"\0" * 4096)
    old_export = out / ".cache" / "export-0123456789abcdef-ctx128-v0"  # an old export format
    old_export.mkdir()
    (old_export / "model.onnx.data").write_bytes(b"\0" * 8192)
    killed = [out / ".cache" / ".tmp-export-k1ll3d", out / ".tmp-t-k1ll3d"]  # runs killed with -9 leave these
    running = out / ".cache" / ".tmp-export-running"           # a build writing right now keeps its folder
    two_hours_ago = time.time() - 7200
    for k in killed + [running]:
        k.mkdir()
        (k / "model.onnx.data").write_bytes(b"\0" * 1024)
        if k is not running:
            for q in (k / "model.onnx.data", k):
                os.utime(q, (two_hours_ago, two_hours_ago))
    used = {e.path.name: e.in_use for e in cache_entries(out)}
    assert used[exp.name] and not used["build-oldrecipe"] and not used[old_export.name]
    assert sum(used.values()) == 2                             # the export and the build the set links

    r = specrt("cache", "--out", out)
    assert r.returncode == 0 and "stale" in r.stdout and "in use" in r.stdout and stale_build.exists()
    r = specrt("cache", "--out", out, "--prune")
    assert r.returncode == 0 and "freed" in r.stdout
    assert not stale_build.exists() and not old_export.exists() and exp.exists()
    assert not any(k.exists() for k in killed) and running.exists()
    assert Generator.load(path).generate("hi", max_new_tokens=2).token_ids   # the set still works
    assert_user_error(specrt("cache", "--out", tmp_path / "nowhere"), "no build cache", "specrt engines")


@pytest.mark.slow
def test_disk_full_during_a_build_is_one_line_and_leaves_no_partial_engine(tiny_dir, tmp_path):
    out = tmp_path / "eng"
    code = (
        "import errno, sys\n"
        "import specrt.build.ort as ort\n"
        "def full(src, dst, prec, calibration=None):\n"
        "    open(str(dst) + '.data', 'wb').write(b'x' * 100)  # what a full disk leaves behind\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device', str(dst) + '.data')\n"
        "ort.build_ort_engine = full\n"
        "from specrt.cli.main import main\n"
        f"sys.argv = ['specrt', 'engines', '--source', {str(tiny_dir)!r}, '--precisions', 'fp32', "
        f"'--max-context', '256', '--out', {str(out)!r}]\n"
        "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert_user_error(r, "no space left", "cache --prune")
    no_leftovers(out)
    assert [p for p in (out / ".cache").rglob("*") if p.is_file() and "build-" in str(p.parent.name)] == []


@pytest.mark.slow
def test_two_builds_of_one_set_at_once_both_succeed(tiny_dir, tmp_path):
    """The second run waits for the first (a lock per --out), then finds the set up to date; without it
    they raced on the export cache and the .part files."""
    out = tmp_path / "eng"
    args = [sys.executable, "-m", "specrt.cli", "engines", "--source", str(tiny_dir), "--name", "t",
            "--precisions", "fp32,int8", "--max-context", "256", "--out", str(out)]
    runs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
            for _ in range(2)]
    results = [r.communicate(timeout=300) + (r.returncode,) for r in runs]
    assert all(rc == 0 for _, _, rc in results), [err[-500:] for _, err, _ in results]
    assert sum("is up to date" in " ".join(err.split()) for _, err, _ in results) == 1   # rich wraps long paths
    assert sorted(p.name for p in out.iterdir()) == [".cache", "t"]                   # no temp folders left
    from specrt.runtime.generate import Generator

    assert Generator.load(out / "t").generate("hi", max_new_tokens=2).token_ids


@pytest.mark.slow
def test_too_small_a_context_for_the_parity_check_is_one_line(tiny_dir, tmp_path):
    assert_user_error(specrt("engines", "--source", tiny_dir, "--max-context", "32", "--out", tmp_path),
                      "--max-context 32 is too small", "at least 64")
    assert_user_error(specrt("engines", "--source", tiny_dir, "--max-context", "64", "--out", tmp_path),
                      "too small to check this export", "use at least")


@pytest.mark.slow
def test_preset_with_source_or_draft_and_bench_out_file_and_training_options(tmp_path, tiny_dir):
    assert_user_error(specrt("engines", "--preset", "qwen2.5-coder", "--draft", "x.gguf", "--out", tmp_path),
                      "--preset names the model", "drop --source/--draft")
    f = tmp_path / "afile"
    f.write_text("x")
    assert_user_error(specrt("bench", "--out", f, "--modes", "plain-fp32"), "--out", "is a file")
    for flag, value in (("--heads", "0"), ("--epochs", "0"), ("--budget-minutes", "0"), ("--threads", "0")):
        assert_user_error(specrt("train-medusa", "--source", tiny_dir, flag, value, "--work", tmp_path / "w"),
                          f"{flag} must be > 0")
    assert_user_error(specrt("train-medusa", "--source", tiny_dir, "--work", f / "w"), "--work", "is a file")
