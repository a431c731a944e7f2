"""The loader's caches inside a repack (``OUT/cache/``), which the loader writes and
``repack remove`` prunes: torch-free, so that a command that only edits a repack never imports
Megatron.

:mod:`~repack.cache.indexcache` (Megatron's per-dataset cached indices consolidated into one
mapped pack per build, with a catalog), :mod:`~repack.cache.index_records` (the catalog's
records, in columns, a ``.npy`` header, the pack writer) and :mod:`~repack.cache.loadercache` (what
``repack remove`` takes out of ``OUT/cache/``: nothing of a removed source stays).
"""

__all__: list[str] = []
