"""Folders other machines mount (issue 45): an edit keeps what it supersedes, as on a bucket.

The store decides from the folder's file system (:mod:`repack.store.filesystems`: the mount
table's type); these tests inject the type (``mount_of`` replaced), so that a folder of this
machine's disk is taken for an NFS mount. What an edit does there: the superseded index,
shards and fingerprint file stay, recorded under ``.superseded/`` as on a bucket; a new file
never takes a name a superseded generation recorded (on NFS a rename over a name deletes its
file for every other client); ``gc``, ``remove --now``, ``inspect`` work on it; ``merge
--force`` refuses to drop kept generations. A real second client (a FUSE view) is
tests/test_shared_fuse.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.errors import ObjectExists, UnsupportedLocation
from repack.format import spec as fmt
from repack.merge import merge
from repack.merge.commit import named_files
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.store import filesystems, open_store
from repack.store.filesystems import Mount, is_shared, lock_is_local, parse_mountinfo
from repack.store.generations import generations
from repack.store.local import LocalStore
from repack.synth import make_blend


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def nfs(monkeypatch) -> None:
    """Every folder is taken for an NFS mount."""
    monkeypatch.setattr(filesystems, "mount_of", lambda path: Mount("nfs4", "/", ("rw",)))


def read_sources(repack: Repack) -> dict[str, bytes]:
    found = {}
    for source in repack.manifest.sources:
        parts = [bytes(repack.read_bytes(s.shard, s.offset, s.size)) for s in source.segments]
        found[source.path] = b"".join(parts)
    return found


def files_of(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in out.rglob("*")
        if p.is_file() and p.name != ".lock"
    }


def _repack(tmp_path: Path, *, fingerprints: bool = True, seed: int = 91):
    first = make_blend(tmp_path / "a", 10, seed=seed)
    second = make_blend(tmp_path / "b", 4, seed=seed + 1)
    out = tmp_path / "out"
    merge(first.flat_json, out, shard_size=8 * 1024, fingerprints=fingerprints)
    return out, first, second


# --- the decision ---------------------------------------------------------------------------


def test_which_file_systems_keep_what_an_edit_supersedes():
    shared = ["nfs", "nfs4", "lustre", "gpfs", "ceph", "beegfs", "wekafs", "cifs", "smb3", "9p"]
    shared += ["fuse", "fuseblk", "fuse.sshfs", "fuse.juicefs", "fuse.gcsfuse", "fuse.s3fs"]
    local = ["ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs"]
    assert all(is_shared(kind) for kind in shared)
    assert not any(is_shared(kind) for kind in local)
    assert is_shared("somefs")  # a type in neither list: kept (the cost is disk, reported)
    assert not is_shared("")  # no mount table (not Linux): today's behaviour


def test_the_mount_table_is_read_as_the_kernel_writes_it(tmp_path):
    text = (
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "40 22 0:52 / /mnt/my\\040data rw,relatime shared:7 - nfs4 srv:/export rw,vers=4.2,"
        "local_lock=none\n"
        "41 22 0:53 / /mnt/fs rw - fuse.sshfs u@h: rw,user_id=0\n"
    )
    assert parse_mountinfo(text) == [
        ("8:1", "/", "ext4", ("rw",)),
        ("0:52", "/mnt/my data", "nfs4", ("rw", "vers=4.2", "local_lock=none")),
        ("0:53", "/mnt/fs", "fuse.sshfs", ("rw", "user_id=0")),
    ]
    found = filesystems.mount_of(str(tmp_path / "not" / "made" / "yet"))
    assert found.type and found.point  # this machine's: its nearest existing parent's mount
    store = open_store(tmp_path)
    assert store.deleted_stays_readable is not is_shared(found.type)


def test_the_grace_period_is_one_decision_of_the_store(tmp_path):
    local, shared = LocalStore(tmp_path, fs_type="ext4"), LocalStore(tmp_path, fs_type="nfs")
    assert local.deleted_stays_readable and not shared.deleted_stays_readable
    assert local.superseded_grace(None) is None  # deleted at once, no record: as before
    assert shared.superseded_grace(None) == 24 * 3600.0
    assert local.superseded_grace(3600.0) == 3600.0  # given: on any folder
    assert local.superseded_grace(0.0) is None
    assert shared.superseded_grace(0.0) == 0.0  # recorded, deleted at once: a tombstone


def test_the_lock_is_refused_where_nfs_keeps_flock_on_this_machine(tmp_path):
    assert lock_is_local(Mount("nfs4", "/mnt/x", ("rw", "local_lock=none"))) is None
    assert lock_is_local(Mount("ext4", "/", ("rw",))) is None
    assert lock_is_local(Mount("lustre", "/lus", ("rw", "flock"))) is None
    assert "localflock" in lock_is_local(Mount("lustre", "/lus", ("rw", "localflock")))
    for option in ("local_lock=flock", "local_lock=all", "nolock"):
        store = LocalStore(tmp_path, fs_type="nfs")
        store._mount = Mount("nfs", "/mnt/x", ("rw", option))
        with pytest.raises(UnsupportedLocation, match=f"'{option}'"):
            store.lock()


def test_create_survives_an_nfs_link_resent_after_a_lost_reply(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    real_link = os.link

    def link_then_eexist(src, dst):  # the link was made; the resent call answers EEXIST
        real_link(src, dst)
        raise FileExistsError(17, "File exists")

    monkeypatch.setattr(os, "link", link_then_eexist)
    store.create("lease.json", b"mine")
    monkeypatch.undo()
    assert (tmp_path / "lease.json").read_bytes() == b"mine"
    with pytest.raises(ObjectExists):
        store.create("lease.json", b"theirs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease.json"]


# --- edits on a shared folder -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_readers_opened_before_edits_of_a_shared_folder_read_the_same_bytes(tmp_path, nfs, backend):
    out, first, second = _repack(tmp_path, fingerprints=False)
    readers = []

    def open_and_read() -> None:
        repack = Repack(out, backend=backend)
        readers.append((repack, read_sources(repack)))

    open_and_read()
    edits = [
        ("add", "-q", out, second.flat_json),
        ("remove", "-q", out, first.prefixes[1], second.prefixes[2]),
        ("fingerprint", "-q", out),  # supersedes nothing: there were none
        ("fingerprint", "-q", out),  # supersedes the first one's file
        ("remove", "-q", out, first.prefixes[4]),
    ]
    names = [set(files_of(out))]
    for args in edits:
        result = cli(*args)
        assert result.exit_code == 0, result.output
        names.append(set(files_of(out)))
        open_and_read()
    for repack, before in readers:
        assert read_sources(repack) == before
        repack.close()
    superseded, _ = generations(open_store(out))
    assert [g.edit for g in superseded] == ["add", "remove", "fingerprint", "remove"]
    assert all(g.kept for g in superseded)
    recorded = {name for g in superseded for name in g.objects}
    assert recorded <= set(files_of(out))  # every superseded file still there
    assert not recorded & named_files(Repack(out).manifest)
    assert all(earlier <= later for earlier, later in itertools.pairwise(names))  # none deleted
    assert verify(out, sources=True).ok


def test_no_new_file_takes_the_name_of_a_kept_one(tmp_path, nfs):
    """Names an edit used to take again: an add after a remove that dropped the last shards
    numbered its shards after the manifest's last (the dropped ones' numbers), and a second
    ``fingerprint`` wrote ``fingerprints.rpf`` again, the name the first one superseded."""
    out, _, second = _repack(tmp_path)
    for args in (
        ("fingerprint", "-q", out),
        ("fingerprint", "-q", out),
        ("add", "-q", out, second.flat_json),
        ("remove", "-q", out, *second.prefixes),  # drops the add's shards, rewrites none
        ("add", "-q", out, second.flat_json),
    ):
        result = cli(*args)
        assert result.exit_code == 0, result.output
    found, _ = generations(open_store(out))
    assert [g.edit for g in found] == ["fingerprint", "fingerprint", "add", "remove", "add"]
    current = named_files(Repack(out).manifest)
    seen: set[str] = set()
    for g in found:
        assert not set(g.objects) & current
        assert not set(g.objects) & seen, "a name superseded twice was written twice"
        seen |= set(g.objects)
    assert verify(out, sources=True).ok


def test_gc_inspect_and_a_take_down_on_a_shared_folder(tmp_path, nfs):
    out, first, _ = _repack(tmp_path)
    taken = first.prefixes[5]
    reader = Repack(out, backend="pread")
    read_sources(reader)
    result = cli("remove", out, first.prefixes[1], "--keep-superseded", "12h")
    assert result.exit_code == 0, result.output
    [generation], _ = generations(open_store(out))
    assert "kept the " in result.output and "`repack gc " in result.output
    shown = cli("inspect", out)
    assert "superseded by `repack remove` at " in shown.output, shown.output
    listed = json.loads(cli("inspect", "--json", out).output)["superseded"]
    assert [(g["edit"], g["objects"]) for g in listed] == [("remove", sorted(generation.objects))]
    kept = cli("gc", out)  # younger than a day: kept
    assert kept.exit_code == 0 and "kept " in kept.output, kept.output
    assert set(generation.objects) <= set(files_of(out))
    # a take-down: nothing of the source is left, kept generations included
    result = cli("remove", "--now", out, taken)
    assert result.exit_code == 0, result.output
    secret = Path(taken + ".bin").read_bytes()
    assert len(secret) > 64
    assert all(secret[:64] not in data for data in files_of(out).values())
    found, _ = generations(open_store(out))
    assert found and all(not g.kept for g in found)  # tombstones
    reader.close()
    assert cli("gc", out, "--older-than", "0").exit_code == 0
    assert verify(out, sources=True).ok


def test_gc_deletes_exactly_the_superseded_files(tmp_path, nfs):
    out, first, second = _repack(tmp_path)
    for args in (("add", "-q", out, second.flat_json), ("remove", "-q", out, first.prefixes[0])):
        assert cli(*args).exit_code == 0
    named = named_files(Repack(out).manifest)
    before = files_of(out)
    superseded = {name for g in generations(open_store(out))[0] for name in g.objects}
    result = cli("gc", "--json", out, "--older-than", "0")
    assert result.exit_code == 0, result.output
    after = files_of(out)
    gone = set(before) - set(after)
    assert gone == superseded
    assert {k: after[k] for k in named} == {k: before[k] for k in named}


def test_keep_superseded_0_deletes_at_once_on_a_shared_folder(tmp_path, nfs):
    out, first, _ = _repack(tmp_path)
    result = cli("remove", out, first.prefixes[2], "--keep-superseded", "0")
    assert result.exit_code == 0, result.output
    found, _ = generations(open_store(out))
    assert [g.kept for g in found] == [False]  # a tombstone for readers that find it gone
    files = {n for n in files_of(out) if "/" not in n}
    assert files == named_files(Repack(out).manifest) | {fmt.MANIFEST_FILE}


def test_a_local_folder_given_keep_superseded_keeps_and_records(tmp_path):
    out, first, second = _repack(tmp_path)
    assert open_store(out).deleted_stays_readable  # (this machine's disk)
    result = cli("remove", out, first.prefixes[2], "--keep-superseded", "1d")
    assert result.exit_code == 0, result.output
    [generation], _ = generations(open_store(out))
    assert generation.kept and set(generation.objects) <= set(files_of(out))
    # the next default edit deletes nothing younger than a day, and records nothing itself
    assert cli("add", "-q", out, second.flat_json).exit_code == 0
    found, _ = generations(open_store(out))
    assert [g.edit for g in found] == ["remove"] and found[0].kept
    assert cli("gc", out, "--older-than", "0").exit_code == 0
    assert not set(generation.objects) & set(files_of(out))


def test_merge_force_refuses_to_drop_kept_generations(tmp_path, nfs):
    out, first, _ = _repack(tmp_path)
    assert cli("remove", "-q", out, first.prefixes[3]).exit_code == 0
    refused = cli("merge", "-q", "--force", first.flat_json, out)
    assert refused.exit_code != 0
    assert "keeps 1 superseded generation" in refused.output, refused.output
    assert f"repack gc {out} --older-than 0" in refused.output
    assert cli("gc", out, "--older-than", "0").exit_code == 0
    result = cli("merge", "-q", "--force", first.flat_json, out)
    assert result.exit_code == 0, result.output
    assert verify(out).ok


def test_the_grace_period_counts_from_the_edit(tmp_path, nfs, monkeypatch):
    from repack.merge import edit as edit_module

    out, first, second = _repack(tmp_path)
    assert cli("remove", "-q", out, first.prefixes[2]).exit_code == 0
    [older], _ = generations(open_store(out))
    later = time.time() + 24 * 3600 + 60
    monkeypatch.setattr(edit_module.time, "time", lambda: later)
    assert cli("add", "-q", out, second.flat_json).exit_code == 0
    monkeypatch.setattr(edit_module.time, "time", time.time)
    assert not set(older.objects) & set(files_of(out))
    found, _ = generations(open_store(out))
    assert [(g.edit, g.kept) for g in found] == [("remove", False), ("add", True)]


def test_a_manifest_renamed_over_mid_read_is_read_again(tmp_path, monkeypatch):
    """NFS: an edit's rename over ``manifest.json`` between a reader's open and its read fails
    that read with ESTALE; the store opens it again."""
    import errno

    from repack.format import manifest as manifest_module

    out, _, _ = _repack(tmp_path)
    real = manifest_module.load_manifest
    calls = []

    def stale_once(folder):
        calls.append(folder)
        if len(calls) == 1:
            try:
                raise OSError(errno.ESTALE, "Stale file handle")
            except OSError:
                raise manifest_module.FormatError("manifest.json: cannot read") from None
        return real(folder)

    monkeypatch.setattr(manifest_module, "load_manifest", stale_once)
    assert LocalStore(out).manifest().checksum == real(out).checksum
    assert len(calls) == 2


def test_a_take_down_deletes_generations_dated_ahead_of_this_clock(tmp_path, nfs):
    """A generation recorded by a host whose clock is ahead: kept by a grace period, deleted
    by ``--now`` (and ``gc --older-than 0``) all the same."""
    out, first, _ = _repack(tmp_path)
    assert cli("remove", "-q", out, first.prefixes[1]).exit_code == 0
    store = open_store(out)
    [generation], _ = generations(store)
    ahead = dataclasses.replace(generation, at=generation.at + 3600).write(store)
    assert cli("gc", out, "--older-than", "1m").exit_code == 0
    assert set(ahead.objects) <= set(files_of(out))
    assert cli("remove", "-q", "--now", out, first.prefixes[2]).exit_code == 0
    assert not set(ahead.objects) & set(files_of(out))


def test_a_dry_run_names_the_shards_the_remove_writes(tmp_path, nfs):
    out, _, second = _repack(tmp_path)
    assert cli("add", "-q", out, second.flat_json).exit_code == 0
    assert cli("remove", "-q", out, *second.prefixes).exit_code == 0  # drops the add's shards
    victim = Repack(out).manifest.sources[0].path
    planned = cli("remove", "--dry-run", "--json", out, victim)
    done = cli("remove", "-q", "--json", out, victim)
    assert planned.exit_code == 0 and done.exit_code == 0, planned.output + done.output
    rewritten = json.loads(planned.output)["rewritten"]
    assert rewritten and rewritten == json.loads(done.output)["rewritten"]


def test_the_mount_holding_a_path_is_found_by_its_device(tmp_path, monkeypatch):
    st = os.stat(tmp_path)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    point = str(tmp_path.resolve().parent)
    table = tmp_path / "mountinfo"
    table.write_text(
        "1 0 254:9 / / rw - ext4 /dev/vda rw\n"
        f"2 1 {device} / {point} rw shared:3 - nfs4 srv:/x rw,vers=4.1,local_lock=none\n"
        f"3 2 0:99 / {point}/elsewhere rw - tmpfs tmpfs rw\n"
    )
    monkeypatch.setattr(filesystems, "MOUNTINFO", str(table))
    found = filesystems.mount_of(str(tmp_path / "out"))  # (not made yet: its parent's)
    assert found == Mount("nfs4", point, ("rw", "vers=4.1", "local_lock=none"))
    assert not LocalStore(tmp_path / "out").deleted_stays_readable
    monkeypatch.setattr(filesystems, "MOUNTINFO", str(tmp_path / "none"))
    assert filesystems.mount_of(str(tmp_path)) == Mount("")  # no table: unknown, local
    assert LocalStore(tmp_path).deleted_stays_readable
