"""Per-cell aggregates of runs.csv (mean ± std over seeds), shared by the CLI summary and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pandas as pd

from dpsgd_cli.engine.results import COLUMNS, TRACE_COLUMNS, ResultStore

HYPER = ["batch_size", "lr", "epochs", "l2", "clip_norm"]
CELL_COLUMNS = ["dataset", "model", "algorithm", "label", "epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm"]


def _params(frame: pd.DataFrame) -> pd.Series:
    return frame["algorithm_params"].fillna("{}").map(lambda s: json.loads(s) if isinstance(s, str) and s else {})


def algorithm_label(frame: pd.DataFrame) -> pd.Series:
    """`dp_sgd`, or `dp_sgd accountant=pld` naming the parameters that differ between an algorithm's runs."""
    params = _params(frame)
    label = frame["algorithm"].copy()
    for algorithm, rows in params.groupby(frame["algorithm"]):
        keys = sorted({k for p in rows for k in p})
        varying = [k for k in keys if len({json.dumps(p.get(k)) for p in rows}) > 1]
        label[rows.index] = algorithm + rows.map(lambda p: "".join(f" {k}={p.get(k)}" for k in varying))
    return label


def with_params(frame: pd.DataFrame) -> pd.DataFrame:
    """The runs with each algorithm parameter as a column of its own (e.g. `schedule`, `accountant`), so that
    figures and claims can select on it; a column that exists already keeps its values."""
    params = _params(frame)
    keys = sorted({k for p in params for k in p} - set(frame.columns))
    return frame.assign(**{k: params.map(lambda p, k=k: p.get(k)) for k in keys}) if keys else frame


def summary_frame(folder: Path) -> pd.DataFrame:
    """One row per cell: runs, ok runs, mean and std of test accuracy and optimality gap."""
    frame = ResultStore(folder).read()
    if frame.empty:
        return pd.DataFrame(columns=[*CELL_COLUMNS, "runs", "ok", "acc_mean", "acc_std", "gap_mean", "gap_std"])
    frame = frame.assign(label=algorithm_label(frame))
    ok = frame[frame["status"] == "ok"]
    keys = [c for c in CELL_COLUMNS]
    grouped = frame.groupby(keys, dropna=False)
    stats = ok.groupby(keys, dropna=False).agg(
        acc_mean=("test_accuracy", "mean"), acc_std=("test_accuracy", "std"),
        gap_mean=("optimality_gap", "mean"), gap_std=("optimality_gap", "std"))
    out = grouped.size().rename("runs").to_frame().join(ok.groupby(keys, dropna=False).size().rename("ok"))
    out = out.join(stats).reset_index()
    out["ok"] = out["ok"].fillna(0).astype(int)
    return out.fillna({"acc_std": 0.0, "gap_std": 0.0})


_COMPARISONS = {">=": "ge", "<=": "le", "!=": "ne", ">": "gt", "<": "lt", "==": "eq"}


def comparison(wanted: object) -> Optional[tuple[str, float]]:
    """(operator, number) of a selection value such as ">=1", None for a plain value; ValueError when it starts
    like a comparison but the rest is not a number (">=one")."""
    if not isinstance(wanted, str):
        return None
    op = next((op for op in _COMPARISONS if wanted.startswith(op)), None)
    if op is None:
        return None
    try:
        return op, float(wanted[len(op):])
    except ValueError:
        raise ValueError(f"{wanted!r} compares with {wanted[len(op):].strip()!r}, which is not a number; "
                         f"write e.g. '{op}1'") from None


def select(frame: pd.DataFrame, selection: dict) -> pd.DataFrame:
    """Rows matching every `column: value` of the selection: a value, a list of values, or a comparison
    string such as ">=1" (numbers) — the filter language of figures and claims in experiments.yaml."""
    mask = pd.Series(True, index=frame.index)
    for column, wanted in selection.items():
        if column not in frame.columns:
            raise KeyError(f"no column {column!r} in the results (columns: {', '.join(frame.columns)})")
        values = frame[column]
        compare = comparison(wanted)
        if isinstance(wanted, list):
            mask &= values.isin(wanted)
        elif compare is not None:
            mask &= getattr(pd.to_numeric(values, errors="coerce"), _COMPARISONS[compare[0]])(compare[1])
        else:
            mask &= values == wanted
    return frame[mask]


def line_labels(frame: pd.DataFrame) -> pd.Series:
    """Algorithm label, plus the hyperparameters that vary among that algorithm's runs."""
    labels = algorithm_label(frame)
    extra = pd.Series("", index=frame.index)
    for col in HYPER:
        varying = frame.groupby(labels)[col].transform(lambda s: s.nunique(dropna=True) > 1)
        extra += frame[col].map(lambda v, c=col: f" {c}={v:g}" if v == v else "").where(varying, "")
    return labels + extra


ADDED_COLUMNS = ["label"]  # what `results_frame` adds to runs.csv's columns, besides the algorithm parameters


def frame_columns(grid, traces: bool = False) -> list[str]:
    """The columns `results_frame` gives for `grid`'s results — runs.csv's, the line label, each parameter of
    the grid's algorithms — so that `dpsgd run` can check the names figures and claims use before any work."""
    params = sorted({k for algo in grid.algorithms for k in algo.params} - set(COLUMNS))
    runs = [*COLUMNS, *ADDED_COLUMNS, *params]
    return [*TRACE_COLUMNS, *(c for c in runs if c not in TRACE_COLUMNS)] if traces else runs


def current_run_ids(folder: Path, fallback: pd.Series) -> set[str]:
    """Run ids of the grid as last run (its manifest): rows left by an earlier version of the grid stay in
    runs.csv but are not shown. Without a manifest, every row counts."""
    from dpsgd_cli.config import Grid, expand

    manifest = Path(folder) / "manifest.json"
    if not manifest.exists():
        return set(fallback.astype(str))
    grid = Grid.model_validate(json.loads(manifest.read_text())["grid"])
    return {cell.run_id(seed) for cell in expand(grid) for seed in cell.seeds}


def results_frame(folder: Path, traces: bool = False) -> pd.DataFrame:
    """The ok runs of a results folder with their line label and parameter columns; with `traces`, their
    checkpoints (one row per run and checkpoint) joined with those run columns."""
    store = ResultStore(folder)
    runs = store.read()
    runs = runs[(runs["status"] == "ok") & runs["run_id"].isin(current_run_ids(folder, runs["run_id"]))]
    runs = with_params(runs.assign(label=line_labels(runs))) if len(runs) else runs.assign(**{c: [] for c in ADDED_COLUMNS})
    if traces:
        checkpoints = store.read_traces()
        keep = [c for c in runs.columns if c not in checkpoints.columns or c == "run_id"]
        runs = checkpoints.merge(runs[keep], on="run_id", how="inner")
    return runs
