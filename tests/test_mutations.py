"""Random damage to a repack is always caught: by ``repack verify`` always, and by the loader
on open whenever the damage is in what opening checks.

Property tests with a seeded generator: each trial damages one file of a pristine repack in
one way (a byte replaced by another, the file cut at a random length, or random bytes
appended), checks, and restores the file. ``REPACK_MUTATION_SEED`` changes the seed and
``REPACK_MUTATIONS`` the number of trials; a failure message carries the seed and the trial.

test_verify.py places damage at chosen spots and checks that the report names the right file
and sources; this module checks the plain property "damage is never missed" on many random
spots, and what the loader does with damage it is given.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from figures import record_figures

from repack.errors import ChecksumMismatch, FormatError, RepackError
from repack.format import spec as fmt
from repack.format.manifest import dump_manifest, load_manifest
from repack.inputs.sources import read_source_index
from repack.merge import merge
from repack.read import reader
from repack.read.verify import verify
from repack.read.views import SourceDataset
from repack.synth import DemoBlend, make_blend

SEED = int(os.environ.get("REPACK_MUTATION_SEED", "20240611"))
TRIALS = int(os.environ.get("REPACK_MUTATIONS", "300"))
KINDS = ("flip", "truncate", "extend")


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """16 sources, uint16 and int32, two multimodal, the edge cases (empty sequences, an
    empty document)."""
    return make_blend(
        tmp_path_factory.mktemp("mutations-src"),
        16,
        seed=8,
        tokens_per_source=(50, 1500),
        multimodal_fraction=0.1,
    )


@pytest.fixture(scope="module")
def pristine(blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The blend in 8 KiB shards: several shards, padding between segments, cut sources."""
    out = tmp_path_factory.mktemp("mutations-pristine") / "out"
    merge(blend.flat_json, out, shard_size=8192)
    return out


@pytest.fixture
def repack(pristine: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(pristine, out)
    return out


@dataclass(frozen=True)
class Mutation:
    file: str
    kind: str
    position: int  # byte replaced, new length, or old length (extension)
    data: bytes  # the new byte, or the appended bytes

    def __str__(self) -> str:
        if self.kind == "flip":
            return f"{self.file}: byte {self.position} set to 0x{self.data[0]:02x}"
        if self.kind == "truncate":
            return f"{self.file}: cut to {self.position} bytes"
        return f"{self.file}: {len(self.data)} bytes appended"


def draw(rng: np.random.Generator, folder: Path, kind: str, file: str | None = None) -> Mutation:
    """A random mutation of ``kind`` of a random file of ``folder`` (or of ``file``)."""
    if file is None:
        file = str(rng.choice(sorted(os.listdir(folder))))
    data = (folder / file).read_bytes()
    if kind == "flip":
        position = int(rng.integers(len(data)))
        new = (data[position] + int(rng.integers(1, 256))) % 256
        return Mutation(file, kind, position, bytes([new]))
    if kind == "truncate":
        return Mutation(file, kind, int(rng.integers(len(data))), b"")
    extra = rng.integers(0, 256, int(rng.choice([1, int(rng.integers(1, 8193))])), np.uint8)
    return Mutation(file, kind, len(data), extra.tobytes())


@contextmanager
def applied(folder: Path, mutation: Mutation) -> Iterator[None]:
    path = folder / mutation.file
    original = path.read_bytes()
    if mutation.kind == "flip":
        damaged = bytearray(original)
        damaged[mutation.position] = mutation.data[0]
        assert bytes(damaged) != original
        path.write_bytes(bytes(damaged))
    elif mutation.kind == "truncate":
        os.truncate(path, mutation.position)
    else:
        with open(path, "ab") as stream:
            stream.write(mutation.data)
    try:
        yield
    finally:
        path.write_bytes(original)


# --- verify catches everything ---------------------------------------------------------------


def test_verify_catches_every_random_mutation(repack: Path) -> None:
    rng = np.random.default_rng(SEED)
    assert verify(repack).ok
    files = sorted(os.listdir(repack))
    assert len(files) >= 6  # manifest, index and several shards
    tried: dict[str, int] = dict.fromkeys(KINDS, 0)
    by_file: dict[str, int] = {}
    missed: list[str] = []
    for trial in range(TRIALS):
        kind = KINDS[trial % len(KINDS)]
        mutation = draw(rng, repack, kind)
        with applied(repack, mutation):
            report = verify(repack)
        tried[kind] += 1
        kind_of_file = "shard" if mutation.file.startswith("shard-") else mutation.file
        by_file[kind_of_file] = by_file.get(kind_of_file, 0) + 1
        if report.ok:
            missed.append(f"seed {SEED} trial {trial}: {mutation}")
    assert verify(repack).ok  # every file was restored
    record_figures(
        "verify_mutations",
        {
            "seed": SEED,
            "tried": TRIALS,
            "caught": TRIALS - len(missed),
            "by_kind": tried,
            "by_file": by_file,
            "files": len(files),
        },
    )
    assert missed == []


def test_verify_catches_bit_flips_in_every_byte_of_the_headers(repack: Path) -> None:
    """Systematic where random sampling might skip a spot: two random bits of every byte of
    the index header and of the manifest's checksum member."""
    rng = np.random.default_rng(SEED + 6)
    manifest_head = (repack / fmt.MANIFEST_FILE).read_bytes()
    member = manifest_head.index(b'",') + 1  # '{"checksum": "ALGO:HEX"'
    missed = []
    tried = 0
    for file, size in ((fmt.INDEX_FILE, fmt.INDEX_HEADER_SIZE), (fmt.MANIFEST_FILE, member)):
        data = (repack / file).read_bytes()
        for position in range(size):
            for bit in rng.choice(8, 2, replace=False):
                mutation = Mutation(file, "flip", position, bytes([data[position] ^ (1 << bit)]))
                with applied(repack, mutation):
                    if verify(repack).ok:
                        missed.append(str(mutation))
                tried += 1
    record_figures("verify_header_bit_flips", {"tried": tried, "caught": tried - len(missed)})
    assert missed == []


# --- the loader refuses what it cannot serve correctly ---------------------------------------


@dataclass
class Expected:
    """Every source's tokens, modes and document indices, from the original prefixes."""

    sources: dict[str, tuple[list[bytes], np.ndarray | None, np.ndarray]] = field(
        default_factory=dict
    )


@pytest.fixture(scope="module")
def expected(blend: DemoBlend, pristine: Path) -> Expected:
    result = Expected()
    for source in load_manifest(pristine).sources:
        index = read_source_index(source.path)
        data = Path(source.path + ".bin").read_bytes()
        itemsize = source.dtype.itemsize
        tokens = [
            data[int(p) : int(p) + int(n) * itemsize] for p, n in zip(index.pointers, index.lengths)
        ]
        result.sources[source.name] = (tokens, index.modes, index.documents)
    return result


@pytest.fixture
def fresh_opens(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Forget the process-wide open repacks, so that the next view opens (and checks) the
    folder again."""

    def forget() -> None:
        monkeypatch.setattr(reader, "_OPEN", {})

    forget()
    return forget


def reads_differ(folder: Path, expected: Expected, mmap: bool) -> list[str]:
    """Read every sequence, mode and document index through the loader; what differs."""
    differences = []
    for name, (tokens, modes, documents) in expected.sources.items():
        view = SourceDataset(str(folder), name, multimodal=modes is not None, mmap=mmap)
        if len(view) != len(tokens):
            differences.append(f"{name}: {len(view)} sequences, expected {len(tokens)}")
            continue
        if not np.array_equal(view.document_indices, documents):
            differences.append(f"{name}: document indices differ")
        for i, want in enumerate(tokens):
            got = view[i]
            if modes is not None:
                got, mode = got
                if mode != modes[i]:
                    differences.append(f"{name}[{i}]: mode {mode}, expected {modes[i]}")
            if got.tobytes() != want:
                differences.append(f"{name}[{i}]: tokens differ")
    return differences


def open_or_refuse(folder: Path, expected: Expected, forget: Callable[[], None]) -> str:
    """'refused' if opening raises a FormatError or ChecksumMismatch, 'same' if both backends
    read exactly the original data, else a description of the wrong data served."""
    outcomes = set()
    for mmap in (True, False):
        forget()
        try:
            differences = reads_differ(folder, expected, mmap)
        except (FormatError, ChecksumMismatch):
            outcomes.add("refused")
            continue
        outcomes.add("same" if not differences else f"wrong: {differences[:3]}")
    forget()
    assert len(outcomes) == 1, outcomes  # the backends agree
    return outcomes.pop()


def test_pristine_repack_reads_the_originals(
    pristine: Path, expected: Expected, fresh_opens
) -> None:
    assert open_or_refuse(pristine, expected, fresh_opens) == "same"


def test_loader_refuses_any_damage_to_the_manifest(
    repack: Path, expected: Expected, fresh_opens
) -> None:
    rng = np.random.default_rng(SEED + 1)
    outcomes: dict[str, int] = {}
    failures = []
    trials = max(60, TRIALS // 4)
    for trial in range(trials):
        mutation = draw(rng, repack, KINDS[trial % 3], fmt.MANIFEST_FILE)
        with applied(repack, mutation):
            outcome = open_or_refuse(repack, expected, fresh_opens)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome != "refused":
            failures.append(f"seed {SEED + 1} trial {trial}: {mutation}: {outcome}")
    record_figures("loader_manifest_mutations", {"tried": trials, "refused": outcomes})
    assert failures == []


INDEX_HEADER_FIELDS = {
    "magic": range(0, 8),
    "version": range(8, 12),
    "flags": range(12, 16),
    "sequence count": range(16, 24),
    "document count": range(24, 32),
    "reserved": range(32, 64),
}


def test_loader_refuses_a_damaged_index_header(
    repack: Path, expected: Expected, fresh_opens
) -> None:
    """Every byte of the index header, three random new values each: a damaged magic,
    version, flags or count is refused; the reserved bytes mean nothing to a version 1
    reader (verify catches them), so damage there must leave every read exact."""
    rng = np.random.default_rng(SEED + 2)
    header = (repack / fmt.INDEX_FILE).read_bytes()[: fmt.INDEX_HEADER_SIZE]
    failures = []
    counts: dict[str, dict[str, int]] = {}
    for field_name, positions in INDEX_HEADER_FIELDS.items():
        for position in positions:
            for _ in range(3):
                new = (header[position] + int(rng.integers(1, 256))) % 256
                mutation = Mutation(fmt.INDEX_FILE, "flip", position, bytes([new]))
                with applied(repack, mutation):
                    outcome = open_or_refuse(repack, expected, fresh_opens)
                tally = counts.setdefault(field_name, {})
                tally[outcome] = tally.get(outcome, 0) + 1
                should = "same" if field_name == "reserved" else "refused"
                if outcome != should:
                    failures.append(f"{mutation} ({field_name}): {outcome}")
    record_figures("loader_index_header", counts)
    assert failures == []


def test_loader_refuses_any_file_of_another_size(
    repack: Path, expected: Expected, fresh_opens
) -> None:
    rng = np.random.default_rng(SEED + 3)
    failures = []
    tried = 0
    for file in sorted(os.listdir(repack)):
        if fmt.is_fingerprint_name(file):
            # not read by the loader, which needs no fingerprints to read tokens; verify,
            # doctor and inspect report a damaged one (tests/test_fingerprints.py)
            continue
        size = (repack / file).stat().st_size
        cuts = {size - 1, 0, int(rng.integers(size))}
        mutations = [Mutation(file, "truncate", n, b"") for n in sorted(cuts)]
        mutations += [Mutation(file, "extend", size, b"\x00"), draw(rng, repack, "extend", file)]
        for mutation in mutations:
            with applied(repack, mutation):
                outcome = open_or_refuse(repack, expected, fresh_opens)
            tried += 1
            if outcome != "refused":
                failures.append(f"{mutation}: {outcome}")
    record_figures("loader_size_changes", {"tried": tried, "refused": tried - len(failures)})
    assert failures == []


def test_loader_refuses_index_lengths_that_disagree_with_the_manifest(
    repack: Path, expected: Expected, fresh_opens
) -> None:
    """A damaged sequence length changes its source's token count, which opening checks."""
    manifest = load_manifest(repack)
    layout = fmt.index_layout(manifest.sequence_count, manifest.document_count)
    rng = np.random.default_rng(SEED + 4)
    failures = []
    for _ in range(40):
        position = layout.lengths + int(rng.integers(4 * manifest.sequence_count))
        data = (repack / fmt.INDEX_FILE).read_bytes()
        new = (data[position] + int(rng.integers(1, 256))) % 256
        mutation = Mutation(fmt.INDEX_FILE, "flip", position, bytes([new]))
        with applied(repack, mutation):
            outcome = open_or_refuse(repack, expected, fresh_opens)
        if outcome != "refused":
            failures.append(f"{mutation}: {outcome}")
    assert failures == []


# --- manifests edited on purpose, with a valid self-checksum ---------------------------------


def leaves(value: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    else:
        yield path


REPLACEMENTS: list[Callable[[Any], Any]] = [
    lambda v: v + 1 if type(v) is int else 1,
    lambda v: v - 1 if type(v) is int else -1,
    lambda v: v + 4096 if type(v) is int else 4096,
    lambda v: 2**63,
    lambda v: 2**64 + 5,
    lambda v: -(2**70),
    lambda v: 1e300,
    lambda v: float(v) if type(v) is int else 0.5,
    lambda v: True,
    lambda v: None,
    lambda v: "",
    lambda v: "../" + v if isinstance(v, str) else "..",
    lambda v: [v],
    lambda v: {"x": v},
    lambda v: [],
]


def test_edited_manifests_are_refused_or_harmless_never_a_crash(
    repack: Path, expected: Expected, fresh_opens
) -> None:
    """A manifest rewritten with a valid self-checksum is not damage but a deliberate edit;
    the loader must still never crash on it (only a RepackError), and when it opens one and
    serves other data than the originals, verify must say so."""
    raw = json.loads((repack / fmt.MANIFEST_FILE).read_bytes())
    algorithm = raw.pop("checksum").split(":")[0]
    paths = list(leaves(raw))
    rng = np.random.default_rng(SEED + 5)
    outcomes: dict[str, int] = {}
    failures = []
    original = (repack / fmt.MANIFEST_FILE).read_bytes()
    trials = max(150, TRIALS // 2)
    for trial in range(trials):
        path = paths[int(rng.integers(len(paths)))]
        edited = copy.deepcopy(raw)
        target = edited
        for key in path[:-1]:
            target = target[key]
        replace = REPLACEMENTS[int(rng.integers(len(REPLACEMENTS)))]
        target[path[-1]] = replace(target[path[-1]])
        where = f"seed {SEED + 5} trial {trial}: {'.'.join(map(str, path))} = {target[path[-1]]!r}"
        (repack / fmt.MANIFEST_FILE).write_bytes(dump_manifest(edited, algorithm))
        try:
            try:
                outcome = open_or_refuse(repack, expected, fresh_opens)
            except RepackError as err:  # refused by a check past opening (a view's own)
                outcome = f"refused by the view: {type(err).__name__}"
            except Exception as err:
                outcome = "crash"
                failures.append(f"{where}: {type(err).__name__}: {err}")
            if outcome.startswith("wrong"):
                if verify(repack).ok:
                    failures.append(f"{where}: served other data and verify saw nothing")
                outcome = "served other data; verify caught it"
        finally:
            (repack / fmt.MANIFEST_FILE).write_bytes(original)
        key = outcome if not outcome.startswith("refused by the view") else "refused by the view"
        outcomes[key] = outcomes.get(key, 0) + 1
    record_figures("edited_manifests", {"tried": trials, "outcomes": outcomes})
    assert failures == []
