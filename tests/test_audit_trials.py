"""The audit's default trials per cell: what refuting the noise × 0.5 control needs (an optimal attack at its
expected counts, twice over), within the time budget; `dpsgd audit --dry-run` shows them with the estimated time."""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pandas as pd
import pytest
import scipy.stats
from typer.testing import CliRunner

from dpsgd_cli.audit import engine, stats
from dpsgd_cli.cli import app
from dpsgd_cli.config import AuditSpec, GridFile, expand


def _gaussian(mu: float):
    return lambda fpr: float(scipy.stats.norm.cdf(scipy.stats.norm.ppf(fpr) + mu))


def test_trials_to_refute_are_enough_and_not_twice_too_many():
    """At the trials found the rule refutes the claim at the attack's expected counts, at half of them it does not;
    a stronger attack needs fewer; a mechanism exactly at the claim (its (ε, δ) region's largest TPR) is never
    refuted."""
    claim, delta, confidence = 1.0, 1e-5, 0.99
    weak, strong = _gaussian(stats.gdp_mu_of_epsilon(3.0, delta)), _gaussian(stats.gdp_mu_of_epsilon(5.0, delta))
    n = stats.trials_to_refute(weak, claim, confidence, delta)
    assert n is not None and stats.refutes_expected(n, weak, claim, confidence, delta)
    assert not stats.refutes_expected(n // 2, weak, claim, confidence, delta)
    assert stats.trials_to_refute(strong, claim, confidence, delta) < n
    tight = lambda fpr: min(1.0, np.exp(claim) * fpr + delta)
    assert stats.trials_to_refute(tight, claim, confidence, delta, limit=20_000) is None


def _cell(**grid):
    base = dict(name="t", datasets=[{"name": "synthetic", "n": 300, "dim": 5}], models=["logreg"], seeds=1,
                delta=1e-5, clip_norm=1.0, l2=1e-3, lr=0.5, epochs=1, batch_size=32, epsilon=[1.0],
                algorithms=["dp_sgd"])
    return expand(GridFile.model_validate({"grids": [{**base, **grid}]}).grids[0])[0]


def test_default_trials_refute_the_half_noise_control_within_the_budget():
    """Without trials in the grid: MARGIN × the trials the optimal attack on the half-noise twin needs (its ε from
    the accountant, above the claim), as many as the budget affords when fewer (the most it affords), never below
    MIN_TRIALS; the grid's or the caller's trials win over both."""
    cell = _cell()
    roomy = engine.plan_trials(cell, AuditSpec(canaries=["dirac"], budget=1e6))
    assert roomy.control_epsilon > cell.epsilon and roomy.needed is not None
    assert roomy.needed % engine.MARGIN == 0 and roomy.trials == roomy.needed
    budget = roomy.seconds / (engine.REACH + 1)  # what refuting the control takes is out of reach
    tight = engine.plan_trials(cell, AuditSpec(canaries=["dirac"], budget=budget))
    assert engine.MIN_TRIALS < tight.trials < roomy.trials and tight.seconds <= budget
    assert engine.plan_trials(cell, AuditSpec(canaries=["dirac"], budget=budget * 1.1)).seconds > budget  # the most
    assert engine.plan_trials(cell, AuditSpec(canaries=["dirac"], budget=1e-9)).trials == engine.MIN_TRIALS
    assert engine.plan_trials(cell, AuditSpec(canaries=["dirac"], trials=77)).trials == 77
    assert engine.plan_trials(cell, AuditSpec(canaries=["dirac"], trials=77), trials=55).trials == 55
    # a smaller claim is harder to refute with the same factor on the noise: more trials needed
    assert engine.plan_trials(_cell(epsilon=[0.5]), AuditSpec(canaries=["dirac"], budget=1e6)).needed > roomy.needed


def test_a_cell_within_reach_of_refuting_the_half_noise_control_gets_it():
    """Where the noise × 0.5 control's trials cost at most REACH budgets, the cell gets them (and takes that
    time); just beyond, the budget binds as before (the most it affords)."""
    cell = _cell(epsilon=[0.5])
    roomy = engine.plan_trials(cell, AuditSpec(canaries=["dirac"], budget=1e6))
    assert roomy.needed is not None and roomy.trials == roomy.needed
    reach = roomy.seconds / engine.REACH
    within = engine.plan_trials(cell, AuditSpec(canaries=["dirac"], budget=reach * 1.001))
    assert within.trials == roomy.needed and within.table == roomy.table and within.seconds > reach
    beyond = engine.plan_trials(cell, AuditSpec(canaries=["dirac"], budget=reach * 0.999))
    assert engine.MIN_TRIALS < beyond.trials < roomy.needed and beyond.seconds <= reach * 0.999


GRID = """
grids:
  - name: auto_trials
    datasets: [{name: synthetic, n: 300, dim: 5}]
    algorithms: [dp_sgd]
    epsilon: [1, 4]
    batch_size: [32]
    epochs: 1
    lr: 0.5
    l2: 1.0e-3
    seeds: 1
    delta: 1.0e-5
    audit: {canaries: [input], budget: 1.0e-6}
"""


def test_dry_run_shows_each_cells_trials_and_time_and_the_audit_uses_them(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(GRID))
    result = CliRunner().invoke(app, ["audit", str(grid), "--out", str(tmp_path / "res"), "--dry-run"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "σ/2 needs" in result.output and "est. time" in result.output and "controls' trials" in result.output
    rows = [line.split() for line in result.output.splitlines() if re.match(r"\s*[14]\s+100\s+[\d,]+\s", line)]
    assert len(rows) == 2 and all(row[-1] == "s" and float(row[-2]) >= 0 for row in rows), result.output
    assert not (tmp_path / "res").exists()  # nothing trained, nothing written
    result = CliRunner().invoke(app, ["audit", str(grid), "--out", str(tmp_path / "res")])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "res" / "auto_trials" / "audit.csv")
    assert (frame["trials"] == engine.MIN_TRIALS).all() and (frame["status"] == "ok").all()


def test_each_control_gets_what_refuting_it_takes_within_the_cells_trials():
    """Per variant: the cell's white-box rows and the noise × 0.5 control's get what refuting that control takes;
    the twin and no clipping (true ε far above) what refuting each takes (at least CONTROL_MIN_TRIALS), fewer; a control
    whose need is beyond the cell's trials MIN_TRIALS; the black-box input canary, beside a white-box one, what the
    twin and no clipping take; every kind's trials in the estimated time, within the budget where it binds."""
    cell = _cell()
    plan = engine.plan_trials(cell, AuditSpec(budget=1e6))  # input and Dirac canaries, the whole ladder
    assert set(plan.table) == {"cell", "control", "sigma_t10", "noise_half", "no_clip"}
    assert plan.of("cell", "dirac") == plan.of("noise_half", "dirac") == plan.needed == plan.trials
    for key in ("control", "no_clip"):
        need = plan.needs[key]
        assert need is not None and plan.of(key, "dirac") == max(engine.CONTROL_MIN_TRIALS, need) < plan.trials
    assert plan.needs["sigma_t10"] is None or plan.needs["sigma_t10"] > plan.trials
    assert plan.of("sigma_t10", "dirac") == engine.MIN_TRIALS
    black = max(plan.of("control", "dirac"), plan.of("no_clip", "dirac"))
    assert all(plan.of(key, "input") == min(black, plan.of(key, "dirac")) for key in plan.table)
    assert plan.seconds == pytest.approx(sum(plan.of(key, kind) * plan.kind_seconds[kind]
                                             for key in plan.table for kind in ("input", "dirac")))
    tight = engine.plan_trials(cell, AuditSpec(budget=plan.seconds / 4))
    assert tight.trials < plan.trials and tight.seconds <= plan.seconds / 4
    assert tight.of("control", "dirac") == plan.of("control", "dirac")  # the cheap controls keep what they need
    uniform = engine.plan_trials(cell, AuditSpec(trials=300))
    assert {uniform.of(key, kind) for key in ("cell", *plan.table) for kind in ("input", "dirac")} == {300}


def test_each_rows_bounds_are_at_its_own_trials_and_level():
    """The audit trains each variant with its planned trials (audit.csv's `<key>_trials`, each row's `trials`), and
    each bound is its own scores' at its own family's level: recomputed from the raw scores."""
    cell = _cell()
    spec = AuditSpec(canaries=["dirac"], budget=4.0)
    plan = engine.plan_trials(cell, spec)
    scores: dict = {}
    rows = engine.audit_cell(cell, spec, scores=scores)
    assert rows and all(r["status"] == "ok" for r in rows)
    assert len({r[f"{key}_trials"] for r in rows for key in ("control", "noise_half")}) == 2  # they differ
    for r in rows:
        assert r["trials"] == plan.trials
        prefix = engine._key("dirac", r["threat_model"], "")
        for key in ("control", "sigma_t10", "noise_half", "no_clip"):
            s_in, s_out = scores[f"{key}.{prefix}in"], scores[f"{key}.{prefix}out"]
            assert r[f"{key}_trials"] == plan.of(key, "dirac") == s_in.size == s_out.size
            assert r[f"{key}_epsilon_lo"] == stats.epsilon_clopper_pearson(
                s_in, s_out, r[f"{key}_row_confidence"], r["delta"], "order", claim=r["epsilon_claimed"])


@pytest.mark.parametrize("algorithm", ["output_perturbation", "bassily2014"])
def test_a_fit_alone_cells_trials_do_not_depend_on_the_clock(monkeypatch, algorithm):
    """An algorithm trained by `fit` alone (no chain to estimate) is planned from the work its pilot fit reports,
    not from how long it took: the plan is the same with a clock that reads a minute on at every look (a loaded
    machine)."""
    cell = _cell(algorithms=[algorithm], epochs=1)
    spec = AuditSpec(canaries=["input"], budget=1.0)
    real = engine.plan_trials(cell, spec)
    ticks = iter(np.arange(0.0, 1e9, 60.0))  # every reading a minute after the last
    monkeypatch.setattr(engine.time, "perf_counter", lambda: float(next(ticks)))
    slow = engine.plan_trials(cell, spec)
    assert slow == real
    assert real.trials > engine.MIN_TRIALS  # the budget affords more than the least (the clock could move it)


def test_dry_run_shows_the_trials_a_fit_alone_cell_is_audited_with(tmp_path):
    """The plan of a cell trained by `fit` alone is a function of the cell: the dry run's trials are the run's."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(GRID).replace("[dp_sgd]", "[output_perturbation]")
                    .replace("epsilon: [1, 4]", "epsilon: [1]").replace("budget: 1.0e-6", "budget: 1.0"))
    result = CliRunner().invoke(app, ["audit", str(grid), "--out", str(tmp_path / "res"), "--dry-run"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    rows = [row for line in result.output.splitlines() if (row := re.fullmatch(r"\s*([\d,]+)\s+[\d.]+ s\s*", line))]
    assert len(rows) == 1, result.output
    shown = int(rows[0][1].replace(",", ""))
    assert shown > engine.MIN_TRIALS, result.output  # the budget binds above the least: the clock could move it
    result = CliRunner().invoke(app, ["audit", str(grid), "--out", str(tmp_path / "res")])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "res" / "auto_trials" / "audit.csv")
    assert (frame["trials"] == shown).all() and (frame["status"] == "ok").all()
