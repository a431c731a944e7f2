"""Which megatron-core release is installed, found without importing it.

``repack trace`` and ``repack doctor`` compute what the installed megatron-core does, whose
arithmetic differs between releases (``repack.model.release`` lists how). Importing
megatron-core imports torch: seconds, and the doctor runs where neither is installed. So the
version is read from the ``megatron/core/package_info.py`` that an import would find, as text
(a wheel, ``pip install --target`` and a Megatron-LM checkout on ``PYTHONPATH`` all have one),
else from the package's metadata.

No imports of Megatron or torch.
"""

from __future__ import annotations

import os
import re
import sys

__all__ = ["NEWEST", "installed_release", "release_name", "release_of"]

#: What :func:`release_of` gives for no release or an unreadable one: later than every
#: release, so the newest release's arithmetic applies.
NEWEST = (99, 0)

_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)\s*$", re.MULTILINE)


def installed_release() -> str:
    """The version of the megatron-core that ``import megatron.core`` would import
    (``"0.16.1"``), or ``""`` if none is found.

    The first ``megatron/core/package_info.py`` on ``sys.path``, read as text (so that a
    Megatron-LM checkout on ``PYTHONPATH`` wins over a megatron-core installed below it, as it
    does on import); else the package's metadata (an editable install found by an import hook).
    """
    for folder in sys.path:
        path = os.path.join(folder or os.getcwd(), "megatron", "core", "package_info.py")
        try:
            with open(path, encoding="utf-8") as stream:
                found = dict(_FIELD.findall(stream.read()))
        except (OSError, UnicodeDecodeError):
            continue
        if "MAJOR" in found and "MINOR" in found:
            return ".".join(found[k] for k in ("MAJOR", "MINOR", "PATCH") if k in found)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return ""


def release_of(version: str) -> tuple[int, int]:
    """``"0.16.1"`` -> ``(0, 16)``; no version or an unreadable one counts as the newest
    (:data:`NEWEST`)."""
    found = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(found.group(1)), int(found.group(2))) if found else NEWEST


def release_name(release: tuple[int, int]) -> str:
    """``(0, 12)`` -> ``"0.12"``; :data:`NEWEST` -> ``"the newest"``."""
    return "the newest" if release == NEWEST else f"{release[0]}.{release[1]}"
