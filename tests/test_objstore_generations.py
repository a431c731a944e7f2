"""An edit of a repack on object storage never breaks a reader that opened it before
(docs/objstore.md, "What a reader sees during an edit"), against a real S3 server (SeaweedFS
on 127.0.0.1) and multi-storage-client on the same server.

``add``, ``remove`` and ``fingerprint`` keep the objects they supersede, recorded under
``.superseded/`` (:mod:`repack.store.generations`); the first edit after the grace period,
``repack gc`` or ``remove --now`` deletes them, never an object the current manifest names;
a reader whose object was deleted gets ``ObjectChanged`` naming the edit."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.errors import ObjectChanged
from repack.format import spec as fmt
from repack.merge import merge
from repack.merge.commit import named_files
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.store import open_store
from repack.store.generations import Generation, generations
from repack.synth import make_blend
from repack.units import format_duration, parse_duration


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("REPACK_CACHE_DIR", str(folder))
    return folder


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def objects_of(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {key: store.get(key, 1 << 30)[0] for key, _ in store.list()}


def read_sources(repack: Repack) -> dict[str, bytes]:
    """Every source's bytes, as a reader reads them: through its open repack."""
    found = {}
    for source in repack.manifest.sources:
        parts = [bytes(repack.read_bytes(s.shard, s.offset, s.size)) for s in source.segments]
        found[source.path] = b"".join(parts)
    return found


def _repack(tmp_path: Path, url: str, *, fingerprints: bool = True, seed: int = 91):
    first = make_blend(tmp_path / "a", 10, seed=seed)
    second = make_blend(tmp_path / "b", 4, seed=seed + 1)
    merge(first.flat_json, url, shard_size=8 * 1024, fingerprints=fingerprints)
    return first, second


def _bucket_url(s3) -> str:
    return f"s3://{s3.new_bucket()}/x.repack"


def _msc_url(s3, tmp_path, monkeypatch) -> str:
    from s3_support import missing, msc_profile

    if importlib.util.find_spec("multistorageclient") is None:
        missing("multi-storage-client not installed: pip install -e '.[msc]'")
    monkeypatch.setenv("MSC_CONFIG", "")
    return msc_profile(s3, tmp_path, s3.new_bucket()) + "/x.repack"


@pytest.mark.parametrize("scheme", ["s3", "msc"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_readers_opened_before_add_remove_fingerprint_read_the_same_bytes(
    s3, tmp_path, cache, monkeypatch, scheme, backend
):
    url = _bucket_url(s3) if scheme == "s3" else _msc_url(s3, tmp_path, monkeypatch)
    first, second = _repack(tmp_path, url, fingerprints=False)
    readers = []

    def open_and_read() -> None:
        repack = Repack(url, backend=backend)
        readers.append((repack, read_sources(repack)))

    open_and_read()
    edits = [
        ("add", "-q", url, second.flat_json),
        ("remove", "-q", url, first.prefixes[1], second.prefixes[2]),
        ("fingerprint", "-q", url),  # supersedes nothing: there were none
        ("fingerprint", "-q", url),  # supersedes the first one's file
        ("remove", "-q", url, first.prefixes[4]),
    ]
    for args in edits:
        result = cli(*args)
        assert result.exit_code == 0, result.output
        open_and_read()  # a reader of the new version, for the next edit
    assert len(readers) == len(edits) + 1
    for repack, before in readers:  # every source it had opened, removed ones included
        assert read_sources(repack) == before
        repack.close()
    superseded, _ = generations(open_store(url))
    assert [g.edit for g in superseded] == ["add", "remove", "fingerprint", "remove"]
    assert all(g.kept for g in superseded)
    assert verify(url, sources=True).ok


def test_a_remove_says_what_it_kept_and_when_it_goes(s3, tmp_path, cache):
    url = _bucket_url(s3)
    first, _ = _repack(tmp_path, url)
    result = cli("remove", url, first.prefixes[3], "--keep-superseded", "12h")
    assert result.exit_code == 0, result.output
    [generation], _ = generations(open_store(url))
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith(f"kept the {len(generation.objects)} replaced objects ("), (
        result.output
    )
    day = time.strftime("%Y-%m-%d", time.gmtime(generation.at + 12 * 3600))
    assert f"deleted by the first edit after {day}" in lines[-1]
    assert f"`repack gc {url} --older-than 0`" in lines[-1]
    shown = cli("inspect", url)
    assert shown.exit_code == 0, shown.output
    assert "superseded by `repack remove` at " in shown.output
    assert f"{len(generation.objects)} objects" in shown.output
    listed = json.loads(cli("inspect", "--json", url).output)["superseded"]
    assert [(g["edit"], g["objects"], g["bytes"]) for g in listed] == [
        ("remove", sorted(generation.objects), generation.size)
    ]
    as_json = json.loads(cli("remove", "--json", url, first.prefixes[4]).output)
    assert as_json["superseded"]["kept"][0]["edit"] == "remove"
    assert as_json["superseded"]["pending"] and not as_json["superseded"]["deleted"]


def test_the_next_edit_after_the_grace_period_deletes_exactly_the_superseded(
    s3, tmp_path, cache, monkeypatch
):
    from repack.merge import edit as edit_module

    url = _bucket_url(s3)
    first, second = _repack(tmp_path, url)
    assert cli("remove", "-q", url, first.prefixes[2]).exit_code == 0
    [older], _ = generations(open_store(url))
    assert set(older.objects) <= set(objects_of(url))
    # a day and a minute later (the editing host's clock), the next edit
    later = time.time() + 24 * 3600 + 60
    monkeypatch.setattr(edit_module.time, "time", lambda: later)
    assert cli("add", "-q", url, second.flat_json).exit_code == 0
    monkeypatch.undo()
    objects = objects_of(url)
    assert not set(older.objects) & set(objects)  # the older generation's objects are gone
    found, _ = generations(open_store(url))
    assert [(g.edit, g.kept) for g in found] == [("remove", False), ("add", True)]
    assert found[0].deleted_by == "add"
    assert set(found[1].objects) <= set(objects)  # the add's own are kept
    assert named_files(Repack(url).manifest) <= set(objects)
    assert verify(url, sources=True).ok


def test_gc_deletes_the_superseded_never_what_the_manifest_names(s3, tmp_path, cache):
    url = _bucket_url(s3)
    first, second = _repack(tmp_path, url)
    for args in (("add", "-q", url, second.flat_json), ("remove", "-q", url, first.prefixes[0])):
        assert cli(*args).exit_code == 0
    store = open_store(url)
    named = named_files(Repack(url).manifest)
    # a record naming current objects (as an edit killed between its record and its commit
    # leaves, or a hand-made one): never deleted
    Generation("remove", time.time() - 7 * 86400, "other", {n: 0 for n in named}).write(store)
    superseded = {name for g in generations(store)[0] for name in g.objects} - named
    before = objects_of(url)
    kept = cli("gc", url)  # the default: older than a day; these are minutes old
    assert kept.exit_code == 0, kept.output
    assert "kept " in kept.output
    assert superseded <= set(objects_of(url))
    result = cli("gc", "--json", url, "--older-than", "0")
    assert result.exit_code == 0, result.output
    after = objects_of(url)
    assert set(before) - set(after) == superseded  # exactly those
    assert {k: v for k, v in after.items() if k in named} == {k: before[k] for k in named}
    deleted = json.loads(result.output)["deleted"]
    assert {name for g in deleted for name in g["objects"]} - named == superseded
    assert verify(url, sources=True).ok
    found, _ = generations(store)
    assert all(not g.kept and g.deleted_by == "gc" for g in found)  # tombstones


def test_a_take_down_with_now_deletes_every_copy_and_readers_learn_why(s3, tmp_path, cache):
    url = _bucket_url(s3)
    first, _ = _repack(tmp_path, url)
    taken = first.prefixes[5]
    reader = Repack(url, backend="pread")
    read_sources(reader)
    # an earlier edit's kept objects still hold the source's bytes: a take-down deletes them too
    assert cli("remove", "-q", url, first.prefixes[1]).exit_code == 0
    result = cli("remove", "--now", url, taken)
    assert result.exit_code == 0, result.output
    assert "readers that opened the repack before fail" in result.output
    secret = Path(taken + ".bin").read_bytes()
    assert len(secret) > 64
    assert all(secret[:64] not in data for data in objects_of(url).values())
    source = next(s for s in reader.manifest.sources if s.path == taken)
    segment = source.segments[0]
    with pytest.raises(ObjectChanged) as caught:
        reader.read_bytes(segment.shard, segment.offset, segment.size)
    message = str(caught.value)
    assert "not found" not in message
    assert "deleted since this process opened the repack" in message
    assert "deleted by `repack remove --now` at " in message
    reader.close()
    assert verify(url, sources=True).ok


def test_a_reader_of_an_object_replaced_or_deleted_by_hand(s3, tmp_path, cache):
    """Without a record (another tool deleted it): still ObjectChanged, never "not found"."""
    url = _bucket_url(s3)
    _repack(tmp_path, url)
    reader = Repack(url, backend="pread")
    shard = reader.manifest.shards[0]
    open_store(url).delete(shard.file)
    with pytest.raises(ObjectChanged, match="deleted since this process opened the repack"):
        reader.read_bytes(0, 0, 16)
    reader.close()


def test_a_folder_deletes_at_once_and_keeps_no_record(tmp_path, cache):
    out = tmp_path / "out"
    first, _ = _repack(tmp_path, out)
    reader = Repack(out, backend="pread")
    before = read_sources(reader)
    result = cli("remove", out, first.prefixes[1])
    assert result.exit_code == 0, result.output
    assert "kept" not in result.output
    assert not (out / ".superseded").exists()
    files = {p.name for p in out.iterdir() if p.is_file()} - {".lock"}
    assert files == named_files(Repack(out).manifest) | {fmt.MANIFEST_FILE}
    assert read_sources(reader) == before  # open descriptors keep the unlinked shards
    reader.close()
    assert cli("gc", out).exit_code == 0


def test_durations():
    assert [parse_duration(t) for t in ("1d", "12h", "30m", "90s", "0", "1w", "2")] == [
        86400,
        43200,
        1800,
        90,
        0,
        604800,
        2,
    ]
    assert [format_duration(s) for s in (86400, 43200, 5400, 90, 0)] == [
        "1d",
        "12h",
        "90m",
        "90s",
        "0s",
    ]
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("1 fortnight")
    result = cli("gc", "/nonexistent", "--older-than", "soon")
    assert result.exit_code == 2 and "not a duration" in result.output
