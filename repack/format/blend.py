"""The blend as a repack records it: its splits, each a list of prefixes with their weights.

:class:`Blend` is what :func:`repack.inputs.blend_files.load_blend` reads any of the blend files
Megatron, NeMo and Megatron-Bridge users keep into, and what the manifest records (its
``blend`` and ``appended`` members, docs/format.md): :meth:`Blend.to_json` and
:meth:`Blend.from_json` are that record's encoding, checked member by member.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, NoReturn

from repack.errors import BlendError

__all__ = [
    "ALL",
    "FORMS",
    "PER_SPLIT_FORMS",
    "SPLITS",
    "Blend",
    "BlendEntry",
    "counted",
    "finite_positive",
    "show_value",
]

#: Split names of the per-split forms, in Megatron's order.
SPLITS = ("train", "valid", "test")

#: The only split name of the flat forms (one blend for all splits).
ALL = "all"

#: Every form a blend file can take (see the module docstring).
FORMS = (
    "data-path",
    "per-split-data-args",
    "data-args",
    "mcore-blend",
    "mcore-blend-per-split",
    "nemo-paths",
)

#: The forms that give one list per split.
PER_SPLIT_FORMS = frozenset({"per-split-data-args", "mcore-blend-per-split", "nemo-paths"})

# How many characters of a value an error message shows.
_SHOW_MAX = 80


@dataclass(frozen=True, slots=True)
class BlendEntry:
    """One dataset of a blend.

    Attributes:
        prefix: The prefix exactly as written in the blend file (stripped of surrounding
            whitespace, as Megatron does, in all but the Megatron-Core forms).
        weight: The sampling weight as parsed, or ``None`` when the list gives bare prefixes.
        path: Absolute normalized prefix: a relative prefix is resolved against the folder of
            the blend file; ``~`` is not expanded.
    """

    prefix: str
    weight: float | None
    path: str


@dataclass(frozen=True)
class Blend:
    """A parsed blend file.

    Attributes:
        source: The blend file path as given.
        form: One of :data:`FORMS`.
        splits: For the per-split forms exactly the keys ``"train"``, ``"valid"``, ``"test"``;
            for the flat forms exactly the key ``"all"``. A value is ``None`` for a split without
            data. Treat it as read-only.
    """

    source: str
    form: str
    splits: dict[str, tuple[BlendEntry, ...] | None]

    @property
    def per_split(self) -> bool:
        """Whether the blend gives one list per split (train, valid, test)."""
        return self.form in PER_SPLIT_FORMS

    def _split_names(self) -> tuple[str, ...]:
        return SPLITS if self.per_split else (ALL,)

    def paths(self) -> list[str]:
        """Return the absolute dataset paths, each once, in order of first appearance.

        Splits are visited in the order train, valid, test.
        """
        seen: dict[str, None] = {}
        for name in self._split_names():
            for entry in self.splits.get(name) or ():
                seen.setdefault(entry.path, None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        """Return the blend as a plain JSON-serializable dict (inverse of :meth:`from_json`)."""
        splits: dict[str, Any] = {}
        for name in self._split_names():
            entries = self.splits[name]
            splits[name] = (
                None
                if entries is None
                else [{"prefix": e.prefix, "weight": e.weight, "path": e.path} for e in entries]
            )
        return {"source": self.source, "form": self.form, "splits": splits}

    @classmethod
    def from_json(cls, d: Any) -> Blend:
        """Rebuild a blend from the dict :meth:`to_json` made.

        Args:
            d: The dict, as loaded from JSON.

        Returns:
            The blend, equal to the one that was serialized.

        Raises:
            BlendError: ``d`` is not such a dict.
        """
        where = d.get("source") if isinstance(d, dict) else None
        where = where if isinstance(where, str) else "<blend>"

        def bad(what: str) -> NoReturn:
            raise BlendError(f"{where}: serialized blend {what}")

        if not isinstance(d, dict) or set(d) != {"source", "form", "splits"}:
            bad(f"is {show_value(d)}; expected an object with keys source, form, splits")
        if not isinstance(d["source"], str):
            bad(f"has source {show_value(d['source'])}; expected a string")
        form = d["form"]
        if form not in FORMS:
            bad(f"has form {show_value(form)}; expected one of {', '.join(FORMS)}")
        names = SPLITS if form in PER_SPLIT_FORMS else (ALL,)
        raw_splits = d["splits"]
        if not isinstance(raw_splits, dict) or set(raw_splits) != set(names):
            bad(
                f"has splits {show_value(raw_splits)}; expected an object with keys "
                f"{', '.join(names)}"
            )
        splits: dict[str, tuple[BlendEntry, ...] | None] = {}
        for name in names:
            raw = raw_splits[name]
            if raw is None:
                splits[name] = None
                continue
            if not isinstance(raw, list):
                bad(f"split {name!r} is {show_value(raw)}; expected a list or null")
            entries = []
            for i, item in enumerate(raw, 1):
                ok = (
                    isinstance(item, dict)
                    and set(item) == {"prefix", "weight", "path"}
                    and isinstance(item["prefix"], str)
                    and isinstance(item["path"], str)
                )
                if not ok:
                    bad(
                        f"entry {i} of split {name!r} is {show_value(item)}; expected "
                        '{"prefix": string, "weight": number or null, "path": string}'
                    )
                weight = item["weight"]
                if weight is not None and (
                    not isinstance(weight, (int, float))
                    or isinstance(weight, bool)
                    or not finite_positive(weight)
                ):
                    bad(
                        f"entry {i} of split {name!r} has weight {show_value(weight)}; expected a "
                        "finite number > 0 or null"
                    )
                weight = None if item["weight"] is None else float(item["weight"])
                entries.append(BlendEntry(item["prefix"], weight, item["path"]))
            splits[name] = tuple(entries)
        return cls(source=d["source"], form=form, splits=splits)


def show_value(value: Any, raw: bool = False) -> str:
    """Render a value found in a blend file for an error message, on one short line."""
    if isinstance(value, list):
        return f"a list of {counted(len(value), 'item', 'items')}"
    if isinstance(value, dict):
        return "an object"
    if raw and isinstance(value, str):
        text = value
    else:  # YAML gives more types than JSON (bytes, sets): show those as Python does
        text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= _SHOW_MAX else text[: _SHOW_MAX - 3] + "..."


def counted(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def finite_positive(number: int | float) -> bool:
    try:
        value = float(number)
    except OverflowError:
        return False
    return math.isfinite(value) and value > 0
