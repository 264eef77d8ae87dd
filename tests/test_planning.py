"""Before the first run: the reference optima L* computed by `execute` (in its workers with `--jobs`), announced
line by line, the same numbers wherever they are computed; the tasks then submitted longest first."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_caches
from test_caches import forget_in_process
from test_fusion import table

from dpsgd_cli.algorithms import erm
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import execute, plan_grid, runner
from dpsgd_cli.plots import plot_results

GRID = """
grids:
  - name: plan
    datasets: [{name: synthetic, n: 300, dim: 5}, {name: synthetic, n: 200, dim: 4}]
    models: [{name: mlp, hidden: 3}]
    algorithms: [erm, dp_sgd, {name: pidp_sgd, zeta: 0.01, radius: 10, batch_size: [1], lr: [0.001]}]
    epsilon: [1]
    batch_size: [30]
    lr: [0.5]
    seeds: 2
    epochs: 1
    l2: 1.0e-3
"""


cache = test_caches.cache  # the fixture: an empty disk cache, nothing remembered in the process


def optima(tasks):
    return {runner.optimum_args(t.cell): (t.optimal_objective, t.optimum_method) for t in tasks}


def minima(tasks):
    """Each distinct L*'s reference minimum (θ*, F(θ*), info) as this process holds it."""
    out = {}
    for args in {runner.optimum_args(t.cell) for t in tasks}:
        model, X, y = runner._optimum_model(args)
        out[args] = erm.known_reference(model, X, y)
    return out


def test_plan_leaves_lstar_to_execute(cache, write_grid, tmp_path):
    plan = plan_grid(load_grid_file(write_grid(GRID)).grids[0], tmp_path / "out")
    assert plan.tasks and all(t.optimum_method == runner.OPTIMUM_PENDING for t in plan.tasks)
    assert not cache.exists()  # nothing computed while planning


@pytest.mark.parametrize("jobs", [1, 2])
def test_lstar_is_announced_and_the_same_in_workers_as_here(cache, write_grid, tmp_path, jobs):
    """jobs = 2: the L-BFGS starts run in forked workers; θ*, F(θ*), the info and L* equal those computed in
    this process bit for bit, and the disk cache holds them (a later run reads them, verified, and says nothing)."""
    grid = load_grid_file(write_grid(GRID)).grids[0]
    tasks = plan_grid(grid, tmp_path / "here").tasks
    said = []
    here = runner.resolve_optima(tasks, 1, said.append)
    here_minima = minima(here)
    assert len(here_minima) == 2 and sum("computing (3 L-BFGS starts)" in line for line in said) == 2
    forget_in_process()
    for path in cache.glob("*.json"):
        path.unlink()
    said = []
    there = runner.resolve_optima(tasks, jobs, said.append)
    assert optima(there) == optima(here) and all(np.isfinite(t.optimal_objective) for t in there)
    for args, (theta, objective, info) in minima(there).items():
        theta0, objective0, info0 = here_minima[args]
        assert np.array_equal(theta, theta0) and objective == objective0 and info == info0
    assert said[0].startswith("computing 2 reference optima L* (6 L-BFGS starts, in "
                              + ("2 processes" if jobs == 2 else "this process"))
    assert sum(" = " in line and "lbfgs_best_of_3" in line for line in said) == 2
    assert len(list(cache.glob("*.json"))) == 2
    forget_in_process()
    said = []
    assert optima(runner.resolve_optima(tasks, jobs, said.append)) == optima(here) and said == []


def test_a_task_run_alone_computes_its_lstar(cache, write_grid, tmp_path):
    grid = load_grid_file(write_grid(GRID)).grids[0]
    tasks = plan_grid(grid, tmp_path / "out").tasks
    alone = [row for task in tasks for row in runner.run_task(task).rows]
    resolved = [row for task in runner.resolve_optima(tasks) for row in runner.run_task(task).rows]
    key = lambda row: row["run_id"]
    for a, b in zip(sorted(alone, key=key), sorted(resolved, key=key)):
        assert a["optimal_objective"] == b["optimal_objective"] and a["optimality_gap"] == b["optimality_gap"]
        assert a["status"] == b["status"] == "ok"


def test_execute_with_two_jobs_writes_the_rows_of_one_job(cache, write_grid, tmp_path):
    grid = load_grid_file(write_grid(GRID)).grids[0]
    said = []
    execute(plan_grid(grid, tmp_path / "one"), jobs=1, on_status=said.append)
    assert any("L* of mlp" in line for line in said)
    forget_in_process()
    for path in cache.glob("*.json"):
        path.unlink()
    execute(plan_grid(grid, tmp_path / "two"), jobs=2, on_status=said.append)
    assert table(tmp_path / "one" / "plan").equals(table(tmp_path / "two" / "plan"))


def test_tasks_are_submitted_longest_first(cache, write_grid, tmp_path, monkeypatch):
    """The single-example pidp_sgd cells (n steps each with P Gaussian numbers) before the mini-batch ones; the
    order is by the estimate alone, and every task is still run once."""
    grid = load_grid_file(write_grid(GRID)).grids[0]
    tasks = runner.resolve_optima(plan_grid(grid, tmp_path / "out").tasks)
    submitted = []

    def in_process_workers(tasks, jobs):
        submitted.extend(tasks)
        yield from (runner.run_task(task) for task in tasks)

    monkeypatch.setattr(runner, "_forked_results", in_process_workers)
    monkeypatch.setattr(runner.sys, "platform", "linux")
    rows = [row for result in runner._results(tasks, 2) for row in result.rows]
    costs = [runner.task_cost(t) for t in submitted]
    assert costs == sorted(costs, reverse=True) and sorted(map(id, submitted)) == sorted(map(id, tasks))
    assert submitted[0].cell.algorithm.name == "pidp_sgd" and submitted[-1].cell.algorithm.name == "erm"
    assert len(rows) == sum(t.runs for t in tasks)


def test_cost_grows_with_steps_replicas_and_parameters(write_grid, tmp_path):
    grid = load_grid_file(write_grid(GRID)).grids[0]
    tasks = plan_grid(grid, tmp_path / "out", dry_run=True).tasks
    by = {(t.cell.algorithm.name, t.cell.dataset.n): t for t in tasks}
    pidp, dp = by["pidp_sgd", 300], by["dp_sgd", 300]
    assert runner.task_cost(pidp) > 5 * runner.task_cost(dp)  # 240 single-example steps against 8 batches
    assert runner.task_cost(pidp) > runner.task_cost(by["pidp_sgd", 200])  # more rows and parameters
    one_seed = type(pidp)(pidp.cell, pidp.seeds[:1], pidp.optimal_objective, pidp.optimum_method)
    assert runner.task_cost(pidp) == pytest.approx(2 * runner.task_cost(one_seed))


def test_an_mlp_reference_at_one_of_its_starts_is_rejected(cache, capsys):
    """The check of a non-convex entry compares F(θ*) with the starts' objectives (no gradients needed there): an
    entry whose θ* is start 0, with a matching F and ‖∇F‖, is discarded and recomputed."""
    from test_caches import problem, rewrite

    from dpsgd_cli.models import make_model

    _, X, y = problem()
    model = make_model("mlp", 4, 1e-3, {"hidden": 3})
    theta, objective, _ = erm.reference_minimum(model, X, y)
    start = model.init(erm.ReplicaStreams([0]).generators("init"))
    value, grad = model.objective_and_gradient(start, X, y)
    (path,) = cache.glob("*.json")
    rewrite(path, lambda ref: {**ref, "theta": start[0].tolist(), "objective": float(value[0]),
                               "info": {**ref["info"], "grad_norm": float(np.linalg.norm(grad[0]))}})
    forget_in_process()
    capsys.readouterr()
    again, objective2, _ = erm.reference_minimum(model, X, y)
    assert np.array_equal(again, theta) and objective2 == objective
    assert "not below the L-BFGS starts" in capsys.readouterr().err


UNREAD = """
grids:
  - name: unread
    datasets: [{name: synthetic, n: 200, dim: 4}]
    models: [{name: mlp, hidden: 3}, logreg]
    algorithms: [sgd, dp_sgd]
    epsilon: [1]
    batch_size: [20]
    lr: [0.5]
    seeds: 2
    epochs: 1
    l2: 1.0e-3
"""


def test_lstar_is_computed_only_where_the_grid_reads_the_gap(cache, write_grid, tmp_path):
    """No figure or claim reads the optimality gap and no cell needs θ* (erm): no L-BFGS runs, and the rows say
    so (optimal_objective and optimality_gap empty, derived.optimum_method why); a figure of the gap, or an erm
    cell of the same (data, model, λ), brings L* back for every cell that shares it."""
    grid = load_grid_file(write_grid(UNREAD)).grids[0]
    said = []
    execute(plan_grid(grid, tmp_path / "out"), jobs=1, on_status=said.append)
    rows = table(tmp_path / "out" / "unread")
    assert not any("L*" in line for line in said) and not list(cache.glob("*.json"))
    assert (rows["status"] == "ok").all() and rows["train_objective"].notna().all()
    assert rows["optimal_objective"].isna().all() and rows["optimality_gap"].isna().all()
    assert rows["derived"].map(lambda d: json.loads(d)["optimum_method"] == runner.OPTIMUM_NOT_READ).all()

    figure = UNREAD.replace("    l2: 1.0e-3\n", "    l2: 1.0e-3\n    figures:\n      - {name: gap, metric: "
                            "optimality_gap, where: {model: mlp}}\n")
    tasks = plan_grid(load_grid_file(write_grid(figure)).grids[0], tmp_path / "fig").tasks
    assert {t.optimum_method for t in tasks} == {runner.OPTIMUM_PENDING}
    with_erm = UNREAD.replace("algorithms: [sgd, dp_sgd]", "algorithms: [erm, sgd, dp_sgd]")
    tasks = plan_grid(load_grid_file(write_grid(with_erm)).grids[0], tmp_path / "erm").tasks
    assert {t.optimum_method for t in tasks} == {runner.OPTIMUM_PENDING}


PRIVATE = """
grids:
  - name: private
    datasets: [{name: synthetic, n: 200, dim: 4}, {name: synthetic, n: 100, dim: 3}]
    models: [logreg]
    algorithms: [{name: dp_sgd, accountant: pld}]
    epsilon: [1, 2]
    batch_size: [20]
    lr: [0.5]
    seeds: 1
    epochs: 1
"""

IN_A_FRESH_PROCESS = """
import sys
from pathlib import Path
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import plan_grid, runner

def forked(tasks, jobs):
    print("accountant library loaded before forking:", "dp_accounting.pld.pld_privacy_accountant" in sys.modules)
    yield from ()

runner._forked_results = forked
tasks = runner.resolve_optima(plan_grid(load_grid_file(Path(sys.argv[1])).grids[0], Path(sys.argv[2])).tasks)
list(runner._results(tasks, 2))
"""


def test_forked_workers_inherit_the_accountant_library(write_grid, tmp_path, monkeypatch):
    """With --jobs 2 the driver imports the accountant library before forking, once for all its workers (each
    worker's first private task imported it again: ~0.8 s a worker and grid)."""
    monkeypatch.setenv("DPSGD_CACHE_DIR", str(tmp_path / "cache"))
    script = tmp_path / "fork.py"
    script.write_text(IN_A_FRESH_PROCESS)
    done = subprocess.run([sys.executable, str(script), str(write_grid(PRIVATE)), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert "accountant library loaded before forking: True" in done.stdout, done.stderr[-2000:]


def test_a_gap_figure_of_a_grid_without_lstar_says_why(cache, write_grid, tmp_path, capsys):
    execute(plan_grid(load_grid_file(write_grid(UNREAD)).grids[0], tmp_path / "out"), jobs=1)
    assert plot_results(tmp_path / "out", metric="optimality_gap") == []
    assert "L* is computed only for a grid with a figure or claim of the optimality gap" in capsys.readouterr().err
