"""The pipeline's one door to runtime/ engines: every check and the Medusa tree's sizing open an engine they
have just built through `open_built_engine`, and the logit screen's usability is decided by the runtime's own
rule (`screen_in_use`), so a build measures and checks engines as decoding will run them.
"""

from __future__ import annotations

from pathlib import Path

from ..manifest import EngineEntry


def open_built_engine(path: Path, facts: dict, session_config=None, screen: bool = False):
    """An OrtEngine over the engine file at `path`, sized from its export's facts (export.json), before the
    set's manifest exists. screen: decode greedy passes through its logit screen."""
    from ..runtime.engine import OrtEngine

    s = facts["spec"]
    return OrtEngine(path, num_layers=s["num_layers"], num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                     vocab_size=s["vocab_size"], max_context=facts["max_context"], session_config=dict(session_config or {}),
                     screen=screen)


def screen_in_use(entry: EngineEntry) -> bool:
    """Whether the runtime will decode through this engine's logit screen on this machine."""
    from ..runtime.engine import screen_unusable

    return screen_unusable(entry.screen, entry.build_versions) is None
