"""The audit's ladder of controls (σ for T/10 steps, noise × 0.5, no clipping, beside the noise × 0.1 twin): each a
mutation of the cell's own mechanism with its true ε from the cell's accountant, applied where the cell has what it
mutates; canaries whose raw gradient is above C, which a sound mechanism clips (nothing changes) and an unclipped one
lets through (the no-clipping control is refuted)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from dpsgd_cli.algorithms.ops import Clip, Noise
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.audit import controls
from dpsgd_cli.audit.engine import _verdict, audit_cell, dirac_setup
from dpsgd_cli.config import AuditSpec, GridFile, expand
from dpsgd_cli.engine.runner import dataset
from dpsgd_cli.privacy.accounting import calibrate_sigma, dpsgd_epsilon


def _cells(**grid):
    base = dict(name="t", datasets=[{"name": "synthetic", "n": 400, "dim": 5}], models=["logreg"], seeds=1,
                delta=1e-5, clip_norm=1.0, l2=1e-3, lr=0.5, epochs=2, batch_size=32, epsilon=[1.0])
    return expand(GridFile.model_validate({"grids": [{**base, **grid}]}).grids[0])


def _ladder(cell):
    data = dataset(cell.dataset)
    return {c.key: c for c in controls.ladder(cell, data, cell.make_algorithm(), 0.1)}


def test_each_control_is_the_cells_mechanism_with_one_thing_changed():
    cell = _cells(algorithms=["dp_sgd"])[0]
    data = dataset(cell.dataset)
    ladder = _ladder(cell)
    assert list(ladder) == ["control", *controls.LADDER] and all(c.algorithm is not None for c in ladder.values())
    model, dirac, _, X, y = dirac_setup(cell, data)

    def ops(algorithm):
        return algorithm.prepare(dirac, model, X, y, ReplicaStreams(range(1))).chain.ops

    sound = ops(cell.make_algorithm())
    sigma = calibrate_sigma(*cell.make_algorithm().sigma_calibration(dirac)).sigma
    short = dataclasses.replace(dirac, epochs=dirac.epochs / 10)
    sigma_short = calibrate_sigma(*cell.make_algorithm().sigma_calibration(short)).sigma
    assert short.steps < dirac.steps / 5 and sigma_short < sigma
    std = {key: next(op.std for op in ops(c.algorithm) if isinstance(op, Noise)) for key, c in ladder.items()
           if key != "no_clip"}
    base_std = next(op.std for op in sound if isinstance(op, Noise))
    assert std["control"] == pytest.approx(0.1 * base_std) and std["noise_half"] == pytest.approx(0.5 * base_std)
    # σ calibrated for T/10 steps (on the data the cell trains on), run for all T
    assert std["sigma_t10"] == pytest.approx(base_std * sigma_short / sigma, rel=1e-3)
    unclipped = ops(ladder["no_clip"].algorithm)
    assert [type(op) for op in unclipped] == [type(op) for op in sound if not isinstance(op, Clip)]
    assert any(isinstance(op, Clip) for op in sound)
    assert next(op.std for op in unclipped if isinstance(op, Noise)) == base_std


def test_each_controls_true_epsilon_is_the_cells_accountant_at_what_it_ran():
    cell = _cells(algorithms=["dp_sgd"])[0]
    [row, *_] = audit_cell(cell, AuditSpec(canaries=["dirac"], trials=20, chunk=40))
    q, steps, delta = row["batch_size"] / (dataset(cell.dataset).n + 1), row["steps"], row["delta"]
    sigma = row["sigma"]
    assert row["noise_half_epsilon"] == pytest.approx(dpsgd_epsilon(sigma / 2, q, steps, delta, "rdp", "add_remove"))
    assert row["control_epsilon"] == pytest.approx(dpsgd_epsilon(sigma / 10, q, steps, delta, "rdp", "add_remove"))
    assert row["epsilon_claimed"] < row["sigma_t10_epsilon"] < row["noise_half_epsilon"]
    assert row["no_clip_epsilon"] == float("inf")
    assert row["controls_not_applicable"] == ""


def test_controls_apply_only_where_the_cell_has_what_they_mutate():
    cells = _cells(algorithms=[{"name": "bolt_on", "case": "convex", "calibration": "analytic"},
                               {"name": "output_perturbation", "calibration": "analytic"},
                               {"name": "song2013", "batch_size": [40], "lr": [1.0], "epochs": 1},
                               {"name": "noisy_gd", "accountant": "composition", "lr": [1.0], "epochs": [10]}])
    by = {cell.algorithm.name: _ladder(cell) for cell in cells}
    # bolt_on: output noise (no Noise op per step), a claim that assumes ‖x‖ ≤ 1 (its clip at L is not the argument)
    assert by["bolt_on"]["noise_half"].algorithm is not None
    bolt = by["bolt_on"]
    assert bolt["sigma_t10"].algorithm is None and "no noise at each step" in bolt["sigma_t10"].why_not
    assert by["bolt_on"]["no_clip"].algorithm is None and "unit ball" in by["bolt_on"]["no_clip"].why_not
    assert by["output_perturbation"]["no_clip"].algorithm is None
    # song2013 calibrates per pass: one pass, the same noise for a tenth of its steps; its clip bounds the claim
    assert by["song2013"]["sigma_t10"].algorithm is None and by["song2013"]["no_clip"].algorithm is not None
    assert all(c.algorithm is not None for c in by["noisy_gd"].values())
    # a tenth of 5 epochs is no noisy_gd run (K = round(epochs) ≥ 1): the control does not apply, the audit goes on
    [short] = _cells(algorithms=[{"name": "noisy_gd", "accountant": "composition", "lr": [1.0], "epochs": [5]}])
    assert _ladder(short)["sigma_t10"].algorithm is None and "tenth" in _ladder(short)["sigma_t10"].why_not


def test_a_canary_above_the_clip_changes_nothing_sound_and_shows_a_missing_clip():
    """The Dirac canary's raw gradient is 10·C: the sound mechanism clips it to C (the same scores as a canary of
    norm C), the no-clipping control lets it through and is refuted. A canary of norm C cannot tell them apart."""
    cell = _cells(algorithms=["dp_sgd"])[0]
    spec = AuditSpec(canaries=["dirac"], trials=200, chunk=400, ladder=["no_clip"])
    scores, at_c = {}, {}
    rows = audit_cell(cell, spec, scores=scores)
    blind = audit_cell(cell, spec.model_copy(update={"raw_norm": 1.0}), scores=at_c)
    for key in scores:
        if not key.startswith("no_clip."):
            np.testing.assert_allclose(scores[key], at_c[key], rtol=1e-12, atol=1e-12)
    for row, before in zip(rows, blind):
        assert row["verdict"] == before["verdict"] == "consistent" and row["epsilon_lo"] == before["epsilon_lo"]
        assert before["no_clip_epsilon_lo"] <= 1.0  # unclipped, a canary of norm C is the sound canary
    every = rows[1]
    assert every["no_clip_epsilon_lo"] > every["epsilon_claimed"], every
    assert "no clipping" in every["reason"] and every["detects"] == "noise × 0.1"


def test_an_input_canary_outside_the_unit_ball_shows_a_missing_clip_where_the_claim_rests_on_it():
    cell = _cells(algorithms=["dp_sgd"])[0]
    spec = AuditSpec(canaries=["input"], trials=100, chunk=200, ladder=["no_clip"])
    [row] = audit_cell(cell, spec)
    assert row["no_clip_epsilon_lo"] > row["epsilon_claimed"] >= row["epsilon_lo"], row
    assert row["detects"] == "no clipping" and row["verdict"] == "uninformative"  # the twin is not refuted here
    # bolt_on's claim assumes ‖x‖ ≤ 1: its input canary stays in the unit ball, and its guarantee stays proved
    bolt = _cells(algorithms=[{"name": "bolt_on", "case": "convex", "calibration": "analytic"}])[0]
    [row] = audit_cell(bolt, spec)
    assert row["guarantee"] == "proved" and row["epsilon_lo"] <= row["epsilon_claimed"]


def _row(**kw):
    row = {"status": "ok", "epsilon_claimed": 1.0, "epsilon_lo": 0.2, "ceiling": 4.5, "trials": 500,
           "algorithm": "dp_sgd", "control": 0.1, "control_epsilon": 200.0, "control_epsilon_lo": 4.4,
           "sigma_t10_epsilon": 1.6, "sigma_t10_epsilon_lo": 0.3, "noise_half_epsilon": 4.5,
           "noise_half_epsilon_lo": 1.2, "no_clip_epsilon": float("inf"), "no_clip_epsilon_lo": 4.4}
    return {**row, **kw}


def test_detects_names_the_mildest_refuted_control_and_consistent_says_what_it_would_have_caught():
    every = "white-box, all iterates"
    v = _verdict(_row(), "every iterate", every)
    assert v["verdict"] == "consistent" and v["detects"] == "noise × 0.5"
    assert "would have caught: noise × 0.5 (ε = 4.5, ε_lo = 1.2), noise × 0.1" in v["reason"]
    assert "no clipping (ε = ∞" in v["reason"] and "missed: σ for T/10 steps (ε = 1.6, ε_lo = 0.3)" in v["reason"]
    assert _verdict(_row(sigma_t10_epsilon_lo=1.1), "every iterate", every)["detects"] == "σ for T/10 steps"
    # consistent only if the noise × 0.1 twin is refuted, whatever else is
    v = _verdict(_row(control_epsilon_lo=0.9), "every iterate", every)
    assert v["verdict"] == "uninformative" and v["detects"] == "noise × 0.5"
    # a control not broken at this claim (true ε ≤ ε) is no test: never named
    assert _verdict(_row(noise_half_epsilon=0.9), "every iterate", every)["detects"] == "noise × 0.1"
    # a row without the ladder (n/a, or an older audit.csv) is as before
    bare = {k: v for k, v in _row().items() if not k.startswith(("sigma_t10", "noise_half", "no_clip"))}
    assert _verdict(bare, "every iterate", every)["detects"] == "noise × 0.1"


def test_a_controls_own_trials_are_shown_where_they_are_not_its_rows():
    """The reason (console, report, figure) and the console's controls cell name a control's trials where they
    differ from the row's, and say nothing where they are the same."""
    from dpsgd_cli.cli import _controls_cell

    every = "white-box, all iterates"
    row = _row(trials=7060, noise_half_trials=7060, control_trials=500, no_clip_trials=500, sigma_t10_trials=100)
    reason = _verdict(dict(row), "every iterate", every)["reason"]
    assert "noise × 0.5 (ε = 4.5, ε_lo = 1.2)," in reason and "noise × 0.1 (ε = 200, ε_lo = 4.4, 500 trials)" in reason
    assert "σ for T/10 steps (ε = 1.6, ε_lo = 0.3, 100 trials)" in reason
    cell = _controls_cell(row).splitlines()
    assert "×0.5 1.2✓" in cell and "×0.1 4.4✓ (500 trials)" in cell and "T/10 0.3 (100 trials)" in cell


def test_report_says_what_a_consistent_cell_would_have_caught_over_its_rows():
    from dpsgd_cli.report import audit_verdicts

    base = {"grid": "g", "dataset": "d", "model": "logreg", "algorithm": "dp_sgd", "algorithm_params": "{}",
            "delta": 1e-5, "confidence": 0.95, "family_size": 2, "canary": "dirac", "verdict": "consistent",
            "reason": "r"}
    rows = [_row(**base, threat_model="white-box, last iterate", noise_half_epsilon_lo=0.4, no_clip_epsilon_lo=2.0),
            _row(**base, threat_model="white-box, all iterates", no_clip_epsilon_lo=np.nan)]
    [v] = audit_verdicts(pd.DataFrame(rows))
    assert "would have caught: noise × 0.5 (ε = 4.5, ε_lo = 1.2)" in v["numbers"], v
    assert "no clipping (ε = ∞, ε_lo = 2)" in v["numbers"] and "missed: σ for T/10 steps" in v["numbers"]
