"""Compare a results folder run under one numerics version with a rerun of the same grids under another.

    python scripts/compare_numerics.py OLD_RESULTS NEW_RESULTS [--metric test_accuracy ...] [--alpha 0.05]

A numerics change (a generator, a summation order, a search) may move every number, so runs are not compared by
bits but by cell: for each grid, cell (`cell_id`, the spec without the seed) and metric, the seeds' mean under the
old version against the new. Seeds are replicas, not pairs (a new generator makes seed s's draws unrelated to its
old ones), so the test is Welch's: t = Δmean / √(s²_old/n_old + s²_new/n_new). A cell is within its seeds' noise
when |t| ≤ z, z the two-sided normal quantile at α / (number of cells tested) (Bonferroni: the family of cells of
one metric holds at α under no change). Cells whose seeds do not vary (a non-private reference with a deterministic
stream, or one seed) are compared with a relative tolerance instead (the calibration window for σ and ε), and
listed: a change there is a change of the computation, which must be explained.

Then the claims: `dpsgd report` verdicts read from each folder's report (api.report), listed where they differ.
Exit 1 when any cell is outside its noise or any verdict differs, so the comparison can gate a numerics change.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from dpsgd_cli import api

METRICS = ("test_accuracy", "train_objective", "optimality_gap", "sigma", "epsilon_achieved")
# a deterministic cell's tolerance: σ and ε move within the calibration's window (privacy/calibration.py: ε in
# [(1 − 10⁻³)·target, target]); a training metric only by summation order
DETERMINISTIC_RTOL = {"sigma": 2e-3, "epsilon_achieved": 2e-3}
DEFAULT_RTOL = 1e-6


def cell_table(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per (grid, cell_id): n, mean and std of `metric` over the ok runs' seeds."""
    ok = runs[(runs["status"] == "ok") & runs[metric].notna()]
    return ok.groupby(["grid", "cell_id"])[metric].agg(n="count", mean="mean", std="std").reset_index()


def compare_metric(old: pd.DataFrame, new: pd.DataFrame, metric: str, alpha: float) -> tuple[pd.DataFrame, int]:
    """The cells of both folders joined, with Welch's t and whether each is within noise; and how many were tested."""
    both = cell_table(old, metric).merge(cell_table(new, metric), on=["grid", "cell_id"], suffixes=("_old", "_new"))
    if both.empty:
        return both, 0
    se = np.sqrt(both["std_old"].fillna(0) ** 2 / both["n_old"] + both["std_new"].fillna(0) ** 2 / both["n_new"])
    diff = both["mean_new"] - both["mean_old"]
    noisy = (se > 0) & (both["n_old"] > 1) & (both["n_new"] > 1)
    tested = int(noisy.sum())
    z = stats.norm.isf(alpha / (2 * max(tested, 1)))
    both["delta"] = diff
    both["t"] = np.where(noisy, diff / se.where(se > 0, 1.0), np.nan)
    scale = np.maximum(both["mean_old"].abs(), 1e-12)
    rtol = DETERMINISTIC_RTOL.get(metric, DEFAULT_RTOL)
    both["within"] = np.where(noisy, both["t"].abs() <= z, (diff.abs() / scale) <= rtol)
    both["kind"] = np.where(noisy, "seeds", "deterministic")
    both["z"] = z
    return both, tested


def verdicts(folder: Path) -> pd.DataFrame:
    frame = api.report(folder)
    return frame[["grid", "claim", "verdict"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--metric", action="append", help=f"metrics to compare (default: {', '.join(METRICS)})")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--no-report", action="store_true", help="skip the claims' verdicts")
    args = parser.parse_args(argv)
    old, new = api.read_results(args.old), api.read_results(args.new)
    failed = False
    for metric in args.metric or METRICS:
        if metric not in old or metric not in new:
            continue
        table, tested = compare_metric(old, new, metric, args.alpha)
        if table.empty:
            continue
        outside = table[~table["within"].astype(bool)]
        noisy = table[table["kind"] == "seeds"]
        share_2se = float((noisy["t"].abs() > 2).mean()) if len(noisy) else math.nan
        print(f"{metric}: {len(table)} cells ({tested} with seed noise, z = {table['z'].iloc[0]:.2f}); "
              f"|t| > 2 in {share_2se:.1%} (about 5% expected under no change); outside: {len(outside)}")
        for grid, grid_table in table.groupby("grid"):
            g_noisy = grid_table[grid_table["kind"] == "seeds"]
            print(f"  {grid}: {len(grid_table)} cells, mean |t| {g_noisy['t'].abs().mean():.2f}, "
                  f"max |t| {g_noisy['t'].abs().max():.2f}, outside {int((~grid_table['within'].astype(bool)).sum())}")
        for row in outside.itertuples():
            print(f"    outside: {row.grid} {row.cell_id} {row.kind}: {row.mean_old:.6g} → {row.mean_new:.6g}"
                  f" (t = {row.t:.2f})")
        failed |= not outside.empty
    if not args.no_report:
        joined = verdicts(args.old).merge(verdicts(args.new), on=["grid", "claim"], how="outer",
                                          suffixes=("_old", "_new"))
        moved = joined[joined["verdict_old"] != joined["verdict_new"]]
        print(f"claims: {len(joined)}, verdicts changed: {len(moved)}")
        for row in moved.itertuples():
            print(f"  {row.grid} {row.claim}: {row.verdict_old} → {row.verdict_new}")
        failed |= not moved.empty
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
