"""The doctor's problems: their two levels and :class:`Problem`, one finding on one line.

A leaf of :mod:`repack.doctor`: it imports nothing of the doctor, so that
:mod:`~repack.doctor.core` (the blend's problems) and :mod:`~repack.doctor.findings` (the
duplicate analysis's) both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ERROR", "WARNING", "Problem"]

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Problem:
    """One finding, on one line.

    Attributes:
        level: ``"error"`` (training would stop or hang) or ``"warning"``.
        code: A short stable name: ``empty-split``, ``over-draw``, ``unreadable``, ``bad-weight``,
            ``too-many-datasets``, ``int32-overflow``, ``open-files``, ``map-count``,
            ``mmap-limit``, ``repetition``, ``duplicate``, ``mixed-dtypes``,
            ``int64-index``, ``short-split``, ``host-memory``, ``arch-dependent-order``,
            ``arch-order-unchecked`` (:mod:`repack.doctor.orders`), ``phase-retrain``,
            ``phase-exhausted`` (:mod:`repack.doctor.phase_report`), ``phases-environment``,
            ``prepared-cache`` (a cache prepared for other settings); from
            the duplicate analysis (:mod:`repack.doctor.findings`) ``identical-sources``,
            ``repeated-documents``, ``shared-documents``, ``split-overlap``.
        message: The line, naming the source (and split) it is about.
        source: The prefix concerned, if one.
        split: The split concerned, if one.
    """

    level: str
    code: str
    message: str
    source: str | None = None
    split: str | None = None

    def to_json(self) -> dict[str, Any]:
        """As a JSON-able dict."""
        return {
            "level": self.level,
            "code": self.code,
            "message": self.message,
            "source": self.source,
            "split": self.split,
        }
