"""The engine set behind `serve --model` and `generate --model`: built on first use into the user's cache, keyed by
the model's content and the build options, and reused after, as `llama-server -m` and `vllm serve` do
(docs/usage.md, "From a model file to an endpoint"). make_engine_set does the building, locking and renaming."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..backends import BACKENDS, DEFAULT_CONTEXT
from ..cache_dir import cache_root
from ..errors import SpecrtError
from .orchestrate import (EngineSetRequest, _say, check_request, default_eagle, default_heads, heads_file,
                          make_engine_set)


@dataclass(frozen=True)
class ModelBuild:
    """What a --model set holds: the precision served, for this backend and context, with these heads."""
    precision: str = "fp32"
    backend: str = "onnxruntime"
    max_context: int | None = None   # None: 4096, or the model's positions where it has fewer
    medusa_heads: str | None = None  # as --medusa-heads: None = the committed heads where the source has them
    eagle_head: str | None = "none"  # as --eagle-head; off unless asked for, as in `make demo` (its slowest build)


def engines_for_model(model: str, opts: ModelBuild, log=_say) -> tuple[Path, str]:
    """-> (the engine set for `model` under cache_root()/engines, built now if no run built it before; the name it
    is served as). Bad input is one line before anything is written to the cache; the build is make_engine_set's
    (a lock per cache, written in a temp folder and renamed into place: nothing half-built is ever taken)."""
    from ..export.sources import check_family, fingerprint, max_positions, resolve

    b = BACKENDS.get(opts.backend)
    if b is not None and b.precisions and opts.precision not in b.precisions:
        raise SpecrtError(f"--backend {opts.backend} builds precisions {', '.join(b.precisions)}, not "
                          f"'{opts.precision}'; pass e.g. --precision {b.precisions[0]}")
    src = resolve(model)
    check_family(src)  # an unsupported family or feature: one line, before the weights are hashed
    embedded = _embedded_name(src)  # the committed heads are the embedded default's only, as for `specrt engines`
    name = embedded or _plain_name(src)
    medusa = heads_file(opts.medusa_heads, default_heads(embedded) if embedded else None)
    eagle = heads_file(opts.eagle_head, default_eagle(embedded) if embedded else None)
    root = cache_root() / "engines"
    context = (min(DEFAULT_CONTEXT, max_positions(src) or DEFAULT_CONTEXT) if opts.max_context is None
               else opts.max_context)
    req = check_request(EngineSetRequest(
        name if name == src.label else str(src.path), name, (opts.precision,), context, root,
        medusa_heads=medusa and medusa.resolve(), eagle_head=eagle and eagle.resolve(), backend=opts.backend))
    fp = fingerprint(src, root / ".cache" / "fingerprints.json")
    key = hashlib.sha256(json.dumps([fp, req.backend, req.precisions, req.max_context, str(req.medusa_heads),
                                     str(req.eagle_head)]).encode()).hexdigest()
    # keyed by content: the same files under another name or path find the entry built before
    found = sorted(p.name for p in root.glob(f"*-{key[:12]}") if p.is_dir() and not p.name.startswith("."))
    req = replace(req, name=found[0] if found else f"{name}{BACKENDS[req.backend].set_suffix}-{key[:12]}")
    if not found:
        log(f"first use of {model}: building its engine set into {root / req.name} (later runs reuse it)")
    return make_engine_set(req, log), name


def _plain_name(src) -> str:
    """A folder's or file's own name (resolved, so '.' names the folder), lower case, as a plain folder name."""
    name = (src.path.name if src.kind == "hf" else src.path.stem).lower().lstrip(".")
    return name.replace(" ", "-") or "model"


def _embedded_name(src) -> str | None:
    """The embedded default's name when src is its file (given by name or by path): its committed heads apply."""
    from ..export.sources import EMBEDDED, resolve

    if src.label in EMBEDDED:
        return src.label
    for name in EMBEDDED if src.kind == "gguf" else ():
        try:
            if resolve(name).path == src.path:
                return name
        except SpecrtError:  # its package is not installed
            continue
    return None
