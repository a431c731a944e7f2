"""The output while it is being written, on any store: what may be in it, the work folder
``OUT/.work`` (plan, index entry, shard receipts) and temp files.

Everything that decides "is this file ours, finished, or a leftover" lives here, so that merge,
``repack add`` and ``repack remove`` agree on it, in a folder and in a bucket alike (a
bucket has no temp files: a streaming write is invisible until committed, and the
unfinished ones are aborted, :meth:`~repack.store.Store.abort_uploads`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from repack.errors import FormatError, InputError, ObjectMissing, OutputExists, StoreError
from repack.format import spec as fmt
from repack.inputs.plan import PlannedShard
from repack.inputs.sources import SourceInfo
from repack.merge.prepare import Prepared
from repack.store import Store, open_store, temp_base, temp_name
from repack.store.generations import SUPERSEDED_DIR, generations
from repack.store.lock import LOCK_FILE
from repack.units import plural

__all__ = [
    "INDEX_ENTRY_FILE",
    "INDEX_ENTRY_KEY",
    "MAX_WORK_FILE",
    "PLAN_FILE",
    "PLAN_KEY",
    "WORK_DIR",
    "Receipt",
    "check_not_inside_sources",
    "finished_shards",
    "is_ours",
    "load_plan",
    "prepare_out",
    "read_work_json",
    "remove_leftovers",
    "remove_partial",
    "remove_work",
    "require_plan",
    "save_plan",
    "temp_name",
    "top_names",
    "work_key",
]

#: Folder of OUT holding the plan and shard receipts of an unfinished merge, add or remove.
WORK_DIR = fmt.WORK_DIR
PLAN_FILE = "plan.json"
#: The index member of the manifest-to-be, saved once the index is written.
INDEX_ENTRY_FILE = "index.json"
#: Bound on the files of the work folder read back (plan, index entry, receipts).
MAX_WORK_FILE = 256 * 1024 * 1024

_OURS_FIXED = {fmt.MANIFEST_FILE, "cache", WORK_DIR, LOCK_FILE, SUPERSEDED_DIR}


def work_key(*names: str) -> str:
    """Key of ``names`` in the work folder of a store."""
    return "/".join((WORK_DIR, *names))


PLAN_KEY = work_key(PLAN_FILE)
INDEX_ENTRY_KEY = work_key(INDEX_ENTRY_FILE)


def is_ours(name: str) -> bool:
    """Whether ``name`` in an output folder is something repack writes (or a temp of it)."""
    base = name.split(".tmp", 1)[0]
    return (
        base in _OURS_FIXED
        or fmt.is_shard_name(base)
        or fmt.is_index_name(base)
        or fmt.is_fingerprint_name(base)
    )


# --- receipts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Receipt:
    """Proof that a shard is written: its checksums, saved in the work folder after the shard
    is renamed into place. A shard with a receipt is never copied again."""

    #: Checksum of the logical (uncompressed) shard bytes.
    checksum: str
    #: Checksum of each segment, by :meth:`key`.
    segments: dict[str, str] = field(default_factory=dict)
    #: For a compressed shard: size and checksum of the stored file.
    stored_size: int | None = None
    stored_checksum: str | None = None

    @staticmethod
    def key(source: int, first_sequence: int) -> str:
        """How a segment is named in a receipt: the source and its first sequence."""
        return f"{source}:{first_sequence}"

    def segment(self, source: int, first_sequence: int) -> str:
        """Checksum of the segment of ``source`` starting at ``first_sequence``."""
        return self.segments[self.key(source, first_sequence)]

    def to_json(self) -> dict:
        """As saved in ``.work/shard-NNNNN.bin.json``."""
        data: dict = {"checksum": self.checksum, "segments": self.segments}
        if self.stored_size is not None:
            data.update(stored_size=self.stored_size, stored_checksum=self.stored_checksum)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Receipt:
        """Inverse of :meth:`to_json`."""
        return cls(
            data["checksum"],
            dict(data["segments"]),
            data.get("stored_size"),
            data.get("stored_checksum"),
        )

    @staticmethod
    def key_of(number: int) -> str:
        """Where the receipt of shard ``number`` is saved."""
        return work_key(fmt.shard_name(number) + ".json")

    def save(self, store: Store, number: int) -> None:
        """Save atomically as the receipt of shard ``number``."""
        store.put(self.key_of(number), json.dumps(self.to_json(), sort_keys=True).encode())

    @classmethod
    def load(cls, store: Store, number: int) -> Receipt:
        """The saved receipt of shard ``number``, or a FormatError naming its file."""
        key = cls.key_of(number)
        try:
            return cls.from_json(read_work_json(store, key))
        except (KeyError, TypeError) as err:
            raise FormatError(
                f"{store.url(key)}: damaged ({err}); start over with --force"
            ) from None


def read_work_json(store: Store, key: str):
    """A JSON file of the work folder, or a FormatError naming it.

    Raises:
        ObjectMissing: there is no such file.
    """
    try:
        data, _ = store.get(key, MAX_WORK_FILE)
        return json.loads(data)
    except StoreError as err:
        if isinstance(err, ObjectMissing):
            raise
        raise FormatError(f"{store.url(key)}: damaged ({err}); start over with --force") from None
    except (ValueError, RecursionError) as err:
        raise FormatError(f"{store.url(key)}: damaged ({err}); start over with --force") from None


def finished_shards(store: Store, shards: Iterable[PlannedShard], codec: str | None) -> set[int]:
    """The numbers of ``shards`` that have a receipt and whose file has the size the receipt
    records (a committed write is whole: the size guards against a file some other hand
    truncated). One listing; a receipt is read only where its shard is there."""
    objects = dict(store.list())
    done = set()
    for shard in shards:
        found = objects.get(fmt.shard_name(shard.number, codec))
        if found is None or Receipt.key_of(shard.number) not in objects:
            continue
        try:
            receipt, _ = store.get(Receipt.key_of(shard.number), MAX_WORK_FILE)
            expected = json.loads(receipt).get("stored_size", shard.size)
        except (ObjectMissing, ValueError, AttributeError):
            continue
        if found.size == expected:
            done.add(shard.number)
    return done


# --- the plan ---------------------------------------------------------------------------------


def save_plan(store: Store, prepared: Prepared) -> None:
    """Save ``prepared`` as the plan in the work folder of ``store``, by conditional create.

    Raises:
        ObjectExists: another merge saved its plan first.
    """
    store.create(PLAN_KEY, json.dumps(prepared.to_json(), sort_keys=True).encode())


def load_plan(out: str | os.PathLike | Store) -> Prepared | None:
    """The plan of the unfinished merge in ``out``, or None if there is none."""
    store = open_store(out)
    try:
        data, _ = store.get(PLAN_KEY, MAX_WORK_FILE)
    except ObjectMissing:
        return None
    try:
        return Prepared.from_json(json.loads(data))
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise FormatError(
            f"{store.url(PLAN_KEY)}: not a valid plan ({err}); start over with --force"
        ) from None


def require_plan(store: Store) -> Prepared:
    """The plan of the unfinished merge in ``store``; an InputError saying what to run if
    none."""
    prepared = load_plan(store)
    if prepared is None:
        if store.stat(fmt.MANIFEST_FILE) is not None:
            raise InputError(f"{store.location}: the merge is already finalized")
        raise InputError(
            f"{store.location}: no merge plan here; run 'repack merge BLEND {store.location} "
            "--plan-only' first"
        )
    return prepared


# --- the output folder ------------------------------------------------------------------------


def check_not_inside_sources(store: Store, sources: Iterable[SourceInfo]) -> None:
    """Refuse an OUT that is a folder sources are read from, or that contains one.

    A subfolder of a source folder is fine: sources are read by prefix, never by listing a
    folder, so nothing written there can be read back as input. Sources on object storage
    are never in a local folder, and object storage holds no local source.
    """
    target = os.path.realpath(store.location)
    inside = sorted(
        {os.path.dirname(os.path.realpath(s.path)) for s in sources if store.holds(s.path)}
    )
    for folder in inside:
        raise InputError(
            f"{store.location}: the output folder {'is' if folder == target else 'contains'} "
            f"{folder}, which holds sources of the blend being read; choose another folder"
        )


def top_names(store: Store) -> dict[str, bool]:
    """The names at the top of ``store`` (a folder's entries, the first part of a key), each
    with whether it holds more (a folder); the lock file and litter left out."""
    entries: dict[str, bool] = {}
    for key, _ in store.list():
        name, sep, _ = key.partition("/")
        if name != LOCK_FILE and not fmt.is_litter(name):
            entries[name] = entries.get(name, False) or bool(sep)
    return entries


def prepare_out(store: Store, overwrite: bool) -> None:
    """Make ``store`` empty: with ``overwrite`` empty it of what repack wrote there (the
    manifest first); refuse one holding anything else. The lock file of the writer at work
    and the litter of file managers (``.DS_Store``...) are neither counted nor touched."""
    store.prepare()
    entries = top_names(store)
    foreign = sorted(e for e in entries if not is_ours(e))
    where, what_file = (
        ("folder", ("file", "files")) if store.exclusive_lock else ("prefix", ("object", "objects"))
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        what = f"{plural(len(foreign), *what_file)} repack did not write ({shown})"
        if overwrite:
            raise OutputExists(
                f"{store.location}: holds {what}; --force replaces a repack only: choose an "
                f"empty or new {where}"
            )
        raise OutputExists(
            f"{store.location}: {where} is not empty: it holds {what}; choose an empty or new "
            f"{where}"
        )
    if entries and not overwrite:
        finished = fmt.MANIFEST_FILE in entries
        what = "a repack" if finished else "files of an unfinished merge"
        raise OutputExists(
            f"{store.location}: {where} is not empty: it holds {what}; choose an empty or new "
            f"{where}, or pass --force to replace it"
        )
    if SUPERSEDED_DIR in entries:
        _refuse_kept(store)
    if fmt.MANIFEST_FILE in entries:
        store.delete(fmt.MANIFEST_FILE)  # the commit point goes first
    for name, folder in sorted(entries.items()):
        if folder:
            store.delete_prefix(name + "/")
        elif name != fmt.MANIFEST_FILE:
            store.delete(name)


def _refuse_kept(store: Store) -> None:
    """Refuse ``--force`` over a repack whose edits keep superseded generations for readers
    that opened it before them: deleting them is a take-down, asked for by name (tombstones
    alone go with the rest)."""
    kept = [g for g in generations(store)[0] if g.kept]
    if not kept:
        return
    newest = kept[-1]
    raise OutputExists(
        f"{store.location}: keeps {plural(len(kept), 'superseded generation')} "
        f"({plural(sum(len(g.objects) for g in kept), 'file')}, the newest "
        f"{newest.describe()}) for readers that opened the repack before its edits; --force "
        f"would delete them under those readers. Run `repack gc {store.location} --older-than "
        "0` first (they are then gone for every reader), or wait until `repack gc` or the "
        "next edit deletes them",
        path=store.location,
    )


def remove_partial(store: Store, *, own: bool = False) -> bool:
    """Remove temp files of repack's from OUT and its work folder: all of them, or with
    ``own`` only this process's (other tasks may be writing theirs at the same time). Only
    names repack writes are touched (``shard-00003.bin.tmp-123``, never ``notes.tmp``).
    Returns whether anything was removed. (Object storage has no temp objects: a streaming
    write is invisible until committed; :meth:`~repack.store.Store.abort_uploads`.)"""
    removed = False
    for key, _ in list(store.list()):
        folder, _, name = key.rpartition("/")
        temp = temp_base(name)
        if folder not in ("", WORK_DIR) or temp is None or not _is_temp_of(temp[0]):
            continue
        if own and temp[1] != os.getpid():
            continue
        store.delete(key)
        removed = True
    return removed


def _is_temp_of(base: str) -> bool:
    """Whether a temp file of ``base`` (in OUT or its work folder) is one repack writes."""
    return (
        base in _OURS_FIXED
        or fmt.is_shard_name(base)
        or fmt.is_index_name(base)
        or fmt.is_fingerprint_name(base)
        or _FINGERPRINT_PART.match(base) is not None  # a task's fingerprints, in .work
        or base.endswith(".json")  # plan, receipts, index entry, writer records
    )


#: A shard's fingerprints saved by its task in the work folder (repack/read/fingerprints.py).
_FINGERPRINT_PART = re.compile(r"^fingerprints-\d{5,}\.(json|u64)$")


def remove_work(store: Store) -> None:
    """Finish a merge's clean-up in ``store``, whose manifest is written: remove every temp
    file (of this run and of any run killed before it), then the work folder, then the
    unfinished uploads killed runs left.

    Called with the exclusive writer lock held, so no writer is at work: not a task, nor a
    copy worker of a killed run (workers share their merge's lock). Temp files go first, so
    that while any may be left, the work folder is too, and a run killed here is finished by
    the next (:func:`~repack.merge.steps.plan_merge` calls this whenever it finds the merge
    complete).
    """
    remove_partial(store)
    store.delete_prefix(WORK_DIR + "/")
    store.abort_uploads()


def _written(name: str) -> bool:
    """Whether ``name`` is a shard, index or fingerprint file name."""
    return fmt.is_shard_name(name) or fmt.is_index_name(name) or fmt.is_fingerprint_name(name)


def remove_leftovers(store: Store, named: Iterable[str]) -> bool:
    """Remove what an interrupted ``add`` or ``remove`` left in the complete repack in
    ``store``: its work folder, temp files, and the shards, indexes and fingerprint files
    not in ``named`` (the files the manifest names, and the lease of the writer at work).
    Nothing named is touched, nor anything repack does not write. Then the unfinished
    uploads killed writers left. Returns whether anything was removed."""
    named = frozenset(named)
    removed = False
    for key, _ in list(store.list()):
        if "/" in key:
            continue
        temp = temp_base(key)
        if temp is not None:
            stale = temp[0] == fmt.MANIFEST_FILE or _written(temp[0])
        else:
            stale = _written(key) and key not in named
        if stale:
            store.delete(key)
            removed = True
    removed = store.delete_prefix(WORK_DIR + "/", keep=named) or removed
    store.abort_uploads()
    return removed
