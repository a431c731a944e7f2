"""Megatron's data arithmetic, in numpy, with no import of torch or megatron-core.

So far: :mod:`repack.model.blending`, ``BlendedDataset``'s blending index (the same bytes as
megatron-core's ``helpers.cpp``, without its samples x datasets loop). The doctor's split
sizes, epochs and GPT indices move here with the layout of issue 37.
"""
