"""Run a grid's tasks on a Dask cluster (`dpsgd run --scheduler ADDRESS|local:N`); the driver stays the only
writer (docs/cluster.md)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dpsgd_cli.data.download import DATA_DIR_ENV, MIRROR_ENV, cache_dir
from dpsgd_cli.engine.runner import Task, TaskResult, failed_result, run_task
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule, installed

# optional (the `dask` extra): imported when a scheduler is used
dask = LazyModule("dask")
distributed = LazyModule("distributed")

TIMEOUT_ENV = "DPSGD_SCHEDULER_TIMEOUT"  # seconds to wait for the scheduler when connecting
CONNECT_TIMEOUT = 10.0
INSTALL_HINT = "pip install 'dpsgd[dask]' (from a clone: pip install -e '.[dask]')"
CELLS_PER_TASK = 1  # tasks per submission: a task is a cell's seeds, or the cells fused with it (docs/cluster.md)


class SchedulerLost(UserError):
    """The connection to the scheduler broke mid-grid (what was received is saved)."""


SCHEMES = ("tcp", "tls", "ws", "wss", "ucx", "inproc")  # distributed's comm backends (`HOST:PORT` is tcp)


def parse_scheduler(value: str) -> tuple[str, int | None]:
    """("local", N) for `local:N`, else (address, None); an unknown scheme is a UserError at once (distributed
    would retry it until its timeout)."""
    value = value.strip()
    if value == "local" or value.startswith("local:"):
        _, _, count = value.partition(":")
        if not count.isdigit() or int(count) < 1:
            raise UserError(f"--scheduler {value}: use local:N with N ≥ 1 worker processes (e.g. local:2), "
                            f"or a scheduler address such as tcp://10.0.0.5:8786")
        return "local", int(count)
    if not value:
        raise UserError("--scheduler: empty address; give tcp://HOST:PORT or local:N")
    scheme, sep, rest = value.partition("://")
    if sep and (scheme.lower() not in SCHEMES or not rest):
        raise UserError(f"--scheduler {value}: unknown address scheme {scheme + '://'!r}; give "
                        f"tcp://HOST:PORT (or {', '.join(s + '://' for s in SCHEMES[1:])}) or local:N")
    return value, None


def check_scheduler(value: str) -> None:
    """`--scheduler` checked before any work: at most one local worker per core (more only thrash)."""
    address, workers = parse_scheduler(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers is not None and workers > cores:
        raise UserError(f"--scheduler {value.strip()}: {workers:,} local workers exceed the {cores} cores of this "
                        f"machine; use local:{cores} or fewer, or the address of a larger cluster (tcp://HOST:PORT)")
    connect_timeout()


def connect_timeout() -> float:
    """Seconds to wait for the scheduler: DPSGD_SCHEDULER_TIMEOUT (a positive number) or CONNECT_TIMEOUT."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return CONNECT_TIMEOUT
    try:
        timeout = float(raw)
    except ValueError:
        timeout = float("nan")
    if not 0 < timeout < float("inf"):
        raise UserError(f"{TIMEOUT_ENV}={raw!r}: not a positive number of seconds; set it to e.g. 10, or unset "
                        f"it (default {CONNECT_TIMEOUT:g})")
    return timeout


def worker_environment() -> dict[str, str]:
    """The data settings workers need to find the same files: the cache root (absolute) and the mirror."""
    env = {DATA_DIR_ENV: str(cache_dir())}
    if os.environ.get(MIRROR_ENV):
        env[MIRROR_ENV] = os.environ[MIRROR_ENV]
    return env


def run_tasks(tasks: list[Task], env: dict[str, str]) -> list[TaskResult]:
    """What a worker runs: the tasks, one BLAS thread, the data found through the driver's settings."""
    os.environ.update(env)
    return [run_task(task, single_thread=True) for task in tasks]


@contextmanager
def dask_backend(scheduler: str, cells_per_task: int = CELLS_PER_TASK) -> Iterator[DaskBackend]:
    """Connect to the scheduler (or start a LocalCluster), yield the backend, close both at the end."""
    if not installed("distributed"):
        raise UserError(f"--scheduler needs Dask's `distributed`, which is not installed: {INSTALL_HINT}")
    address, workers = parse_scheduler(scheduler)
    cluster = None
    quiet = _silence_dask_logs()  # its reconnect tracebacks would bury our one-line errors
    try:
        if workers is not None:
            cluster = local_cluster(workers)
            address = cluster.scheduler_address
        client = _connect(distributed, address)
    except BaseException:
        if cluster is not None:
            cluster.close()
        quiet()
        raise
    try:
        yield DaskBackend(client, address, cells_per_task)
    finally:
        client.close(timeout=5)
        if cluster is not None:
            cluster.close(timeout=5)
        quiet()


def _silence_dask_logs() -> Callable[[], None]:
    """Raise every `distributed` logger to CRITICAL in the driver; return the function restoring them."""
    names = ["distributed"] + [n for n in logging.root.manager.loggerDict if n.startswith("distributed.")]
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)

    def restore() -> None:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)

    return restore


def local_cluster(workers: int) -> Any:
    """A LocalCluster of `workers` single-threaded processes on 127.0.0.1, without the nanny's
    MALLOC_TRIM_THRESHOLD_ (about 2× the CPU per task: docs/cluster.md, "Memory allocator")."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # inherited by the workers:
    try:  # Ctrl-C (sent to the whole process group) is the driver's to handle, and it closes the cluster
        with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
            return distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                            dashboard_address="127.0.0.1:0",  # any free port: never "8787 in use"
                                            silence_logs=logging.CRITICAL)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


class DaskBackend:
    """Called with a grid's tasks, yields their results as they finish (for `execute(..., backend=)`)."""

    def __init__(self, client: Any, address: str, cells_per_task: int):
        self.client, self.address, self.cells_per_task = client, address, cells_per_task

    def __call__(self, tasks: list[Task]) -> Iterator[TaskResult]:
        return _results(self.client, self.address, tasks, self.cells_per_task)

    def describe(self) -> str:
        workers = self.client.scheduler_info(n_workers=-1)["workers"].values()
        threads = sum(w["nthreads"] for w in workers)
        return f"Dask scheduler {self.address}: {len(workers)} workers, {threads} threads"


def _connect(distributed: Any, address: str) -> Any:
    timeout = connect_timeout()
    try:
        return distributed.Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"--scheduler {address}: cannot reach the Dask scheduler within {timeout:g} s ({reason}); "
                        f"check the address (tcp://HOST:PORT, as printed by `dask scheduler`) and that it runs, "
                        f"or use local:N") from None


def _results(client: Any, address: str, tasks: list[Task], cells_per_task: int) -> Iterator[TaskResult]:
    """Submit the tasks in groups of `cells_per_task`; yield each group's results as it finishes."""
    if not tasks:
        return
    env = worker_environment()
    chunks = [tasks[i:i + cells_per_task] for i in range(0, len(tasks), cells_per_task)]
    tag = uuid.uuid4().hex[:8]
    futures = {client.submit(run_tasks, chunk, env, key=f"dpsgd-{chunk[0].cell.grid}-{i}-{tag}", retries=1): chunk
               for i, chunk in enumerate(chunks)}
    try:
        for future in distributed.as_completed(futures, loop=client.loop):
            chunk = futures[future]
            if future.cancelled() or client.status != "running":
                raise SchedulerLost(f"lost the Dask scheduler at {address} mid-grid; the runs received so far are "
                                    f"saved; run the same command again (with a running scheduler) to resume")
            exc = future.exception()
            if exc is None:
                yield from future.result()
            elif isinstance(exc, UserError):  # e.g. a worker cannot find the data: stop, with its message
                raise UserError(f"on a Dask worker: {exc}")
            else:  # the task killed its workers repeatedly (KilledWorker), ...: failed rows, retried on resume
                message = " ".join(f"{type(exc).__name__}: {exc}".split())
                yield from (failed_result(task, message) for task in chunk)
            del futures[future]  # released: the cluster keeps no result the driver has written
    finally:
        if client.status == "running":
            client.cancel(list(futures))  # Ctrl-C, a lost scheduler, a worker error: stop what is still queued
