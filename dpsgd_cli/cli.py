"""The `dpsgd` command line: run grids, plot results, manage datasets, compute privacy."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from dpsgd_cli import __version__
from dpsgd_cli.errors import UserError

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
datasets_app = typer.Typer(help="List, fetch and describe the datasets.", no_args_is_help=True)
app.add_typer(datasets_app, name="datasets")
console = Console()


class Accountant(str, Enum):
    rdp = "rdp"
    pld = "pld"


class ImageFormat(str, Enum):
    png = "png"
    pdf = "pdf"
    svg = "svg"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dpsgd {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Reproduce the figures of differentially-private SGD papers."""


# --- run -------------------------------------------------------------------------------------------
@app.command()
def run(
    grid_file: Path = typer.Argument(..., help="YAML file with one or more named grids."),
    only: Optional[list[str]] = typer.Option(None, "--only", help="Run only this grid (repeatable)."),
    out: Path = typer.Option(Path("results"), "--out", help="Results root; grid G writes to OUT/G/."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Worker processes (one BLAS thread each)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show what would run, then stop."),
    no_resume: bool = typer.Option(False, "--no-resume", help="Start over (the old runs.csv is kept as a backup)."),
) -> None:
    """Run every cell of the grid(s), appending each finished run to OUT/<grid>/runs.csv."""
    from dpsgd_cli.algorithms.kernels import backend_description
    from dpsgd_cli.config import load_grid_file, select
    from dpsgd_cli.engine import execute, plan_grid, summary_frame

    grids = select(load_grid_file(grid_file), only)
    plans = [plan_grid(g, out, resume=not no_resume, dry_run=dry_run) for g in grids]
    console.print(backend_description(), highlight=False, markup=False)
    for plan in plans:
        console.print(f"[bold]{plan.grid.name}[/]: {len(plan.cells)} cells × {plan.grid.seeds} seeds = "
                      f"{plan.total_runs} runs; {plan.done_before} already done, {plan.pending_runs} to run "
                      f"→ {plan.folder}")
        if dry_run:
            console.print(_plan_table(plan))
    if dry_run:
        return
    for plan in plans:
        if not plan.tasks:  # nothing to train; the manifest and analytic tables are still refreshed
            execute(plan, jobs=jobs)
            continue
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("runs"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task(plan.grid.name, total=plan.pending_runs)
            try:
                execute(plan, jobs=jobs, on_rows=lambda rows: progress.advance(bar, len(rows)))
            except KeyboardInterrupt:
                progress.stop()
                typer.echo(f"interrupted: finished runs are saved in {plan.folder / 'runs.csv'}; "
                           f"run the same command again to resume", err=True)
                raise typer.Exit(130)
    for plan in plans:
        console.print(_summary_table(summary_frame(plan.folder), plan.grid.name))


def _plan_table(plan) -> Table:
    table = Table("dataset", "model", "algorithm", "ε", "B", "lr", "epochs", "λ", "C", "to run", title=plan.grid.name)
    pending = {t.cell.cell_id: len(t.seeds) for t in plan.tasks}
    for c in plan.cells:
        table.add_row(c.dataset.name, c.model.name, _algo_label(c.algorithm.name, c.algorithm.params),
                      *(_fmt(v) for v in (c.epsilon, c.batch_size, c.lr, c.epochs, c.l2, c.clip_norm)),
                      f"{pending.get(c.cell_id, 0)}/{len(c.seeds)}")
    return table


def _summary_table(frame, name: str) -> Table:
    table = Table("dataset", "model", "algorithm", "ε", "B", "lr", "runs", "test accuracy", "optimality gap",
                  title=f"{name}: mean ± std over seeds")
    for _, r in frame.iterrows():
        table.add_row(r["dataset"], r["model"], r["label"], _fmt(r["epsilon"]), _fmt(r["batch_size"]), _fmt(r["lr"]),
                      f"{r['ok']}/{r['runs']}", f"{r['acc_mean']:.4f} ± {r['acc_std']:.4f}",
                      f"{r['gap_mean']:.3g} ± {r['gap_std']:.2g}")
    return table


def _algo_label(name: str, params: dict[str, Any]) -> str:
    return name + "".join(f" {k}={v}" for k, v in params.items())


def _fmt(value: Any) -> str:
    if value is None or value != value:  # None or NaN
        return "–"
    return f"{value:g}" if isinstance(value, float) else str(value)


# --- plot ------------------------------------------------------------------------------------------
@app.command()
def plot(
    results_dir: Path = typer.Argument(Path("results"), help="A grid's results folder, or the results root."),
    metric: Optional[str] = typer.Option(
        None, "--metric", help="accuracy | optimality_gap | test_loss | train_objective | train_accuracy "
        "(default: the grid's paper figures, or accuracy)"),
    fmt: ImageFormat = typer.Option(ImageFormat.png, "--format", help="Image format (png also writes a PDF)."),
) -> None:
    """Draw the grid's paper figures, or a metric over ε (a panel per dataset and model, a line per algorithm)."""
    from dpsgd_cli.plots import plot_results

    for path in plot_results(results_dir, metric=metric, fmt=fmt.value):
        console.print(str(path))


# --- report --------------------------------------------------------------------------------------------
@app.command()
def report(
    results_dir: Path = typer.Argument(Path("results"), help="A grid's results folder, or the results root."),
) -> None:
    """Check the papers' claims listed in the grids against the results; print PASS/FAIL and write report.md."""
    from dpsgd_cli.report import build_report

    verdicts, path = build_report(results_dir)
    table = Table("grid", "claim", "verdict", "numbers", title="claims of the papers", show_lines=True)
    colours = {"PASS": "green", "FAIL": "red", "NO DATA": "yellow"}
    for v in verdicts:
        source = "(the project's own check)" if v.claim.own else v.claim.quote
        table.add_row(escape(v.grid), escape(f"{v.claim.id}: {v.claim.text}") + f"\n[dim]{escape(source)}[/]",
                      f"[{colours[v.status]}]{v.status}[/]", escape(v.numbers))
    console.print(table)
    counts = {s: sum(v.status == s for v in verdicts) for s in colours}
    console.print(f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['NO DATA']} NO DATA → {path}")


# --- datasets --------------------------------------------------------------------------------------
@datasets_app.command("list")
def datasets_list() -> None:
    """What is known, whether it is cached, sizes and sources."""
    from dpsgd_cli.data import list_datasets

    table = Table("name", "records", "cached", "size", "source", "licence")
    for info in list_datasets():
        table.add_row(info["name"], str(info.get("records", "")), "yes" if info.get("cached") else "no",
                      _size(info.get("size_bytes", 0)), str(info.get("source", "")), str(info.get("license", "")))
    console.print(table)


@datasets_app.command("fetch")
def datasets_fetch(names: list[str] = typer.Argument(..., help="Dataset names (see `dpsgd datasets list`).")) -> None:
    """Download and verify (sha256) the files of each dataset into the cache."""
    from dpsgd_cli.data import fetch

    for name in names:
        for path in fetch(name):
            console.print(f"{name}: {path}")


@datasets_app.command("info")
def datasets_info(name: str = typer.Argument(..., help="Dataset name.")) -> None:
    """Everything known about one dataset: files, checksums, source, licence, default options."""
    from dpsgd_cli.data import dataset_info

    for key, value in dataset_info(name).items():
        console.print(f"[bold]{key}[/]: {value}")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# --- privacy calculators ---------------------------------------------------------------------------
@app.command()
def epsilon(
    sigma: float = typer.Option(..., "--sigma", help="Noise multiplier σ (noise std / clipping norm)."),
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson sampling rate q = B/n."),
    steps: int = typer.Option(..., "--steps", help="Number of steps T."),
    delta: float = typer.Option(..., "--delta", help="δ."),
    accountant: Accountant = typer.Option(Accountant.rdp, "--accountant"),
) -> None:
    """ε of DP-SGD (Poisson-subsampled Gaussian, T steps) at the given δ."""
    from dpsgd_cli.privacy.accounting import dpsgd_epsilon

    eps = dpsgd_epsilon(sigma, sample_rate, steps, delta, accountant=accountant.value)
    console.print(f"ε = {eps:.6g}  (σ = {sigma:g}, q = {sample_rate:g}, T = {steps}, δ = {delta:g}, "
                  f"{accountant.value} accountant)")


@app.command()
def sigma(
    epsilon: float = typer.Option(..., "--epsilon", help="Target ε."),
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson sampling rate q = B/n."),
    steps: int = typer.Option(..., "--steps", help="Number of steps T."),
    delta: float = typer.Option(..., "--delta", help="δ."),
    accountant: Accountant = typer.Option(Accountant.rdp, "--accountant"),
) -> None:
    """The smallest noise multiplier σ giving ε ≤ target (within 0.1%) for DP-SGD."""
    from dpsgd_cli.privacy.accounting import calibrate_sigma

    cal = calibrate_sigma(epsilon, delta, sample_rate, steps, accountant=accountant.value)
    console.print(f"σ = {cal.sigma:.6g}  (achieved ε = {cal.epsilon:.6g} ≤ {epsilon:g}, q = {sample_rate:g}, "
                  f"T = {steps}, δ = {delta:g}, {cal.accountant} accountant, {cal.library})")


@app.command("privacy-curve")
def privacy_curve(
    alpha: float = typer.Option(30.0, "--alpha", min=1.0, help="Rényi order α (> 1)."),
    sigma: float = typer.Option(0.02, "--sigma", min=0.0, help="Noise σ of the update's √(2ησ²) N(0, I)."),
    sensitivity: float = typer.Option(4.0, "--sensitivity", min=0.0, help="Gradient sensitivity S_g."),
    eta: float = typer.Option(0.02, "--eta", min=0.0, help="Step size η."),
    lam: float = typer.Option(1.0, "--lam", min=0.0, help="Strong convexity λ."),
    n: int = typer.Option(5000, "--n", min=1, help="Number of records n."),
    k_max: int = typer.Option(1000, "--k-max", min=1, help="Largest number of steps K."),
    points: int = typer.Option(200, "--points", min=2, help="Number of K values."),
    log_x: bool = typer.Option(False, "--log-x/--no-log-x", help="Logarithmic K axis."),
    log_y: bool = typer.Option(False, "--log-y/--no-log-y", help="Logarithmic ε axis."),
    out: Path = typer.Option(Path("results/privacy_curve"), "--out", help="Folder for the figure and CSV."),
    fmt: ImageFormat = typer.Option(ImageFormat.png, "--format", help="Image format."),
) -> None:
    """Rényi privacy of noisy GD over K steps: the dynamics bound vs composition, and the squared-loss lower
    bound (Chourasia, Ye, Shokri, NeurIPS 2021); defaults are the parameters of their talk."""
    from dpsgd_cli.plots.privacy_curve import k_values, plot_privacy_curve
    from dpsgd_cli.privacy.dynamics import SATURATION_ROOT
    from dpsgd_cli.privacy.dynamics import privacy_curve as curve

    if sigma <= 0 or eta <= 0 or lam <= 0 or alpha <= 1:
        raise UserError("privacy-curve: --sigma, --eta and --lam must be > 0 and --alpha > 1")
    frame = curve(k_values(k_max, points, log=log_x), alpha=alpha, sigma=sigma, sensitivity=sensitivity,
                  eta=eta, lam=lam, n=n)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "privacy_curve.csv", index=False)
    figure = plot_privacy_curve(frame, out / f"privacy_curve.{fmt.value}", log_x=log_x, log_y=log_y)
    saturation = alpha * sensitivity**2 / (lam * sigma**2 * n**2)
    console.print(f"dynamics bound saturates at ε(α={alpha:g}) = {saturation:.6g}; it is below the composition "
                  f"bound for K > {2 * SATURATION_ROOT / (lam * eta):.1f}")
    console.print(str(out / "privacy_curve.csv"))
    console.print(str(figure))


def main() -> None:
    """Entry point: a user error is one line on stderr and exit code 2, never a traceback."""
    try:
        code = app(standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("aborted", err=True)
        sys.exit(130)
    except Exception as exc:
        if not _is_usage_error(exc):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":  # `dpsgd` or a group alone: show its help
            typer.echo(exc.ctx.get_help())
            sys.exit(0)
        command = exc.ctx.command_path if getattr(exc, "ctx", None) else "dpsgd"
        message = " ".join(exc.format_message().split())
        typer.echo(f"error: {message} (see `{command} --help`)", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


def _is_usage_error(exc: Exception) -> bool:
    """Click's usage errors (bad option, missing argument, ...), whether typer vendors click or not."""
    return hasattr(exc, "format_message") and getattr(exc, "exit_code", None) == 2
