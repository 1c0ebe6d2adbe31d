"""What the bench-serve reports share: matplotlib, imported only when a report draws and optional (the bench extra),
and writing a report folder."""

from __future__ import annotations

import io
import json
from pathlib import Path


def pyplot():
    """-> (matplotlib.pyplot on the Agg backend, None), or (None, the one-line note saying why there is no plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "plots skipped: matplotlib is not installed (pip install 'specrt[bench]')"
    return plt, None


def png(plt, fig) -> bytes:
    """The figure as PNG bytes, laid out and closed."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_report(res: dict, out: Path, command: str, summarize, plots, markdown) -> None:
    """results.json, report.md, the plots and the servers' logs into out; everything is rendered first, then written,
    so a failure leaves no half-written report."""
    res["meta"]["command"] = command
    res["summary"] = summarize(res)
    images, notes = plots(res)
    res["notes"] = res["notes"] + notes
    logs = res.pop("server_logs", {}) or {}
    text, blob = markdown(res), json.dumps(res, indent=1)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (out / name).write_bytes(data)
    for name, log in logs.items():
        (out / f"{name}.log").write_text(log)
    (out / "results.json").write_text(blob)
    (out / "report.md").write_text(text)
