"""The output folder while it is being written: what may be in it, the work folder
``OUT/.work`` (plan, index entry, shard receipts) and temp files.

Everything that decides "is this file ours, finished, or a leftover" lives here, so that merge,
``repack add`` and ``repack remove`` agree on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field

from repack import format as fmt
from repack.errors import FormatError, InputError, OutputExists
from repack.fileio import atomic_write, fsync_dir
from repack.lock import LOCK_FILE
from repack.merge.prepare import Prepared
from repack.plan import PlannedShard
from repack.source_data import is_remote
from repack.sources import SourceInfo
from repack.units import plural

__all__ = [
    "INDEX_ENTRY_FILE",
    "MAX_WORK_FILE",
    "PLAN_FILE",
    "WORK_DIR",
    "Receipt",
    "check_not_inside_sources",
    "is_ours",
    "load_plan",
    "prepare_out",
    "read_work_json",
    "remove_leftovers",
    "remove_partial",
    "remove_work",
    "require_plan",
    "save_plan",
    "shard_finished",
    "temp_name",
    "work_path",
]

#: Folder of OUT holding the plan and shard receipts of an unfinished merge, add or remove.
WORK_DIR = fmt.WORK_DIR
PLAN_FILE = "plan.json"
#: The index member of the manifest-to-be, saved once the index is written.
INDEX_ENTRY_FILE = "index.json"
#: Bound on the files of the work folder read back (plan, index entry, receipts).
MAX_WORK_FILE = 256 * 1024 * 1024

_OURS_FIXED = {fmt.MANIFEST_FILE, "cache", WORK_DIR, LOCK_FILE}


def work_path(out: str, *names: str) -> str:
    """Path of ``names`` in the work folder of ``out``."""
    return os.path.join(out, WORK_DIR, *names)


def temp_name(path: str) -> str:
    """This process's temp name for ``path``: two runs of one task never share a file."""
    return f"{path}.tmp-{os.getpid()}"


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
    def path(out: str, number: int) -> str:
        """Where the receipt of shard ``number`` is saved."""
        return work_path(out, fmt.shard_name(number) + ".json")

    def save(self, out: str, number: int) -> None:
        """Save atomically as the receipt of shard ``number``."""
        data = json.dumps(self.to_json(), sort_keys=True).encode()
        atomic_write(self.path(out, number), data)

    @classmethod
    def load(cls, out: str, number: int) -> Receipt:
        """The saved receipt of shard ``number``, or a FormatError naming its file."""
        path = cls.path(out, number)
        try:
            return cls.from_json(read_work_json(path))
        except (KeyError, TypeError) as err:
            raise FormatError(f"{path}: damaged ({err}); start over with --force") from None


def read_work_json(path: str):
    """A JSON file of the work folder, or a FormatError naming it."""
    try:
        with open(path, "rb") as stream:
            data = stream.read(MAX_WORK_FILE + 1)
        if len(data) > MAX_WORK_FILE:
            raise ValueError(f"larger than {MAX_WORK_FILE} bytes")
        return json.loads(data)
    except (ValueError, RecursionError) as err:
        raise FormatError(f"{path}: damaged ({err}); start over with --force") from None


def shard_finished(out: str, shard: PlannedShard, codec: str | None = None) -> bool:
    """Whether ``shard`` has a receipt and its file has the size the receipt records."""
    try:
        with open(Receipt.path(out, shard.number), "rb") as stream:
            receipt = json.loads(stream.read())
        size = os.stat(os.path.join(out, fmt.shard_name(shard.number, codec))).st_size
    except (FileNotFoundError, ValueError):
        return False
    return size == receipt.get("stored_size", shard.size)


# --- the plan ---------------------------------------------------------------------------------


def save_plan(out: str, prepared: Prepared) -> None:
    """Save ``prepared`` atomically as the plan in the work folder of ``out``."""
    atomic_write(work_path(out, PLAN_FILE), json.dumps(prepared.to_json(), sort_keys=True).encode())


def load_plan(out: str | os.PathLike) -> Prepared | None:
    """The plan of the unfinished merge in ``out``, or None if there is none."""
    path = work_path(os.fspath(out), PLAN_FILE)
    try:
        with open(path, "rb") as stream:
            return Prepared.from_json(json.loads(stream.read()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise FormatError(f"{path}: not a valid plan ({err}); start over with --force") from None


def require_plan(out: str) -> Prepared:
    """The plan of the unfinished merge in ``out``; an InputError saying what to run if none."""
    prepared = load_plan(out)
    if prepared is None:
        if os.path.exists(os.path.join(out, fmt.MANIFEST_FILE)):
            raise InputError(f"{out}: the merge is already finalized")
        raise InputError(
            f"{out}: no merge plan here; run 'repack merge BLEND {out} --plan-only' first"
        )
    return prepared


# --- the output folder ------------------------------------------------------------------------


def check_not_inside_sources(out: str, sources: Iterable[SourceInfo]) -> None:
    """Refuse an OUT that is a folder sources are read from, or that contains one.

    A subfolder of a source folder is fine: sources are read by prefix, never by listing a
    folder, so nothing written there can be read back as input. Sources on object storage
    are never in a local folder.
    """
    target = os.path.realpath(out)
    local = (s for s in sources if not is_remote(s.path))
    for folder in sorted({os.path.dirname(os.path.realpath(s.path)) for s in local}):
        if folder == target or folder.startswith(target + os.sep):
            raise InputError(
                f"{out}: the output folder {'is' if folder == target else 'contains'} {folder}, "
                "which holds sources of the blend being read; choose another folder"
            )


def prepare_out(out: str, overwrite: bool) -> None:
    """Make ``out`` an empty folder: create it, or with ``overwrite`` empty it of what repack
    wrote there (the manifest first); refuse a folder holding anything else. The lock file
    of the writer at work and the litter of file managers (``.DS_Store``...) are neither
    counted nor touched."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExists(f"{out}: exists and is not a folder")
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    entries = [e for e in entries if e != LOCK_FILE and not fmt.is_litter(e)]
    foreign = [e for e in entries if not is_ours(e)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        what = f"{plural(len(foreign), 'file', 'files')} repack did not write ({shown})"
        if overwrite:
            raise OutputExists(
                f"{out}: holds {what}; --force replaces a repack only: choose an empty or new "
                "folder"
            )
        raise OutputExists(
            f"{out}: folder is not empty: it holds {what}; choose an empty or new folder"
        )
    if entries and not overwrite:
        finished = os.path.exists(os.path.join(out, fmt.MANIFEST_FILE))
        what = "a repack" if finished else "files of an unfinished merge"
        raise OutputExists(
            f"{out}: folder is not empty: it holds {what}; choose an empty or new folder, or "
            "pass --force to replace it"
        )
    if entries:
        manifest = os.path.join(out, fmt.MANIFEST_FILE)
        if os.path.exists(manifest):
            os.unlink(manifest)
            fsync_dir(out)
        for entry in entries:
            path = os.path.join(out, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
    os.makedirs(out, exist_ok=True)


def remove_partial(out: str, *, own: bool = False) -> bool:
    """Remove temp files of repack's from OUT and its work folder: all of them, or with
    ``own`` only this process's (other tasks may be writing theirs at the same time). Only
    names repack writes are touched (``shard-00003.bin.tmp-123``, never ``notes.tmp``).
    Returns whether anything was removed."""
    mine = f".tmp-{os.getpid()}"
    removed = False
    for folder in (out, work_path(out)):
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in names:
            base, tmp, pid = name.partition(".tmp-")
            if not tmp or (own and not name.endswith(mine)) or not _is_temp_of(base, pid):
                continue
            path = os.path.join(folder, name)
            if os.path.isdir(path) or os.path.islink(path):
                continue
            try:
                os.unlink(path)
                removed = True
            except FileNotFoundError:
                pass
    return removed


def _is_temp_of(base: str, pid: str) -> bool:
    """Whether ``BASE.tmp-PID`` is a temp file repack writes (in OUT or its work folder)."""
    if not pid.isdigit():
        return False
    base = os.path.basename(base)
    return (
        base in _OURS_FIXED
        or fmt.is_shard_name(base)
        or fmt.is_index_name(base)
        or fmt.is_fingerprint_name(base)
        or _FINGERPRINT_PART.match(base) is not None  # a task's fingerprints, in .work
        or base.endswith(".json")  # plan, receipts, index entry, writer records
    )


#: A shard's fingerprints saved by its task in the work folder (repack/fingerprints.py).
_FINGERPRINT_PART = re.compile(r"^fingerprints-\d{5,}\.u64$")


def remove_work(out: str) -> None:
    """Finish a merge's clean-up in ``out``, whose manifest is written: remove every temp file
    (of this run and of any run killed before it), then the work folder.

    Called with the exclusive writer lock held, so no writer is at work: not a task, nor a
    copy worker of a killed run (workers share their merge's lock). Temp files go first, so
    that while any may be left, the work folder is too, and a run killed here is finished by
    the next (:func:`~repack.merge.steps.plan_merge` calls this whenever it finds the merge
    complete).
    """
    removed = remove_partial(out)
    if os.path.isdir(work_path(out)):
        shutil.rmtree(work_path(out))
        removed = True
    if removed:
        fsync_dir(out)


def _written(name: str) -> bool:
    """Whether ``name`` is a shard, index or fingerprint file name."""
    return fmt.is_shard_name(name) or fmt.is_index_name(name) or fmt.is_fingerprint_name(name)


def remove_leftovers(out: str, named: Iterable[str]) -> bool:
    """Remove what an interrupted ``add`` or ``remove`` left in the complete repack ``out``:
    its work folder, temp files, and the shards and indexes not in ``named`` (the files the
    manifest names). Nothing named is touched. Returns whether anything was removed."""
    named = set(named)
    removed = False
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name == WORK_DIR:
            shutil.rmtree(path)
            removed = True
            continue
        base, tmp, _ = name.partition(".tmp")
        if tmp:
            stale = base == fmt.MANIFEST_FILE or _written(base)
        else:
            stale = _written(name) and name not in named
        if stale and os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
            removed = True
    if removed:
        fsync_dir(out)
    return removed
