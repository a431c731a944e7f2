"""Which file system holds a folder, and whether other machines share it.

An edit of a folder repack deletes what it superseded at once only where every reader of the
folder runs on this machine: there a reader's open descriptors and mappings keep an unlinked
file readable. On a file system other machines mount (NFS, a parallel file system, SMB, a
FUSE view of anything), a file deleted by one client is gone for the others: their reads get
``ESTALE`` and a mapping's next page fault ``SIGBUS`` (issue 45). There the edit keeps the
files, as on object storage (:mod:`repack.store.generations`).

**How the type is found: ``/proc/self/mountinfo``, not ``statfs(2)``.** Python's
``os.statvfs`` has no ``f_type``; calling ``statfs`` through ctypes would need ``struct
statfs``'s layout, which differs between architectures (``__fsword_t`` and the field order of
x86-64, aarch64, s390x, 32-bit ABIs), and it answers one magic number for every FUSE file
system and none documented for some vendors' (WekaFS publishes its type name, not a magic).
The mount table is text the kernel writes the same way everywhere (proc(5), "mountinfo"): it
names the type as ``mount -t`` and ``findmnt`` show it (``nfs4``, ``lustre``,
``fuse.sshfs``), and its super options say how NFS locks (``local_lock=``, ``nolock``:
:func:`lock_is_local`). The mount holding a path is the entry whose device (``major:minor``)
is the path's ``st_dev``, the last such one (a later mount hides an earlier); failing that
(a btrfs subvolume has its own anonymous device), the longest mount point that holds the
path. Where there is no mount table (not Linux), the type is unknown: see :func:`is_shared`.

Tests inject a type by replacing :func:`mount_of` (or give ``LocalStore(..., fs_type=)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["LOCAL_TYPES", "SHARED_TYPES", "Mount", "is_shared", "lock_is_local", "mount_of"]

#: File systems other machines mount: an edit keeps what it supersedes. The names are those
#: of each kernel module's ``struct file_system_type .name`` (what mountinfo and ``mount -t``
#: show), as registered in the Linux sources (v6.12) or by the vendor's client:
SHARED_TYPES = frozenset(
    {
        # fs/nfs/fs_context.c: nfs_fs_type "nfs", nfs4_fs_type "nfs4" (VAST, NetApp, EFS,
        # Filestore, Azure Files NFS are NFS servers; their clients mount these)
        "nfs",
        "nfs4",
        # fs/smb/client/cifsfs.c: cifs_fs_type "cifs", smb3_fs_type "smb3"
        "cifs",
        "smb3",
        # fs/9p/vfs_super.c: v9fs_fs_type "9p" (also WSL's and QEMU's shared folders)
        "9p",
        # fs/ceph/super.c: ceph_fs_type "ceph"
        "ceph",
        # Lustre's client (lustre/llite/super25.c, lustre_fs_type "lustre"; out of tree)
        "lustre",
        # IBM Storage Scale / GPFS: its kernel module registers "gpfs" (IBM docs, "mmlsmount",
        # and /proc/mounts on Scale clients)
        "gpfs",
        # BeeGFS client module: "beegfs" (BeeGFS docs, "Client Mount Options"; older "fhgfs")
        "beegfs",
        "fhgfs",
        # WekaFS client: "wekafs" (WEKA docs, "Mount filesystems": mount -t wekafs)
        "wekafs",
        # other cluster and network file systems in the kernel: fs/afs ("afs"),
        # fs/gfs2 ("gfs2", "gfs2meta"), fs/ocfs2 ("ocfs2"), fs/orangefs ("pvfs2"),
        # fs/coda ("coda"); and Panasas' client ("panfs", vendor docs)
        "afs",
        "gfs2",
        "ocfs2",
        "pvfs2",
        "coda",
        "panfs",
        # fs/fuse/inode.c: fuse_fs_type "fuse", fuseblk_fs_type "fuseblk"; a FUSE file system
        # with a subtype shows as "fuse.SUBTYPE" (s3fs, gcsfuse, JuiceFS, sshfs...): any of them
        "fuse",
        "fuseblk",
    }
)
#: File systems of one machine: an edit deletes what it supersedes at once (an open file stays
#: readable to the processes holding it). Names from the same registrations: fs/ext4/super.c
#: ("ext4", "ext3", "ext2" served by ext4), fs/xfs/xfs_super.c ("xfs"), fs/btrfs/super.c
#: ("btrfs"), mm/shmem.c ("tmpfs"), fs/ramfs/inode.c ("ramfs"), fs/overlayfs/super.c
#: ("overlay"), fs/f2fs/super.c ("f2fs"), fs/bcachefs ("bcachefs"), fs/fat ("vfat", "msdos"),
#: fs/exfat ("exfat"), fs/ntfs3 ("ntfs3"), fs/jfs ("jfs"), fs/reiserfs ("reiserfs"),
#: fs/hfsplus ("hfsplus"), and OpenZFS's module ("zfs").
LOCAL_TYPES = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "tmpfs",
        "ramfs",
        "overlay",
        "f2fs",
        "bcachefs",
        "vfat",
        "msdos",
        "exfat",
        "ntfs3",
        "jfs",
        "reiserfs",
        "hfsplus",
        "zfs",
    }
)

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Mount:
    """The mount holding a path: its type as mountinfo names it (``""``: unknown), its mount
    point and its super options."""

    type: str
    point: str = ""
    options: tuple[str, ...] = ()


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo (fs/proc_namespace.c)
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``(major:minor, mount point, type, super options)`` of each line of a mountinfo
    (proc(5): ``ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER``)."""
    found = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            dash = fields.index("-", 6)
            device, point = fields[2], _unescape(fields[4])
            kind = fields[dash + 1]
            supers = tuple(fields[dash + 3].split(",")) if len(fields) > dash + 3 else ()
        except (ValueError, IndexError):
            continue
        found.append((device, point, kind, supers))
    return found


def mount_of(path: str) -> Mount:
    """The mount holding ``path`` (or its nearest existing parent: a merge's folder may not
    exist yet); ``Mount("")`` where the mount table cannot be read."""
    real = os.path.realpath(path)
    while not os.path.exists(real) and os.path.dirname(real) != real:
        real = os.path.dirname(real)
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as stream:
            entries = parse_mountinfo(stream.read())
        st_dev = os.stat(real).st_dev
    except OSError:
        return Mount("")
    device = f"{os.major(st_dev)}:{os.minor(st_dev)}"

    def holds(point: str) -> bool:
        return point == "/" or real == point or real.startswith(point.rstrip("/") + "/")

    inside = [entry for entry in entries if holds(entry[1])]
    # the path's own device if a mount holding it has it, else any mount holding it; of
    # those, the deepest point, and of mounts over one point the last (it hides the others)
    candidates = [entry for entry in inside if entry[0] == device] or inside
    if not candidates:
        return Mount("")
    longest = max(len(entry[1]) for entry in candidates)
    _, point, kind, supers = [e for e in candidates if len(e[1]) == longest][-1]
    return Mount(kind, point, supers)


def is_shared(kind: str) -> bool:
    """Whether a file system of type ``kind`` may be mounted by other machines (an edit must
    keep what it supersedes). A type in neither list is taken as shared: wrongly kept files
    cost disk for the grace period and are reported by the edit, wrongly deleted ones kill
    the readers on other machines. An unknown type (``""``: no mount table, as off Linux) is
    taken as local, today's behaviour there."""
    if not kind:
        return False
    if kind in SHARED_TYPES or kind.startswith("fuse."):
        return True
    return kind not in LOCAL_TYPES


def lock_is_local(mount: Mount) -> str | None:
    """Why ``flock`` on this mount would keep out only writers of this machine, or None.

    Linux's NFS client sends ``flock`` to the server as a whole-file lock (NLM on NFSv3,
    NFSv4's own LOCK) since 2.6.12, unless the mount says ``local_lock=flock`` or
    ``local_lock=all`` (nfs(5)), or ``nolock`` (NFSv3: locks stay local). SMB, 9p and FUSE
    file systems forward it or not by server and options; what nothing here can see is not
    refused (docs/operations.md, "One writer at a time").

    Lustre: ``-o localflock`` makes locks coherent on one client only (lustre(8)'s mount
    options; ``flock`` is coherent, ``noflock`` fails the call and repack falls back to the
    lock's record)."""
    options = set(mount.options)
    if mount.type == "lustre" and "localflock" in options:
        return f"the Lustre mount {mount.point} has 'localflock': locks stay on this machine"
    if mount.type not in ("nfs", "nfs4"):
        return None
    if "nolock" in options:
        return f"the NFS mount {mount.point} has 'nolock': locks stay on this machine"
    for value in ("flock", "all"):
        if f"local_lock={value}" in options:
            return (
                f"the NFS mount {mount.point} has 'local_lock={value}': flock() stays on "
                "this machine"
            )
    return None
