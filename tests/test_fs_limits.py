"""The failures that started repack are gone: a file system that caps live mmaps, and a low
limit on open files.

Stock Megatron maps the ``.idx`` and ``.bin`` of every source and keeps three descriptors per
source open, so a 300-source blend fails under either limit; the repack of the same blend holds
a handful of files and trains. Each run is a fresh process (``loader_child.py``).

The mmap cap is an ``LD_PRELOAD`` shim, compiled here with the system C compiler: it fails with
``EPERM`` every mmap of a file under ``SHIM_DIR`` beyond ``SHIM_MAX_MAPS`` live ones, as some
parallel file systems do, and writes the highest live count it saw to ``SHIM_REPORT``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from megatron_support import run_children, weights_for, write_flat_blend, write_sources

from repack.merge import merge

pytestmark = pytest.mark.slow

SOURCES = 300
MAX_MAPS = 200  # stock needs 2 per source, the repack a handful
NOFILE = 256  # stock needs 3 per source; leaves Python and torch room for their own

SHIM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#define SLOTS 65536
static void *slots[SLOTS];
static long live, peak, limit = -1;
static const char *root, *report;
static size_t root_len;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((constructor)) static void init(void) {
    const char *max = getenv("SHIM_MAX_MAPS");
    root = getenv("SHIM_DIR");
    report = getenv("SHIM_REPORT");
    if (max && root) {
        limit = atol(max);
        root_len = strlen(root);
    }
}

__attribute__((destructor)) static void done(void) {
    if (report) {
        FILE *out = fopen(report, "w");
        if (out) {
            fprintf(out, "%ld\n", peak);
            fclose(out);
        }
    }
}

static int watched(int fd) {
    char link[64], path[PATH_MAX];
    if (fd < 0 || limit < 0) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    return strncmp(path, root, root_len) == 0 && (path[root_len] == '/' || !path[root_len]);
}

static void *raw_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, off);
}

static void *capped(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    if (!watched(fd)) return raw_mmap(addr, len, prot, flags, fd, off);
    void *result = MAP_FAILED;
    int refused = 0;
    pthread_mutex_lock(&lock);
    if (live >= limit) {
        refused = 1;
    } else {
        result = raw_mmap(addr, len, prot, flags, fd, off);
        if (result != MAP_FAILED) {
            for (long i = 0; i < SLOTS; i++) {
                if (!slots[i]) {
                    slots[i] = result;
                    if (++live > peak) peak = live;
                    break;
                }
            }
        }
    }
    pthread_mutex_unlock(&lock);
    if (refused) errno = EPERM;
    return result;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return capped(addr, len, prot, flags, fd, off);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off64_t off) {
    return capped(addr, len, prot, flags, fd, (off_t)off);
}

int munmap(void *addr, size_t len) {
    if (limit >= 0 && addr) {
        pthread_mutex_lock(&lock);
        for (long i = 0; i < SLOTS; i++) {
            if (slots[i] == addr) {
                slots[i] = NULL;
                live--;
                break;
            }
        }
        pthread_mutex_unlock(&lock);
    }
    return (int)syscall(SYS_munmap, addr, len);
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) to build the LD_PRELOAD mmap cap")
    folder = tmp_path_factory.mktemp("shim")
    (folder / "shim.c").write_text(SHIM)
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-o", "shim.so", "shim.c", "-ldl", "-lpthread"],
        cwd=folder,
        check=True,
    )
    return folder / "shim.so"


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """300 small sources and their repack, as the part of a job every run shares."""
    root = tmp_path_factory.mktemp("fs-limits")
    prefixes = write_sources(root, SOURCES, seed=3, sequences=(20, 24), tokens=(2, 10))
    weights = weights_for(prefixes, seed=3)
    merge(write_flat_blend(root / "blend.json", prefixes, weights), root / "out")
    return {"root": root, "prefixes": prefixes, "weights": weights, "sizes": [600, 60, 60]}


def job(blend: dict, name: str, *, repack: bool, nofile: int | None = None) -> dict:
    root = blend["root"]
    return {
        "prefixes": blend["prefixes"],
        "weights": blend["weights"],
        "sizes": blend["sizes"],
        "cache": str(root / f"cache-{name}"),
        "mmap": True,
        "repack": str(root / "out") if repack else None,
        "watch": {"all": str(root)},
        "nofile": nofile,
    }


def test_seed_failures_are_gone(shim: Path, blend: dict) -> None:
    root = blend["root"]
    capped = {
        "LD_PRELOAD": str(shim),
        "SHIM_DIR": str(root.resolve()),
        "SHIM_MAX_MAPS": str(MAX_MAPS),
    }
    jobs = [
        job(blend, "stock-capped", repack=False),
        job(blend, "repack-capped", repack=True),
        job(blend, "stock-nofile", repack=False, nofile=NOFILE),
        job(blend, "repack-nofile", repack=True, nofile=NOFILE),
    ]
    jobs[0]["env"] = capped
    jobs[1]["env"] = {**capped, "SHIM_REPORT": str(root / "repack-peak")}
    stock_capped, repack_capped, stock_limited, repack_limited = run_children(jobs, root / "jobs")

    assert stock_capped.returncode != 0
    assert "PermissionError: [Errno 1]" in stock_capped.stderr, stock_capped.stderr[-3000:]
    assert repack_capped.returncode == 0, repack_capped.stderr[-3000:]
    # the cap was in force for the repack too: its files were counted, and stayed few
    assert 3 <= int((root / "repack-peak").read_text()) <= 16

    assert stock_limited.returncode != 0
    assert "OSError: [Errno 24] Too many open files" in stock_limited.stderr, stock_limited.stderr[
        -3000:
    ]
    assert repack_limited.returncode == 0, repack_limited.stderr[-3000:]

    # both repacked runs read every sample of every split, the same ones
    assert repack_capped.result["digest"] == repack_limited.result["digest"]
    assert repack_capped.result["lengths"][0] >= blend["sizes"][0]
    assert all(n > 0 for n in repack_capped.result["lengths"])
