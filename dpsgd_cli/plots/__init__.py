"""Figures from runs.csv: a metric over ε, a panel per (dataset, model), a line per private algorithm."""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from dpsgd_cli.engine.results import ResultStore  # noqa: E402
from dpsgd_cli.engine.summary import algorithm_label  # noqa: E402
from dpsgd_cli.errors import UserError  # noqa: E402

METRICS = {
    "accuracy": ("test_accuracy", "test accuracy", False),
    "test_accuracy": ("test_accuracy", "test accuracy", False),
    "train_accuracy": ("train_accuracy", "train accuracy", False),
    "optimality_gap": ("optimality_gap", "optimality gap F(θ) − L*", True),
    "test_loss": ("test_loss", "test loss (mean logistic loss)", False),
    "train_objective": ("train_objective", "train objective F(θ)", False),
}
HYPER = ["batch_size", "lr", "epochs", "l2", "clip_norm"]
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


def plot_results(path: Path, metric: str = "accuracy", fmt: str = "png") -> list[Path]:
    if metric not in METRICS:
        match = difflib.get_close_matches(metric, METRICS, n=1)
        hint = f" (did you mean '{match[0]}'?)" if match else ""
        raise UserError(f"--metric {metric}: unknown metric{hint}; choose one of {', '.join(METRICS)}")
    return [p for folder in result_folders(path) for p in [plot_folder(folder, metric, fmt)] if p is not None]


def plot_folder(folder: Path, metric: str, fmt: str) -> Path | None:
    column, ylabel, log_y = METRICS[metric]
    frame = ResultStore(folder).read()
    frame = frame[frame["status"] == "ok"]
    if frame.empty:
        return None
    frame = frame.assign(label=_line_labels(frame))
    panels = list(frame.groupby(["dataset", "model"], sort=True))
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows + 0.5), squeeze=False)
    for ax, ((dataset, model), panel) in zip(axes.flat, panels):
        _draw_panel(ax, panel, column, log_y)
        ax.set_title(f"{dataset} · {model}")
        ax.set_xlabel("privacy budget ε")
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.text(0.01, 0.005, _caption(folder, frame), fontsize=8, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    out = folder / "figures" / f"{metric}.{fmt}"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def _line_labels(frame: pd.DataFrame) -> pd.Series:
    """Algorithm label, plus the hyperparameters that vary among that algorithm's runs."""
    labels = algorithm_label(frame)
    extra = pd.Series("", index=frame.index)
    for col in HYPER:
        varying = frame.groupby(labels)[col].transform(lambda s: s.nunique(dropna=True) > 1)
        extra += frame[col].map(lambda v, c=col: f" {c}={v:g}" if v == v else "").where(varying, "")
    return labels + extra


def _draw_panel(ax, panel: pd.DataFrame, column: str, log_y: bool) -> None:
    private = panel[panel["epsilon"].notna()]
    reference = panel[panel["epsilon"].isna()]
    for label, line in private.groupby("label", sort=True):
        stats = line.groupby("epsilon")[column].agg(["mean", "std"]).fillna(0.0)
        if log_y:
            stats = stats[stats["mean"] > 0]
        (drawn,) = ax.plot(stats.index, stats["mean"], marker="o", ms=3.5, label=label)
        ax.fill_between(stats.index, stats["mean"] - stats["std"], stats["mean"] + stats["std"],
                        color=drawn.get_color(), alpha=0.2, lw=0)
    styles = iter(REFERENCE_STYLES * len(reference))
    for label, ref in reference.groupby("label", sort=True):
        mean, std = ref[column].mean(), ref[column].std() if len(ref) > 1 else 0.0
        color, dashes = next(styles)
        if log_y and mean <= 0:
            continue
        ax.axhline(mean, ls=dashes, lw=1.2, color=color, label=f"{label} (non-private)")
        if std > 0:
            ax.axhspan(mean - std, mean + std, color=color, alpha=0.08, lw=0)
    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7)


def _caption(folder: Path, frame: pd.DataFrame) -> str:
    manifest = folder / "manifest.json"
    grid = json.loads(manifest.read_text()).get("grid", {}) if manifest.exists() else {}
    seeds = grid.get("seeds", frame["seed"].nunique())
    delta = grid.get("delta", ", ".join(f"{d:.3g}" for d in sorted(frame["delta"].unique())))
    delta = "1/n² (n = training records)" if delta == "1/n^2" else delta
    return f"grid {folder.name}; mean ± 1 std over {seeds} seeds; δ = {delta}"
