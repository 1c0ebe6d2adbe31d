"""EAGLE training recipes compared at an equal wall-clock budget: the same data, the same held-out replay
(`specrt train-eagle`'s report: first-token accuracy and chain tau on the target's greedy answers to the benchmark's
prompts), one recipe after another on the same machine.

    python -m experiments.eagle_variants --minutes 8 base:{} 'fuse:{"fuse": true}' \\
        'fuse-ttt3:{"fuse": true, "ttt_steps": 3}'

A variant is NAME:JSON, the JSON fields of export/eagle.py's EagleTrainConfig (fuse: EAGLE-3's fused low, middle
and high target features; ttt_steps: training-time test over that many chained draft steps). The data come from
export/train/eagle_data.py (cached under --work; with layer features when any variant fuses). Heads are written to
--out, not to heads/: a fused head is an experiment the runtime does not drive yet.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME:JSON of EagleTrainConfig fields, e.g. 'fuse:{\"fuse\": true}'")
    ap.add_argument("--source", default="smollm2-135m", help="target: embedded name, HF directory or .gguf")
    ap.add_argument("--minutes", type=float, default=8.0, help="training budget per variant (data excluded)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--work", type=Path, default=Path("engines/.cache/eagle"), help="the EAGLE data cache")
    ap.add_argument("--out", type=Path, default=Path("bench-out/eagle-variants"), help="heads and the report")
    a = ap.parse_args(argv)
    from specrt.export.eagle import EagleTrainConfig

    known = {f.name for f in fields(EagleTrainConfig)} - {"budget_s", "threads"}
    variants = []
    for spec in a.variants:
        name, _, text = spec.partition(":")
        try:
            kw = json.loads(text or "{}")
        except json.JSONDecodeError as e:
            ap.error(f"variant '{spec}': its JSON does not parse ({e.msg}); write NAME:{{\"field\": value}}")
        bad = sorted(set(kw) - known) if isinstance(kw, dict) else ["(not an object)"]
        if not name or bad:
            ap.error(f"variant '{spec}': unknown fields {', '.join(bad) or '(no name)'}; choose from "
                     f"{', '.join(sorted(known))}")
        variants.append((name, kw))
    if not a.minutes > 0:
        ap.error(f"--minutes must be > 0, got {a.minutes}")

    import torch

    from specrt.corpora import BENCH_PROMPTS
    from specrt.export.eagle import HeadShape
    from specrt.export.train.eagle import train
    from specrt.export.train.eagle_data import EagleDataConfig, build_eval_set, build_train_set, load_set
    from specrt.export.sources import load, resolve

    torch.set_num_threads(a.threads)
    layers = any(kw.get("fuse") for _, kw in variants)
    src = resolve(a.source)
    say = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    held = load_set(build_eval_set(src, a.work, BENCH_PROMPTS, log=say, layer_features=layers))
    data = load_set(build_train_set(src, a.work, EagleDataConfig(layer_features=layers), log=say))
    model, _ = load(src)
    embed, lm_head = model.model.embed_tokens.weight.detach().numpy(), model.lm_head.weight.detach().numpy()
    shape = HeadShape.of(model.config)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, kw in variants:
        path = a.out / f"{name}.npz"
        for old in (path, path.with_suffix(".ckpt")):  # an equal budget each: never resume an earlier run
            old.unlink(missing_ok=True)
        cfg = EagleTrainConfig(budget_s=a.minutes * 60, threads=a.threads, **kw)
        r = train(data, embed, lm_head, shape, path, cfg, heldout=held, log=lambda m, n=name: say(f"{n}: {m}"))
        rows.append({"variant": name, "config": kw, "steps": r["steps"], "epochs": round(r["epochs"], 2),
                     "heldout": {k: {"first_top1": v["first_top1"], "tau_depth3": v["tau_by_depth"][2]}
                                 for k, v in r["heldout"].items()}})
    kinds = list(rows[0]["heldout"])
    lines = [f"EAGLE recipes, {a.minutes:g} minutes each ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
             "first draft token right, by category, then chain tau at depth 3 over all", "",
             "| variant | steps | " + " | ".join(kinds) + " | tau@3 (all) |", "|---|---:|" + "---:|" * (len(kinds) + 1)]
    for r in rows:
        h = r["heldout"]
        lines.append(f"| {r['variant']} | {r['steps']} | " + " | ".join(f"{h[k]['first_top1']:.1%}" for k in kinds)
                     + f" | {h['all']['tau_depth3']:.2f} |")
    (a.out / "eagle_variants.md").write_text("\n".join(lines) + "\n")
    (a.out / "eagle_variants.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
