"""Synthetic results for the figure grids of experiments.yaml, and layout checks of a drawn figure.

`synthetic_results(grid, folder)` writes what `dpsgd run` would (manifest, runs.csv, traces.csv) for every cell
and seed of the grid, with made-up but plausible numbers: no training, so every figure renders in well under a
second. Where two configurations must give the same numbers in reality (noisy GD's `minimum` accountant picks
the dynamics bound here), they give the same numbers here too, so the figures meet coinciding lines.

`layout_problems(fig)` lists what makes a figure unfit to print: text shown as raw mathtext, overlapping tick
labels, powers of ten where an axis spans less than two decades, text outside the canvas, a legend over data or
repeating one phrase in every entry, a line hidden under another, more than three bands in one panel, a repeated
legend entry.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

import numpy as np
from matplotlib.collections import FillBetweenPolyCollection, PathCollection
from matplotlib.text import Text

from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.config import expand
from dpsgd_cli.engine.results import ResultStore

N_TRAIN = {"adult": 30162, "bank": 36168, "kddcup99": 70000, "mnist": 12000, "synthetic": 10000}


def _unit(*parts) -> float:
    """A number in [0, 1) fixed by `parts`."""
    return int(hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:8], 16) / 2**32


def _accountant(algorithm: str, params: dict) -> str:
    """runs.csv's `accountant` as the algorithm records it: its accountant (or accounting) parameter, auto = PLD
    (pidp_sgd's), RDP where unset; song2013's one pass is pure ε-DP."""
    if algorithm == "song2013":
        return "pure"
    accountant = params.get("accountant", params.get("accounting", "rdp"))
    return "pld" if accountant == "auto" else accountant


def synthetic_results(grid, folder: Path, seeds: int = 3, checkpoints: int = 8) -> Path:
    grid = grid.model_copy(update={"seeds": seeds})
    folder = Path(folder)
    store = ResultStore(folder)
    store.start(resume=False)
    rows, traces = [], []
    for cell in expand(grid):
        params = dict(cell.algorithm.params)
        if cell.algorithm.name == "noisy_gd" and params.get("accountant") == "minimum":
            params["accountant"] = "dynamics"  # the smaller bound here: the same σ, the same runs
        identity = [cell.algorithm.name, params, cell.batch_size, cell.lr, cell.epochs, cell.dataset.model_dump_json()]
        opts = cell.dataset.model_dump()
        n = opts.get("subsample") or opts.get("n") or N_TRAIN.get(cell.dataset.name, 5000)
        d = opts.get("dim") or opts.get("projection") or 14
        eps = cell.epsilon
        private = eps is not None
        quality = 1.0 if not private else 1 - math.exp(-eps)
        radius = params.get("radius")
        deterministic = cell.algorithm.name == "erm"
        for seed in cell.seeds:
            noise = 0.0 if deterministic else (_unit(identity, seed) - 0.5) * (0.05 if private else 0.01)
            gap = 0.0 if deterministic else (0.02 + 0.3 * (1 - quality) + 0.1 * _unit(identity)) * (1 + noise * 4)
            no_test = opts.get("split") == "none"
            row = {
                "run_id": cell.run_id(seed), "cell_id": cell.cell_id, "grid": grid.name, "dataset": cell.dataset.name,
                "dataset_options": cell.dataset.model_dump_json(exclude={"name"}), "n_train": n,
                "n_test": 0 if no_test else n // 4, "d": d, "model": cell.model.name,
                "model_options": json.dumps(cell.model.options, sort_keys=True), "algorithm": cell.algorithm.name,
                "algorithm_params": json.dumps(cell.algorithm.params, sort_keys=True), "seed": seed,
                "epsilon": eps, "delta": 1.0 / n**2, "accountant": _accountant(cell.algorithm.name, params) if private
                else None,
                "batch_size": cell.batch_size, "lr": cell.lr, "epochs": cell.epochs, "l2": cell.l2,
                "clip_norm": cell.clip_norm, "sigma": 1.0 if private else None,
                "steps": int(n * (cell.epochs or 1) / (cell.batch_size or n)),
                "sample_rate": (cell.batch_size or n) / n,
                "test_accuracy": None if no_test else 0.70 + 0.12 * quality + noise,
                "test_loss": None if no_test else 0.6 - 0.1 * quality + noise,
                "train_accuracy": 0.72 + 0.12 * quality + noise, "train_objective": 0.3 + gap,
                "optimal_objective": 0.3, "optimality_gap": gap,
                "guarantee": "proved" if private else "non-private",
                "noiseless_fraction": None if radius is None else min(1.0, math.log10(radius) / 12),
                "delta_certified": None if radius is None else 10.0 ** (-12 + min(11, math.log10(radius))),
                "val_accuracy": 0.70 + 0.12 * quality + noise, "val_objective": 0.3 + gap, "n_val": n // 5,
                "status": "ok", "message": None, "version": "synthetic", "dtype": cell.dtype,
                "tuning": cell.tuning["tag"] if cell.tuning else None,
                "neighbours": ALGORITHMS[cell.algorithm.name](params, cell.neighbours).neighbouring() if private
                else None,
                "epsilon_base": eps if cell.tuning else None, "wall_time": 0.1,
            }
            rows.append(row)
            if cell.trace_every and not deterministic:
                total = int(n * (cell.epochs or 1))
                for k in range(1, checkpoints + 1):
                    examples = total * k // checkpoints
                    decay = (1 + 3 * _unit(identity)) / math.sqrt(k)
                    traces.append({"run_id": row["run_id"], "cell_id": cell.cell_id, "seed": seed, "examples": examples,
                                   "train_objective": 0.3 + gap + decay * (1 + noise), "optimality_gap": gap + decay,
                                   "train_accuracy": row["train_accuracy"]})
    store.append(rows)
    if traces:
        store.append_traces(traces)
    store.write_manifest(grid.model_dump(mode="json"), "synthetic", 0.0, 1.0)
    return folder


# --- checks ---------------------------------------------------------------------------------------------------
def _shown(text: Text) -> str:
    """The text as the reader sees it when it is not mathtext ('' when it is rendered as math)."""
    string, is_math = text._preprocess_math(text.get_text())
    return "" if is_math else string


def _tick_labels(ax):
    for axis, horizontal in ((ax.xaxis, True), (ax.yaxis, False)):
        lo, hi = sorted(ax.get_xlim() if horizontal else ax.get_ylim())
        labels = []
        for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
            label = tick.label1
            if label.get_visible() and label.get_text() and lo <= tick.get_loc() <= hi:
                labels.append(label)
        yield axis, horizontal, labels


def layout_problems(fig) -> list[str]:
    """Everything wrong with the figure's text and layout, one line each ([] for a figure fit to print)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems = []
    canvas = fig.bbox
    axes = [ax for ax in fig.axes if ax.get_visible()]
    for ax in axes:
        for _axis, horizontal, labels in _tick_labels(ax):
            name = "x" if horizontal else "y"
            for label in labels:
                raw = _shown(label)
                if "$" in raw or "\\mathdefault" in raw:
                    problems.append(f"{name} tick label printed as raw mathtext: {raw!r}")
            boxes = sorted(((lab.get_window_extent(renderer), lab.get_text()) for lab in labels),
                           key=lambda b: b[0].x0 if horizontal else b[0].y0)
            for (a, ta), (b, tb) in itertools.combinations(boxes, 2):
                if a.overlaps(b):
                    problems.append(f"{name} tick labels overlap: {ta!r} and {tb!r}")
            texts = [text for _, text in boxes if text]
            repeated = sorted({t for t in texts if texts.count(t) > 1})
            if repeated:  # one label at several places: the axis cannot be read
                problems.append(f"{name} tick labels repeat: {repeated}")
            scale = ax.get_xscale() if horizontal else ax.get_yscale()
            lo, hi = sorted(ax.get_xlim() if horizontal else ax.get_ylim())
            if scale == "log" and lo >= 1e-3 and hi <= 1e6 and hi / lo < 100:
                powers = [t for t in texts if "10^" in t or "10^{" in t or "×10" in t or "times10" in t]
                if powers:  # 2.17×10⁻¹ where 0.2 belongs
                    problems.append(f"{name} log axis over less than two decades labelled by powers: {powers}")
        bands = [c for c in ax.collections if isinstance(c, FillBetweenPolyCollection)]
        if len(bands) > 3:
            problems.append(f"{len(bands)} std bands in panel {ax.get_title()!r}: more than three blend into one "
                            "colour (error bars instead)")
    drawn_ticks = {id(lab) for ax in axes for _, _, labels in _tick_labels(ax) for lab in labels}
    all_ticks = {id(label) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
                 for t in [*axis.majorTicks, *axis.minorTicks] for label in (t.label1, t.label2)}
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or text.figure is None:
            continue
        if getattr(text, "axes", None) is not None and not text.axes.get_visible():
            continue
        if id(text) in all_ticks and id(text) not in drawn_ticks:
            continue  # a tick label outside the view: not drawn
        box = text.get_window_extent(renderer)
        if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1:
            problems.append(f"text outside the canvas: {text.get_text()[:60]!r}")
        raw = _shown(text)
        if "\\mathdefault" in raw:
            problems.append(f"raw mathtext shown: {raw[:60]!r}")
    legends = [*fig.legends, *(ax.get_legend() for ax in axes if ax.get_legend() is not None)]
    for legend in legends:
        names = [t.get_text() for t in legend.get_texts()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            problems.append(f"legend repeats entries: {repeated}")
        shared = _shared_phrase(names)
        if shared:
            problems.append(f"legend repeats {shared!r} in each of its {len(names)} entries (say it once)")
        box = legend.get_window_extent(renderer)
        for ax in axes:
            for point in _data_points(ax):
                if box.x0 <= point[0] <= box.x1 and box.y0 <= point[1] <= box.y1:
                    problems.append(f"legend covers data at {tuple(np.round(point))} in panel {ax.get_title()!r}")
                    break
    if len(fig.legends) > 1:
        everything = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        if len(everything) != len(set(everything)):
            problems.append("an entry is repeated across the figure's legends")
    for ax in axes:
        problems += _hidden_lines(ax)
    return problems


def _shared_phrase(names: list[str]) -> str:
    """A leading phrase (up to a ', ' or ': ') that three or more legend entries, all but at most two, start with."""
    for first in names:
        for cut in (m for m in range(len(first)) if first.startswith((", ", ": "), m)):
            prefix = first[:cut + 2]
            if sum(n.startswith(prefix) and len(n) > len(prefix) for n in names) >= max(3, len(names) - 2):
                return prefix
    return ""


def _data_points(ax) -> np.ndarray:
    points = []
    for line in ax.get_lines():
        if line.get_label().startswith("_") and not len(line.get_xydata()):
            continue
        xy = np.asarray(line.get_xydata(), dtype=float)
        if len(xy):
            points.append(line.get_transform().transform(xy[np.isfinite(xy).all(axis=1)]))
    for collection in ax.collections:
        if isinstance(collection, PathCollection) and len(collection.get_offsets()):
            points.append(collection.get_offset_transform().transform(np.asarray(collection.get_offsets())))
    inside = ax.get_window_extent()
    points = np.concatenate(points) if points else np.zeros((0, 2))
    keep = (points[:, 0] >= inside.x0) & (points[:, 0] <= inside.x1) & (points[:, 1] >= inside.y0) & \
        (points[:, 1] <= inside.y1)
    return points[keep]


def _hidden_lines(ax) -> list[str]:
    """Pairs of lines with the same data that look alike (no distinct marker or dash pattern): the one drawn
    first is invisible."""
    problems = []
    lines = [line for line in ax.get_lines() if len(line.get_xydata()) and line.get_visible()]
    for a, b in itertools.combinations(lines, 2):
        xa, xb = np.asarray(a.get_xydata(), float), np.asarray(b.get_xydata(), float)
        if xa.shape != xb.shape or not np.allclose(xa, xb, equal_nan=True):
            continue
        if a.get_transform() != b.get_transform():
            continue
        marker = a.get_marker() != b.get_marker() and "None" not in (str(a.get_marker()), str(b.get_marker())) \
            and (a.get_markerfacecolor() == "none" or b.get_markerfacecolor() == "none")
        dashes = a.get_linestyle() != b.get_linestyle()
        if not (marker or dashes):
            problems.append(f"line {b.get_label()!r} hides {a.get_label()!r} (same data, same look) in panel "
                            f"{ax.get_title()!r}")
    return problems


def legend_names(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    return [t.get_text() for legend in legends for t in legend.get_texts()]
