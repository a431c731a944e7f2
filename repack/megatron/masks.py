"""``GPTDataset``'s cached masks and position ids (and the masked datasets' vocabulary list),
held once per process instead of once per dataset.

Stock ``GPTDataset.__getitem__`` computes, on each dataset's first sample, an attention mask
(``[1, S, S]`` bool, after an ``S x S`` float temporary), a loss mask (``S`` float32) and
position ids (``S`` int64), and keeps them for every later sample of that dataset when they
do not depend on the tokens (``masks_and_position_ids_are_cacheable``: no reset of positions or
attention, no EOD loss mask, Megatron's defaults). With one dataset per blend prefix, a worker
holds ``sources x S**2`` bytes of identical masks: 16 MiB per source at ``S = 4096``.

The repacked classes hold them once:

* **attention mask and position ids** depend only on the length and device of the tokens and
  on ``create_attention_mask`` when they are cacheable, and stock hands them out as they are
  (never copied, never written). They are computed once per key, by Megatron's own
  ``_get_ltor_masks_and_position_ids``, and the same tensors are given to every dataset: the
  function Megatron calls is wrapped (:func:`install`), and the wrapper answers from the
  process-wide table only while a repacked dataset computes its cache (:func:`lending`);
  everywhere else, stock's own datasets included, it calls Megatron's function unchanged.
* **the loss mask** is a dataset's own state in stock: its first sample writes zeros into it
  where the labels are padding, and the releases that do not clone it per sample (0.12 to
  0.14) write into it on every sample. Each dataset therefore gets its own copy to compute with
  (``4 x S`` bytes), exactly as stock; where the release clones it per sample (0.15 and later),
  it is never written again after the first sample, and :meth:`SharedMasks.share_loss_mask`
  then swaps it for one equal tensor of the process (interned by content), so that the
  datasets of a process share a handful of loss masks. Whether a class clones is seen, not
  assumed: on the second sample of its first dataset, a class that hands out its cached
  tensor itself returns it; its later datasets are settled right after their first sample.

Samples are bit-identical to stock's, and so is their aliasing: every sample of one dataset
holds the same attention mask and position ids, as in stock (now shared with the other datasets
of the process too, which stock hands out and never writes either).

**Only where stock's contract holds.** That nothing writes into the masks handed out is true
of stock ``GPTDataset.__getitem__``, not of any subclass: one that edits the attention mask of
its sample would edit the table every dataset shares. So sharing is for the classes whose
``__getitem__`` is stock's (no class between the repacked class's stock base and
``GPTDataset`` defines one), and for those named in :data:`ALLOWED` (:func:`allow`, for a
subclass known not to write into them); any other class gets stock's behaviour, per dataset.
And only while the function the wrapper calls is Megatron's own: one replaced by another hand
before :func:`install` is left alone.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import torch
from megatron.core.datasets import gpt_dataset

from repack.read.reader import release_free_heap

__all__ = ["ALLOWED", "SHARED", "SharedMasks", "allow", "install", "shares"]

#: The name under which ``GPTDataset.__getitem__`` looks up the function (a module global).
_FUNCTION = "_get_ltor_masks_and_position_ids"


class _Lending(threading.local):
    active = False


#: Dataset classes with a ``__getitem__`` of their own known to hand out the cached masks
#: untouched, as stock's does: their datasets share masks too (docs/megatron.md, "Host memory").
ALLOWED: set[type] = set()
_SHARES: dict[type, bool] = {}


def allow(cls: type) -> type:
    """Let the datasets of ``cls`` (a ``GPTDataset`` subclass with its own ``__getitem__``)
    share masks: only for a ``__getitem__`` that never writes into the attention mask, loss mask
    or position ids it hands out (stock's contract). Usable as a class decorator."""
    ALLOWED.add(cls)
    _SHARES.clear()
    return cls


def shares(cls: type) -> bool:
    """Whether the datasets of the repacked class ``cls`` may share masks: its ``__getitem__``
    is stock ``GPTDataset``'s (repack's own wrapper aside), or each class that defines one
    between its stock base and ``GPTDataset`` is in :data:`ALLOWED`."""
    found = _SHARES.get(cls)
    if found is None:
        base = getattr(cls, "repack_base", cls)
        found = True
        for klass in base.__mro__:
            if klass is gpt_dataset.GPTDataset:
                break
            if "__getitem__" in vars(klass) and klass not in ALLOWED:
                found = False
                break
        else:
            found = False  # not a GPTDataset at all
        _SHARES[cls] = found
    return found


class SharedMasks:
    """The process's masks: one attention mask and position ids per ``(length, device,
    create_attention_mask)``, and one loss mask per distinct content."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._masks: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._loss_masks: dict[tuple, torch.Tensor] = {}
        self._lookups: dict[tuple, list[list]] = {}
        self._lending = _Lending()
        #: per dataset class: whether its ``__getitem__`` hands out a copy of the cached loss
        #: mask (True), or the cached tensor itself (False), as seen on a second sample
        self.clones: dict[type, bool] = {}
        self.computed = 0  # how many times Megatron's function ran for the table (tests)
        # a worker forked while another thread held the lock would wait on it forever
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._masks)

    def clear(self) -> None:
        with self._lock:
            self._masks.clear()
            self._loss_masks.clear()
            self._lookups.clear()

    # --- attention mask and position ids --------------------------------------------------

    def lending(self) -> _LendingScope:
        """A scope in which the wrapped Megatron function answers from the table: entered by a
        repacked dataset around the sample that computes its cache."""
        return _LendingScope(self._lending)

    def masks(self, stock, args: tuple) -> tuple:
        """What ``stock(*args)`` returns (``args``: Megatron's ``data, eod_token,
        reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask``), from
        the table when it can be."""
        data, _, reset_position_ids, reset_attention_mask, eod_mask_loss, create = args
        if not self._lending.active or reset_position_ids or reset_attention_mask or eod_mask_loss:
            return stock(*args)
        # with none of the three flags, the masks depend on the tokens' count and device only
        key = (int(data.numel()), str(data.device), bool(create))
        with self._lock:
            found = self._masks.get(key)
            computed = found is None
            if computed:
                found = self._masks[key] = stock(*args)
                self.computed += 1
        if computed:
            # Megatron's S x S temporaries (4 MiB each at S = 1,024), freed on its return into
            # a heap whose trim threshold a large build raised, stayed resident in every
            # DataLoader worker (about 0.8 KiB a source at 10,000 sources, issue 44): given
            # back once. A sample that computes its own masks keeps glibc's thresholds and
            # takes its temporaries from the heap again, as stock's.
            release_free_heap()
        attention_mask, loss_mask, position_ids = found
        # the loss mask is the dataset's own: stock writes into it (see the module docstring)
        return attention_mask, loss_mask.clone(), position_ids

    # --- loss masks -----------------------------------------------------------------------

    def settle_first(self, dataset: Any) -> bool:
        """After the sample of ``dataset`` that cached its masks: where its class is already
        known to clone the cached loss mask, share it now. Returns whether it is settled."""
        if not self.clones.get(type(dataset)):
            return False
        self.share_loss_mask(dataset)
        return True

    def settle(self, dataset: Any, idx: Any, sample: Any) -> bool:
        """After a sample of ``dataset`` that found its masks cached: learn from ``sample``
        whether its class hands out its cached loss mask itself, and where it hands out a
        copy, share the loss mask. Returns whether it is settled (needs no further call)."""
        cls = type(dataset)
        cached = getattr(dataset, "cached_loss_mask", None)
        if not isinstance(cached, torch.Tensor):
            return True
        if cls not in self.clones:
            if idx is None or not isinstance(sample, dict) or "loss_mask" not in sample:
                return False  # a padding sample (a loss mask of zeros) shows nothing
            self.clones[cls] = sample["loss_mask"] is not cached
        if self.clones[cls]:
            self.share_loss_mask(dataset)
        return True  # or: the release writes into its cached tensor, which stays the dataset's

    def share_loss_mask(self, dataset: Any) -> None:
        """Swap the dataset's cached loss mask for the process's one equal tensor. Only where
        its class clones the cached loss mask per sample: it is never written again."""
        cached = dataset.cached_loss_mask
        key = (
            tuple(cached.shape),
            cached.dtype,
            str(cached.device),
            hashlib.blake2b(cached.cpu().numpy().tobytes(), digest_size=16).digest(),
        )
        with self._lock:
            shared = self._loss_masks.setdefault(key, cached)
        if shared is not cached and torch.equal(shared, cached):
            dataset.cached_loss_mask = shared

    # --- the masked datasets' vocabulary ---------------------------------------------------

    def token_lookup(self, values: Any) -> Any:
        """One list per process equal to ``values``: the masked datasets (BERT, T5) each keep
        the tokenizer's whole vocabulary as a list (``token_lookup``, 8 bytes per token: 1 MiB
        at 128k tokens, per dataset), which they only read."""
        if not isinstance(values, list) or not values:
            return values
        key = (len(values), values[0], values[-1])
        with self._lock:
            candidates = self._lookups.setdefault(key, [])
            for candidate in candidates:
                if candidate == values:
                    return candidate
            candidates.append(values)
        return values


class _LendingScope:
    def __init__(self, state: _Lending) -> None:
        self._state = state
        self._before = False

    def __enter__(self) -> None:
        self._before = self._state.active  # restored, not reset: scopes may nest
        self._state.active = True

    def __exit__(self, *exc) -> None:
        self._state.active = self._before


#: The table of this process (a forked worker inherits its parent's, then adds to its own copy).
SHARED = SharedMasks()


def install() -> None:
    """Wrap ``megatron.core.datasets.gpt_dataset._get_ltor_masks_and_position_ids`` (once):
    unchanged outside :meth:`SharedMasks.lending`, shared within it."""
    stock = getattr(gpt_dataset, _FUNCTION, None)
    if stock is None or getattr(stock, "_repack_stock", None) is not None:
        return  # a release without it shares nothing (stock's own path); or done already
    if getattr(stock, "__module__", None) != gpt_dataset.__name__:
        return  # another hand's function: what it returns is not known to be shareable

    def _get_ltor_masks_and_position_ids(*args, **kwargs):
        if len(args) != 6 or kwargs:  # a call this module does not know: Megatron's own answer
            return stock(*args, **kwargs)
        return SHARED.masks(stock, args)

    _get_ltor_masks_and_position_ids._repack_stock = stock
    _get_ltor_masks_and_position_ids.__doc__ = stock.__doc__
    _get_ltor_masks_and_position_ids.__wrapped__ = stock
    setattr(gpt_dataset, _FUNCTION, _get_ltor_masks_and_position_ids)
