"""A FUSE view of a folder that behaves as a second NFS client sees it (issue 45).

``python tests/fuse_view.py FOLDER MOUNTPOINT [--delay SECONDS]`` mounts FOLDER at
MOUNTPOINT (type ``fuse.nfsview``) in the foreground until unmounted (``fusermount3 -u
MOUNTPOINT``) or terminated; with ``--delay``, every read is answered that many seconds late
(a slow server, for ``repack bench``'s stall tests, issue 46).

A passthrough, with NFS's one difference that matters to a reader: a file handle
names the *file*, not a descriptor the server keeps open for the client. Once the file's last
name is gone on the server (deleted in FOLDER, or through another view), every read through a
handle opened before fails with ``ESTALE`` (``Stale file handle``), as an NFS server answers
for an inode it freed; a page of a mapping not yet read then raises ``SIGBUS``. A rename keeps
the handle valid, as on NFS.

What the kernel caches is NFS-like too: no ``keep_cache`` (pages are dropped at each open, the
close-to-open rule), and attributes and names are not cached (``attr_timeout=0``,
``entry_timeout=0``): pages the reader's kernel has not read come from the server. ``flock``
is forwarded to FOLDER (as Linux's NFS client forwards it to the server's lock manager), so
two views exclude each other's writers.

Needs libfuse3 (``apt-get install fuse3``) and mfusepy; tests/test_shared_fuse.py runs it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
import time

import mfusepy


class NFSView(mfusepy.Operations):
    use_ns = True  # utimens in nanoseconds

    def __init__(self, root: str, delay: float = 0.0) -> None:
        self.root = os.path.realpath(root)
        self.delay = delay
        self.fds: dict[int, int] = {}
        self._guard = threading.Lock()

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _fd(self, fh: int) -> int:
        fd = self.fds.get(fh)
        if fd is None:
            raise OSError(errno.EBADF, "bad handle")
        return fd

    def _live(self, fh: int) -> int:
        """The descriptor of a handle whose file still has a name on the server, else ESTALE."""
        fd = self._fd(fh)
        if os.fstat(fd).st_nlink == 0:
            raise OSError(errno.ESTALE, "Stale file handle")
        return fd

    # --- names ------------------------------------------------------------------------------

    def getattr(self, path, fh=None):
        st = os.fstat(self._live(fh)) if fh is not None else os.lstat(self._path(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino")
        found = {key: getattr(st, key) for key in keys}
        found.update(
            st_atime=st.st_atime_ns,
            st_mtime=st.st_mtime_ns,
            st_ctime=st.st_ctime_ns,
            st_blocks=st.st_blocks,
        )
        return found

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def access(self, path, amode):
        if not os.access(self._path(path), amode):
            raise OSError(errno.EACCES, "denied")
        return 0

    def readlink(self, path):
        return os.readlink(self._path(path))

    def mkdir(self, path, mode):
        os.mkdir(self._path(path), mode)
        return 0

    def rmdir(self, path):
        os.rmdir(self._path(path))
        return 0

    def unlink(self, path):
        os.unlink(self._path(path))
        return 0

    def rename(self, old, new):
        os.rename(self._path(old), self._path(new))
        return 0

    def link(self, target, source):
        os.link(self._path(source), self._path(target))
        return 0

    def symlink(self, target, source):
        os.symlink(source, self._path(target))
        return 0

    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)
        return 0

    def utimens(self, path, times=None):
        os.utime(self._path(path), ns=times)
        return 0

    def statfs(self, path):
        st = os.statvfs(self._path(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files")
        return {key: getattr(st, key) for key in (*keys, "f_flag", "f_frsize", "f_namemax")}

    # --- files ------------------------------------------------------------------------------

    def _keep(self, fd: int) -> int:
        with self._guard:
            fh = max(self.fds, default=0) + 1
            self.fds[fh] = fd
        return fh

    def open(self, path, flags):
        return self._keep(os.open(self._path(path), flags & ~os.O_CREAT))

    def create(self, path, mode, fi=None):
        return self._keep(os.open(self._path(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode))

    def read(self, path, size, offset, fh):
        if self.delay:
            time.sleep(self.delay)  # a slow server: every read answered this late
        return os.pread(self._live(fh), size, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(self._live(fh), data, offset)

    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(self._live(fh), length)
        else:
            os.truncate(self._path(path), length)
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(self._fd(fh))
        return 0

    def flock(self, path, fh, op):
        fcntl.flock(self._fd(fh), op)
        return 0

    def release(self, path, fh):
        with self._guard:
            fd = self.fds.pop(fh, None)
        if fd is not None:
            os.close(fd)
        return 0


def main() -> None:
    root, mountpoint = sys.argv[1], sys.argv[2]
    delay = float(sys.argv[4]) if sys.argv[3:4] == ["--delay"] else 0.0
    mfusepy.FUSE(
        NFSView(root, delay),
        mountpoint,
        foreground=True,
        nothreads=False,
        fsname="nfsview",
        subtype="nfsview",
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
    )


if __name__ == "__main__":
    main()
