"""Bring a Python wheel larger than one transfer to a GPU machine in parts, then install it there.

For a lent GPU machine that can reach no package index and takes at most --limit-mib (64) of files per call,
working tree included: onnxruntime-gpu (~255 MB; its CUDA 13 build matches a CUDA 13 image, whose
nvidia-* CUDA libraries it loads) travels in several calls, one part each, and is put together and installed
on the last.

Here (a machine with the package index):

    python tests/gpu/carry.py prepare [--package onnxruntime-gpu==1.31.1] [--python 3.12]

downloads the wheel into .gpu-carry/ (git-ignored), splits it into parts that fit beside the working tree, writes
MANIFEST.json (sha256 of the wheel and of every part) and prints the calls to make, in order. Each part's call
copies it out of the working tree to /tmp/specrt-carry (kept while the machine stays warm); the last call runs

    python3 tests/gpu/carry.py assemble && PYTHONPATH=/tmp/specrt-site tests/gpu/check.sh ...

which checks every part, joins them, checks the wheel and installs it with `pip --no-deps --target
/tmp/specrt-site` (the image's own numpy, protobuf, flatbuffers and CUDA libraries serve its needs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".gpu-carry"
THERE = Path("/tmp/specrt-carry")
SITE = Path("/tmp/specrt-site")
MIB = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def travelling_bytes(root: Path = ROOT) -> int:
    """What every call sends besides its carried paths: tracked files and untracked files git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def split(wheel: Path, out: Path, part_bytes: int) -> dict:
    """wheel -> out/part-00, part-01, ... of at most part_bytes each, and the manifest that checks them."""
    parts = []
    with wheel.open("rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            p = out / f"part-{i:02d}"
            p.write_bytes(block)
            parts.append({"name": p.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"wheel": wheel.name, "bytes": wheel.stat().st_size, "sha256": sha256(wheel), "parts": parts}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def assemble(src: Path, dest: Path) -> Path:
    """Check and join the parts in src (MANIFEST.json beside them) into the wheel, in dest; its path. Raises
    SystemExit naming a missing or damaged part."""
    manifest = json.loads((src / "MANIFEST.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / manifest["wheel"]
    with wheel.open("wb") as w:
        for part in manifest["parts"]:
            p = src / part["name"]
            if not p.is_file():
                raise SystemExit(f"carry: {p} is missing; make its call again (python tests/gpu/carry.py prepare "
                                 "prints them)")
            data = p.read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise SystemExit(f"carry: {p} is damaged (sha256 differs); make its call again")
            w.write(data)
    if sha256(wheel) != manifest["sha256"]:
        raise SystemExit(f"carry: {wheel} does not match its manifest; prepare the parts again")
    return wheel


def _prepare(a) -> None:
    tree = travelling_bytes()
    part = (a.limit_mib - a.margin_mib) * MIB - tree - 64 * 1024  # the manifest and a part's own overhead
    if part < 4 * MIB:
        raise SystemExit(f"carry: the working tree is {tree / MIB:.1f} MiB, which leaves under 4 MiB a call of "
                         f"--limit-mib {a.limit_mib}; remove untracked files or raise the limit")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    tags = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28, 31, 34)] + ["--platform=manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(OUT / "wheel"),
           "--python-version", a.python, "--implementation", "cp", *tags, a.package]
    print("carry: " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    wheel = next((OUT / "wheel").glob("*.whl"))
    m = split(wheel, OUT, part)
    shutil.rmtree(OUT / "wheel")
    n = len(m["parts"])
    print(f"{m['wheel']}: {m['bytes'] / MIB:.1f} MiB in {n} parts of at most {part / MIB:.1f} MiB (working tree "
          f"{tree / MIB:.1f} MiB). The calls, in order, each within the machine's warm window of the last:")
    for i, p in enumerate(m["parts"], 1):
        carry = [f".gpu-carry/{p['name']}"] + ([".gpu-carry/MANIFEST.json"] if i == 1 else [])
        print(f"  {i}/{n + 1}: carry {json.dumps(carry)}, command: "
              f"mkdir -p {THERE} && cp .gpu-carry/* {THERE}/ && ls -l {THERE}")
    print(f"  {n + 1}/{n + 1}: no carry, command: python3 tests/gpu/carry.py assemble && "
          f"PYTHONPATH={SITE} tests/gpu/check.sh --json $OUT/gpu.json")


def _assemble(a) -> None:
    wheel = assemble(Path(a.src), Path(a.src) / "wheel")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", a.site, str(wheel)], check=True)
    print(f"carry: installed {wheel.name} into {a.site}; run with PYTHONPATH={a.site}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="here: download the wheel and split it into parts that fit a call")
    p.add_argument("--package", default="onnxruntime-gpu==1.31.1")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    p.add_argument("--limit-mib", type=int, default=64, help="what one call may send, working tree included")
    p.add_argument("--margin-mib", type=int, default=2)
    p.set_defaults(run=_prepare)
    q = sub.add_parser("assemble", help="there: check and join the parts, install the wheel")
    q.add_argument("--src", default=str(THERE))
    q.add_argument("--site", default=str(SITE))
    q.set_defaults(run=_assemble)
    a = ap.parse_args(argv)
    a.run(a)


if __name__ == "__main__":
    main()
