"""The blend as a repack records it: its splits, each a list of prefixes with their weights.

:class:`Blend` is what :func:`repack.inputs.blend_files.load_blend` reads any of the blend files
Megatron, NeMo and Megatron-Bridge users keep into, and what the manifest records (its
``blend`` and ``appended`` members, docs/format.md): :meth:`Blend.to_json` and
:meth:`Blend.from_json` are that record's encoding, checked member by member.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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
    "EntryColumns",
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
        source, form, splits = cls.json_columns(d)
        return cls(
            source=source,
            form=form,
            splits={
                name: None if columns is None else tuple(map(BlendEntry, *columns))
                for name, columns in splits.items()
            },
        )

    @staticmethod
    def json_columns(d: Any) -> tuple[str, str, dict[str, EntryColumns | None]]:
        """What :meth:`from_json` checks and reads of ``d``, its entries in columns: the
        source, the form, and per split ``None`` or its prefixes, weights (a float, or ``None``)
        and paths, a list each (a manifest's reader holds them in columns: an entry per source
        is not made).

        Raises:
            BlendError: As :meth:`from_json`.
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
        splits: dict[str, EntryColumns | None] = {}
        for name in names:
            raw = raw_splits[name]
            if raw is None:
                splits[name] = None
                continue
            if not isinstance(raw, list):
                bad(f"split {name!r} is {show_value(raw)}; expected a list or null")
            found = _entries_in_bulk(raw)
            splits[name] = _entries_by_row(raw, name, bad) if found is None else found
        return d["source"], form, splits


#: A split's entries in columns (:meth:`Blend.json_columns`): prefixes, weights, paths.
EntryColumns = tuple[list[str], list[float | None], list[str]]

# --- a split's entries: checked in bulk, else entry by entry ---------------------------------
#
# Two paths, one result, as for the manifest's sources (repack.format.manifest). The entry loop
# (_entries_by_row) is the definition of a valid entry and names the first bad one. A manifest
# records a blend of every source, read by every process that opens the repack: checked entry
# by entry, tens of thousands of them cost a tenth of the time a loader takes to open it. So
# _entries_in_bulk runs first, with whole-list checks that are the loop's rules or stricter
# (exact types; weights all floats or all null); where one fails, the loop runs from the start
# and refuses with the precise message, or accepts what the bulk checks were stricter about.


def _entries_by_row(raw: list[Any], name: str, bad: Callable[[str], NoReturn]) -> EntryColumns:
    """The reference checks, entry by entry: ``bad`` names the first entry that breaks a rule."""
    prefixes, weights, paths = [], [], []
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
        prefixes.append(item["prefix"])
        weights.append(None if weight is None else float(weight))
        paths.append(item["path"])
    return prefixes, weights, paths


def _entries_in_bulk(raw: list[Any]) -> EntryColumns | None:
    """What :func:`_entries_by_row` returns, checked list by list; ``None`` where any check
    fails: the loop then decides."""
    # each an object of exactly three members, the three named
    if set(map(type, raw)) != {dict} or set(map(len, raw)) != {3}:
        return None
    try:
        prefixes = [item["prefix"] for item in raw]
        weights = [item["weight"] for item in raw]
        paths = [item["path"] for item in raw]
    except KeyError:
        return None
    if set(map(type, prefixes)) != {str} or set(map(type, paths)) != {str}:
        return None
    kinds = set(map(type, weights))
    if kinds == {float}:
        if not (all(map(math.isfinite, weights)) and min(weights) > 0):
            return None
    elif kinds != {type(None)}:  # integers, a mix with null...: the loop
        return None
    return prefixes, weights, paths


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
