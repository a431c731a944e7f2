"""What every repacked class shares: the repack it reads (bound, or ``REPACK_DIR``), each blend
prefix as a view of its source in it, the errors for a slice that cannot give a sample or a
blend ``BlendedDataset`` cannot take, and pickling by the stock class and the binding (so
spawned DataLoader workers remake the class).
"""

from __future__ import annotations

import operator
import os
import sys
from collections import OrderedDict
from typing import Any, ClassVar

import numpy as np

from repack.errors import RepackError, TooManyDatasets, UndrawableSplit
from repack.megatron import buildscope
from repack.model import description
from repack.model.arithmetic import INT16_DATASETS, too_many_datasets
from repack.read.reader import Repack, open_repack
from repack.read.views import BlendIds, SourceDataset

try:  # absent from none of the supported releases, but not needed by GPT users
    from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset
except ImportError:  # pragma: no cover - a release without it fails only for masked classes
    MaskedWordPieceDataset = None

__all__ = ["CACHE_SUBDIR", "ENV_VAR", "NPY_ENV_VAR", "Repacked", "default_cache"]

#: Environment variable naming the repack folder when a class is not bound to one.
ENV_VAR = "REPACK_DIR"
#: Set (to anything but 0) to have Megatron also write its own cache files for every dataset
#: and split (``-description.txt`` and three ``.npy``), which stock ``GPTDataset`` can read.
NPY_ENV_VAR = "REPACK_NPY_CACHE"
#: Sub-folder of OUT for Megatron's cached indices when ``config.path_to_cache`` is unset
#: (stock Megatron would write ``<prefix>/cache/GPTDataset_indices`` next to every source).
CACHE_SUBDIR = os.path.join("cache", "GPTDataset_indices")


def default_cache(repack: Any, kind: str = "GPTDataset_indices") -> str:
    """``OUT/cache/{kind}``: where a repacked dataset caches without ``path_to_cache``, as stock
    Megatron's ``<prefix>/cache/{kind}`` (for a repack on object storage, in its node-local
    cache folder): the loader's rule, which ``repack prepare`` follows."""
    return os.path.join(repack.local_folder, "cache", kind)


def describe(unique_identifiers: Any) -> str:
    """``MegatronDataset.__init__``'s ``unique_description`` of ``unique_identifiers`` (the
    same call in every release from 0.12 to Megatron-LM main)."""
    return description.dumps(unique_identifiers, default=lambda obj: obj.unique_identifiers)


#: Per repacked class: whether :func:`describe` gives what Megatron's ``__init__`` set (checked
#: on the class's first dataset in a process; where it does not, each dataset keeps its own).
_DESCRIBES: dict[type, bool] = {}


class _Description:
    """``unique_description``, held until its first read, then computed again from
    ``unique_identifiers`` when read: Megatron builds it (``indent=4`` JSON, about 1 KiB) for
    every dataset, reads it once in ``MegatronDataset.__init__`` to hash it, and again only to
    write it beside stock cache files, at build time. A class whose text describing again
    would not give keeps it (:data:`_DESCRIBES`)."""

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:
            return self
        held = getattr(dataset, "_repack_description", None)
        if held is None:
            return describe(dataset.unique_identifiers)
        if _DESCRIBES.get(type(dataset)):
            # None, not del: that could give the dataset a dict object of its own
            dataset._repack_description = None
        return held

    def __set__(self, dataset: Any, value: Any) -> None:
        cls = type(dataset)
        if cls not in _DESCRIBES:
            identifiers = getattr(dataset, "unique_identifiers", None)
            _DESCRIBES[cls] = (
                _megatron_init(cls) and identifiers is not None and describe(identifiers) == value
            )
        dataset._repack_description = value
        if _DESCRIBES[cls]:  # the identifiers are complete: Megatron described them
            _IDENTIFIERS.compact(dataset)


#: Each distinct tuple of identifier names, held once (see _Identifiers).
_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}


class _Identifiers:
    """``unique_identifiers``: Megatron's ``OrderedDict`` (about 500 bytes and an object for
    the garbage collector per dataset), held until Megatron has described it, then only its
    names (one tuple shared by every dataset), its values read again from the dataset when it is
    read: ``class`` is the class's name, ``dataset_path``, ``num_samples`` the dataset's,
    ``index_split`` its split's name, and every other name the config's attribute, as
    ``MegatronDataset.__init__`` fills it (in every release from 0.12 to Megatron-LM main).
    A dataset whose identifiers are not all that (the same objects) keeps its dict.

    A non-data descriptor (no ``__set__``): Megatron's dict is the dataset's own attribute, so
    that its 15 accesses per dataset while it fills it (``self.unique_identifiers[name] = ...``)
    call nothing of repack's (6 us a dataset, 0.18 s of a warm build of 30,000 sources); once
    compacted, the attribute is deleted and reads come here. Not on Python 3.10
    (:class:`_HeldIdentifiers`)."""

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:
            return self
        held = getattr(dataset, "_repack_identifiers", None)
        if type(held) is tuple:
            return OrderedDict(zip(held, _values(held)(dataset)))
        if held is None:
            raise AttributeError(
                f"{type(dataset).__name__!r} object has no attribute 'unique_identifiers'"
            )
        return held  # Megatron's dict, held by _HeldIdentifiers

    def compact(self, dataset: Any) -> None:
        """Hold only the names of ``dataset``'s identifiers, where its values are Megatron's."""
        if type(getattr(dataset, "_repack_identifiers", None)) is tuple:
            return  # compacted already
        held = getattr(dataset, "unique_identifiers", None)
        if type(held) is not OrderedDict:
            return
        names = tuple(held)
        try:
            same = all(map(operator.is_, _values(names)(dataset), held.values()))
        except AttributeError:
            same = False
        if same:
            self._release(dataset)
            dataset._repack_identifiers = _NAMES.setdefault(names, names)

    def _release(self, dataset: Any) -> None:
        del dataset.unique_identifiers  # getattr and del: no dict object of its own


class _HeldIdentifiers(_Identifiers):
    """:class:`_Identifiers` as a data descriptor, Megatron's dict held under another name
    until compacted: on Python 3.10, whose instances keep their attributes in a dict shared by
    the class's instances, deleting one unshares the dataset's dict (about 700 bytes a dataset
    more); from 3.11 attributes are held inline and a deletion costs nothing."""

    def __set__(self, dataset: Any, value: Any) -> None:
        dataset._repack_identifiers = value

    def _release(self, dataset: Any) -> None:
        pass  # held under _repack_identifiers, which the names replace


#: ``unique_identifiers`` of every repacked class (see :class:`_HeldIdentifiers`).
_IDENTIFIERS = _Identifiers() if sys.version_info >= (3, 11) else _HeldIdentifiers()


#: What ``MegatronDataset.__init__`` puts under these names in ``unique_identifiers``; under
#: every other name, the config's attribute.
_OWN = {
    "class": lambda dataset: type(dataset).__name__,
    "dataset_path": operator.attrgetter("dataset_path"),
    "num_samples": operator.attrgetter("num_samples"),
    "index_split": lambda dataset: dataset.index_split.name,
}
#: Their names in Megatron's order, first in every dataset's ``unique_identifiers``.
OWN_IDENTIFIERS = tuple(_OWN)
#: Per tuple of names, the function giving a dataset's values of them (see _values).
_READERS: dict[tuple[str, ...], Any] = {}


def _values(names: tuple[str, ...]) -> Any:
    """The function giving a dataset's ``unique_identifiers`` values of ``names``, in order,
    as ``MegatronDataset.__init__`` fills them: where the names are Megatron's (its own
    first, then the config's) a tuple of its own values and one ``attrgetter`` of the config
    (a warm build compacts and reads 30,000 datasets' identifiers)."""
    reader = _READERS.get(names)
    if reader is not None:
        return reader
    own = [_OWN[name] for name in names if name in _OWN]
    config_names = names[len(own) :]
    if any(name in _OWN for name in config_names):  # not Megatron's order: name by name

        def reader(dataset: Any) -> tuple:
            return tuple(
                _OWN[name](dataset) if name in _OWN else getattr(dataset.config, name)
                for name in names
            )

    else:
        configured = operator.attrgetter(*config_names) if config_names else lambda _: ()
        if len(config_names) == 1:
            configured = (lambda get: lambda config: (get(config),))(configured)

        if names[: len(own)] == OWN_IDENTIFIERS:  # all four, Megatron's: read without a loop

            def reader(dataset: Any) -> tuple:
                return (
                    type(dataset).__name__,
                    dataset.dataset_path,
                    dataset.num_samples,
                    dataset.index_split.name,
                    *configured(dataset.config),
                )

        else:

            def reader(dataset: Any) -> tuple:
                return (*[read(dataset) for read in own], *configured(dataset.config))

    return _READERS.setdefault(names, reader)


def _megatron_init(cls: type) -> bool:
    """Whether every ``__init__`` of ``cls`` is Megatron's: none of them changes
    ``unique_identifiers`` after ``MegatronDataset.__init__`` described them (checked in every
    release from 0.12 to Megatron-LM main), so that describing them again gives its text."""
    return all(
        "__init__" not in vars(k) or k is object or k.__module__.startswith("megatron.")
        for k in cls.__mro__
    )


class _Indices:
    """``indices``: the split's slice of the source's sequences, which Megatron's builder
    makes an ``int32`` ``arange`` per dataset and Megatron reads only at build time; held as
    its two ends when it is one (4 bytes a sequence fewer in every process), as given else."""

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:
            return self
        held = getattr(dataset, "_repack_indices", None)
        if isinstance(held, tuple):
            return np.arange(held[0], held[1], dtype=np.int32)
        return held

    def __set__(self, dataset: Any, value: Any) -> None:
        dataset._repack_indices = _span(value)


def _span(value: Any) -> Any:
    """``(begin, end)`` where ``value`` is ``np.arange(begin, end, dtype=np.int32)``, else
    ``value``."""
    if type(value) is not np.ndarray or value.dtype is not _INT32 or value.ndim != 1:
        return value
    count = len(value)
    if count == 0:
        return value
    begin = int(value[0])
    end = begin + count
    if int(value[-1]) != end - 1:
        return value
    if count <= _SMALL:  # a list compares a few values sooner than numpy makes an array
        same = value.tolist() == list(range(begin, end))
    else:
        same = bool((value == np.arange(begin, end, dtype=np.int32)).all())
    return (begin, end) if same else value


_INT32 = np.dtype(np.int32)  # native byte order: what np.arange(..., dtype=np.int32) makes
_SMALL = 256


class Repacked:
    """What every repacked class shares: the repack folder and the low-level datasets."""

    unique_description = _Description()
    unique_identifiers = _IDENTIFIERS
    indices = _Indices()

    #: The bound repack folder; ``None`` reads ``REPACK_DIR``.
    repack_dir: ClassVar[str | None] = None
    #: Whether sources are read as ``IndexedDataset(multimodal=True)`` reads them.
    repack_multimodal: ClassVar[bool] = False
    #: The stock class this one reads a repack for.
    repack_base: ClassVar[type]
    #: The phase schedule and phase of the continuation (:mod:`repack.phases.continuation`);
    #: ``None`` reads ``REPACK_PHASES`` and ``REPACK_PHASE`` (unset: stock's order).
    repack_phases: ClassVar[str | None] = None
    repack_phase: ClassVar[int | None] = None

    @classmethod
    def repack_path(cls) -> str:
        """The repack folder this class reads."""
        path = cls.repack_dir or os.environ.get(ENV_VAR)
        if not path:
            raise RepackError(
                f"{cls.__qualname__}: no repack folder: set {ENV_VAR}=/path/to/repack or use "
                "repack.megatron.repacked(cls, '/path/to/repack')"
            )
        return path

    @classmethod
    def build_low_level_dataset(cls, dataset_path: str, config: Any) -> SourceDataset:
        """The blend prefix ``dataset_path`` as a view of its source in the repack.

        Raises:
            TooManyDatasets: a split of the config's blend blends 32,767 datasets or more,
                which its ``BlendedDataset`` would refuse after every dataset was built.
        """
        mmap = getattr(config, "mmap_bin_files", True)
        found = _blend_source(cls, dataset_path, config, mmap)  # checks the blend's size
        if found is not None:
            return SourceDataset.found(
                found[0], dataset_path, found[1:], multimodal=cls.repack_multimodal, mmap=mmap
            )
        return SourceDataset(
            cls.repack_path(), dataset_path, multimodal=cls.repack_multimodal, mmap=mmap
        )

    def _split_origin(self) -> str:
        """Where this dataset's slice comes from: the split string, or a per-split blend."""
        split = getattr(self.config, "split", None)
        return f"split {split!r}" if split else "its per-split blend"

    def _undrawable(self, problem: str, stock: str) -> UndrawableSplit:
        """The error for a slice that samples are asked of but that cannot give any, where
        stock Megatron would ``stock`` instead."""
        return UndrawableSplit(
            f"{self.dataset.path_prefix}: {problem}, yet {self.num_samples} samples are asked "
            f"of it: stock Megatron would {stock}. Give the split more weight, or leave the "
            f"source out of the {self.index_split.name} blend"
        )

    def _default_cache(self, kind: str) -> str:
        return default_cache(self.dataset.repack, kind)

    def __getstate__(self) -> dict:
        return self.__dict__.copy()

    def __reduce__(self):
        cls = type(self)
        state = self.__getstate__()
        bound = (cls.repack_base, cls.repack_dir, cls.repack_multimodal)
        from repack.megatron import _rebuild  # the package makes the classes, and remakes them

        return (_rebuild, (*bound, state, cls.repack_phases, cls.repack_phase))


def _check_blend_size(config: Any) -> None:
    """Refuse, before the first of its datasets is built, a blend that a ``BlendedDataset``
    takes whole (every split of a flat blend of several prefixes or weighted; each split of
    a per-split one of several prefixes, but a validation blend with
    ``multiple_validation_sets``) with 32,767 datasets or more: Megatron asserts
    ``len(datasets) < 32767`` there after building them all (its dataset index is int16), and
    under ``python -O`` the index wraps (:func:`repack.model.arithmetic.too_many_datasets`)."""
    blends: list[tuple[str, Any]] = []
    per_split = getattr(config, "blend_per_split", None)
    if per_split:
        multiple = bool(getattr(config, "multiple_validation_sets", False))
        for name, blend in zip(("train", "valid", "test"), per_split):
            if blend is not None and not (multiple and name == "valid"):
                blends.append((f"the {name} blend of blend_per_split", blend))
    elif getattr(config, "blend", None) is not None:
        blends.append(("the blend", config.blend))
    for what, blend in blends:
        count = len(blend[0])
        if count >= INT16_DATASETS:
            raise TooManyDatasets(
                f"{what} names {count:,} prefixes: {too_many_datasets()}; blend fewer prefixes"
            )


class _Building:
    """The blend prefixes a builder is building: one list of the config's blend (or of a
    split's), its sources found at once when its first prefix is built (:class:`BlendIds`),
    and its config's blends, checked then (:func:`_check_blend_size`)."""

    __slots__ = ("blend", "config", "ids", "mmap", "per_split", "prefixes", "repack_dir")

    def __init__(self, config: Any, prefixes: Any, repack_dir: str, mmap: Any) -> None:
        self.config = config
        self.blend = getattr(config, "blend", None)
        self.per_split = getattr(config, "blend_per_split", None)
        self.prefixes = prefixes
        self.repack_dir = repack_dir
        self.mmap = mmap
        self.ids = BlendIds(open_repack(repack_dir, "mmap" if mmap else "pread"), prefixes)


#: Where the build's memo (:mod:`repack.megatron.buildscope`) holds the blend being built (the
#: last whose first prefix was built): Megatron's builder builds each list of prefixes in
#: order, one dataset after another (or in a pool of threads: then out of order, and each is
#: found on its own). Outside a build each prefix is found on its own.
_BUILDING = "the blend being built"


def _blend_source(
    cls: type[Repacked], dataset_path: str, config: Any, mmap: Any
) -> tuple[str, Repack, int] | None:
    """``(repack folder, repack, id)`` of the source ``dataset_path`` resolves to, where it is
    the next prefix of the blend being built (the config's blends checked when its first was
    built), else ``None`` (after :func:`_check_blend_size`): the repack, each prefix's
    :class:`~repack.read.views.SourceDataset` resolves it again, as before."""
    memo = buildscope.memo()
    if memo is None:  # not in a build: nothing held past this call
        _check_blend_size(config)
        return None
    building = memo.get(_BUILDING)
    same = (
        building is not None
        and building.config is config
        and building.blend is getattr(config, "blend", None)
        and building.per_split is getattr(config, "blend_per_split", None)
        and building.mmap == mmap
        and building.repack_dir == (cls.repack_dir or cls.repack_path())
    )
    if same:
        found = building.ids.take(dataset_path)
        if found is not None:
            return building.repack_dir, building.ids.repack, found
    _check_blend_size(config)
    prefixes = _first_of(config, dataset_path, building)
    if prefixes is None or (same and prefixes is building.prefixes and not building.ids.done):
        return None  # not a first prefix, or that of the list being built: found on its own
    repack_dir = cls.repack_path()
    memo[_BUILDING] = building = _Building(config, prefixes, repack_dir, mmap)
    found = building.ids.take(dataset_path)
    return None if found is None else (repack_dir, building.ids.repack, found)


def _first_of(config: Any, dataset_path: str, building: _Building | None) -> Any:
    """The config's list of prefixes (its blend's, or a split's) of more than one prefix
    whose first is ``dataset_path``, else ``None``; of two, not the one built last."""
    per_split = getattr(config, "blend_per_split", None)
    if per_split:
        blends = [blend for blend in per_split if blend is not None]
    else:
        blend = getattr(config, "blend", None)
        blends = [] if blend is None else [blend]
    lists = [
        prefixes
        for prefixes, *_ in blends
        if isinstance(prefixes, (list, tuple))
        and len(prefixes) > 1
        and prefixes[0] == dataset_path
        and all(type(p) is str for p in prefixes)
    ]
    if len(lists) > 1 and building is not None and building.config is config:
        lists = [prefixes for prefixes in lists if prefixes is not building.prefixes] or lists
    return lists[0] if lists else None
