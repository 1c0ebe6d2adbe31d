"""Transparent huge pages for what ONNX Runtime keeps in anonymous memory (Linux, best effort).

A decode step streams every weight once, so with 4 KiB pages TLB misses cost a visible share of a step
(docs/runtime-notes.md, "Huge pages"). Where THP is `madvise` (the common default), nothing gets huge pages unless
asked, so after a session is built (its pre-packed weights allocated) we ask: MADV_HUGEPAGE on every anonymous
read-write mapping of at least 2 MiB that appeared (or grew) while the engine was built, and MADV_COLLAPSE
(Linux >= 6.1) to turn the pages already there into huge pages now rather than whenever khugepaged gets to them.
The host process's own memory (or another runtime's) is left as it was; so is memory an engine reuses
from ranges mapped before it (free heap or arena space), which may then stay on 4 KiB pages. Hints only:
any failure leaves memory as it was.
"""

from __future__ import annotations

import ctypes
import sys

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
HUGE = 2 << 20


def anonymous_mappings() -> set[tuple[int, int]]:
    """(start, end) of this process's anonymous read-write mappings ([heap] included); empty off Linux."""
    if not sys.platform.startswith("linux"):
        return set()
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in maps:
        fields = line.split()
        path = fields[5] if len(fields) > 5 else ""
        if fields[1].startswith("rw") and (not path or path == "[heap]"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.add((lo, hi))  # file mappings (the weights file ORT may map) and stacks/vdso stay as they are
    return out


def advise_huge_pages(since: set[tuple[int, int]] | None = None) -> int:
    """Advise (and collapse) anonymous rw mappings >= 2 MiB of this process; returns the bytes advised.

    since: a snapshot of `anonymous_mappings()` taken before the memory to advise was allocated: addresses
    it covered are left alone, so an engine advises what it created and not its host's memory (ranges, not
    mappings: the kernel merges a new anonymous mapping into an adjacent one with the same flags)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return 0
    total = 0
    for lo, hi in _subtract(sorted(anonymous_mappings()), sorted(since or ())):
        lo, hi = (lo + HUGE - 1) & ~(HUGE - 1), hi & ~(HUGE - 1)
        if hi - lo >= HUGE and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0:
            madvise(lo, hi - lo, MADV_COLLAPSE)  # may refuse (busy, no memory): khugepaged then does it later
            total += hi - lo
    return total


def _subtract(spans: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Address ranges in `spans` that no range of `minus` covers (both sorted, each list non-overlapping)."""
    out, j = [], 0
    for lo, hi in spans:
        while j < len(minus) and minus[j][1] <= lo:
            j += 1
        k = j
        while lo < hi and k < len(minus) and minus[k][0] < hi:
            if minus[k][0] > lo:
                out.append((lo, minus[k][0]))
            lo = max(lo, minus[k][1])
            k += 1
        if lo < hi:
            out.append((lo, hi))
    return out
