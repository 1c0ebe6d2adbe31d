"""Measure the drafting cost of Medusa heads on this CPU (figures quoted in heads/README.md).

  python heads/measure_heads.py engines/smollm2-135m [--threads 1]

1. the heads engine (ONNX, reduced vocabulary) at batch 1: what a round pays after verification;
2. the same engine at batch s (s = tree nodes + 1): what heads inside the target graph would pay,
   since in-graph heads run on every token of the verification pass (the accepted position is
   only known after verification), plus the full-vocabulary lm_head for comparison;
3. numpy matmuls of the same math at batch 1 (the alternative to a separate session);
4. the target's own decode pass, for scale.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def best(fn, reps: int = 20) -> float:
    fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return float(np.median(t)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engines", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from specrt.manifest import load_manifest
    from specrt.runtime.engine import EngineOptions, open_engine

    m = load_manifest(a.engines)
    e = m.engine("medusa")
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    sess = ort.InferenceSession(str(m.root / e.file), so, providers=["CPUExecutionProvider"])
    H, nodes = e.hidden_size, len(e.raw["medusa"]["tree"])
    h1 = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    hs = np.random.default_rng(0).standard_normal((nodes + 1, H)).astype(np.float32)
    tok = any(i.name == "token" for i in sess.get_inputs())
    feed1 = {"hidden": h1, **({"token": np.ones(1, np.int64)} if tok else {})}
    feeds = {"hidden": hs, **({"token": np.ones(nodes + 1, np.int64)} if tok else {})}
    print(f"heads engine, batch 1:            {best(lambda: sess.run(['candidates'], feed1)):.2f} ms")
    print(f"heads engine, batch {nodes + 1} (in-graph): {best(lambda: sess.run(['candidates'], feeds)):.2f} ms")
    import onnx
    from onnx import numpy_helper

    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(m.root / e.file)).graph.initializer}
    w1, b1, w2, b2, et = w["w1"], w["b1"], w["w2"], w["b2"], w["e_sub_t"]
    k = e.raw["medusa"]["topk"]

    xin = h1 + (w["token_table"][1].astype(np.float32) if "token_table" in w else 0)

    def numpy_heads():
        x = xin @ w1 + b1
        y = xin + (x / (1 + np.exp(-x))) @ w2 + b2          # [K, 1, H]
        z = y[:, 0] @ et
        return np.argpartition(-z, k, axis=1)[:, :k]

    print(f"numpy heads, batch 1:             {best(numpy_heads):.2f} ms")
    K = w1.shape[0]
    full = np.random.default_rng(0).standard_normal((H, e.vocab_size)).astype(np.float32)
    y = np.random.default_rng(0).standard_normal((K, H)).astype(np.float32)
    print(f"full-vocab lm_head for {K} heads:   {best(lambda: y @ full, 5):.2f} ms")
    t = m.engine("target", "fp32")
    eng = open_engine(m.root, t, EngineOptions(threads=a.threads))
    eng.forward(np.ones(64, np.int64))
    eng.commit(64)
    print(f"target decode pass (1 token):     {best(lambda: eng.forward(np.ones(1, np.int64)), 10):.2f} ms")
    print(f"target tree pass ({nodes + 1} tokens):     "
          f"{best(lambda: eng.forward(np.ones(nodes + 1, np.int64), num_logits=nodes + 1), 10):.2f} ms")


if __name__ == "__main__":
    main()
