"""Sources on object storage: a blend naming ``s3://`` (and ``msc://``) prefixes, as
Megatron-LM's main branch accepts, merged into a local folder or a bucket, against a real S3
server (SeaweedFS on 127.0.0.1, tests/s3_support.py). What is written is what the merge of
the same sources as local files writes, byte for byte (the manifest up to the paths it
records); ``verify --sources`` and ``doctor BLEND`` read such blends too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from s3_support import edited_objects

from repack.cli import main
from repack.errors import SourceError, StoreError
from repack.format import spec as fmt
from repack.merge import execute, merge, prepare, shards
from repack.read.verify import verify
from repack.store import open_store
from repack.synth import make_blend

SHARD = 16 * 1024
OPTIONS = ("-q", "--shard-size", "16KiB")


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    # sizes up to 16 KB, 16 KiB shards: sources cut across shards, documents across pieces
    return make_blend(tmp_path_factory.mktemp("srcblend"), 30, seed=18, multimodal_fraction=0.1)


@pytest.fixture(scope="module")
def local_blend(blend) -> Path:
    """The blend with absolute local prefixes (the weights and order of ``blend``)."""
    return _write_blend(blend, blend.root / "local.json", str(blend.root))


def _write_blend(blend, path: Path, root: str) -> Path:
    items = json.loads(blend.flat_json.read_text())
    out = []
    for weight, prefix in zip(items[::2], items[1::2]):
        absolute = os.path.normpath(os.path.join(blend.root, prefix))
        out += [weight, root + "/" + os.path.relpath(absolute, blend.root)]
    path.write_text(json.dumps(out))
    return path


@pytest.fixture(scope="module")
def reference(local_blend, tmp_path_factory) -> Path:
    """The merge of the local sources: what a merge of the same objects must write."""
    out = tmp_path_factory.mktemp("srcref") / "out"
    merge(local_blend, out, shard_size=SHARD)
    return out


def upload_sources(blend, url_root: str) -> None:
    for prefix in blend.prefixes:
        store, name = open_store(url_root), os.path.relpath(prefix, blend.root)
        for ext in (".bin", ".idx"):
            store.put(name + ext, Path(prefix + ext).read_bytes())


@pytest.fixture
def remote(s3, blend, tmp_path):
    """The sources uploaded to a new bucket, and the blend naming them by URL."""
    root = f"s3://{s3.new_bucket()}/src"
    upload_sources(blend, root)
    return root, _write_blend(blend, tmp_path / "remote.json", root)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("REPACK_CACHE_DIR", str(folder))
    return folder


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def objects_of(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {key: store.get(key, 1 << 30)[0] for key, _ in store.list()}


def comparable(manifest: bytes, url_root: str, local_root: str) -> dict:
    """A manifest with the paths of its sources as local ones, without its self-checksum
    and the paths of the blend files (which differ with the paths)."""
    data = json.loads(manifest)
    data.pop("checksum")
    for blend in (data["blend"], *data.get("appended", ())):
        blend.pop("source")
    return json.loads(json.dumps(data).replace(url_root, local_root))


def assert_same_repack(ours: dict[str, bytes], reference: Path, url_root: str, blend) -> None:
    theirs = files_of(reference)
    assert sorted(ours) == sorted(theirs)
    assert any(fmt.is_fingerprint_name(name) for name in ours)
    for name in theirs:
        if name != fmt.MANIFEST_FILE:
            assert ours[name] == theirs[name], name
    assert comparable(ours[fmt.MANIFEST_FILE], url_root, str(blend.root)) == comparable(
        theirs[fmt.MANIFEST_FILE], url_root, str(blend.root)
    )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_merge_from_s3_into_a_folder_is_the_merge_of_the_local_files(
    remote, blend, reference, tmp_path, monkeypatch, workers
):
    import repack.store.prefixes

    monkeypatch.setattr(repack.store.prefixes, "PIECE", 1000)  # segments of several GETs
    root, url_blend = remote
    out = tmp_path / "out"
    # (--workers 2: shards copied by spawned processes, each with its own client)
    result = cli("merge", *OPTIONS, "--workers", workers, str(url_blend), str(out))
    assert result.exit_code == 0, result.output
    assert_same_repack(files_of(out), reference, root, blend)
    sources = json.loads((out / fmt.MANIFEST_FILE).read_text())["sources"]
    assert sources[0]["path"].startswith(root + "/")  # recorded as written in the blend


@pytest.mark.parametrize("workers", ["1", "3"])
def test_merge_from_s3_into_a_bucket_is_the_merge_of_the_local_files(
    remote, s3, blend, reference, workers
):
    root, url_blend = remote
    url = f"s3://{s3.new_bucket()}/x.repack"
    result = cli("merge", *OPTIONS, "--workers", workers, str(url_blend), url)
    assert result.exit_code == 0, result.output
    assert_same_repack(objects_of(url), reference, root, blend)


def test_verify_sources_and_doctor_on_a_blend_on_s3(remote, blend, reference, tmp_path, cache):
    import repack.store.objects as store_objects

    root, url_blend = remote
    url = f"{root.rsplit('/', 1)[0]}/x.repack"
    merge(url_blend, url, shard_size=SHARD)
    out = tmp_path / "out"
    merge(url_blend, out, shard_size=SHARD)
    for target in (url, str(out)):
        report = verify(target, sources=True)
        assert report.ok, report.problems
        assert report.originals_compared == len(blend.prefixes)
        assert not report.originals_missing
    # the doctor reads a blend of objects as one of files (--duplicates reads no token of
    # a repack: its fingerprints)
    args = ("--seq-length", "64", "--split", "90,5,5", "--train-iters", "10")
    args += ("--global-batch-size", "8", "--json", "-q")
    ours = cli("doctor", str(url_blend), *args)
    local_blend = blend.root / "local.json"
    theirs = cli("doctor", str(local_blend), *args)
    assert ours.exit_code == theirs.exit_code, ours.output
    assert ours.output.replace(root, str(blend.root)).replace(str(url_blend), "BLEND") == (
        theirs.output.replace(str(local_blend), "BLEND")
    )
    # --duplicates on a plain blend reads the tokens: the objects' ranged GETs
    ours = cli("doctor", str(url_blend), "--duplicates", *args)
    theirs = cli("doctor", str(local_blend), "--duplicates", *args)
    assert ours.exit_code == theirs.exit_code, ours.output
    found = json.loads(ours.output)["duplicates"]
    assert found == json.loads(theirs.output)["duplicates"] and found["origin"] == "tokens"
    on_s3 = json.loads(cli("doctor", url, *args).output)
    on_disk = json.loads(cli("doctor", str(out), *args).output)
    assert on_s3["duplicates"] == on_disk["duplicates"] and on_s3["duplicates"]
    # an original changed on the server, one deleted: found, as for local originals
    store, name = open_store(root), os.path.relpath(blend.prefixes[4], blend.root)
    data = bytearray(store.get(name + ".bin", 1 << 30)[0])
    data[len(data) // 2] ^= 0xFF
    store.put(name + ".bin", bytes(data))
    gone = os.path.relpath(blend.prefixes[9], blend.root)
    store.delete(gone + ".idx")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(store_objects, "PIECE", 1000)  # segments of several GETs
    try:
        for target in (url, str(out)):
            report = verify(target, sources=True)
            assert [(p.file, p.message) for p in report.problems] == [
                (
                    f"{root}/{name}",
                    f"original .bin differs from the repack at byte {len(data) // 2}",
                )
            ]
            assert report.originals_missing == [f"{root}/{gone}"]
            assert report.originals_compared == len(blend.prefixes) - 1
    finally:
        monkeypatch.undo()


def test_validation_is_one_get_and_one_head_per_source(remote, blend, local_blend):
    """What Megatron main's object-storage path costs at start, per prefix; the requests of
    many sources run several at once (the order of the results is the blend's)."""
    import threading
    import time

    from s3_support import RequestCounter

    _, url_blend = remote
    lock = threading.Lock()
    at_once = [0, 0]  # requests on the wire now, most at once

    def slow(**_):  # as a server 5 ms away
        with lock:
            at_once[0] += 1
            at_once[1] = max(at_once)
        time.sleep(0.005)
        with lock:
            at_once[0] -= 1

    with RequestCounter() as counter:
        counter._client.meta.events.register("before-send.s3", slow)
        try:
            prepared = prepare(url_blend, shard_size=1 << 30)  # no source cut: no re-read
        finally:
            counter._client.meta.events.unregister("before-send.s3", slow)
    n = len(blend.prefixes)
    assert counter.counts == {"GetObject": n, "HeadObject": n}
    assert at_once[1] > 1  # several sources at once
    local = prepare(local_blend, shard_size=1 << 30)
    assert prepared.idx_checksums == local.idx_checksums
    assert [s.bin_size for s in prepared.sources] == [s.bin_size for s in local.sources]
    assert all(s.bin_etag for s in prepared.sources)


def test_msc_sources(s3, blend, reference, tmp_path, monkeypatch):
    import importlib.util

    from s3_support import missing, msc_profile

    if importlib.util.find_spec("multistorageclient") is None:
        missing("multi-storage-client not installed: pip install -e '.[msc]'")
    monkeypatch.setenv("MSC_CONFIG", "")
    bucket = s3.new_bucket()
    upload_sources(blend, f"s3://{bucket}/src")
    root = msc_profile(s3, tmp_path, bucket) + "/src"
    url_blend = _write_blend(blend, tmp_path / "msc.json", root)
    out = tmp_path / "out"
    result = cli("merge", *OPTIONS, str(url_blend), str(out))
    assert result.exit_code == 0, result.output
    assert_same_repack(files_of(out), reference, root, blend)
    assert verify(str(out), sources=True).ok


def test_a_missing_source_is_one_clear_error(remote, blend, tmp_path):
    root, url_blend = remote
    name = os.path.relpath(blend.prefixes[3], blend.root)
    open_store(root).delete(name + ".idx")
    out = tmp_path / "out"
    result = cli("merge", *OPTIONS, str(url_blend), str(out))
    assert result.exit_code == 3
    assert result.output == f"Error: {root}/{name}.idx: .idx file not found\n"
    open_store(root).delete(os.path.relpath(blend.prefixes[5], blend.root) + ".bin")
    result = cli("merge", *OPTIONS, str(url_blend), str(out))
    assert result.exit_code == 3
    assert result.output.startswith(f"Error: {url_blend}: 2 of 30 sources cannot be used")
    assert f"  {root}/{name}.idx: .idx file not found\n" in result.output
    assert not out.exists()
    nobucket = _write_blend(blend, tmp_path / "nobucket.json", "s3://no-such-bucket-18/src")
    result = cli("merge", *OPTIONS, str(nobucket), str(out))
    assert result.exit_code == 3 and "Traceback" not in result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: s3://no-such-bucket-18/src/")
    assert lines[0].endswith(": bucket 'no-such-bucket-18' does not exist"), lines
    assert not out.exists()


def test_bad_credentials_are_one_clear_error(remote, tmp_path, monkeypatch):
    _, url_blend = remote
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    out = tmp_path / "out"
    result = cli("merge", *OPTIONS, str(url_blend), str(out))
    assert result.exit_code == 3
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: s3://"), result.output
    assert "access denied" in lines[0] and "check the credentials" in lines[0]
    assert not out.exists()


def test_a_source_replaced_during_the_merge_fails_loudly(remote, blend, s3, tmp_path):
    root, url_blend = remote
    prepared = prepare(url_blend, shard_size=SHARD)
    name = os.path.relpath(blend.prefixes[7], blend.root)
    store = open_store(root)
    data = bytearray(store.get(name + ".bin", 1 << 30)[0])
    data[0] ^= 1  # same size, another version
    store.put(name + ".bin", bytes(data))
    for out in (tmp_path / "out", f"s3://{s3.new_bucket()}/x.repack"):
        with pytest.raises(SourceError, match=rf"^{root}/{name}.bin: changed during the merge"):
            execute(prepared, out)
        assert fmt.MANIFEST_FILE not in (
            objects_of(out) if isinstance(out, str) else files_of(out) if out.exists() else {}
        )


def test_interrupted_merge_from_s3_resumes_to_identical_objects(
    remote, s3, blend, reference, monkeypatch
):
    root, url_blend = remote
    url = f"s3://{s3.new_bucket()}/x.repack"
    real = shards.write_shard
    calls = []

    def failing(store, prepared, shard, advance, *rest):
        calls.append(shard.number)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(store, prepared, shard, advance, *rest)

    monkeypatch.setattr(shards, "write_shard", failing)
    result = cli("merge", *OPTIONS, str(url_blend), url)
    assert result.exit_code != 0
    assert fmt.MANIFEST_FILE not in objects_of(url)
    monkeypatch.setattr(shards, "write_shard", real)
    result = cli("merge", "-q", "--json", "--resume", url)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["resumed_shards"] == 2
    assert_same_repack(objects_of(url), reference, root, blend)


def test_add_and_remove_with_sources_on_s3(s3, tmp_path, cache):
    """``add`` of a blend on S3 to a repack on S3 and in a folder, then ``remove``: the
    objects and files of the same commands on local sources, fingerprints carried."""
    from repack.merge.append import add
    from repack.merge.remove import remove

    first = make_blend(tmp_path / "a", 8, seed=181)
    second = make_blend(tmp_path / "b", 5, seed=182)
    root = f"s3://{s3.new_bucket()}/src"
    upload_sources(second, root)
    local_second = _write_blend(second, tmp_path / "second.json", str(second.root))
    url_second = _write_blend(second, tmp_path / "second-s3.json", root)
    reference, folder = tmp_path / "reference", tmp_path / "folder"
    url = f"s3://{s3.new_bucket()}/x.repack"
    for out in (reference, folder, url):
        merge(first.flat_json, out, shard_size=8 * 1024)
    add(reference, local_second)
    add(folder, url_second)
    add(url, url_second)
    assert_same_repack(files_of(folder), reference, root, second)
    assert_same_repack(edited_objects(url), reference, root, second)
    gone = [first.prefixes[1], second.prefixes[2]]
    remove(reference, gone)
    url_gone = [gone[0], f"{root}/{os.path.relpath(gone[1], second.root)}"]
    remove(folder, url_gone)
    remove(url, url_gone)
    assert_same_repack(files_of(folder), reference, root, second)
    assert_same_repack(edited_objects(url), reference, root, second)
    assert verify(url, sources=True).ok


def test_store_error_is_not_taken_for_a_bad_source(monkeypatch, tmp_path):
    """A server that cannot be reached is the server's error, said once, not a "bad source"
    per prefix."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    pytest.importorskip("boto3")
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps([1, "s3://b/x", 1, "s3://b/y"]))
    with pytest.raises(StoreError, match=r"^s3://b/(x|y)\.idx: cannot read: "):
        prepare(blend)


def test_a_read_only_credential_merges_sources_into_a_folder(
    remote, s3, blend, reference, tmp_path
):
    from s3_support import server_env

    root, url_blend = remote
    other = f"s3://{root.split('/')[2]}/x.repack"
    with server_env(s3, read_only=True):
        out = tmp_path / "out"
        result = cli("merge", *OPTIONS, str(url_blend), str(out))
        assert result.exit_code == 0, result.output
        result = cli("merge", *OPTIONS, str(url_blend), other)
        assert result.exit_code == 3 and "access denied" in result.output
    assert_same_repack(files_of(out), reference, root, blend)
    assert objects_of(other) == {}


def test_merge_from_s3_killed_at_random_moments_resumes_to_identical_objects(
    remote, s3, blend, reference, tmp_path
):
    """SIGKILL at random moments once the merge has planned: no manifest, or a complete
    repack; the same command again ends with the objects of an uninterrupted merge."""
    import random
    import signal
    import subprocess
    import sys
    import time

    root, url_blend = remote
    rng = random.Random(1818)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(3):
        url = f"s3://{s3.new_bucket()}/x.repack"
        command = [sys.executable, "-m", "repack", "merge", *OPTIONS, str(url_blend), url]
        process = subprocess.Popen(
            [*command, "--workers", "2"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        store = open_store(url)
        deadline = time.monotonic() + 60
        while store.stat(".work/plan.json") is None and process.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.5))
        process.send_signal(signal.SIGKILL)
        process.wait()
        if fmt.MANIFEST_FILE in objects_of(url):
            assert verify(url).ok
        subprocess.run(command, env=env, check=True, capture_output=True)
        assert_same_repack(objects_of(url), reference, root, blend)
        assert not s3.client().list_multipart_uploads(Bucket=url.split("/")[2]).get("Uploads")
