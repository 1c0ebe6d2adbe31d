"""The engine-set manifest: the only contract between the pipeline (writes it) and runtime/ (reads it).

engines/<name>/manifest.json holds the schema version, the tokenizer (file + hash + chat template
and special tokens), and one entry per engine: role, file, backend, precision, I/O, shapes, max
context, vocab, hashes, tool versions, parity figures and build time. Its schema is defined once:
`manifest_dict` for the whole file, `EngineEntry` (to_dict / from_dict) for an engine's entry, and both
writing and reading go through them. `load_manifest` checks it once and raises a one-line SpecrtError
with the fix on any mismatch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import numpy as np

from .backends import BACKENDS as _BACKENDS
from .errors import SpecrtError
from .interface import PAST_PREFIX, PORTABLE_DTYPES

SCHEMA_VERSION = 1
ROLES = ("target", "draft", "medusa", "eagle")
BACKENDS = tuple(_BACKENDS)  # specrt/backends.py
RUNTIME_BACKENDS = BACKENDS  # runtime/backends/ opens them all (GPU ones refuse where their library or GPU is missing)


def tool_versions(packages=("specrt", "torch", "transformers", "onnx", "onnxruntime", "gguf")) -> dict:
    """Installed versions of `packages` (those not installed are left out), as recorded in manifests."""
    import importlib.metadata as md

    out = {}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class EngineEntry:
    """One engine of a set: the schema of manifest.json's "engines" entries, both ways. to_dict() is what the
    pipeline writes (the fields in this order, those left None omitted), from_dict() what load_manifest reads;
    `raw` is the entry as read (keys this schema does not know included) or as written."""

    name: str  # key in the manifest, e.g. "target-fp32" (not inside the entry)
    role: str
    file: str
    files: list[str] | None = None  # every file it needs; None in sets written before entries listed them
    backend: str
    precision: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    architecture: str | None = None  # target and draft
    inputs: dict | None = None  # {name: [*dims, dtype]} (specrt/interface.py)
    outputs: dict | None = None
    source_sha256: str | None = None
    parity: dict | None = None  # check_engine's figures (target and draft)
    build: dict | None = None  # what build/ reported: op counts, quantization, build seconds
    session_config: dict | None = None  # ORT session entries the runtime applies
    screen: dict | None = None  # the logit screen's facts and its check (fp32 engines with a screen)
    tokenizer_sha256: str | None = None  # the tokenizer it was exported with (target and draft)
    build_versions: dict | None = None  # the tools that built it (the set's "versions" are the export's)
    medusa: dict | None = None  # heads facts, tree, its sizing and the training report (role "medusa")
    eagle: dict | None = None  # EAGLE head facts: cache capacity, top-k, draft vocabulary, the target it was made for
    quality: dict | None = None  # quantized engines: top-1 and KL against the fp32 engine (pipeline/quality.py)
    memory: dict | None = None  # engine_memory(): weights, KV cache per position and at max_context, in bytes
    # from parity: one K-token pass equals K one-token passes (docs/pipeline-notes.md, "Width-exactness")
    width_exact: bool = field(init=False)
    raw: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "width_exact", bool((self.parity or {}).get("width_exact", False)))
        if self.raw is None:
            object.__setattr__(self, "raw", self.to_dict())

    def with_memory(self, memory: dict) -> "EngineEntry":
        """This entry with its memory facts (engine_memory), as the pipeline writes it."""
        from dataclasses import replace

        return replace(self, memory=memory, raw=None)

    def to_dict(self) -> dict:
        """The entry as manifest.json holds it."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _WRITTEN
                and (getattr(self, f.name) is not None or f.default is MISSING)}

    @classmethod
    def from_dict(cls, name: str, v: dict) -> "EngineEntry":
        """An entry as manifest.json holds it; KeyError for a missing required field, TypeError for a wrong type."""
        if not isinstance(v, dict):
            raise TypeError(f"engine '{name}' is a JSON {type(v).__name__}, not an object")
        if not isinstance(v.get("parity", {}), dict):  # width_exact is read from it
            raise TypeError(f"engine '{name}': parity is not an object")
        return cls(name=name, raw=v, **{f.name: v[f.name] if f.default is MISSING else v.get(f.name)
                                        for f in fields(cls) if f.name in _WRITTEN})


_WRITTEN = tuple(f.name for f in fields(EngineEntry) if f.name not in ("name", "width_exact", "raw"))




def engine_memory(entry: EngineEntry, root: Path) -> dict:
    """What an engine holds in memory, in bytes: its weights (the files it loads), its KV cache per position
    (every layer's keys and values, batch 1) and both at max_context; the same for a set is their sum
    (set_memory). A draft model costs its whole total on top of the target's."""
    weights = sum((Path(root) / f).stat().st_size for f in _files(entry))
    portable = entry.backend in _BACKENDS and _BACKENDS[entry.backend].portable
    item = np.dtype(PORTABLE_DTYPES.get(entry.precision, "float32")).itemsize if portable else 4
    per_position = entry.num_layers * 2 * entry.num_kv_heads * entry.head_dim * item
    return {"weights_bytes": weights, "kv_bytes_per_position": per_position,
            "kv_bytes_at_max_context": per_position * entry.max_context,
            "total_bytes_at_max_context": weights + per_position * entry.max_context}


def stream_hidden_bytes(entries) -> int:
    """With several streams on a GPU backend, what each stream adds beside its KV cache where Medusa or EAGLE heads
    run with the target: the device copy of its slot's hidden rows the heads read (runtime/backends/device/batch.py,
    max_context rows of float32)."""
    target = next((e for e in entries if e.role == "target"), None)
    backend = _BACKENDS.get(target.backend) if target is not None else None
    if backend is None or not backend.gpu or not any(e.role in ("medusa", "eagle") for e in entries):
        return 0
    return target.max_context * target.hidden_size * 4


def set_memory(entries) -> dict:
    """The memory of engines that run together (a target, its draft, its heads): the sum of each figure."""
    keys = ("weights_bytes", "kv_bytes_per_position", "kv_bytes_at_max_context", "total_bytes_at_max_context")
    return {k: sum((e.memory or {}).get(k, 0) for e in entries) for k in keys}


@dataclass(frozen=True)
class Manifest:
    root: Path
    name: str
    tokenizer_file: str
    tokenizer_sha256: str
    chat_template: str | None
    bos_token: str | None
    eos_token_ids: tuple[int, ...]
    engines: dict[str, EngineEntry]
    raw: dict

    @property
    def roles(self) -> set[str]:
        """The roles this set has engines for (e.g. {"target", "draft"})."""
        return {e.role for e in self.engines.values()}

    def engine(self, role: str, precision: str | None = None) -> EngineEntry:
        found = [e for e in self.engines.values() if e.role == role and precision in (None, e.precision)]
        if not found:
            have = ", ".join(f"{e.role}/{e.precision}" for e in self.engines.values()) or "none"
            what = f"{role} engine" + (f" at precision '{precision}'" if precision else "")
            raise SpecrtError(f"engine set '{self.root}' has no {what} (it has: {have}); "
                              f"rebuild with `specrt engines --precisions ...`")
        return found[0]


def manifest_dict(*, name: str, inputs_key: str, source: dict, export_parity: dict, versions: dict,
                  tokenizer_sha256: str, chat_template: str | None, bos_token: str | None, eos_token_ids,
                  engines: dict[str, EngineEntry], tokenizer_file: str = "tokenizer.json") -> dict:
    """manifest.json of an engine set, as the pipeline writes it (load_manifest reads it back)."""
    return {
        "schema_version": SCHEMA_VERSION, "name": name, "inputs_key": inputs_key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source, "export_parity": export_parity, "versions": versions,
        "tokenizer": {"file": tokenizer_file, "sha256": tokenizer_sha256, "chat_template": chat_template,
                      "bos_token": bos_token, "eos_token_ids": eos_token_ids},
        "engines": {k: e.to_dict() for k, e in engines.items()},
    }


def load_manifest(root: Path) -> Manifest:
    """Read and check an engine set's manifest.json once, at load: schema version, field types, every file
    an engine needs, roles, backends this runtime can run, one vocabulary (target/draft) and one hidden
    size (target/heads), the tokenizer recorded by each engine and the tokenizer file's hash. Any mismatch
    is a one-line SpecrtError naming the fix (mostly: rebuild with `specrt engines`)."""
    root = Path(root)
    path = root / "manifest.json"
    rebuild = "rebuild the engine set with `specrt engines`"
    if not root.is_dir():
        raise SpecrtError(f"engine set '{root}' not found; build it with `make engines` or `specrt engines`")
    if not path.is_file():
        raise SpecrtError(f"'{root}' has no manifest.json; rebuild it with `specrt engines`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecrtError(f"'{path}' is not valid JSON ({e}); {rebuild}") from None
    if not isinstance(raw, dict):
        raise SpecrtError(f"'{path}' holds a JSON {type(raw).__name__}, not an object; {rebuild}")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SpecrtError(f"'{path}' has schema version {version}, this specrt reads {SCHEMA_VERSION}; "
                          "rebuild the engine set with this version's `specrt engines`")
    try:
        tok = raw["tokenizer"]
        tok_file, tok_sha = tok["file"], tok["sha256"]
        engines = {k: EngineEntry.from_dict(k, v) for k, v in raw["engines"].items()}
        if not all(isinstance(f, str) for e in engines.values() for f in [tok_file, *_files(e)]):
            raise TypeError("file")
    except KeyError as e:
        raise SpecrtError(f"'{path}' is missing field {e}; {rebuild}") from None
    except (TypeError, AttributeError) as e:  # a field of the wrong JSON type (a list where an object belongs...)
        raise SpecrtError(f"'{path}' has a field of the wrong type ({e}); {rebuild}") from None
    for f in [tok_file] + [f for e in engines.values() for f in _files(e)]:
        if not (root / f).is_file():
            raise SpecrtError(f"engine set '{root}' is missing '{f}'; rebuild it with `specrt engines`")
    _check_entries(engines, rebuild)
    vocabs = {e.vocab_size for e in engines.values() if e.role in ("target", "draft")}
    if len(vocabs) > 1:
        raise SpecrtError(f"engine set '{root}' mixes vocabulary sizes {sorted(vocabs)}; target and draft "
                          "must share one tokenizer: rebuild with a matching draft model")
    if engines and not any(e.role == "target" for e in engines.values()):
        raise SpecrtError(f"engine set '{root}' has proposers but no target engine; rebuild it with "
                          "`specrt engines --source TARGET --draft DRAFT`")
    widths = {e.hidden_size for e in engines.values() if e.role in ("target", "medusa", "eagle")}
    if len(widths) > 1:  # heads read the target's hidden state
        raise SpecrtError(f"engine set '{root}': its heads and its target have different hidden sizes "
                          f"{sorted(widths)}; rebuild it with heads trained for this target (`specrt train-medusa`, "
                          "`specrt train-eagle`)")
    sources = {e.source_sha256 for e in engines.values() if e.role == "target"}
    for e in engines.values():  # an EAGLE head reads one target's features: the very checkpoint it was trained on
        made_for = (e.eagle or {}).get("target_source_sha256")
        if e.role == "eagle" and made_for is not None and made_for not in sources:
            raise SpecrtError(f"engine '{e.name}' is an EAGLE head for another target checkpoint than this set's; "
                              "rebuild the set with heads trained for its target (`specrt train-eagle`)")
    for e in engines.values():  # target and draft entries record the tokenizer they were exported with
        if e.role in ("target", "draft") and "tokenizer_sha256" not in e.raw:
            raise SpecrtError(f"engine '{e.name}' does not record its tokenizer (tokenizer_sha256); {rebuild}")
        if e.raw.get("tokenizer_sha256", tok_sha) != tok_sha:
            raise SpecrtError(f"engine '{e.name}' was exported with a different tokenizer than the set's; "
                              "draft and target must share one tokenizer: rebuild with a matching draft model")
    if file_sha256(root / tok_file) != tok_sha:  # docs/pipeline-notes.md, "Hashing the tokenizer at load"
        raise SpecrtError(f"'{root / tok_file}' is not the tokenizer the engines were built with (sha256 differs "
                          f"from the manifest's); {rebuild}")
    return Manifest(root=root, name=raw.get("name", root.name), tokenizer_file=tok_file,
                    tokenizer_sha256=tok_sha, chat_template=tok.get("chat_template"),
                    bos_token=tok.get("bos_token"), eos_token_ids=tuple(tok.get("eos_token_ids", [])),
                    engines=engines, raw=raw)


def _check_entries(engines: dict[str, EngineEntry], rebuild: str) -> None:
    """Each entry on its own: a known role, a backend this runtime runs, a portable graph's cache type."""
    for e in engines.values():
        if e.role not in ROLES:
            raise SpecrtError(f"engine '{e.name}' has unknown role '{e.role}'; expected one of {', '.join(ROLES)}")
        if e.backend not in BACKENDS:
            raise SpecrtError(f"engine '{e.name}' has unknown backend '{e.backend}'; "
                              f"expected one of {', '.join(BACKENDS)}")
        if e.backend not in RUNTIME_BACKENDS:
            raise SpecrtError(f"engine '{e.name}' is a {e.backend} engine, which this specrt cannot run yet (only "
                              f"{', '.join(RUNTIME_BACKENDS)}); {rebuild}")
    for e in engines.values():  # a portable graph's cache type follows its precision (fp8/int8/int4-awq: fp16 base)
        want = PORTABLE_DTYPES.get(e.precision)
        have = next((v[-1] for k, v in (e.inputs or {}).items() if k.startswith(PAST_PREFIX) and v), None)
        if _BACKENDS[e.backend].portable and e.role in ("target", "draft") and have and want and have != want:
            raise SpecrtError(f"engine '{e.name}' keeps its KV cache in {have}, and this specrt's {e.precision} "
                              f"engines keep it in {want} (the Q/DQ precisions now quantize over an fp16 "
                              f"activation base); {rebuild}")


def _files(e: EngineEntry) -> list[str]:
    """Every file the engine needs. Sets built before entries listed `files` name only the graph; their
    target and draft graphs always keep the weights beside them (build/ writes <file>.data), Medusa's inline."""
    return e.files or [e.file] + ([e.file + ".data"] if e.role in ("target", "draft") else [])
