"""The manifest engine entry is defined once (manifest.EngineEntry, both ways), and graph I/O names once
(specrt/interface.py): the built engines have exactly those names, and their entries describe them."""

from __future__ import annotations

import json

import onnxruntime as ort
import pytest

from specrt import interface as io
from specrt.manifest import EngineEntry, load_manifest


def test_entries_round_trip_through_the_schema(tiny_engines):
    raw = json.loads((tiny_engines / "manifest.json").read_text())
    m = load_manifest(tiny_engines)
    for name, v in raw["engines"].items():
        e = EngineEntry.from_dict(name, v)
        assert e.to_dict() == v and list(e.to_dict()) == list(v)   # the keys in the order written
        assert e == m.engines[name] and e.raw is v
        assert e.width_exact is bool(v["parity"]["width_exact"])


def test_an_entry_built_in_code_is_what_is_written(tiny_engines):
    e = load_manifest(tiny_engines).engine("target", "fp32")
    again = EngineEntry(**{f: getattr(e, f) for f in ("name", "role", "file", "files", "backend", "precision",
                                                      "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                      "hidden_size", "vocab_size", "max_context", "parity")})
    assert again.raw == again.to_dict() and "architecture" not in again.raw and again.width_exact == e.width_exact


def test_from_dict_rejects_what_load_manifest_reports():
    with pytest.raises(KeyError, match="role"):
        EngineEntry.from_dict("x", {})
    with pytest.raises(TypeError):
        EngineEntry.from_dict("x", [])
    with pytest.raises(TypeError):
        EngineEntry.from_dict("x", {"parity": None})


def test_engine_graphs_use_the_interface_names(tiny_engines):
    m = load_manifest(tiny_engines)
    for e in m.engines.values():
        if e.role == "medusa":
            continue
        sess = ort.InferenceSession(str(tiny_engines / e.file), providers=["CPUExecutionProvider"])
        sizes = {k: getattr(e, k) for k in ("num_kv_heads", "head_dim", "hidden_size", "vocab_size")}
        sig_in, sig_out = io.decoder_signature(e.num_layers, sizes)
        screen = [io.APPROX_INPUT] if e.screen else []
        assert [i.name for i in sess.get_inputs()] == [n for n, _, _ in sig_in] + screen
        assert [o.name for o in sess.get_outputs()] == ([n for n, _, _ in sig_out]
                                                        + ([io.GREEDY_OUTPUT] if screen else []))
        assert (e.inputs, e.outputs) == io.decoder_io_description(sizes)
