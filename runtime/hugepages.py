"""Transparent huge pages for what ONNX Runtime keeps in anonymous memory (Linux, best effort).

A decode step streams every weight once; with 4 KiB pages that is ~160k pages per step for SmolLM2 at
fp32, and the TLB misses show: where a session's buffers land changed its step by ~0.7 ms here (BENCHMARKS.md,
session 5). Where THP is `madvise` (the common default), nothing gets huge pages unless asked, so after
a session is built (its pre-packed weights allocated) we ask: MADV_HUGEPAGE on every anonymous read-write
mapping of at least 2 MiB, and MADV_COLLAPSE (Linux >= 6.1) to turn the pages already there into huge
pages now rather than whenever khugepaged gets to them. Hints only: any failure leaves memory as it was.
"""

from __future__ import annotations

import ctypes
import sys

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE = 2 << 20


def advise_huge_pages() -> int:
    """Advise (and collapse) anonymous rw mappings >= 2 MiB of this process; returns the bytes advised."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except (OSError, AttributeError):
        return 0
    total = 0
    for line in maps:
        fields = line.split()
        path = fields[5] if len(fields) > 5 else ""
        if not fields[1].startswith("rw") or (path and path != "[heap]"):
            continue  # file mappings (the weights file ORT may map) and stacks/vdso stay as they are
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        lo, hi = (lo + HUGE - 1) & ~(HUGE - 1), hi & ~(HUGE - 1)
        if hi - lo >= HUGE and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0:
            madvise(lo, hi - lo, MADV_COLLAPSE)  # may refuse (busy, no memory): khugepaged then does it later
            total += hi - lo
    return total
