"""Megatron-Bridge's own dataset path reads a repack, bit-identical to stock.

Drives what Bridge's ``pretrain()`` does up to the data loaders (``megatron/bridge/training``:
``pretrain`` → ``setup`` → ``setup_data_iterators``), with Bridge's real functions on a real
``ConfigContainer``: Bridge's ``GPTDatasetConfig`` (``data_path`` or ``blend``) and its
``finalize()``, ``get_dataset_provider(cfg.dataset)``, the tokenizer set on the dataset config
as ``setup`` sets it, ``build_train_valid_test_datasets(cfg, provider)`` and
``build_pretraining_data_loader(...)`` with the arguments ``build_train_valid_test_data_loaders``
passes (its own tail broadcasts flags on a CUDA device, so that one function is not called).
Stock against repack, both ways the docs show (``megatron.bridge.data.utils.GPTDataset``
rebound to ``RepackedGPTDataset`` with ``REPACK_DIR`` set, and to ``dataset_class(OUT)``), cold
and warm index cache, ``mmap_bin_files`` both ways, ``num_workers`` 0 and 2, and Bridge's own
``GPTFIMDataset`` through ``repacked(GPTFIMDataset, OUT)``. Every batch is compared bit for bit.

The one stand-in: ``transformer_engine`` (``tests/bridge_support.py``). Bridge imports it at
import time in model code (``megatron/bridge/peft/lora_layers.py``, the model bridges and
providers, ``training/comm_overlap.py``), even when only the data path is used, and Transformer
Engine does not install without CUDA. The stand-in is served only to imports made by
``megatron.bridge`` modules (megatron-core keeps seeing no Transformer Engine, as on any machine
without it), nothing in it can be called (``TransformerEngineStandIn`` raises), and every
attribute looked up on it is recorded: the test asserts that the data path looked up none.
Nothing else is stubbed: megatron-core, Bridge and its imported dependencies are the real ones.

Needs Python 3.12 and Bridge installed (``.ci/run``'s Python 3.12 step installs Bridge 0.6.2
with the dependencies its data path imports). Bridge 0.6.2 imports only on megatron-core 0.19
(on 0.17.1 it misses ``megatron.core._rank_utils.safe_get_world_size``, on 0.18.2
``megatron.training.models.gpt``): elsewhere the module skips saying why, unless
``REPACK_TEST_BRIDGE`` is set (CI sets it for its megatron-core 0.19 run), where it fails.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from bridge_support import LOOKED_UP, install, uninstall
from megatron_support import (
    GPTDataset,
    Tok,
    assert_same_samples,
    init_process_group,
    weights_for,
    write_flat_blend,
    write_sources,
)

import repack.cache.indexcache
from repack.megatron import MEGATRON_VERSION, RepackedGPTDataset, dataset_class, repacked
from repack.merge import merge

pytestmark = [pytest.mark.megatron, pytest.mark.bridge]

if importlib.util.find_spec("megatron.bridge") is None:
    if os.environ.get("REPACK_TEST_BRIDGE"):
        raise ImportError("REPACK_TEST_BRIDGE is set but megatron.bridge is not importable")
    pytest.skip(
        "Megatron-Bridge is not installed (it needs Python 3.12; .ci/run installs it there)",
        allow_module_level=True,
    )


# the Transformer Engine (and ModelOpt) stand-ins: tests/bridge_support.py
install()
try:
    with warnings.catch_warnings():  # Bridge and Megatron warn that TE, Apex, ... are missing
        warnings.simplefilter("ignore")
        import megatron.bridge.data.utils as bridge_data_utils
        from megatron.bridge.data.datasets.fim_dataset import GPTFIMDataset
        from megatron.bridge.data.loaders import build_train_valid_test_datasets
        from megatron.bridge.data.samplers import build_pretraining_data_loader
        from megatron.bridge.models import GPTModelProvider
        from megatron.bridge.training.config import (
            CheckpointConfig,
            ConfigContainer,
            GPTDatasetConfig,
            GPTFIMDatasetConfig,
            LoggerConfig,
            OptimizerConfig,
            SchedulerConfig,
            TrainingConfig,
            ValidationConfig,
        )
        from megatron.bridge.training.tokenizers.config import TokenizerConfig
except ImportError as error:  # Bridge 0.6.2 imports only on megatron-core 0.19
    uninstall()
    if os.environ.get("REPACK_TEST_BRIDGE"):
        raise
    pytest.skip(
        f"Megatron-Bridge does not import on megatron-core {MEGATRON_VERSION}: {error}",
        allow_module_level=True,
    )
assert "transformer_engine" not in sys.modules  # megatron-core saw none


SEQUENCE = 64
TRAIN_ITERS, GLOBAL_BATCH, MICRO_BATCH = 12, 8, 4
EVAL_ITERS, EVAL_INTERVAL = 2, 6
BATCHES = 6  # read from every loader, at most (the test split has 4)


class FIMTok(Tok):
    """What ``GPTFIMDataset`` reads of a tokenizer (``_tokenizer.tokens_to_ids``,
    ``ids_to_text``, ``text_to_ids``): one character per token id, reversible."""

    BASE = 0x4E00
    TOKENS: ClassVar[dict[str, int]] = {
        "<prefix>": 60001,
        "<middle>": 60002,
        "<suffix>": 60003,
        "<pad>": 60004,
        "<eod>": 0,
    }

    def __init__(self) -> None:
        super().__init__()
        self._tokenizer = self

    def tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.TOKENS.get(tokens, 61)
        return [self.TOKENS[t] for t in tokens]

    def ids_to_text(self, ids, remove_special_tokens=False):
        special = set(self.TOKENS.values())
        return "".join(
            chr(self.BASE + int(i)) for i in ids if not (remove_special_tokens and i in special)
        )

    def text_to_ids(self, text):
        return [ord(c) - self.BASE for c in text]


class Blend:
    def __init__(self, root: Path) -> None:
        # uint16 only: FIMTok maps ids to characters below the surrogates
        self.prefixes = write_sources(root, 12, seed=17, int32_every=0)
        self.weights = weights_for(self.prefixes, seed=17)
        self.out = root / "out.repack"
        merge(write_flat_blend(root / "blend.json", self.prefixes, self.weights), self.out)

    def data_path(self) -> str:
        """Megatron-LM ``--data-path`` style: ``"w1 p1 w2 p2 ..."``."""
        return " ".join(f"{w} {p}" for w, p in zip(self.weights, self.prefixes, strict=True))


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> Blend:
    init_process_group()
    return Blend(tmp_path_factory.mktemp("bridge"))


def container(
    blend: Blend,
    cache: Path,
    *,
    mmap: bool,
    workers: int,
    use_data_path: bool,
    fim: bool = False,
) -> ConfigContainer:
    """A ``ConfigContainer`` as a recipe makes one, its dataset given by ``data_path`` (a
    string) or ``blend``."""
    fields = dict(
        random_seed=1234,
        seq_length=SEQUENCE,
        split="90,5,5",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(cache),
        mmap_bin_files=mmap,
        num_dataset_builder_threads=1,
        num_workers=workers,
        dataloader_type="single",
        data_sharding=True,
        pin_memory=False,
        persistent_workers=False,
        skip_getting_attention_mask_from_dataset=False,
    )
    if use_data_path:
        fields["data_path"] = blend.data_path()
    else:
        fields["blend"] = (list(blend.prefixes), list(blend.weights))
    if fim:
        dataset = GPTFIMDatasetConfig(
            fim_rate=0.5,
            fim_spm_rate=0.5,
            fim_fragment_rate=0.5,
            fim_split_sample=None,
            fim_extra_tokens={k.strip("<>"): k for k in FIMTok.TOKENS},
            **fields,
        )
    else:
        dataset = GPTDatasetConfig(**fields)
    return ConfigContainer(
        train=TrainingConfig(
            train_iters=TRAIN_ITERS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH
        ),
        validation=ValidationConfig(eval_iters=EVAL_ITERS, eval_interval=EVAL_INTERVAL),
        model=GPTModelProvider(num_layers=1, hidden_size=64, num_attention_heads=4),
        optimizer=OptimizerConfig(),
        scheduler=SchedulerConfig(),
        dataset=dataset,
        logger=LoggerConfig(),
        tokenizer=TokenizerConfig(),
        checkpoint=CheckpointConfig(),
    )


def data_path_batches(cfg: ConfigContainer, expect: type, fim: bool = False) -> list[list[dict]]:
    """What ``pretrain(cfg, ...)`` does with ``cfg.dataset`` up to its data loaders, and the
    first :data:`BATCHES` batches of each loader, as numpy arrays. Every dataset under each
    split's blend is an ``expect``."""
    cfg.dataset.finalize()  # ConfigContainer.validate() does this
    provider = bridge_data_utils.get_dataset_provider(cfg.dataset)
    assert provider is bridge_data_utils.pretrain_train_valid_test_datasets_provider
    cfg.dataset.tokenizer = FIMTok() if fim else Tok()  # setup(): build_tokenizer(cfg.tokenizer)
    datasets = build_train_valid_test_datasets(
        cfg=cfg, build_train_valid_test_datasets_provider=provider
    )
    batches = []
    for split, dataset in enumerate(datasets):
        parts = getattr(dataset, "datasets", [dataset])  # a BlendedDataset's, or itself
        assert {type(part) for part in parts} == {expect}, f"split {split}: {parts}"
        kind = cfg.dataset.dataloader_type if split != 1 else "cyclic"  # as the loaders do
        loader = build_pretraining_data_loader(
            dataset,
            0,
            kind,
            cfg.train.micro_batch_size,
            cfg.dataset.num_workers,
            cfg.dataset.data_sharding,
            worker_init_fn=None,
            collate_fn=getattr(dataset, "collate_fn", None),
            pin_memory=cfg.dataset.pin_memory,
            persistent_workers=cfg.dataset.persistent_workers,
            data_parallel_rank=torch.distributed.get_rank(),
            data_parallel_size=torch.distributed.get_world_size(),
            global_batch_size=cfg.train.global_batch_size,
            drop_last=cfg.dataset.drop_last,
            seed=cfg.dataset.random_seed,
        )
        found = []
        for batch in loader:
            found.append({k: v.numpy().copy() for k, v in batch.items() if v is not None})
            if len(found) == BATCHES:
                break
        assert found, f"split {split}: no batch"
        batches.append(found)
    return batches


def forbid_index_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm build, as a new process would make it: the catalog read from disk, and Megatron
    may not build any index (they must all come from the cache)."""
    monkeypatch.setattr(repack.cache.indexcache, "_CACHES", {})

    def refuse(self):
        raise AssertionError(f"{self.unique_description_hash}: indices built, not a cache hit")

    monkeypatch.setattr(GPTDataset, "_build_document_sample_shuffle_indices", refuse)


def rebind(monkeypatch: pytest.MonkeyPatch, name: str, cls: type) -> None:
    """What the docs tell a training script to do before ``pretrain``."""
    monkeypatch.setattr(bridge_data_utils, name, cls)


@pytest.mark.parametrize(
    ("how", "use_data_path", "mmap", "workers"),
    [
        ("REPACK_DIR", True, True, 0),
        ("REPACK_DIR", False, False, 2),
        ("dataset_class", True, False, 0),
        ("dataset_class", False, True, 2),
    ],
)
def test_bridge_data_path_gives_the_stock_batches(
    blend: Blend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    use_data_path: bool,
    mmap: bool,
    workers: int,
) -> None:
    def run(cache: Path, expect: type) -> list[list[dict]]:
        return data_path_batches(
            container(blend, cache, mmap=mmap, workers=workers, use_data_path=use_data_path),
            expect,
        )

    looked_up = len(LOOKED_UP)
    expected = run(tmp_path / "stock", GPTDataset)
    if how == "REPACK_DIR":
        monkeypatch.setenv("REPACK_DIR", str(blend.out))
        rebind(monkeypatch, "GPTDataset", RepackedGPTDataset)
    else:
        rebind(monkeypatch, "GPTDataset", dataset_class(blend.out))
    ours = bridge_data_utils.GPTDataset
    assert ours is not GPTDataset
    assert_same_samples(expected, run(tmp_path / "ours", ours))  # cold
    with monkeypatch.context() as patch:
        forbid_index_builds(patch)
        assert_same_samples(expected, run(tmp_path / "ours", ours))
    assert LOOKED_UP[looked_up:] == []  # the data path never touched Transformer Engine


def test_bridge_fim_data_path_gives_the_stock_batches(
    blend: Blend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bridge's ``GPTFIMDataset`` (``GPTFIMDatasetConfig``), repacked: the stock batches, or,
    where stock fails, the same failure (Bridge 0.6.2's ``GPTFIMDataset`` returns two values
    where megatron-core 0.19's ``GPTDataset.__getitem__`` unpacks three)."""

    def run(cache: Path, expect: type) -> list[list[dict]]:
        cfg = container(blend, cache, mmap=True, workers=0, use_data_path=True, fim=True)
        return data_path_batches(cfg, expect, fim=True)

    ours = repacked(GPTFIMDataset, blend.out)

    looked_up = len(LOOKED_UP)
    try:
        expected = run(tmp_path / "stock", GPTFIMDataset)
    except Exception as stock:  # compared with what the repacked class raises
        rebind(monkeypatch, "GPTFIMDataset", ours)
        with pytest.raises(type(stock)) as failure:
            run(tmp_path / "ours", ours)
        assert str(failure.value) == str(stock)
        assert "not enough values to unpack" in str(stock), stock  # the known incompatibility
        assert LOOKED_UP[looked_up:] == []
        return
    assert any((b["tokens"] == 60001).any() for b in expected[0])  # premise: FIM permuted some
    rebind(monkeypatch, "GPTFIMDataset", ours)
    assert_same_samples(expected, run(tmp_path / "ours", ours))
    with monkeypatch.context() as patch:
        forbid_index_builds(patch)
        assert_same_samples(expected, run(tmp_path / "ours", ours))
    assert LOOKED_UP[looked_up:] == []
