"""Figures from a grid's results: the paper figures its `figures:` list describes, or a metric over ε.

A sweep figure is a grid of panels (rows × cols, from result columns), a line per `lines` value with a
±1 std band over seeds, and the runs without the x value (the non-private references for x = ε) dashed.
"""

from __future__ import annotations

import difflib
import textwrap
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
# titles, labels and legends come from grid files and results: a `$` in them is a dollar sign, not mathtext
# (an unbalanced or invalid `$...$` would make savefig raise)
matplotlib.rcParams["text.parse_math"] = False
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

from dpsgd_cli.config import FigureSpec  # noqa: E402
from dpsgd_cli.engine.analytic import analytic_table  # noqa: E402
from dpsgd_cli.engine.results import note, read_manifest  # noqa: E402
from dpsgd_cli.engine.summary import read_results, results_frame, select  # noqa: E402
from dpsgd_cli.errors import UserError  # noqa: E402

METRICS = {
    "accuracy": ("test_accuracy", "test accuracy"),
    "test_accuracy": ("test_accuracy", "test accuracy"),
    "train_accuracy": ("train_accuracy", "train accuracy"),
    "optimality_gap": ("optimality_gap", "optimality gap F(θ) − L*"),
    "test_loss": ("test_loss", "test loss (mean logistic loss)"),
    "train_objective": ("train_objective", "train objective F(θ)"),
}
AXIS_LABELS = {"epsilon": "privacy budget ε", "batch_size": "batch size b", "examples": "examples processed",
               "lr": "learning rate", "epochs": "epochs"}
REFERENCE_STYLES = [("black", "--"), ("dimgray", ":"), ("gray", "-."), ("darkgray", (0, (5, 2, 1, 2)))]


def result_folders(path: Path) -> list[Path]:
    """`path` itself if it holds runs.csv, else its sub-folders that do."""
    path = Path(path)
    if (path / "runs.csv").exists():
        return [path]
    folders = sorted(p.parent for p in path.glob("*/runs.csv"))
    if not folders:
        raise UserError(f"{path}: no runs.csv here or in its sub-folders; run `dpsgd run GRID.yaml` first "
                        f"or pass a grid's results folder (e.g. results/smoke)")
    return folders


def grid_of(folder: Path) -> dict:
    """The grid as recorded in the folder's manifest (its figures and claims included)."""
    manifest = read_manifest(folder)
    return manifest.get("grid", {}) if manifest else {}


def plot_results(path: Path, metric: Optional[str] = None, fmt: str = "png") -> list[Path]:
    """The grid's paper figures (when it lists some and no metric is asked for), else `metric` over ε."""
    if metric is not None and metric not in METRICS:
        match = difflib.get_close_matches(metric, METRICS, n=1)
        hint = f" (did you mean '{match[0]}'?)" if match else ""
        raise UserError(f"--metric {metric}: unknown metric{hint}; choose one of {', '.join(METRICS)}")
    paths: list[Path] = []
    for folder in result_folders(path):
        for line in read_results(folder).notes():
            note(line)
        figures = [FigureSpec(**f) for f in grid_of(folder).get("figures", [])] if metric is None else []
        if not figures:
            column = METRICS[metric or "accuracy"][0]
            figures = [FigureSpec(name=metric or "accuracy", metric=column, rows="model", cols="dataset",
                                  log_y=column == "optimality_gap")]
        paths += [p for spec in figures for p in draw_figure(folder, spec, fmt)]
    return paths


def draw_figure(folder: Path, spec: FigureSpec, fmt: str) -> list[Path]:
    """Draw one figure; saved as `fmt` (and also PDF when fmt is png, for papers)."""
    if spec.kind == "privacy_curve":
        from dpsgd_cli.plots.privacy_curve import plot_privacy_curve

        table = analytic_table(folder, spec).pivot(index="K", columns="bound", values="rdp_epsilon").reset_index()
        table.attrs.update({k: v for k, v in spec.params.items() if k not in ("k_max", "points", "log_x")})
        paths = [plot_privacy_curve(table, folder / "figures" / f"{spec.name}.{fmt}", log_x=False)]
        if fmt == "png":
            paths.append(plot_privacy_curve(table, folder / "figures" / f"{spec.name}.pdf"))
        return paths
    frame = _frame_for(folder, spec)
    if frame.empty:
        note(f"{folder}: figure {spec.name!r} not drawn: {_why_empty(folder, spec)}")
        return []
    if spec.kind == "noise_scale":
        fig = _noise_scale_figure(frame, spec)
    else:
        fig = _panel_figure(frame, spec)
    caption = "\n".join(textwrap.fill(line, int(fig.get_figwidth() * 15)) for line in _caption(folder, frame).split("\n"))
    fig.text(0.01, 0.005, caption, fontsize=8, ha="left", va="bottom")
    bottom = max(0.04, min(0.35, (caption.count("\n") + 1) * 0.15 / fig.get_figheight()))  # ~0.15 in per line
    fig.tight_layout(rect=(0, bottom, 1, 0.93 if spec.title else 1))
    out = folder / "figures" / f"{spec.name}.{fmt}"
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out]
    fig.savefig(out, dpi=150)
    if fmt == "png":
        fig.savefig(out.with_suffix(".pdf"))
        paths.append(out.with_suffix(".pdf"))
    plt.close(fig)
    return paths


def _frame_for(folder: Path, spec: FigureSpec) -> pd.DataFrame:
    if spec.kind == "noise_scale":
        return analytic_table(folder, spec)
    runs = results_frame(folder, traces=spec.kind == "traces")
    try:
        return select(runs, spec.where) if len(runs) else runs
    except KeyError as exc:
        raise UserError(f"{folder}: figure {spec.name!r}: `where` {str(exc).strip(chr(34) + chr(39))}") from None


def _why_empty(folder: Path, spec: FigureSpec) -> str:
    if spec.kind == "noise_scale":
        return "its analytic table is empty"
    reason = read_results(folder).why_empty()
    if reason:
        return reason
    if spec.kind == "traces":
        return "no checkpoint in traces.csv matches its runs (set `trace_every` in the grid and rerun)"
    return f"no ok run matches its `where: {spec.where}`" if spec.where else "no ok run to draw"


def _panel_figure(frame: pd.DataFrame, spec: FigureSpec):
    rows = _levels(frame, spec.rows)
    cols = _levels(frame, spec.cols)
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.6 * len(cols), 3.6 * len(rows) + 0.6),
                             squeeze=False)
    ylabel = next((label for column, label in METRICS.values() if column == spec.metric), spec.metric)
    x = "examples" if spec.kind == "traces" else spec.x
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            ax = axes[i][j]
            panel = frame
            for column, value in ((spec.rows, row), (spec.cols, col)):
                if column:  # runs without this column's value (e.g. erm has no lr) are references in every panel
                    panel = panel[(panel[column] == value) | panel[column].isna()]
            _draw_panel(ax, panel, x, spec)
            title = " · ".join(f"{v}" if name in ("dataset", "model") else f"{name} = {_num(v)}"
                               for name, v in ((spec.rows, row), (spec.cols, col)) if name)
            ax.set_title(title)
            ax.set_xlabel(AXIS_LABELS.get(x, x))
            ax.set_ylabel(ylabel)
    if spec.title:
        fig.suptitle(textwrap.fill(spec.title, 90 if fig.get_figwidth() > 8 else 55))
    return fig


def _num(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _levels(frame: pd.DataFrame, column: Optional[str]) -> list:
    if not column:
        return [None]
    values = list(frame[column].dropna().unique())
    numeric = all(isinstance(v, (int, float)) for v in values)
    return sorted(values) if numeric else sorted(values, key=str)


def _line_key(frame: pd.DataFrame, spec: FigureSpec) -> pd.Series:
    key = frame[spec.lines[0]].astype(str)
    for column in spec.lines[1:]:
        key = key + f" {column}=" + frame[column].astype(str)
    return key


def _draw_panel(ax, panel: pd.DataFrame, x: str, spec: FigureSpec) -> None:
    if panel.empty:
        ax.set_visible(False)
        return
    panel = panel.assign(_line=_line_key(panel, spec))
    curves, reference = panel[panel[x].notna()], panel[panel[x].isna()]
    for label, line in curves.groupby("_line", sort=True):
        stats = line.groupby(x)[spec.metric].agg(["mean", "std"]).fillna(0.0)
        if spec.log_y:
            stats = stats[stats["mean"] > 0]
        (drawn,) = ax.plot(stats.index, stats["mean"], marker="o" if len(stats) < 30 else None, ms=3.5, label=label)
        ax.fill_between(stats.index, stats["mean"] - stats["std"], stats["mean"] + stats["std"],
                        color=drawn.get_color(), alpha=0.2, lw=0)
    styles = iter(REFERENCE_STYLES * max(1, len(reference)))
    for label, ref in reference.groupby("_line", sort=True):
        mean, std = ref[spec.metric].mean(), ref[spec.metric].std() if len(ref) > 1 else 0.0
        color, dashes = next(styles)
        if spec.log_y and mean <= 1e-9:  # numerically zero (erm's own optimality gap): no place on a log axis
            continue
        kind = "non-private" if x == "epsilon" else f"no {x}"  # references: the runs without the x value
        ax.axhline(mean, ls=dashes, lw=1.2, color=color, label=f"{label} ({kind})")
        if std > 0:
            ax.axhspan(mean - std, mean + std, color=color, alpha=0.08, lw=0)
    if spec.log_x:
        ax.set_xscale("log")
        values = sorted(curves[x].unique())
        if 0 < len(values) <= 12:  # label the swept values themselves, not powers of ten
            ax.set_xticks(values, [_num(v) for v in values])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if spec.log_y:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7)


def _noise_scale_figure(table: pd.DataFrame, spec: FigureSpec):
    """σ of bassily2014 under each accounting: over T (n and δ = 1/n² fixed) and over n (T and δ fixed).
    Points whose accounting is not proved there (per-step ε₀ beyond what its lemmas need) are hollow."""
    from matplotlib.lines import Line2D

    proved = table["proved"].astype(bool) if "proved" in table else pd.Series(True, index=table.index)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), squeeze=False)
    for ax, (panel, x, xlabel) in zip(axes[0], [("T", "steps", "steps T"), ("n", "n", "records n")]):
        part = table[table["panel"] == panel]
        for label, line in part.groupby("accounting", sort=False):
            (drawn,) = ax.plot(line[x], line["sigma"], lw=1.2, label=label)
            ok = proved[line.index]
            ax.plot(line[x][ok], line["sigma"][ok], "o", ms=4, color=drawn.get_color())
            ax.plot(line[x][~ok], line["sigma"][~ok], "o", ms=5, mfc="none", color=drawn.get_color())
        handles, _ = ax.get_legend_handles_labels()
        if (~proved[part.index]).any():
            handles.append(Line2D([], [], ls="none", marker="o", mfc="none", color="0.3",
                                  label="hollow: not proved (per-step ε₀ beyond its lemmas, or ε not certified)"))
        if not len(part):
            fixed = ""
        elif panel == "T":
            fixed = f"n = {part['n'].iloc[0]:,}, δ = 1/n²"
        else:
            fixed = f"T = {part['steps'].iloc[0]:,}, δ = {part['delta'].iloc[0]:.2g}" if "delta" in part else \
                f"T = {part['steps'].iloc[0]:,}"
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="noise σ (per-step, on ∇ℓ)",
               title=f"σ over {xlabel.split()[-1]} ({fixed}, ε = {table['epsilon'].iloc[0]:g})")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(handles=handles, fontsize=7)
    if spec.title:
        fig.suptitle(textwrap.fill(spec.title, 90 if fig.get_figwidth() > 8 else 55))
    return fig


def _caption(folder: Path, frame: pd.DataFrame) -> str:
    grid = grid_of(folder)
    seeds = grid.get("seeds", frame["seed"].nunique() if "seed" in frame else "?")
    delta = grid.get("delta", "")
    delta = "1/n² (n = training records)" if delta == "1/n^2" else delta
    from dpsgd_cli.engine.selection import caption_of

    return f"grid {folder.name}; mean ± 1 std over {seeds} seeds; δ = {delta}" + caption_of(grid)
