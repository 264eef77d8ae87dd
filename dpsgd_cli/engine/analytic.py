"""Tables that need no training, computed by `dpsgd run` for the analytic figures of a grid.

`privacy_curve`: Rényi ε of noisy GD over K steps under both bounds of Chourasia, Ye, Shokri (NeurIPS 2021).
`noise_scale`: the noise σ `bassily2014` needs for the same (ε, δ) under each accounting, over T and n.
Each is written to `<results>/<grid>/<figure name>.csv`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pandas as pd

from dpsgd_cli.config import FigureSpec, Grid

# (label, accounting, formula, amplification) of bassily2014 in the noise-scale figure (Bellet's lecture)
NOISE_ACCOUNTINGS = [
    ("closed form (lecture, 16·l)", "closed_form", "lecture", "tight"),
    ("closed form (√32·l, unverified)", "closed_form", "paper", "tight"),
    ("advanced composition, 2qε", "advanced_composition", "lecture", "approx"),
    ("advanced composition, tight amplification", "advanced_composition", "lecture", "tight"),
    ("RDP (dp-accounting)", "rdp", "lecture", "tight"),
    ("PLD (dp-accounting)", "pld", "lecture", "tight"),
]


def privacy_curve_table(params: dict[str, Any]) -> pd.DataFrame:
    """Long format K, bound (dynamics | composition | lower_bound), rdp_epsilon — so claims can compare bounds;
    params as `dpsgd privacy-curve` (the talk's defaults)."""
    from dpsgd_cli.plots.privacy_curve import k_values
    from dpsgd_cli.privacy.dynamics import privacy_curve

    params = dict(params)
    ks = k_values(int(params.pop("k_max", 1000)), int(params.pop("points", 200)), log=bool(params.pop("log_x", False)))
    wide = privacy_curve(ks, **params)
    return wide.melt(id_vars="K", var_name="bound", value_name="rdp_epsilon")


def noise_scale_table(params: dict[str, Any]) -> pd.DataFrame:
    """σ of bassily2014 calibrated to (ε, δ) under each accounting: over T = epochs·n at fixed n and δ = 1/n²
    (panel "T"), and over n at fixed T = `steps_fixed` and δ = `delta_fixed` (panel "n": the lecture's "more
    data (larger n) → less noise" is a statement at fixed T and δ). Columns panel, accounting, n, steps, delta,
    sigma, proved (False where the accounting's lemmas do not apply, e.g. per-step ε₀ > 1 for 2qε)."""
    from dpsgd_cli.algorithms.bassily import calibrate_bassily

    epsilon = float(params.get("epsilon", 1.0))
    n_fixed = int(params.get("n", 30162))
    epochs_axis = [float(e) for e in params.get("epochs", [0.1, 0.3, 1, 3])]
    n_axis = [int(v) for v in params.get("n_values", [1000, 3000, 10000, 30000])]
    steps_fixed = int(params.get("steps_fixed", n_fixed))
    delta_fixed = float(params.get("delta_fixed", 1.0 / n_fixed**2))
    skip = set(params.get("skip", []))
    points = [("T", n_fixed, round(e * n_fixed), 1.0 / n_fixed**2) for e in epochs_axis]
    points += [("n", n, steps_fixed, delta_fixed) for n in n_axis]
    rows = []
    for label, accounting, formula, amplification in NOISE_ACCOUNTINGS:
        if label in skip:
            continue
        for panel, n, steps, delta in points:
            privacy = calibrate_bassily(epsilon, delta, n, steps, 1.0, accounting, formula, amplification)
            rows.append({"panel": panel, "accounting": label, "n": n, "steps": steps, "epsilon": epsilon,
                         "delta": delta, "sigma": privacy.sigma, "proved": privacy.proved})
    return pd.DataFrame(rows)


ANALYTIC: dict[str, Callable[[dict[str, Any]], pd.DataFrame]] = {
    "privacy_curve": privacy_curve_table,
    "noise_scale": noise_scale_table,
}


def write_analytic_tables(grid: Grid, folder: Path) -> list[Path]:
    """Compute the table of every analytic figure of the grid (cheap next to training; redone each run)."""
    paths = []
    for figure in grid.figures:
        if figure.kind in ANALYTIC:
            path = Path(folder) / f"{figure.name}.csv"
            ANALYTIC[figure.kind](figure.params).to_csv(path, index=False)
            paths.append(path)
    return paths


def analytic_table(folder: Path, figure: FigureSpec) -> pd.DataFrame:
    path = Path(folder) / f"{figure.name}.csv"
    if not path.exists():
        from dpsgd_cli.errors import UserError

        raise UserError(f"{path}: missing; run the grid again (`dpsgd run ... --only {Path(folder).name}`) "
                        f"to compute the table of figure {figure.name}")
    return pd.read_csv(path)
