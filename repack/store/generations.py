"""Superseded generations: what an edit on object storage or a shared folder replaced, kept
for the readers that opened the repack before it.

On a folder only this machine mounts, ``repack add``, ``remove`` and ``fingerprint`` delete
the files only the old manifest named as soon as the new one is committed: a process that
opened the repack before holds their descriptors and mappings, and an unlinked file stays
readable through them. An object store has nothing like it, nor has a folder other machines
mount (NFS, Lustre, FUSE...: :mod:`repack.store.filesystems`): a deleted object is gone for
every reader at once, and a training job that opened the repack before the edit would die
mid-run. So there (or where ``--keep-superseded`` is given) the edit leaves those objects in
place and records them, one small JSON object per edit under ``.superseded/``
(docs/format.md, "Superseded generations"). They are deleted later, at a moment the user
controls: by the first edit once they are older than the grace period
(``--keep-superseded``, a day by default), by ``repack gc``, or at once by
``repack remove --now``. A record whose objects were deleted stays, as long again, as a
tombstone: a reader that finds an object gone learns which edit took it
(:func:`why_gone`).

This module is the record's format and what reads it; writing and deleting are the edit's
(:mod:`repack.merge.edit`). It needs only a store's ``list``, ``get``, ``put`` and ``delete``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field, replace

from repack.errors import ObjectMissing

__all__ = [
    "KEEP_SUPERSEDED",
    "SUPERSEDED_DIR",
    "Generation",
    "generations",
    "utc",
    "why_gone",
]

#: The folder of the records, under the repack's root.
SUPERSEDED_DIR = ".superseded"
#: How long superseded objects are kept by default, in seconds: a day, longer than most
#: readers of an old version keep reading it (a job restarts on the new one from its checkpoint).
KEEP_SUPERSEDED = 24 * 3600.0
FORMAT = "repack-superseded"
#: Bound on a record read back.
MAX_RECORD = 16 * 1024 * 1024


def utc(at: float) -> str:
    """``at`` (seconds since the epoch) as ``2026-12-05 02:10:11 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


@dataclass(frozen=True)
class Generation:
    """The objects one edit superseded (the old manifest named them, the new one does not)."""

    #: The edit: ``add``, ``remove``, ``fingerprint``.
    edit: str
    #: When it was committed (seconds since the epoch, by the editing host's clock).
    at: float
    #: The checksum of the manifest it superseded.
    manifest: str
    #: The objects, with their sizes.
    objects: dict[str, int] = field(default_factory=dict)
    #: When its objects were deleted, and by what (``remove --now``, ``gc``, an ``add``'s
    #: grace period); None while they are kept.
    deleted_at: float | None = None
    deleted_by: str | None = None
    #: Its record's key (set once written or read).
    key: str = ""

    @property
    def size(self) -> int:
        """Bytes the objects take."""
        return sum(self.objects.values())

    @property
    def kept(self) -> bool:
        return self.deleted_at is None

    def describe(self) -> str:
        """``superseded by `repack remove` at 2026-12-05 02:10:11 UTC``, and how it went."""
        said = f"superseded by `repack {self.edit}` at {utc(self.at)}"
        if self.deleted_at is not None:
            said += f", deleted by `repack {self.deleted_by}` at {utc(self.deleted_at)}"
        return said

    def to_json(self) -> dict:
        data = {
            "format": FORMAT,
            "version": 1,
            "edit": self.edit,
            "at": self.at,
            "manifest": self.manifest,
            "objects": dict(sorted(self.objects.items())),
        }
        if self.deleted_at is not None:
            data.update(deleted_at=self.deleted_at, deleted_by=self.deleted_by)
        return data

    @classmethod
    def from_json(cls, data: dict, key: str) -> Generation:
        """Inverse of :meth:`to_json`; ValueError if ``data`` is not such a record."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a record of superseded objects")
        try:
            objects = {str(name): int(size) for name, size in data["objects"].items()}
            deleted_at = data.get("deleted_at")
            return cls(
                str(data["edit"]),
                float(data["at"]),
                str(data["manifest"]),
                objects,
                None if deleted_at is None else float(deleted_at),
                data.get("deleted_by"),
                key,
            )
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"damaged record ({err!r})") from None

    def write(self, store) -> Generation:
        """Save this record (under a new key the first time), atomically; the record saved."""
        key = self.key or (
            f"{SUPERSEDED_DIR}/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(self.at))}-"
            f"{self.edit}-{secrets.token_hex(4)}.json"
        )
        store.put(key, json.dumps(self.to_json(), sort_keys=True).encode())
        return replace(self, key=key)

    def deleted(self, by: str, at: float) -> Generation:
        """This record once its objects are deleted (a tombstone)."""
        return replace(self, deleted_at=at, deleted_by=by)


def generations(store) -> tuple[list[Generation], list[str]]:
    """The records of ``store``, oldest first, and the keys of those that cannot be read
    (left alone: nothing is deleted on a guess)."""
    found, damaged = [], []
    for key, _ in sorted(store.list(SUPERSEDED_DIR + "/")):
        try:
            data, _ = store.get(key, MAX_RECORD)
            found.append(Generation.from_json(json.loads(data), key))
        except ValueError:
            damaged.append(key)
        except ObjectMissing:
            pass  # deleted meanwhile by another editor's collection
    found.sort(key=lambda generation: (generation.at, generation.key))
    return found, damaged


def why_gone(store, name: str) -> str:
    """What to tell a reader that found ``name`` deleted: the newest record naming it, or a
    hint where none does. Best effort: a failure to list says nothing more."""
    try:
        found = [g for g in generations(store)[0] if name in g.objects]
    except Exception:  # the reader's error matters, not this one's
        found = []
    if not found:
        return (
            "deleted since this process opened the repack (by an edit of it: `repack remove "
            "--now`, `repack gc`, or another tool)"
        )
    return f"deleted since this process opened the repack: {found[-1].describe()}"
