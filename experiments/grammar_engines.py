"""llguidance against xgrammar on the structured-output bench's 20 schemas and replies (structured.py's JSON):
the time to compile each schema for the set's tokenizer, and the time of each next-token mask along the reply.

    pip install xgrammar   # not a specrt dependency: it needs torch, transformers and triton
    python -m experiments.grammar_engines --engines engines/smollm2-135m \
        --replies docs/bench/structured/smollm2-135m-fp32.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _summary(compile_s: list[float], mask_s: list[float]) -> dict:
    return {"compile_ms_median": round(statistics.median(compile_s) * 1e3, 3),
            "mask_us_median": round(statistics.median(mask_s) * 1e6, 1),
            "mask_us_p90": round(float(np.percentile(mask_s, 90)) * 1e6, 1), "masks": len(mask_s)}


def run(engines: str, replies: str) -> dict:
    from specrt.runtime.grammar import json_schema_grammar
    from specrt.runtime.session import load
    from experiments.structured import CASES, schema_of

    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        sys.exit(f"error: {e.name} is not installed; `pip install xgrammar` to compare the two engines")
    session = load(engines, "fp32", "off")
    codec, V = session.generator.codec, session.engine.vocab_size
    rows = json.loads(Path(replies).read_text())["rows"]
    work = [(schema_of(props), codec.encode(row["text"])) for (_, props), row in zip(CASES, rows)]
    session.grammar("start: /a/")  # the tokenizer's own setup, once per set, outside the figures
    out = {}
    comp, masks = [], []
    for schema, tokens in work:
        t = time.perf_counter()
        g = session.grammar(json_schema_grammar(schema))
        comp.append(time.perf_counter() - t)
        for tok in tokens:
            t = time.perf_counter()
            g._mask()
            masks.append(time.perf_counter() - t)
            g.advance([tok])
    out["llguidance"] = _summary(comp, masks)
    tokenizer_json = next(Path(engines).rglob("tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json)),
                                              vocab_size=V)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, V)
    comp, masks = [], []
    for schema, tokens in work:
        t = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        comp.append(time.perf_counter() - t)
        for tok in tokens:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - t)
            if not matcher.accept_token(tok):
                sys.exit(f"error: xgrammar refused token {tok} of a reply llguidance accepted")
    out["xgrammar"] = _summary(comp, masks)
    from importlib.metadata import version
    out["versions"] = {p: version(p) for p in ("llguidance", "xgrammar")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/smollm2-135m")
    ap.add_argument("--replies", default="docs/bench/structured/smollm2-135m-fp32.json")
    ap.add_argument("--out")
    a = ap.parse_args()
    r = run(a.engines, a.replies)
    print(json.dumps(r, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
