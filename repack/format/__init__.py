"""The on-disk format of a repack, as data: what the files hold and how they are checked.

:mod:`~repack.format.spec` (names, magic numbers, dtype codes, the index layout: the constants
docs/format.md specifies), :mod:`~repack.format.manifest` (the manifest: parse, check, write),
:mod:`~repack.format.sources` (its sources and blend in columns, an entry made when asked for),
:mod:`~repack.format.codec` (the zstd frames of a compressed shard), :mod:`~repack.format.xxh3`
(the checksum algorithm's Python fallback), :mod:`~repack.format.blend` (the blend as the
manifest records it) and :mod:`~repack.format.gcpause` (the collector paused around a bulk
parse, a manifest's or an index catalog's). No module here opens a file of a repack: reading
and writing them is the store's, the writers' and the readers' job, above this package.
"""

__all__: list[str] = []
