"""One GPT sample's fields from its token window, as ``GPTDataset.__getitem__`` makes them, in
numpy.

Mirrors ``megatron/core/datasets/gpt_dataset.py`` (megatron-core 0.12 to 0.19, the same code
in each for what is mirrored here): ``__getitem__`` (tokens and labels from the window, with or
without ``add_extra_token_to_sequence``; the pad id masked out of the loss and replaced by 0)
and ``_get_ltor_masks_and_position_ids`` (the causal attention mask, the loss mask, the
position ids, with ``reset_position_ids``, ``reset_attention_mask`` and ``eod_mask_loss``).
Megatron's loop over the EOD tokens is done here in closed form: after resets, the position of
token ``j`` counts from just past the last EOD before ``j``, and ``j`` attends to ``c`` when
``c <= j`` and no EOD lies in ``[c, j)``.

The dtypes are Megatron's tensors' (``tokens``, ``labels`` and ``position_ids`` int64,
``loss_mask`` float32, ``attention_mask`` bool of shape ``(1, S, S)``, True where masked).
"""

from __future__ import annotations

import numpy as np

__all__ = ["sample_fields"]


def sample_fields(
    text: np.ndarray,
    *,
    eod: int,
    pad: int,
    add_extra_token: bool,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
    document_lengths: list[int] | None = None,
    sequence_length: int = 0,
) -> dict[str, np.ndarray]:
    """The sample Megatron makes of ``text``, the window's ``S + extra`` tokens (int64, padded
    with ``pad``), as a dict in Megatron's key order.

    Args:
        text: The window, int64 (modified: pass a fresh array).
        eod: The tokenizer's ``eod``.
        pad: The tokenizer's ``pad``, or -1 where it has none (Megatron's ``_PAD_TOKEN_ID``).
        add_extra_token, reset_position_ids, reset_attention_mask, eod_mask_loss,
            create_attention_mask: ``GPTDatasetConfig``'s fields.
        document_lengths: With ``inter_document_masking`` (megatron-core 0.19): the tokens
            each part of the window holds, as ``_query_document_sample_shuffle_indices``
            returns them (before padding); the sample then has ``cu_seqlens`` and
            ``max_seqlen`` instead of an attention mask, and positions restart per part.
        sequence_length: ``S``, with ``document_lengths``.
    """
    if add_extra_token:
        tokens = text[:-1].copy()
        labels = text[1:].copy()
    else:
        tokens = text
        labels = np.roll(text, -1)
        labels[-1] = pad
    size = len(tokens)
    loss_mask = np.ones(size, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = np.arange(size, dtype=np.int64)
    starts = None
    if reset_position_ids or (reset_attention_mask and create_attention_mask):
        # the first token after the last EOD before j: where j's document starts
        marks = np.zeros(size, dtype=np.int64)
        after = np.flatnonzero(tokens == eod) + 1
        after = after[after < size]
        marks[after] = after
        starts = np.maximum.accumulate(marks)
    if reset_position_ids:
        position_ids -= starts
    attention_mask = None
    if create_attention_mask:
        rows = np.arange(size)[:, None]
        cols = np.arange(size)[None, :]
        allowed = cols <= rows
        if reset_attention_mask:
            allowed &= cols >= starts[:, None]
        attention_mask = ~allowed[None]
    loss_mask[labels == pad] = 0.0
    tokens[tokens == pad] = 0
    labels[labels == pad] = 0
    if document_lengths is not None:
        return _inter_document(
            tokens, labels, loss_mask, document_lengths, sequence_length, add_extra_token
        )
    sample = {"tokens": tokens, "labels": labels}
    if attention_mask is not None:
        sample["attention_mask"] = attention_mask
    sample["loss_mask"] = loss_mask
    sample["position_ids"] = position_ids
    return sample


def _inter_document(
    tokens: np.ndarray,
    labels: np.ndarray,
    loss_mask: np.ndarray,
    lengths: list[int],
    sequence_length: int,
    add_extra_token: bool,
) -> dict[str, np.ndarray]:
    # gpt_dataset.py 0.19 __getitem__, its inter_document_masking branch
    lengths = list(lengths)
    if add_extra_token:
        lengths[-1] -= 1
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = sequence_length - sum(lengths)
    if shortfall > 0:
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu_seqlens = np.cumsum([0, *lengths]).astype(np.int32)
    max_seqlen = np.diff(cu_seqlens).max()
    starts = np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)
    position_ids = np.arange(len(starts), dtype=np.int64) - starts
    padded = np.full(sequence_length + 1, sequence_length, dtype=np.int32)
    padded[: len(cu_seqlens)] = cu_seqlens
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": padded,
        "max_seqlen": np.asarray(max_seqlen, dtype=np.int32),
    }
