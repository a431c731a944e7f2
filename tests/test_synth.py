"""repack.synth writes what Megatron-Core writes, and Megatron-Core reads what it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
)
from megatron.core.datasets.utils import get_blend_from_list

from repack.synth import MEGATRON_DTYPE_CODES, DemoBlend, main, make_blend, write_prefix

HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8


def read_bytes(prefix: str | Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def random_sequences(seed: int, count: int, high: int) -> list[np.ndarray]:
    """``count`` sequences of 0 to 40 token ids below ``high``; some are empty."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 41, size=count)
    lengths[[1, count // 2]] = 0
    return [rng.integers(0, high, size=n) for n in lengths]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    return make_blend(tmp_path_factory.mktemp("demo"), 300, seed=7)


# --- write_prefix against Megatron-Core's IndexedDatasetBuilder ---------------------------


def test_dtype_table_matches_megatron() -> None:
    assert MEGATRON_DTYPE_CODES == {member.name: member.value for member in DType}


@pytest.mark.parametrize("dtype_name", sorted(MEGATRON_DTYPE_CODES))
def test_add_item_bytes_match_megatron(tmp_path: Path, dtype_name: str) -> None:
    dtype = getattr(np, dtype_name)
    high = 100 if dtype_name == "int8" else (70000 if dtype_name in ("int32", "int64") else 250)
    sequences = random_sequences(3, 25, high)

    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=dtype)
    for sequence in sequences:
        builder.add_item(torch.from_numpy(sequence))
        builder.end_document()
    builder.finalize(str(tmp_path / "megatron.idx"))
    write_prefix(tmp_path / "ours", sequences, dtype=dtype)

    assert read_bytes(tmp_path / "ours") == read_bytes(tmp_path / "megatron")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_add_document_bytes_match_megatron(tmp_path: Path, dtype: type) -> None:
    sequences = random_sequences(5, 30, 65000 if dtype is np.uint16 else 200000)
    sizes = [3, 1, 4, 0, 2, 5, 1, 0, 9, 5]  # sequences per document, two empty documents
    assert sum(sizes) == len(sequences)

    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=dtype)
    start = 0
    for size in sizes:
        document = sequences[start : start + size]
        tokens = np.concatenate(document) if document else np.empty(0, dtype=np.int64)
        builder.add_document(torch.from_numpy(tokens), [len(s) for s in document])
        start += size
    builder.finalize(str(tmp_path / "megatron.idx"))
    write_prefix(tmp_path / "ours", sequences, dtype=dtype, document_indices=np.cumsum([0, *sizes]))

    assert read_bytes(tmp_path / "ours") == read_bytes(tmp_path / "megatron")


def test_multimodal_bytes_match_megatron(tmp_path: Path) -> None:
    sequences = random_sequences(11, 20, 50000)
    modes = np.random.default_rng(11).integers(0, 3, size=len(sequences))

    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), np.uint16, multimodal=True)
    for i, (sequence, mode) in enumerate(zip(sequences, modes, strict=True)):
        builder.add_item(torch.from_numpy(sequence), int(mode))
        if i % 3 == 2:  # documents of three sequences, then one of two
            builder.end_document()
    builder.end_document()
    builder.finalize(str(tmp_path / "megatron.idx"))
    documents = [*range(0, len(sequences), 3), len(sequences)]
    write_prefix(tmp_path / "ours", sequences, document_indices=documents, modes=modes.tolist())

    assert read_bytes(tmp_path / "ours") == read_bytes(tmp_path / "megatron")


def test_empty_dataset_matches_megatron(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=np.int32)
    builder.finalize(str(tmp_path / "megatron.idx"))
    write_prefix(tmp_path / "ours", [], dtype=np.int32)

    assert read_bytes(tmp_path / "ours") == read_bytes(tmp_path / "megatron")


def test_creates_parents_and_keeps_dots_in_prefix(tmp_path: Path) -> None:
    prefix = tmp_path / "a" / "b" / "wiki.en.part-1"
    write_prefix(prefix, [np.arange(5)])

    assert sorted(p.name for p in prefix.parent.iterdir()) == [
        "wiki.en.part-1.bin",
        "wiki.en.part-1.idx",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequences": [np.array([70000])]}, "does not fit dtype uint16"),
        ({"sequences": [np.array([-1])]}, "does not fit dtype uint16"),
        ({"sequences": [np.arange(3)], "dtype": np.uint32}, "has no Megatron code"),
        ({"sequences": [np.ones((2, 2), dtype=int)]}, "1-D"),
        ({"sequences": [np.arange(3)], "document_indices": [1, 1]}, "start at 0"),
        ({"sequences": [np.arange(3)] * 2, "document_indices": [0, 1]}, "end at"),
        ({"sequences": [np.arange(3)] * 2, "document_indices": [0, 2, 1, 2]}, "decrease"),
        ({"sequences": [np.arange(3)], "document_indices": []}, "non-empty"),
        ({"sequences": [np.arange(3)], "modes": [0, 1]}, "modes has shape"),
        ({"sequences": [np.arange(3)], "modes": [300]}, "does not fit dtype int8"),
    ],
)
def test_write_prefix_refuses_bad_input(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_prefix(tmp_path / "bad", **kwargs)
    assert not list(tmp_path.iterdir())


# --- make_blend, read back by Megatron-Core -------------------------------------------------


def test_megatron_reads_every_demo_source(demo: DemoBlend) -> None:
    assert len(demo.prefixes) == len(set(demo.prefixes)) == 300
    multimodal = set(demo.multimodal)
    dtypes, modes_seen, zero_lengths, single, empty_documents, wide = set(), set(), 0, 0, 0, 0

    for prefix in demo.prefixes:
        dataset = IndexedDataset(prefix, multimodal=prefix in multimodal)
        lengths = dataset.sequence_lengths
        documents = dataset.document_indices
        dtype = np.dtype(dataset.index.dtype)
        bin_size = os.path.getsize(f"{prefix}.bin")
        idx_size = os.path.getsize(f"{prefix}.idx")

        # The index is exactly the arrays Megatron reads, and describes the whole .bin.
        extra = len(lengths) if prefix in multimodal else 0
        assert idx_size == HEADER_BYTES + 12 * len(lengths) + 8 * len(documents) + extra
        assert int(lengths.sum()) * dtype.itemsize == bin_size > 0
        assert documents[0] == 0 and documents[-1] == len(lengths)
        assert np.all(np.diff(documents) >= 0)

        tokens = np.fromfile(f"{prefix}.bin", dtype=dtype)
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        for i in {0, len(lengths) // 2, len(lengths) - 1}:
            item = dataset[i]
            if prefix in multimodal:
                item, mode = item
                modes_seen.add(int(mode))
            assert np.array_equal(item, tokens[bounds[i] : bounds[i + 1]])
        if prefix in multimodal:
            assert set(np.unique(dataset.index.sequence_modes).tolist()) <= {0, 1}

        dtypes.add(dtype)
        zero_lengths += int(np.sum(lengths == 0))
        single += len(lengths) == 1
        empty_documents += int(np.sum(np.diff(documents) == 0))
        wide += dtype == np.int32 and int(tokens.max()) > 65535
        del dataset

    assert dtypes == {np.dtype(np.uint16), np.dtype(np.int32)}
    assert len(multimodal) == 6 and modes_seen == {0, 1}
    assert zero_lengths >= 2 and single >= 1 and empty_documents >= 1 and wide >= 10


def test_demo_layout_and_multi_sequence_documents(demo: DemoBlend) -> None:
    relative = [os.path.relpath(p, demo.root) for p in demo.prefixes]
    assert any(r.startswith("data/web/cc-") for r in relative)
    assert any(r.startswith("data/code/py/") for r in relative)
    assert all(os.path.relpath(p, demo.root).startswith("data/mm/") for p in demo.multimodal)
    assert any("." in Path(p).name for p in demo.prefixes)
    multi = 0
    for prefix in demo.prefixes[:40]:
        # Keep the dataset alive while using its arrays: Megatron unmaps them in __del__.
        dataset = IndexedDataset(prefix, multimodal=prefix in demo.multimodal)
        multi += int(np.any(np.diff(dataset.document_indices) > 1))
        del dataset
    assert multi >= 5
    total = sum(p.stat().st_size for p in demo.root.rglob("*") if p.is_file())
    assert 1_000_000 < total < 10_000_000


def test_plain_option_is_one_dtype_without_modes(tmp_path: Path) -> None:
    blend = make_blend(tmp_path, 20, dtypes=(np.uint16,), multimodal_fraction=0.0)
    assert blend.multimodal == ()
    for prefix in blend.prefixes:
        idx = Path(f"{prefix}.idx").read_bytes()
        assert idx[17] == MEGATRON_DTYPE_CODES["uint16"]
        dataset = IndexedDataset(prefix)
        assert len(idx) == HEADER_BYTES + 12 * len(dataset) + 8 * len(dataset.document_indices)


# --- blend files ----------------------------------------------------------------------------


def test_blend_files_parse(demo: DemoBlend) -> None:
    weights = list(demo.weights)
    assert all(w > 0 for w in weights)

    flat = json.loads(demo.flat_json.read_text())
    assert len(flat) == 2 * len(demo.prefixes)
    assert flat[0::2] == weights
    raw = flat[1::2]
    assert any(os.path.isabs(p) for p in raw) and not all(os.path.isabs(p) for p in raw)
    assert [os.path.join(demo.root, p) for p in raw] == list(demo.prefixes)
    assert get_blend_from_list(flat) == (raw, weights)

    text = demo.data_args_txt.read_text().split()
    assert get_blend_from_list(text) == (list(demo.prefixes), weights)

    per_split = json.loads(demo.per_split_json.read_text())
    assert sorted(per_split) == ["test", "train", "valid"]
    splits = {}
    for name, items in per_split.items():
        prefixes, split_weights = get_blend_from_list(items)
        assert all(
            demo.weights[demo.prefixes.index(p)] == w
            for p, w in zip(prefixes, split_weights, strict=True)
        )
        splits[name] = set(prefixes)
    assert splits["valid"] & splits["train"] and splits["test"] & splits["valid"]
    assert splits["test"] - splits["train"]
    assert set().union(*splits.values()) == set(demo.prefixes)


def test_same_seed_same_files(tmp_path: Path) -> None:
    first = make_blend(tmp_path / "one", 25, seed=3)
    second = make_blend(tmp_path / "two", 25, seed=3)
    other = make_blend(tmp_path / "three", 25, seed=4)

    def snapshot(blend: DemoBlend) -> dict[str, bytes]:
        return {
            str(p.relative_to(blend.root)): p.read_bytes().replace(str(blend.root).encode(), b"@")
            for p in sorted(blend.root.rglob("*"))
            if p.is_file()
        }

    assert snapshot(first) == snapshot(second)
    assert snapshot(first) != snapshot(other)
    assert first.weights == second.weights


# --- command line ---------------------------------------------------------------------------


def test_cli_writes_demo_and_prints_flat_blend(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "repack.synth", str(out), "--sources", "5", "--seed", "1"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr
    flat_json = Path(result.stdout.strip())
    assert flat_json == out / "blend.json"
    assert len(json.loads(flat_json.read_text())) == 10


def test_cli_refuses_non_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "keep.txt").write_text("x")
    assert main([str(tmp_path), "--sources", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "not an empty folder" in captured.err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]

    assert main([str(tmp_path / "keep.txt")]) == 2


def test_synth_imports_neither_torch_nor_megatron() -> None:
    code = "import sys, repack.synth; print(sorted({'torch', 'megatron'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert result.stdout.strip() == "[]"
