"""The `kang_lr` grid on a local Dask cluster vs `--jobs 1` / `--jobs 2`: wall time, ratios, identical results.

`python -m benchmarks.distributed_grid [--reps K] [--modes jobs1,jobs2,local2,local2x3]` (needs the `dask`
extra and the data: DPSGD_DATA_MIRROR=/path/to/mirror or a filled DPSGD_DATA_DIR). Each trial is a fresh
process that plans the grid into a new folder (ERM optima included) and executes it — as `dpsgd run --only
kang_lr` does; `local2` starts a LocalCluster of 2 worker processes inside the trial (its start-up and the
workers' imports are timed), `local2xK` groups K cells per Dask task. Modes are interleaved (the machine is
shared: each round runs every mode once) and the 1-minute load average is recorded before each trial. Every
trial's runs.csv is compared with the first `jobs1` trial's (wall time aside): they must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRID = "kang_lr"


def _trial(mode: str, out: str) -> None:
    """In the child: plan and execute the grid in `mode`; print a JSON summary."""
    start = time.perf_counter()
    from dpsgd_cli.config import load_grid_file, select
    from dpsgd_cli.engine import execute, plan_grid

    grid = select(load_grid_file(REPO / "experiments.yaml"), [GRID])[0]
    plan = plan_grid(grid, Path(out))
    planned = time.perf_counter()
    if mode.startswith("jobs"):
        runs = execute(plan, jobs=int(mode[4:]))
        started, done, cpu = planned, time.perf_counter(), _cpu_seconds()
    else:
        from dpsgd_cli.engine.distributed import dask_backend

        workers, _, per_task = mode[5:].partition("x")
        with dask_backend(f"local:{workers}", cells_per_task=int(per_task or 1)) as backend:
            started = time.perf_counter()
            runs = execute(plan, backend=backend)
            done, cpu = time.perf_counter(), _cpu_seconds()  # before the workers exit
    print(json.dumps({"runs": runs, "plan_s": planned - start, "startup_s": started - planned,
                      "execute_s": done - started, "cpu_s": cpu}))


def _cpu_seconds() -> float:
    """CPU time of this process and its workers (loky's or Dask's, all children of this process)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _frame(folder: Path):
    import pandas as pd

    frame = pd.read_csv(folder / GRID / "runs.csv").drop(columns="wall_time")
    return frame.sort_values("run_id").reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default="jobs1,jobs2,local2")
    args = parser.parse_args()
    modes = args.modes.split(",")
    walls: dict[str, list[float]] = {m: [] for m in modes}
    loads: dict[str, list[float]] = {m: [] for m in modes}
    parts: dict[str, list[dict]] = {m: [] for m in modes}
    reference = None
    with tempfile.TemporaryDirectory(prefix="dpsgd-bench-dask-") as tmp:
        for rep in range(args.reps):
            for mode in modes:
                out = Path(tmp) / f"{mode}-{rep}"
                loads[mode].append(os.getloadavg()[0])
                start = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "benchmarks.distributed_grid", "--trial", mode, str(out)],
                                      cwd=REPO, capture_output=True, text=True)
                walls[mode].append(time.perf_counter() - start)
                if proc.returncode:
                    sys.exit(f"{mode} failed: {proc.stderr.strip().splitlines()[-1:]}")
                parts[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                frame = _frame(out)
                if reference is None:
                    reference = frame
                import pandas as pd

                pd.testing.assert_frame_equal(reference, frame)  # identical runs, ids and numbers
                print(f"round {rep + 1} {mode:>9}: {walls[mode][-1]:6.1f} s wall (load {loads[mode][-1]:.1f}); "
                      + ", ".join(f"{k} {v:.1f} s" for k, v in parts[mode][-1].items() if k.endswith("_s")),
                      flush=True)
    base = statistics.median(walls[modes[0]])
    base_cpu = statistics.median(p["cpu_s"] for p in parts[modes[0]])
    print(f"\n{GRID}: {len(reference)} runs, identical in every trial; median of {args.reps} interleaved rounds")
    for mode in modes:
        med = statistics.median(walls[mode])
        execute = statistics.median(p["execute_s"] for p in parts[mode])
        cpu = statistics.median(p["cpu_s"] for p in parts[mode])
        print(f"{mode:>9}: wall {med:6.1f} s ({base / med:.2f}× {modes[0]}), CPU {cpu:5.1f} s "
              f"({cpu / base_cpu:.2f}× {modes[0]}), execute {execute:5.1f} s, "
              f"cluster start {statistics.median(p['startup_s'] for p in parts[mode]):4.1f} s, "
              f"load {min(loads[mode]):.1f}–{max(loads[mode]):.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trial"]:
        _trial(sys.argv[2], sys.argv[3])
    else:
        main()
