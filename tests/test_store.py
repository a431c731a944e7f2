"""The storage layer (repack/store/): the location rule, and every store's contract, checked
on a local folder and on a real S3 server (SeaweedFS, tests/s3_support.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.errors import (
    MissingExtra,
    ObjectChanged,
    ObjectExists,
    ObjectMissing,
    ShortRead,
    StoreError,
    UnsupportedLocation,
)
from repack.store import LocalStore, is_url, open_store, scheme_of

HAVE_BOTO3 = importlib.util.find_spec("boto3") is not None


# --- the location rule ---------------------------------------------------------------------


def test_scheme_of():
    assert scheme_of("s3://bucket/x") == "s3"
    assert scheme_of("MSC://p/x") == "msc"
    assert scheme_of("/data/x.repack") is None
    assert scheme_of("relative/s3:/x") is None
    assert scheme_of(Path("s3://x")) is None  # a Path is always a path
    assert is_url("gs://b/x") and not is_url("out")


def test_local_paths_are_local_stores(tmp_path):
    store = open_store(tmp_path / "x")
    assert isinstance(store, LocalStore) and store.local
    assert store.location == str(tmp_path / "x")


@pytest.mark.parametrize("url", ["gs://bucket/x.repack", "file:///tmp/x", "hdfs://n/x"])
def test_unknown_scheme_refused(url):
    with pytest.raises(UnsupportedLocation, match="unknown scheme"):
        open_store(url)


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_merge_to_a_url_never_writes_a_local_folder(tmp_path, demo_blend, monkeypatch, scheme):
    """The data-loss-class bug: ``repack merge BLEND s3://bucket/x.repack`` wrote a folder
    ``s3:`` in the working folder. A URL is written to object storage or refused."""
    monkeypatch.chdir(tmp_path)
    if scheme == "s3" and HAVE_BOTO3:
        # no server at this endpoint: the merge must fail on the network, not write locally
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    result = CliRunner().invoke(
        main, ["merge", "-q", str(demo_blend.flat_json), f"{scheme}://bucket/x.repack"]
    )
    assert result.exit_code != 0
    assert result.output.startswith("Error: "), result.output
    assert "Traceback" not in result.output
    assert os.listdir(tmp_path) == []  # no folder "s3:" or "gs:"


@pytest.mark.skipif(HAVE_BOTO3, reason="checks the message shown without boto3")
def test_s3_without_boto3_names_the_extra():
    with pytest.raises(MissingExtra, match=r"pip install 'megatron-repack\[s3\]'"):
        open_store("s3://bucket/x")


def test_s3_without_boto3_names_the_extra_in_a_fresh_interpreter(tmp_path):
    """Whatever this environment has: with boto3 hidden, a URL gets one clear error."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "boto3.py").write_text("raise ImportError('hidden by the test')\n")
    (hide / "botocore.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-m", "repack", "inspect", "s3://bucket/x.repack"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert result.stderr.strip() == (
        "Error: s3:// locations need boto3, which is not installed: "
        "pip install 'megatron-repack[s3]'"
    )
    assert sorted(os.listdir(tmp_path)) == ["hide"]


# --- the contract, on every store --------------------------------------------------------


@pytest.fixture(params=["local", "s3", "msc"])
def store(request, tmp_path, monkeypatch):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    server = request.getfixturevalue("s3")
    if request.param == "s3":
        return open_store(f"s3://{server.new_bucket()}/some/prefix.repack")
    from s3_support import missing, msc_profile

    if importlib.util.find_spec("multistorageclient") is None:
        missing("multi-storage-client not installed: pip install -e '.[msc]'")
    monkeypatch.setenv("MSC_CONFIG", "")  # msc_profile sets it; restored after the test
    root = msc_profile(server, tmp_path, server.new_bucket())
    return open_store(f"{root}/some/prefix.repack")


def test_put_get_read_stat(store):
    assert store.stat("a.json") is None
    put = store.put("a.json", b"hello world")
    data, stat = store.get("a.json", 1024)
    assert data == b"hello world" and stat == put == store.stat("a.json")
    assert store.read("a.json", 6, 5) == b"world"
    assert store.read("a.json", 0, 0) == b""
    with pytest.raises(ShortRead):
        store.read("a.json", 6, 6)
    with pytest.raises(StoreError, match="limit"):
        store.get("a.json", 4)
    with pytest.raises(ObjectMissing):
        store.get("nope", 10)
    with pytest.raises(ObjectMissing):
        store.read("nope", 0, 1)


def test_read_pinned_by_etag(store):
    first = store.put("k", b"one")
    assert store.read("k", 0, 3, etag=first.etag) == b"one"
    store.put("k", b"two")
    with pytest.raises(ObjectChanged):
        store.read("k", 0, 3, etag=first.etag)


def test_create_only_once(store):
    store.create(".work/m", b"first")
    with pytest.raises(ObjectExists):
        store.create(".work/m", b"second")
    assert store.get(".work/m", 100)[0] == b"first"


def test_create_race_has_one_winner(store):
    def attempt(i: int) -> bool:
        try:
            store.create("manifest.json", f"writer {i}".encode())
            return True
        except ObjectExists:
            return False

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(attempt, range(8)))
    assert won.count(True) == 1
    data, _ = store.get("manifest.json", 100)
    assert data == f"writer {won.index(True)}".encode()


def test_replace_conditional(store):
    first = store.put("m", b"v1")
    second = store.replace("m", b"v2", first.etag)
    with pytest.raises(ObjectChanged):
        store.replace("m", b"v3", first.etag)  # a writer that read v1 is refused
    assert store.get("m", 10)[0] == b"v2"
    store.replace("m", b"v3", second.etag)
    store.delete("m")
    with pytest.raises(ObjectChanged):
        store.replace("m", b"v4", second.etag)


def test_writer_streams_and_commits_atomically(store, monkeypatch):
    import repack.store.s3 as s3

    monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)  # S3's smallest part
    pieces = [os.urandom(1 << 20) for _ in range(12)]
    writer = store.writer("shard-00000.bin")
    for piece in pieces[:6]:
        writer.write(piece)
    assert store.stat("shard-00000.bin") is None  # nothing visible before commit
    for piece in pieces[6:]:
        writer.write(memoryview(piece))
    stat = writer.commit()
    assert stat.size == 12 << 20
    assert store.get("shard-00000.bin", 13 << 20)[0] == b"".join(pieces)
    aborted = store.writer("shard-00001.bin")
    aborted.write(b"x" * (6 << 20))
    aborted.abort()
    assert store.stat("shard-00001.bin") is None


def test_list_and_delete(store):
    for name in ("b", "a", ".work/p", ".work/q/r"):
        store.put(name, name.encode())
    assert [k for k, _ in store.list()] == [".work/p", ".work/q/r", "a", "b"]
    assert [k for k, _ in store.list(".work/")] == [".work/p", ".work/q/r"]
    assert dict(store.list())["a"].size == 1
    store.delete("a")
    store.delete("a")  # absent: no error
    assert [k for k, _ in store.list()] == [".work/p", ".work/q/r", "b"]


# --- S3 specifics ---------------------------------------------------------------------------


def test_read_only_credential_reads_but_cannot_write(s3):
    from s3_support import server_env

    bucket = s3.new_bucket()
    open_store(f"s3://{bucket}/r").put("x", b"data")
    with server_env(s3, read_only=True):
        store = open_store(f"s3://{bucket}/r")
        assert store.get("x", 10)[0] == b"data"
        with pytest.raises(StoreError, match="access denied"):
            store.put("y", b"no")
        with pytest.raises(StoreError, match="access denied"):
            store.create("manifest.json", b"no")
    assert open_store(f"s3://{bucket}/r").stat("y") is None


def test_one_client_per_process_and_fork(s3):
    from repack.store import s3 as s3mod

    first = s3mod.client()
    assert s3mod.client() is first
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, b"1" if s3mod.client() is not first else b"0")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"  # the child made its own
    os.close(read)


def test_requests_counted(s3):
    from s3_support import RequestCounter

    store = open_store(f"s3://{s3.new_bucket()}/c")
    store.put("x", b"12345678")
    with RequestCounter() as counter:
        store.read("x", 0, 4)
        store.read("x", 4, 4)
        store.stat("x")
    assert counter.counts == {"GetObject": 2, "HeadObject": 1}


def test_server_gone_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    if not HAVE_BOTO3:
        pytest.skip("boto3 not installed")
    store = open_store("s3://bucket/x")
    with pytest.raises(StoreError, match=r"^s3://bucket/x/manifest.json: cannot read: "):
        store.get("manifest.json", 10)


def test_sources_of_an_unknown_scheme_are_refused_clearly(tmp_path, make_source, monkeypatch):
    """A blend naming a ``gs://`` prefix: the URL is kept as written (never joined to the
    blend's folder) and refused with one line, as a bad source (tests/test_objstore_sources.py
    merges from ``s3://`` and ``msc://`` ones)."""
    monkeypatch.chdir(tmp_path)
    local = make_source("a", [[1, 2, 3]])
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps([0.5, local, 0.5, "gs://bucket/data/web-00001"]))
    result = CliRunner().invoke(main, ["merge", "-q", str(blend), str(tmp_path / "out")])
    assert result.exit_code == 3
    assert result.output == (
        "Error: gs://bucket/data/web-00001: unknown scheme 'gs://'; repack reads and writes "
        "local folders, s3://BUCKET/KEY and msc://PROFILE/PATH\n"
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "gs:").exists()


def test_extract_to_a_url_is_refused(demo_repack, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        main, ["extract", "-q", str(demo_repack), "data/web/cc-00000", "gs://b/x"]
    )
    assert result.exit_code == 3
    assert result.output.startswith("Error: gs://b/x: unknown scheme")
    result = CliRunner().invoke(
        main, ["extract", "-q", str(demo_repack), "data/web/cc-00000", "s3://b/x"]
    )
    assert result.exit_code == 3
    if HAVE_BOTO3:
        assert result.output == (
            "Error: s3://b/x: DEST_PREFIX must be a local path (object storage is not "
            "supported there)\n"
        )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("size", [0, 1, 65536, 65537, 300_001])
def test_frame_writer_is_compress_file_byte_for_byte(tmp_path, size):
    """What a merge to object storage streams is what a local merge compresses."""
    import numpy as np

    from repack.format.codec import FrameWriter, compress_file

    raw = tmp_path / "raw"
    rng = np.random.default_rng(size)
    raw.write_bytes(rng.integers(0, 50, size, dtype=np.uint8).tobytes())
    compress_file(str(raw), str(tmp_path / "local.zst"), 5)
    out = bytearray()
    frames = FrameWriter(out.extend, 5)
    data = raw.read_bytes()
    for start in range(0, size, 7777):  # pieces that do not line up with the blocks
        frames.write(memoryview(data)[start : start + 7777])
    assert frames.finish() == len(out)
    assert bytes(out) == (tmp_path / "local.zst").read_bytes()


def test_a_missing_server_fails_in_ci_and_skips_elsewhere(monkeypatch):
    from s3_support import missing

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI=true: the object-storage tests must run"):
        missing("weed (SeaweedFS) not installed")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="weed"):
        missing("weed (SeaweedFS) not installed")


# --- requests ahead ----------------------------------------------------------------------------


def test_ordered_keeps_the_order_bounds_what_is_in_flight_and_raises_in_turn():
    import threading
    import time

    from repack.store.ahead import ordered

    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    def job(i: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(0.002 * (i % 4))  # later jobs finish first
        with lock:
            running[0] -= 1
        if i == 30:
            raise ValueError("job 30")
        return i

    results = ordered(((10, lambda i=i: job(i)) for i in range(40)), requests=6, budget=1000)
    got = []
    with pytest.raises(ValueError, match="job 30"):
        for value in results:
            got.append(value)
    assert got == list(range(30))
    assert 1 < running[1] <= 6
    deadline = time.monotonic() + 10
    while running[0] and time.monotonic() < deadline:  # the jobs that were running end
        time.sleep(0.01)
    running[1] = 0
    small = ordered(((10, lambda i=i: job(i)) for i in range(8)), requests=6, budget=20)
    assert list(small) == list(range(8))
    # two jobs of 10 bytes fill a budget of 20; the one awaited counts until its result is in
    assert running[1] <= 2


def test_ordered_counts_the_job_awaited_until_its_result_is_in():
    """While the caller waits for a job that is still running, no job starts beyond the
    bound: at most ``requests`` run at once (it let one more start, seen under load)."""
    import threading

    from repack.store.ahead import ordered

    release = threading.Event()
    lock = threading.Lock()
    running = [0, 0]

    def job(i: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        release.wait(10)  # every job started runs until released: all are counted at once
        with lock:
            running[0] -= 1
        return i

    results = ordered(((1, lambda i=i: job(i)) for i in range(20)), requests=3, budget=1000)
    threading.Timer(0.3, release.set).start()
    assert list(results) == list(range(20))
    assert running[1] <= 3
