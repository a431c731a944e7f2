"""The one rule of what a location is: ``scheme://...`` is a URL (object storage, or an
unknown scheme that is refused), anything else a local path."""

from __future__ import annotations

import os
import re

__all__ = ["SCHEMES", "is_url", "scheme_of"]

#: Schemes of object storage this release reads and writes.
SCHEMES = ("s3", "msc")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(location: str | os.PathLike) -> str | None:
    """The URL scheme of ``location`` (``"s3"``), or None for a plain path."""
    if not isinstance(location, str):
        return None
    match = _SCHEME.match(location)
    return match.group(1).lower() if match else None


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a path."""
    return scheme_of(location) is not None
