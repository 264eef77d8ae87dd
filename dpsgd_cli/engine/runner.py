"""Run a grid: cells → tasks (a cell's missing seeds, trained together as replicas) → rows in runs.csv."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import numbers
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from dpsgd_cli import NUMERICS, __version__, compiled, diskcache, plugins
from dpsgd_cli.algorithms import ALGORITHMS, Setting, backends
from dpsgd_cli.algorithms.base import Algorithm, Outcome, Prepared
from dpsgd_cli.algorithms.chain import train_together
from dpsgd_cli.algorithms.erm import known_reference, reference_minimum, reference_start, reference_starts
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.config import DELTA_RULE, Cell, Grid, expand
from dpsgd_cli.data import Dataset, DatasetSpec, load_dataset, with_validation
from dpsgd_cli.engine.analytic import write_analytic_tables
from dpsgd_cli.engine.results import COLUMNS, ResultStore, ResultsWriteError, now, release_lock
from dpsgd_cli.engine.selection import base_epsilon
from dpsgd_cli.engine.workers import die_with_parent, fork_pool
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Model, make_model
from dpsgd_cli.models.rows import cached_astype
from dpsgd_cli.privacy.accounting import ACCOUNTANTS, calibrate_sigma, load_accountants
from dpsgd_cli.privacy.risk import BOUND_COLUMNS, attack_risk


@functools.lru_cache(maxsize=8)
def dataset(spec: DatasetSpec, validation: float | None = None) -> Dataset:
    """Loaded once per process (workers included); the data layer caches processed arrays on disk too. With
    `validation`, X_train holds only the rows used for fitting and X_val the held-out rows. Its arrays are
    read-only: every task of the process shares them (and L*'s key hashes them once)."""
    data = with_validation(load_dataset(spec), validation)
    for array in (data.X_train, data.y_train, data.X_test, data.y_test, data.X_val, data.y_val):
        if array is not None:
            array.flags.writeable = False
    return data


def resolve_delta(delta: Any, n: int) -> float:
    """δ of the grid; the rule of thumb 1/n² with n the number of training records."""
    return 1.0 / n**2 if delta == DELTA_RULE else float(delta)


def setting_of(cell: Cell, data: Dataset) -> Setting:
    """The algorithm's setting; a candidate of a calibrated private selection trains at its base ε."""
    delta = resolve_delta(cell.delta, data.n)
    epsilon = cell.epsilon
    if cell.tuning:
        assert epsilon is not None  # a calibrated selection is for an ε (config's SelectSpec)
        epsilon = base_epsilon(cell.tuning, epsilon, data.n, delta)
    return Setting(n=data.n, d=data.d, delta=delta, l2=cell.l2, epsilon=epsilon,
                   batch_size=cell.batch_size, lr=cell.lr, epochs=cell.epochs, clip_norm=cell.clip_norm,
                   trace_every=cell.trace_every)


@functools.lru_cache(maxsize=64)
def reference_optimum(spec: DatasetSpec, model_name: str, model_options: str, l2: float,
                      validation: float | None = None) -> tuple[float, str]:
    """(L*, how it was obtained): min F on the training set (the rows used for fitting) by `reference_minimum` —
    the exact minimiser for a convex model ("lbfgs"), the best of several L-BFGS starts for a non-convex one
    ("lbfgs_best_of_3": the lowest F of 3 starts, each stopped once F stops falling, `erm.LBFGS_NONCONVEX`).
    F(θ*) is evaluated as the rows' objectives are (`_metrics`), so an optimality gap measures θ, not two
    summation orders (erm's rows: exactly 0, not ±1 ulp of F)."""
    data = dataset(spec, validation)
    model = make_model(model_name, data.d, l2, json.loads(model_options))
    theta, _, info = reference_minimum(model, data.X_train, data.y_train)
    with np.errstate(all="ignore"):
        loss, _ = model.data_loss_and_accuracy(theta[None], data.X_train, data.y_train)
        return float(loss[0] + model.penalty(theta[None])[0]), info["optimum_method"]


OPTIMUM_PENDING = "to be computed"  # a planned task's optimum_method until `resolve_optima` (or its run) sets L*
# a task's optimum_method where the grid never reads L* (`optima_read`): its rows' optimal_objective and
# optimality_gap are empty
OPTIMUM_NOT_READ = "not computed: no figure or claim of the grid reads the optimality gap"
GAP_COLUMNS = ("optimality_gap", "optimal_objective")


def reads_optimality_gap(grid: Grid) -> bool:
    """Whether a figure or claim of the grid reads L* (as its metric or a column it selects or groups by); a
    selection never does (it scores by validation or test accuracy, or the validation objective)."""
    figures = [f for f in grid.figures if f.kind in ("sweep", "traces")]
    claims = [condition for claim in grid.claims for condition in claim.conditions()]
    named = [*(f.metric for f in figures), *(k for f in figures for k in f.where),
             *(c.metric for c in claims), *(c.over or "" for c in claims),
             *(k for c in claims for k in (*c.where, *c.a, *c.b, *c.group_by))]
    return any(name in GAP_COLUMNS for name in named)


def optima_read(grid: Grid, cells: Sequence[Cell]) -> set[tuple[Any, ...]]:
    """The L*s (`optimum_args`) a run of the grid computes: every cell's where a figure or claim reads the
    optimality gap; else only those of cells whose algorithm is the minimiser itself (no steps: erm, output
    perturbation), which compute θ* anyway, so that L* costs them one more pass over the data. An MLP's L* takes
    minutes: a grid that draws no gap does not wait for it."""
    if reads_optimality_gap(grid):
        return {optimum_args(cell) for cell in cells}
    return {optimum_args(cell) for cell in cells if ALGORITHMS[cell.algorithm.name].tags.batch == "none"}


def optimum_args(cell: Cell) -> tuple[Any, ...]:
    """The arguments of `reference_optimum` for a cell: the cells that share them share L*."""
    return (cell.dataset, cell.model.name, json.dumps(cell.model.options, sort_keys=True), cell.l2, cell.validation)


def _optimum_model(args: tuple[Any, ...]) -> tuple[Model, np.ndarray, np.ndarray]:
    """(model, X, y) whose reference minimum L* is (`reference_optimum`'s)."""
    spec, model_name, model_options, l2, validation = args
    data = dataset(spec, validation)
    return make_model(model_name, data.d, l2, json.loads(model_options)), data.X_train, data.y_train


def _optimum_label(args: tuple[Any, ...]) -> str:
    spec, model_name, _, l2, validation = args
    name = getattr(spec, "id", None) or spec.name
    options = spec.model_dump(mode="json", exclude={"name", "sha256"}, exclude_none=True, exclude_defaults=True)
    where = name + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else "")
    held = f", {validation:g} held out" if validation else ""
    return f"L* of {model_name} on {where} (λ = {l2:g}{held})"


def _start_of_reference(args: tuple[Any, ...], seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    """One L-BFGS start of a reference minimum (run in a worker process by `resolve_optima`)."""
    return reference_start(*_optimum_model(args), seed)


def with_optimum(task: Task) -> Task:
    """The task with its L* (computed here if no earlier step did)."""
    if task.optimum_method != OPTIMUM_PENDING:
        return task
    optimal, method = reference_optimum(*optimum_args(task.cell))
    return dataclasses.replace(task, optimal_objective=optimal, optimum_method=method)


def resolve_optima(tasks: list[Task], jobs: int = 1, say: Callable[[str], None] | None = None) -> list[Task]:
    """The tasks with their L*s. A reference minimum this process or the disk cache has (verified on read) is
    used as it is; the others are computed here, one line through `say` as each begins and ends (an MLP's
    takes minutes), and with `jobs` > 1 their L-BFGS starts run in that many forked processes (each start is a
    pure function of the data, the model and its seed, computed with one BLAS thread wherever it runs: the same
    numbers as in this process, which then combines, verifies and caches them as `reference_minimum` does)."""
    say = say or _say
    wanted = list(dict.fromkeys(optimum_args(t.cell) for t in tasks if t.optimum_method == OPTIMUM_PENDING))
    missing = []
    for args in wanted:
        model, X, y = _optimum_model(args)
        if known_reference(model, X, y) is None:
            missing.append((args, reference_starts(model), model.n_params * X.shape[0]))
    if missing:
        starts = sum(m[1] for m in missing)
        where = f"in {min(jobs, starts)} processes" if jobs > 1 and starts > 1 else "in this process"
        say(f"computing {len(missing)} reference optim{'um' if len(missing) == 1 else 'a'} L* ({starts} L-BFGS "
            f"start{'s' * (starts > 1)}, {where}; kept in the disk cache for later runs)")
        if jobs > 1 and starts > 1 and sys.platform == "linux":
            _optima_in_workers(missing, jobs, say)
        else:
            for args, count, _ in missing:
                say(f"{_optimum_label(args)}: computing ({count} L-BFGS start{'s' * (count > 1)})")
                begin = time.perf_counter()
                optimal, method = reference_optimum(*args)
                say(f"{_optimum_label(args)} = {optimal:.10g} ({method}, {time.perf_counter() - begin:.0f} s)")
    return [with_optimum(task) for task in tasks]


def _optima_in_workers(missing: list[tuple[tuple[Any, ...], int, int]], jobs: int, say: Callable[[str], None]) -> None:
    """The starts of the `missing` reference minima in `jobs` forked processes, the largest (data × parameters)
    first; each minimum is combined here as soon as its starts are in."""
    runs: dict[tuple[Any, ...], dict[int, tuple[np.ndarray, dict[str, Any]]]] = {args: {} for args, _, _ in missing}
    count = {args: starts for args, starts, _ in missing}
    begin = {args: time.perf_counter() for args, _, _ in missing}
    order = sorted(((args, seed) for args, starts, _ in missing for seed in range(starts)),
                   key=lambda item: -next(size for a, _, size in missing if a == item[0]))
    with fork_pool(jobs) as pool:
        futures = {pool.submit(_start_of_reference, args, seed): (args, seed) for args, seed in order}
        for args, _, _ in missing:
            say(f"{_optimum_label(args)}: computing ({count[args]} L-BFGS start{'s' * (count[args] > 1)})")
        for future in as_completed(futures):
            args, seed = futures[future]
            runs[args][seed] = future.result()
            if len(runs[args]) == count[args]:
                model, X, y = _optimum_model(args)
                reference_minimum(model, X, y, runs=[runs[args][s] for s in range(count[args])])
                optimal, method = reference_optimum(*args)
                say(f"{_optimum_label(args)} = {optimal:.10g} ({method}, {time.perf_counter() - begin[args]:.0f} s)")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


FUSE_ENV = "DPSGD_FUSE"  # "0": train every cell in its own task (an execution switch: run ids and numbers unchanged)


def fusion_enabled() -> bool:
    return os.environ.get(FUSE_ENV, "1").strip() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Task:
    cell: Cell
    seeds: tuple[int, ...]
    optimal_objective: float
    optimum_method: str = ""  # how L* was obtained (recorded in each row's `derived`)
    fused: tuple[Cell, ...] = ()  # more cells with the same data, model, λ, dtype and seeds, trained with `cell`

    @property
    def cells(self) -> tuple[Cell, ...]:
        return (self.cell, *self.fused)

    @property
    def runs(self) -> int:
        return len(self.cells) * len(self.seeds)


@dataclass(frozen=True)
class TaskResult:
    rows: list[dict[str, Any]]  # one per seed, for runs.csv
    traces: list[dict[str, Any]] = field(default_factory=list)  # checkpoints, for traces.csv


def run_task(task: Task, single_thread: bool = False) -> TaskResult:
    """Train the task's seeds as replicas; one row per seed (and cell), and their checkpoints (never raises). Its
    disk-cache entries (calibrated σ, ...) are written after its clock stops, as its rows are (~0.4 ms a cold σ)."""
    with contextlib.ExitStack() as stack:
        if single_thread:
            stack.enter_context(threadpool_limits(1))
        try:  # L* before the clock starts (`resolve_optima` has usually set it already)
            task = with_optimum(task)
        except Exception as exc:  # recorded, and the grid goes on
            return failed_result(dataclasses.replace(task, optimal_objective=float("nan")), _failure(exc))
        stack.enter_context(diskcache.deferred_writes())
        return _run_fused(task) if task.fused else _run_one(task)


def _run_one(task: Task) -> TaskResult:
    cell = task.cell
    data = dataset(cell.dataset, cell.validation)
    start = time.perf_counter()
    try:
        model, X, y = _training_data(cell, data)
        outcome = cell.make_algorithm().fit(setting_of(cell, data), model, X, y, ReplicaStreams(task.seeds))
    except Exception as exc:  # recorded, and the grid goes on
        return failed_result(task, _failure(exc), (time.perf_counter() - start) / len(task.seeds))
    return _result(task, cell, model, outcome, (time.perf_counter() - start) / len(task.seeds))


def _training_data(cell: Cell, data: Dataset) -> tuple[Model, np.ndarray, np.ndarray]:
    """(model, X, y) a cell trains on."""
    model = make_model(cell.model.name, data.d, cell.l2, cell.model.options)
    X, y = data.X_train, data.y_train
    if cell.dtype == "float32":  # training only: metrics and L* stay float64
        X, y = cached_astype(X, np.float32), cached_astype(y, np.float32)
    return model, X, y


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, UserError) else _short_traceback(exc)


def _run_fused(task: Task) -> TaskResult:
    """Train the task's cells together (one task, one write; docs/design.md, "Fused tasks"): a cell whose
    algorithm is not one chain trains alone here; a cell that fails to prepare fails alone."""
    data = dataset(task.cell.dataset, task.cell.validation)
    start = time.perf_counter()
    model, X, y = _training_data(task.cell, data)  # the same for every cell of the task (the fusion key)
    streams = SharedStreams(task.seeds)
    prepared: dict[str, Prepared] = {}
    results: dict[str, Outcome | str] = {}
    calibrate_ahead(task.cells, data)  # an ε axis on one accountant curve, loosest first (in the task's time)
    for cell in task.cells:
        try:
            p = cell.make_algorithm().prepare(setting_of(cell, data), model, X, y, streams)
            if p is None:
                p = cell.make_algorithm().fit(setting_of(cell, data), model, X, y, ReplicaStreams(task.seeds))
        except Exception as exc:
            results[cell.cell_id] = _failure(exc)
            continue
        (prepared if isinstance(p, Prepared) else results)[cell.cell_id] = p
    streams.close()
    trained = [c for c in task.cells if c.cell_id in prepared]
    try:
        results.update(zip([c.cell_id for c in trained], train_together(model, [prepared[c.cell_id] for c in trained])))
    except Exception as exc:
        results.update({c.cell_id: _failure(exc) for c in trained})
    elapsed = (time.perf_counter() - start) / task.runs  # the task's time, shared evenly by its runs
    metrics = _stacked_metrics(model, data, task.optimal_objective,
                               {c: o.theta for c, o in results.items() if not isinstance(o, str)})
    out = TaskResult([], [])
    for cell in task.cells:
        own = Task(cell, task.seeds, task.optimal_objective, task.optimum_method)
        outcome = results[cell.cell_id]
        part = failed_result(own, outcome, elapsed) if isinstance(outcome, str) else \
            _result(own, cell, model, outcome, elapsed, metrics.get(cell.cell_id))
        out.rows.extend(part.rows)
        out.traces.extend(part.traces)
    return out


def _stacked_metrics(model: Model, data: Dataset, optimal: float,
                     thetas: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Each cell's metrics (by cell id) from one `_metrics` call on all the task's θs stacked, where the model's
    metrics of a θ do not depend on the θs beside it (`Model.stacked_metrics`: logistic regression reads each set
    once for the whole task instead of once per cell); else {} (each cell's own call, in `_result`)."""
    if not model.stacked_metrics or len(thetas) < 2:
        return {}
    stacked = _metrics(model, np.concatenate(list(thetas.values())), data, optimal)
    bounds = np.cumsum([0] + [len(theta) for theta in thetas.values()])
    return {cell_id: {k: v[a:b] for k, v in stacked.items()}
            for cell_id, a, b in zip(thetas, bounds[:-1], bounds[1:])}


def _result(task: Task, cell: Cell, model: Model, outcome: Outcome, elapsed: float,
            metrics: dict[str, np.ndarray] | None = None) -> TaskResult:
    """The rows (one per seed) and checkpoints of one cell's trained replicas; `metrics` when already computed
    (`_stacked_metrics`)."""
    data = dataset(cell.dataset, cell.validation)
    setting = setting_of(cell, data)
    base = _base_row(cell, data, setting, task.optimal_objective)
    if metrics is None:
        metrics = _metrics(model, outcome.theta, data, task.optimal_objective)
    derived = dict(outcome.derived)
    if task.optimum_method:
        derived.setdefault("optimum_method", task.optimum_method)
    if data.train_statistics:  # preprocessing outside the accountant (file datasets), as one string
        derived.setdefault("train_statistics", ", ".join(data.train_statistics))
    try:
        reported = reported_columns(derived, len(task.seeds), ALGORITHMS[cell.algorithm.name].tags.private)
    except ValueError as exc:  # a programming error: the run fails, no column takes the value
        return failed_result(task, _failure(exc), elapsed)
    risk = risk_columns(cell.make_algorithm(), setting, outcome.guarantee, outcome.derived,
                        reported.get("epsilon_achieved")) if ALGORITHMS[cell.algorithm.name].tags.private else {}
    derived = {k: v for k, v in derived.items() if k not in reported}
    # a derived list with one value per replica (e.g. pidp_sgd's eligible_fraction) belongs to each seed's row
    per_replica = {k: derived.pop(k) for k in list(derived)
                   if isinstance(derived[k], (list, np.ndarray)) and len(derived[k]) == len(task.seeds)}
    rows = []
    for r, seed in enumerate(task.seeds):
        extra = {**derived, **{k: v[r] for k, v in per_replica.items()}}
        row = {**base, **{k: v[r] if k in PER_REPLICA_COLUMNS else v for k, v in reported.items()},
               **risk, **{k: v[r] for k, v in metrics.items()}, "run_id": cell.run_id(seed), "seed": seed,
               "guarantee": outcome.guarantee, "derived": json.dumps(extra, default=float) if extra else "",
               "wall_time": elapsed}
        finite = np.isfinite(outcome.theta[r]).all() and np.isfinite(row["train_objective"])
        row["status"], row["message"] = ("ok", "") if finite else ("diverged", "non-finite parameters or objective")
        rows.append(row)
    return TaskResult(rows, _trace_rows(cell, task, outcome.trace))


# The columns an algorithm's derived values set: its schedule, its share of noiseless steps (one per replica) and,
# for a private algorithm, what its verified calibration gives. Every other column has one source: the cell
# (`_base_row`), the metrics or the runner.
PRIVACY_COLUMNS = ("sigma", "epsilon_achieved", "accountant", "accountant_library", "delta_certified")
PER_REPLICA_COLUMNS = ("noiseless_fraction",)
REPORTED_COLUMNS = ("steps", "sample_rate", *PER_REPLICA_COLUMNS, *PRIVACY_COLUMNS)
_REPORTED_TYPES: dict[str, tuple[type, ...]] = {"steps": (numbers.Integral,), "accountant": (str,),
                                                 "accountant_library": (str,)}


def reported_columns(derived: dict[str, Any], replicas: int, private: bool) -> dict[str, Any]:
    """The columns `derived` sets (`REPORTED_COLUMNS`). ValueError for a key that names any other column, a privacy
    column of a non-private algorithm, or a value that is not of the column's kind (None, or a number, a string,
    one number per replica)."""
    allowed = REPORTED_COLUMNS if private else tuple(c for c in REPORTED_COLUMNS if c not in PRIVACY_COLUMNS)
    foreign = [k for k in derived if k in COLUMNS and k not in allowed]
    if foreign:
        raise ValueError(f"the algorithm's derived values name the column{'s' * (len(foreign) > 1)} "
                         f"{', '.join(map(repr, foreign))}, which they cannot set (a row's columns come from the "
                         f"cell, the metrics, the runner and a private algorithm's calibration)")
    reported = {k: derived[k] for k in allowed if k in derived}
    for column, value in reported.items():
        if column in PER_REPLICA_COLUMNS:
            fits = isinstance(value, (list, np.ndarray)) and len(value) == replicas and all(
                isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
        else:
            kinds = _REPORTED_TYPES.get(column, (numbers.Real,))
            fits = value is None or (isinstance(value, kinds) and not isinstance(value, bool))
        if not fits:
            raise ValueError(f"the algorithm's derived value {column!r} = {value!r} is not of that column's kind")
    return reported


def risk_columns(algorithm: Algorithm, setting: Setting, guarantee: str, derived: dict[str, Any],
                 epsilon: float | None) -> dict[str, Any]:
    """A private run's attack-risk columns (`privacy.risk.attack_risk`): from the mechanism as run (its dp_event)
    and its claim, the ε it proved at the δ it is certified for (no claim where its guarantee is "none: …";
    pidp_sgd's "tv-bound: …" proves (ε, δ′), δ′ its `delta_certified`)."""
    delta = derived.get("delta_certified")
    if delta is None or not np.isfinite(delta):
        delta = derived.get("delta_achieved", setting.delta)  # song2013 by basic composition: pure, δ = 0
    claimed = epsilon if guarantee == "proved" or guarantee.startswith("tv-bound: ") else None
    if derived.get("noise_scale", 1.0) != 1.0:  # the audit's broken twin: the claim is not the mechanism run
        if not derived.get("noise_scale"):  # no noise at all: nothing bounds a test's power
            return {**dict.fromkeys(BOUND_COLUMNS.values(), 1.0), "gdp_mu": math.inf, "tpr_bound_from": "no noise"}
        claimed = None
    return attack_risk(algorithm.dp_event(setting, derived), algorithm.neighbouring(), claimed, delta)


def failed_result(task: Task, message: str, wall_time: float | None = None) -> TaskResult:
    """The task's runs as `failed` rows (retried on resume), with what is known of them before training."""
    data = dataset(task.cell.dataset)
    return TaskResult([{**_base_row(cell, data, setting_of(cell, data), task.optimal_objective),
                        "run_id": cell.run_id(s), "seed": s, "status": "failed", "message": message,
                        "wall_time": wall_time} for cell in task.cells for s in task.seeds])


def _trace_rows(cell: Cell, task: Task, trace: list[Any]) -> list[dict[str, Any]]:
    return [{"run_id": cell.run_id(seed), "cell_id": cell.cell_id, "seed": seed, "examples": examples,
             "train_objective": objective[r], "optimality_gap": objective[r] - task.optimal_objective,
             "train_accuracy": accuracy[r]}
            for examples, objective, accuracy in trace for r, seed in enumerate(task.seeds)]


def _base_row(cell: Cell, data: Dataset, setting: Setting, optimal: float) -> dict[str, Any]:
    return {
        "cell_id": cell.cell_id, "grid": cell.grid, "dataset": data.name,
        "dataset_options": cell.dataset.model_dump_json(exclude={"name"}),
        "n_train": data.n, "n_test": data.X_test.shape[0], "d": data.d,
        "model": cell.model.name, "model_options": json.dumps(cell.model.options, sort_keys=True),
        "algorithm": cell.algorithm.name, "algorithm_params": json.dumps(cell.algorithm.params, sort_keys=True),
        "epsilon": cell.epsilon, "epsilon_achieved": None, "delta": setting.delta, "accountant": None,
        "accountant_library": None, "sigma": None, "batch_size": cell.batch_size, "lr": cell.lr,
        "epochs": cell.epochs, "steps": None, "sample_rate": None, "l2": cell.l2, "clip_norm": cell.clip_norm,
        "optimal_objective": optimal, "version": __version__, "numerics": NUMERICS, "dtype": cell.dtype,
        "n_val": 0 if data.X_val is None else len(data.X_val),
        "epsilon_base": setting.epsilon if cell.tuning else None,
        "tuning": cell.tuning["tag"] if cell.tuning else None,
        "neighbours": cell.make_algorithm().neighbouring() if ALGORITHMS[cell.algorithm.name].tags.private else None,
        **plugins.provenance(cell.algorithm.name),
    }


def _metrics(model: Model, theta: np.ndarray, data: Dataset, optimal: float) -> dict[str, np.ndarray]:
    # one forward pass per set (loss and accuracy from it): the numbers of `objective` and `accuracy`
    with np.errstate(all="ignore"):
        train_loss, train_accuracy = model.data_loss_and_accuracy(theta, data.X_train, data.y_train)
        train_objective = train_loss + model.penalty(theta)
        metrics = {**_test_metrics(model, theta, data), "train_accuracy": train_accuracy,
                   "train_objective": train_objective, "optimality_gap": train_objective - optimal}
        if data.X_val is not None and data.y_val is not None:
            val_loss, metrics["val_accuracy"] = model.data_loss_and_accuracy(theta, data.X_val, data.y_val)
            metrics["val_objective"] = val_loss + model.penalty(theta)
        return metrics


def _test_metrics(model: Model, theta: np.ndarray, data: Dataset) -> dict[str, np.ndarray]:
    """Test accuracy and loss; NaN without a test set (`split: none`)."""
    if data.X_test.shape[0] == 0:
        return {"test_accuracy": np.full(theta.shape[0], np.nan), "test_loss": np.full(theta.shape[0], np.nan)}
    test_loss, test_accuracy = model.data_loss_and_accuracy(theta, data.X_test, data.y_test)
    return {"test_accuracy": test_accuracy, "test_loss": test_loss}


def _short_traceback(exc: Exception) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}".replace("\n", " ")


@dataclass
class GridRun:
    """A grid ready to run: validated against the data, with the tasks still to do."""

    grid: Grid
    folder: Path
    cells: list[Cell]
    tasks: list[Task] = field(default_factory=list)
    done_before: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)  # the rows of this session's failed runs

    @property
    def total_runs(self) -> int:
        return len(self.cells) * self.grid.seeds

    @property
    def pending_runs(self) -> int:
        return sum(t.runs for t in self.tasks)


def plan_grid(grid: Grid, out_root: Path, resume: bool = True, dry_run: bool = False) -> GridRun:
    """Expand the grid, check it against the data (batch size ≤ n), and list what is still to run (the tasks'
    L* still to be computed: `execute` does it, see `resolve_optima`)."""
    cells = expand(grid)
    for cell in cells:  # constraints that need the data's n: before any cell runs
        data = dataset(cell.dataset, cell.validation)
        where = f"grid {grid.name!r}: {cell.algorithm.name} on {getattr(cell.dataset, 'id', None) or cell.dataset.name}"
        if cell.batch_size is not None and cell.batch_size > data.n:
            raise UserError(f"{where}: batch_size = {cell.batch_size} exceeds the n = {data.n} training records; "
                            f"use 1 ≤ batch_size ≤ {data.n}")
        try:
            cell.make_algorithm().check(setting_of(cell, data), cell.model.name)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
    store = ResultStore(Path(out_root) / grid.name)
    # each algorithm's code as it is now: rows another version of a plugin made are not resumed into
    shas = {a.name: plugins.provenance(a.name)["plugin_sha256"] for a in grid.algorithms}
    if dry_run:
        done = store.done(shas) if resume else set()
    else:
        done = store.start(resume, shas)
    run = GridRun(grid, store.folder, cells)
    read = optima_read(grid, cells)
    for cell in cells:
        seeds = tuple(s for s in cell.seeds if cell.run_id(s) not in done)
        run.done_before += len(cell.seeds) - len(seeds)
        if seeds and dry_run:  # L* is not needed to show what would run (for an MLP it takes minutes)
            run.tasks.append(Task(cell, seeds, float("nan"), "not computed (dry run)"))
        elif seeds:  # L* is computed by `execute`, in its workers (for an MLP it takes minutes)
            method = OPTIMUM_PENDING if optimum_args(cell) in read else OPTIMUM_NOT_READ
            run.tasks.append(Task(cell, seeds, float("nan"), method))
    if fusion_enabled():
        run.tasks = fuse(run.tasks)
    return run


def fuse(tasks: list[Task]) -> list[Task]:
    """Group the tasks that can train together: cells of chain algorithms (`prepare`) with the same data, model,
    λ, dtype, batch size and pending seeds (e.g. an ε or lr axis, `sgd` beside `dp_sgd`). Order: first cells
    first; the other tasks unchanged."""
    groups: dict[tuple[Any, ...], list[Task]] = {}
    for task in tasks:
        cell = task.cell
        fusable = ALGORITHMS[cell.algorithm.name].prepare is not Algorithm.prepare
        key = (cell.dataset.model_dump_json(), cell.validation, cell.model.name,
               json.dumps(cell.model.options, sort_keys=True), cell.l2, cell.dtype, cell.batch_size,
               task.seeds) if fusable else ("alone", len(groups))  # (so L* is the same too)
        groups.setdefault(key, []).append(task)
    return [group[0] if len(group) == 1 else
            Task(group[0].cell, group[0].seeds, group[0].optimal_objective, group[0].optimum_method,
                 tuple(t.cell for t in group[1:]))
            for group in groups.values()]


def grid_hash(grid: Grid) -> str:
    return hashlib.sha256(grid.model_dump_json().encode()).hexdigest()[:16]


def execute(run: GridRun, jobs: int = 1, on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
            backend: Callable[[list[Task]], Iterator[TaskResult]] | None = None,
            on_status: Callable[[str], None] | None = None) -> int:
    """Run the pending tasks, appending each task's rows to runs.csv (and traces.csv) as it finishes; `backend`
    (e.g. `distributed.dask_backend`) runs them elsewhere instead of in `jobs` local processes. First the L*s
    not yet computed (`resolve_optima`: in the `jobs` processes; with a backend, in this one), each announced
    by a line through `on_status` (default: stderr). The failed runs' rows are collected in `run.failures`.
    Releases the folder's lock at the end."""
    store = ResultStore(run.folder)
    started = now()
    done, writing = 0, []
    loaded = {a.name: plugins.provenance(a.name) for a in run.grid.algorithms if a.name in plugins.LOADED}

    def manifest(finished: float | None) -> None:
        store.write_manifest(run.grid.model_dump(mode="json"), grid_hash(run.grid), started, finished,
                             cells=len(run.cells), runs=run.total_runs, **({"plugins": loaded} if loaded else {}))

    try:
        run.tasks = resolve_optima(run.tasks, 1 if backend else jobs, on_status)
        try:
            manifest(None)
            write_analytic_tables(run.grid, run.folder)
            for result in (backend(run.tasks) if backend else _results(run.tasks, jobs)):
                writing = result.rows
                store.append_traces(result.traces)  # first: a run in runs.csv always has its traces
                store.append(result.rows)
                writing, done = [], done + len(result.rows)
                run.failures += [row for row in result.rows if row["status"] == "failed"]
                if on_rows:
                    on_rows(result.rows)
            manifest(now())
        except OSError as exc:
            lost = f"; the {len(writing)} run(s) being written were not saved" if writing else ""
            raise ResultsWriteError(
                f"{run.folder}: cannot write ({exc.strerror or exc}); {run.done_before + done} of the grid's "
                f"{run.total_runs} runs are saved in runs.csv ({done} from this command){lost}; fix it (free "
                f"space, permissions) and run the same command again to resume") from None
    finally:
        release_lock(run.folder)
    return done


def _results(tasks: list[Task], jobs: int) -> Iterator[TaskResult]:
    if jobs <= 1 or len(tasks) <= 1:  # one BLAS thread here too: threads thrash on a shared 2-core machine
        yield from (run_task(task, single_thread=True) for task in tasks)
        return
    for task in tasks:  # RDP σ in the driver: forked workers inherit it, others read it from the disk cache
        with contextlib.suppress(Exception):  # a task whose data cannot load reports it in its worker
            calibrate_ahead(task.cells, dataset(task.cell.dataset, task.cell.validation), accountants=("rdp",))
    tasks = longest_first(spread(tasks, jobs))
    if sys.platform == "linux":  # forked workers start with the driver's imports, datasets and L* in memory
        preload(tasks)
        yield from _forked_results(tasks, jobs)
        return
    from joblib import Parallel, delayed

    parallel = Parallel(n_jobs=jobs, return_as="generator_unordered", initializer=die_with_parent,
                        initargs=(os.getpid(),))
    yield from parallel(delayed(run_task)(task, single_thread=True) for task in tasks)


def preload(tasks: Sequence[Task]) -> None:
    """Import here, once, what each forked worker would otherwise import on its first task: the accountant library
    (every private run's calibration check and attack-risk profile: ~0.8 s) and the compiled kernel modules."""
    if any(ALGORITHMS[cell.algorithm.name].tags.private for task in tasks for cell in task.cells):
        load_accountants()
    if compiled.HAVE_NUMBA:
        with contextlib.suppress(UserError):  # a broken numba: each task takes the NumPy path (or reports it)
            backends.warm_up()


def calibrate_ahead(cells: Sequence[Cell], data: Dataset, accountants: Sequence[str] = ACCOUNTANTS) -> None:
    """σ of every cell (training on `data`) that calibrates DP-SGD's noise by one of `accountants`: one accountant
    curve per (δ, q, T, accountant), loosest target first (its points are the cheapest; points two targets share are
    evaluated once). A fused task does this at its start; with `--jobs N` the driver does it for the RDP curves
    before forking (RDP is native and fast), so the workers receive σ and a task split by `spread` does not walk
    its curve in both halves. PLD curves (~0.1 s an evaluation) stay in the workers, which walk them in parallel.
    σ is the same wherever and in whatever order it is computed (`EpsilonCurve`); a target that fails here fails
    again when its cell prepares, which records the error."""
    wanted: dict[tuple[Any, ...], set[float]] = {}
    for cell in cells:
        try:
            request = cell.make_algorithm().sigma_calibration(setting_of(cell, data))
        except Exception:  # noqa: BLE001 - the cell reports it when it prepares
            continue
        if request is not None and request[4] in accountants:
            wanted.setdefault(request[1:], set()).add(request[0])
    for curve, targets in wanted.items():  # (δ, q, T, accountant, neighbours)
        for target in sorted(targets, reverse=True):  # loosest first: its points are the cheapest
            with contextlib.suppress(UserError, RuntimeError):
                calibrate_sigma(target, *curve)


# Per-step work of a chain step beyond its examples', in units of one example's work on one parameter: the noise
# (a Gaussian number per parameter), the update, and a step's fixed cost (its Python and kernel calls). Fitted
# roughly to measured steps: the single-example MLP step of pidp_sgd on adult (~130 µs: ~P normals) and the
# logistic-regression steps of dp_sgd (B = 256, ~10 µs) and pidp_sgd (~4 µs).
STEP_WORK_PER_PARAMETER = 5.0
STEP_WORK_FIXED = 1600.0


@functools.lru_cache(maxsize=16)
def _density(spec: DatasetSpec, validation: float | None) -> float:
    """Share of nonzero entries of the training rows (what a row costs the kernels, which skip zeros)."""
    X = dataset(spec, validation).X_train
    return float(np.count_nonzero(X)) / max(1, X.size)


def task_cost(task: Task) -> float:
    """A rough estimate of a task's work, to order tasks (never their numbers): for each cell, replicas × (examples
    processed × parameters × the rows' density + steps × a step's own work, `STEP_WORK_*`); a cell without
    epochs (erm, output perturbation: L* from the cache) counts one pass over the data."""
    total = 0.0
    for cell in task.cells:
        data = dataset(cell.dataset, cell.validation)
        params = make_model(cell.model.name, data.d, cell.l2, cell.model.options).n_params
        example = params * max(_density(cell.dataset, cell.validation), 1.0 / max(1, data.d))
        epochs = cell.epochs or 0.0
        batch = ALGORITHMS[cell.algorithm.name].tags.batch
        if batch == "full_batch":
            steps = epochs
        elif batch == "single_example" or not cell.batch_size:
            steps = epochs * data.n
        else:
            steps = epochs * data.n / min(cell.batch_size, data.n)
        work = max(epochs, 1.0) * data.n * example + steps * (STEP_WORK_PER_PARAMETER * params + STEP_WORK_FIXED)
        total += len(task.seeds) * work
    return total


def longest_first(tasks: list[Task]) -> list[Task]:
    """The tasks by decreasing `task_cost` (ties in plan order), so that `jobs` workers taking them in turn end
    close together instead of one finishing a long task alone; the order changes no number (each task is a pure
    function of its cells and seeds)."""
    return sorted(tasks, key=task_cost, reverse=True)


def spread(tasks: list[Task], workers: int) -> list[Task]:
    """Split the largest fused tasks in halves (by cells) until there are at least `workers` tasks, so that a
    grid fused into one or two tasks still keeps every worker busy (a part computes what the whole did)."""
    tasks = list(tasks)
    while len(tasks) < workers and max((len(t.cells) for t in tasks), default=1) > 1:
        big = max(range(len(tasks)), key=lambda i: len(tasks[i].cells))
        task = tasks.pop(big)
        half = (len(task.cells) + 1) // 2
        tasks += [dataclasses.replace(task, cell=part[0], fused=tuple(part[1:]))
                  for part in (task.cells[:half], task.cells[half:])]
    return tasks


def _forked_results(tasks: list[Task], jobs: int) -> Iterator[TaskResult]:
    """The tasks in `jobs` processes forked from the driver (copy-on-write): no worker imports the package or
    loads a dataset again (loky's fresh workers did, ~2 s each on kang_lr: `--jobs 2` was 2× slower than
    `--jobs 1`). A worker killed mid-task raises BrokenProcessPool here, as loky's TerminatedWorkerError did."""
    with fork_pool(jobs) as pool:
        futures = [pool.submit(run_task, task, True) for task in tasks]
        for future in as_completed(futures):
            yield future.result()
