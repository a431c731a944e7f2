"""Every command on a repack on object storage, against a real S3 server (SeaweedFS on
127.0.0.1, tests/s3_support.py): merge from local sources, verify, inspect, extract and
doctor; resuming a killed upload; two writers; a read-only credential; a server gone
mid-read; a repack replaced while read."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner
from s3_support import edited_objects

from repack.cli import main
from repack.errors import ObjectChanged, ObjectExists, StoreError
from repack.format import spec as fmt
from repack.merge import finalize, merge, plan_merge, prepare, run_task, shards
from repack.merge.lease import LEASE_KEY
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.store import open_store
from repack.synth import make_blend

OPTIONS = ("-q", "--shard-size", "64KiB")


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return make_blend(tmp_path_factory.mktemp("objblend"), 40, seed=5, multimodal_fraction=0.05)


@pytest.fixture(scope="module")
def reference(blend, tmp_path_factory) -> Path:
    """The same merge into a local folder: what the bucket must hold, byte for byte."""
    out = tmp_path_factory.mktemp("objref") / "out"
    merge(blend.flat_json, out, shard_size=64 * 1024)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("REPACK_CACHE_DIR", str(folder))
    return folder


def objects_of(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {key: store.get(key, 1 << 30)[0] for key, _ in store.list()}


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_merge_to_s3_is_the_local_merge_byte_for_byte(s3, blend, reference):
    url = f"s3://{s3.new_bucket()}/blends/x.repack"
    result = cli("merge", *OPTIONS, "--json", str(blend.flat_json), url)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["out"] == url
    assert objects_of(url) == files_of(reference)  # no .work, no temp, same bytes


def test_verify_inspect_extract_doctor_on_s3(s3, blend, reference, tmp_path, cache):
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(blend.flat_json, url, shard_size=64 * 1024)
    result = cli("verify", "-q", "--json", "--sources", url)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["path"] == url
    assert report["originals_compared"] == 40
    # the manifest, the index, the fingerprint file and the shards
    assert report["files_checked"] == 3 + len(Repack(str(reference)).manifest.shards)
    ours = json.loads(cli("inspect", "--json", url).output)
    theirs = json.loads(cli("inspect", "--json", str(reference)).output)
    assert ours == theirs
    for prefix in (blend.prefixes[0], blend.prefixes[7], *blend.multimodal[:1]):
        dest = tmp_path / Path(prefix).name
        result = cli("extract", "-q", url, prefix, str(dest))
        assert result.exit_code == 0, result.output
        for ext in (".bin", ".idx"):
            assert Path(str(dest) + ext).read_bytes() == Path(prefix + ext).read_bytes()
    args = ("--seq-length", "64", "--split", "90,5,5", "--train-iters", "10")
    args += ("--global-batch-size", "8", "--json", "-q")
    ours = cli("doctor", url, *args)
    theirs = cli("doctor", str(reference), *args)
    assert ours.exit_code == theirs.exit_code, ours.output
    assert ours.output.replace(url, "OUT") == theirs.output.replace(str(reference), "OUT")


def test_msc_merge_verify_inspect_extract(s3, blend, reference, tmp_path, cache, monkeypatch):
    """The same on ``msc://`` (multi-storage-client configured against the same server)."""
    import importlib.util

    from s3_support import missing, msc_profile

    if importlib.util.find_spec("multistorageclient") is None:
        missing("multi-storage-client not installed: pip install -e '.[msc]'")
    monkeypatch.setenv("MSC_CONFIG", "")
    url = msc_profile(s3, tmp_path, s3.new_bucket()) + "/x.repack"
    result = cli("merge", *OPTIONS, str(blend.flat_json), url)
    assert result.exit_code == 0, result.output
    assert objects_of(url) == files_of(reference)
    assert verify(url, sources=True).ok
    ours = json.loads(cli("inspect", "--json", url).output)
    assert ours == json.loads(cli("inspect", "--json", str(reference)).output)
    prefix = blend.prefixes[5]
    result = cli("extract", "-q", url, prefix, str(tmp_path / "x"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x.bin").read_bytes() == Path(prefix + ".bin").read_bytes()
    assert (tmp_path / "x.idx").read_bytes() == Path(prefix + ".idx").read_bytes()


_FORKED_READS = {}


def _forked_reader(seed: int) -> str | None:
    """In a forked child: random ranges of a shard through the store opened by the parent,
    compared with the local reference; the first difference, or None."""
    import random

    store, key, data = _FORKED_READS["store"], _FORKED_READS["key"], _FORKED_READS["data"]
    rng = random.Random(seed)
    try:
        for _ in range(60):
            offset = rng.randrange(len(data) - 1)
            size = rng.randrange(1, min(40_000, len(data) - offset) + 1)
            if store.read(key, offset, size) != data[offset : offset + size]:
                return f"wrong bytes at {offset} +{size}"
    except Exception as err:  # the error itself is the finding
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("scheme", ["s3", "msc"])
def test_forked_readers_of_an_open_store_each_use_their_own_client(
    s3, blend, reference, tmp_path, cache, monkeypatch, scheme
):
    """DataLoader workers forked from a process that has the repack open read through its
    store at once: each must get its own connections (a connection pool shared across fork
    crosses the responses: an msc:// store kept its parent's client and read another
    request's bytes)."""
    import importlib.util
    import multiprocessing

    from s3_support import missing, msc_profile

    url = f"s3://{s3.new_bucket()}/x.repack"
    if scheme == "msc":
        if importlib.util.find_spec("multistorageclient") is None:
            missing("multi-storage-client not installed: pip install -e '.[msc]'")
        monkeypatch.setenv("MSC_CONFIG", "")
        url = msc_profile(s3, tmp_path, s3.new_bucket()) + "/x.repack"
    assert cli("merge", *OPTIONS, str(blend.flat_json), url).exit_code == 0
    store = open_store(url)
    key = "shard-00000.bin"
    data = (reference / key).read_bytes()
    assert store.read(key, 0, 100) == data[:100]  # the parent's client, connected
    _FORKED_READS.update(store=store, key=key, data=data)
    with multiprocessing.get_context("fork").Pool(4) as pool:
        found = pool.map(_forked_reader, range(8))
    assert found == [None] * 8


def test_verify_finds_a_damaged_object(s3, blend, reference, cache):
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(blend.flat_json, url, shard_size=64 * 1024)
    store = open_store(url)
    data = bytearray(store.get("shard-00001.bin", 1 << 30)[0])
    data[100] ^= 0xFF
    store.put("shard-00001.bin", bytes(data))
    store.delete("shard-00002.bin")
    report = verify(url)
    assert not report.ok
    files = {p.file: p for p in report.problems}
    assert "checksum stored" in files["shard-00001.bin"].message
    assert files["shard-00001.bin"].sources
    assert "not found" in files["shard-00002.bin"].message
    result = cli("verify", "-q", url)
    assert result.exit_code == 1


def test_verify_sources_finds_a_changed_original(s3, tmp_path, cache):
    small = make_blend(tmp_path / "b", 6, seed=4)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(small.flat_json, url, shard_size=8192)  # sources cut across shards
    assert verify(url, sources=True).ok
    target = Path(small.prefixes[3] + ".bin")
    data = bytearray(target.read_bytes())
    data[len(data) // 2 + 1] ^= 0xFF
    target.write_bytes(bytes(data))
    report = verify(url, sources=True)
    assert [(p.file, p.message) for p in report.problems] == [
        (small.prefixes[3], f"original .bin differs from the repack at byte {len(data) // 2 + 1}")
    ]


def test_compressed_merge_add_remove_on_s3_are_the_local_ones(s3, tmp_path, cache):
    """``--compress zstd``: shards compressed as they stream (the frames, table and trailer
    of a local merge, byte for byte); then add and remove, compressed alike."""
    from repack.merge.append import add
    from repack.merge.remove import remove

    first = make_blend(tmp_path / "a", 10, seed=81)
    second = make_blend(tmp_path / "b", 4, seed=82)
    local = tmp_path / "local"
    url = f"s3://{s3.new_bucket()}/x.repack"
    for out in (local, url):
        merge(first.flat_json, out, shard_size=16 * 1024, codec=("zstd", 5), fingerprints=False)
    assert objects_of(url) == files_of(local)
    assert any(name.endswith(".zst") for name in files_of(local))
    for out in (local, url):
        add(out, second.flat_json)
    assert edited_objects(url) == files_of(local)
    for out in (local, url):
        remove(out, [first.prefixes[2], second.prefixes[1]])
    assert edited_objects(url) == files_of(local)
    assert verify(url, sources=True).ok


@pytest.mark.parametrize("kind", ["zstd", "appended", "removed"])
def test_every_kind_of_repack_reads_from_s3(s3, tmp_path, cache, kind):
    """A compressed, an appended and a removed-from repack, made locally and copied to the
    bucket as they are: verify, inspect and extract on the URL as on the folder."""
    from repack.merge.append import add
    from repack.merge.remove import remove

    first = make_blend(tmp_path / "a", 12, seed=21)
    out = tmp_path / "out"
    codec = ("zstd", 3) if kind == "zstd" else None
    merge(first.flat_json, out, shard_size=16 * 1024, codec=codec)
    kept = list(first.prefixes)
    if kind == "appended":
        second = make_blend(tmp_path / "b", 5, seed=22)
        add(out, second.flat_json)
        kept += second.prefixes
    if kind == "removed":
        remove(out, [first.prefixes[2], first.prefixes[6]])
        kept = [p for i, p in enumerate(kept) if i not in (2, 6)]
    url = f"s3://{s3.new_bucket()}/{kind}.repack"
    store = open_store(url)
    for name, data in files_of(out).items():
        store.put(name, data)
    assert verify(url, sources=True).ok
    assert verify(url).to_json()["bytes_checked"] == verify(out).to_json()["bytes_checked"]
    ours = json.loads(cli("inspect", "--json", url).output)
    assert ours == json.loads(cli("inspect", "--json", str(out)).output)
    for prefix in (kept[0], kept[-1]):
        dest = tmp_path / ("x" + Path(prefix).name)
        result = cli("extract", "-q", url, prefix, str(dest))
        assert result.exit_code == 0, result.output
        assert Path(f"{dest}.bin").read_bytes() == Path(prefix + ".bin").read_bytes()
        assert Path(f"{dest}.idx").read_bytes() == Path(prefix + ".idx").read_bytes()
    if kind == "zstd":  # damage inside a frame is found, as on a folder
        data = bytearray(store.get("shard-00001.bin.zst", 1 << 30)[0])
        data[40] ^= 0xFF
        store.put("shard-00001.bin.zst", bytes(data))
        report = verify(url)
        assert [p.file for p in report.problems] == ["shard-00001.bin.zst"]


# --- writers ---------------------------------------------------------------------------------


def test_two_writers_cannot_both_commit(s3, blend, reference):
    url = f"s3://{s3.new_bucket()}/x.repack"
    prepared = prepare(blend.flat_json, shard_size=64 * 1024)
    plan_merge(prepared, url)
    run_task(url)
    store = open_store(url)

    def finish(_):
        try:
            return finalize(store)
        except ObjectExists as err:
            return err

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(finish, range(2)))
    refused = [o for o in outcomes if isinstance(o, ObjectExists)]
    assert len(refused) == 1, outcomes
    assert "another writer committed a repack here first" in str(refused[0])
    assert objects_of(url) == files_of(reference)  # nothing lost, nothing extra


def test_plan_tasks_finalize_on_s3(s3, blend, reference):
    """The three steps on a URL, the tasks at the same time (as a SLURM array runs them)."""
    url = f"s3://{s3.new_bucket()}/x.repack"
    result = cli("merge", *OPTIONS, "--plan-only", str(blend.flat_json), url)
    assert result.exit_code == 0, result.output
    assert f"now run 'repack merge {url} --task I --tasks N'" in result.output
    result = cli("merge", "-q", "--finalize", url)
    assert result.exit_code != 0 and "not finished yet" in result.output
    with ThreadPoolExecutor(3) as pool:  # (CliRunner is not for threads: the library)
        outcomes = list(pool.map(lambda i: run_task(url, i, 3), range(3)))
    assert sum(copied for copied, _ in outcomes) == len(Repack(str(reference)).manifest.shards)
    assert fmt.MANIFEST_FILE not in objects_of(url)
    result = cli("merge", "-q", "--finalize", url)
    assert result.exit_code == 0, result.output
    assert objects_of(url) == files_of(reference)
    result = cli("merge", "-q", url, "--task", "0", "--tasks", "3")
    assert result.exit_code != 0 and "already finalized" in result.output


def test_another_blend_at_the_same_prefix_is_refused(s3, blend, tmp_path):
    url = f"s3://{s3.new_bucket()}/x.repack"
    plan_merge(prepare(blend.flat_json, shard_size=64 * 1024), url)
    other = make_blend(tmp_path / "other", 5, seed=9)
    result = cli("merge", *OPTIONS, str(other.flat_json), url)
    assert result.exit_code != 0
    assert "unfinished merge of another blend" in result.output
    assert f"'repack merge {url} --resume' finishes it" in result.output
    assert fmt.MANIFEST_FILE not in objects_of(url)


def test_interrupted_upload_resumes_to_identical_objects(s3, blend, reference, monkeypatch):
    url = f"s3://{s3.new_bucket()}/x.repack"
    real = shards.write_shard
    calls = []

    def failing(store, prepared, shard, advance, *rest):
        calls.append(shard.number)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as Ctrl-C in the middle of the merge
        return real(store, prepared, shard, advance, *rest)

    monkeypatch.setattr(shards, "write_shard", failing)
    result = cli("merge", *OPTIONS, str(blend.flat_json), url)
    assert result.exit_code != 0
    left = objects_of(url)
    assert fmt.MANIFEST_FILE not in left and ".work/plan.json" in left
    monkeypatch.setattr(shards, "write_shard", real)
    result = cli("merge", "-q", "--json", "--resume", url)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["resumed_shards"] == 2
    assert objects_of(url) == files_of(reference)


def _merge_command(blend, url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "repack", "merge", *OPTIONS, *extra, str(blend.flat_json), url]


def test_merge_killed_at_random_moments_never_leaves_a_manifest(s3, blend, reference):
    """SIGKILL at random moments once the merge has started (its plan is saved): the bucket
    holds no manifest, or a complete repack; the same command run again always ends with the
    objects of an uninterrupted merge."""
    rng = random.Random(18)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(4):
        url = f"s3://{s3.new_bucket()}/x.repack"
        store = open_store(url)
        process = subprocess.Popen(
            _merge_command(blend, url, "--workers", "2"),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while store.stat(".work/plan.json") is None and process.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.6))
        process.send_signal(signal.SIGKILL)
        process.wait()
        left = objects_of(url)
        if fmt.MANIFEST_FILE in left:
            assert verify(url).ok  # it was done
        subprocess.run(_merge_command(blend, url), env=env, check=True, capture_output=True)
        assert objects_of(url) == files_of(reference)
        bucket = url.split("/")[2]
        assert not s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_add_on_s3_is_the_local_add_byte_for_byte(s3, tmp_path, cache):
    from repack.merge.append import add

    first = make_blend(tmp_path / "a", 10, seed=31)
    second = make_blend(tmp_path / "b", 6, seed=32)
    local = tmp_path / "local"
    merge(first.flat_json, local, shard_size=16 * 1024)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(first.flat_json, url, shard_size=16 * 1024)
    old_index = Repack(url).manifest.index_file
    add(local, second.flat_json)
    result = cli("add", "-q", url, str(second.flat_json))
    assert result.exit_code == 0, result.output
    assert edited_objects(url) == files_of(local)  # no .work, no lease
    assert old_index in objects_of(url)  # kept for readers of the old repack
    result = cli("gc", url, "--older-than", "0")
    assert result.exit_code == 0, result.output
    assert old_index not in objects_of(url)
    assert verify(url, sources=True).ok
    prefix = second.prefixes[1]
    result = cli("extract", "-q", url, prefix, str(tmp_path / "x"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x.bin").read_bytes() == Path(prefix + ".bin").read_bytes()


def test_add_on_s3_one_writer_at_a_time(s3, tmp_path, cache, monkeypatch):
    from repack.merge.append import add

    first = make_blend(tmp_path / "a", 6, seed=41)
    second = make_blend(tmp_path / "b", 4, seed=42)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(first.flat_json, url, shard_size=16 * 1024)
    before = objects_of(url)
    store = open_store(url)
    # a lease held by a live process (this one's parent: alive, not this process)
    from repack.store.lock import Holder

    holder = Holder(os.getppid(), Holder.me().host, "repack add x y", time.time())
    store.put(LEASE_KEY, holder.to_bytes())
    result = cli("add", "-q", url, str(second.flat_json))
    assert result.exit_code != 0
    assert "another repack command is writing here" in result.output
    assert f"pid {os.getppid()}" in result.output
    # one of another host is never taken over: the message says what to delete if it is gone
    elsewhere = Holder(123, "another-node", "repack remove x y", time.time())
    store.put(LEASE_KEY, elsewhere.to_bytes())
    result = cli("remove", "-q", url, first.prefixes[0])
    assert result.exit_code != 0
    assert "pid 123 on another-node" in result.output
    assert f"if that process is gone, delete {url}/{LEASE_KEY}" in result.output
    store.delete(LEASE_KEY)
    assert objects_of(url) == before
    # a lease left by a process gone from this host is taken over
    gone = Holder(2**22 + 7, Holder.me().host, "repack add x y", time.time())
    store.put(LEASE_KEY, gone.to_bytes())
    add(url, second.flat_json)
    assert verify(url).ok
    assert LEASE_KEY not in objects_of(url)


def test_add_on_s3_refused_when_the_manifest_changed_meanwhile(s3, tmp_path, cache, monkeypatch):
    from repack.errors import ObjectChanged
    from repack.merge.append import add

    first = make_blend(tmp_path / "a", 6, seed=51)
    second = make_blend(tmp_path / "b", 4, seed=52)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(first.flat_json, url, shard_size=16 * 1024)
    store = open_store(url)
    original = store.get("manifest.json", 1 << 20)[0]
    real = shards.write_shard

    def meanwhile(*args):
        # another writer (without the lease: a merge --force) commits in the middle
        store.put("manifest.json", original.replace(b'"shard_size"', b'"shard_size" ', 1))
        return real(*args)

    monkeypatch.setattr(shards, "write_shard", meanwhile)
    with pytest.raises(ObjectChanged, match="replaced by another writer during this add"):
        add(url, second.flat_json)
    assert LEASE_KEY not in objects_of(url)


def test_add_killed_leaves_the_repack_and_the_rerun_completes(s3, tmp_path, cache, monkeypatch):
    from repack.merge.append import add

    first = make_blend(tmp_path / "a", 6, seed=61)
    second = make_blend(tmp_path / "b", 6, seed=62)
    local = tmp_path / "local"
    merge(first.flat_json, local, shard_size=8 * 1024)
    add(local, second.flat_json)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(first.flat_json, url, shard_size=8 * 1024)
    before = Repack(url).manifest.checksum
    real = shards.write_shard
    calls = []

    def dies(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(shards, "write_shard", dies)
    with pytest.raises(KeyboardInterrupt):
        add(url, second.flat_json)
    assert Repack(url).manifest.checksum == before  # still the old repack, readable
    assert verify(url).ok
    monkeypatch.setattr(shards, "write_shard", real)
    add(url, second.flat_json)
    assert edited_objects(url) == files_of(local)


def test_remove_on_s3_is_the_local_remove_byte_for_byte(s3, tmp_path, cache):
    from repack.merge.remove import remove

    first = make_blend(tmp_path / "a", 12, seed=71)
    local = tmp_path / "local"
    merge(first.flat_json, local, shard_size=8 * 1024)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(first.flat_json, url, shard_size=8 * 1024)
    gone = [first.prefixes[1], first.prefixes[5]]
    dry = cli("remove", "--dry-run", "--json", url, *gone)
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["out"] == url
    assert objects_of(url) == files_of(local)  # a dry run changes nothing
    remove(local, gone)
    result = cli("remove", "-q", url, *gone)
    assert result.exit_code == 0, result.output
    assert edited_objects(url) == files_of(local)
    removed = b"".join(Path(p + ".bin").read_bytes() for p in gone)
    assert len(removed) > 64
    assert any(removed[:64] in data for data in objects_of(url).values())  # kept for readers
    result = cli("gc", url, "--older-than", "0")
    assert result.exit_code == 0, result.output
    ours = objects_of(url)
    # the replaced shards and the old index left the bucket; the record stays, as a tombstone
    assert {k: v for k, v in ours.items() if not k.startswith(".superseded/")} == files_of(local)
    assert all(removed[:64] not in data for data in ours.values())
    assert verify(url, sources=True).ok
    result = cli("remove", "-q", url, gone[0])
    assert result.exit_code != 0 and "not a source of this repack" in result.output


def test_remove_on_s3_killed_after_its_commit_is_finished_by_the_rerun(
    s3, tmp_path, cache, monkeypatch
):
    """The recovery record ``.work/remove.json`` of a local remove, on a bucket: a remove
    killed once the manifest was replaced, run again, deletes what it left and reports the
    sources as removed (not as unknown)."""
    from repack.merge.remove import remove
    from repack.store.s3 import S3Store

    first = make_blend(tmp_path / "a", 8, seed=81)
    local = tmp_path / "local"
    merge(first.flat_json, local, shard_size=8 * 1024)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(first.flat_json, url, shard_size=8 * 1024)
    gone = [first.prefixes[2], first.prefixes[3]]
    remove(local, gone)
    before = open_store(url).get(fmt.MANIFEST_FILE, 1 << 20)[0]
    real = S3Store.delete

    def killed(store, key):
        if key.startswith("shard-"):  # the first delete after the manifest was replaced
            raise KeyboardInterrupt
        return real(store, key)

    monkeypatch.setattr(S3Store, "delete", killed)
    with pytest.raises(KeyboardInterrupt):
        remove(url, gone, now=True, keep_superseded=0)
    monkeypatch.setattr(S3Store, "delete", real)
    left = objects_of(url)
    assert left[fmt.MANIFEST_FILE] == files_of(local)[fmt.MANIFEST_FILE] != before
    assert ".work/remove.json" in left and left != files_of(local)
    result = cli("remove", "--json", "--now", url, *gone)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["already_removed"] == gone
    assert edited_objects(url) == files_of(local)


# --- readers ---------------------------------------------------------------------------------


def test_read_only_credential_reads_but_cannot_write(s3, blend, tmp_path, cache):
    from s3_support import server_env

    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(blend.flat_json, url, shard_size=64 * 1024)
    other = f"s3://{url.split('/')[2]}/y.repack"
    with server_env(s3, read_only=True):
        assert verify(url).ok
        result = cli("extract", "-q", url, blend.prefixes[3], str(tmp_path / "x"))
        assert result.exit_code == 0, result.output
        result = cli("merge", *OPTIONS, str(blend.flat_json), other)
        assert result.exit_code != 0
        assert result.output.startswith("Error: ") and "access denied" in result.output
    assert objects_of(other) == {}


def test_repack_replaced_while_read_fails_loudly(s3, blend, cache):
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(blend.flat_json, url, shard_size=64 * 1024)
    repack = Repack(url, backend="pread")
    before = bytes(repack.read_bytes(1, 0, 64))
    store = open_store(url)
    data = bytearray(store.get("shard-00001.bin", 1 << 30)[0])
    data[-1] ^= 1  # another version of the same size (same bytes would keep their ETag)
    store.put("shard-00001.bin", bytes(data))
    with pytest.raises(ObjectChanged, match="replaced on the server"):
        repack.read_bytes(1, 0, 64)
    assert bytes(Repack(url, backend="pread").read_bytes(1, 0, 64)) == before


def test_index_fetched_once_per_node(s3, blend, cache):
    from s3_support import RequestCounter

    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(blend.flat_json, url, shard_size=64 * 1024)
    with RequestCounter() as cold:
        Repack(url)
    with RequestCounter() as warm:
        Repack(url)
    shards = len(Repack(url).manifest.shards)
    assert warm.counts == {"GetObject": 1, "HeadObject": shards}  # manifest; pins
    assert cold.counts == {"GetObject": 2, "HeadObject": shards}  # + the index, once
    assert len(list((cache / "objects").iterdir())) == 1


def _warm_open_requests(s3, blend) -> dict:
    from s3_support import RequestCounter

    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(blend.flat_json, url)  # one shard per dtype
    Repack(url)  # cold: fetches the index into the cache
    with RequestCounter() as warm:
        Repack(url)
    return dict(warm.counts)


def test_requests_at_open_do_not_grow_with_sources(s3, demo_blend, tmp_path, cache):
    few = _warm_open_requests(s3, make_blend(tmp_path / "b30", 30, seed=30))
    many = _warm_open_requests(s3, demo_blend)  # 300 sources
    assert few == many == {"GetObject": 1, "HeadObject": 2}


@pytest.mark.slow
def test_requests_at_open_do_not_grow_from_300_to_3000_sources(s3, demo_blend, tmp_path, cache):
    few = _warm_open_requests(s3, demo_blend)
    many = _warm_open_requests(s3, make_blend(tmp_path / "b3000", 3000, seed=3))
    assert few == many == {"GetObject": 1, "HeadObject": 2}


def test_server_gone_mid_read_is_a_clear_error(blend, tmp_path, cache):
    from s3_support import server_env, start_server

    server = start_server(tmp_path / "private-server")
    try:
        with server_env(server):
            url = f"s3://{server.new_bucket()}/x.repack"
            merge(blend.flat_json, url, shard_size=64 * 1024)
            repack = Repack(url, backend="pread")
            server.stop()
            os.environ["AWS_MAX_ATTEMPTS"] = "1"
            try:
                with pytest.raises(StoreError, match=r"^s3://.*/shard-00000.bin: cannot read: "):
                    repack.read_bytes(0, 0, 64)
                dest = tmp_path / "out"
                result = cli("extract", "-q", url, blend.prefixes[0], str(dest))
            finally:
                del os.environ["AWS_MAX_ATTEMPTS"]
            assert result.exit_code != 0
            assert result.output.startswith("Error: s3://"), result.output
            assert "Traceback" not in result.output
            assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "private-server"]
    finally:
        server.stop()


# --- fingerprints ----------------------------------------------------------------------------


def test_doctor_on_s3_reports_duplicates_from_the_fingerprints(s3, make_source, tmp_path, cache):
    """A merge to a bucket writes the fingerprint file; the doctor finds a copied source
    from it, without reading a token (as on a folder)."""
    import numpy as np

    rng = np.random.default_rng(18)
    sequences = [rng.integers(0, 500, int(n)) for n in rng.integers(5, 60, 40)]
    a = make_source("data/a", sequences)
    copy = make_source("copies/a", sequences)
    other = make_source("data/b", [rng.integers(0, 500, 30) for _ in range(40)])
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps([1, a, 1, copy, 1, other]))
    url = f"s3://{s3.new_bucket()}/x.repack"
    local = tmp_path / "local"
    for out in (url, local):
        merge(blend, out, shard_size=16 * 1024)
    assert objects_of(url) == files_of(local)
    args = ("--seq-length", "16", "--split", "90,10,0", "--train-iters", "10")
    args += ("--global-batch-size", "4", "-q")
    result = cli("doctor", url, *args)
    assert f"WARNING [identical-sources] {copy}: a byte-identical copy of {a}" in result.output
    assert "Duplicates (exact, from fingerprints):" in result.output
    assert "duplicates (exact, from fingerprints): " in cli("inspect", url).output


def test_verify_on_s3_checks_the_fingerprint_object(s3, blend, cache):
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(blend.flat_json, url, shard_size=64 * 1024)
    assert verify(url).ok
    # the doctor reads the file from the node cache: verify must read the server's object
    cli("doctor", url, "--seq-length", "64", "-q")
    store = open_store(url)
    data = bytearray(store.get(fmt.fingerprint_name(0), 1 << 30)[0])
    data[-3] ^= 0xFF
    store.put(fmt.fingerprint_name(0), bytes(data))
    report = verify(url)
    stored = Repack(url).manifest.raw[fmt.FINGERPRINT_MEMBER]["checksum"]
    assert [(p.file, p.message.split(",")[0]) for p in report.problems] == [
        (fmt.fingerprint_name(0), f"stored checksum {stored}")
    ]


def test_fingerprint_command_on_s3(s3, blend, tmp_path, cache):
    """``repack fingerprint s3://...`` on a repack written without them: the objects of the
    same command on a folder, the old manifest replaced conditionally."""
    url = f"s3://{s3.new_bucket()}/x.repack"
    local = tmp_path / "local"
    for out in (url, local):
        merge(blend.flat_json, out, shard_size=64 * 1024, fingerprints=False)
    assert "no fingerprints (" in cli("inspect", url).output
    result = cli("fingerprint", "-q", "--json", url)
    assert result.exit_code == 0, result.output
    assert cli("fingerprint", "-q", str(local)).exit_code == 0
    assert objects_of(url) == files_of(local)
    assert verify(url).ok
    assert sorted(os.listdir(tmp_path)) == ["cache", "local"]  # no folder named "s3:"


def test_add_on_s3_refuses_to_drop_a_damaged_fingerprint_object(s3, tmp_path, cache):
    """As on a folder: a fingerprint object that fails its check stops the add (which
    would otherwise write a repack without them), the manifest untouched."""
    first = make_blend(tmp_path / "a", 6, seed=33)
    second = make_blend(tmp_path / "b", 3, seed=34)
    url = f"s3://{s3.new_bucket()}/x.repack"
    merge(first.flat_json, url, shard_size=16 * 1024)
    store = open_store(url)
    data = bytearray(store.get(fmt.fingerprint_name(0), 1 << 30)[0])
    data[-3] ^= 0xFF
    store.put(fmt.fingerprint_name(0), bytes(data))
    before = store.get(fmt.MANIFEST_FILE, 1 << 30)[0]
    result = cli("add", "-q", url, str(second.flat_json))
    assert result.exit_code != 0
    assert "fingerprints would be lost" in result.output, result.output
    assert store.get(fmt.MANIFEST_FILE, 1 << 30)[0] == before
