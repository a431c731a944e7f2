"""A repack that cannot be read is not a damaged one (issue 26): against the tests' real S3
server (SeaweedFS on 127.0.0.1, tests/s3_support.py), a wrong secret, an endpoint nothing
listens on and a bucket that does not exist make every command that reads a repack (verify
in text and --json, inspect, extract, add, remove, doctor) print one ``Error:`` line naming
the cause and exit 3, never ``DAMAGED``, and a missing bucket is called one, not "not a
complete repack". Beside them: a repack whose bytes are missing still is DAMAGED; a local
``repack verify`` names files through the errors' location, and a report says why it has
no fingerprints."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.errors import BucketMissing, FormatError, ObjectMissing, StoreError
from repack.merge import merge
from repack.read.verify import _file_of, verify
from repack.synth import make_blend


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return make_blend(tmp_path_factory.mktemp("verdicts"), 6, seed=3)


@pytest.fixture
def repack_url(s3, blend, tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "cache"))
    url = f"s3://{s3.new_bucket()}/x.repack"
    result = CliRunner().invoke(main, ["merge", "-q", str(blend.flat_json), url])
    assert result.exit_code == 0, result.output
    return url


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, never listening, then closed: nothing answers
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _commands(url: str, blend, tmp_path: Path) -> dict[str, list[str]]:
    name = json.loads(blend.flat_json.read_text())[1]
    return {
        "verify": ["verify", "-q", url],
        "verify --json": ["verify", "-q", "--json", url],
        "verify --sources": ["verify", "-q", "--sources", url],
        "inspect": ["inspect", url],
        "inspect --json": ["inspect", "--json", url],
        "extract": ["extract", "-q", url, name, str(tmp_path / "extracted" / "x")],
        "add": ["add", "-q", url, str(blend.flat_json)],
        "remove": ["remove", "-q", url, name],
        "doctor": [
            "doctor",
            url,
            "--seq-length",
            "64",
            "--train-iters",
            "10",
            "--global-batch-size",
            "4",
        ],
    }


def _run_all(url: str, blend, tmp_path: Path) -> dict[str, object]:
    return {
        label: CliRunner().invoke(main, args)
        for label, args in _commands(url, blend, tmp_path).items()
    }


def _assert_one_error_line(results: dict, expected: str) -> None:
    for label, result in results.items():
        lines = result.stderr.splitlines()
        assert result.exit_code == 3, (label, result.exit_code, result.output)
        assert len(lines) == 1 and lines[0].startswith("Error: "), (label, result.stderr)
        assert expected in lines[0], (label, lines[0])
        assert "DAMAGED" not in result.output and "FAIL" not in result.stdout, label
        if "--json" in label:
            error = json.loads(result.stdout)["error"]
            assert error["status"] == 3, (label, error)
            assert expected.removeprefix("Error: ") in error["message"], (label, error)


def test_a_wrong_secret_is_an_error_not_damage(s3, repack_url, blend, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    results = _run_all(repack_url, blend, tmp_path)
    _assert_one_error_line(results, "access denied")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
    assert verify(repack_url).ok  # nothing was changed, and the repack is intact


def test_a_closed_endpoint_is_an_error_not_damage(s3, repack_url, blend, tmp_path, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    # one attempt: what is tested is the verdict, not how long connections are retried
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    results = _run_all(repack_url, blend, tmp_path)
    _assert_one_error_line(results, f"127.0.0.1:{port}")


def test_a_missing_bucket_is_named_by_every_command(s3, blend, tmp_path):
    url = "s3://repack-no-such-bucket/x.repack"
    results = _run_all(url, blend, tmp_path)
    results["merge"] = CliRunner().invoke(main, ["merge", "-q", str(blend.flat_json), url])
    _assert_one_error_line(results, "bucket 'repack-no-such-bucket' does not exist")
    for result in results.values():
        assert "not a complete repack" not in result.stderr
    with pytest.raises(BucketMissing) as caught:
        verify(url)
    assert isinstance(caught.value, StoreError) and not isinstance(caught.value, ObjectMissing)
    assert caught.value.location == f"{url}/manifest.json"


def test_a_missing_bucket_is_named_through_msc(s3, tmp_path, monkeypatch):
    from s3_support import msc_profile

    pytest.importorskip("multistorageclient")
    monkeypatch.delenv("MSC_CONFIG", raising=False)  # restored after: msc_profile sets it
    url = msc_profile(s3, tmp_path, "repack-no-such-bucket-msc") + "/x.repack"
    results = {
        "verify": CliRunner().invoke(main, ["verify", "-q", url]),
        "verify --json": CliRunner().invoke(main, ["verify", "-q", "--json", url]),
        "inspect": CliRunner().invoke(main, ["inspect", url]),
    }
    _assert_one_error_line(results, "the bucket of MSC profile 'repack-no-such-bucket-msc'")


def test_a_missing_object_is_still_damage(s3, repack_url):
    """The other side of the line: the store answers, and an object of the repack is not
    there: DAMAGED, naming it, exit 1."""
    from repack.store import open_store

    store = open_store(repack_url)
    shard = next(key for key, _ in store.list() if key.startswith("shard-"))
    data = store.get(shard, 1 << 30)[0]
    for cut in (len(data) // 3, 0):  # truncated, empty: the shard named, not a crash
        store.put(shard, data[:cut])
        result = CliRunner().invoke(main, ["verify", "-q", repack_url])
        assert result.exit_code == 1, result.output
        assert f"FAIL {shard}: {cut} bytes, expected" in result.stdout, result.output
    store.delete(shard)
    result = CliRunner().invoke(main, ["verify", "-q", repack_url])
    assert result.exit_code == 1, result.output
    assert f"FAIL {shard}: " in result.stdout and "DAMAGED (1 problem)" in result.stdout
    store.delete("manifest.json")
    result = CliRunner().invoke(main, ["verify", "-q", "--json", repack_url])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["problems"][0]["file"] == "manifest.json"


# --- a report never drops a section for an error that is not the repack's ----------------------


def test_unreadable_fingerprints_are_an_error_not_an_absent_report(
    s3, repack_url, tmp_path, monkeypatch
):
    """inspect, the doctor and verify, with every read of the fingerprint file throttled: one
    Error line naming it, exit 3; not "no fingerprints" (inspect and the doctor said so,
    exit 0) nor DAMAGED (verify)."""
    from s3_faults import FaultProxy

    from repack.store import open_store

    [fingerprints] = [k for k, _ in open_store(repack_url).list() if k.endswith(".rpf")]
    with FaultProxy(s3.endpoint) as proxy:
        proxy.set(refuse=lambda method, path, headers: f"/{fingerprints}" in path)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        # one attempt: what is tested is the report, not how long throttling is retried
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        doctor = ["doctor", repack_url, "--seq-length", "64", "--train-iters", "10"]
        results = {
            "inspect": CliRunner().invoke(main, ["inspect", repack_url]),
            "inspect --json": CliRunner().invoke(main, ["inspect", "--json", repack_url]),
            "doctor": CliRunner().invoke(main, [*doctor, "--global-batch-size", "4"]),
            "verify": CliRunner().invoke(main, ["verify", "-q", repack_url]),
            "verify --json": CliRunner().invoke(main, ["verify", "-q", "--json", repack_url]),
        }
        assert proxy.counts["throttle"] >= len(results)  # premise: each was refused the file
        _assert_one_error_line(results, f"Error: {repack_url}/{fingerprints}: cannot ")
        for label, result in results.items():  # a GET's SlowDown, a HEAD's bare 503
            assert "SlowDown" in result.stderr or "503" in result.stderr, label
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        assert verify(repack_url).ok


# --- the location of an error is an attribute, never parsed out of its message -------------------


def test_verify_names_a_file_by_the_errors_location(tmp_path):
    out = tmp_path / "out"
    merge(make_blend(tmp_path / "src", 3, seed=1).flat_json, out)
    index = next(p for p in out.iterdir() if p.name.startswith("index"))
    data = bytearray(index.read_bytes())
    data[:8] = b"XXXXXXXX"  # the index's magic
    index.write_bytes(bytes(data))
    report = verify(out)
    problem = next(p for p in report.problems if p.file == index.name)
    assert problem.message.startswith("bad magic"), problem  # the location is not repeated
    # an error whose message happens to start with a path inside the folder, but that
    # carries no location, is about the folder: nothing is parsed out of its message
    assert _file_of(FormatError(f"{out}/index.rpx: made up"), str(out)) == str(out)
    located = FormatError(f"{out}/index.rpx: made up", location=f"{out}/index.rpx")
    assert _file_of(located, str(out)) == "index.rpx" and located.cause == "made up"


def test_a_stale_fingerprint_member_is_named_with_its_cause(tmp_path):
    from repack.read.fingerprints import Unusable, check_member, load_fingerprints
    from repack.read.reader import Repack

    out = tmp_path / "out"
    merge(make_blend(tmp_path / "src", 3, seed=1).flat_json, out)
    manifest = Repack(str(out)).manifest
    fingerprints = out / manifest.to_json()["fingerprints"]["file"]
    fingerprints.write_bytes(b"RPFX" + fingerprints.read_bytes()[4:])
    found = load_fingerprints(out, manifest)
    assert isinstance(found, Unusable) and found.path == str(fingerprints)
    assert found.cause.startswith("bad magic") and str(found) == f"{fingerprints}: {found.cause}"
    assert check_member(str(out), manifest) is None
    problem = next(p for p in verify(out).problems if p.file == fingerprints.name)
    assert not problem.message.startswith(str(out))
