"""Megatron's data arithmetic, in numpy, with no import of torch or megatron-core.

:mod:`~repack.model.arithmetic` (split bounds, per-dataset sample counts, epochs, index dtypes:
small pure functions, each naming the megatron-core code it mirrors),
:mod:`~repack.model.splits` (the builder's branches: what each split builds from a blend),
:mod:`~repack.model.gpt_indices` (``GPTDataset``'s document and shuffle indices, stock's and the
phases' continuation's), :mod:`~repack.model.blending` (``BlendedDataset``'s blending index:
Megatron's bytes without its samples x datasets loop, compiled in ``_blending.c``),
:mod:`~repack.model.blend_draws` (the samples each dataset is drawn) and
:mod:`~repack.model.release` (what differs between releases). The doctor, the phases and the
loader use them; the tests hold each to real megatron-core on every supported release.

Where Megatron's own build runs instead, and why: the loader builds each ``GPTDataset``'s
indices with the installed megatron-core's own functions (:mod:`repack.megatron`), because a
training run must get the release's bytes even where a future release changes them;
``repack trace`` does the same (:mod:`repack.trace.draws`), because its answer is the run's.
The doctor and the phases' replay, which must run without Megatron and build every source of
every phase in seconds, use this package.
"""

__all__: list[str] = []
