"""matplotlib for the bench's reports: imported only when a report draws, and optional (the bench extra)."""

from __future__ import annotations

import io


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
