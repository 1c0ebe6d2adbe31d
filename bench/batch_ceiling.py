"""The ceiling of batched decoding on an ONNX Runtime CPU engine: one decode pass of B one-token rows (B sequences,
each with its own cache row and length, the GroupQueryAttention graph's per-row `seqlens_k`) against B = 1.
Pass cost only: no drafting, no scheduling, random cache contents.

    python -m specrt.bench.batch_ceiling --engines engines/smollm2-135m --batches 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/smollm2-135m", help="engine set folder (its target-fp32)")
    ap.add_argument("--batches", default="1,2,4,8", help="batch sizes")
    ap.add_argument("--context", type=int, default=300, help="tokens of context per sequence")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    ap.add_argument("--passes", type=int, default=25, help="timed passes per batch size (the first 5 warm up)")
    a = ap.parse_args(argv)

    import onnxruntime as ort

    from ..interface import (INPUT_IDS, NUM_LOGITS_TO_KEEP, POSITION_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH,
                             TREE_MASK, past_name, present_name)
    from ..manifest import load_manifest

    entry = load_manifest(Path(a.engines)).engine("target", "fp32")
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
    sess = ort.InferenceSession(str(Path(a.engines) / entry.file), so, providers=["CPUExecutionProvider"])
    fixed = {INPUT_IDS, POSITION_IDS, TREE_MASK, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, NUM_LOGITS_TO_KEEP}
    cache_names = {past_name(i, k) for i in range(entry.num_layers) for k in ("key", "value")}
    C = -(-(a.context + 1) // 256) * 256
    rows, one = [], None
    for B in (int(b) for b in a.batches.split(",")):
        io = sess.io_binding()
        for i in range(entry.num_layers):
            for kind in ("key", "value"):
                buf = (np.random.default_rng(i).random((B, entry.num_kv_heads, C, entry.head_dim)) * 0.1).astype(
                    np.float32)
                value = ort.OrtValue.ortvalue_from_numpy(buf)
                io.bind_ortvalue_input(past_name(i, kind), value)
                io.bind_ortvalue_output(present_name(i, kind), value)
        io.bind_cpu_input(INPUT_IDS, np.full((B, 1), 42, np.int64))
        io.bind_cpu_input(POSITION_IDS, np.full((B, 1), a.context, np.int64))
        io.bind_cpu_input(TREE_MASK, np.zeros((B, 1, 1), np.float32))
        io.bind_cpu_input(SEQLENS_K, np.full(B, a.context, np.int32))
        io.bind_cpu_input(TOTAL_SEQUENCE_LENGTH, np.array(a.context + 1, np.int32))
        io.bind_cpu_input(NUM_LOGITS_TO_KEEP, np.array(1, np.int64))
        for inp in sess.get_inputs():  # the logit screen's flag: the full fp32 lm_head
            if inp.name not in fixed | cache_names:
                io.bind_cpu_input(inp.name, np.array(False))
        for out in sess.get_outputs():
            if not out.name.startswith("present"):
                io.bind_output(out.name, "cpu")
        times = []
        for _ in range(a.passes):
            t = time.perf_counter()
            sess.run_with_iobinding(io)
            times.append(time.perf_counter() - t)
        s = float(np.median(times[5:]))
        one = one or s
        rows.append({"batch": B, "pass_ms": round(s * 1000, 2), "aggregate_tok_s": round(B / s, 1),
                     "vs_one_stream": round(one * B / s, 2)})
        print(json.dumps(rows[-1]))
    return rows


if __name__ == "__main__":
    main()
