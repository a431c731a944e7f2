"""What goes into a repack or a run: the blend, its sources, and what a merge would make of them.

:mod:`~repack.inputs.blend_files` (Megatron, NeMo and Megatron-Bridge blend files, read into one
:class:`~repack.format.blend.Blend`), :mod:`~repack.inputs.sources` (each prefix's ``.idx`` and
``.bin`` validated before anything is written), :mod:`~repack.inputs.plan` (which bytes of which
source go to which shard; pure) and :mod:`~repack.inputs.facts` (each source's sequences,
documents, tokens and dtype, read from its ``.idx`` or from a repack's index, alike for the
doctor, the phases' replay and the loader's continuation).
"""

__all__: list[str] = []
