"""The ONNX Runtime CPU backend's sessions, which its decoder engines and heads (and the portable backend's) share:
the session and its options (sessions that take turns on the cores), binding the cache in place, and the fp32 logit
screen's safety rule."""

from __future__ import annotations

import os
from pathlib import Path

import onnxruntime as ort

from ....errors import SpecrtError, first_line
from ....interface import KV_KINDS, past_name, present_name
from ...engine import EngineOptions

# The screen saves time on narrow passes and loses it on wide ones (docs/runtime-notes.md, "Logit screen row limit").
SCREEN_MAX_ROWS = 6

# Sessions that take turns on the same cores (a target and its draft model) stop ORT's intra-op threads from
# spinning after a Run returns, or the spinning threads of one steal the cores the other needs; a lone target
# keeps the default, which is faster back to back (docs/runtime-notes.md, "Sessions that take turns").
TAKING_TURNS = {"session.force_spinning_stop": "1"}


def bind_in_place(io, layers) -> None:
    """Bind each cache buffer as both its layer's past input and present output: one OrtValue, so the graph writes
    the new positions into it in place. layers: per layer, its [key, value] arrays."""
    for i, layer in enumerate(layers):
        for kind, view in zip(KV_KINDS, layer):
            value = ort.OrtValue.ortvalue_from_numpy(view)
            io.bind_ortvalue_input(past_name(i, kind), value)
            io.bind_ortvalue_output(present_name(i, kind), value)


def open_session(onnx_path: Path, options: ort.SessionOptions, graph: bytes | None = None,
                 providers=("CPUExecutionProvider",)) -> ort.InferenceSession:
    """A session for onnx_path (or for `graph`, a serialized variant of it) on `providers` (the CPU's unless
    asked); a corrupt or incomplete engine file is a one-line SpecrtError, not ORT's traceback (ORT raises its own
    exception types: InvalidProtobuf, Fail, NoSuchFile, ...)."""
    try:
        return ort.InferenceSession(graph if graph is not None else str(onnx_path), options,
                                    providers=list(providers))
    except MemoryError:
        raise
    except Exception as e:
        raise SpecrtError(f"cannot load engine '{onnx_path}' ({first_line(e)}); "
                          "rebuild the engine set with `specrt engines`") from None


def session_options(threads: int = 0, session_config: dict[str, str] | None = None) -> ort.SessionOptions:
    """A decoder engine's session options: all graph optimizations, `threads` intra-op threads (0 = all cores), one
    inter-op thread, and the entries build/ chose for the engine."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    for key, value in (session_config or {}).items():
        so.add_session_config_entry(key, value)
    return so


def screen_unusable(facts: dict | None, built_with: dict | None) -> str | None:
    """Why an engine's logit screen must not be used here (None: it may). Its error bound assumes the int8
    kernel `specrt engines` checked it against: the same onnxruntime on the same CPU family (x86-64's MLAS
    quantizes activations per block; e.g. KleidiAI on Arm quantizes per row, which the bound does not cover)."""
    import platform

    if not facts:
        return "engine built without a logit screen"
    if os.environ.get("SPECRT_LOGIT_SCREEN", "1") == "0":
        return "SPECRT_LOGIT_SCREEN=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"checked on x86-64 only, this is {platform.machine()}"
    built = (built_with or {}).get("onnxruntime")
    if built != ort.__version__:
        return f"built with onnxruntime {built}, running {ort.__version__} (rebuild with `specrt engines`)"
    if not (facts.get("check") or {}).get("holds"):
        return "its error bound did not hold when the engine was built"
    return None


def entry_config(entry, options: EngineOptions) -> tuple[dict[str, str], str | None]:
    """A decoder entry's session config entries under these options, and why its logit screen must not be used
    (None: it may)."""
    config = {**(entry.session_config or {}), **(TAKING_TURNS if options.taking_turns else {})}
    note = screen_unusable(entry.screen, entry.build_versions)
    if note is None and not options.logit_screen:
        note = "turned off (EngineOptions.logit_screen)"
    return config, note
