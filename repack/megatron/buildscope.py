"""What lives while Megatron's builder builds a repack's blend, and no longer.

Megatron's ``BlendedMegatronDatasetBuilder.build()`` of a repacked class runs inside
:func:`building` (:mod:`repack.megatron.buildhook` wraps it). Meanwhile one memo, a dict, holds
what the build's 30,000 datasets would otherwise each make again:

* the descriptions' texts of the config's values (:mod:`repack.megatron.buildhook`, by the
  values' ids and tuples of identifier names);
* what a build does not change, as the environment (:func:`once_per_build`, string keys);
* the sources of the blend's prefixes, found at once (:mod:`repack.megatron.mixin`).

It relies on nothing changing the config's values while Megatron builds (Megatron's builder
does not). When the last build running ends, the memo is let go: nothing of a build, its
config included, outlives it. Outside a build, nothing is kept and each dataset makes its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["building", "memo", "once_per_build"]

_LOCK = threading.Lock()
#: The memo while a build runs (else ``None``), and how many builds run (threads).
_STATE: dict[str, Any] = {"memo": None, "running": 0}


@contextmanager
def building() -> Iterator[dict]:
    """The scope of a build: the memo made at the first of builds that overlap, let go at the
    end of the last."""
    with _LOCK:
        if not _STATE["running"]:
            _STATE["memo"] = {}
        _STATE["running"] += 1
        held = _STATE["memo"]
    try:
        yield held
    finally:
        with _LOCK:
            _STATE["running"] -= 1
            if not _STATE["running"]:
                _STATE["memo"] = None


def memo() -> dict | None:
    """The memo of the builds running, else ``None``."""
    return _STATE["memo"]


def once_per_build(key: str, make: Callable[[], Any]) -> Any:
    """``make()``, kept in the memo under ``key`` while a build runs (asked of each of its
    30,000 datasets, what a build does not change, as the environment, is made once), else
    made at each call."""
    held = _STATE["memo"]
    if held is None:
        return make()
    found = held.get(key, held)
    if found is held:
        found = held[key] = make()
    return found
