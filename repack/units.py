"""Human-readable byte sizes, durations and counts."""

from __future__ import annotations

import re

__all__ = ["format_duration", "format_size", "parse_duration", "parse_size", "plural"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse ``64GiB``, ``500MB``, ``1.5TiB`` or a plain byte count into bytes.

    Raises:
        ValueError: the text is not a size.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 64GiB, 500MB, 1048576)")
    return int(float(match.group(1)) * _UNITS[unit])


_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(text: str) -> float:
    """Parse ``1d``, ``12h``, ``30m``, ``90s``, ``1w`` or a plain count of seconds (``0``).

    Raises:
        ValueError: the text is not a duration.
    """
    match = _DURATION.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SECONDS:
        raise ValueError(f"{text!r} is not a duration (examples: 1d, 12h, 30m, 90s, 0)")
    return float(match.group(1)) * _SECONDS[unit]


def format_duration(seconds: float) -> str:
    """``1d``, ``12h``, ``30m``, ``90s``: the largest unit that divides ``seconds`` whole."""
    for unit in ("w", "d", "h", "m"):
        if seconds >= _SECONDS[unit] and seconds % _SECONDS[unit] == 0:
            return f"{seconds // _SECONDS[unit]:.0f}{unit}"
    return f"{seconds:g}s"


def format_size(size: float) -> str:
    """Format a byte count with binary units: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def plural(n: int, one: str, many: str | None = None, *, grouped: bool = False) -> str:
    """``1 shard``, ``2 shards``, ``0 entries``: a count and its noun, singular for 1 only.

    ``many`` defaults to ``one`` + ``s``; give it for other plurals (``entry``, ``entries``).
    ``grouped`` writes the count with thousands separators (``4,711 sequences``).
    """
    number = f"{n:,}" if grouped else str(n)
    return f"{number} {one if n == 1 else (one + 's' if many is None else many)}"
