"""Pausing Python's garbage collector around a bulk parse.

A loader parses a manifest or a catalog of tens of thousands of records in a process that
already holds torch's and Megatron's hundreds of thousands of objects. Each generation-2
collection the parse's temporary objects set off walks all of them (about 0.2 s here), and the
temporaries that live through a young collection are promoted, bringing the next full
collection closer. Paused, the temporaries are freed by reference counting before any
collection sees them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the collector for the block; re-enable it after, if it was enabled."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
