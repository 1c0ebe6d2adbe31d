"""The GPU check script (tests/gpu/check.py, tests/gpu/check.sh): it says there is no GPU here and passes; the
tests that need a GPU skip without one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specrt.runtime.backends.device import memory as cuda_memory
from gpu_fakes import REPO


# --- the GPU check script -------------------------------------------------------------------------------------

def test_the_gpu_check_says_there_is_no_gpu_here_and_passes():
    if cuda_memory.device_count()[0]:
        pytest.skip("a CUDA device is here: run tests/gpu/check.sh itself")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    r = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "check.sh"), "--json", os.devnull], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu check: no NVIDIA GPU here")


def test_device_memory_round_trip_on_a_gpu():
    if not cuda_memory.device_count()[0]:
        pytest.skip("no CUDA device here (tests/gpu/check.sh runs the GPU checks where there is one)")
    m = cuda_memory.CudaMemory()
    try:
        a = m.alloc(64)
        host = np.arange(8, dtype=np.int64)
        m.upload(a, host)
        out = m.host((8,), np.int64)
        m.download(out, a)
        m.sync()
        np.testing.assert_array_equal(out, host)
    finally:
        m.close()


def test_a_wheel_carried_in_parts_is_joined_and_checked(tmp_path):
    """tests/gpu/carry.py: parts that fit a call, joined back bit for bit; a missing or damaged part is named."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("carry", Path(__file__).parent / "gpu" / "carry.py")
    carry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(carry)
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(os.urandom(10_000))
    parts = tmp_path / "parts"
    parts.mkdir()
    m = carry.split(wheel, parts, 3_000)
    assert [p["bytes"] for p in m["parts"]] == [3000, 3000, 3000, 1000]
    joined = carry.assemble(parts, tmp_path / "there")
    assert joined.read_bytes() == wheel.read_bytes() and joined.name == wheel.name
    (parts / "part-02").write_bytes(b"x" * 3000)
    with pytest.raises(SystemExit, match="part-02 is damaged"):
        carry.assemble(parts, tmp_path / "there")
    (parts / "part-02").unlink()
    with pytest.raises(SystemExit, match="part-02 is missing"):
        carry.assemble(parts, tmp_path / "there")
    assert 0 < carry.travelling_bytes() < 64 << 20   # what travels with every call leaves room for parts
