"""What comes back from S3 is checked, and what retrying cannot fix fails fast: the tests'
SeaweedFS behind the fault-injecting proxy (tests/s3_faults.py).

* ranged GETs answered with the whole object (``200``, no ``Content-Range``) after a cut, or
  always: every command gives the bytes of a run without faults; past the bound of bytes
  before the range, one ``Error:`` line saying the server ignored the range; never other
  bytes, never DAMAGED;
* a reply cut before its first byte, then the object replaced: a read pinned to the version
  opened fails with ``ObjectChanged``, an unpinned read reads the new version whole;
* an endpoint that is not there (a closed port, a host name that does not resolve): one
  ``Error:`` line within seconds for every command and the loader; TLS and URL errors are
  not retried; ``409 ConditionalRequestConflict`` is; a server that goes away in the middle
  of a merge and comes back is waited for; after a stall one probe per quarter of the bound.

The loader through the same faults: tests/test_objstore_loader.py.
"""

# ruff: noqa: F811  (the fixtures of test_objstore_faults, imported, are arguments here)
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from test_objstore_faults import (  # noqa: F401
    OPTIONS,
    _compare,
    _merged,
    blends,
    cli,
    fast,
    objects_of,
    proxy,
    reference,
    sequence,
    through,
)

from repack.errors import ObjectChanged, ShortRead, Stalled, StoreError
from repack.store import open_store, retry
from repack.store import s3 as s3_store

# --- ranged replies answered whole ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_ranged_gets_answered_whole_after_a_cut(s3, through, blends, reference, tmp_path, seed):
    through.set(seed=seed, cut=0.3, whole="after-cut")
    url = f"s3://{s3.new_bucket()}/x.repack"
    found = sequence(url, blends, tmp_path)
    counts = dict(through.counts)
    through.set()
    assert counts["whole"] > 3, counts  # premise: resumed reads were answered whole
    _compare(found, reference)


def test_ranged_gets_always_answered_whole(s3, through, blends, reference, tmp_path):
    through.set(whole="always")
    url = f"s3://{s3.new_bucket()}/x.repack"
    found = sequence(url, blends, tmp_path)
    counts = dict(through.counts)
    through.set()
    assert counts["whole"] > 10, counts
    _compare(found, reference)


def test_a_range_ignored_too_far_in_is_one_error_line(s3, through, blends, tmp_path, monkeypatch):
    """Past ``WHOLE_REPLY_SKIP`` bytes before the range (none here), a whole reply is
    refused: verify and extract end with one line saying the server ignored the range, never
    DAMAGED, never other bytes."""
    from repack.store import base, objects

    first = blends[0]
    url = _merged(s3, blends)
    monkeypatch.setattr(s3_store, "WHOLE_REPLY_SKIP", 0)  # any range not at 0
    for module in (base, objects):  # verify's reads of a shard: 16 KiB ranges
        monkeypatch.setattr(module, "PIECE", 16 * 1024)
    through.set(whole="always")
    results = [cli("verify", "-q", url)]
    for n, prefix in enumerate(first.prefixes):  # those not at the start of their shard fail
        result = cli("extract", "-q", url, prefix, str(tmp_path / f"x{n}"))
        if result.exit_code == 0:
            assert Path(f"{prefix}.bin").read_bytes() == (tmp_path / f"x{n}.bin").read_bytes()
        else:
            assert not (tmp_path / f"x{n}.bin").exists()
            results.append(result)
    assert len(results) > 5
    for result in results:
        lines = result.output.strip().splitlines()
        assert result.exit_code == 3, result.output
        assert len(lines) == 1 and lines[0].startswith(f"Error: {url}/"), result.output
        assert "the server ignored the range bytes=" in lines[0], lines[0]
        assert "DAMAGED" not in result.output
    through.set()
    assert cli("verify", "-q", url).exit_code == 0


def test_a_cut_before_the_first_byte_then_a_new_version(s3, through):
    """The first reply cut before any byte, the object replaced before the retry: a read
    pinned to the version opened is ``ObjectChanged`` naming it; a read of no version in
    particular (``get``) reads the new version whole; never a bare "precondition failed"."""
    url = f"s3://{s3.new_bucket()}/x.repack"
    store = open_store(url)
    old, new = b"old version " * 100, b"NEW VERSION " * 100
    stat = store.put("a.json", old)
    bucket, key = url.split("/")[2], "x.repack/a.json"
    direct = s3.client()
    cut = threading.Event()

    def first_get(method, path, headers):
        if path.split("?")[0].endswith("/a.json") and not cut.is_set():
            cut.set()
            return 0
        return None

    def replace(method, path, fault):
        if fault == "cut":
            direct.put_object(Bucket=bucket, Key=key, Body=new)

    through.set(cut=first_get, after=replace)
    with pytest.raises(ObjectChanged) as caught:
        store.read("a.json", 12, 24, stat.etag)
    assert str(caught.value).startswith(f"{url}/a.json: replaced on the server since it was")
    assert through.counts["cut"] == 1
    for read in (lambda: store.get("a.json", 1 << 20), lambda: store.read("a.json", 12, 24)):
        direct.put_object(Bucket=bucket, Key=key, Body=old)
        cut.clear()
        found = read()
        assert cut.is_set()
        expected = (new, store.stat("a.json")) if isinstance(found, tuple) else new[12:36]
        assert found == expected


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ({"ContentRange": "bytes 12-35/1200", "ContentLength": 24}, None),
        ({"ContentRange": "bytes 0-23/1200", "ContentLength": 24}, "answered bytes 0-23/1200"),
        ({"ContentRange": "bytes 12-40/1200", "ContentLength": 29}, "answered bytes 12-40"),
        ({"ContentLength": 24}, "answered no Content-Range"),
        ({"ContentRange": "bytes 12-19/20", "ContentLength": 8}, "20 bytes, a read of 24"),
    ],
)
def test_a_ranged_reply_must_hold_the_range_asked(reply, error):
    """``_span`` on the 206 replies a server could give to ``bytes=12-35``."""
    response = {"ResponseMetadata": {"HTTPStatusCode": 206}, **reply}
    if error is None:
        assert s3_store._span(response, "s3://b/k", "bytes=12-35", 12, 36, 12, 24) == (0, 24)
        return
    with pytest.raises((StoreError, ShortRead), match=error):
        s3_store._span(response, "s3://b/k", "bytes=12-35", 12, 36, 12, 24)


# --- what retrying cannot fix --------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: nothing listens there


def _every_command(url: str, blends, tmp_path: Path) -> dict[str, tuple[str, ...]]:
    first, second = blends
    return {
        "merge": ("merge", *OPTIONS, str(first.flat_json), url),
        "verify": ("verify", "-q", url),
        "inspect": ("inspect", url),
        "extract": ("extract", "-q", url, first.prefixes[3], str(tmp_path / "x")),
        "add": ("add", "-q", url, str(second.flat_json)),
        "remove": ("remove", "-q", url, first.prefixes[1]),
        "fingerprint": ("fingerprint", "-q", url),
        "doctor": (
            "doctor",
            url,
            "--seq-length",
            "64",
            "--train-iters",
            "10",
            "--global-batch-size",
            "8",
        ),
    }


@pytest.mark.parametrize("endpoint", ["closed port", "unknown host"])
def test_an_endpoint_not_there_fails_fast(s3, blends, tmp_path, monkeypatch, endpoint):
    """Every command and the loader: one ``Error:`` line naming the object, in seconds (the
    real policy's waits; 20 s is a generous bound for 2 attempts, about 1 s by hand)."""
    from repack.read.reader import open_repack

    host = f"127.0.0.1:{_closed_port()}" if endpoint == "closed port" else "nohost.invalid"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}")
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(retry, "_silence", retry._Silence())
    url = "s3://some-bucket/x.repack"
    for name, args in _every_command(url, blends, tmp_path).items():
        started = time.monotonic()
        result = cli(*args)
        took = time.monotonic() - started
        lines = result.output.strip().splitlines()
        assert result.exit_code != 0, (name, result.output)
        assert len(lines) == 1 and lines[0].startswith("Error: s3://some-bucket/"), (name, lines)
        assert "Could not connect to the endpoint URL" in lines[0], (name, lines)
        assert took < 20, (name, took)
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"^s3://some-bucket/x\.repack/manifest\.json: cannot "):
        open_repack(url)
    assert time.monotonic() - started < 20


def test_tls_and_url_errors_are_not_retried(s3, proxy, monkeypatch):
    """TLS spoken to a plain-HTTP port: one connection, one line; an endpoint that is no
    URL: one line naming the setting, not an internal error."""
    proxy.set()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint.replace("http://", "https://"))
    url = f"s3://{s3.new_bucket()}/x.repack"
    connections = proxy.counts["connections"]
    result = cli("inspect", url)
    assert result.exit_code == 3, result.output
    assert result.output.startswith(f"Error: {url}/manifest.json: cannot read: SSL"), result.output
    assert "attempts" not in result.output
    assert proxy.counts["connections"] == connections + 1
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not a url")
    result = cli("inspect", url)
    assert result.exit_code != 0
    assert result.output == (
        "Error: cannot use the S3 endpoint: Invalid endpoint: not a url (check "
        "AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or endpoint_url in the AWS config file)\n"
    )


def test_a_conditional_request_conflict_is_retried(s3, through, blends, reference):
    """409 ``ConditionalRequestConflict`` to the plan's and the manifest's conditional
    creates (twice each): S3 asks for a retry; the merge ends as without faults."""
    from s3_faults import conditional_put

    left = {".work/plan.json": 2, "/manifest.json": 2}

    def conflict(method, path, headers):
        for suffix, count in left.items():
            if count and conditional_put(suffix, "If-None-Match")(method, path, headers):
                left[suffix] -= 1
                return True
        return False

    through.set(refuse=conflict, refuse_with=409)
    url = f"s3://{s3.new_bucket()}/x.repack"
    result = cli("merge", *OPTIONS, str(blends[0].flat_json), url)
    refused = through.counts["refuse"]
    through.set()
    assert refused == 4, refused
    assert result.exit_code == 0, result.output
    assert objects_of(url) == reference["merge"]


def test_a_server_gone_in_the_middle_of_a_merge_is_waited_for(
    s3, through, blends, reference, monkeypatch
):
    """The proxy stops listening (connections refused, open ones dropped) after the merge's
    first requests, and comes back 3 s later: the merge waits for it and completes. With
    the real waits (not ``fast``'s): once the endpoint has answered, each wait is at least
    half its bound, so that the budget rides out a restart whatever the draw (3 s here, in
    4 attempts at most; 30 s by hand, in 6; the 10 attempts wait 55 s at least)."""
    monkeypatch.setattr(retry, "FIRST_DELAY", 1.0)
    monkeypatch.setattr(retry, "MAX_DELAY", 20.0)
    through.set(down_after=(8, 3.0))
    url = f"s3://{s3.new_bucket()}/x.repack"
    started = time.monotonic()
    result = cli("merge", *OPTIONS, str(blends[0].flat_json), url)
    took = time.monotonic() - started
    counts = dict(through.counts)
    through.set()
    assert counts["down"] == 1, counts
    assert result.exit_code == 0, result.output
    assert took > 3
    assert objects_of(url) == reference["merge"]


def test_a_refused_connection_waits_as_its_endpoint_says(monkeypatch):
    """The retry policy itself, on botocore's own error for a refused connection: two
    attempts for an endpoint that has not answered the process; the whole budget for one
    that has, each wait at least half its bound (10 attempts: 55 s of waits at least)."""
    pytest.importorskip("botocore", reason="botocore (the s3 extra) is not installed")
    import botocore.exceptions

    waits: list[float] = []
    monkeypatch.setattr(retry.interrupt, "pause", waits.append)
    monkeypatch.setattr(retry, "_silence", retry._Silence())
    monkeypatch.setattr(retry, "_answered", {"http://restarting:9000"})
    for endpoint, attempts in (("http://typo:9000", 2), ("http://restarting:9000", 10)):
        waits.clear()
        settings = retry.Policy(10, None, 120.0, "repack's default", endpoint)
        request = retry.Retry("s3://b/k", settings)
        refused = botocore.exceptions.EndpointConnectionError(endpoint_url=f"{endpoint}/b/k")
        with pytest.raises(botocore.exceptions.EndpointConnectionError):
            while True:
                request.begin()
                request.failed(refused)
        assert request.tried == attempts, endpoint
        bounds = [1, 2, 4, 8, 16, 20, 20, 20, 20][: attempts - 1]
        assert len(waits) == len(bounds)
        if attempts == 10:
            assert all(bound / 2 <= wait <= bound for wait, bound in zip(waits, bounds)), waits
            assert sum(waits) >= 55
        else:
            assert "the endpoint has not answered this process" in request.spent()


def test_after_a_stall_one_probe_per_quarter_of_the_bound(s3, through, monkeypatch):
    """After a request gave up on a silent server, the others fail at once, but one attempt
    (a probe) is made at most every quarter of the bound; once the server is back, the next
    probe finds it and every request goes on."""
    url = f"s3://{s3.new_bucket()}/x.repack"
    open_store(url).put("a.json", b"{}")
    monkeypatch.setenv("REPACK_S3_STALL_TIMEOUT", "2")  # a probe every 0.5 s at most
    store = open_store(url)
    through.set(frozen=True)
    with pytest.raises(Stalled, match=r"no answer from the server in"):
        store.stat("a.json")
    tried = through.counts["frozen"]
    failed_at_once = 0
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        started = time.monotonic()
        with pytest.raises(Stalled, match=r"a request of this process waited"):
            store.stat("a.json")
        failed_at_once += time.monotonic() - started < 0.1
        time.sleep(0.02)
    probes = through.counts["frozen"] - tried
    assert 1 <= probes <= 4, probes  # 2 s: at most one per 0.5 s, each waiting 0.5 s
    assert failed_at_once > 10
    through.set()  # the server is back
    time.sleep(0.6)
    assert store.stat("a.json") is not None  # the probe
    assert store.stat("a.json") is not None  # and every request after it
