"""scripts/stress_read.py, in a short form: 8 reader processes of 4 threads each, both loader
backends, 4 seconds of random reads after a full sweep, every byte compared with the original
prefixes; and proof that it notices wrong bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from figures import record_figures

from repack.format.manifest import load_manifest
from repack.merge import merge
from repack.synth import make_blend

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "stress_read.py"
SECONDS = float(os.environ.get("REPACK_STRESS_SECONDS", "4"))


@pytest.fixture(scope="module")
def stress_repack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 sources (uint16, int32, three multimodal) in 64 KiB shards: sources cut across
    shards, so reads cross segment boundaries."""
    root = tmp_path_factory.mktemp("stress")
    blend = make_blend(
        root / "src", 24, seed=12, tokens_per_source=(100, 12000), multimodal_fraction=0.1
    )
    out = root / "repack"
    merge(blend.flat_json, out, shard_size=64 * 1024)
    return out


def run_script(*args: str) -> tuple[int, dict, str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.returncode, report, result.stderr


def test_many_readers_read_every_byte_right(stress_repack: Path) -> None:
    code, report, stderr = run_script("--repack", str(stress_repack), "--seconds", str(SECONDS))
    assert code == 0, (stderr, report.get("failures"), report.get("totals"))
    processes = report["per_process"]
    assert len(processes) == 8 and report["threads"] == 4
    assert {p["backend"] for p in processes} == {"mmap", "pread"}
    shards = len(load_manifest(stress_repack).shards)
    for p in processes:
        assert p["reads"] > 0 and p["errors"] == 0 and p["wrong"] == 0, p
        assert p["anon_growth_kib"] <= report["rss_growth_limit_kib"], p
        # one descriptor per shard and one for the index, whatever the number of views
        assert p["fds"] == shards + 1, p
    totals = report["totals"]
    record_figures(
        "stress",
        {
            "processes": 8,
            "threads": 4,
            "seconds": report["seconds"],
            "sources": report["sources"],
            "shards": report["shards"],
            "reads": totals["reads"],
            "mib_read": round(totals["bytes"] / 2**20, 1),
            "errors": totals["errors"],
            "wrong": totals["wrong"],
            "max_anon_growth_kib": totals["max_anon_growth_kib"],
            "rss_kib_end": max(p["memory_kib_end"]["VmRSS"] for p in processes),
        },
    )


def test_the_stress_run_notices_wrong_bytes(stress_repack: Path, tmp_path: Path) -> None:
    """A repack whose shard was damaged after the merge (verify would say so; the loader
    does not check data on open): the script must report wrong reads and fail."""
    damaged = tmp_path / "damaged"
    shutil.copytree(stress_repack, damaged)
    manifest = load_manifest(damaged)
    source = next(s for s in manifest.sources if s.bin_size > 64)
    seg = source.segments[0]
    path = damaged / manifest.shards[seg.shard].file
    data = bytearray(path.read_bytes())
    data[seg.offset + seg.size // 2] ^= 0x40
    path.write_bytes(bytes(data))
    code, report, _ = run_script(
        "--repack", str(damaged), "--seconds", "0.5", "--processes", "2", "--threads", "2"
    )
    assert code == 1 and not report["ok"]
    assert report["totals"]["wrong"] > 0 and report["totals"]["errors"] == 0
    messages = [m for p in report["per_process"] for m in p["messages"]]
    assert any(source.name in m and "tokens differ" in m for m in messages), messages


def test_a_broken_repack_is_an_error(stress_repack: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(stress_repack, broken)
    (broken / "index.rpx").write_bytes(b"")
    code, report, stderr = run_script("--repack", str(broken), "--seconds", "0.1")
    assert code == 1 and report == {}
    assert stderr.startswith("Error: ") and "index.rpx" in stderr
