"""The build cache under <out_root>/.cache (exports, and the engines built from each) and its lock: one build
or prune per out_root at a time; engine sets hard-link their files from it and are moved into place in one
rename; stale entries and the leftovers of killed runs are listed and pruned here.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@contextmanager
def one_build_at_a_time(out_root: Path, log):
    """An exclusive lock on out_root/.cache/.lock for a build or a prune: concurrent builds of one set race on
    the export cache and the .part files, and a prune could delete what a build is writing
    (docs/pipeline-notes.md, "The build lock"). A second run waits, then usually finds the set up to date."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    (out_root / ".cache").mkdir(parents=True, exist_ok=True)
    with open(out_root / ".cache" / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another specrt build or prune in {out_root} to finish")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def link(src: Path, dst: Path) -> None:
    """dst as a hard link to the cached src (a copy where links are impossible)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def swap_into_place(tmp: Path, final: Path) -> None:
    """The set written in tmp becomes final in one rename (an old set there goes to a .old-* folder first)."""
    if final.exists():
        trash = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    bytes: int
    in_use: bool  # an engine set hard-links files from it (deleting it would cost a rebuild, nothing else)


def _usage(paths) -> tuple[int, bool]:
    """(bytes of the regular files among paths, whether any of them is hard-linked from elsewhere)."""
    size, linked = 0, False
    for f in paths:
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            size += st.st_size
            linked |= st.st_nlink > 1
    return size, linked


LEFTOVER_AGE_S = 3600  # a temp folder untouched this long belongs to a dead run, not to a build in progress


def _leftovers(out_root: Path) -> list[CacheEntry]:
    """Temp folders of runs killed before they could clean up (kill -9, power loss): .tmp-* (a set or an
    export being written) and .old-* (a set being replaced), beside the sets and in .cache, once nothing
    in them changed for LEFTOVER_AGE_S (a build running next to the prune keeps its own)."""
    found = [p for d in (out_root, out_root / ".cache") for pat in (".tmp-*", ".old-*") for p in d.glob(pat)]
    now = time.time()
    return [CacheEntry(p, _usage(p.rglob("*"))[0], False) for p in sorted(found)
            if p.is_dir() and now - max(q.stat().st_mtime for q in [p, *p.iterdir()]) > LEFTOVER_AGE_S]


def cache_entries(out_root: Path) -> list[CacheEntry]:
    """The export and build folders under out_root/.cache. Engine sets hard-link their engines from a
    build folder, so one that no set links is stale: an old build recipe or format, or a set since
    rebuilt. An export folder is in use while any of its builds is. (Where hard links are impossible the
    sets hold copies, nothing in the cache counts as in use, and pruning only costs rebuild time.)
    Leftovers of interrupted runs come first, always stale."""
    entries = _leftovers(out_root)
    for exp in sorted((out_root / ".cache").glob("export-*")):
        builds = [CacheEntry(b, *_usage(b.rglob("*"))) for b in sorted(exp.glob("build-*")) if b.is_dir()]
        own, own_used = _usage(exp.iterdir())  # sets built before build folders linked from the export itself
        entries.append(CacheEntry(exp, own, own_used or any(b.in_use for b in builds)))
        entries += builds
    return entries


def prune_cache(out_root: Path, log=print) -> int:
    """Delete the stale entries of cache_entries; returns the bytes freed. A stale export's builds are
    all stale too and listed after it, so each entry's bytes count once. Leftovers go first: a half-written
    set hard-links builds, which count as in use only until it is gone."""
    with one_build_at_a_time(out_root, log):
        return _prune(out_root, log)


def _prune(out_root: Path, log) -> int:
    freed = 0
    for listing in (_leftovers, cache_entries):  # the second listing runs after the leftovers are gone
        for e in listing(out_root):
            if not e.in_use:
                if e.path.exists():  # a build of an export removed just before is already gone
                    shutil.rmtree(e.path)
                freed += e.bytes
                log(f"removed {e.path} ({e.bytes / 2**30:.2f} GiB)")
    return freed
