"""Megatron's GPT samples in Megatron's order, for any framework: no torch, no megatron-core.

:class:`GPTSamples` (:mod:`repack.samples.dataset`) is one split of what megatron-core's
``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` builds, sample for sample, over a repack
(folder, ``s3://``, ``msc://``) or a plain blend; :mod:`repack.samples.samplers` is
Megatron-LM's batch samplers (``single``, ``cyclic``) as arithmetic, shared with
``repack trace``; :mod:`repack.samples.adapters` hands the samples to Grain, PyTorch and
Hugging Face ``datasets``. See docs/samples.md.
"""

from repack.samples.adapters import GrainSource, TorchSamples, hf_examples
from repack.samples.dataset import GPTSamples, SampleOrigin
from repack.samples.samplers import Sampler, micro_batches, randperm

__all__ = [
    "GPTSamples",
    "GrainSource",
    "SampleOrigin",
    "Sampler",
    "TorchSamples",
    "hf_examples",
    "micro_batches",
    "randperm",
]
