"""Every command on a repack on S3 under faults: the tests' SeaweedFS behind a fault-injecting
proxy (tests/s3_faults.py) that throttles, cuts replies mid-body, loses the replies of
writes the server applied, or freezes.

* 20 % of requests throttled (``503 SlowDown``), 10 seeds: merge, verify, inspect, extract,
  add and remove give what the same commands give without faults (run once, straight to the
  server), byte for byte;
* replies cut mid-body, 10 seeds: the same;
* each conditional write (plan, manifest create, manifest replace by add and by remove,
  lease create, lease take-over, multipart complete) applied by the server, its reply lost,
  or answered ``500`` instead: exit 0, the repack of a run without faults, no object left
  behind, verify clean (the retried complete is answered ``404 NoSuchUpload``, as AWS does);
* a frozen server: each command ends with one ``Error:`` line naming the object and
  ``REPACK_S3_STALL_TIMEOUT`` (set to a few seconds here).

The Megatron loader through the proxy: tests/test_objstore_loader.py.
The waits between attempts are made short here (``retry.FIRST_DELAY``): the policy is the
same, only faster.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from s3_support import edited_objects

from repack.cli import main
from repack.merge import merge
from repack.store import open_store, retry
from repack.synth import make_blend

OPTIONS = ("-q", "--shard-size", "48KiB")
SEEDS = range(10)


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def objects_of(url: str) -> dict[str, bytes]:
    store = open_store(url)
    return {key: store.get(key, 1 << 30)[0] for key, _ in store.list()}


@pytest.fixture(scope="module")
def blends(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault-blends")
    return make_blend(root / "a", 16, seed=61), make_blend(root / "b", 6, seed=62)


@pytest.fixture(scope="module")
def proxy(s3_server):
    from s3_faults import FaultProxy, whole_reader

    with FaultProxy(s3_server.endpoint, whole_reader(s3_server.client())) as found:
        yield found


@pytest.fixture
def fast(monkeypatch, tmp_path):
    """Short waits between attempts, a node cache of the test's own, a fresh memory of
    silent servers."""
    monkeypatch.setattr(retry, "FIRST_DELAY", 0.01)
    monkeypatch.setattr(retry, "MAX_DELAY", 0.05)
    monkeypatch.setattr(retry, "_silence", retry._Silence())
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def through(s3, proxy, fast, monkeypatch):
    """The S3 environment pointed at the proxy (no faults until the test sets some)."""
    proxy.set()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    yield proxy
    proxy.set()


def _same_form(text: str, url: str) -> object:
    """A command's ``--json`` output with its location replaced, timings dropped."""
    data = json.loads(text.replace(url, "URL"))
    if isinstance(data, dict):
        for key in ("seconds", "elapsed", "time"):
            data.pop(key, None)
    return data


def sequence(url: str, blends, folder: Path) -> dict[str, object]:
    """Every command on a new repack at ``url``: what each gave."""
    first, second = blends
    found: dict[str, object] = {}
    result = cli("merge", *OPTIONS, str(first.flat_json), url)
    assert result.exit_code == 0, result.output
    found["merge"] = objects_of(url)
    result = cli("verify", "-q", "--json", url)
    assert result.exit_code == 0, result.output
    found["verify"] = _same_form(result.output, url)
    result = cli("inspect", "--json", url)
    assert result.exit_code == 0, result.output
    found["inspect"] = _same_form(result.output, url)
    for prefix in (first.prefixes[3], first.prefixes[13]):
        dest = folder / Path(prefix).name
        result = cli("extract", "-q", url, prefix, str(dest))
        assert result.exit_code == 0, result.output
        found[f"extract {prefix}"] = [Path(f"{dest}{ext}").read_bytes() for ext in (".bin", ".idx")]
    result = cli("add", "-q", url, str(second.flat_json))
    assert result.exit_code == 0, result.output
    found["add"] = edited_objects(url)
    result = cli("remove", "-q", url, first.prefixes[1], second.prefixes[2])
    assert result.exit_code == 0, result.output
    found["remove"] = edited_objects(url)
    result = cli("verify", "-q", "--json", "--sources", url)
    assert result.exit_code == 0, result.output
    found["verify --sources"] = _same_form(result.output, url)
    return found


def _no_uploads_left(s3_server, url: str) -> None:
    bucket = url.split("/")[2]
    assert not s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.fixture(scope="module")
def reference(s3_server, blends, tmp_path_factory):
    """The commands without faults, straight to the server: once for the module."""
    from s3_support import server_env

    folder = tmp_path_factory.mktemp("fault-reference")
    saved = os.environ.get("REPACK_CACHE_DIR")
    os.environ["REPACK_CACHE_DIR"] = str(folder / "cache")
    try:
        with server_env(s3_server):
            url = f"s3://{s3_server.new_bucket()}/x.repack"
            found = sequence(url, blends, folder)
    finally:
        if saved is None:
            os.environ.pop("REPACK_CACHE_DIR", None)
        else:
            os.environ["REPACK_CACHE_DIR"] = saved
    # the originals themselves: the reference is right, not just repeatable
    first = blends[0]
    for prefix in (first.prefixes[3], first.prefixes[13]):
        original = [Path(f"{prefix}{ext}").read_bytes() for ext in (".bin", ".idx")]
        assert found[f"extract {prefix}"] == original
    assert found["verify"]["ok"] and found["verify --sources"]["ok"]
    return found


def _compare(found: dict, reference: dict) -> None:
    assert found.keys() == reference.keys()
    for step in reference:
        assert found[step] == reference[step], f"{step} differs from the run without faults"


@pytest.mark.parametrize("seed", SEEDS)
def test_every_command_under_20_percent_throttling(s3, through, blends, reference, tmp_path, seed):
    through.set(seed=seed, throttle=0.2)
    url = f"s3://{s3.new_bucket()}/x.repack"
    found = sequence(url, blends, tmp_path)
    counts = dict(through.counts)
    through.set()
    assert counts["throttle"] >= 0.1 * counts["requests"] > 5, counts
    _compare(found, reference)
    _no_uploads_left(s3, url)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_command_with_replies_cut_mid_body(s3, through, blends, reference, tmp_path, seed):
    through.set(seed=seed, cut=0.3)
    url = f"s3://{s3.new_bucket()}/x.repack"
    found = sequence(url, blends, tmp_path)
    counts = dict(through.counts)
    through.set()
    assert counts["cut"] > 3, counts
    _compare(found, reference)
    _no_uploads_left(s3, url)


# --- lost replies of conditional writes --------------------------------------------------


def _merged(s3_server, blends) -> str:
    url = f"s3://{s3_server.new_bucket()}/x.repack"
    merge(blends[0].flat_json, url, shard_size=48 * 1024)
    return url


def _stale_lease(url: str) -> None:
    """A lease left by a process gone from this host (taken over by a conditional replace)."""
    from repack.merge.lease import LEASE_KEY
    from repack.store.lock import Holder

    gone = Holder(2**22 + 12345, Holder.me().host, "repack add x y", time.time() - 60)
    assert gone.alive() is False
    open_store(url).put(LEASE_KEY, gone.to_bytes())


# (what is lost: the key's end and the condition, or None for a multipart complete; the
# command; what it must leave)
LOST = {
    "plan create": (".work/plan.json", "If-None-Match", "merge", "merge"),
    "manifest create": ("/manifest.json", "If-None-Match", "merge", "merge"),
    "manifest replace by add": ("/manifest.json", "If-Match", "add", "add"),
    "manifest replace by remove": ("/manifest.json", "If-Match", "remove", "remove"),
    "lease create": (".work/writer.json", "If-None-Match", "add", "add"),
    "lease take-over": (".work/writer.json", "If-Match", "add", "add"),
    "multipart complete": (None, None, "merge", "merge"),
}


def _complete(method: str, path: str, headers) -> bool:
    return method == "POST" and "uploadId=" in path


#: A blend whose shard is sent in parts of S3's smallest size (5 MiB; SeaweedFS refuses
#: smaller ones, as S3 does): about 11 MiB, three parts.
PARTS = ("-q", "--shard-size", "16MiB")


@pytest.fixture(scope="module")
def parted(s3_server, tmp_path_factory):
    """That blend, and the objects of its merge without faults (straight to the server)."""
    import numpy as np
    from s3_support import server_env

    root = tmp_path_factory.mktemp("parted")
    blend = make_blend(
        root, 2, seed=63, tokens_per_source=(1_400_000, 1_500_000), dtypes=(np.int32,)
    )
    with server_env(s3_server):
        url = f"s3://{s3_server.new_bucket()}/x.repack"
        result = cli("merge", *PARTS, str(blend.flat_json), url)
        assert result.exit_code == 0, result.output
        objects = objects_of(url)
    assert 10 << 20 < len(objects["shard-00000.bin"]) < 15 << 20
    return blend, objects


@pytest.mark.parametrize("how", ["lose", "fail"])
@pytest.mark.parametrize("case", list(LOST))
def test_a_lost_reply_to_a_conditional_write(
    s3, through, blends, reference, tmp_path, monkeypatch, request, case, how
):
    """The write applied by the server, then its reply lost (``lose``) or answered ``500
    InternalError`` (``fail``): the retry is refused by the write's own effect (412, or 404
    ``NoSuchUpload`` for a complete), and the writer recognises its own bytes."""
    from s3_faults import conditional_put, lose_once

    from repack.store import s3 as s3_store

    suffix, header, command, step = LOST[case]
    expected = reference[step]
    if suffix is None:
        blend, expected = request.getfixturevalue("parted")
        blends = (blend, None)
        monkeypatch.setattr(s3_store, "PART_SIZE", 5 << 20)
    first, second = blends
    if command == "merge":
        url = f"s3://{s3.new_bucket()}/x.repack"
    else:
        url = _merged(s3, blends)
        if command == "remove":
            assert cli("add", "-q", url, str(second.flat_json)).exit_code == 0
    if case == "lease take-over":
        _stale_lease(url)
    rule = lose_once(_complete if suffix is None else conditional_put(suffix, header))
    through.set(**{how: rule})
    if command == "merge":
        result = cli("merge", *(OPTIONS if suffix else PARTS), str(first.flat_json), url)
    elif command == "add":
        result = cli("add", "-q", url, str(second.flat_json))
    else:
        result = cli("remove", "-q", url, first.prefixes[1], second.prefixes[2])
    counts = dict(through.counts)
    through.set()
    assert rule.done.is_set() and counts[how] == 1, f"no reply of {case} was lost"
    if suffix is None:
        assert counts.get("completed") == 1, counts  # the retried complete: NoSuchUpload
    assert result.exit_code == 0, result.output
    assert edited_objects(url) == expected  # the repack, and nothing else
    _no_uploads_left(s3, url)
    result = cli("verify", "-q", url)
    assert result.exit_code == 0, result.output


# --- a frozen server ---------------------------------------------------------------------


def _one_error_line(result, bound: str) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 3, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: s3://"), result.output
    assert f"(REPACK_S3_STALL_TIMEOUT={bound} bounds the wait)" in lines[0], lines[0]
    assert "no answer from the server" in lines[0]
    return lines[0]


def test_every_command_ends_within_the_stall_bound(s3, through, blends, tmp_path, monkeypatch):
    first, second = blends
    url = _merged(s3, blends)
    monkeypatch.setenv("REPACK_S3_STALL_TIMEOUT", "1.5")
    through.set(frozen=True)
    commands = {
        "merge": ("merge", *OPTIONS, str(first.flat_json), f"s3://{url.split('/')[2]}/y.repack"),
        "verify": ("verify", "-q", url),
        "inspect": ("inspect", url),
        "extract": ("extract", "-q", url, first.prefixes[3], str(tmp_path / "x")),
        "add": ("add", "-q", url, str(second.flat_json)),
        "remove": ("remove", "-q", url, first.prefixes[1]),
    }
    for name, args in commands.items():
        monkeypatch.setattr(retry, "_silence", retry._Silence())  # each waits for itself
        result = cli(*args)
        line = _one_error_line(result, "1.5")
        assert url.split("/")[2] in line, (name, line)
        assert not (tmp_path / "x.bin").exists()
    assert through.counts["frozen"] >= len(commands)
    # a request right after one gave up does not wait again: it fails at once, saying so
    line = _one_error_line(cli("inspect", url), "1.5")
    assert "a request of this process waited" in line
    through.set()
    monkeypatch.setattr(retry, "_silence", retry._Silence())
    assert cli("verify", "-q", url).exit_code == 0  # the server is back: all is well


# --- the settings --------------------------------------------------------------------------


def test_attempts_come_from_aws_max_attempts_the_config_file_or_repack(
    s3, through, blends, tmp_path, monkeypatch
):
    """Every request throttled: a command gives up after the attempts set, and says so."""
    url = _merged(s3, blends)
    through.set(throttle=1.0)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    result = cli("inspect", url)
    assert result.exit_code == 3
    assert re.fullmatch(
        rf"Error: {re.escape(url)}/manifest\.json: cannot read: SlowDown \(Please reduce your "
        r"request rate\.\); 10 attempts in \d+ s \(repack's default; AWS_MAX_ATTEMPTS sets "
        r"it\)\n",
        result.output,
    ), result.output
    assert through.counts["requests"] == retry.DEFAULT_ATTEMPTS == 10
    through.set(throttle=1.0)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    result = cli("inspect", url)
    assert re.search(r"; 3 attempts in \d+ s \(AWS_MAX_ATTEMPTS=3\)\n$", result.output)
    assert through.counts["requests"] == 3
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    config = Path(os.environ["AWS_CONFIG_FILE"])
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    (tmp_path / "aws-config").write_text("[default]\nmax_attempts = 2\nretry_mode = adaptive\n")
    through.set(throttle=1.0)
    result = cli("inspect", url)
    assert re.search(
        r"; 2 attempts in \d+ s \(max_attempts = 2 in the AWS config file\)", result.output
    )
    assert through.counts["requests"] == 2
    from repack.store.s3 import client

    assert client().meta.config.retries == {"mode": "adaptive", "total_max_attempts": 1}
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    assert client().meta.config.retries == {"mode": "standard", "total_max_attempts": 1}
    through.set()
    assert cli("inspect", url).exit_code == 0


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "AWS_MAX_ATTEMPTS",
            "many",
            "AWS_MAX_ATTEMPTS='many': expected a whole number, at least 1",
        ),
        ("AWS_MAX_ATTEMPTS", "0", "AWS_MAX_ATTEMPTS='0': expected a whole number, at least 1"),
        (
            "AWS_RETRY_MODE",
            "eager",
            "AWS_RETRY_MODE='eager': expected legacy, standard or adaptive",
        ),
        (
            "REPACK_S3_STALL_TIMEOUT",
            "soon",
            "REPACK_S3_STALL_TIMEOUT='soon': expected a number of seconds, at least 0.1",
        ),
    ],
)
def test_bad_retry_settings_are_refused(s3, blends, monkeypatch, name, value, message):
    url = f"s3://{s3.new_bucket()}/x.repack"
    monkeypatch.setenv(name, value)
    result = cli("inspect", url)
    assert result.exit_code != 0
    assert result.output == f"Error: {message}\n"


def test_a_lost_reply_to_a_multipart_complete(s3, through, monkeypatch):
    """The reply to ``CompleteMultipartUpload`` lost after the server completed it: its retry
    finds no such upload, and the writer recognises the object by its parts' ETag."""
    from s3_faults import lose_once

    from repack.store import s3 as s3_store

    monkeypatch.setattr(s3_store, "PART_SIZE", 5 * 1024 * 1024)  # S3's smallest part
    url = f"s3://{s3.new_bucket()}/x.repack"
    data = os.urandom(11 * 1024 * 1024)  # three parts
    rule = lose_once(lambda method, path, headers: method == "POST" and "uploadId=" in path)
    through.set(lose=rule)
    store = open_store(url)
    with store.writer("shard-00000.bin") as writer:
        writer.write(data)
        stat = writer.commit()
    assert rule.done.is_set() and through.counts["lose"] == 1
    through.set()
    assert stat.size == len(data) and stat.etag.strip('"').endswith("-3")
    # the ETag the writer recognises an upload completed by a lost attempt by (SeaweedFS
    # answers a repeated complete with success; S3 may say NoSuchUpload instead)
    import hashlib

    part = 5 * 1024 * 1024
    parts = [
        {"ETag": hashlib.md5(data[i : i + part]).hexdigest()} for i in range(0, len(data), part)
    ]
    assert stat.etag.strip('"') == s3_store.multipart_etag(parts)
    assert store.get("shard-00000.bin", 1 << 30) == (data, stat)
    _no_uploads_left(s3, url)
