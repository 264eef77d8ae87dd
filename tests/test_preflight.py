"""Every grid shipped in experiments.yaml passes the checks `dpsgd run` makes before any work (names, bounded
work, and each algorithm's own constraints against the data's n), so a shipped grid cannot end in failed runs
that a check could have refused; and a constraint an algorithm checks is refused before any work."""

from pathlib import Path

import pytest

from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import plan_grid
from dpsgd_cli.engine.checks import check_grid
from dpsgd_cli.errors import UserError

GRIDS = load_grid_file(Path(__file__).parents[1] / "experiments.yaml").grids


@pytest.mark.parametrize("grid", GRIDS, ids=[g.name for g in GRIDS])
def test_every_shipped_grid_passes_the_checks_before_work(grid, data_env, tmp_path):
    check_grid(grid)
    plan = plan_grid(grid, tmp_path, dry_run=True)
    assert plan.tasks


@pytest.mark.parametrize("entry, message", [
    ("{name: pidp_sgd, zeta: 0.01, radius: 10}", "needs batch_size 1, got 32"),
    ("{name: pidp_sgd, batch_size: [1], accountant: composition}", "composition is for sampling: poisson"),
    ("{name: song2013, schedule: constant, l2: [0]}", "need a λ-strongly convex objective"),
    ("{name: noisy_gd, accountant: dynamics, l2: [0]}", "needs l2 > 0"),
    ("{name: output_perturbation, l2: [0]}", "needs l2 > 0"),
    ("{name: bolt_on, case: strongly_convex, l2: [0]}", "needs l2 > 0"),
    ("{name: bolt_on, epochs: [1.5]}", "whole number"),
    ("{name: bassily2014, schedule: strongly_convex, l2: [0]}", "needs l2 > 0"),
])
def test_an_algorithms_constraints_are_refused_before_any_work(entry, message, write_grid, tmp_path):
    grid = load_grid_file(write_grid(f"""
        grids:
          - name: bad
            datasets: [{{name: synthetic, n: 400}}]
            algorithms: [erm, {entry}]
            batch_size: [32]
            seeds: 1
            epochs: 1
        """)).grids[0]
    with pytest.raises(UserError, match=message) as refused:
        plan_grid(grid, tmp_path / "out")
    assert "grid 'bad'" in str(refused.value)
    runs = tmp_path / "out" / "bad" / "runs.csv"
    assert not runs.exists() or not runs.read_text().count("\n") > 1
