"""`specrt quant-report ENGINES`: what each precision of a set costs in accuracy, from the figures its build
measured (entry.quality: teacher-forced top-1 agreement and mean KL against the fp32 engine on held-out text;
entry.parity: width-exactness and greedy agreement with PyTorch on the golden prompt) -> a Markdown table and a
plot per precision.
"""

from __future__ import annotations

from pathlib import Path

from ..manifest import Manifest


def rows(manifest: Manifest) -> list[dict]:
    """One row per target, draft or Medusa heads engine, in the set's order."""
    out = []
    for e in manifest.engines.values():
        if e.role not in ("target", "draft", "medusa"):
            continue
        q, p = e.quality or {}, e.parity or {}
        model = e.role != "medusa"  # heads have no logits of their own to compare
        agree = q.get("top1", 1.0 if e.precision == "fp32" and model else None)
        out.append({"engine": e.name, "role": e.role, "backend": e.backend, "precision": e.precision,
                    "top1_vs_fp32": agree, "kl_vs_fp32": q.get("kl", 0.0 if e.precision == "fp32" and model else None),
                    "width_exact": e.width_exact, "greedy_vs_torch": p.get("greedy_agreement_vs_torch"),
                    "greedy_bench": q.get("greedy_bench"),
                    "draft_tau": (q.get("drafting") or {}).get("tau"),
                    "draft_acceptance": (q.get("drafting") or {}).get("acceptance_by_position"),
                    "draft_tau_humaneval": ((q.get("drafting") or {}).get("humaneval") or {}).get("tau"),
                    "kept_float": _kept_float(e.build or {}),
                    "weights_mib": (e.memory or {}).get("weights_bytes", 0) / 2**20})
    for r in out:  # the share of the fp32 draft's (or heads') tau a quantized one keeps, per prompt set
        ref = next((x for x in out if x["role"] == r["role"] and x["precision"] == "fp32"), None)
        for key in ("draft_tau", "draft_tau_humaneval"):
            base = ref and ref[key]
            r[key + "_kept"] = round(r[key] / base, 3) if base and r[key] is not None else None
    return out


def _kept_float(build: dict) -> str | None:
    """A Q/DQ engine's GEMMs left in float (the build's options and count), None where nothing was quantized."""
    if "gemms_quantized" not in build:
        return None
    kept = build.get("gemms_kept") or []
    parts = ["+".join(build["float_gemms"])] if build.get("float_gemms") else []
    parts += [f"first/last {build['float_layers']} layers"] if build.get("float_layers") else []
    parts += ["lm_head"] if "logits" in kept else []
    whole = f"{', '.join(parts) or 'none'} ({len(kept)} of {len(kept) + build['gemms_quantized']})"
    return whole + (f"; {build['outlier_channels']} outlier channels an input" if build.get("outlier_channels")
                    else "")


def write(manifest: Manifest, out: Path) -> Path:
    """report.md (+ quality.png where matplotlib is installed) in out -> the report's path."""
    table = rows(manifest)
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    lines = [f"# Quantization report: {manifest.name}", "",
             "top-1 and KL: teacher-forced on held-out stdlib code against the set's fp32 engine. greedy vs torch: "
             "the share of PyTorch's 32 greedy tokens on the golden prompt reproduced "
             "before the first divergence.", "",
             "greedy on bench: plain greedy decoding of the first bench prompt per category, 32 tokens, "
             "identical to the fp32 engine's / prompts.", "",
             "draft tau: tokens per target pass for the fp32 target (greedy, 48 tokens a prompt; a draft model "
             "drafts 4 tokens a round, Medusa heads their tree), on held-out stdlib code (with acceptance by "
             "position) and on HumanEval problems, their code as a raw prompt (the model writes the body); "
             "(x) the share of the fp32 draft's or heads' tau kept.", "",
             "| engine | backend | top-1 vs fp32 | KL vs fp32 | width-exact | greedy vs torch | greedy on bench | "
             "draft tau, stdlib | acceptance by position | draft tau, HumanEval | GEMMs kept in float | weights MiB |",
             "|---|---|---:|---:|---|---:|---:|---:|---|---:|---|---:|"]
    kept = lambda r, k: "" if r[k + "_kept"] is None or r["precision"] == "fp32" else \
        f" ({r[k + '_kept']:.0%})"  # noqa: E731
    for r in table:
        acc = " ".join(f"{a:.2f}" for a in r["draft_acceptance"]) if r["draft_acceptance"] else "–"
        g = r["greedy_bench"]
        bench = f"{g['identical']}/{g['prompts']}" if g and g.get("prompts") else "–"
        lines.append(f"| {r['engine']} | {r['backend']} | {fmt(r['top1_vs_fp32'], '.1%')} | "
                     f"{fmt(r['kl_vs_fp32'], '.4f')} | {r['width_exact']} | {fmt(r['greedy_vs_torch'], '.0%')} | "
                     f"{bench} | {fmt(r['draft_tau'], '.3f')}{kept(r, 'draft_tau')} | {acc} | "
                     f"{fmt(r['draft_tau_humaneval'], '.3f')}{kept(r, 'draft_tau_humaneval')} | "
                     f"{r['kept_float'] or '–'} | {r['weights_mib']:.0f} |")
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = [r for r in table if r["top1_vs_fp32"] is not None]
        drafts = [r for r in table if r["draft_tau"] is not None]
        fig, axes = plt.subplots(1, 3 if drafts else 2, figsize=(13 if drafts else 9, 3.2))
        a, b = axes[0], axes[1]
        if drafts:
            axes[2].bar([r["engine"] for r in drafts], [r["draft_tau"] for r in drafts])
            axes[2].set_title("tau for the fp32 target (stdlib code)")
        names = [r["engine"] for r in shown]
        a.bar(names, [r["top1_vs_fp32"] for r in shown])
        a.set_ylim(0, 1)
        a.set_title("top-1 agreement with fp32")
        b.bar(names, [r["kl_vs_fp32"] or 0.0 for r in shown])
        b.set_title("KL(fp32 || engine)")
        for ax in axes:
            ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(out / "quality.png", dpi=110)
        plt.close(fig)
        lines += ["", "![quality](quality.png)"]
    except ImportError:
        lines += ["", "(no plot: matplotlib is not installed; `pip install -e '.[bench]'`)"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"
