"""Hyperparameter selection after the runs (a grid's `select:`): which candidate each group uses, and what
choosing it cost in privacy; a private search is simulated from the runs (docs/hyperparameters.md)."""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpsgd_cli.algorithms import ALGORITHMS, Algorithm, Setting
from dpsgd_cli.config import Grid, SelectSpec
from dpsgd_cli.engine.folder import write_csv
from dpsgd_cli.engine.results import (
    COLUMNS,
    TRACE_COLUMNS,
    ResultStore,
    grid_of,
    line_labels,
    read_results,
    result_folders,
    with_params,
)
from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy.accounting import AccountantName, calibrate_sigma
from dpsgd_cli.privacy.calibration import calibrate
from dpsgd_cli.privacy.tuning import (
    TUNING_ORDERS,
    Trials,
    dpsgd_rdp,
    event_rdp,
    liu_talwar_epsilon,
    score_laplace_scale,
    score_sigma,
    tuned_epsilon,
)

TABLE_COLUMNS = ["selection", "privacy", "group", "chosen", "score", "score_mean", "test_accuracy_mean",
                 "test_accuracy_std", "runs", "epsilon", "epsilon_total", "delta", "expected_trials", "score_noise"]


def selections(grid: dict[str, Any]) -> list[SelectSpec]:
    """The `select:` entries of a grid as recorded in its manifest."""
    return [SelectSpec(**s) for s in grid.get("select", [])]


def tuned_for(specs: Iterable[SelectSpec]) -> dict[str, str]:
    """The `tuning` tag of each calibrated private selection's candidates → the selections' names."""
    names: dict[str, list[str]] = {}
    for spec in specs:
        if spec.privacy != "non_private" and spec.calibrate:
            names.setdefault(spec.tuning_tag(), []).append(spec.name)
    return {tag: ", ".join(found) for tag, found in names.items()}


# ------------------------------------------------------------------------------ the runs readers use

ADDED_COLUMNS = ["label"]  # what `results_frame` adds to runs.csv's columns, besides the algorithm parameters
SELECTION_COLUMNS = ["selection", "selection_privacy", "epsilon_total"]  # and, with `select:`, apply_selections


def frame_columns(grid: Grid, traces: bool = False) -> list[str]:
    """The columns `results_frame` gives for `grid`'s results, for `dpsgd run` to check names before any work."""
    params = sorted({k for algo in grid.algorithms for k in algo.params} - set(COLUMNS))
    selected = SELECTION_COLUMNS if grid.select else []
    runs = [*COLUMNS, *ADDED_COLUMNS, *params, *selected]
    return [*TRACE_COLUMNS, *(c for c in runs if c not in TRACE_COLUMNS)] if traces else runs


_FRAMES: dict[tuple[Any, ...], pd.DataFrame] = {}  # results_frame's recent answers, keyed by the files' stamps


def results_frame(folder: Path, traces: bool = False, select: bool = True) -> pd.DataFrame:
    """The ok runs of a results folder with their line label and parameter columns (with `select`, only the
    chosen candidates' runs); with `traces`, their checkpoints joined with those; an infinite number is missing.
    A report reads one folder once per claim: the answer is kept while the folder's files are unchanged."""
    stamps = tuple(_stamp(Path(folder) / name) for name in ("runs.csv", "traces.csv", "manifest.json"))
    key = (str(Path(folder).resolve()), traces, select, stamps)
    if key not in _FRAMES:
        if len(_FRAMES) >= 8:
            _FRAMES.pop(next(iter(_FRAMES)))
        _FRAMES[key] = _results_frame(folder, traces, select)
    return _FRAMES[key].copy()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file does: a replaced file is a new inode, an appended one grows."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _results_frame(folder: Path, traces: bool, select: bool) -> pd.DataFrame:
    runs = read_results(folder).ok
    runs = (with_params(runs.assign(label=line_labels(runs))) if len(runs)
            else runs.assign(**{c: [] for c in ADDED_COLUMNS}))
    if select:
        runs = apply_selections(runs, grid_of(folder))
    if traces:
        checkpoints = ResultStore(folder).read_traces().drop_duplicates(["run_id", "examples"])
        keep = [c for c in runs.columns if c not in checkpoints.columns or c == "run_id"]
        runs = checkpoints.merge(runs[keep], on="run_id", how="inner")
    return runs.replace([np.inf, -np.inf], np.nan)


def base_epsilon(tuning: dict[str, Any], target: float, n: int, delta: float) -> float:
    """The ε each candidate of a calibrated private selection is trained at, so that tuning + training is
    (target, δ)-DP (Liu & Talwar: target/3; Papernot & Steinke: the smallest lattice point 1/x, `calibrate`,
    whose candidates give a tuned mechanism meeting the target, `total_epsilon`)."""
    return _base_epsilon(json.dumps(tuning, sort_keys=True), float(target), int(n), float(delta))


@functools.lru_cache(maxsize=256)
def _base_epsilon(tuning_json: str, target: float, n: int, delta: float) -> float:
    tuning = json.loads(tuning_json)
    if tuning["privacy"] == "liu_talwar":
        return target / 3.0
    point = calibrate(total_epsilon(tuning, n, delta), target, sigma_min=1.0 / target, sigma_max=1e4,
                      sigma_guess=2.0 / target,
                      context=f" (base ε of a {tuning['privacy']} selection at ε = {target:g})")
    return 1.0 / point.sigma


def total_epsilon(tuning: dict[str, Any], n: int, delta: float) -> Callable[[float], float]:
    """x = 1/ε_base ↦ ε of a Papernot & Steinke selection (tuning + training) whose candidates are calibrated to
    ε_base, each by its own accountant: non-increasing in x, the curve `base_epsilon` calibrates x on. A candidate
    [B, epochs, accountant] is DP-SGD's mechanism; [B, epochs, accountant, algorithm] its algorithm's own event."""
    trials = Trials(tuning["distribution"], tuning["mean"], tuning["eta"])

    def curve(x: float, batch_size: int, epochs: float, accountant: AccountantName, *algorithm: str
              ) -> tuple[float, ...]:
        setting = Setting(n=n, d=1, delta=delta, l2=0.0, epsilon=1.0 / x, batch_size=batch_size, epochs=epochs)
        if algorithm:
            return _event_rdp(ALGORITHMS[algorithm[0]](), setting, None)
        q, steps = setting.sample_rate, setting.steps
        return dpsgd_rdp(calibrate_sigma(1.0 / x, delta, q, steps, accountant).sigma, q, steps)

    def total(x: float) -> float:
        try:
            curves = [curve(x, *candidate) for candidate in tuning["candidates"]]
        except Exception:  # ε_base below what the accountant certifies: never chosen
            return float("inf")
        return tuned_epsilon(TUNING_ORDERS, curves, trials, delta)

    return total


def _event_rdp(algorithm: Algorithm, setting: Setting, sigma: float | None) -> tuple[float, ...]:
    """The RDP curve of one training by `algorithm`'s own event at noise multiplier σ (None: its calibration's for
    the setting's ε), under the relation its claim holds for."""
    sigma = algorithm.calibrated_sigma(setting) if sigma is None else sigma
    return event_rdp(algorithm.dp_event(setting, {"sigma": sigma}), algorithm.neighbouring())


_RUN_MECHANISM = ["algorithm", "algorithm_params", "neighbours", "n_train", "delta", "batch_size", "epochs", "sigma",
                  "sample_rate", "steps"]  # what a run's RDP curve depends on


def _run_curves(group: pd.DataFrame) -> pd.Series:
    """Per run, the RDP curve of its training: its algorithm's own event where `tags.selection_by_event`, else
    DP-SGD's Poisson-sampled Gaussian from its σ, q and T."""
    curves: dict[tuple[Any, ...], tuple[float, ...]] = {}
    columns = group.reindex(columns=_RUN_MECHANISM)  # a frame made by hand may lack some: None
    keys = list(columns.astype(object).where(columns.notna(), None).itertuples(index=False, name=None))
    for key in dict.fromkeys(keys):
        name, params, neighbours, n, delta, batch_size, epochs, sigma, q, steps = key
        kind = ALGORITHMS.get(name)
        if kind is not None and kind.tags.selection_by_event:
            setting = Setting(n=int(n), d=1, delta=float(delta), l2=0.0, batch_size=int(batch_size),
                              epochs=float(epochs))
            curves[key] = _event_rdp(kind(json.loads(params), neighbours), setting, float(sigma))
        else:
            curves[key] = dpsgd_rdp(float(sigma), float(q), int(steps))
    return pd.Series([curves[key] for key in keys], index=group.index)


def apply_selections(runs: pd.DataFrame, grid: dict[str, Any]) -> pd.DataFrame:
    """The runs plots and claims use: per selection and group the chosen candidate's runs (all without
    `select:`), with columns `selection`, `selection_privacy`, `epsilon_total`."""
    specs = selections(grid)
    if not specs or runs.empty:
        return runs
    chosen = [choose(runs, spec)[0] for spec in specs]
    out = pd.concat(chosen, ignore_index=True)
    if len(specs) > 1:  # each selection is a line of its own
        out["label"] = out["label"] + " · " + out["selection"]
    return out


def caption_of(grid: dict[str, Any]) -> str:
    """How the figure's hyperparameters were chosen, for its caption ('' without `select:`)."""
    parts = []
    for spec in selections(grid):
        if spec.score == "test_accuracy":
            how = "on the TEST set (optimistic)"
        elif spec.privacy == "non_private":
            how = f"on validation ({spec.score}), choice not accounted"
        else:
            how = (f"private random search on validation ({spec.privacy}, {spec.distribution} E[K] = {spec.mean:g}; "
                   f"± std over {spec.searches} searches), "
                   + ("ε = tuning + training" if spec.calibrate else "ε axis = total ε"))
        parts.append(f"{spec.name}: {', '.join(spec.candidates)} {how}")
    return ("\ntuned per " + " × ".join(selections(grid)[0].group_by) + ". " + "; ".join(parts)) if parts else ""


def selection_table(runs: pd.DataFrame, grid: dict[str, Any]) -> pd.DataFrame:
    """One row per selection and group: the choice, its score, the test metric of the chosen runs, the privacy."""
    tables = [choose(runs, spec)[1] for spec in selections(grid)]
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=TABLE_COLUMNS)


def choose(runs: pd.DataFrame, spec: SelectSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the chosen runs, the table of choices) of one selection."""
    private = spec.privacy != "non_private"
    tuned = runs["tuning"].astype(object).fillna("").astype(str) if "tuning" in runs else \
        pd.Series("", index=runs.index)
    wanted = spec.tuning_tag() if private and spec.calibrate else ""
    pool = runs[(tuned == wanted) | ((tuned == "") & runs["epsilon"].isna())]  # non-private references stay
    pool = pool.assign(_cand=_key(pool, spec.candidates), _group=_key(pool, spec.group_by))
    picked, table = [], []
    for group_key, group in pool.groupby("_group", sort=True):
        if private and group["epsilon"].notna().any():
            rows, row = _private_search(group, spec, group_key)
        else:
            rows, row = _best_mean(group, spec)
        picked.append(rows)
        table.append({"selection": spec.name, "group": _readable(group_key, spec.group_by), **row})
    chosen = pd.concat(picked, ignore_index=True) if picked else pool.iloc[:0]
    chosen = chosen.drop(columns=["_cand", "_group"]).assign(selection=spec.name)
    chosen["label"] = _strip(chosen["label"], spec.candidates)
    return chosen, pd.DataFrame(table, columns=TABLE_COLUMNS)


def _best_mean(group: pd.DataFrame, spec: SelectSpec) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Non-private: the candidate with the best mean score over its seeds (the first on ties)."""
    means = group.groupby("_cand", sort=True)[spec.score].mean()
    best = (means.idxmin() if spec.score == "val_objective" else means.idxmax()) if means.notna().any() \
        else means.index[0]
    rows = group[group["_cand"] == best]
    if group["epsilon"].isna().all():
        privacy = "n/a: non-private algorithm"
    elif spec.score == "test_accuracy":
        privacy = "non-private, optimistic: chosen on the TEST set"
    else:
        privacy = "non-private: chosen on validation outside any accountant"
    rows = rows.assign(selection_privacy=privacy, epsilon_total=np.nan)
    return rows, _row(spec, privacy, _readable(best, spec.candidates), means[best], rows, rows["epsilon"].iloc[0],
                      np.nan, rows["delta"].max(), None)


def _private_search(group: pd.DataFrame, spec: SelectSpec, group_key: str) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Random search with K ~ spec's distribution trials, simulated spec.searches times (seeded by the group)."""
    trials = spec.trials()
    rng = np.random.default_rng(zlib.crc32(f"{spec.name}|{group_key}".encode()))
    group = group.assign(_noise=_score_noise(group, spec))
    runs = [part for _, part in group.groupby("_cand", sort=True)]
    # each candidate's scores, noise scales and validation sizes as plain lists: a search reads a few numbers of
    # each trial, and a pandas row per trial (thousands a grid) was most of a plot's or report's time
    columns = [{c: part[c].tolist() for c in (spec.score, "_noise", "n_val")} for part in runs]
    first = np.cumsum([0] + [len(part) for part in runs])  # candidate c's runs at first[c]: in `stacked`
    picked, searches = [], []
    for search, k in enumerate(trials.sample(rng, spec.searches)):
        if k == 0:  # a Poisson search may run no trial: it releases nothing
            continue
        which = rng.integers(len(runs), size=k)
        tried = [(int(c), int(rng.integers(len(runs[c])))) for c in which]
        scores = [columns[c][spec.score][i] + _draw(rng, spec, columns[c]["_noise"][i]) / columns[c]["n_val"][i]
                  for c, i in tried]
        c, i = tried[int(np.argmax(scores))]  # the first on ties
        picked.append(first[c] + i)
        searches.append(search)
    stacked = pd.concat(runs, ignore_index=True)
    chosen = stacked.iloc[picked].reset_index(drop=True).assign(seed=searches).infer_objects().drop(columns="_noise")
    total, delta = _total_epsilon(group, spec, trials)
    privacy = (f"{spec.privacy} ({spec.distribution}, E[K] = {spec.mean:g}): ({total:.4g}, {delta:.3g})-DP for "
               f"tuning + training" + ("" if spec.calibrate else " (not calibrated: above the candidates' ε)"))
    if not spec.calibrate:
        chosen["epsilon"] = total
    chosen = chosen.assign(selection_privacy=privacy, epsilon_total=total)
    counts = chosen["_cand"].value_counts()
    top = f"{_readable(counts.index[0], spec.candidates)} in {counts.iloc[0] / len(chosen):.0%} of searches"
    row = _row(spec, privacy, top, chosen[spec.score].mean(), chosen, group["epsilon"].iloc[0], total, delta,
               trials.mean)
    kind = "Laplace scale" if spec.privacy == "liu_talwar" else "Gaussian σ"
    row["score_noise"] = (f"{kind} {group['_noise'].min():.3g}–{group['_noise'].max():.3g} correct predictions "
                          f"of {int(group['n_val'].iloc[0])}")
    return chosen, row


def _total_epsilon(group: pd.DataFrame, spec: SelectSpec, trials: Trials) -> tuple[float, float]:
    """(ε, δ) of tuning + training, from the runs' own noise (σ, q, T) or, for pure ε-DP runs, their ε."""
    delta = float(group["delta"].max())
    if spec.privacy == "liu_talwar":
        return liu_talwar_epsilon(float(group["epsilon_achieved"].max())), 0.0
    curves = list(dict.fromkeys(_run_curves(group)))
    return tuned_epsilon(TUNING_ORDERS, curves, trials, delta), delta


def _score_noise(group: pd.DataFrame, spec: SelectSpec) -> pd.Series:
    """Per run, the noise scale (in counts) of its released validation score."""
    if spec.privacy == "liu_talwar":
        return group["epsilon_achieved"].map(score_laplace_scale)
    return _run_curves(group).map(score_sigma)


def _draw(rng: np.random.Generator, spec: SelectSpec, scale: float) -> float:
    return rng.laplace(0.0, scale) if spec.privacy == "liu_talwar" else rng.normal(0.0, scale)


def _row(spec: SelectSpec, privacy: str, chosen: str, score: float, rows: pd.DataFrame, epsilon: float,
         total: float, delta: float, expected: float | None) -> dict[str, Any]:
    return {"privacy": privacy, "chosen": chosen, "score": spec.score, "score_mean": score,
            "test_accuracy_mean": rows["test_accuracy"].mean(), "test_accuracy_std": rows["test_accuracy"].std(),
            "runs": len(rows), "epsilon": epsilon, "epsilon_total": total, "delta": delta,
            "expected_trials": expected, "score_noise": ""}


def _key(frame: pd.DataFrame, columns: list[str]) -> pd.Series:
    """One JSON string per row of the values of `columns` (missing → null), usable as a group key."""
    if frame.empty:
        return pd.Series([], dtype=str, index=frame.index)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"select: no column {missing[0]!r} in the results; rerun `dpsgd run` on the grid (it checks "
                        f"the columns a select: names)")
    values = frame[columns].astype(object).where(frame[columns].notna(), None)
    return pd.Series([json.dumps([_plain(v) for v in row]) for row in values.itertuples(index=False)],
                     index=frame.index)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _readable(key: str, columns: list[str]) -> str:
    return ", ".join(f"{c}={'—' if v is None else (f'{v:g}' if isinstance(v, float) else v)}"
                     for c, v in zip(columns, json.loads(key)))


def _strip(labels: pd.Series, candidates: list[str]) -> pd.Series:
    """Line labels without the candidate values (a tuned line's candidate may differ from one ε to the next)."""
    pattern = re.compile(r" (?:" + "|".join(map(re.escape, candidates)) + r")=\S+")
    return labels.astype(str).map(lambda s: pattern.sub("", s))


def chosen_cells(folder: Path) -> set[str]:
    """The cells (`cell_id`) whose runs the folder's selections chose (per group the best candidate, or every
    candidate a simulated private search released); empty without `select:`."""
    grid = grid_of(folder)
    specs = selections(grid)
    if not specs:
        return set()
    runs = results_frame(folder, select=False)
    return {str(cell) for spec in specs for cell in choose(runs, spec)[0]["cell_id"]}


def write_selection_tables(path: str | Path) -> list[tuple[Path, pd.DataFrame]]:
    """For each results folder under `path` whose grid has `select:`, its table of choices (also selection.csv)."""
    out = []
    for folder in result_folders(path):
        grid = grid_of(folder)
        if not grid.get("select"):
            continue
        runs = results_frame(folder, select=False)
        table = selection_table(runs, grid)
        write_csv(table, folder / "selection.csv")
        out.append((folder, table))
    if not out:
        raise UserError(f"{path}: no grid here has `select:`; add one (see docs/hyperparameters.md) and rerun "
                        "`dpsgd run` (selection changes no run)")
    return out
