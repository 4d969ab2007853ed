"""pagedkv's own directory for generated files (the default model, compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def pagedkv_home() -> Path:
    """$PAGEDKV_HOME, or ~/.cache/pagedkv."""
    return Path(os.environ.get("PAGEDKV_HOME") or Path.home() / ".cache" / "pagedkv").expanduser()
