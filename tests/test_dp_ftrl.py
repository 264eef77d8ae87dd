"""dp_ftrl: the tree's released prefix sums, their noise, the fixed order, the accounting and the refusals."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.chain import train_together
from dpsgd_cli.algorithms.dp_ftrl import DPFTRL, tree_curve, tree_event, tree_steps
from dpsgd_cli.algorithms.ops import TreeAggregation
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import execute, plan_grid
from dpsgd_cli.engine.runner import FUSE_ENV
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.accounting import calibrate_sigma
from dpsgd_cli.privacy.calibration import LATTICE_STEP

N, D = 400, 5
SETTING = Setting(n=N, d=D, delta=1e-5, l2=1e-2, epsilon=1.0, batch_size=30, lr=0.5, epochs=2.5, clip_norm=1.0)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(N, D))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    y = np.where(X @ np.array([1.0, -2.0, 0.5, 0.0, 1.0]) + 0.1 * rng.normal(size=N) > 0, 1.0, -1.0)
    return X, y, make_model("logreg", D, SETTING.l2)


def _dyadic(t: int) -> list[tuple[int, int]]:
    """The dyadic intervals (start, end] whose union is (0, t], longest first: one per set bit of t."""
    out, end = [], 0
    for bit in reversed(range(t.bit_length())):
        if t >> bit & 1:
            out.append((end, end + 2**bit))
            end += 2**bit
    return out


def _normals(replicas: int, shape: tuple[int, ...]):
    return ReplicaStreams(range(replicas)).normal("noise", shape)


def test_released_prefix_sums_are_the_noisy_nodes_of_each_dyadic_decomposition():
    """Brute force: s_t of a tree = Σ over the dyadic intervals (a, b] of t of (the exact sum of the gradients in it
    + std · the draw of the step at which it completed, b); the tree restarts every K steps. s_t is what the op's
    outputs add up to since the tree's start."""
    rng, std, K, steps, R, P = np.random.default_rng(0), 0.7, 7, 17, 3, 4
    op = TreeAggregation(std, _normals(R, (P,)), K)
    draws = _normals(R, (P,)).take(steps)  # the same numbers: the stream depends on the seeds only
    grads = rng.standard_normal((steps, R, P))
    state, params = op.init(np.zeros((R, P))), np.zeros((R, P))
    for step in range(steps):
        start, t = step - step % K, step % K + 1
        if t == 1:
            released = np.zeros((R, P))
        out, state = op.update(grads[step], state, params)
        released = released + out
        want = sum(grads[start + a:start + b].sum(axis=0) + std * draws[start + b - 1] for a, b in _dyadic(t))
        np.testing.assert_allclose(released, want, rtol=1e-12, atol=1e-12)


def test_a_released_prefix_sum_has_the_variance_of_its_nodes():
    """Var s_t = (number of nodes of t's decomposition) σ²C² per coordinate: 1 for t = 8, 4 for t = 15, ...
    (10⁵ samples per t: the sample variance is within 5 standard errors, ~2.2 %)."""
    R, P, K, std = 1000, 100, 16, 1.3
    op = TreeAggregation(std, _normals(R, (P,)), K)
    state, zeros, released = op.init(np.zeros((R, P))), np.zeros((R, P)), np.zeros((R, P))
    for t in range(1, K + 1):
        out, state = op.update(zeros, state, zeros)
        released += out
        nodes = bin(t).count("1")
        variance = float(np.mean(released**2))
        assert abs(variance / (nodes * std**2) - 1) < 5 * math.sqrt(2 / (R * P)), (t, nodes, variance)


def test_each_example_is_used_once_per_pass_in_the_order_drawn_once_from_the_seed(problem):
    X, y, model = problem
    seeds = [4, 9]
    prepared = DPFTRL().prepare(SETTING, model, X, y, ReplicaStreams(seeds))
    steps, per_pass = tree_steps(SETTING)
    assert (steps, per_pass) == (round(2.5 * (N // 30)), N // 30) == (32, 13)
    taken = prepared.chain.batches.take(steps)  # (T, R, B) example indices
    assert taken.shape == (steps, len(seeds), 30)
    for r, g in enumerate(ReplicaStreams(seeds).generators("sampling")):  # the stated order: drawn once per seed
        order = g.permutation(N)[:per_pass * 30]
        for p in range(math.ceil(steps / per_pass)):
            walked = taken[p * per_pass:(p + 1) * per_pass, r].ravel()
            np.testing.assert_array_equal(walked, order[:len(walked)])  # the same fixed order every pass
            if len(walked) == per_pass * 30:
                assert len(np.unique(walked)) == len(walked)  # each example at most once per pass
    assert not np.array_equal(taken[:, 0], taken[:, 1])


def test_one_pass_without_regulariser_ends_at_theta0_minus_eta_times_the_released_sum_over_b(problem, monkeypatch):
    """FTRL's θ_{T+1} = θ_0 − s_T/λ_F, λ_F = B/η, s_T the tree's last released prefix sum: the sum of the clipped
    gradient sums the op received and of the noise of T's dyadic nodes (brute force)."""
    X, y, model = problem
    setting = dataclasses.replace(SETTING, l2=0.0, epochs=1)
    received: list[np.ndarray] = []
    update = TreeAggregation.update
    monkeypatch.setattr(TreeAggregation, "update", lambda op, g, state, theta: (received.append(g.copy()),
                                                                               update(op, g, state, theta))[1])
    prepared = DPFTRL({"backend": "numpy"}).prepare(setting, model, X, y, ReplicaStreams([0, 1]))
    theta = prepared.chain.run(model, prepared.theta, prepared.steps)
    steps, _ = tree_steps(setting)
    tree = next(op for op in prepared.chain.ops if isinstance(op, TreeAggregation))
    draws = ReplicaStreams([0, 1]).normal("noise", (model.n_params,)).take(steps)
    released = sum(received) + tree.std * sum(draws[b - 1] for _, b in _dyadic(steps))
    np.testing.assert_allclose(theta, prepared.theta - setting.lr * released / setting.batch_size, rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("epsilon, epochs", [(1.0, 2.5), (0.5, 1), (4.0, 3)])
def test_claimed_epsilon_is_dp_accountings_for_the_tree_event_and_sigma_the_smallest_lattice_point(
        problem, epsilon, epochs):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    X, y, model = problem
    setting = dataclasses.replace(SETTING, epsilon=epsilon, epochs=epochs)
    outcome = DPFTRL().fit(setting, model, X, y, ReplicaStreams([0]))
    sigma, claimed = outcome.derived["sigma"], outcome.derived["epsilon_achieved"]
    steps, per_tree = tree_steps(setting)
    orders = sorted({*np.linspace(1.01, 64, 400).tolist(), *range(64, 2000)})
    accountant = RdpAccountant(orders, dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    library = accountant.compose(DPFTRL().dp_event(setting, outcome.derived)).get_epsilon(setting.delta)
    assert claimed <= epsilon and library == pytest.approx(claimed, rel=2e-3)
    # the event's RDP is the paper's: every tree adds α⌈log₂(K' + 1)⌉/(2σ²) (K' its steps)
    trees = [per_tree] * (steps // per_tree) + ([steps % per_tree] if steps % per_tree else [])
    np.testing.assert_allclose(accountant._rdp, np.array(orders) * sum(math.ceil(math.log2(k + 1)) for k in trees)
                               / (2 * sigma**2), rtol=1e-12)
    # smallest lattice σ: the one below does not meet the target
    assert tree_curve(setting.delta, steps, per_tree).evaluate(sigma * math.exp(-LATTICE_STEP))[0] > epsilon


def test_the_tree_event_composes_the_passes():
    import dp_accounting

    tree = dp_accounting.SingleEpochTreeAggregationDpEvent
    assert tree_event(2.0, 3, 10) == tree(2.0, 3)
    assert tree_event(2.0, 30, 10) == dp_accounting.SelfComposedDpEvent(tree(2.0, 10), 3)
    assert tree_event(2.0, 25, 10) == dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(tree(2.0, 10), 2), tree(2.0, 5)])


def test_fused_cells_equal_each_cell_alone_bit_for_bit(problem):
    X, y, model = problem
    seeds = [3, 5]
    settings = [dataclasses.replace(SETTING, epsilon=e, lr=lr) for e, lr in ((0.5, 0.5), (4.0, 0.5), (1.0, 2.0))]
    streams = SharedStreams(seeds)
    prepared = [DPFTRL().prepare(s, model, X, y, streams) for s in settings]
    prepared.append(ALGORITHMS["bolt_on"]().prepare(dataclasses.replace(SETTING, epochs=2), model, X, y, streams))
    streams.close()
    together = train_together(model, prepared)
    for s, outcome in zip(settings, together):
        alone = DPFTRL().fit(s, model, X, y, ReplicaStreams(seeds))
        assert np.array_equal(outcome.theta, alone.theta) and outcome.derived == alone.derived
    assert not np.array_equal(together[0].theta, together[1].theta)


@pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed")
def test_the_compiled_mini_batch_backend_equals_numpy(problem):
    X, y, model = problem
    setting = dataclasses.replace(SETTING, trace_every=100)
    runs = {}
    for backend in ("numpy", "auto"):
        prepared = DPFTRL({"backend": backend}).prepare(setting, model, X, y, ReplicaStreams([0, 1, 2]))
        runs[backend] = prepared.train(model), prepared.chain.ran_on
    assert runs["numpy"][1] == "numpy" and runs["auto"][1] == "numba"
    np.testing.assert_allclose(runs["auto"][0].theta, runs["numpy"][0].theta, rtol=1e-12, atol=1e-14)
    for (_, loss_a, _), (_, loss_n, _) in zip(runs["auto"][0].trace, runs["numpy"][0].trace):
        np.testing.assert_allclose(loss_a, loss_n, rtol=1e-12)


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_other_relations_are_refused_by_the_grid_in_one_line(write_grid, relation):
    path = write_grid(f"""
        name: ftrl
        datasets: [{{name: synthetic, n: 200, dim: 4}}]
        algorithms: [dp_ftrl]
        neighbours: {relation}
        epsilon: [1]
        batch_size: [20]
        lr: [0.5]
        epochs: 1
    """)
    with pytest.raises(Exception, match="zero-out neighbours only") as caught:
        load_grid_file(path)
    assert "\n" not in str(caught.value).strip().splitlines()[-1]


def test_refusals_come_before_work(tmp_path):
    algo = DPFTRL()
    assert algo.refuses_neighbours("zero_out") is None
    assert "use neighbours: zero_out" in algo.refuses_neighbours("add_remove")
    with pytest.raises(Exception, match="batch_size 500 exceeds"):
        algo.check(dataclasses.replace(SETTING, batch_size=500))


def test_dp_sgd_under_zero_out_is_its_add_remove_calibration():
    """The fair comparison's footing: DP-SGD's Poisson-sampled Gaussian has the same bound under both relations."""
    args = (1.0, 1e-5, 0.05, 200, "rdp")
    assert calibrate_sigma(*args, "zero_out").sigma == calibrate_sigma(*args, "add_remove").sigma
    assert DPFTRL.tags.neighbours == "zero_out" and ALGORITHMS["dp_sgd"](neighbours="zero_out").refuses_neighbours(
        "zero_out") is None


def test_a_grid_runs_fused_and_alone_to_the_same_rows_labelled_zero_out(write_grid, tmp_path, monkeypatch):
    grid = load_grid_file(write_grid("""
        name: ftrl
        datasets: [{name: synthetic, n: 300, dim: 4}]
        algorithms: [dp_ftrl, dp_sgd]
        neighbours: zero_out
        epsilon: [1, 4]
        batch_size: [30]
        lr: [0.5]
        seeds: 2
        epochs: 2
    """)).grids[0]
    frames = []
    for fuse in (True, False):
        monkeypatch.setenv(FUSE_ENV, "1" if fuse else "0")
        out = tmp_path / f"fuse{fuse}"
        plan = plan_grid(grid, out)
        execute(plan)
        assert max(len(t.cells) for t in plan.tasks) == (4 if fuse else 1)  # dp_ftrl's ε axis beside dp_sgd's
        frame = pd.read_csv(out / grid.name / "runs.csv").drop(columns=["wall_time"]).sort_values("run_id")
        frames.append(frame.reset_index(drop=True))
    pd.testing.assert_frame_equal(frames[0], frames[1])
    ftrl = frames[0][frames[0].algorithm == "dp_ftrl"]
    assert set(frames[0].neighbours) == {"zero_out"} and (ftrl.status == "ok").all()
    assert (ftrl.epsilon_achieved <= ftrl.epsilon).all() and ftrl.sample_rate.isna().all()


def test_the_audit_twin_adds_scaled_noise_and_records_the_epsilon_of_what_it_adds(problem):
    X, y, model = problem
    twin = DPFTRL().with_noise_scale(0.5)
    prepared = twin.prepare(SETTING, model, X, y, ReplicaStreams([0]))
    derived = prepared.finish(prepared.theta).derived
    tree = next(op for op in prepared.chain.ops if isinstance(op, TreeAggregation))
    assert tree.std == derived["sigma"] * SETTING.clip_norm * 0.5 and derived["sigma_used"] == derived["sigma"] * 0.5
    assert derived["epsilon_noise_scaled"] > 1.5 * derived["epsilon_achieved"]
    assert twin.dp_event(SETTING, derived) == tree_event(derived["sigma_used"], *tree_steps(SETTING))
