"""Megatron-Core integration: any ``IndexedDataset``-based dataset class, reading a repack.

Swap the class given to ``BlendedMegatronDatasetBuilder`` and keep everything else — the
config, the blend, the weights, the seed::

    from repack.megatron import RepackedGPTDataset      # REPACK_DIR=/lustre/me/blend.repack
    BlendedMegatronDatasetBuilder(RepackedGPTDataset, sizes, is_built_on_rank, config).build()

    from repack.megatron import repacked                # any other class, e.g. BERT, T5, FIM
    BERT = repacked(BERTMaskedWordPieceDataset, "/lustre/me/blend.repack")

Samples are bit-identical to stock Megatron's, while the process holds a constant number of
mmaps and file descriptors:

* every blend prefix becomes a :class:`~repack.read.views.SourceDataset` over the shared shards;
* ``GPTDataset``'s per-dataset cached ``.npy`` indices (and those of its subclasses) are
  consolidated into one mapped pack per build (:mod:`repack.cache.indexcache`); with
  ``path_to_cache`` unset they live in ``OUT/cache/``, as do the sample indices of the masked
  (BERT, T5) datasets;
* the ``BlendedDataset`` over them builds its index with :mod:`repack.model.blending` (the
  same bytes as Megatron's helper, without its samples x datasets loop); :func:`fast_blending`
  does the same for stock blends (:mod:`repack.megatron.blendhook`).

Works with megatron-core 0.12 to Megatron-LM's main branch (0.20 dev). What repack relies on is
checked when a class is made, by feature (a method and its parameters), not by version number:
a release that lacks it fails there with :class:`~repack.errors.UnsupportedMegatron`, naming
the version and what is missing. Megatron calls the class by its stock name (``__name__``), so
cache hashes and file names are stock Megatron's.

The package, one module per job: :mod:`~repack.megatron.support` (what repack relies on in a
class, checked when one is made), :mod:`~repack.megatron.mixin` (what every repacked class
shares), :mod:`~repack.megatron.gpt` and :mod:`~repack.megatron.masked` (the two families'
mixins), :mod:`~repack.megatron.masks` (the masks shared per process)
and Megatron's build of a repack's blend, a hook each: :mod:`~repack.megatron.blendhook` (the
blending index), :mod:`~repack.megatron.buildhook` (the descriptions and the collector),
:mod:`~repack.megatron.buildpool` (the calling thread for a pool of one) and
:mod:`~repack.megatron.blenddesc` (a blend's description held compressed); this module makes
the classes. A
source is read through :mod:`repack.read.views` and the consolidated index cache is
:mod:`repack.cache.indexcache`: both torch-free, outside this package, so that what does not
load with Megatron never imports it.

This package imports megatron-core, which the user brings (``pip install megatron-repack`` never
installs or changes torch or megatron-core); the rest of repack does not.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

from megatron.core.datasets.gpt_dataset import GPTDataset

from repack.errors import PhaseError
from repack.megatron import blenddesc, blendhook, buildhook, buildpool
from repack.megatron.blendhook import (
    build_blending_indices,
    build_exhaustive_blending_indices,
    fast_blending,
)
from repack.megatron.gpt import RepackedGPT
from repack.megatron.masked import RepackedMasked
from repack.megatron.masks import install as install_shared_masks
from repack.megatron.mixin import CACHE_SUBDIR, ENV_VAR, NPY_ENV_VAR, Repacked
from repack.megatron.support import MEGATRON_VERSION, check_supported
from repack.read.reader import Repack
from repack.store import normalize

__all__ = [
    "CACHE_SUBDIR",
    "ENV_VAR",
    "MEGATRON_VERSION",
    "NPY_ENV_VAR",
    "READY_MADE",
    "RepackedGPTDataset",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "dataset_class",
    "fast_blending",
    "repacked",
]

install_shared_masks()  # GPTDataset's cached masks, once per process (repack.megatron.masks)
# BlendedDataset's index: repack's for a repack's blends, stock's helper for stock ones unless
# fast_blending() is called (repack.megatron.blendhook)
blendhook.register_repacked(Repacked)
blendhook.install()
# its descriptions and the collector during its build (repack.megatron.buildhook)
buildhook.install()
# a repack's datasets built in the calling thread, not by a pool of one thread, whose futures
# leave holes that the datasets pin (repack.megatron.buildpool)
buildpool.install()
# a BlendedDataset of a repack's datasets holds its description compressed once hashed
# (repack.megatron.blenddesc)
blenddesc.install()

_MIXINS = {"gpt": RepackedGPT, "masked": RepackedMasked, "any": Repacked}


# --- making classes ---------------------------------------------------------------------------


def _make(
    base: type,
    parent: type | None,
    repack_dir: str | None,
    multimodal: bool,
    phases: str | None = None,
    phase: int | None = None,
) -> type:
    """A new class reading a repack for ``base``: a subclass of ``parent`` (the unbound class
    of ``base``) when there is one, else of ``base`` and the mixin of its family."""
    bases = (parent,) if parent is not None else (_MIXINS[check_supported(base)], base)
    where = repack_dir or f"the repack in ${ENV_VAR}"
    namespace = {
        "repack_dir": repack_dir,
        "repack_multimodal": multimodal,
        "repack_phases": phases,
        "repack_phase": phase,
        "repack_base": base,
        "__module__": __name__,
        "__qualname__": f"Repacked{base.__name__}",
        "__doc__": f"{base.__qualname__} reading its sources from {where}.",
    }
    # Megatron names cache files, and hashes dataset descriptions, with type(self).__name__:
    # the stock name keeps every hash and file name identical to stock Megatron's: a stock
    # cache is a hit here (and, with REPACK_NPY_CACHE=1, the reverse).
    return type(base.__name__, bases, namespace)


RepackedGPTDataset = _make(GPTDataset, None, None, False)
RepackedGPTDataset.__doc__ = """Megatron-Core's ``GPTDataset``, reading its sources from a repack.

Use it as the ``cls`` of ``BlendedMegatronDatasetBuilder`` with an unchanged
``GPTDatasetConfig``. The repack is the folder in the ``REPACK_DIR`` environment variable
(or bind one with :func:`dataset_class`). ``config.mmap_bin_files`` picks the shard backend
(mmap, or pread without data mmaps).
"""

_BOUND_LOCK = threading.RLock()
_BOUND: dict[tuple, type] = {(GPTDataset, None, False, None, None): RepackedGPTDataset}


def repacked(
    cls: type,
    repack_dir: str | os.PathLike | None = None,
    *,
    multimodal: bool = False,
    phases: str | os.PathLike | None = None,
    phase: int | None = None,
) -> type:
    """``cls``, a Megatron dataset class over ``IndexedDataset`` prefixes, reading a repack.

    Works for ``GPTDataset`` and its subclasses (``GPTFIMDataset``, ``MockGPTDataset``-free
    user subclasses...), the masked WordPiece datasets (``BERTMaskedWordPieceDataset``,
    ``T5MaskedWordPieceDataset``) and any other ``MegatronDataset`` whose
    ``build_low_level_dataset`` makes an ``IndexedDataset``. The returned class answers to
    ``cls.__name__``, so that Megatron's cache hashes and file names are stock's, and is made
    once per ``(cls, repack_dir, multimodal)``.

    Args:
        cls: The stock dataset class (or a class made by this function: its stock class is
            used).
        repack_dir: The repack folder. It is opened, and its structure checked, right away, so
            that a wrong path fails here rather than deep inside the builder. ``None`` reads the
            folder from ``REPACK_DIR`` when datasets are built.
        multimodal: Read sources as ``IndexedDataset(path, multimodal=True)`` does: items are
            ``(tokens, mode)`` pairs.
        phases, phase: The continuation across blend phases (``GPTDataset`` and its
            subclasses; docs/megatron.md, "Blend phases"): the phase schedule file and the
            phase this launch trains. Then the training split of phase ``phase > 0`` draws,
            from every source, the documents no earlier phase trained on before any other.
            ``None`` reads ``REPACK_PHASES`` and ``REPACK_PHASE``; both unset: stock's order.

    Raises:
        UnsupportedMegatron: ``cls`` lacks something repack relies on in this megatron-core.
        RepackError: ``repack_dir`` is not a readable repack.
        PhaseError: ``phases`` is not a readable phase schedule, or ``phase`` not one of it.
    """
    base = getattr(cls, "repack_base", cls)
    # s3://, msc:// as given (an unknown scheme is refused when opened), a path absolute
    path = None if repack_dir is None else normalize(repack_dir)
    schedule = None if phases is None else os.path.abspath(os.fspath(phases))
    number = None if phase is None else int(phase)
    if schedule is not None or number is not None:
        from repack.phases.continuation import selected

        if schedule is None or number is None:
            raise PhaseError("repack.megatron.repacked: give both phases= and phase=, or neither")
        if not issubclass(base, GPTDataset):
            raise PhaseError(
                f"repack.megatron.repacked: the continuation across phases is for GPTDataset and "
                f"its subclasses, not {base.__qualname__}"
            )
        selected(schedule, number)  # checked now, as the folder is
    key = (base, path, bool(multimodal), schedule, number)
    with _BOUND_LOCK:
        made = _BOUND.get(key)
        if made is None:
            parent = None
            if path is not None or schedule is not None:
                if path is not None:
                    Repack(path).close()  # checked now; datasets open it with their backend
                parent = repacked(base, None, multimodal=multimodal)
            made = _BOUND[key] = _make(base, parent, path, bool(multimodal), schedule, number)
        return made


#: Ready-made classes reading ``REPACK_DIR``, made on first use (``from repack.megatron import
#: RepackedT5MaskedWordPieceDataset``); they pickle by name, like ``RepackedGPTDataset``.
#: ``GPTFIMDataset`` lives in Megatron-LM's ``megatron.training``: only where Megatron-LM is.
READY_MADE = {
    "RepackedBERTMaskedWordPieceDataset": (
        "megatron.core.datasets.bert_dataset",
        "BERTMaskedWordPieceDataset",
    ),
    "RepackedT5MaskedWordPieceDataset": (
        "megatron.core.datasets.t5_dataset",
        "T5MaskedWordPieceDataset",
    ),
    "RepackedGPTFIMDataset": ("megatron.training.datasets.fim_dataset", "GPTFIMDataset"),
}


def __getattr__(name: str) -> type:
    if name not in READY_MADE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, stock = READY_MADE[name]
    return repacked(getattr(importlib.import_module(module), stock))


def dataset_class(
    repack_dir: str | os.PathLike,
    *,
    phases: str | os.PathLike | None = None,
    phase: int | None = None,
) -> type:
    """A ``RepackedGPTDataset`` bound to the repack at ``repack_dir``:
    ``repacked(GPTDataset, repack_dir, phases=phases, phase=phase)``."""
    return repacked(GPTDataset, repack_dir, phases=phases, phase=phase)


def _rebuild(
    base: type,
    repack_dir: str | None,
    multimodal: bool,
    state: dict,
    phases: str | None = None,
    phase: int | None = None,
) -> Any:
    cls = repacked(base, repack_dir, multimodal=multimodal, phases=phases, phase=phase)
    dataset = cls.__new__(cls)
    dataset.__dict__.update(state)
    return dataset
