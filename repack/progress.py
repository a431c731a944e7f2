"""The progress hook every long command of the library takes, and its silent default.

The library never draws bars itself: it calls ``progress(description, total)`` once per phase
and the returned callable with each increment; the command line passes a tqdm factory.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress", "no_progress"]

Progress = Callable[[str, int], Callable[[int], object]]
"""``progress(description, total)`` returns a callable that takes increments."""


def no_progress(description: str, total: int) -> Callable[[int], object]:
    """A progress hook that reports nothing."""
    return _ignore


def _ignore(n: int) -> None:
    pass
