"""Fused tasks (cells sharing a batch stream train together) give exactly the rows of the cells run one by one."""

import numpy as np
import pandas as pd
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms.chain import run_together
from dpsgd_cli.algorithms.sampling import poisson_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import execute, plan_grid
from dpsgd_cli.engine.runner import FUSE_ENV
from dpsgd_cli.models import logreg, rows
from dpsgd_cli.models.rows import RowNonzeros

# Poisson (B = 40), full batch (B = n = 320 training rows: q = 1), shuffled (song2013, b = 20), float32 and an MLP,
# with an ε axis, an lr axis, sgd beside dp_sgd and dp_lssgd, traces on; erm stays in tasks of its own.
GRID = """
grids:
  - name: fuse
    datasets: [{name: synthetic, n: 400, dim: 6}]
    models: [logreg]
    algorithms: [erm, sgd, dp_sgd, {name: dp_lssgd, smoothing: 0.5}, {name: song2013, batch_size: [20], lr: [1.0]}]
    epsilon: [0.5, 2]
    batch_size: [40, 320]
    lr: [0.5, 1.0]
    seeds: 3
    epochs: 2
    trace_every: 200
  - name: fuse_mlp
    datasets: [{name: synthetic, n: 300, dim: 5}]
    models: [{name: mlp, hidden: 4}]
    algorithms: [sgd, dp_sgd]
    epsilon: [1, 4]
    batch_size: [30]
    lr: [0.5]
    dtype: float32
    seeds: 2
    epochs: 1
"""
KEY = ["run_id"]


def run_grid(grid, out, fuse, monkeypatch, keep=None):
    monkeypatch.setenv(FUSE_ENV, "1" if fuse else "0")
    plan = plan_grid(grid, out)
    if keep is not None:
        plan.tasks = keep(plan.tasks)
    execute(plan)
    return plan


def table(folder, name="runs.csv"):
    frame = pd.read_csv(folder / name)
    return frame.drop(columns=[c for c in ("wall_time",) if c in frame]).sort_values(
        ["run_id"] + (["examples"] if "examples" in frame else [])).reset_index(drop=True)


@pytest.fixture
def grids(write_grid):
    return load_grid_file(write_grid(GRID)).grids


@pytest.mark.parametrize("which, sparse", [(0, False), (1, False), (0, True)])
def test_a_fused_grid_equals_its_cells_run_one_by_one_bit_for_bit(grids, tmp_path, monkeypatch, which, sparse):
    """sparse: the rows' metrics (`logreg.logistic_metrics`) and the compiled mini-batch steps read X by its
    nonzeros (numba), not densely."""
    grid = grids[which]
    if sparse:
        if not compiled.HAVE_NUMBA:
            pytest.skip("numba not installed")
        monkeypatch.setattr(RowNonzeros, "MAX_DENSITY", 2.0)  # the synthetic rows (6 nonzeros, padded to 8)
        monkeypatch.setattr(rows, "_PER_ARRAY", {})  # the loaded datasets' nonzeros, found too dense before
        read = []
        monkeypatch.setattr(logreg, "_row_nonzeros",
                            lambda X, own=logreg._row_nonzeros: read.append(own(X)) or read[-1])
    plan = run_grid(grid, tmp_path / "fused", True, monkeypatch)
    assert max(len(t.cells) for t in plan.tasks) >= 3  # cells did train together
    if which == 0:
        assert sorted(len(t.cells) for t in plan.tasks) == [1, 2, 10, 10]  # erm; song2013's ε axis; B = 40; B = n
    alone = run_grid(grid, tmp_path / "alone", False, monkeypatch)
    assert all(len(t.cells) == 1 for t in alone.tasks)
    for name in ("runs.csv", "traces.csv")[: 2 if grid.trace_every else 1]:
        a, b = table(tmp_path / "fused" / grid.name, name), table(tmp_path / "alone" / grid.name, name)
        assert len(a) == len(b) > 0
        pd.testing.assert_frame_equal(a, b, check_exact=True)  # every number, to the last bit
    runs = table(tmp_path / "fused" / grid.name)
    assert set(runs["status"]) == {"ok"}
    assert not sparse or (read and all(nz is not None for nz in read))


def test_resume_after_a_partial_fused_grid_gives_the_same_rows(grids, tmp_path, monkeypatch):
    grid = grids[0]
    run_grid(grid, tmp_path / "alone", False, monkeypatch)
    # an interrupted grid: one fused task written, and some seeds of other cells from an unfused session
    run_grid(grid, tmp_path / "b", True, monkeypatch, keep=lambda tasks: [t for t in tasks if len(t.cells) > 1][:1])
    runs = pd.read_csv(tmp_path / "b" / grid.name / "runs.csv")
    assert len(runs) > 3 and len(runs) % 3 == 0  # one write per task: whole cells (3 seeds each)
    # (erm is left out: its L-BFGS over R replicas at once differs in the last bit with R, fused or not)
    run_grid(grid, tmp_path / "b", False, monkeypatch, keep=lambda tasks: [
        type(t)(t.cell, t.seeds[:1], t.optimal_objective, t.optimum_method) for t in tasks[::3]
        if t.cell.algorithm.name != "erm"])
    resumed = run_grid(grid, tmp_path / "b", True, monkeypatch)
    assert {len(t.seeds) for t in resumed.tasks} >= {2, 3}  # fused by pending seeds
    pd.testing.assert_frame_equal(table(tmp_path / "b" / grid.name), table(tmp_path / "alone" / grid.name),
                                  check_exact=True)


def test_run_together_shares_one_batch_per_stream_and_one_noise_draw_per_step():
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((50, 3)), rng.choice([-1.0, 1.0], 50)
    streams = SharedStreams([4, 7])
    a, b, c = (streams.normal("noise", (3,)) for _ in range(3))
    streams.close()
    alone = ReplicaStreams([4, 7]).normal("noise", (3,))
    for _ in range(70):  # drawn once: the three readers' steps are the same memory, the numbers drawn alone
        x, y_, z = next(a), next(b), next(c)
        assert np.shares_memory(x, y_) and np.shares_memory(x, z) and np.array_equal(x, next(alone))

    drawn = []

    class Counting:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            drawn.append(1)
            return next(self.it)

    from dpsgd_cli.algorithms.chain import GradientChain
    from dpsgd_cli.algorithms.ops import Clip, Sgd, WeightDecay, constant
    from dpsgd_cli.models import make_model

    model = make_model("logreg", 3, 0.0, {})
    ops = [Clip(1.0), WeightDecay(0.1), Sgd(constant(0.1))]
    chains = [GradientChain(batches=Counting(poisson_batches(X, y, 0.2, ReplicaStreams([4, 7]))), ops=ops,
                            stream=("poisson", 0.2)) for _ in range(3)]
    thetas = run_together(model, chains, [np.zeros((2, 3))] * 3, [5, 9, 7])
    assert len(drawn) == 9  # one batch per step for the three chains
    solo = GradientChain(batches=poisson_batches(X, y, 0.2, ReplicaStreams([4, 7])), ops=ops,
                         backend="numpy").run(model, np.zeros((2, 3)), 7)
    assert np.array_equal(thetas[2], solo)


def test_spread_splits_fused_tasks_for_idle_workers(grids, monkeypatch, tmp_path):
    from dpsgd_cli.engine.runner import spread

    monkeypatch.setenv(FUSE_ENV, "1")
    tasks = plan_grid(grids[0], tmp_path, dry_run=True).tasks
    fused = [t for t in tasks if len(t.cells) == 10]
    parts = spread(fused[:1], 3)
    assert [len(t.cells) for t in parts] == [5, 3, 2]
    assert sorted(c.cell_id for t in parts for c in t.cells) == sorted(c.cell_id for c in fused[0].cells)
    assert spread(tasks, 2) == tasks


def test_train_together_equals_fit_alone_for_an_epsilon_axis():
    from dpsgd_cli.algorithms import ALGORITHMS, Setting
    from dpsgd_cli.algorithms.chain import train_together
    from dpsgd_cli.models import make_model

    rng = np.random.default_rng(1)
    X = rng.standard_normal((300, 4))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.where(X[:, 0] + 0.3 * rng.standard_normal(300) > 0, 1.0, -1.0)
    model, seeds = make_model("logreg", 4, 1e-3, {}), [3, 5, 8]
    settings = [Setting(n=300, d=4, delta=1e-5, l2=1e-3, epsilon=eps, batch_size=30, lr=0.5, epochs=2, clip_norm=1.0)
                for eps in (0.5, 1.0, 4.0)]
    streams = SharedStreams(seeds)
    prepared = [ALGORITHMS["dp_sgd"]().prepare(s, model, X, y, streams) for s in settings]
    streams.close()
    together = train_together(model, prepared)
    for s, outcome in zip(settings, together):
        alone = ALGORITHMS["dp_sgd"]().fit(s, model, X, y, ReplicaStreams(seeds))
        assert np.array_equal(outcome.theta, alone.theta) and outcome.derived == alone.derived
    assert not np.array_equal(together[0].theta, together[2].theta)


@pytest.mark.parametrize("case", ["convex", "strongly_convex"])
def test_bolt_on_epsilon_and_epochs_axis_trains_once_and_equals_fit_alone(case, monkeypatch):
    """bolt_on's iterates depend on neither ε nor (beyond a prefix) the number of passes: the longest chain
    runs, the others take its θ at their last step, each cell's θ and noise equal to `fit` alone."""
    from dpsgd_cli.algorithms import ALGORITHMS, Setting
    from dpsgd_cli.algorithms.chain import GradientChain, train_together
    from dpsgd_cli.models import make_model

    rng = np.random.default_rng(2)
    X = rng.standard_normal((200, 4))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.where(X[:, 0] + 0.3 * rng.standard_normal(200) > 0, 1.0, -1.0)
    model, seeds, algo = make_model("logreg", 4, 1e-2, {}), [3, 5], ALGORITHMS["bolt_on"]({"case": case})
    settings = [Setting(n=200, d=4, delta=1e-5, l2=1e-2, epsilon=eps, batch_size=16, lr=1.0, epochs=k)
                for eps in (0.5, 2.0) for k in (1, 3, 2)]
    steps = []
    step = GradientChain.step
    monkeypatch.setattr(GradientChain, "step", lambda self, *a: steps.append(1) or step(self, *a))
    streams = SharedStreams(seeds)
    together = train_together(model, [algo.prepare(s, model, X, y, streams) for s in settings])
    assert len(steps) == 3 * (200 // 16)  # the longest chain only
    for s, outcome in zip(settings, together):
        alone = algo.fit(s, model, X, y, ReplicaStreams(seeds))
        assert np.array_equal(outcome.theta, alone.theta) and outcome.derived == alone.derived
    assert not np.array_equal(together[0].theta, together[1].theta)
