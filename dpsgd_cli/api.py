"""The Python API: what the `dpsgd` commands do, as functions for notebooks and scripts (docs/python-api.md).

    import dpsgd_cli as dpsgd
    df = dpsgd.run("experiments.yaml", only=["smoke"], out="results")   # a DataFrame, one row per run

Bad input raises `dpsgd_cli.UserError`, whose message is the line the command prints; arguments are checked
before any work (`dpsgd_cli.arguments`). Heavy modules are imported on first use (`dpsgd_cli.lazy`)."""

from __future__ import annotations

import contextlib
import copy
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, runtime_checkable

from dpsgd_cli.arguments import at_least, between, checked, each
from dpsgd_cli.errors import ArgumentValueError, UserError, file_errors
from dpsgd_cli.lazy import LazyModule, installed
from dpsgd_cli.privacy import AccountantName, Neighbours
from dpsgd_cli.privacy import validate as check

if TYPE_CHECKING:
    import pandas as pd
    from rich.progress import Progress

    from dpsgd_cli.config import GridFile
else:
    pd = LazyModule("pandas")

# imported on first use: each pulls in pydantic, NumPy, pandas, matplotlib or rich (multiprocessing alone costs a
# third of `import dpsgd_cli`)
multiprocessing = LazyModule("multiprocessing")
rich_console = LazyModule("rich.console")
rich_markup = LazyModule("rich.markup")
rich_progress = LazyModule("rich.progress")
tables = LazyModule("dpsgd_cli.tables")
config = LazyModule("dpsgd_cli.config")
compiled = LazyModule("dpsgd_cli.compiled")
data_files = LazyModule("dpsgd_cli.data.files")
engine = LazyModule("dpsgd_cli.engine")
checks = LazyModule("dpsgd_cli.engine.checks")
distributed = LazyModule("dpsgd_cli.engine.distributed")
engine_folder = LazyModule("dpsgd_cli.engine.folder")
results = LazyModule("dpsgd_cli.engine.results")
runner = LazyModule("dpsgd_cli.engine.runner")
selection = LazyModule("dpsgd_cli.engine.selection")
plots = LazyModule("dpsgd_cli.plots")
claims_report = LazyModule("dpsgd_cli.report")
report_html = LazyModule("dpsgd_cli.report_html")
audit_run = LazyModule("dpsgd_cli.audit.run")
audit_engine = LazyModule("dpsgd_cli.audit.engine")
accounting = LazyModule("dpsgd_cli.privacy.accounting")
algorithm_plugins = LazyModule("dpsgd_cli.plugins")
contract = LazyModule("dpsgd_cli.contract")

PathLike = str | Path


@runtime_checkable
class GridModel(Protocol):
    """A validated grid, `dpsgd_cli.config.Grid` (recognised without importing pydantic here)."""

    name: str

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...


# a grid file's path; its YAML text; the document as a dict ({"grids": [...]}, or one grid); one or more grids
GridSource = Annotated[str | Path | Mapping[str, Any] | GridModel | Sequence[Mapping[str, Any] | GridModel],
                       "a path, YAML text, a dict, a Grid or a list of grids"]
Names = str | Iterable[str] | None  # one name, or several (`only="a"` is `only=["a"]`)
Plugins = PathLike | Sequence[PathLike]  # one plugin file, or several
ExportFormat = Literal["parquet", "csv"]
ImageFormat = Literal["png", "pdf", "svg"]


# --- run -------------------------------------------------------------------------------------------
@file_errors()
@checked(jobs=at_least(1))
def run(grid: GridSource, *, only: Names = None, out: PathLike = "results", jobs: int = 1,
        dry_run: bool = False, no_resume: bool = False, scheduler: str | None = None,
        set: Mapping[str, Any] | Names = None, seeds: int | None = None,  # noqa: A002
        quiet: bool = False, plugins: Plugins = ()) -> pd.DataFrame:
    """`dpsgd run`: run every cell of the grid(s), resuming, and return their runs as `read_results` reads them;
    `df.attrs["failed"]` counts the runs that failed in this call. The forms of `grid` and `set`:
    docs/python-api.md."""
    only = _strings(only) or None
    grids = config.select(_load_grids(grid, _overrides(set, seeds), only, plugins), only)
    root = checks.out_root(str(out))
    if scheduler:  # checked at once, before any work (the connection itself waits until dry_run is ruled out)
        distributed.check_scheduler(scheduler)
    checks.check_grids(grids)  # every figure, claim and limit, before any work
    jobs = _cap_jobs(jobs)
    # workers not forked from this process (Dask's; --jobs off Linux) have not loaded the plugin files
    unforked = f"--jobs {jobs}" if jobs > 1 and sys.platform != "linux" else scheduler and f"--scheduler {scheduler}"
    if unforked and any(a.name in algorithm_plugins.LOADED for g in grids for a in g.algorithms):
        raise UserError(f"{unforked}: its worker processes do not load plugin algorithms (only forked ones, Linux's "
                        f"--jobs, inherit them); run the grid with --jobs 1")
    if scheduler and jobs > 1:
        raise UserError(f"--jobs {jobs} and --scheduler {scheduler}: choose one (the Dask workers are the processes)")
    show = _Display(quiet)
    with contextlib.ExitStack() as stack:
        backend = None
        if scheduler and not dry_run:  # connected first: an unreachable scheduler fails before anything is touched
            backend = stack.enter_context(distributed.dask_backend(scheduler))
            show.line(backend.describe())
        plans = [engine.plan_grid(g, root, resume=not no_resume, dry_run=dry_run) for g in grids]
        show.plans(plans, dry_run)
        for plan in [] if dry_run else plans:
            with show.progress(plan) as advance:
                try:
                    engine.execute(plan, jobs=jobs, backend=backend, on_rows=advance, on_status=show.line)
                except KeyboardInterrupt:
                    _stop_workers()
                    show.stop()
                    print(f"interrupted: finished runs are saved in {plan.folder / 'runs.csv'}; run the same "
                          f"command again to resume", file=sys.stderr)
                    raise
    readings = [results.read_results(plan.folder) for plan in plans]
    frame = results.typed_runs(pd.concat([r.runs for r in readings], ignore_index=True)) if readings else pd.DataFrame()
    failures = [row for plan in plans for row in plan.failures]
    if not dry_run:
        show.summaries(plans, readings)
        _print_failures(failures)
    frame.attrs["failed"] = len(failures)
    return frame


def _load_grids(grid: GridSource, overrides: Sequence[tuple[str, Any]] = (),
               only: list[str] | None = None, plugins: Plugins = ()) -> GridFile:
    """The grids `run` and `audit` take (the forms of docs/python-api.md), validated as a grid file is; the
    `plugins` files are loaded first, so that the grids may name their algorithms."""
    load_plugins(plugins)
    if isinstance(grid, str) and _is_yaml_text(grid):
        return config.validate_grids(config.parse_yaml(grid, "grid (YAML text)"), "grid (YAML text)", Path.cwd(),
                                     overrides, only)
    if isinstance(grid, (str, os.PathLike)):
        return config.load_grid_file(Path(grid), overrides, only)
    if isinstance(grid, GridModel):
        raw: Any = {"grids": [grid.model_dump(mode="json")]}
    elif isinstance(grid, Mapping):
        raw = copy.deepcopy(dict(grid))  # the overrides are set in it: the caller's dict stays as it was
    else:
        raw = {"grids": [g.model_dump(mode="json") if isinstance(g, GridModel) else copy.deepcopy(dict(g))
                         for g in grid]}
    kind = "a Grid" if isinstance(grid, GridModel) else "a dict" if isinstance(grid, Mapping) else "a list"
    return config.validate_grids(raw, f"grid ({kind})", Path.cwd(), overrides, only)


@checked()
def load_plugins(plugins: Plugins) -> list[str]:
    """Load plugin files (`--plugin`): the algorithms they define may then be named by grids; their names."""
    return algorithm_plugins.load([plugins] if isinstance(plugins, (str, os.PathLike)) else plugins)


def _is_yaml_text(text: str) -> bool:
    """A grid's YAML rather than a file name: no such path, and a newline or `grids:` in it."""
    try:
        exists = Path(text).exists()
    except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte: no file of that name
        exists = False
    return not exists and ("\n" in text or "grids:" in text)


def _overrides(set: Mapping[str, Any] | Names, seeds: int | None) -> list[tuple[str, Any]]:  # noqa: A002
    """`set` ({"epochs": 1} or ["epochs=1"]) and `seeds` as (dotted key, value) pairs."""
    overrides = list(set.items()) if isinstance(set, Mapping) else config.parse_overrides(_strings(set))
    if seeds is not None:
        overrides.append(("seeds", seeds))
    return overrides


def _strings(value: Names) -> list[str]:
    """`only="a"` as `only=["a"]` (a string is one name, not its characters)."""
    return [value] if isinstance(value, str) else list(value or [])


def _stop_workers() -> None:
    """Ctrl-C: end the worker processes now. The runs they were training are lost either way (a rerun redoes
    them), and the process pool's exit handler would otherwise wait for each to finish its task (seconds to
    minutes) before the interpreter exits."""
    for child in multiprocessing.active_children():
        child.kill()


def _cap_jobs(jobs: int) -> int:
    """At most one worker per core available to this process: more only thrash (and multiply memory)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if jobs > cores:
        print(f"--jobs {jobs}: capped at {cores}, the number of cores available", file=sys.stderr)
    return min(jobs, cores)


def _print_failures(rows: list[dict]) -> None:
    """The failed runs' messages, most frequent first, each with the cells it hit."""
    if not rows:
        return
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get("message") or "(no message)", []).append(row)
    print(f"error: {len(rows)} run(s) failed (recorded as `failed` in runs.csv and tried again when the same "
          f"command is rerun):", file=sys.stderr)
    for message, group in sorted(groups.items(), key=lambda item: -len(item[1])):
        cells = sorted({f"{r['grid']}: {r['algorithm']} on {r['dataset']}"
                        + (f" ε={tables.fmt(r['epsilon'])}" if r.get("epsilon") is not None else "") for r in group})
        shown = ", ".join(cells[:3]) + (f", … ({len(cells)} cells)" if len(cells) > 3 else "")
        print(f"  {len(group)}× {message}  [{shown}]", file=sys.stderr)


class _Display:
    """What `run` shows while it works (rich renders it in a terminal and in a notebook); nothing when quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.console = rich_console.Console()
        self._progress: Progress | None = None

    def line(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False, markup=False)

    def plans(self, plans: list, dry_run: bool) -> None:
        if self.quiet:
            return
        self.line(compiled.backend_description())
        specs = {c.dataset for plan in plans for c in plan.cells if c.dataset.name == "file"}
        for note in data_files.run_notes(runner.dataset(spec) for spec in sorted(specs, key=lambda s: s.id)):
            self.line(note)  # once per run: what each file dataset's loading did, and its privacy caveat
        for plan in plans:
            self.console.print(f"[bold]{rich_markup.escape(plan.grid.name)}[/]: {len(plan.cells)} cells × "
                               f"{plan.grid.seeds} seeds = {plan.total_runs} runs; {plan.done_before} already done, "
                               f"{plan.pending_runs} to run → {rich_markup.escape(str(plan.folder))}")
            if dry_run:
                self.console.print(tables.plan_table(plan))

    @contextlib.contextmanager
    def progress(self, plan) -> Any:
        """A progress bar over the plan's pending runs; yields the callback that advances it."""
        if self.quiet or not plan.tasks:  # nothing to train: the manifest and analytic tables are still refreshed
            yield None
            return
        text = rich_progress.TextColumn
        columns = [text("{task.description}"), rich_progress.BarColumn(), rich_progress.MofNCompleteColumn(),
                   text("runs"), rich_progress.TimeElapsedColumn(), text("ETA"), rich_progress.TimeRemainingColumn()]
        with rich_progress.Progress(*columns, console=self.console, transient=False) as progress:
            self._progress = progress
            bar = progress.add_task(plan.grid.name, total=plan.pending_runs)
            yield lambda rows: progress.advance(bar, len(rows))
        self._progress = None

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()

    def summaries(self, plans: list, readings: list) -> None:
        if self.quiet:
            return
        for plan, reading in zip(plans, readings):
            for line in reading.notes():  # rows the table leaves out, and why
                results.note(line)
            self.console.print(tables.summary_table(engine.summary_frame(plan.folder), plan.grid.name))


# --- results ---------------------------------------------------------------------------------------
@file_errors()
@checked()
def read_results(folder: PathLike = "results", *, plugins: Plugins = ()) -> pd.DataFrame:
    """The runs of a grid's results folder (or of every grid under a results root), one row per run id, as the
    summary, plots and report read them (docs/python-api.md): unreadable rows and rows of another version of the grid
    left out, each omission noted on stderr; JSON columns flattened (`derived.*`); `epsilon` NaN exactly where
    `private` is False. `plugins`: the files of the plugin algorithms the grids name (without them, a note)."""
    load_plugins(plugins)
    frames = []
    for path in results.result_folders(folder):
        found = results.read_results(path)
        for line in found.notes():
            results.note(line)
        frames.append(found.runs)
    return results.typed_runs(pd.concat(frames, ignore_index=True))


@file_errors()
@checked()
def export(results_dir: PathLike = "results", *, format: ExportFormat = "parquet",  # noqa: A002
           plugins: Plugins = ()) -> list[Path]:
    """`dpsgd export`: each grid's runs (as `read_results` gives them) written beside its runs.csv as
    runs.parquet (or runs_valid.csv with format="csv"), and traces.csv as traces.parquet; returns the paths."""
    load_plugins(plugins)
    if format == "parquet" and not installed("pyarrow"):
        raise UserError("--format parquet needs pyarrow: pip install 'dpsgd[parquet]' (or pip install pyarrow)")
    paths = []
    for folder in results.result_folders(results_dir):
        frames = {"runs": read_results(folder)}
        if (folder / "traces.csv").exists():
            frames["traces"] = results.ResultStore(folder).read_traces()
        for name, frame in frames.items():
            path = folder / (f"{name}.parquet" if format == "parquet" else f"{name}_valid.csv")
            paths.append(engine_folder.write_bytes(path, frame.to_parquet(index=False)) if format == "parquet" else
                         engine_folder.write_csv(frame, path))
    return paths


@file_errors()
@checked(jobs=at_least(1))
def report(results_dir: PathLike = "results", *, jobs: int = 1, plugins: Plugins = ()) -> pd.DataFrame:
    """`dpsgd report`: check the claims of every grid under `results_dir` and write report.md and report.html
    (the report with its figures embedded: one file to open in a browser or send); one row per claim: grid,
    claim, kind, text, quote, reading, own, verdict (PASS, FAIL, VACUOUS, NO DATA), numbers; `df.attrs["path"]` is
    report.md's path. `jobs`: worker processes evaluating the grids (capped at the number of cores). `plugins` as
    for `read_results`."""
    load_plugins(plugins)
    verdicts, path = claims_report.build_report(Path(results_dir), jobs=_cap_jobs(jobs))
    report_html.write_html(path)
    frame = pd.DataFrame([{"grid": v.grid, "claim": v.claim.id, "kind": v.claim.kind, "text": v.claim.text,
                           "quote": v.claim.quote, "reading": v.claim.reading, "own": v.claim.own,
                           "verdict": v.status, "numbers": v.numbers} for v in verdicts],
                         columns=["grid", "claim", "kind", "text", "quote", "reading", "own", "verdict", "numbers"])
    # report.md's path; the verdicts counted
    frame.attrs.update(path=path, summary=claims_report.summary_line(verdicts))
    return frame


@file_errors()
@checked()
def select(results_dir: PathLike = "results", *, plugins: Plugins = ()) -> pd.DataFrame:
    """`dpsgd select`: for each grid with `select:`, the candidate each group chose on validation, its scores
    and what choosing cost in privacy (also written to selection.csv beside runs.csv); one row per selection and
    group, the first column naming the grid. `plugins` as for `read_results`."""
    load_plugins(plugins)
    tables = [table.assign(grid=folder.name) for folder, table in selection.write_selection_tables(results_dir)]
    frame = pd.concat(tables, ignore_index=True)
    return frame[["grid", *(c for c in frame.columns if c != "grid")]]


# --- figures, audit --------------------------------------------------------------------------------
def metrics() -> list[str]:
    """What `plot(metric=...)` accepts: `accuracy` (test accuracy) and every numeric column of runs.csv."""
    return ["accuracy", *(c for c in results.COLUMNS if c in results.NUMERIC and c != "seed")]


@checked()
def check_metric(metric: str | None) -> str | None:
    """`metric` if `plot` can draw it, else one UserError line (with the closest name)."""
    if metric is None or metric in metrics():
        return metric
    match = difflib.get_close_matches(metric, metrics(), n=1)
    hint = f" (did you mean '{match[0]}'?)" if match else ""
    raise ArgumentValueError(f"--metric {metric}: not a numeric column of runs.csv{hint}; choose one of "
                             f"{', '.join(metrics())}")


@file_errors()
@checked(jobs=at_least(1))
def plot(results_dir: PathLike = "results", *, metric: str | None = None, format: ImageFormat = "png",  # noqa: A002
         caption: bool = True, jobs: int = 1, plugins: Plugins = ()) -> list[Path]:
    """`dpsgd plot`: the grid's paper figures, or `metric` (any numeric column of runs.csv) over ε; returns
    the files written (under each grid's figures/). `caption=False`: each caption in a .txt beside its figure
    (for a LaTeX caption), not in the image. `jobs`: worker processes drawing the grids (capped at the number of
    cores). `plugins` as for `read_results`."""
    load_plugins(plugins)
    return plots.plot_results(Path(results_dir), metric=check_metric(metric), fmt=format, caption=caption,
                              jobs=_cap_jobs(jobs))


@file_errors()
@checked(trials=at_least(2), confidence=between(0.5, 1, "0.95"))
def audit(grid: GridSource, *, only: Names = None, out: PathLike = "results",
          trials: int | None = None, confidence: float | None = None, dry_run: bool = False,
          set: Mapping[str, Any] | Names = None, seeds: int | None = None,  # noqa: A002
          on_rows: Callable[[list[dict]], None] | None = None, selected: bool = False,
          plugins: Plugins = ()) -> pd.DataFrame:
    """`dpsgd audit`: train with and without a canary and bound each cell's ε from below; returns the rows of
    every audited grid's audit.csv. `grid`, `set`, `seeds` and `plugins` as for `run`; `on_rows` sees each cell's
    rows as they come; `dry_run`: a row per cell to audit, its trials per world, the trials refuting the noise × 0.5
    control would need and the estimated seconds of training, nothing trained; `selected`: `grid` is a results folder
    whose selections' chosen configurations are audited as run, audit.csv beside runs.csv (docs/audit.md)."""
    only = _strings(only) or None
    audits: list[tuple[Any, frozenset[str] | None, Path]]
    if selected:
        if set or seeds is not None:
            raise UserError("audit --selected audits the grid as it was run: --set and --seeds do not apply")
        load_plugins(plugins)
        audits = [*_selected_audits(grid, only)]
    else:
        grids = config.select(_load_grids(grid, _overrides(set, seeds), only, plugins), only)
        audits = [(one, None, Path(out)) for one in grids]
    for one, cells, _ in audits:  # every grid's trials bounded before the first training
        checks.check_audit(one, trials, cells)
    if dry_run:
        parts = []
        for one, cells, _ in audits:
            spec = one.audit or config.AuditSpec()
            audited = checks.audited_cells(one, cells)
            plans = [audit_engine.plan_trials(cell, spec, trials, confidence) for cell in audited]
            parts.append(tables.cells_frame(audited).assign(
                grid=one.name, canaries=", ".join(spec.canaries), trials=[p.trials for p in plans],
                trials_needed=[p.needed for p in plans], seconds=[p.seconds for p in plans],
                controls_trials=[audit_engine.controls_trials(p) for p in plans]))
        return pd.concat(parts, ignore_index=True)
    paths = [audit_run.audit_grid(one, root, trials=trials, confidence=confidence, on_rows=on_rows, cells=cells)
             for one, cells, root in audits]
    frame = pd.concat([audit_run.read_audit_csv(p) for p in paths], ignore_index=True)
    frame.attrs["paths"] = {one.name: path for (one, _, _), path in zip(audits, paths)}  # grid → its audit.csv
    return frame


def _selected_audits(folder: GridSource, only: list[str] | None) -> list[tuple[Any, frozenset[str], Path]]:
    """(grid as run without its non-private algorithms, the private cells its selections chose, results root) for
    each grid with `select:` under the results folder `folder`."""
    if not isinstance(folder, (str, os.PathLike)):
        raise UserError("audit --selected takes a results folder (where `dpsgd run` wrote runs.csv), not a grid")
    audits = []
    for path in results.result_folders(folder):
        recorded = results.grid_of(path)
        if not recorded.get("select") or (only and recorded.get("name") not in only):
            continue
        private = [a for a in recorded["algorithms"] if config.ALGORITHMS[a["name"]].tags.private]
        source = str(path / "manifest.json")
        one = config.validate_grids({**recorded, "algorithms": private}, source, path).grids[0]
        cells = frozenset(selection.chosen_cells(path) & {cell.cell_id for cell in config.expand(one)})
        if cells:
            audits.append((one, cells, path.parent))
    if not audits:
        raise UserError(f"{folder}: no grid here chose a private configuration with `select:`; run a grid with "
                        f"`select:` first (docs/hyperparameters.md), or audit a grid file without --selected")
    return audits


@file_errors()
@checked()
def check_plugin(plugin: PathLike) -> pd.DataFrame:
    """`dpsgd check`: the algorithm contract (`dpsgd_cli.contract`) on each algorithm the plugin file defines; one
    row per algorithm and check: algorithm, check, status ("ok", "FAIL", "n/a"), message."""
    names = load_plugins(plugin)
    return pd.DataFrame([row for name in names for row in contract.run_checks(algorithm_plugins.ALGORITHMS[name])],
                        columns=["algorithm", "check", "status", "message"])


# --- privacy calculators ---------------------------------------------------------------------------
# the ranges the accountants check, at the door (σ's and T's upper limits depend on the accountant: checked there)
PRIVACY_RULES = {"sample_rate": check.sample_rate, "steps": check.count, "delta": check.open_unit}


@checked(sigma=check.noise_multiplier, **PRIVACY_RULES)
def epsilon(*, sigma: float, sample_rate: float, steps: int, delta: float, accountant: AccountantName = "rdp",
            neighbours: Neighbours = "add_remove") -> float:
    """`dpsgd epsilon`: ε of DP-SGD (Poisson-subsampled Gaussian, `steps` steps) at `delta`."""
    return float(accounting.dpsgd_epsilon(sigma, sample_rate, steps, delta, accountant=accountant,
                                          neighbours=neighbours))


@checked(epsilon=each(check.positive), **PRIVACY_RULES)
def calibrations(*, epsilon: Sequence[float], sample_rate: float, steps: int, delta: float,
                 accountant: AccountantName = "rdp", neighbours: Neighbours = "add_remove") -> list:
    """`dpsgd sigma`'s calibrations: per target ε, σ with the ε it achieves, the accountant and its library."""
    return accounting.calibrate_sigmas(list(epsilon), delta, sample_rate, steps, accountant, neighbours)


@checked(epsilon=each(check.positive), **PRIVACY_RULES)
def sigma(*, epsilon: float | Sequence[float], sample_rate: float, steps: int, delta: float,
          accountant: AccountantName = "rdp", neighbours: Neighbours = "add_remove") -> float | list[float]:
    """`dpsgd sigma`: the smallest noise multiplier σ giving ε ≤ target (within 0.1%); a list for a list."""
    targets = [epsilon] if isinstance(epsilon, (int, float)) else list(epsilon)
    found = [c.sigma for c in calibrations(epsilon=targets, sample_rate=sample_rate, steps=steps, delta=delta,
                                           accountant=accountant, neighbours=neighbours)]
    return found[0] if isinstance(epsilon, (int, float)) else found
