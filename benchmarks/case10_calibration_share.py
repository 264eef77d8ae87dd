"""Case 10: σ calibration's share of a one-seed run's wall time, σ not cached (the goal: ≤ 10%).

Two one-seed grids on adult (copied from experiments.yaml's `kang_lr`), each run as `dpsgd run --jobs 1` in a
fresh process pinned to one core:
(a) one `dp_sgd` cell at ε = 3, the costliest target of kang_lr's axis (its optimal RDP order is fractional, on
    the edge where the binomial sum's last term takes over): the row's task is that cell alone;
(b) kang_lr on adult with one seed (erm, sgd and `dp_sgd` at 8 ε): sgd and the 8 `dp_sgd` cells train fused in
    one task whose time its rows share, the 8 σ calibrated at its start on one accountant curve.
Inside each process the time spent in `accounting.cached` (the calibration cache's read and check, the search,
the write: the timers) is divided by the rows' summed `wall_time` (their tasks' time). Cold: a calibration cache with
nothing in it (L*'s cache holds the optimum, as after any first run); warm: every σ cached. Each round runs a
cold and a warm process of each grid, interleaved. Two measures: the timers' share, median over the cold runs
(an upper bound: a fresh process pays NumPy/SciPy first-call costs there that training would otherwise pay),
and what the cold cache adds to the rows' wall time (median cold − median warm, over the median cold; noisier).
`--quick`: 3 rounds (default 10).
"""

from __future__ import annotations

import csv
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.case9_fused_grid import scaled_yaml
from benchmarks.common import Row, Skip, load
from benchmarks.pinned import MARK, Command, load1

GOAL_PERCENT = 10.0
GRIDS = {  # case letter: (goal id, what, kang_lr's overrides)
    "10a": ("calibration_cell", "one dp_sgd cell, adult, ε = 3, 5 epochs",
            {"dataset": "adult", "seeds": 1, "algorithms": ["dp_sgd"], "epsilon": [3]}),
    "10b": ("calibration_kang", "kang_lr on adult (erm, sgd, dp_sgd × 8 ε fused), 5 epochs",
            {"dataset": "adult", "seeds": 1}),
}


def _worker(grid_file: str, out: str) -> None:
    """In the child: `dpsgd run` with the calibration timed; prints the timers and the rows' summed wall_time."""
    from dpsgd_cli.privacy import accounting

    spent, calls = [0.0], {}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper

    # the cache's read and check, the search and the write, all inside `cached` (looked up by name at each call);
    # the searches counted apart
    accounting.cached = timed(accounting.cached)
    search = accounting._calibrate_sigma

    def counted(*args, **kwargs):
        calls["_calibrate_sigma"] = calls.get("_calibrate_sigma", 0) + 1
        return search(*args, **kwargs)

    accounting._calibrate_sigma = counted
    from dpsgd_cli.cli import app

    try:
        app(["run", grid_file, "--out", out, "--jobs", "1"], standalone_mode=False)
    except SystemExit as exc:
        if exc.code:
            raise
    rows = [row for f in sorted(Path(out).glob("*/runs.csv")) for row in csv.DictReader(f.open())]
    print(MARK + json.dumps({"calibration_s": spent[0], "wall_time_s": sum(float(r["wall_time"]) for r in rows),
                             "runs": len(rows), "not_ok": sum(r["status"] != "ok" for r in rows),
                             "calibrations": calls.get("_calibrate_sigma", 0)}))


def _measure(grid_file: Path, cache: Path) -> dict:
    """One pinned `dpsgd run` of `grid_file` with DPSGD_CACHE_DIR=`cache`; its worker's answer and the load."""
    before = load1()
    answer = Command([sys.executable, "-m", "benchmarks.case10_calibration_share", str(grid_file), "{out}"],
                     env={"DPSGD_CACHE_DIR": str(cache)})()
    if "not_ok" not in answer:
        raise RuntimeError(f"case 10: dpsgd run {grid_file.name} printed no measurement")
    if answer["not_ok"]:
        raise RuntimeError(f"case 10: {answer['not_ok']} run(s) of {grid_file.name} not ok")
    answer["load"] = None if before is None else (before + (load1() or before)) / 2
    return answer


def _cold_cache(warm: Path, folder: Path) -> Path:
    """A cache folder holding warm's L* (reference) entries and no σ."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if (warm / "reference").is_dir():
        shutil.copytree(warm / "reference", folder / "reference")
    return folder


def run(ctx) -> list[Row]:
    try:
        load({"name": "adult"})
    except Skip as skip:
        return [Row(case, what, goal=f"≤ {GOAL_PERCENT:g}%", note=f"skipped: {skip}")
                for case, (_, what, _) in GRIDS.items()]
    rounds = 3 if ctx.quick else 10
    with tempfile.TemporaryDirectory(prefix="dpsgd-bench-calshare-") as tmp:
        tmp = Path(tmp)
        files, warm = {}, {}
        for case, (_, _, overrides) in GRIDS.items():
            files[case] = tmp / f"{case}.yaml"
            scaled_yaml(["kang_lr"], {"kang_lr": overrides}, files[case])
            warm[case] = tmp / f"warm-{case}"
            _measure(files[case], warm[case])  # untimed: fills the σ and L* caches
        runs = {case: {"cold": [], "warm": []} for case in GRIDS}
        for _ in range(rounds):
            for case in GRIDS:
                runs[case]["cold"].append(_measure(files[case], _cold_cache(warm[case], tmp / "cold")))
                runs[case]["warm"].append(_measure(files[case], warm[case]))
    return [_row(case, runs[case], rounds) for case in GRIDS]


def _row(case: str, measured: dict, rounds: int) -> Row:
    goal_id, what, _ = GRIDS[case]
    cold, warm = measured["cold"], measured["warm"]
    shares = [100 * m["calibration_s"] / m["wall_time_s"] for m in cold]
    share = statistics.median(shares)
    cal_ms = statistics.median(m["calibration_s"] for m in cold) * 1e3
    cold_ms = statistics.median(m["wall_time_s"] for m in cold) * 1e3
    warm_ms = statistics.median(m["wall_time_s"] for m in warm) * 1e3
    warm_cal_ms = statistics.median(m["calibration_s"] for m in warm) * 1e3
    added = 100 * (cold_ms - warm_ms) / cold_ms
    loads = [m["load"] for m in cold + warm if m["load"] is not None]
    return Row(
        case, f"σ calibration over a one-seed run's wall_time, σ not cached: {what}",
        ours=f"calibration {cal_ms:.2f} ms of {cold_ms:.1f} ms", comparison=f"σ cached: {warm_ms:.1f} ms",
        ratio=share, ratio_label="%", goal=f"≤ {GOAL_PERCENT:g}%", met=share <= GOAL_PERCENT, goal_id=goal_id,
        load=round(statistics.mean(loads), 2) if loads else None,
        note=(f"{rounds} interleaved rounds (cold, warm) of {cold[0]['runs']} run(s); the timers' share (calibration"
              f" + its cache's read and write over the rows' wall_time) median {share:.1f}% ({min(shares):.1f}–"
              f"{max(shares):.1f}%); what the cold cache adds to the rows' wall_time (median cold − median warm, "
              f"over the median cold) {added:.1f}%; warm runs read σ in {warm_cal_ms:.2f} ms"),
        data={"cold": cold, "warm": warm, "timer_share_percent": shares, "added_percent": added})


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
