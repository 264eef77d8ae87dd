"""Case 11: every grid of experiments.yaml end to end, as a user reproducing the papers runs them.

For each grid (the audit grids excepted: `dpsgd audit` runs them), one `dpsgd run experiments.yaml --only GRID
--jobs 2 --out <folder>` process, then `dpsgd plot <folder> --jobs 2` and `dpsgd report <folder> --jobs 2` once
over every grid (each grid's folder in a worker);
each command's wall time and CPU time (user + system of the process and its workers, `getrusage` of the
children) is recorded, with the grid's runs and their summed training time (runs.csv's `wall_time`). By default
as from a fresh clone: the σ / L* cache (DPSGD_CACHE_DIR), numba's compiled kernels (NUMBA_CACHE_DIR) and,
when DPSGD_DATA_MIRROR is set, the data folder (DPSGD_DATA_DIR: downloads from the mirror and preprocessing) are
new empty folders, shared by the grids in turn as one user's clone would share them. Nothing is pinned: the
workers use both cores as `--jobs 2` does. The same code is the command line `scripts/time_grids.py`, which
can also compare every run's numbers with another results folder (`compare`). `--quick`: `smoke` and `kang_lr`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, Row

GOAL_S = 600.0  # every grid, the figures and the report in at most ten minutes on the 2-core machine
QUICK_GRIDS = ["smoke", "kang_lr"]
CACHES = ("sigma", "numba", "data")  # what `cold` may name
TOLERANCE = 1e-12  # `compare`: |a − b| ≤ TOLERANCE · max(1, |b|) for every number of a run
NOT_COMPARED = {"wall_time"}  # a run's time is not one of its numbers


@dataclass
class Step:
    """One timed command."""

    name: str  # the grid, or "plot" / "report"
    command: list[str]
    wall_s: float = math.nan
    cpu_s: float = math.nan  # user + system of the process and its waited-for children (the workers)
    returncode: int | None = None
    runs: int = 0  # rows of runs.csv (a grid)
    not_ok: dict[str, int] = field(default_factory=dict)  # runs by status other than ok
    train_s: float = 0.0  # the rows' summed wall_time: training, summed over the workers
    log: str = ""  # the command's output, saved beside the results

    def json(self) -> dict[str, Any]:
        return asdict(self)


def grid_names(grid_file: Path = REPO / "experiments.yaml") -> list[str]:
    """The grids `dpsgd run` reproduces: every grid of the file but the audits (they have an `audit:` block or an
    audit name, and run under `dpsgd audit`)."""
    from dpsgd_cli.config import load_grid_file

    return [g.name for g in load_grid_file(grid_file).grids if g.audit is None and not g.name.startswith("audit")]


def environment(root: Path, cold: Iterable[str]) -> dict[str, str]:
    """The commands' environment: this one, with the caches named in `cold` moved to new empty folders under
    `root` (σ and L*: DPSGD_CACHE_DIR; compiled kernels: NUMBA_CACHE_DIR; data: DPSGD_DATA_DIR, filled from
    DPSGD_DATA_MIRROR)."""
    env = dict(os.environ)
    cold = set(cold)
    unknown = cold - set(CACHES)
    if unknown:
        raise ValueError(f"unknown cache(s) {sorted(unknown)}; choose among {', '.join(CACHES)}")
    if "sigma" in cold:
        env["DPSGD_CACHE_DIR"] = str(root / "cache")
    elif "data" in cold and "DPSGD_CACHE_DIR" not in env:  # keep the σ cache where it was (under the data)
        from dpsgd_cli.diskcache import cache_folder

        folder = cache_folder("sigma")
        if folder is not None:
            env["DPSGD_CACHE_DIR"] = str(folder.parent)
    if "numba" in cold:
        env["NUMBA_CACHE_DIR"] = str(root / "numba")
    if "data" in cold:
        env["DPSGD_DATA_DIR"] = str(root / "data")
    return env


def timed(step: Step, env: dict[str, str], log: Path | None = None) -> Step:
    """Run the step's command (cwd: the repository) and record its wall and CPU time and exit code; its output
    goes to `log`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(step.command, cwd=REPO, env=env, capture_output=True, text=True)
    step.wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    step.cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    step.returncode = proc.returncode
    if log is not None:
        log.write_text(proc.stdout + ("\n--- stderr ---\n" + proc.stderr if proc.stderr else ""))
        step.log = str(log)
    return step


def read_runs(folder: Path, step: Step) -> Step:
    """The grid's runs, their statuses and summed training time, from its runs.csv (absent: none)."""
    import pandas as pd

    path = folder / "runs.csv"
    if not path.exists():
        return step
    frame = pd.read_csv(path)
    step.runs = len(frame)
    step.not_ok = {str(k): int(v) for k, v in frame["status"].value_counts().items() if k != "ok"}
    step.train_s = float(frame["wall_time"].fillna(0).sum())
    return step


def run_grids(grids: list[str], out: Path, jobs: int = 2, cold: Iterable[str] = CACHES,
              plot_and_report: bool = True, grid_file: Path = REPO / "experiments.yaml",
              say=lambda text: print(text, file=sys.stderr, flush=True)) -> list[Step]:
    """Each grid with `dpsgd run`, then `dpsgd plot` and `dpsgd report` over them all; the caches in `cold`
    start empty (under out/.caches) and are shared by the commands in turn."""
    out.mkdir(parents=True, exist_ok=True)
    caches = out / ".caches"
    env = environment(caches, cold)
    logs = out / ".logs"
    logs.mkdir(exist_ok=True)
    dpsgd = [sys.executable, "-m", "dpsgd_cli"]
    steps = []
    for grid in grids:
        step = Step(grid, dpsgd + ["run", str(grid_file), "--only", grid, "--jobs", str(jobs), "--out", str(out)])
        read_runs(out / grid, timed(step, env, logs / f"{grid}.log"))
        say(f"{grid}: {step.wall_s:.1f} s wall, {step.cpu_s:.1f} s CPU, {step.runs} runs"
            + (f", not ok: {step.not_ok}" if step.not_ok else "") + (f" (exit {step.returncode})"
                                                                      if step.returncode else ""))
        steps.append(step)
    if plot_and_report:
        for name in ("plot", "report"):
            step = timed(Step(name, dpsgd + [name, str(out), "--jobs", str(jobs)]), env, logs / f"{name}.log")
            say(f"{name}: {step.wall_s:.1f} s wall, {step.cpu_s:.1f} s CPU" + (f" (exit {step.returncode})"
                                                                                if step.returncode else ""))
            steps.append(step)
    return steps


def markdown(steps: list[Step], note: str = "") -> str:
    """The steps as a Markdown table (grid, wall, CPU, runs, training time, not ok), with the total."""
    lines = ["| step | wall (s) | CPU (s) | runs | training (s, summed) | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in steps:
        remark = ", ".join(f"{v} {k}" for k, v in s.not_ok.items())
        if s.returncode:
            remark = ", ".join(filter(None, [remark, f"exit {s.returncode}"]))
        runs = str(s.runs) if s.runs else "–"
        train = f"{s.train_s:.1f}" if s.runs else "–"
        lines.append(f"| {s.name} | {s.wall_s:.1f} | {s.cpu_s:.1f} | {runs} | {train} | {remark} |")
    wall, cpu = sum(s.wall_s for s in steps), sum(s.cpu_s for s in steps)
    lines.append(f"| **total** | **{wall:.1f}** ({wall / 60:.1f} min) | {cpu:.1f} | {sum(s.runs for s in steps)} "
                 f"| {sum(s.train_s for s in steps):.1f} | {note} |")
    return "\n".join(lines) + "\n"


def _numbers(value: Any, prefix: str = "") -> Iterable[tuple[str, float]]:
    """The numeric leaves of a parsed `derived` JSON value, by path."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{prefix}[{i}]")


def _close(a: float, b: float, tolerance: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= tolerance * max(1.0, abs(b))


def compare(folder: Path, reference: Path, tolerance: float = TOLERANCE) -> list[str]:
    """How the runs of `folder`'s runs.csv differ from `reference`'s, by run id: the same run ids and statuses,
    every number (the numeric columns and the numbers inside `derived`, but not `wall_time`) within `tolerance`
    (relative above 1), the text columns equal. [] when they agree."""
    import pandas as pd

    from dpsgd_cli.engine.results import NUMERIC

    ours, ref = (pd.read_csv(f / "runs.csv", dtype={"run_id": str}).set_index("run_id") for f in (folder, reference))
    problems = []
    if ours.index.has_duplicates or ref.index.has_duplicates:
        problems.append("a run id appears twice")
    missing, extra = sorted(set(ref.index) - set(ours.index)), sorted(set(ours.index) - set(ref.index))
    if missing or extra:
        problems.append(f"run ids differ: {len(missing)} missing (e.g. {missing[:3]}), {len(extra)} extra "
                        f"(e.g. {extra[:3]})")
    common = sorted(set(ours.index) & set(ref.index))
    for column in ref.columns:
        if column in NOT_COMPARED:
            continue
        if column not in ours.columns:
            problems.append(f"column {column} missing")
            continue
        for run_id in common:
            a, b = ours.at[run_id, column], ref.at[run_id, column]
            if column == "derived":
                da = dict(_numbers(json.loads(a))) if isinstance(a, str) and a else {}
                db = dict(_numbers(json.loads(b))) if isinstance(b, str) and b else {}
                keys = {k for k in da.keys() | db.keys() if "time" not in k}
                bad = [k for k in sorted(keys) if k not in da or k not in db or not _close(da[k], db[k], tolerance)]
                if bad:
                    problems.append(f"{run_id} derived {bad[0]}: {da.get(bad[0])!r} vs {db.get(bad[0])!r}")
            elif column in NUMERIC:
                fa, fb = float(a) if pd.notna(a) else math.nan, float(b) if pd.notna(b) else math.nan
                if not _close(fa, fb, tolerance):
                    problems.append(f"{run_id} {column}: {fa!r} vs {fb!r}")
            elif not (pd.isna(a) and pd.isna(b)) and a != b:
                problems.append(f"{run_id} {column}: {a!r} vs {b!r}")
    return problems


def run(ctx) -> list[Row]:
    grids = QUICK_GRIDS if ctx.quick else [g for g in (ctx.end_to_end or "all").split(",") if g]
    if grids == ["all"]:
        grids = grid_names()
    cold = list(CACHES) if os.environ.get("DPSGD_DATA_MIRROR") else ["sigma", "numba"]
    with tempfile.TemporaryDirectory(prefix="dpsgd-bench-e2e-") as tmp:
        steps = run_grids(grids, Path(tmp), jobs=2, cold=cold)
    rows = []
    for s in steps:
        note = ", ".join(f"{v} {k}" for k, v in s.not_ok.items()) + (f"; exit {s.returncode}" if s.returncode else "")
        what = f"{s.name}: dpsgd run --jobs 2" if s.runs or s.name not in ("plot", "report") else f"dpsgd {s.name}"
        rows.append(Row("11", what, ours=f"{s.wall_s:.1f} s wall, {s.cpu_s:.1f} s CPU",
                        comparison=f"{s.runs} runs, training {s.train_s:.1f} s" if s.runs else "–",
                        note=note, data=s.json()))
    wall = sum(s.wall_s for s in steps)
    full = not ctx.quick and (ctx.end_to_end or "all") == "all"
    rows.append(Row("11", f"every grid, plot and report end to end (cold: {', '.join(cold)})" if full else
                    f"{', '.join(grids)}, plot and report end to end (cold: {', '.join(cold)})",
                    ours=f"{wall:.0f} s wall ({wall / 60:.1f} min), {sum(s.cpu_s for s in steps):.0f} s CPU",
                    ratio=wall / 60 if full else None, ratio_label=" min",  # the goal is a time, not a ratio
                    goal=f"≤ {GOAL_S / 60:g} min" if full else "–", met=(wall <= GOAL_S) if full else None,
                    goal_id="end_to_end" if full else "",
                    load=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                    data={"wall_s": wall, "steps": [s.json() for s in steps], "cold": cold}))
    return rows
