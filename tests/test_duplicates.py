"""``repack doctor`` finds duplicate data: from a repack's fingerprints (no token read) and,
with ``--duplicates``, from a plain blend's tokens; both give the same report.

The blend made here holds, next to two ordinary sources ``a`` and ``b``:

* ``copy``: a byte-identical copy of ``a`` under another path (``identical-sources``);
* ``eight``: 40 documents, each present 8 times (``repeated-documents``; 280 of its 320
  documents are repeats, and a document of it drawn for e epochs is seen 8e times);
* ``half``: 60 documents of which 30 are documents of ``b`` (``shared-documents``);
* ``held``, the valid split of the per-split blend: 25 documents of which 5 are in ``a``
  (``split-overlap``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.doctor.duplicates import _RECORD
from repack.merge import merge

CODES = {"identical-sources", "repeated-documents", "shared-documents", "split-overlap"}


def documents(rng: np.random.Generator, count: int, lengths=(32, 90)) -> list[np.ndarray]:
    """``count`` random documents (none alike), of at least DEFAULT_MIN_TOKENS tokens by
    default: each counts for repeated-documents and shared-documents."""
    return [rng.integers(0, 50000, rng.integers(*lengths)) for _ in range(count)]


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from repack.synth import write_prefix

    root = tmp_path_factory.mktemp("dups")
    rng = np.random.default_rng(20)
    a, b = documents(rng, 50), documents(rng, 70)
    unique8 = documents(rng, 40)
    eight = [unique8[k] for k in rng.permutation(np.repeat(np.arange(40), 8))]
    half = [b[k] for k in rng.choice(70, 30, replace=False)] + documents(rng, 30)
    held = [a[k] for k in (1, 7, 11, 20, 42)] + documents(rng, 20)
    for name, docs in (("a", a), ("b", b), ("eight", eight), ("half", half), ("held", held)):
        write_prefix(root / "data" / name, docs, dtype=np.uint16)
    (root / "copies").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(root / "data" / f"a{ext}", root / "copies" / f"a{ext}")
    train = ["data/a", "data/b", "copies/a", "data/eight", "data/half"]
    per_split = {
        "train": [x for p in train for x in (1.0, p)],
        "valid": [1.0, "data/held"],
        "test": None,
    }
    (root / "per_split.json").write_text(json.dumps(per_split))
    (root / "flat.json").write_text(json.dumps([x for p in train for x in (1.0, p)]))
    for name in ("per_split", "flat"):
        merge(root / f"{name}.json", root / f"{name}-repack", shard_size=1 << 16)
    return {
        "per_split": root / "per_split.json",
        "flat": root / "flat.json",
        "per_split_repack": root / "per_split-repack",
        "flat_repack": root / "flat-repack",
    }


def doctor_json(target: Path, *options: str) -> dict:
    args = ["doctor", "-q", "--json", str(target), "--seq-length", "16", *options]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def found(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for problem in report["problems"]:
        if problem["code"] in CODES:
            out.setdefault(problem["code"], []).append(problem)
    return out


def by_source(report: dict) -> dict[str, dict]:
    return {row["prefix"]: row["duplicates"] for row in report["sources"]}


def check_per_split(report: dict) -> None:
    problems = found(report)
    assert set(problems) == CODES, report["problems"]
    [identical] = problems["identical-sources"]
    assert identical["source"] == "copies/a" and "data/a" in identical["message"]
    tokens = {r["prefix"]: r["tokens"] for r in report["sources"]}
    rows = by_source(report)
    [repeated] = problems["repeated-documents"]
    assert repeated["source"] == "data/eight"
    repeats = rows["data/eight"]["repeated_tokens"]  # shares are by tokens
    assert repeats == round(7 / 8 * tokens["data/eight"])
    assert repeated["message"].startswith(
        f"data/eight: {repeats:,} of its {tokens['data/eight']:,} tokens (87.5%) are repeats: "
        "280 of its 320 documents of 32+ tokens repeat another"
    )
    assert "there 8 times" in repeated["message"]
    [shared] = problems["shared-documents"]
    assert shared["source"] == "data/half"
    copied = rows["data/half"]["shared_tokens"]
    assert f"data/half: {copied:,} of its {tokens['data/half']:,} tokens (" in shared["message"]
    assert "in 30 of its 60 documents of 32+ tokens that are also in data/b" in shared["message"]
    [overlap] = problems["split-overlap"]
    assert (overlap["source"], overlap["split"]) == ("data/held", "valid")
    assert "5 of its 25 valid documents" in overlap["message"]
    assert "data/a" in overlap["message"]
    assert rows["data/eight"]["repeated_documents"] == 280
    assert rows["data/eight"]["max_copies"] == 8
    assert rows["copies/a"]["identical_to"] == "data/a"
    assert rows["data/half"]["shared_documents"] == 30
    assert rows["data/held"]["split_overlap"]["valid"]["documents"] == 5
    assert rows["data/b"]["repeated_documents"] == 0 and rows["data/b"]["max_copies"] == 1
    # the effective repetition: a document of `eight` is seen 8 times its epochs
    epochs = next(r for r in report["sources"] if r["prefix"] == "data/eight")["splits"]
    drawn = epochs["train"]["epochs"]
    assert rows["data/eight"]["effective_epochs"]["train"] == pytest.approx(8 * drawn)
    repetition = [
        p for p in report["problems"] if p["code"] == "repetition" and p["source"] == "data/eight"
    ]
    assert len(repetition) == 1 and "most-seen document is seen" in repetition[0]["message"]
    # unique tokens: `copy` adds none, `eight` adds an eighth of its tokens, `half` a half
    summary = report["duplicates"]
    assert summary["available"]
    assert summary["thresholds"]["min_duplicate_tokens"] == 32
    unique = summary["splits"]["train"]["unique_tokens"]
    drawn_tokens = summary["splits"]["train"]["tokens"]
    assert drawn_tokens == sum(tokens[p] for p in tokens if p != "data/held")
    assert unique < drawn_tokens - tokens["copies/a"]


SAMPLES = ["--samples", "20000,200,0"]


def test_doctor_on_a_repack_names_each_duplicate(blend) -> None:
    report = doctor_json(blend["per_split_repack"], *SAMPLES)
    assert report["duplicates"]["origin"] == "fingerprints"
    check_per_split(report)


def test_doctor_on_the_plain_blend_with_duplicates_says_the_same(blend) -> None:
    from_repack = doctor_json(blend["per_split_repack"], *SAMPLES)
    from_tokens = doctor_json(blend["per_split"], "--duplicates", *SAMPLES)
    assert from_tokens["duplicates"]["origin"] == "tokens"
    check_per_split(from_tokens)
    same = ("problems", "sources")
    for member in same:
        assert from_tokens[member] == from_repack[member], member
    a, b = dict(from_tokens["duplicates"]), dict(from_repack["duplicates"])
    assert a.pop("origin") == "tokens" and b.pop("origin") == "fingerprints"
    assert a == b


def test_partitioned_analysis_gives_the_same_report(blend) -> None:
    whole = doctor_json(blend["per_split_repack"], *SAMPLES)
    # 256 bytes: the records in temporary files, 32 partitions, and the repeated documents
    # of a partition grouped two at a time
    parts = doctor_json(blend["per_split_repack"], "--duplicates-memory", "256", *SAMPLES)
    assert parts["duplicates"]["partitions"] > 8  # premise: really partitioned
    assert whole["duplicates"]["partitions"] == 1
    for report in (whole, parts):
        del report["duplicates"]["partitions"]
    assert parts == whole


def test_split_slices_overlap_when_a_source_repeats(blend) -> None:
    # --split 90,10,0: `eight`'s valid slice holds documents of its train slice; `b`'s valid
    # slice (its last 7 documents) holds some of the 30 that `half` copied, in half's train
    # slice; `a` and its copy have the same valid slice, which neither trains on
    report = doctor_json(blend["flat_repack"], "--split", "90,10,0", "--samples", "2000,100,0")
    overlaps = {p["source"]: p for p in found(report)["split-overlap"]}
    assert set(overlaps) == {"data/b", "data/eight"}, report["problems"]
    assert all(p["split"] == "valid" for p in overlaps.values())
    assert "(e.g. in data/half)" in overlaps["data/b"]["message"]
    rows = by_source(report)
    assert rows["data/a"]["split_overlap"] == rows["copies/a"]["split_overlap"] == {}
    assert rows["data/half"]["split_overlap"] == {}
    # the blend's own split: `eight` holds 320 documents, 32 in valid, each also in train
    # unless all 8 copies fell in valid (none of the 40 here)
    assert rows["data/eight"]["split_overlap"]["valid"]["documents"] == 32
    same = doctor_json(
        blend["flat"], "--duplicates", "--split", "90,10,0", "--samples", "2000,100,0"
    )
    assert same["problems"] == report["problems"]


def test_thresholds_are_options(blend) -> None:
    report = doctor_json(
        blend["per_split_repack"],
        "--max-repeated-share",
        "0.9",
        "--max-shared-share",
        "0.6",
        "--max-split-overlap",
        "0.5",
        *SAMPLES,
    )
    assert set(found(report)) == {"identical-sources"}
    text = CliRunner().invoke(
        main, ["doctor", "-q", str(blend["per_split_repack"]), "--seq-length", "16", *SAMPLES]
    )
    assert "WARNING [identical-sources] copies/a: a byte-identical copy of data/a" in text.stdout
    assert "Duplicates (exact, from fingerprints): 280 of" in text.stdout


def test_a_blend_without_duplicates_asks_for_them(blend) -> None:
    report = doctor_json(blend["per_split"], *SAMPLES)
    assert report["duplicates"]["available"] is False
    assert "--duplicates" in report["duplicates"]["reason"]
    assert not found(report)


def test_a_repack_without_fingerprints_says_so_and_reads_tokens_if_asked(
    blend, tmp_path: Path
) -> None:
    out = tmp_path / "old"
    merge(blend["per_split"], out, fingerprints=False)
    report = doctor_json(out, *SAMPLES)
    assert report["duplicates"]["available"] is False
    assert report["duplicates"]["reason"].startswith("no fingerprints")
    assert not found(report)
    read = doctor_json(out, "--duplicates", *SAMPLES)
    assert read["duplicates"]["origin"] == "tokens"
    check_per_split(read)


def test_an_ordinary_blend_has_no_duplicates(demo_blend, demo_repack: Path) -> None:
    # the demo generator draws every document at random: no two are alike (its empty
    # document is left out, as every empty document is)
    report = doctor_json(demo_repack, "--split", "90,10,0", "--samples", "20000,200,0")
    assert report["duplicates"]["available"]
    assert report["duplicates"]["repeated_documents"] == 0
    assert report["duplicates"]["source_pairs_sharing"] == 0
    assert not found(report), found(report)
    assert any(row["duplicates"]["empty_documents"] for row in report["sources"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_generated_blends_have_no_duplicate_problem(tmp_path: Path, seed: int) -> None:
    from repack.synth import make_blend

    blend = make_blend(tmp_path, 150, seed=seed)
    report = doctor_json(blend.flat_json, "--duplicates", "--samples", "20000,200,0")
    assert report["duplicates"]["available"]
    assert not found(report), found(report)


def test_tiny_documents_alike_by_chance_are_no_problem_real_copies_are(tmp_path: Path) -> None:
    """Sources of random documents that share a one-token document by chance (as generated
    blends of 3,000 sources do: 1 of a source's 10 documents is 10 %), or repeat a two-token
    one, are clean (in their train slices: split-overlap is not about them); documents copied
    from one source into another are named, and documents shorter than
    --min-duplicate-tokens only when it is lowered."""
    from repack.synth import write_prefix

    rng = np.random.default_rng(3)
    long = (60, 300)
    tiny, pair = np.array([7]), np.array([9, 11])
    real = documents(rng, 40, long)
    short = documents(rng, 30, (20, 24))  # each 20-23 tokens: under the default of 32
    sources = {
        "few": [tiny, *documents(rng, 10, long)],
        "more": [tiny, pair, *documents(rng, 30, long)],
        "again": [pair] * 3 + documents(rng, 20, long),
        "real": real,
        "copied": real[:10] + documents(rng, 30, long),
        "short": short + documents(rng, 5, long),
        "short-copied": short[:15] + documents(rng, 5, long),
    }
    for name, docs in sources.items():
        write_prefix(tmp_path / name, docs, dtype=np.uint16)
    (tmp_path / "blend.json").write_text(json.dumps([x for n in sources for x in (1.0, n)]))
    options = ("--duplicates", "--samples", "20000,200,0")
    report = doctor_json(tmp_path / "blend.json", *options)
    assert report["duplicates"]["source_pairs_sharing"] == 4  # premise: all four are seen
    assert report["duplicates"]["repeated_documents"] == 2
    problems = found(report)
    assert set(problems) == {"shared-documents"}, problems
    assert [(p["source"], "real" in p["message"]) for p in problems["shared-documents"]] == [
        ("copied", True)
    ]
    lowered = found(doctor_json(tmp_path / "blend.json", "--min-duplicate-tokens", "16", *options))
    assert sorted(p["source"] for p in lowered["shared-documents"]) == ["copied", "short-copied"]
    # down to one token, the chance ones count, but by tokens they are too few to matter
    one = found(doctor_json(tmp_path / "blend.json", "--min-duplicate-tokens", "1", *options))
    assert set(one) == {"shared-documents"}
    assert sorted(p["source"] for p in one["shared-documents"]) == ["copied", "short-copied"]
    every = found(
        doctor_json(
            tmp_path / "blend.json",
            *(
                "--min-duplicate-tokens",
                "1",
                "--max-shared-share",
                "0",
                "--max-repeated-share",
                "0",
            ),
            *options,
        )
    )
    # premise: the chance pairs are there, each named by the source with the larger share
    named = {
        (p["source"], p["message"].split(" also in ")[1].split(" (")[0])
        for p in every["shared-documents"]
    }
    assert {("few", "more"), ("again", "more")} <= named, named
    assert [p["source"] for p in every["repeated-documents"]] == ["again"]


def test_the_command_line_default_is_the_librarys() -> None:
    from repack.cli.diagnosis import doctor
    from repack.doctor.repeats import DEFAULT_MIN_TOKENS

    [option] = [p for p in doctor.params if p.name == "min_duplicate_tokens"]
    assert option.default == DEFAULT_MIN_TOKENS


@pytest.mark.parametrize("stored", [False, True])
@pytest.mark.parametrize(
    ("memory", "in_files", "partitioned"),
    [(1 << 30, False, False), (6000, True, False), (64, True, True)],
)
def test_the_analysis_counts_as_grouping_every_document(
    memory: int, in_files: bool, partitioned: bool, stored: bool
) -> None:
    """Analysis tells documents found once from the others by 32 bits of their fingerprints
    and counts the former from per-source figures: its figures are those of grouping every
    document, in memory, in temporary files and partitioned (fingerprints drawn from a small
    pool whose values share their high bits: 32-bit collisions abound, as do copies); and
    the same when the fingerprints are slices of one array (a repack's mapped file), read
    again from it for the sources without empty documents."""
    from repack.doctor.duplicates import _DTYPE_SALT, Analysis, Options
    from repack.doctor.repeats import SPLIT_BITS, SourceMeta
    from repack.doctor.repeats import Accumulator as _Accumulator
    from repack.doctor.repeats import bit_index as _bit_index

    rng = np.random.default_rng(7)
    high = rng.integers(0, 1 << 32, 40, dtype=np.uint64) << np.uint64(32)
    pool = high[rng.integers(0, 40, 300)] | rng.integers(0, 1 << 32, 300, dtype=np.uint64)
    sources, metas = [], []
    for i in range(9):
        count = int(rng.integers(0, 120))
        hashes = pool[rng.integers(0, len(pool), count)]
        tokens = rng.integers(0, 6, count) * (rng.random(count) < 0.9)
        if stored and i >= 5:  # no empty document: read again from the array
            tokens = np.maximum(tokens, 1)
        first = np.concatenate([[0], np.cumsum(rng.integers(1, 3, count))])[:-1].astype(np.int64)
        seqs = int(first[-1]) + 1 if count else 0
        splits = [("train", 0, int(0.8 * seqs), float(rng.random() * 3))]
        if i % 3:
            splits.append(("valid", int(0.6 * seqs), seqs, float(rng.random())))
        if i % 4 == 1:
            splits.append(("test", int(0.3 * seqs), int(0.5 * seqs), 1.0))
        if i == 5:  # two slices of one bit, overlapping (counted once)
            splits.append(("all", int(0.5 * seqs), seqs, 0.5))
        # stored: sources 5 and 6, 7 and 8 follow each other in the array with one dtype
        dtype = 1 + (i >= 7 if stored and i >= 5 else i % 2)
        metas.append(SourceMeta(f"/s{i}", f"s{i}", dtype, tuple(splits)))
        sources.append((hashes, tokens, first))
    total = sum(len(h) for h, _, _ in sources)
    array = None
    if stored:
        array = np.concatenate([np.zeros(3, np.uint64)] + [h for h, _, _ in sources])
        ends = np.cumsum([3] + [len(h) for h, _, _ in sources])
        sources = [(array[a:b], t, f) for a, b, (_, t, f) in zip(ends, ends[1:], sources)]
    # documents of 3+ tokens count for the problems (tokens 0-5 here)
    analysis = Analysis(metas, total, Options(memory=memory, min_tokens=3), stored=array)
    # premise: the path under test is taken
    assert (analysis._folder is not None, analysis.bits > 0) == (in_files, partitioned)
    for i, documents in enumerate(sources):
        analysis.add(i, *documents)
    if stored:  # premise: some are read again from the array, in runs of several sources
        again = [run for run in analysis._runs if run[3] is not None]
        assert 0 < len(again) < 4
    reference = _Accumulator(len(metas), 3)
    reference.epochs = analysis.epochs
    chunks = []
    for i, (meta, (hashes, tokens, first)) in enumerate(zip(metas, sources)):
        mask = np.zeros(len(hashes), np.uint8)
        for split, begin, end, _ in meta.splits:
            mask[(first >= begin) & (first < end)] |= SPLIT_BITS[split]
        keep = tokens > 0
        records = np.zeros(int(keep.sum()), _RECORD)
        records["key"] = hashes[keep] ^ np.uint64(meta.dtype_code * _DTYPE_SALT % (1 << 64))
        records["tokens"], records["source"], records["mask"] = tokens[keep], i, mask[keep]
        chunks.append(records)
    reference._groups(np.concatenate(chunks))
    result = analysis.finish(lambda i: sources[i][1:])
    assert result.records == sum(len(c) for c in chunks)
    for name in ("repeated_documents", "repeated_tokens", "max_copies", "shared_documents",
                 "shared_tokens", "long_repeated_documents", "long_repeated_tokens",
                 "long_max_copies"):  # fmt: skip
        assert np.array_equal(getattr(result, name), getattr(reference, name)), name
    assert result.repeated_documents.sum() > 50 and result.shared_documents.sum() > 50
    # premise: some repeats are short, some long
    assert 0 < result.long_repeated_documents.sum() < result.repeated_documents.sum()
    assert np.array_equal(result.long_documents, [int((t >= 3).sum()) for _, t, _ in sources])
    for split, values in result.effective.items():
        assert np.allclose(values, reference.effective[_bit_index(split)])
    assert np.array_equal(result.overlap["valid"], reference.overlap[1])
    assert np.array_equal(result.overlap["test"], reference.overlap[2])
    assert result.overlap["valid"][:, 0].sum() > 0
    assert result.pairs == reference.pairs
    assert result.unique_tokens == reference.unique_tokens
    assert result.overlap_partner == reference.partner()


def test_an_analysis_given_up_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    import os
    import tempfile

    from repack.doctor.duplicates import Analysis, Options
    from repack.doctor.repeats import SourceMeta

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    meta = SourceMeta("/s", "s", 8, (("train", 0, 10, 1.0),))
    analysis = Analysis([meta], 10, Options(memory=64))
    analysis.add(0, np.arange(10, dtype=np.uint64), np.ones(10, np.int64), np.arange(10))
    assert os.listdir(tmp_path)  # premise: its file is there
    analysis.close()
    assert not os.listdir(tmp_path)


def test_reading_the_tokens_checks_the_index_is_the_one_loaded(blend, tmp_path: Path) -> None:
    # --duplicates reads a plain blend's document indices alone, after the load checked the
    # whole .idx: a file changed since is an error, not wrong figures
    from repack.doctor.documents import _document_indices
    from repack.errors import SourceError
    from repack.inputs.facts import load

    root = tmp_path / "copy"
    shutil.copytree(blend["flat"].parent / "data", root / "data")
    (root / "flat.json").write_text(json.dumps([1.0, "data/a", 1.0, "data/b"]))
    loaded = load(root / "flat.json")
    a, b = (s for s in loaded.sources.values())
    assert _document_indices(a).tolist() == list(range(51))  # one sequence per document
    with open(b.key + ".idx", "ab") as stream:
        stream.write(b"\0" * 8)
    with pytest.raises(SourceError, match="changed since the blend was read"):
        _document_indices(b)
