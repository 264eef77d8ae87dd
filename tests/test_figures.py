"""Every figure of experiments.yaml, drawn from synthetic results, is fit to print: math rendered as math and
user text printed literally, no overlapping or cut-off text, legends over no data, every line visible, no
repeated legend entry, readable names, true captions; and a few figures match stored reference images.

Set DPSGD_UPDATE_FIGURE_REFERENCES=1 to rewrite the reference images (then look at them before committing).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from figure_checks import layout_problems, legend_names, synthetic_results
from matplotlib.testing.compare import compare_images

from dpsgd_cli.config import FigureSpec, load_grid_file
from dpsgd_cli.engine.analytic import privacy_curve_table
from dpsgd_cli.engine.results import grid_of
from dpsgd_cli.engine.summary import summary_frame
from dpsgd_cli.plots import _caption, _frame_for, draw_figure, figure, names, plot_results
from dpsgd_cli.plots.layout import finish, wrap_phrases

ROOT = Path(__file__).parents[1]
REFERENCES = Path(__file__).parent / "figures_reference"
GRIDS = {g.name: g for g in load_grid_file(ROOT / "experiments.yaml").grids}
FIGURES = [(grid.name, spec) for grid in GRIDS.values() for spec in grid.figures]
CONFIG_STRING = re.compile(r"\b[a-z0-9]+_[a-z0-9_]+\b|\w=\w")  # song2013_nonprivate, schedule=inv_t


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("figure-grids")
    cache = {}

    def folder(name: str) -> Path:
        if name not in cache:
            cache[name] = synthetic_results(GRIDS[name], root / name)
        return cache[name]

    return folder


FRAMES: dict = {}


def noise_scale(spec: FigureSpec) -> pd.DataFrame:
    """The table of a noise-scale figure with made-up σ (calibrating every accounting takes minutes): the
    layout is what is tested, the numbers are tested in the accounting tests."""
    from dpsgd_cli.engine.analytic import NOISE_ACCOUNTINGS

    p, rows = spec.params, []
    n, steps_fixed, delta_fixed = p["n"], p.get("steps_fixed") or p["n"], p.get("delta_fixed") or 1 / p["n"] ** 2
    points = [("T", n, max(1, round(e * n)), 1 / n**2) for e in p["epochs"]]
    points += [("n", m, steps_fixed, delta_fixed) for m in p["n_values"]]
    for i, (label, *_) in enumerate(NOISE_ACCOUNTINGS):
        for panel, m, steps, delta in points:
            sigma = (1 + i / 3) * (steps ** 0.5) * 1e3 / m
            rows.append({"panel": panel, "accounting": label, "n": m, "steps": steps, "epsilon": p["epsilon"],
                         "delta": delta, "sigma": sigma, "proved": not (i == 2 and steps > n)})
    return pd.DataFrame(rows)


def draw(folder: Path, spec: FigureSpec):
    """The laid-out figure of one spec, as `dpsgd plot` draws it (before saving)."""
    from dpsgd_cli.plots import grid_of

    if spec.kind == "privacy_curve":
        from dpsgd_cli.plots.privacy_curve import plot_privacy_curve

        table = privacy_curve_table(spec.params).pivot(index="K", columns="bound", values="rdp_epsilon").reset_index()
        table.attrs.update({k: v for k, v in spec.params.items() if k not in ("k_max", "points", "log_x")})
        table.attrs["title"] = spec.title
        captured = {}
        original = plt.close
        plt.close = lambda fig=None: captured.setdefault("fig", fig)
        try:
            plot_privacy_curve(table, folder / "figures" / "privacy_curve.png")
        finally:
            plt.close = original
        return captured["fig"]
    key = (str(folder), spec.name)
    if key not in FRAMES:  # a grid's private selections take seconds to simulate: once per figure
        FRAMES[key] = noise_scale(spec) if spec.kind == "noise_scale" else _frame_for(folder, spec)
    frame = FRAMES[key]
    assert not frame.empty, f"{spec.name}: no data to draw"
    return figure(frame, spec, grid_of(folder), folder.name)


@pytest.mark.parametrize("grid,spec", FIGURES, ids=[f"{g}-{s.name}" for g, s in FIGURES])
def test_each_figure_of_experiments_yaml_is_fit_to_print(results, grid, spec):
    fig = draw(results(grid), spec)
    try:
        assert layout_problems(fig) == []
        legend = legend_names(fig)
        if spec.lines[0] in ("label", "algorithm"):  # names, not configuration strings
            raw = [n for n in legend if CONFIG_STRING.search(n.replace(r"\$", "").split("$")[0])]
            assert raw == [], f"legend shows configuration strings: {raw}"
        for ax in fig.axes:
            for label in (ax.get_xlabel(), ax.get_ylabel()):
                assert not CONFIG_STRING.search(label.split("$")[0]), f"axis label {label!r}"
    finally:
        plt.close(fig)


def test_figure_titles_and_captions_of_experiments_yaml_use_symbols_not_ascii_spellings():
    ascii_math = re.compile(r"\b(eta|epsilon|eps|lambda|sigma|delta|alpha|theta|sqrt)\b")
    for grid, spec in FIGURES:
        assert not ascii_math.search(spec.title), f"{grid}/{spec.name}: title {spec.title!r}"


def test_math_is_rendered_and_user_text_is_literal(tmp_path):
    assert matplotlib.rcParams["text.parse_math"]
    folder = synthetic_results(GRIDS["song_fig3"], tmp_path / "dollar$grid")
    spec = FigureSpec(name="f", kind="traces", title="costs $5 and $x_1$ (unbalanced $", metric="train_objective",
                      cols="dataset", log_x=False, log_y=True)
    fig = draw(folder, spec)
    try:
        assert layout_problems(fig) == []
        shown = [t._preprocess_math(t.get_text()) for t in fig.texts]
        assert ("costs $5 and $x_1$ (unbalanced $", False) in shown  # literal, as written
        assert any(t.get_text().startswith(r"grid dollar\$grid") for t in fig.texts)  # escaped: a dollar sign
        fig.savefig(tmp_path / "f.png", dpi=40)  # an unbalanced $ in user text does not make savefig raise
        ticks = [t.label1 for ax in fig.axes for t in ax.yaxis.get_major_ticks() if t.label1.get_text()]
        # 10^k as math, or plain numbers where the log axis spans less than two decades (no literal "$")
        assert ticks and all(t._preprocess_math(t.get_text())[1] or "$" not in t.get_text() for t in ticks)
    finally:
        plt.close(fig)


def test_readable_names_come_from_one_mapping():
    assert names.label("song2013_nonprivate schedule=inv_t") == r"non-private SGD (Song et al.), $\eta = 1/(\lambda t)$"
    assert names.label("noisy_gd accountant=minimum") == "noisy GD, accountant: min(dynamics, composition)"
    assert names.label("dp_sgd lr=0.1 [for pick]") == r"DP-SGD, $\eta_0$ = 0.1 [tuning for pick]"
    assert names.label("my$algo") == r"my\$algo"
    assert names.number(1e8) == "$10^{8}$" and names.number(3e9) == r"$3\times10^{9}$" and names.number(0.01) == "0.01"


def test_a_legend_leaves_out_a_parameter_that_does_not_act():
    # bassily2014 pins `formula` on every accounting (for stable run ids); only the closed form uses one
    assert names.label("bassily2014 accounting=rdp formula=paper") == "DP-SGD (Bassily et al.), accounting: RDP"
    assert names.label("bassily2014 accounting=closed_form formula=paper") == \
        "DP-SGD (Bassily et al.), accounting: closed form, formula: the paper's"
    assert names.label("bassily2014 formula=lecture") == "DP-SGD (Bassily et al.), formula: the lecture's"


def test_each_check_catches_its_defect():
    """The checks fail on the defects they are for (so a passing figure test means something)."""
    # raw mathtext ticks (math parsing off) and overlapping tick labels
    with matplotlib.rc_context({"text.parse_math": False}):
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.plot([1, 1e4], [1, 1e3])
        ax.set(xscale="log", yscale="log")
        assert any("raw mathtext" in p for p in layout_problems(fig))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2, 3], [1, 2, 3])
    ax.set_xticks([1, 1.1, 3], ["1e+08", "1e3", "3e+09"])
    assert any("overlap" in p for p in layout_problems(fig))
    plt.close(fig)
    # a title cut off, a legend over data, lines hidden, a repeated entry
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(np.linspace(0, 1, 21), np.linspace(0, 1, 21), label="dynamics", color="C0")
    ax.plot(np.linspace(0, 1, 21), np.linspace(0, 1, 21), label="minimum", color="C1")
    ax.axhline(0.5, label="ERM")
    ax.axhline(0.5, label="ERM")
    ax.legend(loc="center")
    fig.suptitle("a title far too long to fit on this small canvas, cut off at both sides")
    problems = layout_problems(fig)
    plt.close(fig)
    for expected in ("outside the canvas", "legend covers data", "hides", "repeats"):
        assert any(expected in p for p in problems), (expected, problems)


def test_captions_break_between_phrases_only():
    fig = plt.figure(figsize=(4, 2))
    phrases = ["grid song_fig3", "mean ± 1 std over 20 seeds", r"$\delta = 1/n^2$ ($n$ training records) for DP-SGD",
               r"private SGD (Song et al.): pure $\varepsilon$-DP ($\delta = 0$)"]
    text = wrap_phrases(fig, phrases, 3.8, 8)
    plt.close(fig)
    for line in text.split("\n"):
        assert all(part in phrases for part in line.split("; ")), line


def test_caption_states_delta_only_for_the_lines_that_have_one(results):
    song = results("song_fig3")
    spec = GRIDS["song_fig3"].figures[0]
    phrases = _caption(GRIDS["song_fig3"].model_dump(mode="json"), "song_fig3", _frame_for(song, spec), spec)
    assert any("pure $\\varepsilon$-DP" in p for p in phrases)
    assert not any("1/n^2" in p for p in phrases), phrases  # no line of this figure has a δ > 0
    chourasia = results("chourasia")
    spec = GRIDS["chourasia"].figures[1]
    phrases = _caption(GRIDS["chourasia"].model_dump(mode="json"), "chourasia", _frame_for(chourasia, spec), spec)
    assert any("1/n^2" in p for p in phrases) and not any("pure" in p for p in phrases)


def test_reference_lines_are_drawn_once_whatever_the_selections(results):
    """`tuning` has several selections; each keeps the non-private reference runs: one legend entry each."""
    grid = GRIDS["tuning"]
    spec = grid.figures[0]
    fig = draw(results("tuning"), spec)
    try:
        legend = legend_names(fig)
        assert len(legend) == len(set(legend))
        for ax in fig.axes:
            levels = [round(line.get_ydata()[0], 12) for line in ax.get_lines() if "non-private" in line.get_label()]
            assert len(levels) == len(set(levels)), legend
    finally:
        plt.close(fig)


def test_audit_figure_shows_points_at_zero_whole_and_its_legend_covers_none(tmp_path):
    from dpsgd_cli.audit.plot import audit_figure

    frame = pd.DataFrame({
        "status": "ok", "threat_model": ["black-box, last iterate"] * 3 + ["white-box, every step"] * 3,
        "algorithm": ["dp_sgd", "song2013", "bolt_on"] * 2, "epsilon_claimed": [1.0, 4.0, 8.0] * 2,
        "epsilon_lo": [0.0, 0.0, 9.5, 0.2, 0.0, 1.0]})
    fig = audit_figure(frame)
    try:
        assert layout_problems(fig) == []
        for ax in fig.axes:
            # markers at ε_lo = 0 (x) and on the first claim's row (y = 0) are not half clipped
            assert min(ax.get_ylim()) < 0 and ax.get_xlim()[0] < 0
    finally:
        plt.close(fig)


def test_audit_figure_sets_algorithms_at_one_point_side_by_side():
    """Three algorithms audited at ε = 1 with ε_lo = 0, each with its twin and a control at 0 too: every marker at
    a place of its own (a row per claim, a line per control), none under another."""
    from matplotlib.collections import PathCollection

    from dpsgd_cli.audit.plot import audit_figure

    frame = pd.DataFrame({"status": "ok", "threat_model": "black-box, last iterate",
                          "algorithm": ["dp_sgd", "song2013", "bolt_on"], "epsilon_claimed": 1.0, "epsilon_lo": 0.0,
                          "verdict": "consistent", "control": 0.1, "control_epsilon_lo": 0.0,
                          "noise_half_epsilon_lo": 0.0})
    fig = audit_figure(frame)
    try:
        (ax,) = fig.axes
        points = [tuple(p) for c in ax.collections if isinstance(c, PathCollection)
                  for p in np.asarray(c.get_offsets(), float)]  # the markers (not the shaded zones)
        assert len(points) == 9, points
        ys = sorted(y for _, y in points)
        assert min(np.diff(ys)) > 0.1, ys
    finally:
        plt.close(fig)


def test_audit_figure_shows_each_verdict_and_the_twins_bound():
    """A consistent row is filled, an uninformative one hollow, a refuted one an X; each row's twin ε_lo is drawn
    above it (the bound a real bug gives), with a legend entry saying so."""
    from dpsgd_cli.audit.plot import audit_figure

    frame = pd.DataFrame({
        "status": "ok", "threat_model": "white-box, all iterates", "algorithm": "dp_sgd",
        "epsilon_claimed": [0.5, 1.0, 2.0], "epsilon_lo": [0.0, 0.0, 2.5],
        "verdict": ["uninformative", "consistent", "refuted"], "control_epsilon_lo": [0.3, 3.6, np.nan]})
    fig = audit_figure(frame)
    try:
        assert layout_problems(fig) == []
        (ax,) = fig.axes
        faces = [c.get_facecolors() for c in ax.collections if len(c.get_offsets())]
        assert any(len(f) == 0 or (f[:, 3] == 0).all() for f in faces)  # a hollow (uninformative) marker
        twins = [c for c in ax.collections if np.isclose(np.asarray(c.get_offsets(), float)[:, 0], 3.6).any()]
        assert twins, "the twin's ε_lo is drawn"
        legend = " ".join(legend_names(fig))
        assert "broken twin" in legend and "hollow: uninformative" in legend and "REFUTED" in legend
    finally:
        plt.close(fig)


def test_summary_marks_a_cell_deterministic_by_the_metrics_it_shows(tmp_path):
    """Without a test split every test accuracy is NaN: a cell whose optimality gap varies over seeds is not
    'deterministic', and shows its spread; erm (the same gap every seed) still is."""
    folder = synthetic_results(GRIDS["song_fig3"], tmp_path / "song_fig3")
    table = summary_frame(folder).set_index("label")
    assert table["acc_mean"].isna().all()
    assert table.loc["erm", "identical"]
    varying = table.drop(index="erm")
    assert not varying["identical"].any()
    assert (varying["gap_std"] > 0).all()


REFERENCE_FIGURES = [("song_fig3", "song_fig3"), ("chourasia", "chourasia_utility"),
                     ("kang_sweep", "kang_sweep_accuracy"),
                     ("chourasia", "privacy_curve"), ("bellet", "bellet_noise")]


@pytest.mark.parametrize("grid,name", REFERENCE_FIGURES, ids=[n for _, n in REFERENCE_FIGURES])
def test_figure_matches_its_reference_image(results, tmp_path, grid, name):
    spec = next(s for s in GRIDS[grid].figures if s.name == name)
    fig = draw(results(grid), spec)
    actual = tmp_path / f"{name}.png"
    with matplotlib.rc_context({"svg.hashsalt": "dpsgd"}):
        fig.savefig(actual, dpi=50)
    plt.close(fig)
    expected = REFERENCES / f"{name}.png"
    if os.environ.get("DPSGD_UPDATE_FIGURE_REFERENCES") or not expected.exists():
        REFERENCES.mkdir(exist_ok=True)
        expected.write_bytes(actual.read_bytes())
        pytest.skip(f"wrote {expected}")
    result = compare_images(str(expected), str(actual), tol=6)
    assert result is None, result


def test_dpsgd_plot_writes_every_figure_of_a_grid(results):
    paths = plot_results(results("song_fig3"))
    assert sorted(p.suffix for p in paths) == [".pdf", ".png"]


def test_finish_keeps_a_long_title_and_caption_on_the_canvas():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([1, 2], [1, 2], label="a line")
    finish(fig, title="A title that is much longer than the figure is wide, so that it must wrap " * 2,
           caption=["a first phrase", "a second, longer phrase that would not fit on the line of the first"])
    try:
        assert layout_problems(fig) == []
    finally:
        plt.close(fig)


def test_captions_name_the_neighbouring_relation_and_warn_when_it_is_mixed():
    from dpsgd_cli.plots import relation_phrases

    one = pd.DataFrame({"algorithm": ["dp_sgd", "pidp_sgd"], "neighbours": ["replace_one", "replace_one"]})
    assert relation_phrases(one) == ["$\\varepsilon$ under replace-one neighbours"]
    mixed = pd.DataFrame({"algorithm": ["dp_sgd", "pidp_sgd"], "neighbours": ["add_remove", "replace_one"]})
    (phrase,) = relation_phrases(mixed)
    assert phrase.startswith("mixed neighbouring relations") and "add/remove: DP-SGD" in phrase
    assert relation_phrases(mixed.drop(columns="neighbours")) == []  # results written before the column existed
    assert relation_phrases(mixed.assign(neighbours=float("nan"))) == []


def test_captions_name_the_accountant_and_each_one_when_they_differ():
    from dpsgd_cli.plots import accountant_phrases

    one = pd.DataFrame({"algorithm": ["dp_sgd", "pidp_sgd"], "accountant": ["pld", "pld"]})
    assert accountant_phrases(one) == ["$\\varepsilon$ calibrated by PLD"]
    two = pd.DataFrame({"algorithm": ["dp_sgd", "pidp_sgd", "bolt_on"],
                        "accountant": ["pld", "rdp", "gaussian_analytic"]})
    (phrase,) = accountant_phrases(two)
    assert phrase.startswith("$\\varepsilon$ calibrated by different accountants")
    for named in ("PLD: DP-SGD", "RDP: PIDP-SGD", "analytic Gaussian: bolt-on (output"):
        assert named in phrase, (named, phrase)
    assert accountant_phrases(two.drop(columns="accountant")) == []  # results without the column
    assert accountant_phrases(two.assign(accountant=float("nan"))) == []


def test_a_log_axis_spanning_a_sliver_of_a_decade_labels_its_ticks_apart():
    """δ certified at 1e-5 and 1.00004e-5 on a log axis: matplotlib labels every tick "10⁻⁵"."""
    from dpsgd_cli.plots.layout import thin_ticks

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([10, 100, 1000], [1e-5, 1e-5, 1.00004e-5])
    ax.set_yscale("log")
    thin_ticks(fig)
    assert not [p for p in layout_problems(fig) if "repeat" in p]
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4, 3))  # values apart by less than any label shows: a decade around them
    ax.plot([10, 100, 1000], [1e-5, 1e-5, 1e-5 * (1 + 1e-10)])
    ax.set_yscale("log")
    thin_ticks(fig)
    assert not [p for p in layout_problems(fig) if "repeat" in p] and ax.get_ylim()[1] / ax.get_ylim()[0] > 9
    plt.close(fig)


# --- missing values: no point, never a 0 -------------------------------------------------------------------------

def _blank(path: Path, column: str, rows=None) -> None:
    """`column` of the CSV at `path` emptied (a missing value) where `rows(table)` holds (everywhere by default),
    the other cells kept as written."""
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    chosen = rows(table) if rows else slice(None)
    assert rows is None or chosen.any()
    table.loc[chosen, column] = ""
    table.to_csv(path, index=False)


def _drop(path: Path, rows) -> None:
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    table[~rows(table)].to_csv(path, index=False)


def _drawn(fig) -> list:
    """Every finite point the figure draws (lines, markers, bands), per panel: what the reader sees."""
    from matplotlib.collections import Collection

    panels = []
    for ax in fig.axes:
        points = [tuple(np.round(p, 9)) for line in ax.get_lines() for p in np.asarray(line.get_xydata(), float)
                  if np.isfinite(p).all()]
        for collection in ax.collections:
            assert isinstance(collection, Collection)
            for path in [*collection.get_paths(), *([] if collection.get_offsets() is None else
                                                    [type("P", (), {"vertices": collection.get_offsets()})])]:
                points += [tuple(np.round(p, 9)) for p in np.asarray(path.vertices, float) if np.isfinite(p).all()]
        panels.append(sorted(points))
    return panels


def _grid_folder(tmp_path: Path, grid: str, spec: FigureSpec) -> Path:
    """Synthetic results of a grid of experiments.yaml, with the analytic tables its figures read."""
    folder = synthetic_results(GRIDS[grid], tmp_path / grid)
    if spec.kind == "noise_scale":
        noise_scale(spec).to_csv(folder / f"{spec.name}.csv", index=False)
    if spec.kind == "privacy_curve":
        privacy_curve_table(spec.params).to_csv(folder / f"{spec.name}.csv", index=False)
    return folder


def _private_at(column: str, value: str):
    return lambda t: (t["epsilon"] != "") & (t[column] == value) if "epsilon" in t else t[column] == value


# (grid, figure, the CSV its values come from, the column drawn, the rows of one point of one line)
KINDS = {
    "sweep": ("chourasia", "chourasia_utility", "runs.csv", "optimality_gap", _private_at("epsilon", "1.0")),
    "metric": ("chourasia", None, "runs.csv", "val_accuracy", _private_at("epsilon", "1.0")),
    "traces": ("song_fig3", "song_fig3", "traces.csv", "train_objective",
               lambda t: t["examples"] == t["examples"].iloc[0]),
    "privacy_curve": ("chourasia", "privacy_curve", "privacy_curve.csv", "rdp_epsilon",
                      lambda t: t["K"] == t["K"].iloc[3]),
    "noise_scale": ("bellet", "bellet_noise", "bellet_noise.csv", "sigma", lambda t: t.index == 2),
}


def _spec(grid: str, name, column: str) -> FigureSpec:
    if name is None:  # `dpsgd plot --metric`: the metric over ε, as plot_results lays it out
        return FigureSpec(name=column, metric=column, rows="model", cols="dataset")
    return next(s for s in GRIDS[grid].figures if s.name == name)


def _plotted(folder: Path, spec: FigureSpec, monkeypatch) -> tuple[list, list]:
    """The files `dpsgd plot` writes for `spec`, and the figures it drew (kept open)."""
    from dpsgd_cli.plots import draw_figure

    figures: list = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    return draw_figure(folder, spec, "svg"), figures


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_figure_of_a_column_without_values_is_not_drawn(tmp_path, monkeypatch, capsys, kind):
    grid, name, csv, column, _ = KINDS[kind]
    spec = _spec(grid, name, column)
    folder = _grid_folder(tmp_path, grid, spec)
    _blank(folder / csv, column)
    paths, figures = _plotted(folder, spec, monkeypatch)
    assert paths == [] and figures == []
    assert f"figure {spec.name!r} not drawn" in capsys.readouterr().err


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_missing_value_is_no_point_as_if_its_row_were_not_there(tmp_path, monkeypatch, kind):
    grid, name, csv, column, rows = KINDS[kind]
    spec = _spec(grid, name, column).model_copy(update={"log_y": False})  # a point drawn at 0 would show
    blanked, dropped = (_grid_folder(tmp_path / case, grid, spec) for case in ("blanked", "dropped"))
    _blank(blanked / csv, column, rows)
    _drop(dropped / csv, rows)
    drawn = [_plotted(folder, spec, monkeypatch)[1] for folder in (blanked, dropped)]
    assert len(drawn[0]) == len(drawn[1]) == 1
    assert _drawn(drawn[0][0]) == _drawn(drawn[1][0])
    for fig in (*drawn[0], *drawn[1]):
        plt.close(fig)


def test_dpsgd_plot_of_a_metric_no_run_has_draws_nothing_and_exits_1(tmp_path):
    """A grid without a validation split: val_accuracy has no value; nothing is drawn (not a line at 0)."""
    from typer.testing import CliRunner

    from dpsgd_cli.cli import app

    folder = synthetic_results(GRIDS["chourasia"], tmp_path / "chourasia")
    _blank(folder / "runs.csv", "val_accuracy")
    result = CliRunner().invoke(app, ["plot", str(folder), "--metric", "val_accuracy"])
    assert result.exit_code == 1, result.output
    assert "nothing could be drawn" in result.output and "val_accuracy" in result.output, result.output
    assert not list((folder / "figures").glob("val_accuracy.*"))


def test_the_audit_figure_draws_no_point_without_a_bound_or_a_claim():
    from dpsgd_cli.audit.plot import audit_figure

    nan = float("nan")
    frame = pd.DataFrame({"status": "ok", "threat_model": "black-box, last iterate",
                          "algorithm": ["dp_sgd", "song2013", "bolt_on", "noisy_gd"],
                          "epsilon_claimed": [1.0, 4.0, 8.0, nan], "epsilon_lo": [0.5, nan, 2.0, 1.0]})
    assert audit_figure(frame.assign(epsilon_lo=nan)) is None
    assert audit_figure(frame.assign(epsilon_claimed=nan)) is None
    partial, whole = audit_figure(frame), audit_figure(frame.iloc[[0, 2]])
    try:
        assert _drawn(partial) == _drawn(whole)
    finally:
        plt.close(partial)
        plt.close(whole)


# --- captions out of the image, the one-example marker, legends and ticks -------------------------------------------

ONE_OF_EACH_KIND = list({spec.kind: (grid, spec) for grid, spec in FIGURES}.values())


@pytest.mark.parametrize("grid,spec", ONE_OF_EACH_KIND, ids=[spec.kind for _, spec in ONE_OF_EACH_KIND])
def test_no_caption_writes_each_caption_beside_its_figure(results, grid, spec):
    """Every kind of figure: without a caption the image holds none of its phrases, and <figure>.txt holds them."""
    folder = results(grid)
    if spec.kind in ("privacy_curve", "noise_scale"):  # the analytic table `dpsgd run` writes (σ made up)
        table = privacy_curve_table(spec.params) if spec.kind == "privacy_curve" else noise_scale(spec)
        table.to_csv(folder / f"{spec.name}.csv", index=False)
    with_caption = draw_figure(folder, spec, "png")
    assert not [p for p in with_caption if p.suffix == ".txt"]
    paths = draw_figure(folder, spec, "png", caption=False)
    text = next(p for p in paths if p.suffix == ".txt").read_text(encoding="utf-8")
    assert len(text) > 20 and text.endswith(".\n")
    if spec.kind != "privacy_curve":  # the panel figures: drawn again to look at their text
        frame = FRAMES.get((str(folder), spec.name))
        if frame is not None:
            fig = figure(frame, spec, grid_of(folder), folder.name, caption=False)
            shown = " ".join(t.get_text() for t in fig.texts)
            assert text.split("; ")[0] not in shown
            plt.close(fig)


def test_a_small_test_set_marks_one_example_and_a_large_one_does_not(tmp_path):
    spec = FigureSpec(name="f", metric="test_accuracy", cols="dataset", lines=["algorithm"])
    base = pd.DataFrame({"algorithm": ["dp_sgd"] * 6, "dataset": ["d"] * 6, "epsilon": [1, 1, 2, 2, 4, 4],
                         "test_accuracy": [0.70, 0.71, 0.72, 0.73, 0.74, 0.76], "label": ["DP-SGD"] * 6})
    for n_test, marked in ((114, True), (14000, False)):
        fig = figure(base.assign(n_test=n_test), spec, {}, "g")
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert ("1 test\nexample" in texts) is marked, (n_test, texts)
        plt.close(fig)


def test_a_phrase_shared_by_every_legend_entry_is_said_once_as_its_title():
    fig, ax = plt.subplots(figsize=(5, 3))
    for k, accountant in enumerate(["RDP", "PLD", "dynamics"]):
        ax.plot([1, 2], [k, k + 1], label=f"noisy GD, accountant: {accountant}")
    finish(fig, title="t")
    assert legend_names(fig) == ["RDP", "PLD", "dynamics"]
    assert fig.legends[0].get_title().get_text() == "noisy GD, accountant"
    assert layout_problems(fig) == []
    plt.close(fig)


def test_a_log_axis_under_two_decades_has_plain_ticks_and_the_check_sees_powers():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([1, 2, 3], [0.17, 0.2, 0.24])
    ax.set_yscale("log")
    fig.canvas.draw()
    assert any("log axis over less than two decades" in p for p in layout_problems(fig))  # matplotlib's own
    finish(fig)
    labels = [t.label1.get_text() for t in ax.yaxis.get_major_ticks() if t.label1.get_text()]
    assert labels and all("10" not in lab or lab.startswith("0.") for lab in labels), labels
    assert layout_problems(fig) == []
    plt.close(fig)


def test_more_than_three_bands_become_error_bars(tmp_path):
    spec = FigureSpec(name="f", metric="test_accuracy", cols="dataset", lines=["algorithm"])
    rows = [{"algorithm": f"a{k}", "label": f"line {k}", "dataset": "d", "epsilon": e, "n_test": 10000,
             "test_accuracy": 0.5 + 0.013 * k + 0.02 * e + 0.01 * s} for k in range(5) for e in (1, 2, 4)
            for s in range(3)]
    fig = figure(pd.DataFrame(rows), spec, {}, "g")
    assert layout_problems(fig) == []
    plt.close(fig)
