"""Tables that need no training, computed by `dpsgd run` for a grid's analytic figures (`<figure name>.csv`).

`privacy_curve`: Rényi ε of noisy GD over K steps under both bounds of Chourasia, Ye, Shokri (NeurIPS 2021).
`noise_scale`: the noise σ `bassily2014` needs for the same (ε, δ) under each accounting, over T and n.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from dpsgd_cli.config import FigureSpec, Grid, NoiseScaleParams, PrivacyCurveParams
from dpsgd_cli.engine.folder import read_table, write_csv
from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy import ACCOUNTANT_LABELS, ACCOUNTANTS
from dpsgd_cli.privacy.dynamics import privacy_curve
from dpsgd_cli.privacy.single_example_gaussian import calibrate_bassily

# (label, accounting, formula, amplification) of bassily2014 in the noise-scale figure (Bellet's lecture)
NOISE_ACCOUNTINGS = [
    ("closed form (lecture, 16·l)", "closed_form", "lecture", "tight"),
    ("closed form (√32·l, unverified)", "closed_form", "paper", "tight"),
    ("advanced composition, 2qε", "advanced_composition", "lecture", "approx"),
    ("advanced composition, tight amplification", "advanced_composition", "lecture", "tight"),
    *((f"{ACCOUNTANT_LABELS[name]} (dp-accounting)", name, "lecture", "tight") for name in ACCOUNTANTS),
]


def privacy_curve_table(params: dict[str, Any]) -> pd.DataFrame:
    """Long format K, bound (dynamics | composition | lower_bound), rdp_epsilon: claims compare bounds."""
    from dpsgd_cli.plots.privacy_curve import k_values  # plots imports this module: at the top, a cycle

    p = PrivacyCurveParams.model_validate(params)
    curve = p.model_dump(exclude={"k_max", "points", "log_x"})
    wide = privacy_curve(k_values(p.k_max, p.points, log=p.log_x), **curve)
    return wide.melt(id_vars="K", var_name="bound", value_name="rdp_epsilon")


def noise_scale_table(params: dict[str, Any]) -> pd.DataFrame:
    """σ of bassily2014 calibrated to (ε, δ) under each accounting: over T = epochs·n at fixed n and δ = 1/n²
    (panel "T"), and over n at fixed T and δ (panel "n": the lecture's "more data → less noise" holds at fixed
    T and δ); `proved` False where the accounting's lemmas do not apply (per-step ε₀ > 1 for 2qε)."""
    p = NoiseScaleParams.model_validate(params)
    steps_fixed = p.steps_fixed or p.n
    delta_fixed = p.delta_fixed or 1.0 / p.n**2
    points = [("T", p.n, max(1, round(e * p.n)), 1.0 / p.n**2) for e in p.epochs]
    points += [("n", n, steps_fixed, delta_fixed) for n in p.n_values]
    rows = []
    for label, accounting, formula, amplification in NOISE_ACCOUNTINGS:
        if label in p.skip:
            continue
        for panel, n, steps, delta in points:
            privacy = calibrate_bassily(p.epsilon, delta, n, steps, 1.0, accounting, formula, amplification)
            rows.append({"panel": panel, "accounting": label, "n": n, "steps": steps, "epsilon": p.epsilon,
                         "delta": delta, "sigma": privacy.sigma, "proved": privacy.proved})
    return pd.DataFrame(rows, columns=TABLE_COLUMNS["noise_scale"])


# the columns of each analytic table (what claims on it may name; checked by `dpsgd run`)
TABLE_COLUMNS = {
    "privacy_curve": ["K", "bound", "rdp_epsilon"],
    "noise_scale": ["panel", "accounting", "n", "steps", "epsilon", "delta", "sigma", "proved"],
}
NUMERIC_TABLE_COLUMNS = {"K", "rdp_epsilon", "n", "steps", "epsilon", "delta", "sigma"}

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
            write_csv(ANALYTIC[figure.kind](figure.params), path)
            paths.append(path)
    return paths


def analytic_table(folder: Path, figure: FigureSpec) -> pd.DataFrame:
    path = Path(folder) / f"{figure.name}.csv"
    remedy = f"run the grid again (`dpsgd run ... --only {Path(folder).name}`) to compute the table of figure " \
             f"{figure.name}"
    if not os.path.lexists(path):
        raise UserError(f"{path}: missing; {remedy}")
    return read_table(path, TABLE_COLUMNS[figure.kind], NUMERIC_TABLE_COLUMNS & set(TABLE_COLUMNS[figure.kind]),
                      remedy)
