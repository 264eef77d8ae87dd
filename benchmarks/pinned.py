"""Fair timing of separate sides: each side in its own process pinned to one core, warmed up, measured in rounds.

A side is a long-lived worker process (`python -m benchmarks.sides`, started under `taskset -c CORE` with every
thread pool set to one thread: OMP/OpenBLAS/MKL, XLA's intra-op pool, torch) or a command timed from outside
(`Command`, e.g. `dpsgd run ...` under `taskset`). `interleave` measures the sides in rounds A B A B … (one side
runs at a time, the others wait blocked on a pipe) and keeps the best and the median of each, with the 1-minute
load average read at every measurement: a ratio is only as good as the machine was quiet, so the load travels
with it. The sides may run in different interpreters (`python=`): none imports another side's libraries.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, Skip

MARK = "@@bench "  # prefix of the worker's answers on stdout (libraries may print there too)
CORE = int(os.environ.get("DPSGD_BENCH_CORE", "0"))
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "NUMBA_NUM_THREADS": "1",
              # XLA: Eigen's and the intra-op pools to one thread; taskset is what really holds JAX to one core
              "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
              "TF_CPP_MIN_LOG_LEVEL": "3"}


def load1() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def pin_prefix() -> list[str]:
    """`taskset -c CORE` when available (Linux), else nothing (the one-thread settings still apply)."""
    return ["taskset", "-c", str(CORE)] if shutil.which("taskset") else []


def side_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """The driver's environment, one thread everywhere, the repo importable; `extra` sets (None: removes)."""
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class Worker:
    """One side's process; `prepare(kind, **spec)` sets a task up (warm-up and compilation included, their
    seconds reported), `run(name)` times it once inside the worker (only the work, no IPC)."""

    def __init__(self, label: str, python: str | None = None, env: dict[str, str | None] | None = None):
        self.label = label
        self.python = python or sys.executable
        # the worker's stderr, open while it runs; close() removes it
        self._err = tempfile.NamedTemporaryFile(prefix=f"dpsgd-bench-{label}-", suffix=".log",  # noqa: SIM115
                                                delete=False)
        self.proc = subprocess.Popen(pin_prefix() + [self.python, "-m", "benchmarks.sides"], cwd=REPO,
                                     env=side_env(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, bufsize=1)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        for line in self.proc.stdout:
            if line.startswith(MARK):
                answer = json.loads(line[len(MARK):])
                if "skip" in answer:
                    raise Skip(answer["skip"])
                if "error" in answer:
                    raise RuntimeError(f"{self.label}: {answer['error']}")
                return answer
        raise RuntimeError(f"{self.label} worker ended: {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        try:
            lines = Path(self._err.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no stderr)"
        return " | ".join(lines[-3:])[-400:] or "(no stderr)"

    def prepare(self, name: str, kind: str, **spec) -> dict[str, Any]:
        return self.ask({"op": "prepare", "name": name, "kind": kind, "spec": spec})

    def run(self, name: str) -> dict[str, Any]:
        return self.ask({"op": "run", "name": name})

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask({"op": "quit"})
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(self._err.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class Command:
    """A side that is a whole command (timed from outside, wall clock), pinned like the workers; what it printed
    after :data:`MARK` (a JSON object, the last such line) is merged into its answer."""

    argv: list[str]
    env: dict[str, str | None] = field(default_factory=dict)
    fresh_dir: bool = True  # an empty temporary folder substituted for "{out}" in argv at each run

    def __call__(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="dpsgd-bench-cmd-") as tmp:
            argv = [a.replace("{out}", tmp) for a in self.argv]
            cpu0 = _children_cpu()
            start = time.perf_counter()
            proc = subprocess.run(pin_prefix() + argv, cwd=REPO, env=side_env(self.env), capture_output=True,
                                  text=True)
            seconds = time.perf_counter() - start
            cpu = _children_cpu() - cpu0
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{' '.join(argv[:4])} … failed: {tail[:300]}")
        said = [line[len(MARK):] for line in proc.stdout.splitlines() if line.startswith(MARK)]
        return {**(json.loads(said[-1]) if said else {}), "seconds": seconds, "cpu_seconds": cpu}


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children (a command's CPU time: unlike its wall time,
    not stretched by other processes sharing the core)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Measured:
    """Best of the rounds of one side, its median, and the load average at each of its measurements."""

    times: list[float]
    loads: list[float | None]
    info: dict[str, Any]
    cpu: list[float] = field(default_factory=list)  # CPU seconds per round, for sides that report them

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def json(self) -> dict[str, Any]:
        return {"best_s": self.best, "median_s": self.median, "times_s": self.times, "load1": self.loads,
                "info": self.info, **({"cpu_s": self.cpu} if self.cpu else {})}


def interleave(sides: dict[str, Callable[[], dict[str, Any]]], rounds: int) -> dict[str, Measured]:
    """Run every side once per round, in the same order each round (A B A B …); each call returns
    {"seconds": …, …}. The best of the rounds is the figure."""
    out = {name: Measured([], [], {}) for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            before = load1()
            answer = fn()
            m = out[name]
            m.times.append(float(answer.pop("seconds")))
            if "cpu_seconds" in answer:
                m.cpu.append(float(answer.pop("cpu_seconds")))
            m.loads.append(None if before is None else round((before + (load1() or before)) / 2, 2))
            m.info = answer
    return out


def load_text(*measured: Measured) -> str:
    """The load average over the measurements of a comparison: 'load 1.2 (1.0–1.5)'."""
    loads = [v for m in measured for v in m.loads if v is not None]
    if not loads:
        return "load ?"
    return f"load {statistics.mean(loads):.1f} ({min(loads):.1f}–{max(loads):.1f})"


def mean_load(*measured: Measured) -> float | None:
    loads = [v for m in measured for v in m.loads if v is not None]
    return round(statistics.mean(loads), 2) if loads else None
