"""The ceiling of batched decoding on an ONNX Runtime CPU engine: one decode pass of B one-token rows (B sequences,
each with its own cache row and length, the GroupQueryAttention graph's per-row `seqlens_k`) against B = 1.
Pass cost only: no drafting, no scheduling, random cache contents.

    python -m experiments.batch_ceiling --engines engines/smollm2-135m --batches 1,2,4,8

--with-prefills also times the prefill of each prompt batch_load's closed loop sends (alone, the best of 2) and
gives the ceiling of that loop's throughput against one stream: (prefills + tokens x t(1)) / (prefills + tokens /
C x t(C)), since on a CPU a prefill costs the same batched or not (compute-bound) while a decode pass of C rows
costs little more than one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from specrt.bench.prompts import DEFAULT_PROMPTS


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/smollm2-135m", help="engine set folder (its target-fp32)")
    ap.add_argument("--batches", default="1,2,4,8", help="batch sizes")
    ap.add_argument("--context", type=int, default=300, help="tokens of context per sequence")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    ap.add_argument("--passes", type=int, default=25, help="timed passes per batch size (the first 5 warm up)")
    ap.add_argument("--with-prefills", action="store_true",
                    help="also the closed loop's ceiling with its prompts' prefills counted (batch_load's prompts)")
    ap.add_argument("--answers", type=int, default=16, help="with --with-prefills: batch_load's --answers")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="with --with-prefills: tokens per answer")
    ap.add_argument("--categories", default="chat,code,qa,summarize,math,edit",
                    help="with --with-prefills: batch_load's --categories")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                    help="with --with-prefills: the prompt set")
    a = ap.parse_args(argv)
    if a.with_prefills and 1 not in [int(b) for b in a.batches.split(",")]:
        ap.error("--with-prefills needs 1 in --batches (the one-stream pass cost)")

    import onnxruntime as ort

    from specrt.interface import (INPUT_IDS, NUM_LOGITS_TO_KEEP, POSITION_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH,
                             TREE_MASK, past_name, present_name)
    from specrt.manifest import load_manifest

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
    if a.with_prefills:
        rows += with_prefills(a, {r["batch"]: r["pass_ms"] / 1000 for r in rows})
    return rows


def with_prefills(a, pass_s: dict[int, float]) -> list[dict]:
    from specrt.runtime.engine import EngineOptions
    from specrt.runtime.sampling import SamplingParams
    from specrt.runtime.session import load
    from specrt.runtime.tokenizer import Message
    from experiments.batch_load import prompt_set

    session = load(a.engines, "fp32", "off", EngineOptions(threads=a.threads))
    greedy = SamplingParams(temperature=0.0)
    session.generate([Message("user", "hi")], max_new_tokens=2, sampling=greedy)  # warm-up
    prefill = []
    for case in prompt_set(Path(a.prompts), a.categories, a.answers):
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            for _ in session.stream([Message(r, c) for r, c in case.messages], max_new_tokens=1, sampling=greedy,
                                    ignore_eos=True):
                pass
            best = min(best, time.perf_counter() - t)
        prefill.append(best)
    tokens, pre = len(prefill) * a.max_new_tokens, sum(prefill)
    alone = pre + tokens * pass_s[1]
    out = []
    for C, t in sorted(pass_s.items()):
        loop = pre + tokens / C * t
        out.append({"concurrency": C, "prompts": len(prefill), "prefill_s": round(pre, 6),
                    "decode_s": round(tokens / C * t, 6), "loop_s": round(loop, 6),
                    "ceiling_vs_one_stream": round(alone / loop, 2)})
        print(json.dumps(out[-1]))
    return out


if __name__ == "__main__":
    main()
