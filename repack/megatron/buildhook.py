"""Megatron's builder, building a repack's blend: its descriptions written without ``json``'s
Python encoder, its garbage collector paused. The blending index is :mod:`blendhook`'s.

A warm build of 30,000 sources was half ``json.dumps(..., indent=4)`` (each dataset's
description in ``MegatronDataset.__init__``, then ``BlendedDataset``'s of all of them) and a
quarter full collections, each walking torch's and Megatron's ~400,000 objects, set off by the
build's 30,000 datasets and the ``Future`` Megatron's builder keeps for each prefix. Two
dispatchers, put in place once per process by :func:`install` (``import repack.megatron``):

* ``json`` in ``megatron.core.datasets.megatron_dataset`` and ``blended_dataset`` is
  :data:`JSON`: its ``dumps``, called by a repacked dataset or a ``BlendedDataset`` of them
  with Megatron's arguments, is :func:`repack.model.description.dumps` (the same text); every
  other call, and every other name, is ``json``'s;
* ``BlendedMegatronDatasetBuilder.build`` of a repacked class runs with the collector paused
  (:func:`repack.format.gcpause.gc_paused`): the objects that live past the build are walked at
  the next collection after it, once, not by several full ones during it; and in
  :func:`repack.megatron.buildscope.building`, whose memo the descriptions share: what the
  config's values write (its ``split_matrix``, its tokenizer) is written once, as nothing
  changes them while Megatron builds.

A stock build goes through both unchanged, as with :mod:`blendhook`.
"""

from __future__ import annotations

import functools
import json
import operator
import sys
import threading
from collections import OrderedDict
from json.encoder import encode_basestring_ascii as _string
from typing import Any

from repack.format.gcpause import gc_paused
from repack.megatron import buildscope
from repack.megatron.mixin import OWN_IDENTIFIERS, Repacked
from repack.model import description

__all__ = ["JSON", "install"]

_LOCK = threading.Lock()
_INSTALLED: list[bool] = []


def _repacked(obj: Any) -> bool:
    return isinstance(obj, Repacked)


class _Json:
    """The ``json`` module, but for ``dumps`` of a repack's descriptions."""

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)

    @staticmethod
    def dumps(obj: Any, *args: Any, **kwargs: Any) -> str:
        if not args and kwargs.keys() == {"indent", "default"} and kwargs["indent"] == 4:
            caller = sys._getframe(1).f_locals.get("self")
            if _repacked(caller):
                return _describe_dataset(obj, kwargs["default"])
            datasets = getattr(caller, "datasets", None)  # a BlendedDataset's
            if isinstance(datasets, list) and datasets and _repacked(datasets[0]):
                return _describe_blend(obj, kwargs["default"])
        return json.dumps(obj, *args, **kwargs)


def _describe_dataset(identifiers: Any, default: Any) -> str:
    """A repacked dataset's description: its config's items written once per build."""
    memo = buildscope.memo()
    if memo is not None and type(identifiers) is OrderedDict and len(identifiers) > _OWN:
        try:
            return _by_parts(identifiers, default, memo)
        except Exception:  # description.dumps says it as json does
            pass
    return description.dumps(identifiers, default, memo)


#: ``MegatronDataset.__init__`` puts 4 identifiers of the dataset's own first (``class``,
#: ``dataset_path``, ``num_samples``, ``index_split``), then the config's (every release).
_OWN = len(OWN_IDENTIFIERS)


def _by_parts(identifiers: OrderedDict, default: Any, memo: dict, newline: str = "\n") -> str:
    """:func:`repack.model.description.dumps` of a dataset's identifiers (written at the level
    whose line break is ``newline``), the text of the config's items kept in the build's memo
    by their names and the identity of their values: every dataset of a build describes the
    same config (the last one is found by the names alone, its values then compared by
    identity, which costs less than hashing their ids)."""
    names, values = tuple(identifiers), tuple(identifiers.values())
    config = values[_OWN:]
    held = memo.get(names)
    if held is None or not all(map(operator.is_, held[0], config)):
        key = (names, *map(id, config))
        held = memo.get(key)
        if held is None:  # the values held: their ids stay their own
            items = description.items(zip(names[_OWN:], config), default, memo)
            held = memo[key] = (config, {"\n": items})
        memo[names] = held
    leveled = held[1]
    config_items = leveled.get(newline)
    if config_items is None:  # one level down, each line break followed by one more indent
        config_items = leveled[newline] = leveled["\n"].replace("\n", newline)
    inner = newline + _INDENT
    own = _own_items(names, values, default, inner)
    return "{" + inner + own + "," + inner + config_items + newline + "}"


_INDENT = description.INDENT


def _own_items(names: tuple, values: tuple, default: Any, inner: str) -> str:
    """The text of the dataset's own 4 items, each after the line break ``inner`` but the
    first: written here where they are the plain strings and integer (or ``None``) Megatron
    puts there, as :func:`repack.model.description.items` writes them (json's ``"key": value``,
    ``ensure_ascii`` strings), which takes a loop over pairs and a dispatch per value; else by
    it."""
    if names[:_OWN] == OWN_IDENTIFIERS:
        kind, path, samples, split = values[:_OWN]
        if (
            type(kind) is str
            and type(path) is str
            and type(split) is str
            and (samples is None or type(samples) is int)
        ):
            count = "null" if samples is None else int.__repr__(samples)
            return (
                f'"class": {_string(kind)},{inner}"dataset_path": {_string(path)},{inner}'
                f'"num_samples": {count},{inner}"index_split": {_string(split)}'
            )
    own = description.items(zip(names[:_OWN], values[:_OWN]), default, None)
    return own if inner == "\n" + _INDENT else own.replace("\n", inner[: -len(_INDENT)])


#: Where ``BlendedDataset.__init__`` lists its datasets' identifiers (``"datasets"``, an item
#: of its top-level object, every release): the line break of the list, and of its items.
_LISTED, _LISTED_ITEMS = "\n" + _INDENT, "\n" + 2 * _INDENT


def _describe_blend(identifiers: Any, default: Any) -> str:
    """A ``BlendedDataset``'s description, each of its datasets' identifiers (``[dataset.
    unique_identifiers for dataset in self.datasets]``, in ``BlendedDataset.__init__`` of every
    release) written as :func:`_describe_dataset` writes them, at their level in the list, their
    config's items from the build's memo; the list's text handed to the encoder as written.
    (Not the datasets' own texts kept from their build: held over the build, 30,000 of them
    left holes in the heap that every DataLoader worker inherits.)"""
    memo = buildscope.memo()
    listed = identifiers.get("datasets") if isinstance(identifiers, dict) else None
    if memo is None or not isinstance(listed, list) or not listed:
        return description.dumps(identifiers, default, memo)
    try:
        texts = [
            _by_parts(dataset_identifiers, default, memo, _LISTED_ITEMS)
            for dataset_identifiers in listed
            if type(dataset_identifiers) is OrderedDict and len(dataset_identifiers) > _OWN
        ]
    except Exception:  # description.dumps says it as json does
        texts = []
    if len(texts) != len(listed):  # not every one Megatron's: the encoder writes them all
        return description.dumps(identifiers, default, memo)
    text = "[" + _LISTED_ITEMS + ("," + _LISTED_ITEMS).join(texts) + _LISTED + "]"
    written = dict(memo)  # the identifiers listed are this call's, not the build's
    written[id(listed)] = (listed, text, _LISTED)
    return description.dumps(identifiers, default, written)


#: What Megatron's dataset modules call ``json`` once :func:`install` ran.
JSON = _Json()


def install() -> None:
    """Put the dispatchers in place, once (idempotent)."""
    with _LOCK:
        if _INSTALLED:
            return
        from megatron.core.datasets import blended_dataset, megatron_dataset
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )

        for module in (megatron_dataset, blended_dataset):
            if getattr(module, "json", None) is json:
                module.json = JSON
        BlendedMegatronDatasetBuilder.build = _paused(BlendedMegatronDatasetBuilder.build)
        _INSTALLED.append(True)


def _paused(build: Any) -> Any:
    @functools.wraps(build)
    def build_paused(self: Any, *args: Any, **kwargs: Any) -> Any:
        cls = getattr(self, "cls", None)
        if not (isinstance(cls, type) and issubclass(cls, Repacked)):
            return build(self, *args, **kwargs)
        with buildscope.building(), gc_paused():
            return build(self, *args, **kwargs)

    return build_paused
