"""Figures that reliability tests measure, for docs/reliability.md."""

from __future__ import annotations

import json
import os
from pathlib import Path


def record_figures(name: str, figures: dict) -> None:
    """Print the figures of a test and, with $REPACK_FIGURES set, save them as JSON there
    (docs/reliability.md quotes them)."""
    print(f"\nfigures {name}: {json.dumps(figures, sort_keys=True)}")
    folder = os.environ.get("REPACK_FIGURES")
    if folder:
        os.makedirs(folder, exist_ok=True)
        Path(folder, f"{name}.json").write_text(json.dumps(figures, indent=1, sort_keys=True))
