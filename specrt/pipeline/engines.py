"""One target or draft engine of a set: built with onnxruntime (or reused) in the build cache beside its export,
linked into the set being written, checked (checks.py) and described by its manifest entry.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..interface import decoder_io_description
from ..manifest import EngineEntry, engine_memory, file_sha256
from . import checks
from .buildcache import link


def build_engine(role: str, p: str, cache: Path, facts: dict, tmp: Path, log) -> EngineEntry:
    """Build (or reuse) <role>-<p>.onnx in the export cache, link it into tmp, check it -> its manifest entry."""
    from ..build.ort import build_key, build_ort_engine, build_versions, precision

    bdir = cache / f"build-{build_key(precision(p))}"  # a changed build recipe never reuses a stale engine
    bdir.mkdir(exist_ok=True)
    built, facts_file = bdir / f"{role}-{p}.onnx", bdir / f"{role}-{p}.json"
    if not built.is_file():
        prec = precision(p)
        calibration = None
        if prec.method == "gptq":
            calibration = _calibration(cache, facts)
            log(f"building onnxruntime {role} engine at {p} (GPTQ: one fp32 pass over {len(calibration)} "
                "calibration texts, then the weights)")
        else:
            log(f"building onnxruntime {role} engine at {p}")
        t0 = time.time()
        part = bdir / f".part-{role}-{p}.onnx"
        try:  # `built` appears last, by rename: it marks a complete build
            info = build_ort_engine(cache / "model.onnx", part, prec, calibration)
            info["build_seconds"] = round(time.time() - t0, 1)
            facts_file.write_text(json.dumps(info))
            os.replace(str(part) + ".data", str(built) + ".data")
            _rewrite_data_location(part, built)
        except BaseException:  # a failed or interrupted build leaves no partial engine in the cache
            for leftover in (part, Path(str(part) + ".data"), built, Path(str(built) + ".data"), facts_file):
                leftover.unlink(missing_ok=True)
            raise
    for f in (built, Path(str(built) + ".data")):
        link(f, tmp / f.name)
    info = json.loads(facts_file.read_text())
    log(f"checking {role}-{p} against PyTorch")
    parity = checks.check_engine(tmp / built.name, facts, cache / "golden.npz", info.get("session_config"))
    if precision(p).bits is None:  # fp32 weights and compute: must match PyTorch (quantized engines only record it)
        checks.require_parity(f"{role}-{p}", parity)
    screen = info.pop("screen", None)  # the build's facts of its logit screen, checked here
    if screen is not None:
        screen["check"] = checks.check_screen(tmp / built.name, facts, cache / "golden.npz", screen,
                                              info.get("session_config"))
        if not screen["check"]["holds"]:
            log(f"warning: {role}-{p} decodes greedy passes with its full fp32 lm_head: its logit screen did not pass "
                f"its check on this machine ({checks.screen_fallback_reason(screen['check'])}); please report it "
                "(with `pip list | grep onnx`)")
    s = facts["spec"]
    inputs, outputs = decoder_io_description({k: s[k] for k in ("num_kv_heads", "head_dim", "hidden_size",
                                                                "vocab_size")})
    entry = EngineEntry(
        name=f"{role}-{p}", role=role, file=built.name, files=[built.name, built.name + ".data"], backend="onnxruntime",
        precision=p, num_layers=s["num_layers"], num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"],
        head_dim=s["head_dim"], hidden_size=s["hidden_size"], vocab_size=s["vocab_size"],
        max_context=facts["max_context"], architecture=s["architecture"], inputs=inputs, outputs=outputs,
        source_sha256=facts["source"]["sha256"], parity=parity, build=info,
        session_config=info.get("session_config", {}), screen=screen,
        tokenizer_sha256=file_sha256(cache / "tokenizer.json"), build_versions=build_versions())
    return entry.with_memory(engine_memory(entry, tmp))


def chat_template(cache: Path) -> str | None:
    """The chat template an export's tokenizer files carry (None: none)."""
    cfg = json.loads((cache / "tokenizer_config.json").read_text())
    if cfg.get("chat_template"):
        return cfg["chat_template"]
    jinja = cache / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


def export_codec(cache: Path, facts: dict):
    """The tokenizer of an export (runtime.tokenizer.TextCodec), with its chat template and special tokens."""
    from ..runtime.tokenizer import TextCodec

    return TextCodec(cache / "tokenizer.json", chat_template(cache), facts["bos_token"], tuple(facts["eos_token_ids"]))


def _calibration(cache: Path, facts: dict) -> list[list[int]]:
    """GPTQ's calibration: stdlib code as raw text, stdlib doc questions through the chat template."""
    from ..build.gptq import MAX_TOKENS, calibration_texts
    from ..runtime.tokenizer import Message

    codec = export_codec(cache, facts)
    limit = min(MAX_TOKENS, facts["max_context"])
    seqs = [codec.encode(codec.render_chat([Message("user", text)]) if kind == "chat" else text)[:limit]
            for kind, text in calibration_texts()]
    return [s for s in seqs if s]


def _rewrite_data_location(part: Path, built: Path) -> None:
    """The optimized graph names its weights file; point it at the final name."""
    import onnx

    model = onnx.load(str(part), load_external_data=False)
    for t in model.graph.initializer:
        for kv in t.external_data:
            if kv.key == "location":
                kv.value = built.name + ".data"
    onnx.save_model(model, str(part))
    os.replace(part, built)
