"""Megatron's builder builds a repack's datasets in the calling thread, one after another, where
it would have a pool of one thread build them one after another.

``BlendedMegatronDatasetBuilder._build_megatron_datasets_parallel`` (every release from 0.12 to
Megatron-LM main) submits one call per blend prefix to a ``ThreadPoolExecutor`` of
``num_dataset_builder_threads`` threads (1 by default) before it asks for the first result.
Every ``Future`` and work item (a condition, its lock, a queue entry: about 1.5 KiB per
prefix) is made up front, the pool's thread frees the work items one by one as it builds, and
each dataset it builds lands in the holes they leave: when the futures go, Python's allocator
keeps the pools and arenas those datasets pin. 10,000 prefixes left about 1.9 KiB of empty pools
and free glibc heap per source in the process, which every DataLoader worker forked from it
inherits (docs/benchmarks.md, issue 44).

:func:`install` puts :class:`BuildPool` in place of the name ``ThreadPoolExecutor`` in the
builder's module (once per process; ``import repack.megatron`` does it). A pool of one thread
whose calls build a repacked class's datasets runs each call as it is submitted, in the calling
thread, and gives back what the pool's future would: its result, or the exception it raised,
raised by ``result()``; as in the pool, a call that fails does not stop the calls submitted
after it. Anything else (a stock class, more than one thread, another call) goes to a real
``ThreadPoolExecutor``, made at its first call: a stock build is unchanged.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from repack.megatron.mixin import Repacked

__all__ = ["BuildPool", "install"]

_POOL = concurrent.futures.ThreadPoolExecutor


def _builds_repacked(fn: Any) -> bool:
    """Whether ``fn`` is a builder's method and the builder's class a repacked one."""
    cls = getattr(getattr(fn, "__self__", None), "cls", None)
    return isinstance(cls, type) and issubclass(cls, Repacked)


class _Done:
    """What :meth:`BuildPool.submit` gives for a call it made at once: a finished future."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self._value = value
        self._error = error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Any) -> None:
        fn(self)


class BuildPool:
    """``ThreadPoolExecutor`` as Megatron's builder uses it (``with``, ``submit``,
    ``result``): the calls of a one-thread pool that build a repacked class's datasets run
    at once in the calling thread, every other call in a real pool."""

    def __init__(self, max_workers: int | None = None, *args: Any, **kwargs: Any) -> None:
        self._args = (max_workers, *args)
        self._kwargs = kwargs
        self._inline = max_workers == 1
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if not self._inline:  # a pool in any case: made now, as stock makes it (and refuses 0)
            self._real()

    def _real(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = _POOL(*self._args, **self._kwargs)
        return self._pool

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if self._inline and self._pool is None and _builds_repacked(fn):
            try:
                return _Done(fn(*args, **kwargs), None)
            except Exception as error:  # the pool's future holds it; the next calls still run
                return _Done(None, error)
        return self._real().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)

    def __enter__(self) -> BuildPool:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.shutdown(wait=True)
        return False

    def __getattr__(self, name: str) -> Any:  # map() and the rest: the real pool's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._real(), name)


def install() -> None:
    """Put :class:`BuildPool` in place of ``ThreadPoolExecutor`` in Megatron's builder module
    (once; left alone where another hand has replaced it)."""
    from megatron.core.datasets import blended_megatron_dataset_builder as builder

    if getattr(builder, "ThreadPoolExecutor", None) is _POOL:
        builder.ThreadPoolExecutor = BuildPool
