"""Paper figures and claims: the filter language, each check (able to pass and to fail), and the report."""

import re
import typing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpsgd_cli.config import CheckKind, ClaimSpec, FigureSpec, load_grid_file
from dpsgd_cli.engine.checks import check_grid
from dpsgd_cli.engine.results import select
from dpsgd_cli.errors import UserError
from dpsgd_cli.plots import plot_results
from dpsgd_cli.report import (
    VACUOUS,
    Verdict,
    _check_group,
    build_report,
    check_conditions,
    decide,
    fixed_candidates,
    quantified,
    selection_effect,
    summary_line,
)


def test_select_language():
    frame = pd.DataFrame({"eps": [0.1, 1.0, 3.0, np.nan], "algo": ["a", "b", "a", "c"]})
    assert select(frame, {"eps": ">=1"}).index.tolist() == [1, 2]
    assert select(frame, {"eps": "<1"}).index.tolist() == [0]
    assert select(frame, {"algo": ["a", "c"]}).index.tolist() == [0, 2, 3]
    assert select(frame, {"algo": "a", "eps": "!=0.1"}).index.tolist() == [2]
    with pytest.raises(KeyError):
        select(frame, {"nope": 1})


def _runs(values: dict) -> pd.DataFrame:
    """A results frame: algorithm → {epsilon: [accuracy per seed]}."""
    rows = [{"algorithm": algo, "epsilon": eps, "test_accuracy": acc, "seed": s}
            for algo, by_eps in values.items() for eps, accs in by_eps.items() for s, acc in enumerate(accs)]
    return pd.DataFrame(rows)


def claim(**kw):
    return ClaimSpec(id="c", text="t", **{"own": True, **kw})


def test_monotone_passes_and_fails():
    frame = _runs({"dp": {0.1: [0.80, 0.81], 1.0: [0.83, 0.84], 3.0: [0.835, 0.84]}})
    assert _check_group(frame, claim(check="monotone", a={"algorithm": "dp"}), None)[0] is True
    frame.loc[frame["epsilon"] == 3.0, "test_accuracy"] = 0.82
    assert _check_group(frame, claim(check="monotone", a={"algorithm": "dp"}), None)[0] is False
    assert _check_group(frame, claim(check="monotone", a={"algorithm": "dp"}, tolerance=0.02), None)[0] is True


def test_better_needs_the_gain_beyond_the_seed_spread():
    clear = _runs({"a": {1.0: [0.85, 0.86, 0.85]}, "b": {1.0: [0.80, 0.81, 0.80]}})
    spec = claim(check="better", a={"algorithm": "a"}, b={"algorithm": "b"})
    holds, numbers = _check_group(clear, spec, None)
    assert holds is True and "gain 0.05" in numbers
    noisy = _runs({"a": {1.0: [0.90, 0.80, 0.85]}, "b": {1.0: [0.84, 0.83, 0.85]}})
    assert _check_group(noisy, spec, None)[0] is False  # mean gain 0.01 < 2·SE
    lower = claim(check="better", metric="test_accuracy", a={"algorithm": "b"}, b={"algorithm": "a"},
                  higher_is_better=False)
    assert _check_group(clear, lower, None)[0] is True


def test_within_absolute_and_relative():
    frame = _runs({"a": {1.0: [0.84]}, "b": {1.0: [0.85]}})
    assert _check_group(frame, claim(check="within", a={"algorithm": "a"}, b={"algorithm": "b"},
                                     tolerance=0.011), None)[0] is True
    assert _check_group(frame, claim(check="within", a={"algorithm": "a"}, b={"algorithm": "b"},
                                     tolerance=0.009), None)[0] is False
    assert _check_group(frame, claim(check="within", a={"algorithm": "a"}, b={"algorithm": "b"},
                                     tolerance=0.02, relative=True), None)[0] is True


def test_no_common_values_is_no_data():
    frame = _runs({"a": {1.0: [0.84]}, "b": {3.0: [0.85]}})
    assert _check_group(frame, claim(check="better", a={"algorithm": "a"}, b={"algorithm": "b"}), None)[0] is None


def test_saturates():
    table = pd.DataFrame({"K": [1, 10, 100], "bound": "dynamics", "rdp_epsilon": [0.01, 0.04, 0.0479]})
    spec = claim(check="saturates", metric="rdp_epsilon", a={"bound": "dynamics"}, over="K", tolerance=0.01)
    assert _check_group(table, spec, 0.048)[0] is True
    assert _check_group(table, spec, 0.06)[0] is False


GRID = """
grids:
  - name: figs
    datasets: [{name: synthetic, n: 500}]
    algorithms: [erm, {name: song2013, lr: [1.0]}, {name: song2013_nonprivate, lr: [1.0]}]
    epsilon: [1]
    batch_size: [1, 5]
    epochs: 1
    seeds: 2
    trace_every: 100
    figures:
      - {name: trace_fig, kind: traces, metric: train_objective, rows: batch_size, cols: dataset, log_x: false}
      - {name: b_fig, kind: sweep, x: batch_size, metric: train_objective, lines: [algorithm]}
      - {name: curve, kind: privacy_curve, params: {k_max: 300, points: 50}}
    claims:
      - {id: sat, text: the dynamics bound saturates, quote: 'Talk: "saturates"', check: saturates, source: curve,
         metric: rdp_epsilon,
         a: {bound: dynamics}, over: K, tolerance: 0.05}
      - {id: nonpriv-better, text: non-private SGD reaches a lower objective, own: true, check: better,
         metric: train_objective, higher_is_better: false, a: {algorithm: song2013_nonprivate},
         b: {algorithm: song2013}, over: batch_size}
      - {id: missing, text: refers to nothing, own: true, check: better, a: {algorithm: dp_sgd}, b: {algorithm: erm}}
      - {id: sat-formula, text: the same curve as a formula check, own: true, kind: formula_check, check: saturates,
         source: curve, metric: rdp_epsilon, a: {bound: dynamics}, over: K, tolerance: 0.05,
         reading: the limit of the closed form}
      - {id: flat, text: the training set size does not fall with the batch size, own: true, check: monotone,
         metric: n_train, a: {algorithm: song2013}, over: batch_size}
"""


def test_figures_and_report_end_to_end(tmp_path, run_grid):
    run_grid(GRID)
    assert (tmp_path / "out" / "figs" / "curve.csv").exists()
    figures = plot_results(tmp_path / "out")
    names = sorted(p.name for p in figures)
    assert names == ["b_fig.pdf", "b_fig.png", "curve.pdf", "curve.png", "trace_fig.pdf", "trace_fig.png"]
    assert all(p.stat().st_size > 5_000 for p in figures)
    verdicts, report = build_report(tmp_path / "out")
    status = {v.claim.id: v.status for v in verdicts}
    assert status == {"sat": "PASS", "nonpriv-better": "PASS", "missing": "NO DATA", "sat-formula": "PASS",
                      "flat": "VACUOUS"}  # n_train is one value: it passed as monotone before VACUOUS existed
    text = report.read_text()
    assert "![trace_fig](figs/figures/trace_fig.png)" in text and "| **sat**" in text
    findings, formulas = text.split("## Formula checks")
    assert "sat-formula" not in findings and "| figs | **sat-formula**" in formulas  # its own table
    assert "reading: the limit of the closed form" in formulas
    assert ("findings: 2 PASS, 0 FAIL, 1 VACUOUS, 1 NO DATA; formula checks: 1 PASS, 0 FAIL, 0 VACUOUS, 0 NO DATA"
            in text)
    risk = findings.split("### Attack risk beside ε")[1]  # song2013's pure ε-DP (no dp_event): TPR ≤ e^ε α
    assert "| song2013 batch_size=1 | 1 | 0.0272 | 0.00272 | — |" in risk and "erm" not in risk


def test_plot_and_report_in_workers_write_what_one_process_writes(tmp_path, run_grid):
    """`--jobs 2`: each grid's folder drawn and checked in a forked worker; the same files, the same report."""
    run_grid(GRID)
    run_grid(GRID.replace("name: figs", "name: figs_again"))
    one = sorted(p.relative_to(tmp_path) for p in plot_results(tmp_path / "out"))
    report_one = build_report(tmp_path / "out")[1].read_text()
    two = sorted(p.relative_to(tmp_path) for p in plot_results(tmp_path / "out", jobs=2))
    verdicts, report = build_report(tmp_path / "out", jobs=2)
    assert one == two and len(two) == 12 and report.read_text() == report_one
    assert [v.grid for v in verdicts] == ["figs"] * 5 + ["figs_again"] * 5  # in the folders' order


def test_figure_spec_validation():
    with pytest.raises(ValueError):  # pydantic's ValidationError
        FigureSpec(name="x", kind="bar")


def test_rows_of_an_earlier_grid_version_are_kept_but_not_shown(tmp_path, run_grid):
    from dpsgd_cli.engine.results import ResultStore
    from dpsgd_cli.engine.selection import results_frame

    text = ("grids: [{name: g, datasets: [{name: synthetic, n: 300}], algorithms: [sgd], lr: [0.5], batch_size: 20, "
            "seeds: 2, epochs: 1}]")
    run_grid(text)
    run_grid(text.replace("lr: [0.5]", "lr: [0.25]"))
    assert len(ResultStore(tmp_path / "out" / "g").read()) == 4  # nothing computed is lost
    shown = results_frame(tmp_path / "out" / "g")
    assert len(shown) == 2 and set(shown["lr"]) == {0.25}


def test_claim_needs_a_quote_or_own():
    with pytest.raises(ValueError, match="quote"):
        ClaimSpec(id="c", text="t", check="monotone")
    assert ClaimSpec(id="c", text="t", check="monotone", quote='Song et al. §4: "..."').quote
    assert ClaimSpec(id="c", text="t", check="monotone", own=True).own


@pytest.mark.parametrize("decided, expected", [
    ([True, True, True], {"all": True, "most": True, "some": True}),
    ([True, True, False], {"all": False, "most": True, "some": True}),
    ([True, False], {"all": False, "most": False, "some": True}),  # half is not most
    ([False, False], {"all": False, "most": False, "some": False}),
])
def test_quantifiers_over_groups(decided, expected):
    for quantifier, holds in expected.items():
        assert quantified(decided, quantifier) is holds


def _spread_frame(std_a: float, std_b: float, n: int = 20, seed: int = 0) -> pd.DataFrame:
    """Two selections whose values over n seeds have exactly the given sample standard deviations."""
    z = np.random.default_rng(seed).standard_normal(n)
    z = (z - z.mean()) / z.std(ddof=1)
    return _runs({"a": {1.0: list(1.0 + std_a * z)}, "b": {1.0: list(1.0 + std_b * z[::-1])}})


def test_spread_lower_bound_is_the_one_sided_f_test():
    from scipy.stats import f as f_dist

    from dpsgd_cli.report import spread_ratio_bounds

    ratio, lower, upper = spread_ratio_bounds(2.0, 20, 1.0, 20, 0.95)
    assert ratio == pytest.approx(2.0)
    assert lower == pytest.approx(2.0 / np.sqrt(2.168), rel=1e-4)  # F_0.95(19, 19) = 2.168 (tables)
    assert lower < ratio < upper
    # the lower bound exceeds r exactly when the F-test of H0: σ_a/σ_b = r rejects at 5% (one-sided)
    for s_a, r in [(1.4, 1.0), (1.8, 1.0), (3.0, 2.0), (4.5, 2.0)]:
        p_value = f_dist.sf((s_a / r) ** 2, 19, 19)
        assert (spread_ratio_bounds(s_a, 20, 1.0, 20, 0.95)[1] > r) == (p_value < 0.05)


def test_spread_passes_and_fails():
    spec = claim(check="spread", metric="test_accuracy", a={"algorithm": "a"}, b={"algorithm": "b"}, over=None)
    holds, numbers = _check_group(_spread_frame(3.0, 1.0), spec, None)
    assert holds is True and "ratio 3" in numbers
    assert _check_group(_spread_frame(1.2, 1.0), spec, None)[0] is False  # 1.2× over 20 seeds: not significant
    assert _check_group(_spread_frame(1.0, 3.0), spec, None)[0] is False
    twice = claim(check="spread", metric="test_accuracy", a={"algorithm": "a"}, b={"algorithm": "b"}, over=None,
                  tolerance=1.0)  # "dramatically": at least twice the std at 95%
    assert _check_group(_spread_frame(2.5, 1.0), twice, None)[0] is False  # lower bound 1.70 < 2
    assert _check_group(_spread_frame(5.0, 1.0), twice, None)[0] is True
    with pytest.raises(ValueError, match="at least 2 seeds"):
        _check_group(_runs({"a": {1.0: [0.5]}, "b": {1.0: [0.4, 0.6]}}), spec, None)


def test_spread_claims_in_experiments_yaml_carry_quotes():
    from pathlib import Path

    from dpsgd_cli.config import load_grid_file

    grids = {g.name: g for g in load_grid_file(Path(__file__).parents[1] / "experiments.yaml").grids}
    spread = [c for name in ("song_fig1", "song_fig3") for c in grids[name].claims if c.check == "spread"]
    assert len(spread) >= 3 and all(c.quote and not c.own for c in spread)


def test_fluctuates_needs_a_reversal_beyond_the_seed_noise():
    spec = claim(check="fluctuates", a={"algorithm": "dp"})
    dip = _runs({"dp": {0.1: [0.80, 0.81, 0.80], 1.0: [0.86, 0.85, 0.86], 3.0: [0.82, 0.83, 0.82]}})
    holds, numbers = _check_group(dip, spec, None)
    assert holds is True and "epsilon=1 → 3" in numbers  # falls by 0.033 against 2·SE ≈ 0.01
    noisy = _runs({"dp": {0.1: [0.80, 0.81, 0.80], 1.0: [0.90, 0.80, 0.86], 3.0: [0.82, 0.83, 0.84]}})
    assert _check_group(noisy, spec, None)[0] is False  # the same dip within the seed spread
    rising = _runs({"dp": {0.1: [0.80, 0.81, 0.80], 1.0: [0.83, 0.84, 0.83], 3.0: [0.85, 0.86, 0.85]}})
    assert _check_group(rising, spec, None)[0] is False
    assert _check_group(dip, claim(check="fluctuates", a={"algorithm": "dp"}, tolerance=0.05), None)[0] is False
    gap = dip.assign(test_accuracy=1 - dip["test_accuracy"])  # a decreasing metric that rises at ε = 3
    assert _check_group(gap, claim(check="fluctuates", a={"algorithm": "dp"}, direction="decreasing"),
                        None)[0] is True
    one_seed = _runs({"dp": {0.1: [0.80], 1.0: [0.86], 3.0: [0.82]}})
    assert _check_group(one_seed, spec, None)[0] is None  # no seed noise to compare against


def test_widens_needs_the_gain_to_grow_beyond_the_seed_noise():
    spec = claim(check="widens", a={"algorithm": "a"}, b={"algorithm": "b"})
    growing = _runs({"a": {0.1: [0.70, 0.71, 0.70], 1.0: [0.82, 0.83, 0.82], 3.0: [0.86, 0.87, 0.86]},
                     "b": {0.1: [0.72, 0.73, 0.72], 1.0: [0.82, 0.82, 0.83], 3.0: [0.83, 0.84, 0.83]}})
    holds, numbers = _check_group(growing, spec, None)
    assert holds is True and "0.1: -0.02" in numbers and "3: 0.03" in numbers  # gain −0.02 → +0.03
    assert _check_group(growing, claim(check="widens", a={"algorithm": "b"}, b={"algorithm": "a"}),
                        None)[0] is False  # b's gain over a shrinks
    spread = {"a": [0.0, 0.09, -0.09], "b": [0.06, -0.06, 0.0]}  # the same means, seeds far apart
    noisy = growing.copy()
    for algo, offsets in spread.items():
        for eps in (0.1, 1.0, 3.0):
            rows = (noisy["algorithm"] == algo) & (noisy["epsilon"] == eps)
            noisy.loc[rows, "test_accuracy"] = noisy.loc[rows, "test_accuracy"].mean() + np.array(offsets)
    assert _check_group(noisy, spec, None)[0] is False
    assert _check_group(growing, claim(check="widens", a={"algorithm": "b"}, b={"algorithm": "a"},
                                       higher_is_better=False), None)[0] is True
    two = growing[growing["epsilon"] != 1.0]
    assert _check_group(two, spec, None)[0] is None  # a slope needs 3 values


def test_a_flat_curve_is_vacuous_for_monotone_and_fluctuates():
    flat = _runs({"dp": {0.1: [0.0, 0.0], 1.0: [0.0, 0.0], 3.0: [0.0, 0.0]}})  # e.g. no step ever skips the noise
    for check in ("monotone", "fluctuates"):
        for direction in ("increasing", "decreasing"):
            spec = claim(check=check, a={"algorithm": "dp"}, direction=direction)
            assert _check_group(flat, spec, None)[0] == VACUOUS
    within_tolerance = _runs({"dp": {0.1: [0.80, 0.80], 1.0: [0.803, 0.803], 3.0: [0.801, 0.801]}})
    assert _check_group(within_tolerance, claim(check="monotone", a={"algorithm": "dp"}, tolerance=0.005),
                        None)[0] == VACUOUS
    assert _check_group(within_tolerance, claim(check="monotone", a={"algorithm": "dp"}), None)[0] is False
    missing = flat.assign(test_accuracy=np.nan)
    assert _check_group(missing, claim(check="monotone", a={"algorithm": "dp"}), None)[0] == VACUOUS


def test_one_value_on_every_compared_row_is_vacuous():
    zeros = _runs({"a": {0.1: [0.0, 0.0], 3.0: [0.0, 0.0]}, "b": {0.1: [0.0, 0.0], 3.0: [0.0, 0.0]}})
    for check in ("better", "within", "not_worse"):
        assert _check_group(zeros, claim(check=check, a={"algorithm": "a"}, b={"algorithm": "b"}),
                            None)[0] == VACUOUS
    assert _check_group(zeros.assign(test_accuracy=np.nan), claim(check="better", a={"algorithm": "a"},
                                                                    b={"algorithm": "b"}), None)[0] == VACUOUS
    # close but distinct values are evidence, for a `within` or against a `better` with a margin
    close = _runs({"a": {1.0: [0.84, 0.84]}, "b": {1.0: [0.85, 0.85]}})
    assert _check_group(close, claim(check="within", a={"algorithm": "a"}, b={"algorithm": "b"},
                                     tolerance=0.02), None)[0] is True
    assert _check_group(close, claim(check="better", a={"algorithm": "b"}, b={"algorithm": "a"},
                                     tolerance=0.02), None)[0] is False
    no_spread = _runs({"a": {1.0: [0.9, 0.9]}, "b": {1.0: [0.8, 0.8]}})
    assert _check_group(no_spread, claim(check="spread", a={"algorithm": "a"}, b={"algorithm": "b"}),
                        None)[0] == VACUOUS
    table = pd.DataFrame({"K": [1, 10, 100], "bound": "dynamics", "rdp_epsilon": 0.048})
    spec = claim(check="saturates", metric="rdp_epsilon", a={"bound": "dynamics"}, over="K", tolerance=0.01)
    assert _check_group(table, spec, 0.048)[0] == VACUOUS


def test_not_worse_is_one_sided():
    frame = _runs({"min": {1.0: [0.0500]}, "dyn": {1.0: [0.0501]}, "comp": {1.0: [0.0800]}})
    less = claim(check="not_worse", metric="test_accuracy", higher_is_better=False, tolerance=0.002, relative=True,
                 a={"algorithm": "min"}, b={"algorithm": "dyn"})
    assert _check_group(frame, less, None)[0] is True
    assert _check_group(frame, less.model_copy(update={"b": {"algorithm": "comp"}}), None)[0] is True  # far less
    assert _check_group(frame, less.model_copy(update={"a": {"algorithm": "comp"}}), None)[0] is False
    within = less.model_copy(update={"check": "within", "b": {"algorithm": "comp"}})
    assert _check_group(frame, within, None)[0] is False  # the two-sided check refuses "far less"


def test_vacuous_groups_count_neither_way():
    spec = claim(check="monotone", group_by=["dataset"])
    status, numbers = decide([(True, "✓ [a]"), (VACUOUS, "○ [b]"), (VACUOUS, "○ [c]")], spec)
    assert status == "PASS" and numbers.startswith("1 of 1 groups hold (all must) (2 vacuous, not counted)")
    assert decide([(VACUOUS, "○ [b]"), (None, "? [c]")], spec)[0] == "VACUOUS"
    assert decide([(None, "? [c]")], spec)[0] == "NO DATA"
    assert decide([(False, "✗ [a]"), (VACUOUS, "○ [b]")], spec.model_copy(update={"quantifier": "some"}))[0] == "FAIL"


def test_summary_counts_each_verdict_and_formula_checks_apart():
    finding, formula = claim(check="monotone"), claim(check="monotone", kind="formula_check")
    verdicts = [Verdict("g", finding, s, "") for s in ("PASS", "PASS", "FAIL", "VACUOUS", "NO DATA")]
    verdicts += [Verdict("g", formula, s, "") for s in ("PASS", "FAIL", "VACUOUS")]
    assert summary_line(verdicts) == ("findings: 2 PASS, 1 FAIL, 1 VACUOUS, 1 NO DATA; "
                                      "formula checks: 1 PASS, 1 FAIL, 1 VACUOUS, 0 NO DATA")
    assert summary_line(verdicts[:1]) == "findings: 1 PASS, 0 FAIL, 0 VACUOUS, 0 NO DATA"


def test_reading_is_shown_beside_the_claim():
    from dpsgd_cli.report import _table

    spec = ClaimSpec(id="c", text="t", check="monotone", quote='Kang et al.: "x | y"', reading="a choice, and why")
    row = _table([Verdict("g", spec, "PASS", "n")])[-1]
    assert row.startswith("| **c**: t<br>*Kang et al.: \"x \\| y\"*<br>reading: a choice, and why | PASS | n |")


def test_experiments_yaml_claims_on_analytic_tables_are_formula_checks():
    from pathlib import Path

    from dpsgd_cli.config import load_grid_file

    for grid in load_grid_file(Path(__file__).parents[1] / "experiments.yaml").grids:
        for c in grid.claims:
            if c.source not in ("runs", "traces"):
                assert c.kind == "formula_check", c.id


@pytest.mark.parametrize("column, which, same, other, said", [
    ("neighbours", "dp", "replace_one", "add_remove", " [mixed neighbouring relations: add_remove, replace_one]"),
    ("accountant", "pidp", "pld", "rdp", " [mixed accountants: pld, rdp]"),
])
def test_a_claim_comparing_epsilons_on_different_footings_says_so(column, which, same, other, said):
    """Rows of one claim under different neighbouring relations, or calibrated by different accountants."""
    from dpsgd_cli.report import _mixed_footings as mixed

    frame = _runs({"dp": {1.0: [0.80, 0.81]}, "pidp": {1.0: [0.82, 0.83]}})
    better = claim(check="better", a={"algorithm": "pidp"}, b={"algorithm": "dp"})
    frame[column] = same
    assert mixed(frame, better) == ""
    frame.loc[frame["algorithm"] == which, column] = other
    assert mixed(frame, better) == said
    assert mixed(frame.drop(columns=column), better) == ""


def test_above_and_below_compare_the_mean_with_a_level():
    zeros = _runs({"pidp": {0.01: [0.0, 0.0], 3.0: [0.0, 0.0]}})  # no step ever skipped the noise
    exceeds = claim(check="above", metric="test_accuracy", a={"algorithm": "pidp", "epsilon": 3.0}, over=None)
    holds, numbers = _check_group(zeros, exceeds, None)
    assert holds is False and "(> 0?)" in numbers  # one value everywhere decides a level: not VACUOUS
    some = zeros.assign(test_accuracy=[0.0, 0.0, 0.0, 0.002])
    assert _check_group(some, exceeds, None)[0] is True
    assert _check_group(some, exceeds.model_copy(update={"tolerance": 0.01}), None)[0] is False
    below = claim(check="below", metric="test_accuracy", a={"algorithm": "pidp"}, value=0.001)
    assert _check_group(some, below, None)[0] is False  # ε = 3: mean 0.001 is not below 0.001
    assert _check_group(zeros, below, None)[0] is True
    assert _check_group(zeros.assign(test_accuracy=np.nan), below, None)[0] == VACUOUS


def test_a_claim_holds_where_every_condition_holds():
    grows_and_exceeds = claim(check="better", metric="test_accuracy", a={"algorithm": "pidp", "epsilon": 3.0},
                              b={"algorithm": "pidp", "epsilon": 0.01}, over=None,
                              also=[{"text": "exceeds 0 at epsilon = 3", "check": "above"}])
    zeros = _runs({"pidp": {0.01: [0.0, 0.0, 0.0], 3.0: [0.0, 0.0, 0.0]}})
    assert _check_group(zeros, grows_and_exceeds, None)[0] == VACUOUS  # the first condition alone
    holds, numbers = check_conditions(zeros, grows_and_exceeds, None)
    assert holds is False  # the text's own second condition fails: no longer VACUOUS
    assert numbers.startswith("(1) better: ○ ") and "(2) exceeds 0 at epsilon = 3: ✗ " in numbers
    rising = _runs({"pidp": {0.01: [0.0, 0.0, 0.0], 3.0: [0.2, 0.21, 0.2]}})
    assert check_conditions(rising, grows_and_exceeds, None)[0] is True
    flat_positive = _runs({"pidp": {0.01: [0.2, 0.2, 0.2], 3.0: [0.2, 0.2, 0.2]}})
    assert check_conditions(flat_positive, grows_and_exceeds, None)[0] == VACUOUS  # one decided, one not
    status, _ = decide([check_conditions(zeros, grows_and_exceeds, None)], grows_and_exceeds)
    assert status == "FAIL"


def test_a_pass_that_rests_on_the_selection_is_said_or_refused():
    runs = _runs({"dp": {0.1: [0.8, 0.8], 1.0: [0.9, 0.9]}, "erm": {np.nan: [0.95]}})
    runs["epochs"] = [2, 5, 2, 5, np.nan]
    fixed = fixed_candidates(runs, ["epochs"])
    assert [label for label, _ in fixed] == ["epochs=2", "epochs=5"]
    assert all("erm" in set(rows["algorithm"]) for _, rows in fixed)  # the reference belongs to every T
    spec = claim(check="fluctuates")
    status, text = selection_effect("PASS", [("epochs=2", "FAIL"), ("epochs=5", "FAIL")], ["epochs"], spec)
    assert status == "PASS" and "epochs=2 FAIL" in text and "rests on the selection's choice of epochs" in text
    strict = spec.model_copy(update={"unselected": "some"})
    assert selection_effect("PASS", [("epochs=2", "FAIL"), ("epochs=5", "FAIL")], ["epochs"], strict)[0] == "FAIL"
    assert selection_effect("PASS", [("epochs=2", "FAIL"), ("epochs=5", "PASS")], ["epochs"], strict)[0] == "PASS"
    every = spec.model_copy(update={"unselected": "all"})
    assert selection_effect("PASS", [("epochs=2", "FAIL"), ("epochs=5", "PASS")], ["epochs"], every)[0] == "FAIL"
    assert selection_effect("FAIL", [("epochs=2", "PASS")], ["epochs"], every)[0] == "FAIL"


SELECTED = """
grids:
  - name: sel
    datasets: [{name: synthetic, n: 400}]
    algorithms: [{name: dp_sgd, accountant: pld}]
    epsilon: [0.5, 2]
    batch_size: [50]
    lr: [0.5]
    epochs: [1, 2]
    seeds: 2
    validation: 0.2
    select: {name: T, candidates: [epochs], score: val_accuracy}
    claims:
      - {id: grows, text: accuracy grows, own: true, check: monotone, a: {algorithm: dp_sgd}, tolerance: 0.5,
         unselected: all}
"""


def test_a_claim_on_a_selected_grid_shows_each_fixed_candidate(tmp_path, run_grid):
    run_grid(SELECTED)
    verdicts, _ = build_report(tmp_path / "out")
    (verdict,) = verdicts
    assert "unselected runs at fixed epochs: epochs=1 " in verdict.numbers and ", epochs=2 " in verdict.numbers


def test_long_pointwise_checks_show_their_ends_and_where_they_fail():
    table = pd.DataFrame({"K": np.arange(1, 101), "bound": "x", "rdp_epsilon": 0.01})
    lower = table.assign(bound="y", rdp_epsilon=0.004)
    lower.loc[lower["K"] == 50, "rdp_epsilon"] = 0.001
    spec = claim(check="not_worse", metric="rdp_epsilon", higher_is_better=False, a={"bound": "x"},
                 b={"bound": "y"}, over="K", tolerance=3.0, relative=True)
    holds, numbers = _check_group(pd.concat([table, lower]), spec, None)
    assert holds is False and "K=50:" in numbers and "K=1:" in numbers and "K=100:" in numbers
    assert "K=20:" not in numbers and numbers.endswith("(100 values of K; it fails at 1)")


def test_claim_conditions_are_checked_before_any_work(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(SELECTED.replace("unselected: all}", "also: [{text: x, check: above, metric: nope}]}"))
    with pytest.raises(UserError, match=r"claims\[0\] \(grows\) also\[0\].*nope"):
        check_grid(load_grid_file(path).grids[0])
    path.write_text(SELECTED.replace("    select: {name: T, candidates: [epochs], score: val_accuracy}\n", ""))
    with pytest.raises(UserError, match="unselected = 'all' needs a grid with select"):
        check_grid(load_grid_file(path).grids[0])


def test_every_check_kind_is_in_the_docs_table():
    page = (Path(__file__).parents[1] / "docs" / "papers" / "claims.md").read_text()
    section = page.split("## How a check decides", 1)[1].split("\n## ", 1)[0]
    tabled = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))
    assert tabled == set(typing.get_args(CheckKind))


def test_a_condition_inherits_what_it_leaves_out_after_a_manifest_round_trip():
    spec = claim(check="better", metric="train_objective", a={"algorithm": "p", "batch_size": 10},
                 b={"algorithm": "p", "batch_size": 50}, over=None, higher_is_better=False,
                 also=[{"text": "b = 10 beats b = 1", "check": "better", "b": {"algorithm": "p", "batch_size": 1}}])
    for one in (spec, ClaimSpec(**spec.model_dump())):  # the manifest records every key, defaults included
        second = one.conditions()[1]
        assert second.a == {"algorithm": "p", "batch_size": 10} and second.over is None
        assert second.b == {"algorithm": "p", "batch_size": 1} and second.higher_is_better is False


def test_every_check_kind_is_in_the_readme_grid_keys():
    row = next(line for line in (Path(__file__).parents[1] / "README.md").read_text().splitlines()
               if line.startswith("| `claims` |"))
    listed = re.search(r"check \(([^)]*)\)", row).group(1).replace("\\|", "|").split("|")
    assert set(listed) == set(typing.get_args(CheckKind))
