"""``repack trace``: which data trained at iteration N, and where a document was read.

Steps, one module each: :mod:`repack.trace.settings` (the run's arguments, by Megatron-LM's
names), :mod:`repack.trace.batches` (iteration <-> consumed samples), :mod:`repack.samples.samplers`
(consumed samples <-> rank and row), :mod:`repack.trace.query` (the answers, over the datasets
:mod:`repack.trace.draws` builds with Megatron's own code) and :mod:`repack.trace.table` (the
table).
"""

__all__: list[str] = []
