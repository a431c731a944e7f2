"""``repack bench``: a run's own reads, replayed on this node's storage.

Steps, one module each: :mod:`repack.bench.plan` (which bytes each rank's DataLoader workers
read, for which micro-batch, from ``repack trace``'s datasets and samplers),
:mod:`repack.bench.pagecache` (this node's page cache emptied of those files, and asked what it
still holds), :mod:`repack.bench.replay` (the reads made by ``ranks x workers`` processes,
paced as the DataLoaders are), :mod:`repack.bench.report` (the figures, a node's result, the
merge of several nodes'), and :mod:`repack.bench.run` (the steps in order).
"""

__all__: list[str] = []
