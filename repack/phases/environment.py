"""The two variables that turn the loader's phase continuation on, and what the analyses say
when they are set. A leaf: the doctor and trace read it without importing the continuation
(which imports the doctor's arithmetic)."""

from __future__ import annotations

import os

__all__ = ["PHASES_ENV_VAR", "PHASE_ENV_VAR", "environment_note"]

#: The phase schedule file, for the continuation (off when unset).
PHASES_ENV_VAR = "REPACK_PHASES"
#: The phase this launch trains (0 for the first).
PHASE_ENV_VAR = "REPACK_PHASE"


def environment_note() -> str | None:
    """What ``doctor`` and ``trace`` say when this environment would change the loader's
    order: ``REPACK_PHASES`` / ``REPACK_PHASE`` set; else None."""
    found = {name: os.environ.get(name) for name in (PHASES_ENV_VAR, PHASE_ENV_VAR)}
    found = {name: value for name, value in found.items() if value}
    if not found:
        return None
    said = " and ".join(f"{name}={value}" for name, value in found.items())
    return (
        f"{said} set in this environment: a repacked loader started here trains the phase "
        'continuation (docs/megatron.md, "Blend phases"), not stock Megatron\'s order; '
        "unset them for stock's order"
    )
