"""Per-cell aggregates of runs.csv (mean ± std over seeds), shared by the CLI summary and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from dpsgd_cli.engine.results import ResultStore

CELL_COLUMNS = ["dataset", "model", "algorithm", "label", "epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm"]


def algorithm_label(frame: pd.DataFrame) -> pd.Series:
    """`dp_sgd`, or `dp_sgd accountant=pld` where the grid has several parameterisations."""
    params = frame["algorithm_params"].fillna("{}").map(lambda s: json.loads(s) if s else {})
    text = params.map(lambda p: "".join(f" {k}={v}" for k, v in p.items()))
    varying = frame.assign(_p=text).groupby("algorithm")["_p"].transform("nunique") > 1
    return frame["algorithm"] + text.where(varying, "")


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


def select(frame: pd.DataFrame, selection: dict) -> pd.DataFrame:
    """Rows matching every `column: value` of the selection: a value, a list of values, or a comparison
    string such as ">=1" (numbers) — the filter language of figures and claims in experiments.yaml."""
    mask = pd.Series(True, index=frame.index)
    for column, wanted in selection.items():
        if column not in frame.columns:
            raise KeyError(f"no column {column!r} in the results (columns: {', '.join(frame.columns)})")
        values = frame[column]
        if isinstance(wanted, list):
            mask &= values.isin(wanted)
        elif isinstance(wanted, str) and wanted[:2].rstrip("0123456789.-+ ") in _COMPARISONS:
            op = wanted[:2] if wanted[:2] in _COMPARISONS else wanted[:1]
            mask &= getattr(pd.to_numeric(values, errors="coerce"), _COMPARISONS[op])(float(wanted[len(op):]))
        else:
            mask &= values == wanted
    return frame[mask]
