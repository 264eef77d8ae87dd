"""The `dpsgd` command line: run grids, plot results, manage datasets, compute privacy."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, TypeGuard
from urllib.parse import urlsplit

import typer
from pydantic import ValidationError
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperOption

from dpsgd_cli import __version__, api
from dpsgd_cli.analytic_params import PrivacyCurveParams, bounds
from dpsgd_cli.errors import UserError, file_errors
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy import ACCOUNTANTS, AccountantName
from dpsgd_cli.tables import compact_table, settings_table, spread
from dpsgd_cli.tables import fmt as _fmt

# imported by the commands that use them: `dpsgd --help` stays quick
pd = LazyModule("pandas")
yaml = LazyModule("yaml")
data = LazyModule("dpsgd_cli.data")
data_files = LazyModule("dpsgd_cli.data.files")
checks = LazyModule("dpsgd_cli.engine.checks")
engine_folder = LazyModule("dpsgd_cli.engine.folder")
results = LazyModule("dpsgd_cli.engine.results")
engine_selection = LazyModule("dpsgd_cli.engine.selection")
summary = LazyModule("dpsgd_cli.engine.summary")
curve_plot = LazyModule("dpsgd_cli.plots.privacy_curve")
dynamics = LazyModule("dpsgd_cli.privacy.dynamics")
claims_report = LazyModule("dpsgd_cli.report")
controls = LazyModule("dpsgd_cli.audit.controls")

def _hide_flag_types() -> None:
    """Show flags as `--dry-run`, not `--dry-run <bool>` (which suggests they take a value), and an argument as
    its metavar alone (`RESULTS_DIR`, not `RESULTS_DIR <path>`), as options are: typer's rich help prints a type
    for every parameter; a flag (and `--help`) has none, and a metavar already says what to give."""
    for cls, hidden in ((TyperOption, lambda p: getattr(p, "is_flag", False) and p.metavar is None),
                        (TyperArgument, lambda p: p.metavar is not None)):
        shown = cls.display_type_rich
        if getattr(shown, "_types_hidden", False):
            continue

        def display_type_rich(self, ctx, shown=shown, hidden=hidden):  # noqa: ANN001
            return None if hidden(self) else shown(self, ctx)

        # typer's classes patched in place: attributes a type checker does not know of
        setattr(display_type_rich, "_types_hidden", True)
        setattr(cls, "display_type_rich", display_type_rich)


_hide_flag_types()
# markdown: a docstring's single line breaks are spaces, so help text wraps at the terminal's width, not ragged
app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")
datasets_app = typer.Typer(help="List, fetch and describe the datasets.", no_args_is_help=True,
                           rich_markup_mode="markdown")
app.add_typer(datasets_app, name="datasets")
console = Console()


class Neighbours(str, Enum):
    add_remove = "add_remove"
    replace_one = "replace_one"


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


# options several commands share
_PLUGINS = typer.Option(None, "--plugin", metavar="FILE.py", help="Load the algorithms defined in this Python file, "
                        "so that the grids may name them (repeatable; docs/algorithms.md).")
_PLUGINS_READ = typer.Option(None, "--plugin", metavar="FILE.py", help="A plugin file whose algorithms the grids ran "
                             "(repeatable): the grid as last run is known.")
_RESULTS_DIR = typer.Argument(Path("results"), metavar="RESULTS_DIR",
                              help="A grid's results folder, or the results root.")


# --- run -------------------------------------------------------------------------------------------
@app.command()
def run(
    grid_file: Path = typer.Argument(..., metavar="GRID.yaml", help="YAML file with one or more named grids."),
    only: list[str] | None = typer.Option(None, "--only", metavar="NAME",
                                          help="Run only this grid (repeatable: --only a --only b)."),
    out: str = typer.Option("results", "--out", metavar="DIR", help="Results root; grid G writes to DIR/G/."),
    jobs: int = typer.Option(1, "--jobs", min=1, metavar="N",
                             help="Worker processes (one BLAS thread each); capped at the number of cores."),
    overrides: list[str] | None = typer.Option(
        None, "--set", metavar="KEY=VALUE", help="Set a grid key before validation, in every grid run (repeatable; "
        "VALUE is YAML; dotted KEY for nested values: --set epochs=1 --set datasets.0.n=500)."),
    seeds: int | None = typer.Option(None, "--seeds", metavar="N", help="Runs per cell (as --set seeds=N)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show what would run, then stop."),
    no_resume: bool = typer.Option(False, "--no-resume", help="Start over (the old runs.csv is kept as a backup)."),
    scheduler: str | None = typer.Option(
        None, "--scheduler", metavar="ADDRESS", envvar="DPSGD_SCHEDULER", show_envvar=True,
        help="Run the tasks on a Dask cluster: its scheduler's address (tcp://HOST:PORT) or local:N (a LocalCluster "
             "of N worker processes on this machine); needs the `dask` extra."),
    plugins: list[Path] | None = _PLUGINS,
) -> None:
    """Run every cell of the grid(s), appending each finished run to `DIR/<grid>/runs.csv`.

    Everything is checked before any work (keys, ranges, the columns figures and claims name, runs, steps and
    memory). Resume: runs already in runs.csv (same run id) are skipped, so rerunning the same command after an
    interruption (Ctrl-C, a crash) continues where it stopped; --no-resume starts over. Data: datasets are
    downloaded (sha256-verified) into $DPSGD_DATA_DIR (default ./datasets); set DPSGD_DATA_MIRROR to a URL or
    folder serving `<dataset>/<file>` to fetch from a mirror instead of the canonical URLs."""
    try:
        frame = api.run(grid_file, only=only, out=out, jobs=jobs, dry_run=dry_run, no_resume=no_resume,
                        scheduler=scheduler, set=overrides, seeds=seeds, plugins=plugins or [])
    except KeyboardInterrupt:  # api.run said what is saved
        raise typer.Exit(130) from None
    if frame.attrs.get("failed"):
        raise typer.Exit(1)


# --- audit -----------------------------------------------------------------------------------------
@app.command()
def audit(
    grid_file: Path = typer.Argument(..., metavar="GRID.yaml", help="YAML file with one or more named grids (their "
                                     "`audit:` blocks); with --selected, a results folder."),
    only: list[str] | None = typer.Option(None, "--only", metavar="NAME", help="Audit only this grid (repeatable)."),
    selected: bool = typer.Option(False, "--selected", help="Audit the private configurations `select:` chose in "
                                  "the results folder GRID.yaml names, as they were run (same split, n and δ); "
                                  "audit.csv beside their runs.csv."),
    out: Path = typer.Option(Path("results"), "--out", metavar="DIR",
                             help="Results root; grid G writes DIR/G/audit.csv."),
    trials: int | None = typer.Option(None, "--trials", min=2, metavar="N", help="Trainings with the canary (and "
                                      "as many without); default: the grid's audit.trials, or chosen per cell "
                                      "(--dry-run shows them)."),
    confidence: float | None = typer.Option(None, "--confidence", metavar="P", help="Probability that ε_lo is a "
                                            "lower bound (default: the grid's, 0.95)."),
    overrides: list[str] | None = typer.Option(
        None, "--set", metavar="KEY=VALUE", help="Set a grid key before validation, as `dpsgd run --set` does "
        "(repeatable; e.g. --set epochs=1 --set audit.trials=50)."),
    seeds: int | None = typer.Option(None, "--seeds", metavar="N", help="As --set seeds=N."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show the cells to audit, then stop."),
    plugins: list[Path] | None = _PLUGINS,
) -> None:
    """Train with and without a canary, attack, and bound each cell's ε from below (ε_lo beside the claimed ε)."""
    if dry_run:
        cells = api.audit(grid_file, only=only, out=out, trials=trials, confidence=confidence, set=overrides,
                          seeds=seeds, dry_run=True, selected=selected, plugins=plugins or [])
        for grid, part in cells.groupby("grid", sort=False):
            console.print(settings_table(part, f"{grid}: {len(part)} cells to audit", numbers={
                "canaries": list(part["canaries"]), "trials per world": list(part["trials"]),
                "σ/2 needs": [f"{n:,.0f}" if pd.notna(n) else "—" for n in part["trials_needed"]],
                "controls' trials": list(part["controls_trials"]),
                "est. time": [f"{s:.1f} s" if s < 10 else f"{s:,.0f} s" for s in part["seconds"]]},
                keep=["trials per world", "est. time"],
                notes=["σ/2 needs: the trials per world that refuting the noise × 0.5 control would take (three "
                       "times an optimal attack's); controls' trials: each control's where not the cell's (the black-"
                       "box input canary's after a slash); est. time: the cell's training, estimated"]))
        return
    rows: list[dict] = []
    console.print(f"auditing the configurations select chose in {grid_file}" if selected else
                  f"auditing → {out / '<grid>' / 'audit.csv'}", highlight=False)
    frame = api.audit(grid_file, only=only, out=out, trials=trials, confidence=confidence, set=overrides,
                      seeds=seeds, on_rows=rows.extend, selected=selected, plugins=plugins or [])
    for grid in dict.fromkeys(frame["grid"]):
        console.print(audit_table([r for r in rows if r["grid"] == grid], f"{grid}: audit"))
        path = frame.attrs["paths"][grid]
        console.print(f"wrote {path} and {path.parent / 'figures' / 'audit.png'}", highlight=False)


@app.command()
def check(plugin: Path = typer.Argument(..., metavar="FILE.py", help="A plugin file (docs/algorithms.md).")) -> None:
    """Run the algorithm contract on each algorithm the plugin file defines: a line per check; exit 1 if any fails.

    NumPy = compiled where both apply, fused = alone, the claimed ε = dp-accounting's for its `dp_event`, refusals
    before work, the columns its derived values set, and more (dpsgd_cli/contract.py)."""
    frame = api.check_plugin(plugin)
    for row in frame.itertuples():
        typer.echo(f"{row.status:4}  {row.algorithm}: {row.check}: {row.message}")
    failed = int((frame["status"] == "FAIL").sum())
    typer.echo(f"{len(frame) - failed} of {len(frame)} checks passed or do not apply; {failed} failed")
    if failed:
        raise typer.Exit(1)


THREATS = {"black-box, last iterate": "black box", "white-box, last iterate": "white box",
           "white-box, all iterates": "all iterates"}
VERDICT_STYLES = {"refuted": "red", "consistent": "green"}


def audit_table(rows: list[dict], title: str) -> Any:
    """audit.csv's rows, a row per cell and attack: ε_lo beside the claimed ε and the ceiling, each control's ε_lo
    (✓: refuted), the verdict; under the table each claim's verdict with what it rests on (what a consistent audit
    would have caught, why an uninformative one says nothing)."""
    frame = pd.DataFrame(rows).reindex(columns=["grid", "dataset", "model", "algorithm", "algorithm_params", "canary",
                                                "threat_model", "epsilon_claimed", "delta", "epsilon_lo", "ceiling",
                                                "verdict", "reason", "status", "message", "trials", "confidence",
                                                "family_size", "statistic", "control", "controls_not_applicable",
                                                *(f"{key}_{c}" for key in CONTROL_KEYS
                                                  for c in ("epsilon", "epsilon_lo", "trials"))]
                                       ).fillna({"algorithm_params": "{}", "reason": ""})
    labels = results.varying_label(frame["algorithm"], frame["algorithm_params"])
    shown = []
    for label, r in zip(labels, frame.to_dict("records")):
        verdict = r["verdict"] if isinstance(r["verdict"], str) else "—"
        shown.append({"claim": Text(f"{label}\nε = {_fmt(r['epsilon_claimed'], 3)}"),
                      "attack": Text(f"{r['canary']},\n{THREATS.get(r['threat_model'], r['threat_model'])}"),
                      "ε_lo": _fmt(r["epsilon_lo"], 3), "ceil.": _fmt(r["ceiling"], 3),
                      "controls": Text(_controls_cell(r)),
                      "verdict": Text(verdict, style=VERDICT_STYLES.get(verdict, "")) if r["status"] == "ok"
                      else "n/a" if r["status"] == "not applicable" else r["status"]})
    fixed = summary.fixed_options(frame)
    notes = ["attack: canary, and what the adversary sees (black box: the last model's outputs; white box: its "
             "parameters; all iterates: every step's); ceil.: the ceiling of the trials (no bound above it); "
             "controls: ε_lo of the same audit of the cell's mechanism with "
             "σ calibrated for T/10 steps, noise × 0.5, noise × 0.1 (the twin), without clipping (✓: refuted — the "
             "audit would have caught it)",
             *(["one run: ε_lo is Mahloujifar et al.'s f-DP test with the (ε, δ) curve (valid for any claim); "
                "audit.csv has Steinke et al.'s bound and the μ-GDP curve's (valid for a Gaussian mechanism only) "
                "beside it"]
               if (frame["statistic"] == "one_run").any() else []),
             *([f"options: {'; '.join(fixed)}"] if fixed else [])]
    ok = frame.assign(label=labels)
    ok = ok[(ok["status"] == "ok") & ok["epsilon_lo"].notna() & ok["verdict"].notna()]
    lines = []
    for (label, claim), group in ok.groupby(["label", "epsilon_claimed"], sort=False):
        verdict, best, reason = claims_report.claim_verdict(group)
        lines.append(Text.assemble(f"{label}, ε = {_fmt(claim, 3)}, δ = {_fmt(best['delta'], 2)}: ",
                                   (verdict, VERDICT_STYLES.get(verdict, "")), f" — {reason}"))
    lines += [Text(f"{label}, {r['canary']}, {THREATS.get(r['threat_model'], r['threat_model'])}: {r['status']}: "
                   f"{r['message']}")
              for label, r in zip(labels, frame.to_dict("records")) if r["status"] != "ok"]
    return Group(compact_table(shown, title, keep=["ε_lo", "verdict"], notes=notes, lines=True),
                 *([Text("each claim's verdict:", style="bold"), *lines] if lines else []))


CONTROL_KEYS = ("sigma_t10", "noise_half", "control", "no_clip")  # as the console shows them, mildest first
CONTROL_NAMES = {"sigma_t10": "T/10", "noise_half": "×0.5", "no_clip": "no clip"}


def _controls_cell(row: dict) -> str:
    """`T/10 0`, `×0.5 0.07`, `×0.1 2.83✓ (100 trials)`, `no clip 2.83✓` a line each (✓: refuted; `n/a`: the
    control does not apply to the cell, `controls_not_applicable` says why; its trials where not the row's)."""
    parts = []
    absent = row.get("controls_not_applicable")
    for key in CONTROL_KEYS:
        lo = row.get(f"{key}_epsilon_lo")
        if lo is None or lo != lo:
            if isinstance(absent, str) and key in controls.LABELS and controls.LABELS[key] + ":" in absent:
                parts.append(f"{CONTROL_NAMES[key]} n/a")
            continue
        name = f"×{row['control']:g}" if key == "control" else CONTROL_NAMES[key]
        n = row.get(f"{key}_trials")
        own = f" ({n:,.0f} trials)" if n == n and n is not None and n != row.get("trials") else ""
        parts.append(f"{name} {lo:.3g}" + ("✓" if lo > row["epsilon_claimed"] else "") + own)
    return "\n".join(parts) or "—"


# --- plot ------------------------------------------------------------------------------------------
@app.command()
def plot(
    results_dir: Path = _RESULTS_DIR,
    metric: str | None = typer.Option(
        None, "--metric", metavar="COLUMN", help="Any numeric column of runs.csv (accuracy = test_accuracy, "
        "optimality_gap, val_accuracy, ...) over ε (default: the grid's paper figures, or accuracy)."),
    fmt: ImageFormat = typer.Option(ImageFormat.png, "--format", metavar="png|pdf|svg",
                                    help="Image format (png also writes a PDF)."),
    caption: bool = typer.Option(True, "--caption/--no-caption", help="Draw each caption below its figure, or "
                                 "write it to a .txt beside the figure (for a LaTeX caption)."),
    jobs: int = typer.Option(1, "--jobs", min=1, metavar="N",
                             help="Worker processes drawing the grids; capped at the number of cores."),
    plugins: list[Path] | None = _PLUGINS_READ,
) -> None:
    """Draw the grid's paper figures, or a metric over ε (a panel per dataset and model, a line per algorithm)."""
    paths = api.plot(results_dir, metric=metric, format=fmt.value, caption=caption, jobs=jobs, plugins=plugins or [])
    for path in paths:
        console.print(str(path), highlight=False, markup=False)
    if not paths:  # the notes above say why
        typer.echo(f"error: nothing could be drawn from {results_dir}", err=True)
        raise typer.Exit(1)


class ExportFormat(str, Enum):
    parquet = "parquet"
    csv = "csv"


@app.command()
def export(
    results_dir: Path = _RESULTS_DIR,
    fmt: ExportFormat = typer.Option(ExportFormat.parquet, "--format", metavar="parquet|csv",
                                     help="parquet (needs pyarrow: the `parquet` extra) or csv."),
    plugins: list[Path] | None = _PLUGINS_READ,
) -> None:
    """Write each grid's valid runs (as plot and report read them) as runs.parquet beside runs.csv, and its traces
    as traces.parquet, for pandas, polars or DuckDB (csv: runs_valid.csv, traces_valid.csv)."""
    for path in api.export(results_dir, format=fmt.value, plugins=plugins or []):
        console.print(str(path), highlight=False, markup=False)


# --- report --------------------------------------------------------------------------------------------
@app.command()
def report(
    results_dir: Path = _RESULTS_DIR,
    jobs: int = typer.Option(1, "--jobs", min=1, metavar="N",
                             help="Worker processes checking the grids; capped at the number of cores."),
    plugins: list[Path] | None = _PLUGINS_READ,
) -> None:
    """Check the papers' claims listed in the grids against the results; print PASS/FAIL and write report.md and
    report.html (the same with its figures embedded: one file to open in a browser or send)."""
    verdicts = api.report(results_dir, jobs=jobs, plugins=plugins or [])
    path = verdicts.attrs["path"]
    colours = {"PASS": "green", "FAIL": "red", "VACUOUS": "blue", "NO DATA": "yellow"}
    if len(verdicts):  # one line a claim, a block per grid: its quote, reading and numbers are in report.md
        width = max(len(str(c)) for c in verdicts["claim"])
        for grid, part in verdicts.groupby("grid", sort=False):
            console.print(Text(f"{grid}: claims (details in report.md)", style="bold"))
            for _, v in part.iterrows():  # Text: a grid's strings are shown, never read as markup
                says = v["numbers"] if v["verdict"] == "NO DATA" else ("(own) " if v["own"] else "") + v["text"]
                line = Text.assemble((f"{v['verdict']:<8}", colours[v["verdict"]]), f"{v['claim']:<{width}}  ",
                                     says)  # NO DATA: why, the reader's next step
                line.truncate(console.width, overflow="ellipsis")
                console.print(line, no_wrap=True)
    _print_audit_verdicts(results_dir)
    written = f"{path} and {path.with_suffix('.html')}"
    if not len(verdicts):
        console.print(f"nothing to check: no grid under {results_dir} lists claims; wrote {written}",
                      highlight=False, markup=False)
        return
    console.print(verdicts.attrs["summary"], highlight=False, markup=False)
    for file in (path, path.with_suffix(".html")):  # a path on a line of its own: never broken
        console.print(f"wrote {file}", highlight=False, markup=False, no_wrap=True, crop=False)
    if not verdicts["verdict"].isin(["PASS", "FAIL", "VACUOUS"]).any():  # each NO DATA row says why; a VACUOUS
        # claim was checked: its data carry no evidence either way, which the report says
        typer.echo(f"error: no claim could be checked against the results in {results_dir}", err=True)
        raise typer.Exit(1)


# --- select --------------------------------------------------------------------------------------------
def _group_columns(group: str) -> dict[str, str]:
    """A selection's group, `dataset=adult, model=logreg, …`, as columns; a value holding ", " (a received
    runs.csv may name a dataset anything) stays whole."""
    columns: dict[str, str] = {}
    for item in group.split(", "):
        name, equals, value = item.partition("=")
        if equals and name.isidentifier():
            columns[name] = value
        elif columns:
            last = next(reversed(columns))
            columns[last] += ", " + item
    return columns


@app.command("select")
def select_command(
    results_dir: Path = _RESULTS_DIR,
    plugins: list[Path] | None = _PLUGINS_READ,
) -> None:
    """Print the hyperparameters each group's `select:` chose (and its privacy); write selection.csv."""
    api.load_plugins(plugins or [])
    for folder, table in engine_selection.write_selection_tables(results_dir):
        for selection, part in table.groupby("selection", sort=False):
            rows = [{**_group_columns(r["group"]), "chosen": r["chosen"],
                     r["score"]: f"{r['score_mean']:.4f}", "runs": str(r["runs"]),
                     "test accuracy": spread(r["test_accuracy_mean"], r["test_accuracy_std"]),
                     "ε": _fmt(r["epsilon"]), "ε total": _fmt(r["epsilon_total"], 4), "δ": _fmt(r["delta"], 3),
                     "privacy": _privacy(r)} for _, r in part.iterrows()]
            console.print(compact_table(
                [{k: v for k, v in row.items() if k != "ε" or "epsilon" not in row} for row in rows],
                f"{folder.name}: {selection} → {folder / 'selection.csv'}", keep=["chosen", "test accuracy"],
                sparse=("ε", "ε total", "δ", "privacy")))


def _privacy(row) -> str:
    """selection.csv's privacy, short: a private search's kind (its (ε, δ) are columns of their own), nothing
    for a non-private algorithm's group."""
    if row["privacy"].startswith("n/a"):
        return _fmt(None)
    return row["privacy"] if row["epsilon_total"] != row["epsilon_total"] else row["privacy"].split(": ")[0]


def _print_audit_verdicts(results_dir: Path) -> None:
    found = pd.DataFrame([v for frame in claims_report.audit_frames(results_dir)
                          for v in claims_report.audit_verdicts(frame)])
    if found.empty:
        return
    labels = results.varying_label(found["algorithm"], found["algorithm_params"])
    fixed = summary.fixed_options(found)
    console.print(compact_table([{
        "grid": v["grid"], "dataset": v["dataset"], "model": v["model"], "algorithm": label,
        "ε claimed": _fmt(v["epsilon_claimed"], 3), "audit": Text(v["verdict"], VERDICT_STYLES.get(v["verdict"], "")),
        "numbers": v["numbers"]} for label, v in zip(labels, found.to_dict("records"))],
        "privacy audit (dpsgd audit)", keep=["audit"], lines=True,
        notes=[f"options: {'; '.join(fixed)}"] if fixed else []))


# --- datasets --------------------------------------------------------------------------------------
@datasets_app.command("list")
def datasets_list() -> None:
    """What is known, whether it is cached, sizes and sources."""
    console.print(compact_table([{
        "name": info["name"], "records": f"{info['records']:,}" if info.get("records") else "", "cached":
        info["cache_state"], "size": _size(info.get("size_bytes", 0)), "source": _host(str(info.get("source", ""))),
        "licence": str(info.get("license", ""))} for info in data.list_datasets()], "datasets",
        keep=["name", "source"], notes=["source: the host; the full address with `dpsgd datasets info NAME`"]))


def _host(source: str) -> str:
    """An address's host (a URL is never broken across lines in a table); other text as it is."""
    return urlsplit(source).netloc or source


@datasets_app.command("fetch")
def datasets_fetch(names: list[str] = typer.Argument(..., metavar="NAME...",
                                                    help="Dataset names (see `dpsgd datasets list`).")) -> None:
    """Download and verify (sha256) the files of each dataset into the cache."""
    for name in names:
        for path in data.fetch(name):
            console.print(f"{name}: {path}")


@datasets_app.command("info")
def datasets_info(
    name: str | None = typer.Argument(None, metavar="NAME",
                                      help="Dataset name (or --path FILE for a file of your own)."),
    path: Path | None = typer.Option(None, "--path", metavar="FILE",
                                     help="Preview what `{name: file, path: FILE}` loads."),
    label: str | None = typer.Option(None, "--label", metavar="COLUMN", help="File: the label column."),
    positive: str | None = typer.Option(None, "--positive", metavar="VALUE",
                                        help="File: the label value of class +1."),
    drop: list[str] | None = typer.Option(None, "--drop", metavar="COLUMN",
                                          help="File: a column not used (repeatable)."),
    categorical: list[str] | None = typer.Option(None, "--categorical", metavar="COLUMN",
                                                 help="File: a one-hot column (repeatable)."),
    test_path: Path | None = typer.Option(None, "--test-path", metavar="FILE", help="File: the test file."),
    missing: str | None = typer.Option(None, "--missing", metavar="drop|impute",
                                       help="File: drop or impute rows with missing values."),
    options: list[str] | None = typer.Option(None, "--set", metavar="KEY=VALUE",
                                             help="File: any other option KEY=VALUE (YAML value)."),
) -> None:
    """Everything known about one dataset: files, checksums, source, licence, default options; with --path,
    what a file dataset's loader produces (rows read and dropped, features after encoding, label balance)."""
    if path is not None:
        info = _file_info(path, label=label, positive=positive, drop=drop, categorical=categorical,
                          test_path=test_path, missing=missing, options=options)
    elif name is None or name == "file":
        raise UserError("datasets info: give a dataset name, or --path FILE [--label COLUMN ...] for a file")
    else:
        return _print_dataset_info(name)
    for key, value in info.items():
        if value is not None:
            console.print(f"[bold]{key}[/]: {escape(_plain(value))}")


def _plain(value: Any) -> str:
    """A value as a reader writes it: a list as its items, a mapping as key=value, no Python repr."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={_plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(v) for v in value) or "none"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _file_info(path: Path, **given: Any) -> dict[str, Any]:
    """`datasets info --path`: the file spec from the options, loaded, described."""
    raw: dict[str, Any] = {"path": str(path)}
    for item in given.pop("options") or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--set {item}: expected KEY=VALUE (e.g. --set standardize=false)")
        try:
            raw[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise UserError(f"--set {item}: the value is not valid YAML ({problem}); quote it (--set "
                            f"'{key.strip()}=\"...\"') or fix it") from None
    raw.update({k: (str(v) if isinstance(v, Path) else v) for k, v in given.items() if v not in (None, [])})
    return data_files.file_dataset_info(data_files.file_spec(raw))


def _print_dataset_info(name: str) -> None:
    """A built-in dataset: files, checksums, source, licence, default options."""
    info = data.dataset_info(name)
    console.print(f"[bold]{escape(info['name'])}[/]: {escape(info['description'])}")
    detail = ", ".join(f"{k} {v:,}" for k, v in info["records_detail"].items() if k != "total")
    fields = [
        ("records", f"{info['records']:,}" + (f" ({detail})" if detail else "")),
        ("source", info["source"]), ("licence", info["license"]), ("reference", info["reference"]),
        ("notes", info["notes"]),
        ("cache", f"{info['cache_dir']} (cached: {info['cache_state']}, {_size(info['size_bytes'])})"),
        ("mirror", info["mirror"] or f"none (set {'DPSGD_DATA_MIRROR'} to fetch from one)"),
        ("defaults", ", ".join(f"{k}={v}" for k, v in info["defaults"].items() if v is not None)),
    ]
    table = Table(show_header=False, box=None, pad_edge=False)
    for key, value in fields:
        if value:
            table.add_row(f"[bold]{key}[/]", escape(str(value)))
    console.print(table)
    for f in info["file_details"]:
        console.print(f"[bold]file {escape(f['name'])}[/]: {escape(f['description'])}; {_size(f['size'])}, "
                      f"{f['records']:,} records; cached {'yes' if f['cached'] else 'no'}, verified "
                      f"{'yes' if f['verified'] else 'no'}", soft_wrap=True)
        console.print(f"  sha256 {f['sha256']}\n  url    {f['fetch_url']}\n  path   {f['path']}",
                      soft_wrap=True, markup=False, highlight=False)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# --- privacy calculators ---------------------------------------------------------------------------
_SIGMA_HELP = "Noise multiplier σ (noise std / clipping norm), in [1e-3, 1e6]; the PLD accountant needs σ ≥ 0.05."
_Q_HELP = "Poisson sampling rate q = B/n (each record joins a step with probability q), in (0, 1]."
_STEPS_HELP = "Number of steps T (≥ 1; at most 1e6 with the PLD accountant, 1e12 with RDP)."
_DELTA_HELP = "δ of the (ε, δ)-DP guarantee, in (0, 1); choose δ ≪ 1/n (e.g. 1/n², n = training records)."
_ACCOUNTANT_CHOICES = "|".join(ACCOUNTANTS)
_ACCOUNTANT_HELP = ("How ε is computed over the T steps (both dp-accounting, both valid upper bounds): rdp = Rényi "
                    "DP converted to (ε, δ) (fast, slightly looser); pld = privacy loss distributions "
                    "(tighter, slower).")
_NEIGHBOURS_HELP = ("The neighbouring relation ε holds under: add_remove (one record added or removed) or "
                    "replace_one (one record replaced; needs --accountant pld).")
_SAMPLE_RATE = typer.Option(..., "--sample-rate", metavar="Q", help=_Q_HELP)
_STEPS = typer.Option(..., "--steps", metavar="T", help=_STEPS_HELP)
_DELTA = typer.Option(..., "--delta", metavar="D", help=_DELTA_HELP)
_ACCOUNTANT = typer.Option("rdp", "--accountant", metavar=_ACCOUNTANT_CHOICES, help=_ACCOUNTANT_HELP)
_NEIGHBOURS = typer.Option(Neighbours.add_remove, "--neighbours", metavar="add_remove|replace_one",
                           help=_NEIGHBOURS_HELP)


@app.command()
def epsilon(
    sigma: float = typer.Option(..., "--sigma", metavar="S", help=_SIGMA_HELP),
    sample_rate: float = _SAMPLE_RATE,
    steps: int = _STEPS,
    delta: float = _DELTA,
    accountant: AccountantName = _ACCOUNTANT,
    neighbours: Neighbours = _NEIGHBOURS,
) -> None:
    """ε of DP-SGD (Poisson-subsampled Gaussian, T steps) at the given δ."""
    eps = api.epsilon(sigma=sigma, sample_rate=sample_rate, steps=steps, delta=delta, accountant=accountant,
                      neighbours=neighbours.value)
    console.print(f"ε = {eps:.6g}  (σ = {sigma:g}, q = {sample_rate:g}, T = {steps}, δ = {delta:g}, "
                  f"{accountant} accountant, {neighbours.value} neighbours)")


@app.command()
def sigma(
    epsilon: list[float] = typer.Option(..., "--epsilon", metavar="E",
                                        help="Target ε (> 0); repeat it for an ε axis (one accountant curve)."),
    sample_rate: float = _SAMPLE_RATE,
    steps: int = _STEPS,
    delta: float = _DELTA,
    accountant: AccountantName = _ACCOUNTANT,
    neighbours: Neighbours = _NEIGHBOURS,
) -> None:
    """The smallest noise multiplier σ giving ε ≤ target (within 0.1%) for DP-SGD."""
    calibrations = api.calibrations(epsilon=epsilon, sample_rate=sample_rate, steps=steps, delta=delta,
                                    accountant=accountant, neighbours=neighbours.value)
    for target, cal in zip(epsilon, calibrations):
        console.print(f"σ = {cal.sigma:.6g}  (achieved ε = {cal.epsilon:.6g} ≤ {target:g}, q = {sample_rate:g}, "
                      f"T = {steps}, δ = {delta:g}, {cal.accountant} accountant, {cal.neighbours} neighbours, "
                      f"{cal.library})")


def _curve_help(field: str, text: str) -> str:
    return f"{text}, {bounds(PrivacyCurveParams, field)}."


@app.command("privacy-curve")
def privacy_curve(
    alpha: float = typer.Option(30.0, "--alpha", metavar="A", help=_curve_help("alpha", "Rényi order α")),
    sigma: float = typer.Option(0.02, "--sigma", metavar="S",
                                help=_curve_help("sigma", "Noise σ of the update's √(2ησ²) N(0, I)")),
    sensitivity: float = typer.Option(4.0, "--sensitivity", metavar="S_G",
                                      help=_curve_help("sensitivity", "Gradient sensitivity S_g")),
    eta: float = typer.Option(0.02, "--eta", metavar="ETA", help=_curve_help("eta", "Step size η")),
    lam: float = typer.Option(1.0, "--lam", metavar="LAMBDA", help=_curve_help(
        "lam", "Strong convexity λ (the lower bound is drawn only for λ = 1, the squared loss ‖θ − x‖²/2 it is "
               "exact for)")),
    n: int = typer.Option(5000, "--n", metavar="N", help=_curve_help("n", "Number of records n")),
    k_max: int = typer.Option(1000, "--k-max", metavar="K", help=_curve_help("k_max", "Largest number of steps K")),
    points: int = typer.Option(200, "--points", metavar="P", help=_curve_help("points", "Number of K values")),
    log_x: bool = typer.Option(False, "--log-x/--no-log-x", help="Logarithmic K axis."),
    log_y: bool = typer.Option(False, "--log-y/--no-log-y", help="Logarithmic ε axis."),
    out: str = typer.Option("results/privacy_curve", "--out", metavar="DIR", help="Folder for the figure and CSV."),
    fmt: ImageFormat = typer.Option(ImageFormat.png, "--format", metavar="png|pdf|svg", help="Image format."),
) -> None:
    """Rényi privacy of noisy GD over K steps: the dynamics bound vs composition, and the squared-loss lower
    bound (Chourasia, Ye, Shokri, NeurIPS 2021); defaults are the parameters of their talk."""
    p = _curve_params(alpha=alpha, sigma=sigma, sensitivity=sensitivity, eta=eta, lam=lam, n=n, k_max=k_max,
                      points=points, log_x=log_x)
    folder = checks.out_root(out)
    frame = dynamics.privacy_curve(curve_plot.k_values(p.k_max, p.points, log=p.log_x),
                                   **p.model_dump(exclude={"k_max", "points", "log_x"}))
    engine_folder.make_folder(folder)
    engine_folder.write_csv(frame, folder / "privacy_curve.csv")
    figure = curve_plot.plot_privacy_curve(frame, folder / f"privacy_curve.{fmt.value}", log_x=log_x, log_y=log_y)
    saturation = alpha * sensitivity**2 / (lam * sigma**2 * n**2)
    console.print(f"dynamics bound saturates at ε(α={alpha:g}) = {saturation:.6g}; it is below the composition "
                  f"bound for K > {2 * dynamics.SATURATION_ROOT / (lam * eta):.1f}")
    if "lower_bound_note" in frame.attrs:
        console.print(f"note: {frame.attrs['lower_bound_note']} (use --lam 1)")
    console.print(str(folder / "privacy_curve.csv"))
    console.print(str(figure))


def _curve_params(**values: Any):
    """The privacy-curve parameters, checked by the same model (and bounds) as a grid's privacy_curve figure."""
    try:
        return PrivacyCurveParams(**values)
    except ValidationError as exc:
        field = str(exc.errors()[0]["loc"][0])
        raise UserError(f"--{field.replace('_', '-')} = {values[field]!r} must be "
                        f"{bounds(PrivacyCurveParams, field)}") from None


def main() -> None:
    """Entry point: a user error is one line on stderr and exit code 2, never a traceback."""
    try:
        with file_errors():  # a file no command could read or write: one line too
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


class _UsageError(Protocol):
    ctx: Any

    def format_message(self) -> str: ...


def _is_usage_error(exc: Exception) -> TypeGuard[_UsageError]:
    """Click's usage errors (bad option, missing argument, ...), whether typer vendors click or not."""
    return hasattr(exc, "format_message") and getattr(exc, "exit_code", None) == 2
