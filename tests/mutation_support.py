"""Random changes to a parsed JSON document, for tests that hold a fast check to a slow one
(tests/test_manifest_bulk.py, tests/test_blend_bulk.py)."""

from __future__ import annotations

import random
from typing import Any


def places(value: Any, path: tuple = ()) -> list[tuple]:
    """Every member and item under ``value``, as paths."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        found.append((*path, key))
        if isinstance(item, (dict, list)):
            found.extend(places(item, (*path, key)))
    return found


def pick(value: Any, paths: list[tuple], rng: random.Random) -> tuple[Any, Any, Any] | None:
    """``(container, key, item)`` at one of ``paths`` chosen at random in ``value``, or ``None``
    where an earlier change took that path away."""
    path = rng.choice(paths)
    target = value
    try:
        for key in path[:-1]:
            target = target[key]
        return target, path[-1], target[path[-1]]
    except (KeyError, IndexError, TypeError):
        return None
