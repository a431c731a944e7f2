"""``repack doctor``: Megatron's arithmetic function by function, the problems it reports, the
command line (exit statuses, JSON, grouping, plots) and repacks as input.

The arithmetic is compared with megatron-core's own functions where they can be called alone;
whole builds are compared in ``test_doctor_megatron.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.doctor import Limits, Settings, doctor
from repack.doctor.core import examine
from repack.errors import InputError, NotCompiled
from repack.format.blend import Blend, BlendEntry
from repack.inputs.facts import Loaded, Source
from repack.inputs.sources import SourceInfo
from repack.merge import merge
from repack.model import arithmetic as mm
from repack.model import blend_draws
from repack.model.splits import Facts
from repack.synth import write_prefix

NO_LIMITS = Limits(None, None, None)


def _megatron():
    pytest.importorskip("megatron.core")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import blended_megatron_dataset_builder as builder
        from megatron.core.datasets import blended_megatron_dataset_config as config
        from megatron.core.datasets import helpers
        from megatron.core.datasets.gpt_dataset import GPTDataset
        from megatron.core.datasets.utils import normalize
    return SimpleNamespace(
        builder=builder,
        config=config,
        helpers=helpers,
        GPTDataset=GPTDataset,
        normalize=normalize,
    )


# --- the arithmetic, against megatron-core's functions -------------------------------------


@pytest.mark.parametrize(
    "split", ["99,1,0", "969, 30, 1", "90,5,5", "1", "80/15/5", "0.7,0.2,0.1", "3,0,1", "949,50,1"]
)
def test_split_parsing_and_matrix_are_megatrons(split: str) -> None:
    m = _megatron()
    vector = m.config.parse_and_normalize_split(split)
    assert mm.parse_split(split) == vector
    assert mm.split_matrix(vector) == m.config.convert_split_vector_to_split_matrix(vector)


@pytest.mark.parametrize("split", ["", "1,2,3,4", "0,0,0", "1..2"])
def test_bad_splits_are_refused(split: str) -> None:
    with pytest.raises(ValueError):
        mm.parse_split(split)


def test_split_bounds_round_half_to_even() -> None:
    # 0.99 * 50 = 49.5 rounds to 50 (Python's round): the valid slice of 50 sequences is empty
    assert mm.split_bounds((0.99, 1.0), 50) == (50, 50)
    assert mm.split_bounds((0.0, 0.99), 4) == (0, 4)


def test_sizes_per_dataset_are_megatrons() -> None:
    m = _megatron()
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = m.normalize(list(rng.uniform(0.001, 3, int(rng.integers(1, 40)))))
        sizes = [int(x) for x in rng.integers(0, 10**7, 3)]
        for surplus in (0.0, 0.005, 0.1):
            expected = m.builder._get_size_per_split_per_dataset(weights, sizes, surplus)
            assert mm.size_per_dataset(weights, sizes, surplus) == expected
        assert mm.normalize(list(weights)) == m.normalize(list(weights))


def test_epochs_are_megatrons() -> None:
    m = _megatron()
    rng = np.random.default_rng(1)
    for _ in range(300):
        tokens = int(rng.integers(1, 10**6))
        samples = int(rng.integers(0, 10**5))
        seq = int(rng.integers(2, 9000))
        extra = bool(rng.integers(0, 2))
        fake = SimpleNamespace(
            num_samples=samples,
            config=SimpleNamespace(sequence_length=seq, add_extra_token_to_sequence=extra),
        )
        expected = m.GPTDataset._get_num_epochs(fake, tokens)  # Megatron's own loop
        assert mm.num_epochs(tokens, samples, seq, extra) == expected
    assert mm.num_epochs(0, 5, 64) is None  # Megatron's loop never ends
    assert mm.num_epochs(0, 0, 64) is None  # even for 0 samples: it asks for 1 extra token
    assert mm.num_epochs(0, 0, 64, add_extra_token=False) == 1
    assert mm.num_epochs(0, None, 64) == 1


def test_built_samples_are_what_build_sample_idx_makes() -> None:
    m = _megatron()
    rng = np.random.default_rng(2)
    for _ in range(200):
        lengths = rng.integers(0, 300, int(rng.integers(1, 30))).astype(np.int32)
        lengths[0] = max(lengths[0], 2)
        tokens = int(lengths.sum())
        seq = int(rng.integers(2, 200))
        epochs = int(rng.integers(1, 4))
        drop = bool(rng.integers(0, 2))
        extra = bool(rng.integers(0, 2))
        documents = np.tile(np.arange(len(lengths), dtype=np.int32), epochs)
        index = m.helpers.build_sample_idx(lengths, documents, seq, epochs, tokens, drop, extra)
        assert mm.built_samples(epochs, tokens, seq, drop, extra) == len(index) - 1
        dtype = mm.sample_index_dtype(len(documents), int(lengths.max()))
        assert str(index.dtype) == dtype


def test_index_dtypes_switch_where_megatron_does() -> None:
    assert mm.sample_index_dtype(2**31 - 1, 10) == "int32"
    assert mm.sample_index_dtype(2**31, 10) == "int64"
    assert mm.shuffle_index_dtype(2**32 - 3) == "uint32"
    assert mm.shuffle_index_dtype(2**32 - 2) == "int64"


def test_training_samples_are_megatron_lms() -> None:
    # get_train_valid_test_num_samples: (train_iters // eval_interval + 1) * eval_iters * gbs
    assert mm.training_samples(global_batch_size=512, train_iters=100_000) == (
        51_200_000,
        (100 + 1) * 100 * 512,
        100 * 512,
    )
    # --train-samples: train_iters = train_samples // global_batch_size
    assert mm.training_samples(
        global_batch_size=256, train_samples=1_000_000, eval_iters=10, eval_interval=500
    ) == (1_000_000, (3906 // 500 + 1) * 10 * 256, 10 * 256)
    assert mm.training_samples(
        global_batch_size=8,
        train_iters=1000,
        eval_iters=5,
        eval_interval=100,
        start_eval_at_iter=300,
    ) == (8000, (11 - 3) * 5 * 8, 40)
    assert mm.training_samples(global_batch_size=8, train_iters=10, eval_iters=0) == (80, 0, 0)
    with pytest.raises(ValueError):
        mm.training_samples(global_batch_size=8)


# --- problems, from crafted inputs ---------------------------------------------------------


def _loaded(count: int, lengths: np.ndarray, weights=1.0) -> Loaded:
    """A blend of ``count`` sources with the same lengths, without files; ``weights`` one for
    all, or one each."""
    facts = Facts.from_lengths(lengths)
    info = SourceInfo("x", 8, len(lengths), len(lengths) + 1, False, 0, 0, int(lengths.sum()))
    entries, sources = [], {}
    each = list(weights) if isinstance(weights, (list, tuple)) else [weights] * count
    for i in range(count):
        key = f"/d/src-{i}"
        entries.append(BlendEntry(f"d/src-{i}", each[i], key))
        sources[key] = Source(key, f"d/src-{i}", info, facts, None, (1, i))
    return Loaded(Blend("b.json", "data-path", {"all": tuple(entries)}), sources, None, 1)


def test_more_datasets_than_the_int16_blend_index() -> None:
    lengths = np.full(300, 100, dtype=np.int32)
    settings = Settings(64, (1000, 0, 0), "1")
    report = examine(_loaded(32_767, lengths), settings, target="b.json", limits=NO_LIMITS)
    codes = {p.code for p in report.problems if p.level == "error"}
    assert codes == {"too-many-datasets"}
    [found] = [p for p in report.problems if p.code == "too-many-datasets"]
    assert found.message.startswith("split train blends 32,767 datasets: Megatron's Blended")
    assert "python -O" in found.message and "\n" not in found.message
    ok = examine(_loaded(32_766, lengths), settings, target="b.json", limits=NO_LIMITS)
    assert ok.ok


def test_epochs_past_int32() -> None:
    lengths = np.array([2], dtype=np.int32)
    report = examine(
        _loaded(1, lengths), Settings(8, (10**9, 0, 0), "1"), target="b", limits=NO_LIMITS
    )
    assert [p.code for p in report.problems if p.level == "error"] == ["int32-overflow"]


def test_document_index_past_int32_is_a_warning() -> None:
    lengths = np.ones(1000, dtype=np.int32) * 2
    report = examine(
        _loaded(1, lengths), Settings(2, (3 * 10**9, 0, 0), "1"), target="b", limits=NO_LIMITS
    )
    assert report.ok
    assert "int64-index" in {p.code for p in report.problems}


def test_limits_of_the_machine_and_the_file_system() -> None:
    lengths = np.full(50, 100, dtype=np.int32)
    loaded = _loaded(100, lengths)
    settings = Settings(64, (1000, 10, 10), "90,5,5", release=(0, 16))
    report = examine(loaded, settings, target="b", limits=Limits(500, 500, 100_000, 800))
    stock = report.resources["stock"]["per_process"]
    assert stock == {"mmaps": 2 * 100 + 3 * 300 + 6, "fds": 3 * 100 + 3 * 300 + 6}
    assert {p.code for p in report.problems if p.level == "error"} == {"open-files", "mmap-limit"}
    assert report.resources["repack"]["per_process"] == {"mmaps": 1 + 1 + 1 + 6, "fds": 9}


def test_host_memory_of_the_cached_masks() -> None:
    """Per reading process, each split's loader keeps one set of masks per source it draws from
    (stock) or one set (repacked); a node holds ranks x workers of them per loader."""
    from repack.doctor import memory

    lengths = np.full(50, 100, dtype=np.int32)
    settings = Settings(1024, (1000, 10, 10), "90,5,5", release=(0, 16))
    node = 64 << 30
    report = examine(
        _loaded(100, lengths), settings, target="b", ranks_per_node=8, workers=2,
        limits=Limits(None, None, None, None, node),
    )  # fmt: skip
    m = report.resources["memory"]
    per_source = memory.mask_bytes_per_source(1024, True, True)
    assert per_source == int(2.75 * 1024**2) + 12 * 1024 + memory.TENSOR_OBJECTS
    assert [(s["split"], s["sources"]) for s in m["splits"]] == [
        ("train", 100), ("valid", 100), ("test", 100),
    ]  # fmt: skip
    assert m["splits"][0]["stock_per_worker"] == 100 * per_source
    # one set, and the loss mask the datasets share (0.15 and later)
    assert m["splits"][0]["repack_per_worker"] == 1024**2 + 16 * 1024
    assert m["readers_per_node"] == 16
    assert m["stock"]["per_node"] == 16 * 3 * 100 * per_source  # 13.5 GiB: below 64 GiB
    assert m["repack"]["per_node"] == 16 * 3 * (1024**2 + 16 * 1024)
    assert "host-memory" not in {p.code for p in report.problems}

    # at 4,096 tokens the mask is 16 MiB per source: 8 ranks x 2 workers x 3 loaders pass it
    report = examine(
        _loaded(100, lengths), Settings(4096, (1000, 10, 10), "90,5,5"), target="b",
        limits=Limits(None, None, None, None, node),
    )  # fmt: skip
    found = [p for p in report.problems if p.code == "host-memory"]
    assert len(found) == 1 and found[0].level == "warning" and report.ok
    assert "--no-create-attention-mask-in-dataloader" in found[0].message
    assert "train from a repack" in found[0].message
    assert "more than its 64.0 GiB" in found[0].message
    # without attention masks: 12 bytes a token per source, far below
    quiet = Settings(4096, (1000, 10, 10), "90,5,5", create_attention_mask=False)
    report = examine(
        _loaded(100, lengths), quiet, target="b", limits=Limits(None, None, None, None, node)
    )
    assert "host-memory" not in {p.code for p in report.problems}
    assert report.resources["memory"]["stock"]["per_source"] == 12 * 4096 + memory.TENSOR_OBJECTS
    # unknown node memory: figures, no check
    report = examine(_loaded(100, lengths), Settings(4096, (1000, 10, 10), "90,5,5"),
                     target="b", limits=NO_LIMITS)  # fmt: skip
    assert "host-memory" not in {p.code for p in report.problems}
    assert report.resources["memory"]["node_memory"] is None


def test_host_memory_without_workers_and_splits_asked_nothing() -> None:
    """Without DataLoader workers the ranks read; a split asked no samples has no loader."""
    lengths = np.full(50, 100, dtype=np.int32)
    loaded = _loaded(6, lengths)
    report = examine(loaded, Settings(512, (1000, 10, 0), "100,0,0"), target="b",
                     workers=0, ranks_per_node=4, limits=NO_LIMITS)  # fmt: skip
    m = report.resources["memory"]
    assert m["readers_per_node"] == 4  # without workers the ranks read
    assert [(s["split"], s["sources"]) for s in m["splits"]] == [("train", 6)]


# --- what differs between megatron-core releases (repack.model.release) --------------------


@pytest.mark.parametrize(
    ("release", "bin_fds", "own_loss_mask"),
    [((0, 12), 1, True), ((0, 13), 2, True), ((0, 14), 2, True), ((0, 15), 2, False),
     ((0, 19), 2, False)],
)  # fmt: skip
def test_the_figures_follow_the_release(
    release: tuple[int, int], bin_fds: int, own_loss_mask: bool
) -> None:
    """0.12 keeps no .bin open beside its map (one descriptor fewer per IndexedDataset); up to
    0.14 each repacked dataset keeps its own loss mask (4 S bytes), from 0.15 they share one."""
    lengths = np.full(50, 100, dtype=np.int32)
    settings = Settings(1024, (1000, 10, 10), "90,5,5", release=release)
    report = examine(_loaded(100, lengths), settings, target="b", limits=NO_LIMITS)
    stock = report.resources["stock"]["per_process"]
    assert stock == {"mmaps": 2 * 100 + 3 * 300 + 6, "fds": (1 + bin_fds) * 100 + 3 * 300 + 6}
    m = report.resources["memory"]
    loss_masks = 100 if own_loss_mask else 1
    assert m["splits"][0]["repack_per_worker"] == 1024**2 + 12 * 1024 + loss_masks * 4 * 1024
    assert m["repack"]["per_source"] == (4 * 1024 if own_loss_mask else 0)
    assert report.to_json()["settings"]["megatron_core"] == f"{release[0]}.{release[1]}"


def test_a_surplus_megatron_core_0_12_does_not_have_is_refused() -> None:
    with pytest.raises(InputError, match=r"megatron-core 0\.12 has no such setting"):
        Settings(64, (1, 1, 1), surplus=0.02, release=(0, 12))
    assert Settings(64, (1, 1, 1), release=(0, 12)).surplus == 0.005  # its fixed one
    assert Settings(64, (1, 1, 1), surplus=0.02, release=(0, 13)).surplus == 0.02


def test_the_release_is_read_without_importing_megatron(tmp_path: Path) -> None:
    """The first megatron/core/package_info.py on sys.path is the release (a Megatron-LM
    checkout on PYTHONPATH wins over an installed megatron-core, as on import), read as text:
    a process where importing torch or megatron fails computes with it."""
    core = tmp_path / "checkout" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 12\nPATCH = 3\nraise ImportError\n")
    path = [str(tmp_path / "checkout"), *filter(None, [os.environ.get("PYTHONPATH")])]
    child = subprocess.run(
        [sys.executable, "-c", "import sys\n"
         "sys.modules['torch'] = sys.modules['megatron'] = None  # importing either fails\n"
         "from repack.doctor import Settings\n"
         "from repack.releases import installed_release\n"
         "print(installed_release(), Settings(64, (1, 1, 1)).release)\n"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert child.stdout.split() == ["0.12.3", "(0,", "12)"]


@pytest.fixture
def blend(tmp_path: Path) -> Path:
    rng = np.random.default_rng(4)
    items: list = []
    for i in range(6):
        folder = "web" if i < 4 else "books"
        prefix = tmp_path / "data" / folder / f"src-{i}"
        sequences = [rng.integers(1, 60000, int(rng.integers(20, 200))) for _ in range(100)]
        write_prefix(prefix, sequences, dtype=np.uint16)
        items += [0.5 + i, f"data/{folder}/src-{i}"]
    path = tmp_path / "blend.json"
    path.write_text(json.dumps(items))
    return path


ARGS = ["--seq-length", "128", "--split", "90,5,5", "--train-iters", "50"]
ARGS += ["--global-batch-size", "32", "--eval-iters", "2", "--eval-interval", "10"]


def run(*args: str):
    return CliRunner().invoke(main, ["doctor", "-q", *args])


def test_a_sound_blend_passes(blend: Path) -> None:
    result = run(str(blend), *ARGS)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "train: BlendedDataset of 6 GPTDatasets, 1,603 samples" in out
    assert "samples asked: train 1,600, valid 384, test 64" in out
    assert out.rstrip().splitlines()[-1].startswith("OK: nothing found")
    assert "stock Megatron" in out and "repack (1 shard)" in out  # not "(1 shards)"


def test_json(blend: Path) -> None:
    result = run(str(blend), *ARGS, "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["kind"] == "blend"
    assert [s["split"] for s in data["splits"]] == ["train", "valid", "test"]
    train = data["sources"][0]["splits"]["train"]
    assert set(train) >= {"share", "token_share", "planned", "num_samples", "built", "epochs"}
    # most repeated first (in any split)
    epochs = [max(x["epochs"] for x in s["splits"].values()) for s in data["sources"]]
    assert epochs == sorted(epochs, reverse=True)
    assert sum(s["splits"]["train"]["share"] for s in data["sources"]) == pytest.approx(1.0)


def test_samples_option_and_group_by_folder(blend: Path) -> None:
    result = run(
        str(blend),
        "--seq-length",
        "128",
        "--split",
        "90,5,5",
        "--samples",
        "1600,384,64",
        "--group-by-folder",
    )
    assert result.exit_code == 0
    rows = [word for line in result.stdout.splitlines() for word in line.split()[:1]]
    assert "web" in rows and "books" in rows  # relative to the folder all prefixes share
    grouped = run(str(blend), *ARGS, "--group-by-folder", "--json")
    groups = json.loads(grouped.stdout)["groups"]
    assert sorted((g["folder"], g["sources"]) for g in groups) == [("books", 2), ("web", 4)]
    assert sum(g["splits"]["train"]["share"] for g in groups) == pytest.approx(1.0)
    same = run(str(blend), *ARGS, "--json")
    other = run(
        str(blend), "--seq-length", "128", "--split", "90,5,5", "--samples", "1600,384,64", "--json"
    )
    assert json.loads(same.stdout)["sources"] == json.loads(other.stdout)["sources"]


def test_problems_unreadable_bad_weights_duplicates(blend: Path, tmp_path: Path) -> None:
    items = json.loads(blend.read_text())
    items[0] = 0  # weight 0
    items[2] = "nan"
    items += [1.0, "data/missing"]
    items += [items[4], items[5]]  # src-2 again, with its weight: a duplicate
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(items))
    result = run(str(bad), *ARGS)
    assert result.exit_code == 1
    lines = [x for x in result.stdout.splitlines() if x.startswith(("ERROR", "WARNING"))]
    assert any("[unreadable]" in x and "data/missing.idx" in x for x in lines), lines
    weights = [x for x in lines if "[bad-weight]" in x]
    assert len(weights) == 2 and "data/web/src-0" in weights[0] and "weight 0" in weights[0]
    assert "weight nan" in weights[1]
    assert any("[duplicate]" in x and "data/web/src-2" in x for x in lines)
    assert "train: not computed" in result.stdout


def test_mixed_dtypes_warn_but_pass(blend: Path, tmp_path: Path) -> None:
    write_prefix(
        tmp_path / "data" / "wide", [np.arange(1, 300) * 700 for _ in range(100)], dtype=np.int32
    )
    items = [*json.loads(blend.read_text()), 1.0, "data/wide"]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(items))
    result = run(str(path), *ARGS)
    assert result.exit_code == 0
    assert "WARNING [mixed-dtypes] sources of 2 token dtypes: 6 uint16" in result.stdout


def test_repetition_threshold(blend: Path) -> None:
    many = run(str(blend), "--seq-length", "128", "--samples", "20000,0,0", "--split", "1")
    assert many.exit_code == 0
    assert "[repetition]" in many.stdout
    relaxed = run(
        str(blend),
        "--seq-length",
        "128",
        "--samples",
        "20000,0,0",
        "--split",
        "1",
        "--max-epochs",
        "1000",
    )
    assert "[repetition]" not in relaxed.stdout


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--split", "1,2,3,4"], 2, "numbers"),
        (["--samples", "1,2"], 2, "TRAIN,VALID,TEST"),
        (["--train-iters", "5"], 2, "--global-batch-size"),
    ],
)
def test_usage_errors(blend: Path, args: list[str], status: int, message: str) -> None:
    result = run(str(blend), "--seq-length", "64", *args)
    assert result.exit_code == status
    assert message in result.output


def test_megatron_release_option(blend: Path) -> None:
    def report(*args: str) -> dict:
        result = run(str(blend), *ARGS, "--json", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    old, new = report("--megatron-release", "0.12.3"), report("--megatron-release", "0.16")
    assert (old["settings"]["megatron_core"], new["settings"]["megatron_core"]) == ("0.12", "0.16")
    fds = [r["resources"]["stock"]["per_process"]["fds"] for r in (old, new)]
    assert fds[1] - fds[0] == 6  # six prefixes: 0.12 opens no .bin beside its map
    refused = run(str(blend), *ARGS, "--megatron-release", "0.12", "--mid-level-dataset-surplus",
                  "0.01")  # fmt: skip
    assert refused.exit_code == 3
    assert "megatron-core 0.12 has no such setting" in refused.output
    assert run(str(blend), *ARGS, "--megatron-release", "twelve").exit_code == 2


@pytest.mark.parametrize(
    ("flag", "why"),
    [
        (["--samples", "100,0,0"], "give --train-samples or --train-iters"),
        (["--blend", "blend.json"], "each phase's blend is the schedule's"),
        (["--plot", "mix.png"], "the phase report has no plot"),
        (["--node-memory", "2TiB"], "the phase report has no memory figure"),
        (["--workers", "4"], "the phase report does not use it"),
    ],
)
def test_phases_refuses_what_it_does_not_use(blend: Path, flag: list[str], why: str) -> None:
    """``doctor --phases`` used to ignore these silently; now each is a one-line usage error."""
    schedule = blend.parent / "phases.json"
    schedule.write_text(json.dumps({"global_batch_size": 8, "phases": [
        {"blend": blend.name, "start_iteration": 0}]}))  # fmt: skip
    args = ["--phases", str(schedule), "--seq-length", "64", "--train-samples", "80"]
    assert run(*args).exit_code == 0  # premise: the same without the flag runs
    result = run(*args, *flag)
    assert result.exit_code == 2, result.output
    assert f"Error: {flag[0]} does not apply with --phases: {why}" in result.output
    assert not (blend.parent / "mix.png").exists()


def test_bad_blend_file_is_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("[1.0, ")
    result = run(str(path), "--seq-length", "64", "--samples", "1,1,1")
    assert result.exit_code == 3
    assert result.stderr.strip().splitlines() == [
        f"Error: {path}: malformed JSON at line 1, column 7: Expecting value"
    ]


def test_repack_gives_the_same_numbers(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    merge(blend, out)
    # --duplicates: the blend's tokens are read for what the repack's fingerprints say
    from_blend = json.loads(run(str(blend), *ARGS, "--duplicates", "--json").stdout)
    from_repack = json.loads(run(str(out), *ARGS, "--json").stdout)
    assert from_repack["kind"] == "repack"
    assert from_repack["duplicates"]["available"] and from_blend["duplicates"]["available"]
    assert from_repack["sources"] == from_blend["sources"]
    assert from_repack["resources"]["repack"]["shards"] == 1
    with_blend = json.loads(run(str(out), "--blend", str(blend), *ARGS, "--json").stdout)
    assert with_blend["sources"] == from_blend["sources"]
    result = run(str(blend), "--blend", str(blend), *ARGS)
    assert result.exit_code == 3 and "not a repack folder" in result.stderr


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot(blend: Path, tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / f"mix{suffix}"
    result = run(str(blend), *ARGS, "--plot", str(picture))
    assert result.exit_code == 0, result.output
    data = picture.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data[:2000]
    assert result.stderr == f"wrote the plot of the mix to {picture}\n"  # -q: no progress


def test_plot_is_named_in_json(blend: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "mix.svg"
    result = run(str(blend), *ARGS, "--json", "--plot", str(picture))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plot"] == str(picture) and picture.exists()
    without = json.loads(run(str(blend), *ARGS, "--json").stdout)
    assert "plot" not in without


def test_plot_needs_matplotlib(blend: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = run(str(blend), *ARGS, "--plot", str(tmp_path / "mix.png"))
    assert result.exit_code == 3
    assert "pip install 'megatron-repack[plot]'" in result.stderr
    assert not (tmp_path / "mix.png").exists()


def test_plot_refuses_other_formats(blend: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = run(str(blend), *ARGS, "--plot", str(tmp_path / "mix.pdf"))
    assert result.exit_code == 3 and "writes .png or .svg" in result.stderr


def test_library_api(blend: Path) -> None:
    report = doctor(blend, Settings(128, (1600, 384, 64), "90,5,5"), limits=NO_LIMITS)
    assert report.ok
    assert math.isclose(sum(d.share for d in report.plans[0].datasets), 1.0)


def test_cli_host_memory_options(blend: Path) -> None:
    runner = CliRunner()
    small = runner.invoke(main, ["doctor", "-q", str(blend), *ARGS, "--global-batch-size", "8",
                                 "--seq-length", "4096", "--node-memory", "1GiB"])  # fmt: skip
    assert small.exit_code == 0, small.output
    assert "WARNING [host-memory]" in small.output
    assert "Host memory of cached masks (--seq-length 4,096, attention masks on" in small.output
    off = runner.invoke(main, ["doctor", "-q", str(blend), *ARGS, "--global-batch-size", "8",
                               "--seq-length", "4096", "--node-memory", "1GiB", "--json",
                               "--no-create-attention-mask-in-dataloader"])  # fmt: skip
    assert off.exit_code == 0, off.output
    memory = json.loads(off.output)["resources"]["memory"]
    assert memory["create_attention_mask"] is False and memory["node_memory"] == 1 << 30
    assert memory["stock"]["per_source"] < 64 << 10
    assert "host-memory" not in {p["code"] for p in json.loads(off.output)["problems"]}
    bad = runner.invoke(main, ["doctor", str(blend), *ARGS, "--global-batch-size", "8",
                               "--node-memory", "lots"])  # fmt: skip
    assert bad.exit_code == 2 and "--node-memory" in bad.output


# --- the order on x86-64 and aarch64 builds of Megatron (arch-dependent-order) --------------
# (against Megatron's own helper and its fused build: tests/test_doctor_blending.py)

#: Hand-written weights: two decimals, several equal (tests/test_blending_aarch64.py's).
HAND_WRITTEN = [0.3, 0.3, 0.4, 0.15, 0.35, 0.5, 0.25, 0.25, 0.1, 0.2, 0.3, 0.3]


def _orders(weights: list[float], size: int) -> np.ndarray:
    """Where the two roundings' indices differ (repack's index, each rounding)."""
    from repack.model.blending import build_blending_indices

    w = np.array(weights, dtype=np.float64)
    found = []
    for fma in (False, True):
        index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
        build_blending_indices(index, sample, w, len(w), size, False, fma=fma)
        found.append(index)
    return np.flatnonzero(found[0] != found[1])


def test_the_rounding_follows_the_installed_helper_by_default(monkeypatch) -> None:
    from repack.model import rounding

    for value in (True, False):
        monkeypatch.setattr(rounding, "default_fma", lambda value=value: value)
        assert Settings(64, (1, 1, 1)).fma is value
    assert Settings(64, (1, 1, 1), fma=True).fma is True


def test_the_drawn_counts_follow_the_rounding() -> None:
    lengths = np.full(200, 100, dtype=np.int32)
    loaded = _loaded(len(HAND_WRITTEN), lengths, HAND_WRITTEN)
    drawn = {}
    for fma in (False, True):
        # 171 samples: a step where the two orders have drawn other datasets so far
        report = examine(loaded, Settings(64, (164, 0, 0), "1", fma=fma), target="b",
                         limits=NO_LIMITS)  # fmt: skip
        drawn[fma] = [d.drawn for d in report.plans[0].datasets]
        described = "one rounding (aarch64 builds)" if fma else "two roundings (x86-64 builds)"
        assert report.to_json()["blending_arithmetic"] == {"fma": fma, "description": described}
        weights = blend_draws.blend_weights(HAND_WRITTEN, [])
        size = report.plans[0].size
        assert drawn[fma] == blend_draws.drawn_counts(weights, size, fma=fma).tolist()
    assert drawn[False] != drawn[True]


def test_an_order_that_differs_between_the_roundings_is_a_warning() -> None:
    lengths = np.full(200, 100, dtype=np.int32)
    loaded = _loaded(len(HAND_WRITTEN), lengths, HAND_WRITTEN)
    report = examine(loaded, Settings(64, (20_000, 500, 0), "90,10,0"), target="b",
                     limits=NO_LIMITS)  # fmt: skip
    assert report.ok  # a warning
    found = [p for p in report.problems if p.code == "arch-dependent-order"]
    assert [(p.level, p.split, p.source) for p in found] == [
        ("warning", "train", None), ("warning", "valid", None),
    ]  # fmt: skip
    for problem, plan in zip(found, report.plans):
        differ = _orders(list(plan.weights), plan.size)
        assert len(differ) > 0
        message = problem.message
        assert message.startswith(f"split {plan.name}: Megatron's x86-64 builds")
        assert f"another order from sample {differ[0]:,} on: {len(differ):,} of its " in message
        assert f"of its {plan.size:,} samples ({100 * len(differ) / plan.size:.3g}%)" in message
        assert "an index cache built on one kind of machine" in message
        assert "whole multiples of 1/1024 summing to 1" in message
    assert any(p["code"] == "arch-dependent-order" for p in report.to_json()["problems"])


def test_weights_1_2_3_part_at_sample_6() -> None:
    report = examine(_loaded(3, np.full(200, 100, dtype=np.int32), [1.0, 2.0, 3.0]),
                     Settings(64, (2000, 0, 0), "1"), target="b", limits=NO_LIMITS)  # fmt: skip
    [found] = [p for p in report.problems if p.code == "arch-dependent-order"]
    assert "another order from sample 6 on" in found.message


def test_a_long_split_is_compared_on_its_first_samples() -> None:
    lengths = np.full(200, 100, dtype=np.int32)
    loaded = _loaded(len(HAND_WRITTEN), lengths, HAND_WRITTEN)
    report = examine(loaded, Settings(64, (20_000, 0, 0), "1"), target="b", limits=NO_LIMITS,
                     order_samples=5000)  # fmt: skip
    [found] = [p for p in report.problems if p.code == "arch-dependent-order"]
    differ = _orders(list(report.plans[0].weights), 5000)
    share = f"{100 * len(differ) / 5000:.3g}%"
    rest = report.plans[0].size - 5000
    said = f" {len(differ):,} of its first 5,000 samples ({share}; the other {rest:,} were not "
    assert said in found.message


def test_weights_of_exact_binary_fractions_keep_one_order() -> None:
    """Multiples of 1/1024 summing to 1, or whole numbers summing to a power of two: every error
    Megatron computes is exact, both roundings agree, and the doctor says nothing."""
    lengths = np.full(200, 100, dtype=np.int32)
    for weights in ([0.25, 0.375, 0.125, 0.25], [1.0, 1.0, 2.0], [3 / 1024, 1021 / 1024],
                    [5.0, 7.0, 11.0, 9.0]):  # fmt: skip
        loaded = _loaded(len(weights), lengths, weights)
        report = examine(loaded, Settings(64, (20_000, 300, 0), "90,10,0"), target="b",
                         limits=NO_LIMITS)  # fmt: skip
        assert "arch-dependent-order" not in {p.code for p in report.problems}, weights
        for plan in report.plans:
            assert blend_draws.exact_errors(plan.weights, plan.size)
            assert not len(_orders(list(plan.weights), plan.size))
    # multiples of 1/1024 that do not sum to a power of two: not exact, and they part
    weights = [300 / 1024, 301 / 1024, 400 / 1024]
    report = examine(_loaded(3, lengths, weights), Settings(64, (20_000, 0, 0), "1"),
                     target="b", limits=NO_LIMITS)  # fmt: skip
    assert "arch-dependent-order" in {p.code for p in report.problems}
    assert not blend_draws.exact_errors(report.plans[0].weights, 20_000)


def test_exact_binary_fractions_on_random_weights() -> None:
    """The claim of the doctor's way out, on random weights: whole multiples of 2**-k summing to
    1 (any k, any scale) draw one order in both roundings, at every size; multiples of 1/1024
    whose sum is not a power of two mostly do not."""
    rng = np.random.default_rng(43)

    def parts(total: int, n: int) -> np.ndarray:
        cuts = np.sort(rng.choice(np.arange(1, total), size=n - 1, replace=False))
        return np.diff(np.concatenate([[0], cuts, [total]]))

    for trial in range(120):
        n = int(rng.choice([2, 3, 5, 17, 100, 700]))
        k = int(rng.integers(max(1, int(np.ceil(np.log2(n)))) + 1, 21))
        scale = 2.0 ** int(rng.integers(-12, 12))  # normalized away: the sum is a power of two
        weights = (parts(2**k, n) * scale).tolist()
        size = int(rng.choice([1000, 10_000, 100_000, 300_000]))
        normalized = blend_draws.blend_weights(weights, [])
        assert blend_draws.exact_errors(normalized, size), (trial, k)
        assert not len(_orders(normalized, size)), (trial, n, k, size)
        assert blend_draws.order_difference(normalized, size) is None
    parted = 0
    for _ in range(40):
        counts = rng.integers(1, 1024, size=int(rng.choice([3, 5, 17])))
        if int(counts.sum()) & (int(counts.sum()) - 1) == 0:
            continue
        normalized = blend_draws.blend_weights((counts / 1024).tolist(), [])
        assert not blend_draws.exact_errors(normalized, 100_000)
        parted += len(_orders(normalized, 100_000)) > 0
    assert parted >= 20


def test_exact_errors_stop_at_53_bits() -> None:
    # multiples of 1/1024: exact up to 2**43 - 1 samples
    assert blend_draws.exact_errors([0.25, 0.75], 2**51 - 1)
    assert blend_draws.exact_errors([1 / 1024, 1023 / 1024], 2**43 - 1)
    assert not blend_draws.exact_errors([1 / 1024, 1023 / 1024], 2**43)
    assert not blend_draws.exact_errors([1 / 3, 2 / 3], 10)
    assert not blend_draws.exact_errors([0.1, 0.9], 10)


def test_the_exhaustive_index_is_compared_too() -> None:
    """A blend with no size (every dataset drawn its size, build_exhaustive_blending_indices):
    compared whole, or not at all past the limit."""
    sizes = [3000, 2000, 5000, 1234]
    found = blend_draws.order_difference([], sizes=sizes)
    assert found is not None and found.compared == found.size == sum(sizes)
    assert blend_draws.order_difference([], sizes=sizes, limit=1000) is None
    assert blend_draws.order_difference([], sizes=[256, 512, 256]) is None  # exact


def test_without_the_compiled_index_the_orders_are_not_compared(monkeypatch) -> None:
    from repack.model import blending

    monkeypatch.setattr(blending, "_compiled_blend", None)
    monkeypatch.setattr(blending, "COMPILED", False)
    lengths = np.full(200, 100, dtype=np.int32)
    loaded = _loaded(len(HAND_WRITTEN), lengths, HAND_WRITTEN)
    report = examine(loaded, Settings(64, (2000, 200, 0), "90,10,0", fma=False), target="b",
                     limits=NO_LIMITS)  # fmt: skip
    codes = [p.code for p in report.problems]
    assert "arch-dependent-order" not in codes and codes.count("arch-order-unchecked") == 1
    [found] = [p for p in report.problems if p.code == "arch-order-unchecked"]
    assert found.level == "warning" and "\n" not in found.message
    assert found.message.startswith("the orders of Megatron's x86-64 builds")
    assert "repack.model._blending" in found.message
    # the fused rounding itself cannot be computed: refused, naming --no-fma
    with pytest.raises(NotCompiled, match="--no-fma"):
        examine(loaded, Settings(64, (2000, 0, 0), "1", fma=True), target="b", limits=NO_LIMITS)


def test_cli_fma_and_no_fma(blend: Path, monkeypatch) -> None:
    from repack.model import rounding

    monkeypatch.setattr(rounding, "default_fma", lambda: True)  # what an aarch64 node says
    found = {}
    for flag in ("--fma", "--no-fma", None):
        result = run(str(blend), *ARGS, *([flag] if flag else []), "--json")
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        found[flag] = data["blending_arithmetic"]
        text = run(str(blend), *ARGS, *([flag] if flag else []))
        assert f"blending arithmetic: {found[flag]['description']}" in text.stdout.splitlines()
    assert found["--fma"] == found[None] == {
        "fma": True, "description": "one rounding (aarch64 builds)",
    }  # fmt: skip
    assert found["--no-fma"] == {"fma": False, "description": "two roundings (x86-64 builds)"}


def test_cli_without_the_compiled_index(blend: Path, monkeypatch) -> None:
    from repack.model import blending

    monkeypatch.setattr(blending, "_compiled_blend", None)
    monkeypatch.setattr(blending, "COMPILED", False)
    result = run(str(blend), *ARGS, "--fma")
    assert result.exit_code == 3
    assert result.stderr.startswith("Error: blending arithmetic one rounding (aarch64 builds)")
    assert "--no-fma" in result.stderr and len(result.stderr.splitlines()) == 1
    result = run(str(blend), *ARGS, "--no-fma")
    assert result.exit_code == 0, result.output
    assert "WARNING [arch-order-unchecked] the orders of Megatron's x86-64 builds" in (
        result.stdout
    )


def test_phases_take_and_say_the_rounding(blend: Path) -> None:
    schedule = blend.parent / "phases.json"
    schedule.write_text(json.dumps({"global_batch_size": 8, "phases": [
        {"blend": blend.name, "start_iteration": 0}]}))  # fmt: skip
    args = ["--phases", str(schedule), "--seq-length", "64", "--train-samples", "80"]
    for flag, described in (("--fma", "one rounding (aarch64 builds)"),
                            ("--no-fma", "two roundings (x86-64 builds)")):  # fmt: skip
        result = run(*args, flag)
        assert result.exit_code == 0, result.output
        assert f"blending arithmetic: {described}" in result.stdout.splitlines()
        data = json.loads(run(*args, flag, "--json").stdout)
        assert data["blending_arithmetic"] == {"fma": flag == "--fma", "description": described}
