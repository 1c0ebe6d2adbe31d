"""Top-1 and KL against fp32 of the Qwen2.5-Coder 1.5B target's Q/DQ graphs over the fp16 base, as the build measures
them (pipeline.quality.measure_quality) on the first N of its 16 held-out texts, the greedy bench skipped: the
graphs qwen_compile.py wrote (<role>-<precision>-cal32.onnx beside the portable graphs).

    python docs/bench/2026-12-02/tensorrt-rtx/qwen_quality.py fp8 16 engines/.cache
"""

import json
import sys
import time
from pathlib import Path

import specrt.pipeline.quality as quality

quality.HELDOUT_TEXTS = int(sys.argv[2])
quality._greedy_on_bench = lambda *a, **k: None
cache = (Path(sys.argv[3]) if len(sys.argv) > 3 else Path("engines/.cache")) / \
    "export-e8446584d36b556b-ctx4096-v2-t3d7cb711"
facts = json.loads((cache / "export.json").read_text())
for p in sys.argv[1].split(","):
    t = time.time()
    r = quality.measure_quality(cache / "portable-v3" / f"target-{p}-cal32.onnx", cache / "portable-v3" /
                                "target-fp32.onnx", facts, "onnxruntime-portable", p, cache)
    print(p, json.dumps(r), round(time.time() - t), "s", flush=True)
