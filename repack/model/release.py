"""What the doctor's figures depend on that differs between megatron-core releases.

The doctor predicts what the installed megatron-core does
(:func:`repack.releases.installed_release`; where none is installed, the newest's
arithmetic). Everything else it computes is the same in every supported release, 0.12.3 to
0.19.2 (``tests/test_doctor_megatron.py`` and ``tests/test_doctor_blending.py`` compare it
with each). A release is ``(major, minor)``.

No I/O, no imports of Megatron or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FIXED_SURPLUS",
    "OverDrawText",
    "bin_fds",
    "has_surplus_setting",
    "loss_mask_per_dataset",
    "over_draw_text",
]

#: megatron-core 0.12's fixed sample surplus per dataset: ``margin=0.5`` (per cent), which
#: ``_get_size_per_split_per_dataset`` applies as ``1 + margin / 100``
#: (``blended_megatron_dataset_builder.py``, 0.12.3 lines 220, 303 and 573). The same float as
#: 0.13's default ``mid_level_dataset_surplus = 0.005``.
FIXED_SURPLUS = 0.005


def has_surplus_setting(release: tuple[int, int]) -> bool:
    """Whether the config has ``mid_level_dataset_surplus`` (``--mid-level-dataset-surplus``).

    0.13 and later (``blended_megatron_dataset_config.py``, 0.13.1 line 66); 0.12 builds
    :data:`FIXED_SURPLUS` more, always.
    """
    return release >= (0, 13)


def bin_fds(release: tuple[int, int]) -> int:
    """Descriptors one ``IndexedDataset`` holds for its ``.bin`` with ``mmap_bin_files``.

    From 0.13, ``_MMapBinReader`` opens the ``.bin`` and maps the open file, keeping both: the
    file object and the map's duplicate descriptor, 2 (``indexed_dataset.py``, 0.13.1 lines
    381-382: ``self._bin_file_reader = open(bin_path, mode="rb")``, then
    ``numpy.memmap(self._bin_file_reader, ...)``). In 0.12 it maps the path
    (``numpy.memmap(bin_path, ...)``, 0.12.3 line 372): the map's descriptor only, 1.
    """
    return 2 if release >= (0, 13) else 1


def loss_mask_per_dataset(release: tuple[int, int]) -> bool:
    """Whether each repacked dataset keeps a loss mask of its own (``4 S`` bytes).

    Up to 0.14, ``GPTDataset.__getitem__`` hands out its cached loss mask itself and writes
    into it (``loss_mask = self.cached_loss_mask``, 0.14.0 ``gpt_dataset.py`` line 207), so the
    repacked classes give each dataset its own (:mod:`repack.megatron.masks`); from 0.15 it clones
    it per sample (``self.cached_loss_mask.clone()``, 0.15.3 line 207) and they share one.
    """
    return release < (0, 15)


@dataclass(frozen=True)
class OverDrawText:
    """Where stock Megatron stops on an over-draw, and the start of what it says."""

    where: str
    text: str


def over_draw_text(
    release: tuple[int, int], split: str, drawn: int, number: int, available: int
) -> OverDrawText:
    """The ``IndexError`` stock raises when the ``split`` blend draws ``drawn`` samples from its
    ``number``-th drawn dataset, which holds ``available``.

    From 0.13 ``BlendedDataset._build_indices`` checks (``blended_dataset.py``, 0.13.1 lines
    157-167); in 0.12 ``BlendedMegatronDatasetBuilder.build`` checks the built blend, in other
    words (``blended_megatron_dataset_builder.py``, 0.12.3 lines 160-172). Both number the
    datasets drawn from (``numpy.unique`` of the dataset index), not all of them.
    """
    if release >= (0, 13):
        return OverDrawText(
            "BlendedDataset._build_indices",
            f"The {split} blend oversamples the contributing datasets and, for example, "
            f"requests {drawn} samples from GPTDataset number {number} in excess of its size "
            f"{available}",
        )
    return OverDrawText(
        "BlendedMegatronDatasetBuilder.build",
        f"The {split} blend oversamples the contributing datasets  and, e.g., requests {drawn} "
        f"samples from GPTDataset {number} with size {available}",
    )
