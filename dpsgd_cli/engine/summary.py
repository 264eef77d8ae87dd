"""Per-cell aggregates of runs.csv (mean ± std over seeds), shared by the CLI summary and the plots."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from dpsgd_cli.engine.results import COLUMNS, FINAL, TRACE_COLUMNS, ResultStore, note, read_manifest, scan_csv
from dpsgd_cli.engine.selection import apply_selections

HYPER = ["batch_size", "lr", "epochs", "l2", "clip_norm"]


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


AXES = ["epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm", "dtype"]


def summary_frame(folder: Path) -> pd.DataFrame:
    """One row per cell of the grid as last run (by cell id, so cells differing in any setting stay apart):
    its settings, runs, ok runs, mean and std of test accuracy and optimality gap, and `identical` — every ok
    seed gave the same value of each of them (a deterministic algorithm such as `erm`)."""
    frame = read_results(folder).runs
    columns = ["cell_id", "dataset", "model", "label", *AXES, "runs", "ok", "acc_mean", "acc_std", "gap_mean",
               "gap_std", "identical"]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    tuned = frame["tuning"].map(lambda t: f" [for {t}]" if isinstance(t, str) and t else "") \
        if "tuning" in frame else ""
    frame = frame.assign(label=algorithm_label(frame) + tuned,
                         dataset=_options_label(frame, "dataset", "dataset_options"),
                         model=_options_label(frame, "model", "model_options"))
    ok = frame[frame["status"] == "ok"]
    out = frame.groupby("cell_id", sort=False).agg(
        **{c: (c, "first") for c in ["dataset", "model", "label", *AXES]}, runs=("run_id", "size"))
    stats = ok.groupby("cell_id", sort=False).agg(
        ok=("run_id", "size"), acc_mean=("test_accuracy", "mean"), acc_std=("test_accuracy", "std"),
        gap_mean=("optimality_gap", "mean"), gap_std=("optimality_gap", "std"))
    identical = ok.groupby("cell_id", sort=False)[list(SHOWN)].apply(_identical).rename("identical") if len(ok) \
        else pd.Series(dtype=bool, name="identical")
    out = out.join(stats).join(identical).reset_index()
    out["ok"] = out["ok"].fillna(0).astype(int)
    out["identical"] = out["identical"].eq(True)
    return out.fillna({"acc_std": 0.0, "gap_std": 0.0})[columns]


SHOWN = ("test_accuracy", "optimality_gap")  # the metrics the summary table shows, mean ± std over seeds


def _identical(cell: pd.DataFrame) -> bool:
    """Every seed gave the same value of every metric shown (a metric no run has, e.g. test accuracy without a
    test split, says nothing), and there is at least one shown value: a ± would only ever say ± 0."""
    if len(cell) < 2:
        return False
    present = [cell[c] for c in SHOWN if cell[c].notna().any()]
    return bool(present) and all(values.nunique(dropna=False) == 1 for values in present)


def _options_label(frame: pd.DataFrame, name: str, options: str) -> pd.Series:
    """`kddcup99` or `kddcup99 subsample=70000`: the options that differ between a dataset's (model's) runs."""
    parsed = frame[options].fillna("{}").map(lambda s: json.loads(s) if isinstance(s, str) and s else {})
    label = frame[name].astype(str)
    for value, rows in parsed.groupby(frame[name]):
        keys = sorted({k for p in rows for k in p})
        varying = [k for k in keys if len({json.dumps(p.get(k)) for p in rows}) > 1]
        label[rows.index] = str(value) + rows.map(lambda p: "".join(f" {k}={p.get(k)}" for k in varying))
    return label


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
SELECTION_COLUMNS = ["selection", "selection_privacy", "epsilon_total"]  # and, with `select:`, apply_selections


def frame_columns(grid, traces: bool = False) -> list[str]:
    """The columns `results_frame` gives for `grid`'s results — runs.csv's, the line label, each parameter of
    the grid's algorithms — so that `dpsgd run` can check the names figures and claims use before any work."""
    params = sorted({k for algo in grid.algorithms for k in algo.params} - set(COLUMNS))
    selected = SELECTION_COLUMNS if grid.select else []
    runs = [*COLUMNS, *ADDED_COLUMNS, *params, *selected]
    return [*TRACE_COLUMNS, *(c for c in runs if c not in TRACE_COLUMNS)] if traces else runs


@functools.lru_cache(maxsize=16)
def _grid_run_ids(grid_json: str) -> frozenset[str]:
    from dpsgd_cli.config import Grid, expand

    grid = Grid.model_validate(json.loads(grid_json))
    return frozenset(cell.run_id(seed) for cell in expand(grid) for seed in cell.seeds)


def current_run_ids(folder: Path, fallback: pd.Series) -> set[str]:
    """Run ids of the grid as last run (its manifest): rows left by an earlier version of the grid, or by
    another grid, stay in runs.csv but are not shown. Without a usable manifest, every row counts."""
    manifest = read_manifest(folder)
    if manifest is None or "grid" not in manifest:
        return set(fallback.astype(str))
    try:
        return set(_grid_run_ids(json.dumps(manifest["grid"], sort_keys=True)))
    except Exception as exc:  # a grid this version no longer accepts: show every row, and say so
        note(f"{Path(folder) / 'manifest.json'}: its grid no longer validates ({str(exc).splitlines()[0]}); "
             f"showing every row of runs.csv")
        return set(fallback.astype(str))


@dataclass
class Reading:
    """What a reader (summary, plot, report) takes from a results folder, and what it left out."""

    folder: Path
    runs: pd.DataFrame  # valid rows of the grid as last run, one per run id (every status)
    rows: int = 0  # complete data lines in runs.csv
    malformed: int = 0
    incomplete: bool = False
    duplicates: int = 0
    foreign: int = 0

    @property
    def ok(self) -> pd.DataFrame:
        return self.runs[self.runs["status"] == "ok"]

    def notes(self) -> list[str]:
        csv = self.folder / "runs.csv"
        notes = []
        if self.malformed:
            notes.append(f"{csv}: skipped {self.malformed} malformed row(s) (wrong number of fields, or a "
                         f"non-number where a number belongs; `dpsgd run` sets them aside and redoes those runs)")
        if self.incomplete:
            notes.append(f"{csv}: ignored its incomplete last row (cut mid-write; `dpsgd run` sets it aside and "
                         f"redoes that run)")
        if self.duplicates:
            notes.append(f"{csv}: {self.duplicates} duplicate row(s) of a run id counted once")
        if self.foreign:
            notes.append(f"{csv}: ignored {self.foreign} row(s) not in the grid as last run (another grid's, or "
                         f"an earlier version of this grid's)")
        return notes

    def why_empty(self) -> str:
        """Why there is no ok run to show ('' if there is one)."""
        if len(self.ok):
            return ""
        if not self.rows:
            return "runs.csv has no rows (header only): no run has finished yet; run `dpsgd run` on the grid"
        if self.rows == self.malformed:
            return f"all {self.rows} row(s) of runs.csv are malformed"
        if self.runs.empty:
            return f"none of the {self.rows} row(s) of runs.csv belongs to the grid as last run"
        counts = self.runs["status"].value_counts().to_dict()
        failed = self.runs[self.runs["status"] == "failed"]["message"].dropna()
        first = f"; first message: {failed.iloc[0]}" if len(failed) else ""
        return ("every run failed or diverged (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"){first}")


_READINGS: dict[tuple, Reading] = {}


def read_results(folder: Path) -> Reading:
    """The rows readers use: valid rows (malformed and cut ones skipped), of the grid as last run, each run
    id once (a final row before a failed one, then the first); counts of what was left out."""
    folder = Path(folder)
    key = (str(folder.resolve()), *(_stamp(folder / name) for name in ("runs.csv", "manifest.json")))
    if key in _READINGS:
        return _READINGS[key]
    scan = scan_csv(folder / "runs.csv")
    frame = scan.frame()
    frame = frame.reindex(columns=[*COLUMNS, *(c for c in frame.columns if c not in COLUMNS)])  # older files too
    current = frame[frame["run_id"].isin(current_run_ids(folder, frame["run_id"]))]
    order = current["status"].isin(FINAL).map({True: 0, False: 1}).sort_values(kind="stable").index
    unique = current.loc[order].drop_duplicates("run_id", keep="first").sort_index()
    reading = Reading(folder, unique.reset_index(drop=True), rows=len(scan.rows) + len(scan.bad),
                      malformed=len(scan.bad), incomplete=bool(scan.partial),
                      duplicates=len(current) - len(unique), foreign=len(frame) - len(current))
    _READINGS[key] = reading
    return reading


def _stamp(path: Path) -> tuple:
    try:
        stat = path.stat()
        return stat.st_mtime_ns, stat.st_size
    except OSError:
        return None, None


def _manifest_grid(folder: Path) -> dict:
    manifest = read_manifest(folder)
    return (manifest or {}).get("grid", {})


def results_frame(folder: Path, traces: bool = False, select: bool = True) -> pd.DataFrame:
    """The ok runs of a results folder (see `read_results`) with their line label and parameter columns (with
    `select` and a grid `select:`, only the chosen candidates' runs); with `traces`, their checkpoints (one row
    per run and checkpoint) joined with those run columns."""
    runs = read_results(folder).ok
    runs = (with_params(runs.assign(label=line_labels(runs))) if len(runs)
            else runs.assign(**{c: [] for c in ADDED_COLUMNS}))
    if select:  # a grid's `select:`: the chosen candidates' runs
        runs = apply_selections(runs, _manifest_grid(folder))
    if traces:
        checkpoints = ResultStore(folder).read_traces().drop_duplicates(["run_id", "examples"])
        keep = [c for c in runs.columns if c not in checkpoints.columns or c == "run_id"]
        runs = checkpoints.merge(runs[keep], on="run_id", how="inner")
    return runs
