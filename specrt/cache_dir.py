"""Where specrt keeps what it builds for --model: the XDG base-directory rule, as pip and Hugging Face do."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_RULE = "$SPECRT_CACHE, else $XDG_CACHE_HOME/specrt, else ~/.cache/specrt"


def cache_root() -> Path:
    """$SPECRT_CACHE, else $XDG_CACHE_HOME/specrt (an absolute one, as the rule says), else ~/.cache/specrt."""
    if os.environ.get("SPECRT_CACHE"):
        return Path(os.environ["SPECRT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if Path(xdg).is_absolute() else Path.home() / ".cache") / "specrt"
