"""Stock Megatron's samples, computed in a process that never imports repack: the reference of
tests/test_masks.py, taken before any wrapper of repack's is installed (repack.megatron.masks wraps
Megatron's mask function when repack.megatron is imported; a reference computed in the test's
own process could not see a wrapper that changed stock's behaviour).

Also :class:`Flipping`, a ``GPTDataset`` subclass that writes into the attention mask it hands
out, which the test imports: stock keeps such a class's masks per dataset.

Usage: ``python stock_masks_child.py JOB.json`` prints one JSON list: a digest per split.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig


class Flipping(GPTDataset):
    """Flips one cell of the attention mask of every sample it hands out: in stock, that is
    this dataset's own cached mask, so each sample shows the flips of the dataset's earlier
    samples (and of no other dataset's)."""

    def __getitem__(self, idx):
        sample = super().__getitem__(idx)
        mask = sample.get("attention_mask")
        if isinstance(mask, torch.Tensor) and idx is not None:
            n = mask.shape[-1]
            row = int(idx) % n
            mask[0, row, (row * 7) % n] = ~mask[0, row, (row * 7) % n]
        return sample


class Tok:
    eod = 0

    def __init__(self, vocab_size: int = 65000) -> None:
        self.vocab_size = vocab_size
        self.unique_identifiers = {"class": "Tok", "vocab_size": vocab_size}


def digests(splits) -> list[str | None]:
    """As tests/megatron_support.py's ``digest``, over every sample of every split in order."""
    out: list[str | None] = []
    for split in splits:
        if split is None:
            out.append(None)
            continue
        h = hashlib.sha256()
        for i in range(len(split)):
            sample = split[i]
            for key in sorted(sample):
                value = sample[key]
                value = value.numpy() if isinstance(value, torch.Tensor) else np.array(value)
                value = np.ascontiguousarray(value)
                h.update(f"{key}:{value.dtype.str}:{value.shape};".encode())
                h.update(value.tobytes())
        out.append(h.hexdigest())
    return out


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    store = os.path.join(job["cache"], f"gloo-store-{os.getpid()}")
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + store, rank=0, world_size=1
    )
    config = GPTDatasetConfig(
        random_seed=job["seed"],
        sequence_length=job["length"],
        blend=(job["prefixes"], job["weights"]),
        split="90,5,5",
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=job["cache"],
        create_attention_mask=job["masks"],
    )
    cls = {"GPTDataset": GPTDataset, "Flipping": Flipping}[job["cls"]]
    splits = BlendedMegatronDatasetBuilder(cls, job["sizes"], lambda: True, config).build()
    found = digests(splits)
    assert not any(name == "repack" or name.startswith("repack.") for name in sys.modules)
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
