"""Compile-only figures for the Qwen2.5-Coder pair with TensorRT for RTX (sm89): each graph written by the
pipeline's own functions (portable fp32/fp16, Q/DQ over the fp16 base calibrated on 32 texts), compiled by
build/tensorrt.py, timed, with the process's peak RSS after each. No quality check runs (see qwen2.5-coder.json).

    python docs/bench/2026-12-02/tensorrt-rtx/qwen_compile.py target,draft fp16,fp32,fp8 engines/.cache

The last argument is the folder holding the export caches `specrt engines --preset qwen2.5-coder` wrote.
"""

import json
import resource
import sys
import time
from pathlib import Path

from specrt.backends import TENSORRT_RTX
from specrt.build.quantize import outliers_for
from specrt.build.tensorrt import build_engine
from specrt.pipeline.portable import _portable_graph
from specrt.pipeline.quality import build_quantized
from specrt.pipeline.runtime_link import provisional_entry

CACHE = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("engines/.cache")
EXPORTS = {"target": "export-e8446584d36b556b-ctx4096-v2-t3d7cb711",  # Qwen2.5-Coder-1.5B-Instruct
           "draft": "export-6a17f996cd0202f9-ctx4096-v2-t3d7cb711"}  # Qwen2.5-Coder-0.5B-Instruct
OUT = Path("compiled-qwen")
figures = {}


def compile_engine(name: str, graph: Path, facts: dict) -> None:
    t = time.time()
    f = build_engine(graph, OUT / f"{name}.engine", max_prompt=2048, max_width=64,
                     max_capacity=facts["max_context"] + 64, compiler=TENSORRT_RTX, gpu_archs=("sm89",), name=name)
    figures[name] = {"build_s": f["build_s"], "engine_bytes": f["engine_bytes"], "wall_s": round(time.time() - t, 1),
                     "peak_rss_mib_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    print(name, figures[name], flush=True)
    (OUT / "compile.json").write_text(json.dumps(figures, indent=1))


for role in sys.argv[1].split(","):
    cache = CACHE / EXPORTS[role]
    facts = json.loads((cache / "export.json").read_text())
    bdir = cache / "portable-v3"
    for p in sys.argv[2].split(","):
        graph = _portable_graph(role, p if p in ("fp32", "fp16") else "fp32", cache, facts, print, bdir)
        if p not in ("fp32", "fp16"):
            fp32, graph = graph, bdir / f"{role}-{p}-cal32.onnx"
            if not graph.is_file():
                entry = provisional_entry(fp32, facts, backend="onnxruntime-portable")
                build_quantized(fp32, graph, p, cache, facts, entry, print, 32,
                                outliers=outliers_for(p, None) if role == "target" else 0,
                                base_graph=_portable_graph(role, "fp16", cache, facts, print, bdir))
        compile_engine(f"{role}-{p}", graph, facts)
