"""Figures from a grid's results: the paper figures its `figures:` list describes, or a metric over ε. A sweep
is a grid of panels (rows × cols), a line per `lines` value with a ±1 std band over seeds, references dashed."""

from __future__ import annotations

import functools
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

from dpsgd_cli.config import FigureSpec  # noqa: E402
from dpsgd_cli.engine.analytic import analytic_table  # noqa: E402
from dpsgd_cli.engine.folder import save_figure, write_text  # noqa: E402
from dpsgd_cli.engine.results import grid_of, note, read_results, result_folders, results_size, select  # noqa: E402
from dpsgd_cli.engine.selection import caption_of, results_frame  # noqa: E402
from dpsgd_cli.engine.workers import map_in_workers  # noqa: E402
from dpsgd_cli.errors import UserError  # noqa: E402
from dpsgd_cli.plots import names  # noqa: E402
from dpsgd_cli.plots.layout import Styles, caption_text, finish  # noqa: E402

METRICS = {"accuracy": "test_accuracy", "test_accuracy": "test_accuracy", "train_accuracy": "train_accuracy",
           "optimality_gap": "optimality_gap", "test_loss": "test_loss", "train_objective": "train_objective"}
DPI = 150
MAX_BANDS = 3  # std bands a panel shades; beyond, error bars (more blend into one colour)


def plot_results(path: Path, metric: str | None = None, fmt: str = "png", caption: bool = True,
                 jobs: int = 1) -> list[Path]:
    """The grid's paper figures (when it lists some and no metric is asked for), else `metric` over ε; without
    `caption`, each caption goes to a .txt beside its figure (for a LaTeX caption) instead of into the image. With
    `jobs` > 1, the folders under `path` are drawn in that many worker processes (forked: matplotlib and the
    package already imported), the largest first."""
    folders = result_folders(path)
    drawn = map_in_workers(functools.partial(_plot_folder, metric=metric, fmt=fmt, caption=caption), folders, jobs,
                           cost=results_size)
    return [p for paths in drawn for p in paths]


def _plot_folder(folder: Path, metric: str | None, fmt: str, caption: bool) -> list[Path]:
    for line in read_results(folder).notes():
        note(line)
    figures = [FigureSpec(**f) for f in grid_of(folder).get("figures", [])] if metric is None else []
    if not figures:
        column = METRICS.get(metric or "accuracy", metric)
        figures = [FigureSpec(name=metric or "accuracy", metric=column, rows="model", cols="dataset",
                              log_y=column == "optimality_gap")]
    return [p for spec in figures for p in draw_figure(folder, spec, fmt, caption)]


def draw_figure(folder: Path, spec: FigureSpec, fmt: str, caption: bool = True) -> list[Path]:
    """Draw one figure; saved as `fmt` (and also PDF when fmt is png, for papers); without `caption`, the caption
    is written to <figure>.txt instead of drawn."""
    if spec.kind == "privacy_curve":
        from dpsgd_cli.plots.privacy_curve import plot_privacy_curve

        table = analytic_table(folder, spec)
        if _drawn_column(spec) not in table or table[_drawn_column(spec)].isna().all():
            note(f"{folder}: figure {spec.name!r} not drawn: {_why_empty(folder, spec, table)}")
            return []
        table = table.pivot(index="K", columns="bound", values="rdp_epsilon").reset_index()
        table.attrs.update({k: v for k, v in spec.params.items() if k not in ("k_max", "points", "log_x")})
        if spec.title:
            table.attrs["title"] = spec.title
        paths = [plot_privacy_curve(table, folder / "figures" / f"{spec.name}.{suffix}", log_x=False, caption=caption)
                 for suffix in [fmt, *(["pdf"] if fmt == "png" else [])]]
        return paths if caption else [*paths, paths[0].with_suffix(".txt")]
    rows = _frame_for(folder, spec)
    frame = rows[rows[_drawn_column(spec)].notna()] if _drawn_column(spec) in rows else rows.iloc[:0]
    if frame.empty:  # a missing value is no point (never a 0): with none, no figure
        note(f"{folder}: figure {spec.name!r} not drawn: {_why_empty(folder, spec, rows)}")
        return []
    fig = figure(frame, spec, grid_of(folder), folder.name, caption=caption)
    out = folder / "figures" / f"{spec.name}.{fmt}"
    paths = [save_figure(fig, out, dpi=DPI)]
    if not caption:
        paths.append(write_text(out.with_suffix(".txt"), caption_text(caption_for(frame, spec, grid_of(folder),
                                                                                  folder.name))))
    if fmt == "png":
        paths.append(save_figure(fig, out.with_suffix(".pdf")))
    plt.close(fig)
    return paths


def figure(frame: pd.DataFrame, spec: FigureSpec, grid: dict, grid_name: str, caption: bool = True):
    """The laid-out figure of `spec` drawn from `frame` (runs, traces or an analytic table), not yet saved; its
    caption drawn below it unless `caption` is False."""
    fig = _noise_scale_figure(frame, spec) if spec.kind == "noise_scale" else _panel_figure(frame, spec)
    fig.set_dpi(DPI)
    finish(fig, title=spec.title, caption=caption_for(frame, spec, grid, grid_name) if caption else [])
    return fig


def caption_for(frame: pd.DataFrame, spec: FigureSpec, grid: dict, grid_name: str) -> list[str]:
    """The caption's phrases of the figure of `spec`."""
    if spec.kind == "noise_scale":
        return [f"grid {names.literal(grid_name)}", "computed from the accountants (no training)"]
    return _caption(grid, grid_name, frame, spec)


def _frame_for(folder: Path, spec: FigureSpec) -> pd.DataFrame:
    if spec.kind == "noise_scale":
        return analytic_table(folder, spec)
    runs = results_frame(folder, traces=spec.kind == "traces")
    try:
        return select(runs, spec.where) if len(runs) else runs
    except KeyError as exc:
        raise UserError(f"{folder}: figure {spec.name!r}: `where` {str(exc).strip(chr(34) + chr(39))}") from None


def _drawn_column(spec: FigureSpec) -> str:
    """The column the figure draws over its x axis."""
    return {"noise_scale": "sigma", "privacy_curve": "rdp_epsilon"}.get(spec.kind, spec.metric)


def _why_empty(folder: Path, spec: FigureSpec, rows: pd.DataFrame) -> str:
    """Why the figure has nothing to draw, given the `rows` it would draw from (before those without a value)."""
    column = _drawn_column(spec)
    if spec.kind in ("noise_scale", "privacy_curve"):
        return f"its analytic table has no value of {column}" if len(rows) else "its analytic table is empty"
    reason = read_results(folder).why_empty()
    if reason:
        return reason
    if len(rows):
        where = "checkpoint in traces.csv" if spec.kind == "traces" else "ok run"
        hint = " (validation metrics need a validation split: set `validation: 0.1` in the grid and rerun)" \
            if column.startswith("val_") else ""
        if column == "optimality_gap" and rows.get("optimal_objective", pd.Series(dtype=float)).isna().all():
            hint = (" (L* is computed only for a grid with a figure or claim of the optimality gap: add one to the "
                    "grid and rerun it with --no-resume)")
        return f"no {where} has a value of {column}{hint}"
    if spec.kind == "traces":
        return "no checkpoint in traces.csv matches its runs (set `trace_every` in the grid and rerun)"
    return f"no ok run matches its `where: {spec.where}`" if spec.where else "no ok run to draw"


def _panel_figure(frame: pd.DataFrame, spec: FigureSpec):
    rows = _levels(frame, spec.rows)
    cols = _levels(frame, spec.cols)
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(max(6.0, 4.4 * len(cols)), 3.3 * len(rows)), squeeze=False,
                             dpi=DPI)
    x = "examples" if spec.kind == "traces" else spec.x
    lines = _lines(frame, x, spec)
    styles = Styles(lines[frame[x].notna()].unique(), lines[frame[x].isna()].unique())
    frame = frame.assign(_line=lines)
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            ax = axes[i][j]
            panel = frame
            for column, value in ((spec.rows, row), (spec.cols, col)):
                if column:  # runs without this column's value (e.g. erm has no lr) are references in every panel
                    panel = panel[(panel[column] == value) | panel[column].isna()]
            _draw_panel(ax, panel, x, spec, styles)
            ax.set_title(" · ".join(_level_name(name, v) for name, v in ((spec.rows, row), (spec.cols, col))
                                    if name), fontsize=10)
            ax.set_xlabel(names.column(x))
            ax.set_ylabel(names.column(spec.metric))
    return fig


def _level_name(column: str, value) -> str:
    if column in ("dataset", "model", "grid", "selection"):
        return names.literal(value)
    return names.parameter(column, value)


def _lines(frame: pd.DataFrame, x: str, spec: FigureSpec) -> pd.Series:
    """Each row's line name: its `lines` values in readable names; a reference (a run without the x value)
    is named by its algorithm, once however many selections or lines it stands beside."""
    keys = frame[spec.lines].astype(object).where(frame[spec.lines].notna(), None).itertuples(index=False, name=None)
    shown = {c for c in (spec.rows, spec.cols, x) if c}  # in the panel titles or on the x axis already
    named = pd.Series([names.line_name(spec.lines, key, shown) for key in keys], index=frame.index, dtype=object)
    reference = frame[x].isna()
    if reference.any():
        label = frame["label"] if "label" in frame else frame["algorithm"]
        suffix = frame["algorithm"].map(
            lambda a: "" if names.non_private(a) or x != "epsilon" else " (non-private)") \
            if "algorithm" in frame else ""
        named[reference] = (label.map(lambda v: names.label(v, shown)) + suffix)[reference]
    return named



def _levels(frame: pd.DataFrame, column: str | None) -> list:
    if not column:
        return [None]
    values = list(frame[column].dropna().unique())
    numeric = all(isinstance(v, (int, float)) for v in values)
    return sorted(values) if numeric else sorted(values, key=str)


def _draw_panel(ax, panel: pd.DataFrame, x: str, spec: FigureSpec, styles: Styles) -> None:
    if panel.empty:
        ax.set_visible(False)
        return
    curves, reference = panel[panel[x].notna()], panel[panel[x].isna()]
    if spec.log_x:  # a value ≤ 0 has no place on a log axis (a received traces.csv may hold one)
        curves = curves[curves[x] > 0]
    if "run_id" in reference:  # the same reference run under each selection is one line
        reference = reference.drop_duplicates(["run_id", *([c for c in ("examples",) if c in reference])])
    lines = {}
    for label, line in curves.groupby("_line", sort=False):
        stats = line.groupby(x)[spec.metric].agg(["mean", "std"]).fillna({"std": 0.0})  # one seed: no band
        lines[label] = stats[stats["mean"] > 0] if spec.log_y else stats
    spread = sum(bool((stats["std"] > 0).any()) for stats in lines.values())
    for label, stats in lines.items():
        style = styles.lines[label]
        ax.plot(stats.index, stats["mean"], label=label, lw=1.4, ms=4.5 if len(stats) < 30 else 0,
                markevery=1, **style)
        if spread > MAX_BANDS:  # more bands than the eye tells apart blend into one colour: error bars
            ax.errorbar(stats.index, stats["mean"], yerr=stats["std"], fmt="none", ecolor=style["color"],
                        elinewidth=0.9, capsize=2.5, alpha=0.8)
        else:
            ax.fill_between(stats.index, stats["mean"] - stats["std"], stats["mean"] + stats["std"],
                            color=style["color"], alpha=0.15, lw=0)
    for label, ref in reference.groupby("_line", sort=False):
        mean, std = ref[spec.metric].mean(), ref[spec.metric].std() if len(ref) > 1 else 0.0
        if mean != mean or (spec.log_y and mean <= 1e-9):  # none, or numerically zero (erm's own optimality
            continue                                      # gap): no place on a log axis
        style = styles.references[label]
        ax.axhline(mean, lw=1.2, label=label, **style)
        if std > 0:
            ax.axhspan(mean - std, mean + std, color=style["color"], alpha=0.08, lw=0)
    if spec.log_x:
        ax.set_xscale("log")
        values = sorted(curves[x].unique())
        if 0 < len(values) <= 12:  # label the swept values themselves, not powers of ten
            ax.set_xticks(values, [names.number(v) for v in values])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if spec.log_y:
        ax.set_yscale("log")
    else:
        _one_example_marker(ax, panel, spec.metric)
    ax.grid(True, which="both", alpha=0.25)


def _one_example_marker(ax, panel: pd.DataFrame, metric: str) -> None:
    """A bar one test example high at the panel's right edge, where one example is a visible step (≥ 1/40 of the
    panel's height): a difference within it is one prediction, not a finding (a 114-row test set moves accuracy
    in steps of 0.9 points)."""
    if metric != "test_accuracy" or "n_test" not in panel or not (panel["n_test"] > 0).any():
        return
    step = 1.0 / float(panel.loc[panel["n_test"] > 0, "n_test"].min())
    lo, hi = ax.get_ylim()
    if step < (hi - lo) / 40:
        return
    edge = matplotlib.transforms.blended_transform_factory(ax.transAxes, ax.transData)
    bottom = lo + 0.06 * (hi - lo)
    ax.plot([0.985, 0.985], [bottom, bottom + step], color="0.25", lw=2.5, transform=edge, solid_capstyle="butt",
            label="_one test example")
    ax.text(0.975, bottom + step / 2, "1 test\nexample", transform=edge, ha="right", va="center", fontsize=6,
            color="0.25")
    ax.set_ylim(lo, hi)


def _noise_scale_figure(table: pd.DataFrame, spec: FigureSpec):
    """σ of bassily2014 under each accounting: over T (n and δ = 1/n² fixed) and over n (T and δ fixed); points
    whose accounting is not proved there are hollow."""
    proved = table["proved"].astype(bool) if "proved" in table else pd.Series(True, index=table.index)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), squeeze=False, dpi=DPI)
    styles = Styles(table["accounting"].unique())
    for ax, (panel, x, xlabel) in zip(axes[0], [("T", "steps", "steps $T$"), ("n", "n", "records $n$")]):
        part = table[table["panel"] == panel]
        for label, line in part.groupby("accounting", sort=False):
            style = styles.lines[label]
            ok = proved[line.index]
            ax.plot(line[x], line["sigma"], lw=1.2, color=style["color"], ls=style["ls"], marker=style["marker"],
                    ms=5, label=names.literal(label))
            ax.plot(line[x][~ok], line["sigma"][~ok], ls="none", marker=style["marker"], ms=6, mfc="white",
                    color=style["color"], zorder=3)  # hollow over the filled marker
        if (~proved[part.index]).any():
            ax.plot([], [], ls="none", marker="o", mfc="none", color="0.3",
                    label=r"hollow: not proved (per-step $\varepsilon_0$ beyond its lemmas, "
                          r"or $\varepsilon$ not certified)")
        if not len(part):
            fixed = ""
        elif panel == "T":
            fixed = f"$n$ = {part['n'].iloc[0]:,}, $\\delta = 1/n^2$"
        else:
            fixed = f"$T$ = {part['steps'].iloc[0]:,}, $\\delta$ = {names.number(part['delta'].iloc[0])}" \
                if "delta" in part else f"$T$ = {part['steps'].iloc[0]:,}"
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=r"noise $\sigma$ (per step, on $\nabla\ell$)")
        ax.set_title(f"{fixed}, $\\varepsilon$ = {names.number(table['epsilon'].iloc[0])}", fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
    return fig


def _caption(grid: dict, grid_name: str, frame: pd.DataFrame, spec: FigureSpec) -> list[str]:
    """The caption's phrases: where the numbers come from, and each line's privacy guarantee."""
    seeds = grid.get("seeds", frame["seed"].nunique() if "seed" in frame else "?")
    band = "mean ± 1 std" if spec.kind != "traces" or seeds != 1 else "one run"
    phrases = [f"grid {names.literal(grid_name)}", f"{band} over {seeds} seeds"]
    delta = grid.get("delta", "")
    delta = "1/n^2" if delta == "1/n^2" else names.number(delta) if delta != "" else ""
    if "algorithm" in frame and "epsilon" in frame:
        runs = frame.drop_duplicates("run_id") if "run_id" in frame else frame
        private = runs[runs["epsilon"].notna()]
        pure = private["accountant"].astype(str).eq("pure") if "accountant" in private else \
            pd.Series(False, index=private.index)
        if "delta" in private:
            pure |= private["delta"].eq(0)
        approximate = [names.algorithm(a) for a in private[~pure]["algorithm"].unique()]
        exact = [names.algorithm(a) for a in private[pure]["algorithm"].unique()]
        if approximate:
            shown = "$\\delta = 1/n^2$ ($n$ training records)" if delta == "1/n^2" else f"$\\delta$ = {delta}"
            phrases.append(f"{shown}" + (f" for {', '.join(approximate)}" if exact else ""))
        if exact:
            phrases.append(f"{', '.join(exact)}: pure $\\varepsilon$-DP ($\\delta = 0$)")
        if private.empty and not runs.empty:
            phrases.append("no private line")
        phrases += relation_phrases(private) + accountant_phrases(private)
    phrases += [names.literal(part) for part in _phrases(caption_of(grid).strip())]
    return phrases


RELATIONS = {"add_remove": "add/remove", "replace_one": "replace-one", "zero_out": "zero-out"}


def relation_phrases(private: pd.DataFrame) -> list[str]:
    """The neighbouring relation the private rows' ε hold under: one phrase, or a warning naming each algorithm's
    relation where they differ (their ε are then not comparable)."""
    by_relation = _algorithms_by(private, "neighbours", RELATIONS)
    if len(by_relation) == 1:
        return [f"$\\varepsilon$ under {next(iter(by_relation))} neighbours"]
    mixed = "; ".join(f"{rel}: {', '.join(algs)}" for rel, algs in by_relation.items())
    return [f"mixed neighbouring relations, $\\varepsilon$ not comparable across them ({mixed})"] if mixed else []


# runs.csv's `accountant` values beyond the `accountant` parameter's own (names.PARAMETERS)
ACCOUNTANTS = {**names.PARAMETERS["accountant"][1], "gaussian_analytic": "analytic Gaussian",
               "gaussian_classical": "classical Gaussian", "pure": "a pure ε-DP pass",
               "basic": "basic composition", "advanced": "advanced composition",
               # bassily2014's accountings (privacy/single_example_gaussian.py: closed_form_<formula>,
               # advanced_composition_<amplification>)
               "closed_form_paper": "the paper's closed form", "closed_form_lecture": "the lecture's closed form",
               "advanced_composition_tight": "advanced composition (tight amplification)",
               "advanced_composition_approx": "advanced composition (approximate amplification)"}


def accountant_phrases(private: pd.DataFrame) -> list[str]:
    """The accountant that calibrated the private rows' ε (runs.csv's `accountant`): one phrase, or each
    accountant with its algorithms where they differ (a looser accountant adds more noise for the same ε)."""
    by_accountant = _algorithms_by(private, "accountant", ACCOUNTANTS)
    if len(by_accountant) == 1:
        return [f"$\\varepsilon$ calibrated by {next(iter(by_accountant))}"]
    if len({tuple(algs) for algs in by_accountant.values()}) == 1:  # one algorithm, the accountant per line
        return [f"$\\varepsilon$ calibrated by different accountants ({', '.join(by_accountant)}): see each line"]
    mixed = "; ".join(f"{acc}: {', '.join(algs)}" for acc, algs in by_accountant.items())
    return [f"$\\varepsilon$ calibrated by different accountants ({mixed})"] if mixed else []


def _algorithms_by(private: pd.DataFrame, column: str, shown: dict[str, str]) -> dict[str, list[str]]:
    """Each value of `column` among the private rows, as `shown` names it → its algorithms."""
    if column not in private or not private[column].notna().any():
        return {}
    return {shown.get(value, value): sorted({names.algorithm(a) for a in rows["algorithm"]})
            for value, rows in private.groupby(private[column].fillna("unrecorded").astype(str))}


def _phrases(text: str) -> list[str]:
    """`text` cut at its sentence ends and at the `; ` outside parentheses: the places a caption may wrap."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and (text.startswith("; ", i) or text.startswith(". ", i)):
            parts.append(text[start:i + (char == ".")].strip())
            start = i + 2
    parts.append(text[start:].strip())
    return [p for p in parts if p]
