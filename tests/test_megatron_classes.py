"""``repack.megatron.repacked(cls)``: every ``IndexedDataset``-based Megatron class reads a
repack, bit-identical to stock.

For each class — a user subclass of ``GPTDataset``, ``BERTMaskedWordPieceDataset``,
``T5MaskedWordPieceDataset``, a multimodal user class, and ``GPTFIMDataset`` (from a Megatron-LM
checkout, or from the ``megatron/training`` that megatron-core 0.17 and later ship) —
``BlendedMegatronDatasetBuilder`` over the repacked class gives the samples that the
stock class gives over the original prefixes, and a cache written by stock is a hit. Plus the
checks made when a class is made, and the clear error where stock Megatron would hang.

These run on whichever megatron-core is importable; CI runs them against every supported
release (``.ci/run``).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import megatron.core.datasets.helpers as megatron_helpers
import numpy as np
import pytest
from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron_support import (
    GPTDataset,
    Tok,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    write_flat_blend,
)

from repack.cache.indexcache import CATALOG_FILE
from repack.errors import UndrawableSplit, UnsupportedMegatron
from repack.megatron import MEGATRON_VERSION, RepackedGPTDataset, dataset_class, repacked
from repack.merge import merge
from repack.synth import write_prefix

pytestmark = pytest.mark.megatron

VOCAB = 30_000
SPLIT_ID = 61
SIZES = [300, 40, 40]


class WordPieceTok(Tok):
    """The fields of a WordPiece tokenizer that the BERT and T5 datasets read, as Megatron's own
    unit tests fake them: special ids, ``inv_vocab`` (every third piece a ``##`` continuation,
    for whole-word masking) and T5's sentinel ids."""

    cls, sep, mask, pad, bos, eos, eod = 1, 2, 3, 0, 4, 5, 5

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.unique_identifiers = {"class": "WordPieceTok", "vocab_size": VOCAB}
        self.inv_vocab = {i: ("##" if i % 3 == 0 else "") + f"p{i}" for i in range(VOCAB)}
        self.additional_special_tokens_ids = list(range(6, 56))


@dataclass(frozen=True)
class Data:
    root: Path
    prefixes: list[str]
    weights: list[float]
    out: Path
    modal_prefixes: list[str]
    modal_out: Path


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


def write_documents(root: Path, count: int, seed: int, modal: bool = False) -> list[str]:
    """``count`` uint16 sources of 12 to 24 documents of 2 to 6 sentences each (the masked
    datasets draw samples from multi-sentence documents), token ids below ``VOCAB``."""
    rng = np.random.default_rng(seed)
    prefixes = []
    for i in range(count):
        sizes = rng.integers(2, 7, int(rng.integers(12, 25)))
        documents = np.concatenate([[0], np.cumsum(sizes)])
        sequences = [
            rng.integers(60, VOCAB, int(rng.integers(3, 40))) for _ in range(documents[-1])
        ]
        for sequence in sequences[::2]:
            sequence[0] = SPLIT_ID  # where GPTFIMDataset's fim_split_sample cuts
        modes = rng.integers(0, 3, len(sequences)).tolist() if modal else None
        prefix = str(root / ("modal" if modal else "text") / f"src-{i:03d}")
        write_prefix(prefix, sequences, dtype=np.uint16, document_indices=documents, modes=modes)
        prefixes.append(prefix)
    return prefixes


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("classes")
    prefixes = write_documents(root, 10, seed=3)
    weights = [round(0.5 + i / 7, 3) for i in range(len(prefixes))]
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, weights), out, shard_size=16384)
    modal = write_documents(root, 4, seed=4, modal=True)
    modal_out = root / "modal-out"
    merge(write_flat_blend(root / "modal.json", modal), modal_out)
    return Data(root, prefixes, weights, out, modal, modal_out)


def masked_config(cls: type, data: Data, cache: Path | None, **extra) -> object:
    fields = dict(
        random_seed=77,
        sequence_length=48,
        blend=(data.prefixes, data.weights),
        split="80,10,10",
        tokenizer=WordPieceTok(),
        path_to_cache=None if cache is None else str(cache),
        masking_probability=0.15,
        short_sequence_probability=0.1,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
    )
    if cls is BERTMaskedWordPieceDatasetConfig:
        fields["classification_head"] = extra.pop("classification_head", True)
    else:
        fields["sequence_length_decoder"] = 16
        fields["masking_use_geometric_distribution"] = True
    fields.update(extra)
    return cls(**fields)


MASKED = {
    "bert": (BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig),
    "t5": (T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig),
}


# --- the masked WordPiece datasets ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MASKED))
@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no-cache"])
def test_masked_dataset_gives_the_stock_samples(
    data: Data, tmp_path: Path, name: str, with_cache: bool
) -> None:
    cls, config_cls = MASKED[name]
    stock_cache = tmp_path / "stock" if with_cache else None
    ours_cache = tmp_path / "ours" if with_cache else None
    stock_splits = build(cls, masked_config(config_cls, data, stock_cache), SIZES)
    expected = collect(stock_splits)
    ours = repacked(cls, data.out)
    assert ours.__name__ == cls.__name__ and issubclass(ours, cls)
    splits = build(ours, masked_config(config_cls, data, ours_cache), SIZES)
    found = collect(splits)
    assert all(split and len(split) > 10 for split in expected)  # premise: real samples
    assert_same_samples(expected, found)
    # the vocabulary list every dataset keeps: one per process (stock: one per dataset)
    datasets = [d for split in splits for d in split.datasets]
    assert len({id(d.token_lookup) for d in datasets}) == 1
    stock_datasets = [d for split in stock_splits for d in split.datasets]
    assert len({id(d.token_lookup) for d in stock_datasets}) == len(stock_datasets)
    if not with_cache:  # stock writes next to each prefix; repack inside the repack
        written = list((data.out / "cache").glob(f"{cls.__name__}_indices/*-sample_index.npy"))
        assert len(written) >= len(data.prefixes)


@pytest.mark.parametrize("name", sorted(MASKED))
def test_masked_stock_cache_is_a_hit(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    cls, config_cls = MASKED[name]
    config = masked_config(config_cls, data, tmp_path / "cache")
    expected = collect(build(cls, config, SIZES))

    def refuse(*args, **kwargs):
        raise AssertionError("sample index rebuilt: not a cache hit")

    monkeypatch.setattr(megatron_helpers, "build_mapping", refuse)
    found = collect(build(repacked(cls, data.out), copy.copy(config), SIZES))
    assert_same_samples(expected, found)


def test_bert_without_classification_head(data: Data, tmp_path: Path) -> None:
    config = masked_config(
        BERTMaskedWordPieceDatasetConfig, data, tmp_path / "s", classification_head=False
    )
    expected = collect(build(BERTMaskedWordPieceDataset, config, SIZES))
    config = masked_config(
        BERTMaskedWordPieceDatasetConfig, data, tmp_path / "r", classification_head=False
    )
    found = collect(build(repacked(BERTMaskedWordPieceDataset, data.out), config, SIZES))
    assert_same_samples(expected, found)


# --- subclasses of GPTDataset and other classes --------------------------------------------------


class DocumentAwareGPT(GPTDataset):
    """A user subclass, as training code writes them: an extra key per sample."""

    def __getitem__(self, idx):
        sample = super().__getitem__(idx)
        sample["first_token"] = sample["tokens"][:1].clone()
        return sample


class ModalDataset(MegatronDataset):
    """A user dataset over multimodal prefixes: each sample is one sequence and its mode."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        return IndexedDataset(dataset_path, multimodal=True)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, idx):
        tokens, mode = self.dataset[int(self.indices[idx % len(self.indices)])]
        return {"tokens": np.asarray(tokens), "mode": np.asarray(mode)}


def test_gpt_subclass_gives_the_stock_samples(data: Data, tmp_path: Path) -> None:
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=9, sequence_length=40)
    expected = collect(
        build(DocumentAwareGPT, gpt_config(**kwargs, cache=tmp_path / "stock"), SIZES)
    )
    ours = repacked(DocumentAwareGPT, data.out)
    found = collect(build(ours, gpt_config(**kwargs, cache=tmp_path / "ours"), SIZES))
    assert "first_token" in found[0][0]
    assert_same_samples(expected, found)
    assert issubclass(ours, DocumentAwareGPT) and ours.__name__ == "DocumentAwareGPT"
    # its indices are consolidated like RepackedGPTDataset's, under the stock class name
    catalog = json.loads((tmp_path / "ours" / CATALOG_FILE).read_text())
    assert catalog["entries"] and all("-DocumentAwareGPT-" in name for name in catalog["entries"])


def forbid_gpt_index_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("GPT sample index rebuilt: not a cache hit")

    monkeypatch.setattr(megatron_helpers, "build_sample_idx", refuse)


def test_gpt_subclass_stock_cache_is_a_hit(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = gpt_config(data.prefixes, data.weights, seed=10, cache=tmp_path / "cache")
    expected = collect(build(DocumentAwareGPT, config, SIZES))
    forbid_gpt_index_builds(monkeypatch)
    found = collect(build(repacked(DocumentAwareGPT, data.out), copy.copy(config), SIZES))
    assert_same_samples(expected, found)


def test_multimodal_class_reads_modes(data: Data, tmp_path: Path) -> None:
    config = gpt_config(data.modal_prefixes, split="70,20,10", cache=tmp_path / "stock")
    expected = collect(build(ModalDataset, config, [None, None, None]))
    ours = repacked(ModalDataset, data.modal_out, multimodal=True)
    config = gpt_config(data.modal_prefixes, split="70,20,10", cache=tmp_path / "ours")
    found = collect(build(ours, config, [None, None, None]))
    assert {int(s["mode"]) for s in found[0]} == {0, 1, 2}  # premise: modes vary
    assert_same_samples(expected, found)


def test_multimodal_needs_a_multimodal_source(data: Data, tmp_path: Path) -> None:
    config = gpt_config(data.prefixes, split="70,20,10", cache=tmp_path / "c")
    with pytest.raises(Exception, match="no sequence modes"):
        build(repacked(ModalDataset, data.out, multimodal=True), config, [None, None, None])


# --- making classes ------------------------------------------------------------------------------


def test_classes_are_made_once_and_bound_ones_subclass_the_unbound(data: Data) -> None:
    bound = repacked(BERTMaskedWordPieceDataset, data.out)
    assert repacked(BERTMaskedWordPieceDataset, str(data.out)) is bound
    assert issubclass(bound, repacked(BERTMaskedWordPieceDataset))
    assert repacked(bound) is repacked(BERTMaskedWordPieceDataset)  # the stock class is used
    assert repacked(GPTDataset) is RepackedGPTDataset
    assert dataset_class(data.out) is repacked(GPTDataset, data.out)
    assert issubclass(dataset_class(data.out), RepackedGPTDataset)


def test_ready_made_classes_read_repack_dir_and_pickle_by_name(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from repack.megatron import RepackedBERTMaskedWordPieceDataset, RepackedT5MaskedWordPieceDataset

    assert RepackedBERTMaskedWordPieceDataset is repacked(BERTMaskedWordPieceDataset)
    assert RepackedT5MaskedWordPieceDataset is repacked(T5MaskedWordPieceDataset)
    assert pickle.loads(pickle.dumps(RepackedT5MaskedWordPieceDataset)) is (
        RepackedT5MaskedWordPieceDataset
    )
    with pytest.raises(ImportError):
        from repack.megatron import RepackedNoSuchDataset  # noqa: F401
    monkeypatch.setenv("REPACK_DIR", str(data.out))
    config = masked_config(T5MaskedWordPieceDatasetConfig, data, tmp_path / "env")
    found = collect(build(RepackedT5MaskedWordPieceDataset, config, SIZES))
    config = masked_config(T5MaskedWordPieceDatasetConfig, data, tmp_path / "bound")
    assert_same_samples(
        collect(build(repacked(T5MaskedWordPieceDataset, data.out), config, SIZES)), found
    )


def test_repacked_instances_pickle(data: Data, tmp_path: Path) -> None:
    config = masked_config(BERTMaskedWordPieceDatasetConfig, data, tmp_path / "c")
    train = build(repacked(BERTMaskedWordPieceDataset, data.out), config, SIZES)[0]
    dataset = train.datasets[0]
    again = pickle.loads(pickle.dumps(dataset))
    assert type(again) is type(dataset)
    for i in (0, 5, len(dataset) - 1):
        for key, value in dataset[i].items():
            assert np.array_equal(np.asarray(value), np.asarray(again[i][key])), key


def test_not_a_dataset_class_is_refused() -> None:
    with pytest.raises(UnsupportedMegatron, match="not a Megatron-Core dataset class"):
        repacked(dict)


def test_a_missing_method_fails_at_class_creation() -> None:
    """What a release that changed a method repack relies on looks like: one clear error when
    the class is made, naming the release and the method — not an AttributeError later."""

    class Changed(GPTDataset):
        def _build_document_sample_shuffle_indices(self, path_to_cache):
            raise AssertionError("never called")

    with pytest.raises(UnsupportedMegatron) as caught:
        repacked(Changed)
    message = str(caught.value)
    assert f"megatron-core {MEGATRON_VERSION}" in message
    assert "_build_document_sample_shuffle_indices(path_to_cache)" in message
    assert "test_megatron_classes" in message

    class Gone(BERTMaskedWordPieceDataset):
        _build_sample_index = None

    with pytest.raises(UnsupportedMegatron, match=r"has no method _build_sample_index\(\)"):
        repacked(Gone)


# --- GPTFIMDataset (megatron/training: Megatron-LM, and the megatron-core 0.17+ wheels) ---------

MEGATRON_LM = os.environ.get("REPACK_TEST_MEGATRON_LM")


def fim_source() -> Path | None:
    """``megatron/training/datasets/fim_dataset.py``: from the Megatron-LM checkout in
    ``$REPACK_TEST_MEGATRON_LM``, else the one the imported megatron-core ships (0.17 and later
    ship ``megatron/training`` in the wheel), else ``None``."""
    if MEGATRON_LM:
        return Path(MEGATRON_LM, "megatron", "training", "datasets", "fim_dataset.py")
    import megatron.core

    shipped = Path(megatron.core.__file__).parents[1] / "training" / "datasets" / "fim_dataset.py"
    return shipped if shipped.is_file() else None


FIM_SOURCE = fim_source()


class FIMTok(Tok):
    """What ``GPTFIMDataset`` reads of a tokenizer (``_tokenizer.tokens_to_ids``,
    ``ids_to_text``, ``text_to_ids``): one character per token id, reversible."""

    BASE = 0x4E00  # token ids < VOCAB map below the surrogates

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
            return self.TOKENS.get(tokens, SPLIT_ID)
        return [self.TOKENS[t] for t in tokens]

    def ids_to_text(self, ids, remove_special_tokens=False):
        special = set(self.TOKENS.values())
        return "".join(
            chr(self.BASE + int(i)) for i in ids if not (remove_special_tokens and i in special)
        )

    def text_to_ids(self, text):
        return [ord(c) - self.BASE for c in text]


def load_fim():
    """:data:`FIM_SOURCE`, loaded from its file: the package ``megatron.training`` itself
    imports the whole training stack (and needs Python 3.12)."""
    spec = importlib.util.spec_from_file_location("megatron_lm_fim_dataset", FIM_SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    FIM_SOURCE is None,
    reason=f"megatron-core {MEGATRON_VERSION} ships no GPTFIMDataset (0.17 and later do): "
    "set REPACK_TEST_MEGATRON_LM to a Megatron-LM checkout",
)
@pytest.mark.parametrize("split_sample", [None, "split"])
@pytest.mark.parametrize("masks", [True, False], ids=["masks", "no-masks"])
def test_fim_dataset_gives_the_stock_samples(
    data: Data, tmp_path: Path, split_sample: str | None, masks: bool
) -> None:
    fim = load_fim()

    def config(cache: Path):
        base = gpt_config(
            data.prefixes, data.weights, seed=21, sequence_length=64, cache=cache,
            attention_mask=masks,
        )  # fmt: skip
        fields = {
            f: getattr(base, f)
            for f in base.__dataclass_fields__
            if base.__dataclass_fields__[f].init
        }
        fields["tokenizer"] = FIMTok()
        return fim.GPTFIMDatasetConfig(
            **fields,
            fim_rate=0.5,
            fim_spm_rate=0.5,
            fim_fragment_rate=0.5,
            fim_split_sample=split_sample,
            fim_extra_tokens={k.strip("<>"): k for k in FIMTok.TOKENS},
        )

    expected = collect(build(fim.GPTFIMDataset, config(tmp_path / "stock"), SIZES))
    ours = repacked(fim.GPTFIMDataset, data.out)
    splits = build(ours, config(tmp_path / "ours"), SIZES)
    found = collect(splits)
    assert any(60001 in s["tokens"] for s in found[0])  # premise: FIM permuted some samples
    assert_same_samples(expected, found)
    assert ("attention_mask" in found[0][0]) == masks
    # one attention mask and one set of position ids for every dataset of the process
    datasets = [d for split in splits for d in split.datasets]
    for name in ("cached_attention_mask", "cached_position_ids"):
        assert len({id(getattr(d, name)) for d in datasets}) == 1, name
    with pytest.MonkeyPatch.context() as patch:  # the stock cache is a hit
        forbid_gpt_index_builds(patch)
        assert_same_samples(expected, collect(build(ours, config(tmp_path / "stock"), SIZES)))


# --- a split slice without tokens: stock hangs, repack says why ---------------------------------

HANG_CHILD = textwrap.dedent(
    """
    import faulthandler, json, sys
    sys.path.insert(0, {tests!r})
    from megatron_support import GPTDataset, build, gpt_config, init_process_group
    init_process_group({gloo!r})
    faulthandler.dump_traceback_later({after}, exit=True)  # prints where it is, then exits
    config = gpt_config({prefixes!r}, [1.0] * 3, split="99,1,0", cache={cache!r})
    build(GPTDataset, config, [200, 20, 20])
    print("BUILT")
    """
)


@pytest.fixture(scope="module")
def four_sequence_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """Sources of 120, 4 and 90 sequences; with split ``"99,1,0"`` the valid slice of a source of 4
    rounds to no sequence at all."""
    root = tmp_path_factory.mktemp("empty-slice")
    rng = np.random.default_rng(8)
    prefixes = []
    for i, n in enumerate([120, 4, 90]):
        prefix = str(root / f"src-{i}")
        write_prefix(prefix, [rng.integers(1, 60000, 30) for _ in range(n)], dtype=np.uint16)
        prefixes.append(prefix)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes), out)
    return prefixes, out


def test_empty_split_slice_is_a_clear_error(
    four_sequence_sources: tuple[list[str], Path], tmp_path: Path
) -> None:
    prefixes, out = four_sequence_sources
    config = gpt_config(prefixes, [1.0] * 3, split="99,1,0", cache=tmp_path / "cache")
    with pytest.raises(UndrawableSplit) as caught:
        build(dataset_class(out), config, [200, 20, 20])
    message = str(caught.value)
    assert message.startswith(f"{prefixes[1]}: the valid slice holds no tokens")
    assert "0 of its 4 sequences" in message and "split '99,1,0'" in message
    assert "_get_num_epochs" in message


def test_a_blend_past_the_int16_index_is_one_error_before_any_dataset(
    four_sequence_sources: tuple[list[str], Path], tmp_path: Path
) -> None:
    """32,767 prefixes in a split's blend: Megatron's BlendedDataset asserts fewer, after every
    dataset is built (and under python -O its int16 index wraps). The repacked class refuses at
    the first, by name; 32,766 go on (and fail on the first prefix the repack lacks)."""
    from repack.errors import TooManyDatasets, UnknownSource

    prefixes, out = four_sequence_sources
    many = [*prefixes, *(str(tmp_path / f"absent-{i}") for i in range(32_767 - len(prefixes)))]
    config = gpt_config(many, None, split="99,1,0", cache=tmp_path / "cache")
    with pytest.raises(TooManyDatasets) as caught:
        build(dataset_class(out), config, [200, 20, 20])
    message = str(caught.value)
    assert message.startswith("the blend names 32,767 prefixes: Megatron's BlendedDataset")
    assert "python -O" in message and message.endswith("; blend fewer prefixes")
    per_split = gpt_config(blend_per_split=[(prefixes, None), None, (many, None)])
    with pytest.raises(TooManyDatasets, match=r"^the test blend of blend_per_split names 32,767"):
        build(dataset_class(out), per_split, [200, 0, 20])
    with pytest.raises(UnknownSource):
        build(dataset_class(out), gpt_config(many[:32_766], None, split="99,1,0"), [200, 20, 20])


@pytest.mark.slow  # 10 s of stock's loop: on 0.16 and the newest release (.ci/run)
def test_stock_megatron_hangs_on_the_same_blend(
    four_sequence_sources: tuple[list[str], Path], tmp_path: Path
) -> None:
    """The same build with stock GPTDataset never returns: after 10 s its stack is still in
    ``GPTDataset._get_num_epochs`` (dumped by faulthandler, which then ends the process)."""
    prefixes, _ = four_sequence_sources
    script = HANG_CHILD.format(
        tests=str(Path(__file__).parent),
        gloo=str(tmp_path),
        prefixes=prefixes,
        cache=str(tmp_path / "cache"),
        after=10,
    )
    assert_still_in(script, "_get_num_epochs")


def assert_still_in(script: str, frame: str) -> None:
    """Run ``script``, which has faulthandler dump its stack and end it after a while: it must
    not have finished its build, and the dumped stack must show ``frame``."""
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert "BUILT" not in child.stdout
    assert "Timeout" in child.stderr and frame in child.stderr, child.stderr[-3000:]


# --- BERT/T5: a slice without a drawable document the blend draws from: stock loops, then fails --

MASKED_HANG_CHILD = textwrap.dedent(
    """
    import faulthandler, sys
    sys.path.insert(0, {tests!r})
    import test_megatron_classes as t
    from megatron_support import build, init_process_group
    init_process_group({gloo!r})
    faulthandler.dump_traceback_later({after}, exit=True)  # prints where it is, then exits
    data = t.Data(None, {prefixes!r}, [1.0] * {count}, None, [], None)
    build(t.BERTMaskedWordPieceDataset, t.masked_config(
        t.BERTMaskedWordPieceDatasetConfig, data, {cache!r}, split="100,0,0"), [200, 0, 0])
    print("BUILT")
    """
)


@pytest.fixture(scope="module")
def undrawable_masked(tmp_path_factory: pytest.TempPathFactory) -> Data:
    """A good source; one whose 12 documents hold one sentence each (BERT with its binary head
    draws from documents of two sentences or more); one whose documents of 2-3 sentences each
    hold a sentence of 600 tokens (Megatron skips a document with a sentence over 512)."""
    root = tmp_path_factory.mktemp("undrawable-masked")
    good = write_documents(root, 1, seed=9)
    rng = np.random.default_rng(10)
    single = str(root / "single")
    write_prefix(
        single,
        [rng.integers(60, VOCAB, 20) for _ in range(12)],
        document_indices=np.arange(13),
    )
    long_doc = str(root / "long")
    counts = rng.integers(2, 4, 8)
    sequences = []
    for n in counts:
        sequences += [rng.integers(60, VOCAB, 30) for _ in range(n - 1)]
        sequences.append(rng.integers(60, VOCAB, 600))
    write_prefix(long_doc, sequences, document_indices=np.concatenate([[0], np.cumsum(counts)]))
    prefixes = [*good, single, long_doc]
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes), out)
    return Data(root, prefixes, [1.0] * 3, out, [], out)


@pytest.mark.parametrize(
    ("name", "culprit", "head"),
    [("bert", 1, True), ("bert", 2, True), ("t5", 2, None)],
    ids=["bert-single-sentence-documents", "bert-long-sentences", "t5-long-sentences"],
)
def test_masked_slice_without_a_drawable_document_is_a_clear_error(
    undrawable_masked: Data, tmp_path: Path, name: str, culprit: int, head: bool | None
) -> None:
    cls, config_cls = MASKED[name]
    data = undrawable_masked
    blend = Data(
        data.root, [data.prefixes[0], data.prefixes[culprit]], [1.0, 1.0], data.out, [], data.out
    )
    extra = {} if head is None else {"classification_head": head}
    config = masked_config(config_cls, blend, tmp_path / "cache", split="100,0,0", **extra)
    with pytest.raises(UndrawableSplit) as caught:
        build(repacked(cls, data.out), config, [200, 0, 0])
    message = str(caught.value)
    need = 2 if name == "bert" else 1
    assert message.startswith(f"{data.prefixes[culprit]}: none of the ")
    assert f"documents of the train slice (split '100,0,0') has {need} or more sentences" in message
    assert "helpers.build_mapping" in message and "\n" not in message


def test_masked_drawable_slices_pass_the_check(undrawable_masked: Data, tmp_path: Path) -> None:
    """The same culprits are fine where Megatron can draw from them: BERT without its binary
    head takes single-sentence documents; the good source alone builds as stock does."""
    data = undrawable_masked
    single = Data(data.root, data.prefixes[:2], [1.0, 1.0], data.out, [], data.out)
    config = masked_config(
        BERTMaskedWordPieceDatasetConfig, single, None, split="100,0,0", classification_head=False
    )
    expected = collect(build(BERTMaskedWordPieceDataset, config, [200, 0, 0]))
    found = collect(build(repacked(BERTMaskedWordPieceDataset, data.out), config, [200, 0, 0]))
    assert len(found[0]) >= 200
    assert_same_samples(expected, found)


@pytest.mark.slow  # 10 s of stock's loop: on 0.16 and the newest release (.ci/run)
def test_stock_bert_loops_on_the_same_blend(undrawable_masked: Data, tmp_path: Path) -> None:
    """Stock BERT on the single-sentence source: after 10 s it is still in
    ``helpers.build_mapping`` (dumped by faulthandler, which then ends the process). Left to
    run, its 2**31 - 2 epochs of 12 documents end after minutes with no sample, and
    ``BlendedDataset``, drawing about 100 from it, stops with ``IndexError``."""
    data = undrawable_masked
    script = MASKED_HANG_CHILD.format(
        tests=str(Path(__file__).parent),
        gloo=str(tmp_path),
        prefixes=[data.prefixes[0], data.prefixes[1]],
        count=2,
        cache=str(tmp_path / "cache"),
        after=10,
    )
    assert_still_in(script, "_build_sample_index")


# --- ... and where the blend draws nothing from such a slice, stock builds: so does repack -------


@pytest.fixture(scope="module")
def one_document_culprits(tmp_path_factory: pytest.TempPathFactory) -> Data:
    """Four good sources, then two culprits of one document each (stock's ``build_mapping``
    spends some 10 s per document of a slice on its ``2**31 - 2`` empty epochs): one sentence;
    two sentences, one of them 600 tokens long."""
    root = tmp_path_factory.mktemp("one-document-culprits")
    good = write_documents(root, 4, seed=12)
    rng = np.random.default_rng(13)
    single = str(root / "single")
    write_prefix(single, [rng.integers(60, VOCAB, 20)], document_indices=np.arange(2))
    long_doc = str(root / "long")
    write_prefix(
        long_doc,
        [rng.integers(60, VOCAB, 30), rng.integers(60, VOCAB, 600)],
        document_indices=np.array([0, 2]),
    )
    prefixes = [*good, single, long_doc]
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes), out)
    return Data(root, prefixes, [1.0] * len(prefixes), out, [], out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "culprit", "head"),
    [("bert", 4, True), ("bert", 5, False), ("t5", 5, None)],
    ids=["bert-single-sentence", "bert-no-head-long-sentence", "t5-long-sentence"],
)
def test_masked_undrawable_slice_the_blend_never_draws_from_builds_as_stock(
    one_document_culprits: Data, tmp_path: Path, name: str, culprit: int, head: bool | None
) -> None:
    """The case of the report: a source that gives no sample, at a weight so small that the
    blend draws none of it (yet asks 2 of its dataset). Stock builds, after its long loop;
    repack builds at once, the same samples and the same cached sample index."""
    cls, config_cls = MASKED[name]
    data = one_document_culprits
    blend = Data(
        data.root,
        [*data.prefixes[:4], data.prefixes[culprit]],
        [1.17, 1.92, 0.55, 1.91, 0.001],  # Megatron's greedy draws 0 of the last, 1 planned
        data.out,
        [],
        data.out,
    )
    extra = {} if head is None else {"classification_head": head}

    def config(cache: Path):
        return masked_config(config_cls, blend, cache, split="100,0,0", **extra)

    stock = build(cls, config(tmp_path / "stock"), [200, 0, 0])
    culprit_dataset = stock[0].datasets[4]
    assert culprit_dataset.num_samples == 2 and len(culprit_dataset) == 0  # premise
    assert np.bincount(stock[0].dataset_index, minlength=5)[4] == 0  # premise: none drawn
    ours = build(repacked(cls, data.out), config(tmp_path / "ours"), [200, 0, 0])
    assert_same_samples(collect(stock), collect(ours))
    for kind in ("description.txt", "sample_index.npy"):
        found = sorted((tmp_path / "ours").glob(f"*-{cls.__name__}-{kind}"))
        expected = sorted((tmp_path / "stock").glob(f"*-{cls.__name__}-{kind}"))
        assert [f.name for f in found] == [f.name for f in expected] and len(found) == 5
        assert [f.read_bytes() for f in found] == [f.read_bytes() for f in expected]


@pytest.mark.parametrize("name", sorted(MASKED))
def test_masked_undrawable_source_alone_builds_as_stock(
    one_document_culprits: Data, tmp_path: Path, name: str
) -> None:
    """A lone culprit (no blend): stock's builder returns its empty dataset; so does repack,
    with the index stock writes (the stock side is read from repack's cache: the same file)."""
    cls, config_cls = MASKED[name]
    data = one_document_culprits
    blend = Data(data.root, [data.prefixes[5]], None, data.out, [], data.out)
    config = masked_config(config_cls, blend, tmp_path / "cache", split="100,0,0")
    ours = build(repacked(cls, data.out), config, [50, 0, 0])
    assert ours[0].num_samples == 50 and len(ours[0]) == 0
    with pytest.MonkeyPatch.context() as patch:  # stock finds repack's file a cache hit
        patch.setattr(megatron_helpers, "build_mapping", lambda *a, **k: 1 / 0)
        stock = build(cls, copy.copy(config), [50, 0, 0])
    assert len(stock[0]) == 0 and stock[0].sample_index.dtype == ours[0].sample_index.dtype


def test_gpt_slice_with_tokens_but_no_sample_builds_as_stock(tmp_path: Path) -> None:
    """GPT's check is for a slice without tokens only: a valid slice of one sequence of 5
    tokens, at a tiny weight, is repeated for as many epochs as its samples need, in stock and
    in repack."""
    rng = np.random.default_rng(14)
    prefixes = []
    for i, n in enumerate([120, 60, 90]):
        prefix = str(tmp_path / f"src-{i}")
        tokens = 30 if i != 1 else 5
        write_prefix(prefix, [rng.integers(1, 60000, tokens) for _ in range(n)], dtype=np.uint16)
        prefixes.append(prefix)
    out = tmp_path / "out"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes), out)
    weights = [1.0, 0.001, 1.0]

    def config(cache: str):
        return gpt_config(
            prefixes, weights, split="98,2,0", sequence_length=16, cache=tmp_path / cache
        )

    stock = build(GPTDataset, config("stock"), [200, 20, 0])
    small = stock[1].datasets[1]
    assert small._get_num_tokens_per_epoch() == 5 and len(small.indices) == 1  # premise
    assert len(small) >= small.num_samples >= 1
    ours = build(dataset_class(out), config("ours"), [200, 20, 0])
    assert_same_samples(collect(stock), collect(ours))
