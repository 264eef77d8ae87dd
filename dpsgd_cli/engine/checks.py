"""Checks of a grid before any work (`dpsgd run`, `--dry-run` included): what later commands read must exist,
and the work must be bounded (docs/results.md#checked-before-any-work)."""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.config import AuditSpec, Cell, ClaimSpec, FigureSpec, Grid, SelectSpec, axis_values, closest, expand
from dpsgd_cli.data.files import FileDatasetSpec
from dpsgd_cli.data.registry import get_entry
from dpsgd_cli.data.spec import DatasetSpec
from dpsgd_cli.engine.analytic import ANALYTIC, NOISE_ACCOUNTINGS, NUMERIC_TABLE_COLUMNS, TABLE_COLUMNS
from dpsgd_cli.engine.results import NUMERIC, comparison
from dpsgd_cli.engine.runner import dataset
from dpsgd_cli.engine.selection import frame_columns
from dpsgd_cli.errors import UserError
from dpsgd_cli.models.mlp import BLOCK_ELEMENTS as MLP_BLOCK
from dpsgd_cli.privacy.accounting import PLD_MAX_COMPOSITIONS
from dpsgd_cli.privacy.validate import MEMORY_SHARE, available_memory

MAX_RUNS = 100_000  # runs of one grid (cells × seeds); the largest paper grid has 594
MAX_STEPS = 10**8  # optimiser steps of one run (the paper grids: at most ~10^6)
MAX_EXAMPLES = 10**10  # examples processed by one run, epochs × n (hours of work even for logistic regression)
MAX_CHECKPOINTS = 10**5  # trace checkpoints of one run (rows of traces.csv; each evaluates the objective on n)
MAX_AUDIT_TRIALS = 10**5  # trials of an audit (the paper audits use at most 5000)
MAX_SIMULATED_TRIALS = 10**5  # a private selection's searches × E[K] trials, each simulated from the runs
# selection values that must name something of the grid
_NAMED = {"algorithm": lambda g: [a.name for a in g.algorithms],
          "dataset": lambda g: [getattr(d, "id", None) or d.name for d in g.datasets],
          "model": lambda g: [m.name for m in g.models]}


def check_grids(grids: Iterable[Grid]) -> None:
    """Every check of this module on every grid, before any of them runs; the first problem is a UserError."""
    for grid in grids:
        check_grid(grid)


def check_grid(grid: Grid) -> list[Cell]:
    """The grid's cells, after checking its size, names and work (UserError naming the grid and the key)."""
    runs = count_runs(grid)
    if runs > MAX_RUNS:
        raise UserError(f"grid {grid.name!r}: {runs:,} runs (cells × seeds) exceed the limit of {MAX_RUNS:,}; "
                        f"split it into several grids or sweep fewer values")
    cells = expand(grid)
    if not cells:
        raise UserError(f"grid {grid.name!r}: expands to zero runs; give every axis at least one value")
    for i, figure in enumerate(grid.figures):
        _check_figure(grid, figure, f"grid {grid.name!r}: figures[{i}] ({figure.name})")
    for i, claim in enumerate(grid.claims):
        _check_claim(grid, claim, f"grid {grid.name!r}: claims[{i}] ({claim.id})")
    for i, spec in enumerate(grid.select):
        check_selection(grid, spec, f"grid {grid.name!r}: select[{i}] ({spec.name})")
    for cell in cells:
        check_work(cell, f"grid {grid.name!r}")
    return cells


def check_audit(grid: Grid, trials: int | None = None, cells: Collection[str] | None = None) -> None:
    """`dpsgd audit`: every algorithm private, its runs and trials bounded; `cells`: only these cell ids audited."""
    public = list(dict.fromkeys(a.name for a in grid.algorithms if not ALGORITHMS[a.name].tags.private))
    if public:
        them = "it" if len(public) == 1 else "them"
        raise UserError(f"grid {grid.name!r}: algorithms: {', '.join(public)}: not private, no ε to audit (an audit "
                        f"bounds a private algorithm's ε from below); remove {them} from the grid's algorithms, or "
                        f"audit another grid (--only NAME)")
    spec = grid.audit or AuditSpec()
    trials = trials or spec.trials
    if trials is None:  # chosen per cell, within the audit's time budget and MAX_AUDIT_TRIALS (audit.engine)
        for cell in audited_cells(grid, cells):
            check_work(cell, f"grid {grid.name!r}")
        return
    where = f"grid {grid.name!r}: audit.trials = {trials:,}" + (" (--trials)" if trials != spec.trials else "")
    if trials > MAX_AUDIT_TRIALS:
        raise UserError(f"{where} is beyond the limit of {MAX_AUDIT_TRIALS:,} trials; lower it (a tighter bound "
                        f"comes from a larger δ or a stronger canary before more trials)")
    for cell in audited_cells(grid, cells):
        check_work(cell, f"grid {grid.name!r}")
        # with and without the canary, per canary kind, and again for each control (the twin and its ladder)
        trainings = 2 * trials * len(spec.canaries) * (2 + len(spec.ladder) if spec.control is not None else 1)
        examples = trainings * steps_estimate(cell)[1]
        if examples > MAX_EXAMPLES:
            raise UserError(f"{where}: {trainings:,} trainings of {cell.algorithm.name} on {cell.dataset.name} "
                            f"process {examples:.3g} examples, beyond the limit of {MAX_EXAMPLES:.0e} a cell; lower "
                            f"trials or epochs, or audit fewer canaries")


def audited_cells(grid: Grid, cells: Collection[str] | None = None) -> list[Cell]:
    """The grid's cells an audit trains: all, or those whose id is in `cells`."""
    return [cell for cell in expand(grid) if cells is None or cell.cell_id in cells]


def check_selection(grid: Grid, spec: SelectSpec, where: str) -> None:
    """A `select:` the readers can compute: its columns exist and a private search can be simulated."""
    columns = frame_columns(grid)
    for key in ("candidates", "group_by"):
        for column in getattr(spec, key):
            _name(column, key, columns, where)
    if spec.privacy == "non_private":
        return
    simulated = spec.searches * spec.mean
    if simulated > MAX_SIMULATED_TRIALS:
        raise UserError(f"{where}: searches × mean = {spec.searches:,} × {spec.mean:g} = {simulated:.3g} simulated "
                        f"trials, beyond the limit of {MAX_SIMULATED_TRIALS:.0e}; lower searches or mean")
    trials = spec.trials()
    try:
        if trials.kind != "poisson":
            trials.gamma  # noqa: B018  (the distribution the readers sample from: solved for its mean)
    except (ValueError, ArithmeticError, RuntimeError) as exc:
        raise UserError(f"{where}: no {spec.distribution} number of trials with mean {spec.mean:g} and eta "
                        f"{spec.eta:g} can be simulated ({exc}); choose another mean or eta") from None


def count_runs(grid: Grid) -> int:
    """Runs of the grid before merging duplicate cells (an upper bound), computed without expanding it."""
    cells = sum(math.prod(len(v) for v in axis_values(grid, algo).values()) for algo in grid.algorithms)
    return cells * len(grid.datasets) * len(grid.models) * grid.seeds


# --- names -------------------------------------------------------------------------------------------------------
def _columns(grid: Grid, source: str) -> tuple[list[str], set[str]]:
    """(columns, numeric columns) of the frame a figure or claim reads: runs, traces or an analytic table."""
    if source in TABLE_COLUMNS:
        return TABLE_COLUMNS[source], NUMERIC_TABLE_COLUMNS & set(TABLE_COLUMNS[source])
    columns = frame_columns(grid, traces=source == "traces")
    numeric = {c for c in columns if c in NUMERIC or _numeric_param(grid, c)}
    return columns, numeric


def _numeric_param(grid: Grid, column: str) -> bool:
    return any(isinstance(a.params.get(column), (int, float)) and not isinstance(a.params.get(column), bool)
               for a in grid.algorithms)


def _name(value: str | None, key: str, columns: list[str], where: str, numeric: set[str] | None = None) -> None:
    if value is None:
        return
    if value not in columns:
        hint = closest(value, columns) or f" (columns: {', '.join(columns)})"
        raise UserError(f"{where}: {key} = {value!r} is not a column of the results{hint}")
    if numeric is not None and value not in numeric:
        raise UserError(f"{where}: {key} = {value!r} is a text column; use a numeric one"
                        f"{closest(value, sorted(numeric))}")


def _selection(grid: Grid, selection: dict[str, Any], key: str, columns: list[str], where: str,
               numeric: set[str]) -> None:
    for column, wanted in selection.items():
        _name(column, f"{key}.{column}", columns, where)
        values = wanted if isinstance(wanted, list) else [wanted]
        for value in values:
            try:
                comparison(value)
            except ValueError as exc:
                raise UserError(f"{where}: {key}.{column}: {exc}") from None
            if column in numeric and isinstance(value, str) and comparison(value) is None:
                raise UserError(f"{where}: {key}.{column} = {value!r}: {column} holds numbers; give a number, a "
                                f"list of numbers or a comparison such as '>=1'")
            known = _NAMED[column](grid) if column in _NAMED else None
            if known is not None and comparison(value) is None and value not in known:
                raise UserError(f"{where}: {key}.{column} = {value!r} is not among the grid's {column}s"
                                f"{closest(str(value), known)}; the grid has {', '.join(known)}")


def _check_figure(grid: Grid, figure: FigureSpec, where: str) -> None:
    if figure.kind in ANALYTIC:
        skip = figure.params.get("skip", []) if figure.kind == "noise_scale" else []
        labels = [label for label, *_ in NOISE_ACCOUNTINGS]
        for label in skip:
            if label not in labels:
                raise UserError(f"{where}: params.skip: {label!r} is not an accounting{closest(label, labels)}; "
                                f"known: {', '.join(labels)}")
        return
    columns, numeric = _columns(grid, figure.kind)
    _name(figure.metric, "metric", columns, where, numeric)
    if figure.kind == "sweep":
        _name(figure.x, "x", columns, where, numeric)
    _name(figure.rows, "rows", columns, where)
    _name(figure.cols, "cols", columns, where)
    for column in figure.lines:
        _name(column, "lines", columns, where)
    _selection(grid, figure.where, "where", columns, where, numeric)


def _check_claim(grid: Grid, claim: ClaimSpec, where: str) -> None:
    figures = {f.name: f for f in grid.figures}
    if claim.source in ("runs", "traces"):
        source = claim.source
    elif claim.source in figures and figures[claim.source].kind in ANALYTIC:
        source = figures[claim.source].kind
    else:
        valid = ["runs", "traces", *(f.name for f in grid.figures if f.kind in ANALYTIC)]
        raise UserError(f"{where}: source = {claim.source!r} is neither runs, traces nor an analytic figure of the "
                        f"grid{closest(claim.source, valid)}; valid: {', '.join(valid)}")
    if claim.unselected != "show" and not grid.select:
        raise UserError(f"{where}: unselected = {claim.unselected!r} needs a grid with select: (the runs a "
                        f"selection did not choose); leave it out")
    columns, numeric = _columns(grid, source)
    for column in claim.group_by:
        _name(column, "group_by", columns, where)
    for i, condition in enumerate(claim.conditions()):
        at = f"{where} also[{i - 1}]" if i else where
        if condition.check == "saturates" and source != "privacy_curve":
            raise UserError(f"{at}: check saturates needs source = a privacy_curve figure of the grid")
        if condition.check in ("fluctuates", "widens") and not condition.over:
            raise UserError(f"{at}: check {condition.check} compares values along `over`: give over (e.g. over: "
                            f"epsilon)")
        _name(condition.metric, "metric", columns, at, numeric)
        _name(condition.over, "over", columns, at)
        for key in ("where", "a", "b"):
            _selection(grid, getattr(condition, key), key, columns, at, numeric)


# --- paths -------------------------------------------------------------------------------------------------------
def out_root(value: str, option: str = "--out") -> Path:
    """The results root given on the command line: not empty, not a file (nor under one), writable."""
    if not value.strip():
        raise UserError(f"{option} is empty; give a folder for the results (default: results)")
    path = Path(value).expanduser()
    try:
        existing = next(p for p in [path, *path.parents] if p.exists() or p == Path(p.anchor or "."))
        name_max = os.pathconf(existing if existing.is_dir() else existing.parent, "PC_NAME_MAX")
    except (OSError, ValueError) as exc:  # a name too long for the filesystem, a NUL byte, ...
        raise UserError(f"{option} {value}: not a usable path ({getattr(exc, 'strerror', None) or exc}); give a "
                        f"shorter folder name") from None
    long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise UserError(f"{option}: the folder name {long[:40]}… has {len(os.fsencode(long))} bytes, more than "
                        f"the {name_max} the filesystem allows; give a shorter folder name")
    if existing.exists() and not existing.is_dir():
        raise UserError(f"{option} {value}: {existing} is a file, not a folder; give a folder for the results")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option} {value}: {existing} is not writable (read-only or permission denied); "
                        f"give a writable folder")
    return path


# --- work --------------------------------------------------------------------------------------------------------
def _loaded_file(spec: FileDatasetSpec) -> tuple[int, int]:
    """(records, features) of a file dataset, loaded (its loader bounds its own memory; the run reuses it)."""
    data = dataset(spec)
    return len(data.y_train) + len(data.y_test), data.X_train.shape[1]


def records(spec: DatasetSpec | FileDatasetSpec) -> int:
    """Records the dataset spec loads (before the train/test split), from the registry: an upper bound."""
    if isinstance(spec, FileDatasetSpec):
        return _loaded_file(spec)[0]
    entry = get_entry(spec.name)
    total = spec.n if spec.name == "synthetic" and spec.n else entry.total_records
    if spec.name == "kddcup99" and spec.split == "official":
        total += entry.records.get("official_test", 0)
    return min(total, spec.subsample) if spec.subsample else total


def features(spec: DatasetSpec | FileDatasetSpec) -> int:
    """Columns after encoding, before projection (the registry's count: an upper bound)."""
    if isinstance(spec, FileDatasetSpec):
        return _loaded_file(spec)[1]
    if spec.name == "synthetic":
        return spec.dim or get_entry("synthetic").defaults["dim"]
    return get_entry(spec.name).features


def memory_estimate(cell: Cell) -> dict[str, float]:
    """Bytes the arrays of one run need, by the key that sizes them: dataset, projection, model."""
    n, d = records(cell.dataset), features(cell.dataset)
    k = cell.dataset.projection
    width = k or d
    replicas = len(cell.seeds)
    hidden = cell.model.options.get("hidden") or width if cell.model.name == "mlp" else 0
    params = width * hidden + 2 * hidden + 1 if hidden else width + 1
    batch = min(cell.batch_size or 1, n)
    return {
        "dataset": 8.0 * n * d * 4,
        "projection": 8.0 * (d * k + 2 * n * k) if k else 0.0,
        "model": 8.0 * replicas * (8 * params + batch * hidden) + (8.0 * 2 * MLP_BLOCK if hidden else 0.0),
    }


def steps_estimate(cell: Cell) -> tuple[float, float]:
    """(steps, examples processed) of one run: T = epochs·n/B, or epochs·n without a batch size (an upper bound
    for noisy_gd's K = epochs)."""
    if cell.epochs is None:
        return 0.0, 0.0
    n = records(cell.dataset)
    examples = cell.epochs * n
    return (examples / cell.batch_size if cell.batch_size else examples), examples


def check_work(cell: Cell, where: str) -> None:
    """UserError naming the key and the limit when one run would take too many steps or too much memory."""
    steps, examples = steps_estimate(cell)
    if steps > MAX_STEPS or examples > MAX_EXAMPLES:
        limit = f"{MAX_STEPS:.0e} steps" if steps > MAX_STEPS else f"{MAX_EXAMPLES:.0e} examples processed"
        raise UserError(f"{where}: epochs = {cell.epochs:g} on {cell.dataset.name} (about {records(cell.dataset):,} "
                        f"records, batch size {cell.batch_size or 1}) is {steps:.3g} steps / {examples:.3g} examples "
                        f"per run, beyond the limit of {limit}; lower epochs")
    if cell.trace_every and examples:  # each checkpoint evaluates the objective on all n records
        n = records(cell.dataset)
        points = examples / cell.trace_every
        if points > MAX_CHECKPOINTS or points * n > MAX_EXAMPLES:
            least = math.ceil(max(examples / MAX_CHECKPOINTS, examples * n / MAX_EXAMPLES))
            raise UserError(f"{where}: trace_every = {cell.trace_every:,} gives {points:.3g} checkpoints per run on "
                            f"{cell.dataset.name} ({n:,} records evaluated at each), beyond the limit of "
                            f"{MAX_CHECKPOINTS:.0e} checkpoints and {MAX_EXAMPLES:.0e} records evaluated; raise "
                            f"trace_every to at least {least:,}")
    params = cell.algorithm.params
    if "pld" in (params.get("accountant"), params.get("accounting")) and steps > PLD_MAX_COMPOSITIONS:
        raise UserError(f"{where}: {cell.algorithm.name} with the PLD accountant on {cell.dataset.name} would compose "
                        f"{steps:.3g} steps, beyond the PLD limit of {PLD_MAX_COMPOSITIONS:.0e}; lower epochs, raise "
                        f"batch_size, or use accountant rdp")
    k, d = cell.dataset.projection, features(cell.dataset)
    if k and k > d:
        raise UserError(f"{where}: datasets[].projection = {k:,} is larger than the {d} features of "
                        f"{cell.dataset.name}; a projection reduces the dimension: use projection ≤ {d}")
    need = memory_estimate(cell)
    have = MEMORY_SHARE * available_memory()
    if sum(need.values()) > have:
        key = max(need, key=lambda part: need[part])
        if key == "projection":
            what = f"datasets[].projection = {cell.dataset.projection:,}"
        elif key == "model":
            what = (f"models[].hidden = {cell.model.options.get('hidden') or features(cell.dataset):,} "
                    f"of {cell.model.name}")
        else:
            what = (f"dataset {cell.dataset.name} ({records(cell.dataset):,} records × {features(cell.dataset):,} "
                    f"features; see subsample, n, dim)")
        raise UserError(f"{where}: {what} needs about {_bytes(sum(need.values()))} of memory, more than the "
                        f"{_bytes(have)} available ({MEMORY_SHARE:.0%} of what is free now); make it smaller")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
