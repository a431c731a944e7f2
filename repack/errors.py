"""Every failure repack reports, one class per cause.

The library raises these; the command line turns them into a one-line ``Error: ...`` message
and an exit status (``exit_code``) without a traceback.
"""

from __future__ import annotations

__all__ = [
    "raise_if_unreadable",
    "RepackError",
    "InputError",
    "BlendError",
    "PhaseError",
    "SourceError",
    "SourceMissing",
    "BadSources",
    "BadMagic",
    "UnsupportedVersion",
    "UnknownDType",
    "TruncatedFile",
    "CorruptIndex",
    "SizeMismatch",
    "IncompatibleSources",
    "OutputExists",
    "FormatError",
    "UnsafePath",
    "ShortRead",
    "ChecksumMismatch",
    "UnknownSource",
    "UnsupportedMegatron",
    "NotCompiled",
    "UndrawableSplit",
    "TooManyDatasets",
    "WriterBusy",
    "StoreError",
    "UnsupportedLocation",
    "MissingExtra",
    "ObjectMissing",
    "BucketMissing",
    "ObjectExists",
    "ObjectChanged",
    "CheckpointError",
    "NotACheckpoint",
    "CheckpointMissing",
    "CorruptCheckpoint",
    "Stalled",
]


class RepackError(Exception):
    """Base class of every error repack raises on purpose.

    Args:
        message: What went wrong, naming the file (the ``Error:`` line of the command line).
        path: The file, folder or object at fault (a path, or a URL such as
            ``s3://bucket/x.repack/shard-00000.bin``), where the raiser knows it: ``--json``
            reports it, and ``repack verify`` reports it per file without parsing the message.
            ``location`` is another name for it.
    """

    #: Exit status of the command line for this error.
    exit_code = 3

    def __init__(self, *args: object, path: str | None = None, location: str | None = None) -> None:
        super().__init__(*args)
        #: The file, folder or object at fault, or None.
        self.path = path if path is not None else location

    @property
    def location(self) -> str | None:
        """The file or object this error is about, if known (the same as ``path``)."""
        return self.path

    @property
    def cause(self) -> str:
        """The message without the location it starts with (``"cannot read: not found"`` of
        ``"s3://b/x/shard-00000.bin: cannot read: not found"``): what a report that names
        the file apart (``repack verify``) prints beside it."""
        text = str(self)
        if self.path is not None and text.startswith(f"{self.path}: "):
            return text[len(self.path) + 2 :]
        return text


class InputError(RepackError):
    """Bad input given by the user (blend file, source prefix, output folder)."""


class BlendError(InputError):
    """A blend file cannot be parsed or its content is inconsistent."""


class PhaseError(InputError):
    """A phase schedule file (``repack doctor --phases``, ``REPACK_PHASES``) cannot be read or
    is inconsistent, or does not describe the run it is used with."""


class SourceError(InputError):
    """A Megatron ``.bin``/``.idx`` source prefix is unusable."""


class SourceMissing(SourceError):
    """The ``.bin`` or ``.idx`` file of a source does not exist or cannot be read."""


class BadSources(SourceError):
    """Several sources of a blend are unusable: every one of them, found in one pass.

    The message lists the first :attr:`SHOWN` (file and cause, one a line) and counts the
    rest; :attr:`errors` holds them all. A single bad source raises its own error instead
    (see :meth:`of`).
    """

    #: How many sources the message lists.
    SHOWN = 20

    def __init__(
        self,
        errors: tuple[InputError, ...] | list[InputError],
        total: int,
        blend: str | None = None,
    ) -> None:
        errors = tuple(errors)
        head = f"{len(errors)} of {total} sources cannot be used; nothing was written:"
        lines = [head if blend is None else f"{blend}: {head}"]
        lines += [f"  {err}" for err in errors[: self.SHOWN]]
        if len(errors) > self.SHOWN:
            lines.append(f"  and {len(errors) - self.SHOWN} more")
        super().__init__("\n".join(lines), path=blend)
        #: The error of each bad source, in the blend's order.
        self.errors = errors
        self.total = total

    def __reduce__(self):  # pickled as what it was made of, not as its message
        return type(self), (self.errors, self.total, self.path)

    @classmethod
    def of(cls, errors: list[InputError], total: int, blend: str | None = None) -> InputError:
        """The error to raise for ``errors`` of ``total`` sources of the blend file ``blend``:
        the one error, or all."""
        return errors[0] if len(errors) == 1 else cls(errors, total, blend)


class BadMagic(SourceError):
    """A file does not start with the magic bytes of its format."""


class UnsupportedVersion(SourceError):
    """A file carries a format version this release cannot read."""


class UnknownDType(SourceError):
    """A ``.idx`` header names a dtype code outside the Megatron table."""


class TruncatedFile(SourceError):
    """A file is shorter than its header says."""


class CorruptIndex(SourceError):
    """Index arrays are inconsistent (pointers, document indices, trailing bytes...)."""


class SizeMismatch(SourceError):
    """A ``.bin`` file's size differs from the sum of its sequence lengths."""


class IncompatibleSources(InputError):
    """Sources that cannot be combined the way they were asked to be."""


class OutputExists(InputError):
    """The output folder is not empty and overwriting was not asked for."""


class FormatError(RepackError):
    """A repack folder is structurally broken or of an unknown format/version."""


class UnsafePath(FormatError):
    """A file of a repack leads outside its folder (a symbolic link pointing elsewhere)."""


class ShortRead(RepackError):
    """A file ended before the bytes a read needed: it is truncated, or shrank while read.

    (Not ``EOFError``: that one means the end of interactive input, which click turns into a
    bare ``Aborted!``.)
    """


class ChecksumMismatch(RepackError):
    """Stored and computed checksums differ: the data is damaged."""

    exit_code = 1


class UnknownSource(RepackError):
    """A source prefix asked for is not in the repack."""


class UnsupportedMegatron(RepackError):
    """The installed Megatron-Core lacks something repack's loader relies on."""


class NotCompiled(RepackError):
    """What was asked needs a compiled piece of repack that this install did not build (no C
    compiler or Python headers at ``pip install`` time)."""


class UndrawableSplit(InputError):
    """Samples are asked of a split slice that cannot give any, where stock Megatron would hang
    (GPT: no tokens) or loop for 2**31 epochs and then fail (BERT, T5: the blend draws from a
    slice without a drawable document)."""


class TooManyDatasets(InputError):
    """A blend of more datasets than Megatron's ``BlendedDataset`` takes: its dataset index is
    int16, so it asserts fewer than 32,767 (under ``python -O`` the index wraps, and samples
    come from the wrong datasets)."""


class WriterBusy(InputError):
    """Another repack command is writing the same repack folder (``merge``, ``add`` or
    ``remove``): one writer at a time."""

    def __init__(self, message: str, holders: tuple = (), *, path: str | None = None) -> None:
        super().__init__(message, path=path)
        #: The :class:`repack.store.lock.Holder` records of the writers found at work.
        self.holders = holders


class StoreError(RepackError):
    """Object storage refused or failed a request (network, permission, server error)."""


class UnsupportedLocation(InputError):
    """A location this release cannot use: an unknown URL scheme (never taken as a folder
    name), or object storage given to a command that works on local folders only."""


class MissingExtra(InputError):
    """A URL needs a client library that is not installed (the ``s3`` or ``msc`` extra)."""


class ObjectMissing(StoreError):
    """The object (or file) asked for does not exist."""


class BucketMissing(StoreError):
    """The bucket a location names does not exist (not a missing object in it: the location
    is wrong, or the bucket was deleted)."""


class ObjectExists(StoreError):
    """A conditional create found the object already there: another writer got there first."""


class ObjectChanged(StoreError):
    """An object is no longer the version that was read (its ETag changed): another writer
    replaced it, or a repack being read was replaced on the server."""


class Stalled(StoreError):
    """The server did not answer (to connect, or with a byte of its reply) within the bound
    ``REPACK_S3_STALL_TIMEOUT`` sets, over every attempt of a request."""


class CheckpointError(InputError):
    """A training run's checkpoint cannot give the run's settings (``repack.trace.checkpoints``)."""


class NotACheckpoint(CheckpointError):
    """A folder is not a checkpoint folder of Megatron-LM or Megatron-Bridge (or of one of their
    iterations)."""


class CheckpointMissing(CheckpointError):
    """The checkpoint folder lacks the iteration asked for, or a file the checkpoint's own
    layout says it has."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file cannot be read or does not hold what its writer puts in it."""


def raise_if_unreadable(err: BaseException) -> None:
    """Raise ``err`` again if it says a repack (or the originals of its sources) cannot be
    read at all, rather than that a file of it is missing or damaged: object storage refusing
    or failing requests (wrong credentials, an endpoint that does not answer, a bucket that does
    not exist, a network or server error), or a local file this user may not read.
    ``repack verify``'s verdict is then no verdict: the command line prints one ``Error:`` line
    and exits 3, as every command does, instead of calling an intact repack damaged."""
    if isinstance(err, StoreError) and not isinstance(err, ObjectMissing):
        raise err
    if isinstance(err, PermissionError):
        raise err
