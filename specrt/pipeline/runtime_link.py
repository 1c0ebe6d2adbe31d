"""The pipeline's one door to runtime/ engines: every check and the Medusa tree's sizing open an engine they
have just built through `open_built_engine`, which goes through the runtime's backend registry
(runtime.engine.open_engine), so a build measures and checks engines as decoding will run them, logit screen
rule included.
"""

from __future__ import annotations

from pathlib import Path

from ..manifest import EngineEntry


def provisional_entry(path: Path, facts: dict, session_config=None, backend: str = "onnxruntime",
                      precision: str = "fp32") -> EngineEntry:
    """The manifest entry of an engine file just built, before its checks (no parity, no screen facts yet)."""
    s = facts["spec"]
    return EngineEntry(name=path.stem, role="target", file=path.name, backend=backend, precision=precision,
                       num_layers=s["num_layers"], num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"],
                       head_dim=s["head_dim"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
                       max_context=facts["max_context"], session_config=dict(session_config or {}))


def open_built_engine(path: Path, facts: dict, session_config=None, entry: EngineEntry | None = None,
                      backend: str = "onnxruntime", precision: str = "fp32"):
    """The engine at `path` (in the set being written). entry: its finished manifest entry, whose screen facts
    let the runtime decide on the logit screen as it will when decoding; None = a provisional entry, screen off
    (the checks ask for screened passes explicitly)."""
    from ..runtime.engine import EngineOptions, open_engine

    entry = entry or provisional_entry(path, facts, session_config, backend, precision)
    return open_engine(path.parent, entry, EngineOptions())
