"""Print the audit's goals, measured: run from the repository root after `dpsgd audit experiments.yaml --only audit`.

    python scripts/audit_goals.py [RESULTS]        (RESULTS: default results)

1. the `audit` grid: every dp_sgd cell's positive control refuted; no sound algorithm refuted; the all-iterates
   rows of bolt_on and output_perturbation `not covered` (read from RESULTS/audit/audit.csv);
2. DP-SGD with the noise removed (noise scale 0) refuted in every dp_sgd cell of `audit` at ε ≤ 1 under a
   white-box threat model (audited here, the grid's own audit block);
3. the false-refutation rate over simulated exactly tight mechanisms (`tests/test_audit_power.py` asserts it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd


def main(results: Path) -> None:
    from dpsgd_cli.audit.engine import audit_cell
    from dpsgd_cli.audit import stats
    from dpsgd_cli.config import expand, load_grid_file, select

    frame = pd.read_csv(results / "audit" / "audit.csv")
    ok = frame[frame["status"] == "ok"]
    cells = ok.groupby("cell_id")
    dp = ok[ok["algorithm"] == "dp_sgd"]
    refuted_controls = dp.groupby("cell_id").apply(lambda g: (g["control_epsilon_lo"] > g["epsilon_claimed"]).any())
    print(f"1a. dp_sgd cells whose positive control (noise x {dp['control'].iloc[0]:g}) is refuted: "
          f"{int(refuted_controls.sum())} / {len(refuted_controls)}")
    for cell_id, group in dp.groupby("cell_id"):
        best = group.loc[group["control_epsilon_lo"].idxmax()]
        print(f"    ε = {best['epsilon']:g}: twin's ε = {best['control_epsilon']:.3g}, its ε_lo = "
              f"{best['control_epsilon_lo']:.3f} ({best['canary']}, {best['threat_model']})")
    print(f"1b. rows with verdict refuted: {int((ok['verdict'] == 'refuted').sum())} of {len(ok)}")
    every = ok[ok["algorithm"].isin(["bolt_on", "output_perturbation"])
               & (ok["threat_model"] == "white-box, all iterates")]
    print(f"1c. bolt_on / output_perturbation all-iterates rows `not covered`: "
          f"{int((every['verdict'] == 'not covered').sum())} / {len(every)} "
          f"(output_perturbation has none: the Dirac canary is not applicable without iterates)")
    verdicts = cells.apply(lambda g: next(v for v in ("refuted", "consistent", "uninformative", "not covered")
                                          if (g["verdict"] == v).any() or v == "not covered"))
    print("    cell verdicts:", verdicts.value_counts().to_dict())

    grid = select(load_grid_file(Path("experiments.yaml")), ["audit"])[0]
    spec = grid.audit.model_copy(update={"control": None})
    start = time.perf_counter()
    print("2.  DP-SGD with the noise removed, every dp_sgd cell of `audit` at ε ≤ 1:")
    for cell in expand(grid):
        if cell.algorithm.name != "dp_sgd" or cell.epsilon > 1:
            continue
        rows = audit_cell(cell, spec, algorithm=cell.make_algorithm().with_noise_scale(0.0))
        white = [r for r in rows if r["threat_model"].startswith("white-box") and r["status"] == "ok"]
        best = max(white, key=lambda r: r["epsilon_lo"])
        print(f"    ε = {cell.epsilon:g}: ε_lo = {best['epsilon_lo']:.3f} ({best['threat_model']}, verdict "
              f"{best['verdict']}; ceiling {best['ceiling']:.3f})")
    print(f"    ({time.perf_counter() - start:.0f} s)")

    rng = np.random.default_rng(7)
    cells_n, rows_n, n, eps, p0 = 2000, 3, 500, 1.0, 0.2
    tp, fp = rng.binomial(n, np.exp(eps) * p0, (cells_n, rows_n)), rng.binomial(n, p0, (cells_n, rows_n))
    lo = stats.epsilon_from_counts(tp, fp, n, n, 0.05 / rows_n, 0.0)
    print(f"3.  false refutations of an exactly tight ε = 1 mechanism, families of {rows_n} rows at 95%: "
          f"{(lo > eps).any(axis=1).mean():.4f} of {cells_n} cells (stated α = 0.05)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results"))
