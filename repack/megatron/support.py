"""What repack relies on in a Megatron dataset class, checked when a repacked class is made:
by feature (a method and the parameters repack passes it), not by version number, so that a
release that lacks one fails at once, naming the release and what is missing.
"""

from __future__ import annotations

import inspect

import megatron.core
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset

from repack.errors import UnsupportedMegatron

try:  # absent from none of the supported releases, but not needed by GPT users
    from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset
except ImportError:  # pragma: no cover - a release without it fails only for masked classes
    MaskedWordPieceDataset = None

__all__ = ["MEGATRON_VERSION", "check_supported"]

#: The megatron-core release in use, as it reports itself.
MEGATRON_VERSION: str = str(getattr(megatron.core, "__version__", "unknown"))


# --- what repack relies on, checked when a class is made ------------------------------------

#: Methods the repacked classes override or call, with the parameters Megatron passes them.
_NEEDS: dict[str, dict[str, tuple[str, ...]]] = {
    "any": {"build_low_level_dataset": ("dataset_path", "config")},
    "gpt": {
        "_build_document_sample_shuffle_indices": (),
        "_get_num_tokens_per_epoch": (),
    },
    "masked": {"_build_sample_index": ("sequence_length", "min_sentences_per_sample")},
}


def _family(cls: type) -> str:
    if issubclass(cls, GPTDataset):
        return "gpt"
    if MaskedWordPieceDataset is not None and issubclass(cls, MaskedWordPieceDataset):
        return "masked"
    return "any"


def check_supported(cls: type) -> str:
    """The family of ``cls`` (``gpt``, ``masked`` or ``any``), after checking that it has every
    method repack relies on, with the parameters repack passes.

    Raises:
        UnsupportedMegatron: ``cls`` is not a Megatron dataset class, or lacks one of them.
    """
    if not (isinstance(cls, type) and issubclass(cls, MegatronDataset)):
        raise UnsupportedMegatron(
            f"repack.megatron: {cls!r} is not a Megatron-Core dataset class (a subclass of "
            "megatron.core.datasets.megatron_dataset.MegatronDataset)"
        )
    family = _family(cls)
    wanted = {**_NEEDS["any"], **(_NEEDS[family] if family != "any" else {})}
    for name, parameters in wanted.items():
        method = getattr(cls, name, None)
        problem = None
        if not callable(method):
            problem = f"has no method {name}()"
        else:
            try:
                found = [
                    p.name
                    for p in inspect.signature(method).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    and p.default is p.empty
                    and p.name != "self"
                ]
            except (TypeError, ValueError):  # a builtin without a signature: trust it
                found = list(parameters)
            if len(found) != len(parameters):
                problem = (
                    f"has {name}({', '.join(found)}), repack calls {name}({', '.join(parameters)})"
                )
        if problem:
            raise UnsupportedMegatron(
                f"repack.megatron: {cls.__module__}.{cls.__qualname__} of megatron-core "
                f"{MEGATRON_VERSION} {problem}; repack supports megatron-core 0.12 to 0.20 "
                "(please report this release at the repack issue tracker)"
            )
    return family
