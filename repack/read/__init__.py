"""Opening a repack and checking it: the reader every command and the loader share, and the
commands that read.

:mod:`~repack.read.reader` (a repack opened once per process: one mapping or descriptor per
shard, whatever the number of sources), :mod:`~repack.read.views` (a source as
Megatron's ``IndexedDataset`` reads it), :mod:`~repack.read.readahead` (the read-ahead of an
object-store shard), :mod:`~repack.read.verify` (``repack verify``: every checksum
recomputed), :mod:`~repack.read.extract` (``repack extract``: a source's ``.bin``/``.idx`` back,
byte for byte), :mod:`~repack.read.summary` (``repack inspect``) and
:mod:`~repack.read.fingerprints` (the document fingerprints: computed while a merge copies,
loaded for the doctor's duplicate report and checked by verify).
"""

__all__: list[str] = []
