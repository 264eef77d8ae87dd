"""Validation split, hyperparameter selection and the privacy of private selection."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant

from dpsgd_cli.algorithms.dp_ftrl import tree_event
from dpsgd_cli.config import Grid, SelectSpec, expand
from dpsgd_cli.data import DatasetSpec, load_dataset, validation_split, with_validation
from dpsgd_cli.engine import plan_grid
from dpsgd_cli.engine.selection import base_epsilon, choose, write_selection_tables
from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy.accounting import dpsgd_event
from dpsgd_cli.privacy.tuning import (
    TUNING_ORDERS,
    Trials,
    dpsgd_rdp,
    liu_talwar_epsilon,
    poisson_rdp,
    score_laplace_scale,
    score_sigma,
    tnb_mean,
    tnb_rdp,
    tuned_epsilon,
    tuned_rdp,
)

GRID = """
name: tiny
datasets: [{name: synthetic, n: 600, dim: 3}]
algorithms: [sgd, dp_sgd]
epsilon: [1]
batch_size: [50]
lr: [0.05, 1]
epochs: 1
seeds: 2
"""


# ------------------------------------------------------------------------------ validation split


def test_validation_split_partitions_the_training_rows():
    fit, held = validation_split(1000, 0.1, seed=3)
    assert abs(len(held) - 100) < 4 * np.sqrt(1000 * 0.1 * 0.9)  # Binomial(1000, 0.1) rows
    assert np.intersect1d(fit, held).size == 0
    assert np.array_equal(np.union1d(fit, held), np.arange(1000))
    assert np.array_equal(validation_split(1000, 0.1, seed=3)[1], held)  # seeded
    assert not np.array_equal(validation_split(1000, 0.1, seed=4)[1], held)
    longer = validation_split(1001, 0.1, seed=3)[1]  # a record more changes no other record's assignment
    assert np.array_equal(longer[longer < 1000], held)


def test_validation_rows_are_neither_test_nor_fitting_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path))
    full = load_dataset(DatasetSpec(name="synthetic", n=500, dim=3))
    data = with_validation(full, 0.2)
    fit, held = validation_split(full.n, 0.2, full.spec.seed)
    assert np.array_equal(data.X_train, full.X_train[fit]) and np.array_equal(data.X_val, full.X_train[held])
    rows = lambda X: {tuple(r) for r in np.round(X, 12)}  # synthetic rows are distinct points
    assert not rows(data.X_val) & rows(data.X_test)
    assert not rows(data.X_val) & rows(data.X_train)
    assert np.array_equal(data.X_test, full.X_test)


def test_runs_record_validation_metrics_and_fit_on_the_rest(run_grid):
    runs = run_grid(GRID + "validation: 0.1\n")
    assert (runs["n_val"] + runs["n_train"] == 480).all() and runs["n_val"].between(30, 66).all()  # 480 rows
    assert runs["val_accuracy"].between(0, 1).all() and (runs["val_objective"] > 0).all()


def test_validation_changes_run_ids_and_select_does_not(tmp_path):
    plain = Grid.model_validate(_yaml(GRID))
    held = Grid.model_validate(_yaml(GRID + "validation: 0.1\n"))
    selected = Grid.model_validate(_yaml(GRID + "validation: 0.1\nselect: {candidates: [lr]}\n"))
    ids = lambda g: [c.run_id(s) for c in expand(g) for s in c.seeds]
    assert not set(ids(plain)) & set(ids(held))
    assert ids(selected) == ids(held)


def test_adding_select_resumes_every_run(run_grid, tmp_path):
    run_grid(GRID + "validation: 0.1\n")
    grid = Grid.model_validate(_yaml(GRID + "validation: 0.1\nselect: [{candidates: [lr]}, "
                                             "{name: optimistic, candidates: [lr], score: test_accuracy}]\n"))
    plan = plan_grid(grid, tmp_path / "out")
    assert plan.pending_runs == 0 and plan.done_before == 8


# ------------------------------------------------------------------------------ choosing


def _runs(val: list[float], test: list[float]) -> pd.DataFrame:
    """Two candidates (lr 0.1, lr 1) × two seeds of one dp_sgd group, with the given scores per candidate."""
    rows = [{"dataset": "adult", "model": "logreg", "algorithm": "dp_sgd", "epsilon": 1.0, "delta": 1e-9,
             "lr": lr, "seed": s, "label": f"dp_sgd lr={lr:g}", "val_accuracy": v + 0.001 * s,
             "val_objective": 1 - v, "test_accuracy": t, "tuning": None}
            for lr, v, t in zip([0.1, 1.0], val, test) for s in range(2)]
    return pd.DataFrame(rows)


def test_selection_takes_the_argmax_on_validation_not_on_test():
    runs = _runs(val=[0.90, 0.80], test=[0.70, 0.85])  # validation prefers lr 0.1, the test set lr 1
    chosen, table = choose(runs, SelectSpec(candidates=["lr"]))
    assert set(chosen["lr"]) == {0.1} and len(chosen) == 2
    assert table["chosen"].iloc[0] == "lr=0.1" and "validation" in table["privacy"].iloc[0]
    assert chosen["label"].iloc[0] == "dp_sgd"  # the candidate is not part of the line's name
    lowest_objective = choose(runs, SelectSpec(candidates=["lr"], score="val_objective"))[0]
    assert set(lowest_objective["lr"]) == {0.1}
    optimistic, table = choose(runs, SelectSpec(name="test", candidates=["lr"], score="test_accuracy"))
    assert set(optimistic["lr"]) == {1.0} and "TEST" in table["privacy"].iloc[0]


def test_private_search_releases_the_best_validation_score_of_its_trials():
    runs = _runs(val=[0.90, 0.80], test=[0.70, 0.85]).assign(sigma=2.0, sample_rate=0.01, steps=100,
                                                              epsilon_achieved=1.0, n_val=3000)
    spec = SelectSpec(candidates=["lr"], privacy="papernot_steinke", mean=20, calibrate=False, searches=300)
    chosen, table = choose(runs, spec)
    # with K ≈ 20 trials over two candidates almost every search tries lr 0.1, whose validation score is higher
    assert (chosen["lr"] == 0.1).mean() > 0.95 and len(chosen) == 300
    total = tuned_epsilon(TUNING_ORDERS, [dpsgd_rdp(2.0, 0.01, 100)], spec.trials(), 1e-9)
    assert table["epsilon_total"].iloc[0] == pytest.approx(total) and (chosen["epsilon"] == total).all()
    assert "Gaussian" in table["score_noise"].iloc[0]


def test_the_released_score_never_costs_more_than_training():
    curve = np.asarray(dpsgd_rdp(2.0, 0.01, 100))
    sigma = score_sigma(curve)
    score = np.asarray(TUNING_ORDERS) / (2 * sigma**2)  # Gaussian on a count of sensitivity 1
    assert (score <= curve * (1 + 1e-12)).all()
    assert (score / curve).max() == pytest.approx(1.0)  # and no more noise than that
    assert score_laplace_scale(0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="val_accuracy"):
        SelectSpec(candidates=["lr"], score="val_objective", privacy="papernot_steinke")


def test_dpsgd_select_writes_the_table(run_grid):
    run_grid(GRID + "validation: 0.1\nselect: {candidates: [lr]}\n")
    [(folder, table)] = write_selection_tables(run_grid.folder)
    assert (folder / "selection.csv").exists() and set(table["chosen"]) <= {"lr=0.05", "lr=1"}
    assert len(table) == 2  # dp_sgd at ε = 1, and the non-private sgd reference


def test_select_needs_a_validation_split_and_known_candidates():
    with pytest.raises(ValueError, match="validation: 0.1"):
        Grid.model_validate(_yaml(GRID + "select: {candidates: [lr]}\n"))
    with pytest.raises(ValueError, match="neither an axis"):
        Grid.model_validate(_yaml(GRID + "validation: 0.1\nselect: {candidates: [lrr]}\n"))
    with pytest.raises(ValueError, match="only a non_private"):
        SelectSpec(candidates=["lr"], score="test_accuracy", privacy="papernot_steinke")


# ------------------------------------------------------------------------------ privacy of selection


def test_theorem_2_on_a_hand_computed_case():
    """Papernot & Steinke Thm 2, geometric K (η = 1) with E[K] = 10 (γ = 0.1), a Gaussian-like base curve
    ε(λ) = 0.01 λ on the orders {15, 20}. By hand: the best λ̂ is 15, 2[(14/15)(0.15) + ln(10)/15] = 0.587011;
    ε'(20) = 0.20 + 0.587011 + ln(10)/19 = 0.908200; ε'(15) = 0.15 + 0.587011 + ln(10)/14 = 0.901481."""
    trials = Trials("geometric", 10.0)
    assert trials.gamma == pytest.approx(0.1) and tnb_mean(1.0, 0.1) == pytest.approx(10.0)
    curve = tuned_rdp([15.0, 20.0], [[0.15, 0.20]], trials)
    assert curve == pytest.approx([0.901481, 0.908200], abs=2e-6)
    assert tnb_rdp(0.20, 20, 0.15, 15, 1.0, 0.1) == pytest.approx(0.908200, abs=2e-6)
    # Theorem 6 (Poisson): ε + μδ̂ + ln μ/(λ − 1), by hand 0.2 + 10·1e-3 + ln(10)/19 = 0.331189
    assert poisson_rdp(0.2, 20, 1e-3, 10.0) == pytest.approx(0.331189, abs=2e-6)
    assert liu_talwar_epsilon(0.5) == 1.5


@pytest.mark.parametrize("kind, eta", [("poisson", 1.0), ("geometric", 1.0), ("logarithmic", 0.0),
                                       ("truncated_negative_binomial", 0.5)])
def test_tuned_epsilon_matches_dp_accounting(kind, eta):
    """dp-accounting's RepeatAndSelectDpEvent implements the same theorems independently."""
    trials = Trials(kind, 10.0, eta)
    ours = tuned_epsilon(TUNING_ORDERS, [dpsgd_rdp(1.5, 256 / 30000, 500)], trials, 1e-9)
    library = RdpAccountant(list(TUNING_ORDERS))
    library.compose(dp_event.RepeatAndSelectDpEvent(dpsgd_event(1.5, 256 / 30000, 500), 10.0, trials.shape))
    assert ours == pytest.approx(library.get_epsilon(1e-9), rel=1e-8)


def test_the_mixture_of_candidates_is_bounded_by_the_worst_candidate():
    trials = Trials("poisson", 5.0)
    noisy, loud = dpsgd_rdp(3.0, 0.01, 200), dpsgd_rdp(1.0, 0.01, 200)
    both = tuned_epsilon(TUNING_ORDERS, [noisy, loud], trials, 1e-8)
    assert both == pytest.approx(tuned_epsilon(TUNING_ORDERS, [loud], trials, 1e-8))
    assert both > tuned_epsilon(TUNING_ORDERS, [noisy], trials, 1e-8)


@pytest.mark.parametrize("kind, eta", [("geometric", 1.0), ("logarithmic", 0.0),
                                       ("truncated_negative_binomial", 0.5), ("truncated_negative_binomial", -0.5)])
def test_number_of_trials_distribution(kind, eta):
    trials = Trials(kind, 8.0, eta)
    k = np.arange(1, 20000)
    pmf = trials.pmf(k)
    assert pmf.min() >= 0 and pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert (k * pmf).sum() == pytest.approx(8.0, rel=1e-6)  # the γ solved for the mean
    draws = trials.sample(np.random.default_rng(0), 20000)
    assert draws.min() >= 1
    assert abs(draws.mean() - 8.0) < 4 * np.sqrt(((k - 8.0) ** 2 * pmf).sum() / 20000)


def test_calibrated_candidates_meet_the_total_epsilon():
    tuning = {"privacy": "papernot_steinke", "distribution": "poisson", "mean": 10.0, "eta": 1.0,
              "candidates": [[100, 1, "rdp"], [200, 1, "rdp"]]}
    n, delta = 2000, 1e-6
    base = base_epsilon(tuning, 1.0, n, delta)
    assert 0.2 < base < 1.0
    from dpsgd_cli.privacy.accounting import calibrate_sigma

    curves = [dpsgd_rdp(calibrate_sigma(base, delta, b / n, n // b).sigma, b / n, n // b) for b in (100, 200)]
    total = tuned_epsilon(TUNING_ORDERS, curves, Trials("poisson", 10.0), delta)
    assert 0.999 <= total <= 1.0
    assert base_epsilon({**tuning, "privacy": "liu_talwar"}, 0.9, n, delta) == pytest.approx(0.3)


def test_calibrated_private_selection_trains_its_own_candidates(run_grid):
    runs = run_grid(GRID + "validation: 0.1\nselect: {name: private, candidates: [lr], privacy: papernot_steinke, "
                    "mean: 5, searches: 20}\n")
    tuned = runs[runs["tuning"] == "papernot_steinke poisson mean=5 eta=1"]
    assert len(tuned) == 4 and tuned["epsilon_base"].lt(0.7).all() and (tuned["epsilon"] == 1).all()
    plain = runs[(runs["algorithm"] == "dp_sgd") & runs["tuning"].isna()]
    assert (tuned["sigma"].min() > plain["sigma"].max())
    [(_, table)] = write_selection_tables(run_grid.folder)
    private = table[table["group"].str.contains("dp_sgd")]
    assert private["epsilon_total"].iloc[0] == pytest.approx(1.0, rel=2e-3)
    assert private["epsilon_total"].iloc[0] <= 1.0


def test_calibrated_private_selection_accounts_dp_ftrl_by_its_trees(run_grid):
    """DP-FTRL's candidates are priced by its own mechanism (trees, zero-out), not as DP-SGD's sampled Gaussian:
    tuning + training meets ε by the tree's RDP curve, which is dp-accounting's for the event the run declares."""
    runs = run_grid(GRID.replace("[sgd, dp_sgd]", "[dp_ftrl]") + "validation: 0.1\nselect: {name: private, "
                    "candidates: [lr], privacy: papernot_steinke, mean: 5, searches: 20}\n")
    tuned = runs[runs["tuning"] == "papernot_steinke poisson mean=5 eta=1"]
    assert len(tuned) == 4 and (tuned["epsilon"] == 1).all() and tuned["epsilon_base"].lt(0.7).all()
    assert (tuned["neighbours"] == "zero_out").all()
    row = tuned.iloc[0]
    steps, per_tree = int(row["steps"]), int(row["n_train"]) // int(row["batch_size"])
    library = RdpAccountant(list(TUNING_ORDERS), neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
    library.compose(tree_event(float(row["sigma"]), steps, per_tree))
    total = tuned_epsilon(TUNING_ORDERS, [library._rdp], Trials("poisson", 5.0), float(row["delta"]))
    assert 0.998 <= total <= 1.0
    [(_, table)] = write_selection_tables(run_grid.folder)
    assert table["epsilon_total"].iloc[0] == pytest.approx(total, rel=1e-9)


def test_private_selection_refuses_what_it_cannot_account():
    with pytest.raises(ValueError, match="cannot account"):
        Grid.model_validate(_yaml(GRID.replace("[sgd, dp_sgd]", "[dp_sgd, noisy_gd]")
                                  + "validation: 0.1\nselect: {candidates: [lr], privacy: papernot_steinke}\n"))
    with pytest.raises(UserError, match="mean"):
        Trials("geometric", 1.0)


def _yaml(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_plots_and_claims_read_the_chosen_runs(run_grid):
    from dpsgd_cli.config import ClaimSpec
    from dpsgd_cli.engine.selection import results_frame
    from dpsgd_cli.report import claim_frame

    run_grid(GRID + "validation: 0.1\nselect: [{candidates: [lr]}, "
                    "{name: optimistic, candidates: [lr], score: test_accuracy}]\n")
    frame = results_frame(run_grid.folder)
    assert set(frame["selection"]) == {"validation", "optimistic"}
    assert frame.groupby(["selection", "algorithm"])["lr"].nunique().eq(1).all()  # one candidate per group
    claim = ClaimSpec(id="c", text="t", own=True, check="monotone")
    assert set(claim_frame(run_grid.folder, claim, [])["selection"]) == {"validation"}  # the grid's first
    named = ClaimSpec(id="c", text="t", own=True, check="monotone", where={"selection": "optimistic"})
    assert set(claim_frame(run_grid.folder, named, [])["selection"]) == {"validation", "optimistic"}


def test_grids_without_validation_keep_their_run_ids():
    """The smoke grid's run ids as computed before `validation:`/`select:` existed (commit c7f44b5)."""
    import hashlib
    from pathlib import Path

    from dpsgd_cli.config import load_grid_file

    smoke = next(g for g in load_grid_file(Path(__file__).parents[1] / "experiments.yaml").grids if g.name == "smoke")
    ids = sorted(c.run_id(s) for c in expand(smoke) for s in c.seeds)
    assert hashlib.sha256(",".join(ids).encode()).hexdigest()[:16] == "210a69850133b0fd"


def test_results_frame_is_read_once_while_the_folder_is_unchanged(tmp_path, monkeypatch):
    """A report reads a folder once per claim: the frame is kept, and read again when runs.csv changes."""
    from dpsgd_cli import api
    from dpsgd_cli.engine import selection

    out = tmp_path / "r"
    api.run({"name": "g", "datasets": [{"name": "synthetic", "n": 200}], "algorithms": ["sgd"], "lr": [0.5],
             "batch_size": [32], "epochs": 1, "seeds": 1}, out=out, quiet=True)
    reads = []
    original = selection.read_results
    monkeypatch.setattr(selection, "read_results", lambda folder: reads.append(folder) or original(folder))
    first = selection.results_frame(out / "g")
    again = selection.results_frame(out / "g")
    assert len(reads) == 1 and first.equals(again) and first is not again
    api.run({"name": "g", "datasets": [{"name": "synthetic", "n": 200}], "algorithms": ["sgd"], "lr": [0.5, 1.0],
             "batch_size": [32], "epochs": 1, "seeds": 1}, out=out, quiet=True)
    assert len(selection.results_frame(out / "g")) == 2 and len(reads) == 2
