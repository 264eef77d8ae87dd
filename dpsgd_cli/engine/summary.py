"""Per-cell aggregates of runs.csv (mean ± std over seeds) for `dpsgd run`'s table, and its labels."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.config import SelectSpec
from dpsgd_cli.data.files import FileDatasetSpec
from dpsgd_cli.data.spec import DatasetSpec
from dpsgd_cli.engine.results import NUMERIC, grid_of, option_text, parse_options, read_results, varying_label
from dpsgd_cli.engine.selection import selections, tuned_for
from dpsgd_cli.models import MODELS

__all__ = ["cell_labels", "fixed_options", "summary_frame", "summary_metrics"]

AXES = ["epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm", "dtype"]
BASE_METRICS = ("test_accuracy", "optimality_gap")
PREFIXES = {"test_accuracy": "acc", "optimality_gap": "gap"}  # summary_frame's columns acc_mean, gap_std, ...


def prefix(metric: str) -> str:
    return PREFIXES.get(metric, metric)


def summary_metrics(runs: pd.DataFrame, grid: dict[str, Any]) -> list[str]:
    """The metrics the summary shows: the grid's figures' (at most two), or else test accuracy and the
    optimality gap; only those some ok run has, or else the first metric that one has."""
    ok = runs[runs["status"] == "ok"]

    def measured(metric: str) -> bool:
        return metric in NUMERIC and metric in ok and pd.to_numeric(ok[metric], errors="coerce").notna().any()

    figures = [f.get("metric", "test_accuracy") for f in grid.get("figures", [])
               if f.get("kind", "sweep") in ("sweep", "traces")]
    wanted = [m for m in dict.fromkeys(figures or BASE_METRICS) if measured(m)][:2]
    return wanted or [m for m in (*BASE_METRICS, "train_objective") if measured(m)][:1]


def summary_frame(folder: Path) -> pd.DataFrame:
    """One row per cell of the grid as last run: labels, settings, runs, ok runs, mean and std over the ok runs
    of each metric (`acc_mean`, `gap_std`, `<metric>_mean`), `identical` (every ok seed gave the same values);
    `attrs`: the metrics shown, why one is missing, the options the labels leave out."""
    runs = read_results(folder).runs
    grid = grid_of(folder)
    metrics = summary_metrics(runs, grid) if len(runs) else []
    summarised = list(dict.fromkeys([*metrics, *BASE_METRICS]))
    stats = [f"{prefix(m)}_{s}" for m in summarised for s in ("mean", "std")]
    columns = ["cell_id", "dataset", "model", "label", "tuning", *AXES, "runs", "ok", *stats, "identical"]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    runs = runs.assign(**cell_labels(runs, selections(grid)))
    ok = runs[runs["status"] == "ok"].assign(**{m: lambda f, m=m: pd.to_numeric(f[m], errors="coerce")
                                                for m in summarised})
    out = runs.groupby("cell_id", sort=False).agg(
        **{c: (c, "first") for c in ["dataset", "model", "label", "tuning", *AXES]}, runs=("run_id", "size"))
    aggregated = ok.groupby("cell_id", sort=False).agg(
        ok=("run_id", "size"), **{f"{prefix(m)}_{s}": (m, s) for m in summarised for s in ("mean", "std")})
    identical = ok.groupby("cell_id", sort=False)[metrics].apply(_identical).rename("identical") \
        if len(ok) and metrics else pd.Series(dtype=bool, name="identical")
    out = out.join(aggregated).join(identical).reset_index()
    out["ok"] = out["ok"].fillna(0).astype(int)
    out["identical"] = out["identical"].eq(True)
    out = out[columns]
    out.attrs.update(metrics=metrics, missing=_missing(runs, metrics), options=fixed_options(runs))
    return out


def _identical(cell: pd.DataFrame) -> bool:
    """Every seed gave the same value of every metric the cell has (a ± would only ever say ± 0)."""
    present = [cell[c] for c in cell.columns if cell[c].notna().any()]
    return len(cell) > 1 and bool(present) and all(values.nunique(dropna=False) == 1 for values in present)


def _missing(runs: pd.DataFrame, metrics: list[str]) -> list[str]:
    """Why a metric the summary would show is not there."""
    ok = runs[runs["status"] == "ok"]
    if ok.empty or "test_accuracy" in metrics or pd.to_numeric(ok["n_test"], errors="coerce").ne(0).any():
        return []
    return ["no test accuracy: the data have no test split (split: none)"]


def cell_labels(frame: pd.DataFrame, specs: Sequence[SelectSpec] = ()) -> pd.DataFrame:
    """Per row: `dataset`, `model` and `label` (the algorithm), each with the options that differ between that
    name's rows, and `tuning`, the selections a calibrated candidate is trained for ('' for a plain run)."""
    tags = frame["tuning"] if "tuning" in frame else pd.Series(None, index=frame.index, dtype=object)
    names = tuned_for(specs)
    return pd.DataFrame({
        "dataset": varying_label(frame["dataset"], frame["dataset_options"]),
        "model": varying_label(frame["model"], frame["model_options"]),
        "label": varying_label(frame["algorithm"], frame["algorithm_params"]),
        "tuning": tags.map(lambda t: names.get(t, t) if isinstance(t, str) and t else ""),
    }, index=frame.index)


def fixed_options(frame: pd.DataFrame) -> list[str]:
    """`dp_sgd(accountant=pld)`: per name, the options all its rows share that differ from the default."""
    out = []
    for name, options in (("dataset", "dataset_options"), ("model", "model_options"),
                          ("algorithm", "algorithm_params")):
        if options not in frame:
            continue
        parsed = parse_options(frame[options])
        for value, rows in parsed.groupby(frame[name], sort=False):
            first = rows.iloc[0]
            defaults = _defaults(name, str(value), first)
            same = {k: v for k, v in first.items() if all(_json(p.get(k)) == _json(v) for p in rows)}
            shown = [f"{k}={option_text(v)}" for k, v in same.items()
                     if k not in defaults or _json(defaults[k]) != _json(v)]
            if shown:
                out.append(f"{value}({', '.join(shown)})")
    return out


def _defaults(kind: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    if kind == "algorithm":
        fields = ALGORITHMS[name].Params.model_fields if name in ALGORITHMS else {}
    elif kind == "model":
        fields = MODELS[name].Options.model_fields if name in MODELS else {}
    else:
        fields = (FileDatasetSpec if "path" in options else DatasetSpec).model_fields
    return {k: f.default for k, f in fields.items()}


def _json(value: Any) -> str:
    return json.dumps(value, default=str)  # (1, 2) and [1, 2] alike; a required field's default is no value
