"""Shared pieces of the benchmark: timing, result rows, data loading with a clear skip, machine description."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Timing:
    """Best-of-k wall times of one callable (seconds)."""

    min: float
    median: float
    k: int
    times: list[float]

    def json(self) -> dict[str, Any]:
        return {"min_s": self.min, "median_s": self.median, "k": self.k, "times_s": self.times}


def best_of(fn: Callable[[], Any], k: int, warmup: int = 0) -> tuple[Timing, Any]:
    """Run fn warmup + k times; (timing of the k timed runs, result of the last run)."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(max(1, k)):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return Timing(min(times), statistics.median(times), len(times), times), result



def interleaved_best(fns: dict[Any, Callable[[], Any]], rounds: int, reps: int = 3,
                     contexts: dict[Any, Callable[[], Any]] | None = None) -> dict[Any, Timing]:
    """Each fn once untimed, then `rounds` rounds, each running every fn `reps` times in turn (A A A B B B A A A …):
    the fns see the same moments of a shared machine, so their ratio is not one side's lucky time slice.
    contexts[name]() (e.g. a thread limit, slow to enter) is entered around a fn's reps, outside the clock."""
    contexts = contexts or {}
    times: dict[Any, list[float]] = {name: [] for name in fns}
    for r in range(max(1, rounds) + 1):
        for name, fn in fns.items():
            with contexts.get(name, contextlib.nullcontext)():
                for _ in range(reps if r else 1):
                    start = time.perf_counter()
                    fn()
                    if r:
                        times[name].append(time.perf_counter() - start)
    return {name: Timing(min(t), statistics.median(t), len(t), t) for name, t in times.items()}

@dataclass
class Row:
    """One line of the table (and of the JSON)."""

    case: str
    what: str
    ours: str = "–"
    comparison: str = "–"
    ratio: float | None = None  # the comparison's time / ours (> 1: ours faster); case 2: ours / the floor
    ratio_label: str = "×"  # "× floor" for case 2
    goal: str = "–"
    met: bool | None = None  # None: no goal, or skipped
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # numbers for the JSON
    load: float | None = None  # mean 1-minute load average over the measurements behind the ratio
    goal_id: str = ""  # the performance goal this row measures (see __main__.GOALS), if any

    def json(self) -> dict[str, Any]:
        return asdict(self)


class Skip(Exception):
    """A case cannot run here (data missing, optional package absent); the message says how to fix it."""


def config() -> dict[str, str]:
    return {"DPSGD_DATA_DIR": os.environ.get("DPSGD_DATA_DIR", "./datasets (default)"),
            "DPSGD_DATA_MIRROR": os.environ.get("DPSGD_DATA_MIRROR", "(unset: canonical URLs)")}


def load(spec_kwargs: dict[str, Any]):
    """The dataset as `dpsgd run` holds it (`engine.runner.dataset`: loaded once per process, arrays read-only, so
    per-dataset work such as row norms is done once, not per fit), or Skip with the fix (the data layer downloads
    into DPSGD_DATA_DIR on first use)."""
    from dpsgd_cli.data import DatasetSpec
    from dpsgd_cli.engine.runner import dataset

    spec = DatasetSpec(**spec_kwargs)
    try:
        return dataset(spec)
    except Exception as exc:  # DataError (no network, no mirror, bad checksum) or anything else while loading
        raise Skip(f"{spec.name} not available ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); fix: "
                   f"`dpsgd datasets fetch {spec.name}` with network access, or set DPSGD_DATA_MIRROR to a folder "
                   f"or URL serving <dataset>/<file>") from exc


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def fmt_rate(per_second: float, unit: str) -> str:
    if per_second >= 1e6:
        return f"{per_second / 1e6:.2f} M {unit}/s"
    if per_second >= 1e3:
        return f"{per_second / 1e3:.1f} k {unit}/s"
    return f"{per_second:.1f} {unit}/s"


# --- machine ---------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_sizes() -> dict[str, str]:
    """Cache sizes of CPU 0 from sysfs (L3 matters: adult's 24 MiB X may fit in it)."""
    out = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            out[f"L{level} {kind}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    return out


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("dpsgd", "numpy", "scipy", "numba", "llvmlite", "dp-accounting", "joblib", "torch", "opacus"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _blas() -> list[dict[str, Any]]:
    try:
        from threadpoolctl import threadpool_info

        return [{k: v for k, v in info.items() if k in ("user_api", "internal_api", "version", "num_threads",
                                                         "threading_layer", "architecture")}
                for info in threadpool_info()]
    except Exception as exc:  # threadpoolctl comes with scikit-learn; report rather than fail
        return [{"error": str(exc)}]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    cores = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gb = None
    return {
        "cpu_model": _cpu_model(), "cores": cores, "usable_cores": usable, "memory_gib": mem_gb,
        "caches": _cache_sizes(),
        "platform": platform.platform(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "blas": _blas(), "versions": _versions(), "git_commit": _git_commit(), "python_executable": sys.executable,
        "data": config(),
    }


def busy_note(info: dict[str, Any]) -> str:
    """A warning when other processes load the machine (the timings are then pessimistic and noisy)."""
    load = (info.get("load_average") or [0])[0]
    cores = info.get("usable_cores") or 1
    if load > 0.5 * cores:
        return (f"machine busy: load average {load:.1f} on {cores} cores at the start; timings are pessimistic "
                f"and noisy, rerun on a quiet machine for published figures")
    return ""


def logreg_setting(data, **kw):
    """The Setting of case 1 (adult, B = 256, 1 epoch, lr 2, C = 1, λ = 1e-4, ε = 1, δ = 1/n²), overridable."""
    from dpsgd_cli.algorithms import Setting

    base = dict(n=data.n, d=data.d, delta=1.0 / data.n**2, l2=1e-4, epsilon=1.0, batch_size=256, lr=2.0, epochs=1,
                clip_norm=1.0)
    base.update(kw)
    return Setting(**base)


def accuracy(theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Test accuracy of linear parameters (R, d) (for the sanity columns: same task, same quality)."""
    return np.mean(np.where(np.atleast_2d(theta) @ X.T >= 0, 1.0, -1.0) == y, axis=-1)


# --- Opacus, in this interpreter or in another one ------------------------------------------------------------


class Opacus:
    """Runs `opacus_worker` requests: in-process when opacus imports here, else with `python` (a path to an
    interpreter that has torch and opacus), else raises Skip with how to enable the comparison."""

    HOWTO = ("opacus is not importable here (optional, never a dependency); to compare, install it in a separate "
             "venv (python -m venv /tmp/ov && /tmp/ov/bin/pip install torch opacus) and pass "
             "--opacus-python /tmp/ov/bin/python")

    def __init__(self, python: str | None = None):
        self.python = python
        try:
            import opacus  # noqa: F401
            import torch  # noqa: F401

            self.mode: str | None = "in-process"
        except Exception:
            self.mode = "subprocess" if python else None

    def describe(self) -> str:
        if self.mode == "in-process":
            return "in-process"
        if self.mode == "subprocess":
            return f"via {self.python}"
        return "not available"

    def run(self, request: dict[str, Any], arrays: dict[str, np.ndarray] | None = None,
            timeout: float = 900) -> dict[str, Any]:
        import json
        import tempfile

        if self.mode is None:
            raise Skip(self.HOWTO)
        with tempfile.TemporaryDirectory(prefix="dpsgd-bench-opacus-") as tmp:
            if arrays is not None:
                path = Path(tmp) / "data.npz"
                np.savez(path, **arrays)
                request = {**request, "data": str(path)}
            if self.mode == "in-process":
                from benchmarks import opacus_worker

                return opacus_worker.run_request(request)
            req = Path(tmp) / "request.json"
            req.write_text(json.dumps(request))
            proc = subprocess.run([self.python, str(Path(__file__).with_name("opacus_worker.py")), str(req)],
                                  capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise Skip(f"the Opacus worker failed with {self.python}: {tail[:200]}")
            return json.loads(proc.stdout)
