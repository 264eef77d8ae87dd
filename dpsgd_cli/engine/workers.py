"""Worker processes forked from this one: they start with its imports, data and caches in memory (compiled
kernels, the accountant library, matplotlib), so a fixed cost is paid once in the driver, not once per worker."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


def can_fork() -> bool:
    """Whether workers are forked (Linux); elsewhere a fork may not copy the libraries' threads safely."""
    return sys.platform == "linux"


@contextlib.contextmanager
def fork_pool(jobs: int) -> Iterator[Any]:
    """`jobs` worker processes forked from this one, ended with it (`die_with_parent`); on leaving, the tasks
    not started are cancelled and nothing waits for the running ones."""
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"), initializer=die_with_parent,
                               initargs=(os.getpid(),))
    try:
        yield pool
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def map_in_workers(function: Callable[[_T], _R], items: Sequence[_T], jobs: int,
                   cost: Callable[[_T], float] | None = None) -> list[_R]:
    """[function(item) for item in items], in `jobs` forked processes where there are several items and the
    platform forks (the costliest items first, by `cost`, so that the workers end close together), else here.
    An exception of an item is raised here, as the loop would raise it."""
    if jobs <= 1 or len(items) <= 1 or not can_fork():
        return [function(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -cost(items[i]) if cost else 0.0)
    with fork_pool(min(jobs, len(items))) as pool:
        futures = {i: pool.submit(function, items[i]) for i in order}
        return [futures[i].result() for i in range(len(items))]


def die_with_parent(parent: int) -> None:
    """Worker initializer: end this worker when the parent process dies, even by kill -9 (a worker would otherwise
    finish its task and idle for minutes). Linux: the kernel sends SIGKILL on the parent's death (prctl
    PR_SET_PDEATHSIG), whatever the worker is doing; elsewhere a thread watches the parent pid."""
    # Ctrl-C in a terminal signals the whole process group: the driver alone handles it (it saves what finished
    # and ends the workers); a worker's own KeyboardInterrupt would only print its traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
