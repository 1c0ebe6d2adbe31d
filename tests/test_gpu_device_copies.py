"""The device copies of the GPU backends (relayout across capacity buckets, tree commits): planned by pure functions
and run on device.memory.HostMemory, which refuses overlapping copies, against static_shapes and numpy."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.interface import KV_KINDS
from specrt.runtime.backends.device.memory import Copy2D, DeviceCache, HostMemory, commit_plan, relayout_plan
from specrt.runtime.static_shapes import relayout


# --- device copies ------------------------------------------------------------------------------------------

def test_host_memory_refuses_overlapping_copies():
    m = HostMemory()
    base = m.alloc(64)
    m.copy2d(Copy2D(base + 32, 8, base, 8, 8, 2))  # rows apart: fine
    with pytest.raises(AssertionError, match="overlapping"):
        m.copy2d(Copy2D(base + 4, 8, base, 8, 8, 1))


def test_commit_plans_go_direct_unless_a_destination_meets_a_source():
    row, cap, heads = 16, 32, 3
    direct = commit_plan(1000, 9000, heads, row, cap, np.array([10, 12, 14]), np.array([10, 11, 12]))
    assert [(c.src - 1000, c.dst - 1000) for c in direct] == [(12 * row, 11 * row), (14 * row, 12 * row)]
    assert all(c.height == heads and c.spitch == c.dpitch == cap * row for c in direct)
    via = commit_plan(1000, 9000, heads, row, cap, np.array([10, 12, 13]), np.array([10, 11, 12]))  # 12,13 -> 11,12
    assert len(via) == 2 and via[0].dst == 9000 and via[1].src == 9000 and via[0].width == 2 * row
    assert commit_plan(1000, 9000, heads, row, cap, np.array([4, 5]), np.array([4, 5])) == []
    assert relayout_plan(1000, 9000, heads, row, 256, 256, 40) == [] and relayout_plan(1000, 9000, 2, 8, 4, 8, 0) == []


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_cache_copies_match_static_shapes(dtype):
    """Random capacity changes and tree commits on a DeviceCache over HostMemory against the numpy reference:
    static_shapes.relayout for the layout, fancy-index assignment for the commits."""
    rng = np.random.default_rng(0)
    layers, heads, dim, caps = 2, 3, 4, (8, 16, 24)
    cache = DeviceCache(HostMemory(), layers, heads, dim, dtype, caps[-1])
    ref = [[np.zeros(heads * caps[-1] * dim, dtype) for _ in KV_KINDS] for _ in range(layers)]
    views = [[relayout(b, heads, dim, 0, caps[0], 0) for b in layer] for layer in ref]
    cache.relayout(caps[0], 0)
    length = 0
    for step in range(60):
        cap = cache.capacity
        if rng.random() < 0.3:  # a new layout, keeping what is committed
            new = int(rng.choice([c for c in caps if c >= length]))
            cache.relayout(new, length)
            views = [[relayout(b, heads, dim, cap, new, length) for b in layer] for layer in ref]
            cap = new
        n = int(rng.integers(1, cap - length + 1)) if cap > length else 0
        if n:  # a pass writes n rows (same values into both), then a tree commit of an ascending path
            rows = rng.standard_normal((layers, 2, heads, n, dim)).astype(dtype)
            for i in range(layers):
                for k in range(2):
                    views[i][k][0, :, length:length + n] = rows[i, k]
                    host = cache.read(i, k)
                    host[0, :, length:length + n] = rows[i, k]
                    cache.memory.upload(cache.ptrs[i][k], host)
            keep = int(rng.integers(0, n + 1))
            path = np.sort(rng.choice(n, keep, replace=False))
            cache.commit(length, path)
            src, dst = length + path, length + np.arange(keep)
            for layer in views:
                for v in layer:
                    v[:, :, dst] = v[:, :, src]
            length += keep
        if rng.random() < 0.1:
            length = int(rng.integers(0, length + 1))  # rewind
        for i in range(layers):
            for k in range(2):
                np.testing.assert_array_equal(cache.read(i, k)[:, :, :length], views[i][k][:, :, :length])
