"""DP-Adam: the Adam op, the first steps of dp_adam against a hand computation, its privacy (DP-SGD's), and dp_adam
trained beside dp_sgd (one batch stream) equal to each alone, bit for bit."""

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.special import expit

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.chain import train_together
from dpsgd_cli.algorithms.ops import Adam, constant
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.engine.results import option_text
from dpsgd_cli.models import make_model
from dpsgd_cli.plots import names

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed (pip install 'dpsgd[numba]')")


def _setting(n, d, **kw):
    base = dict(n=n, d=d, delta=1e-5, l2=1e-2, epsilon=1.0, batch_size=40, lr=0.05, epochs=2, clip_norm=1.0)
    return Setting(**{**base, **kw})


@pytest.fixture(scope="module")
def data(make_logistic_data):
    return make_logistic_data(4, 300, [1.0, -2.0, 0.5, 0.0], 0.1)


def test_adam_op_by_hand():
    """Step 1: m̂ = g, v̂ = g², so the step is −η g/(|g| + ε); step 2 from the moments by hand."""
    op = Adam(constant(0.1), beta1=0.9, beta2=0.999, eps=1e-8)
    g1, g2 = np.array([[2.0, -0.5, 0.0]]), np.array([[1.0, 1.0, -3.0]])
    theta = np.zeros((1, 3))
    step, state = op.update(g1, op.init(theta), theta)
    np.testing.assert_allclose(step, -0.1 * g1 / (np.abs(g1) + 1e-8), rtol=1e-15)
    step, (t, m, v) = op.update(g2, state, theta)
    m_hand = 0.9 * 0.1 * g1 + 0.1 * g2
    v_hand = 0.999 * 0.001 * g1**2 + 0.001 * g2**2
    expected = -0.1 * (m_hand / (1 - 0.9**2)) / (np.sqrt(v_hand / (1 - 0.999**2)) + 1e-8)
    assert t == 2
    np.testing.assert_allclose(step, expected, rtol=1e-13)


def test_dp_adam_first_steps_equal_a_hand_computation(data):
    """Full batch (q = 1), three steps: per-example logistic gradients clipped to C, the seed's noise σCz_t, / B,
    + λθ, then Adam, written out here with loops over the examples."""
    X, y = data
    n, d = X.shape
    setting = _setting(n, d, batch_size=n, epochs=3, lr=0.05, clip_norm=0.3)
    algo = ALGORITHMS["dp_adam"]({"backend": "numpy", "beta1": 0.8, "beta2": 0.99, "eps_adam": 1e-6})
    model = make_model("logreg", d, setting.l2)
    outcome = algo.fit(setting, model, X, y, ReplicaStreams([7]))
    sigma, C, lam, eta = outcome.derived["sigma"], 0.3, setting.l2, 0.05
    noise = ReplicaStreams([7]).normal("noise", (d,))
    theta, m, v = np.zeros(d), np.zeros(d), np.zeros(d)
    for t in range(1, 4):
        total = np.zeros(d)
        for x_i, y_i in zip(X, y):
            g_i = -y_i * expit(-y_i * (theta @ x_i)) * x_i
            total += g_i * min(1.0, C / np.linalg.norm(g_i))
        g = (total + sigma * C * next(noise)[0]) / n + lam * theta
        m = 0.8 * m + 0.2 * g
        v = 0.99 * v + 0.01 * g * g
        theta = theta - eta * (m / (1 - 0.8**t)) / (np.sqrt(v / (1 - 0.99**t)) + 1e-6)
    np.testing.assert_allclose(outcome.theta[0], theta, rtol=1e-10, atol=1e-14)


def test_dp_adam_has_dp_sgd_privacy_and_stream(data):
    X, y = data
    setting = _setting(*X.shape)
    model = make_model("logreg", X.shape[1], setting.l2)
    adam, sgd = ALGORITHMS["dp_adam"](), ALGORITHMS["dp_sgd"]()
    pa = adam.prepare(setting, model, X, y, ReplicaStreams([0]))
    ps = sgd.prepare(setting, model, X, y, ReplicaStreams([0]))
    assert pa.chain.stream == ps.chain.stream and pa.steps == ps.steps
    da, ds = pa.finish(pa.theta).derived, ps.finish(ps.theta).derived
    assert da == ds
    assert adam.dp_event(setting, da) == sgd.dp_event(setting, ds)
    assert adam.sigma_calibration(setting) == sgd.sigma_calibration(setting)
    assert names.algorithm("dp_adam") == "DP-Adam"
    assert names.label("dp_adam clip_quantile=None") == "DP-Adam, clip quantile: fixed clip"
    unset = option_text(None)  # how a line label writes a parameter one of the algorithm's lines leaves unset
    assert names.label(f"dp_sgd clip_quantile={unset}") == "DP-SGD, clip quantile: fixed clip"


def test_dp_adam_params_are_checked():
    with pytest.raises(ValidationError):
        ALGORITHMS["dp_adam"]({"beta1": 1.0})
    with pytest.raises(ValidationError):
        ALGORITHMS["dp_adam"]({"eps_adam": 0.0})
    assert ALGORITHMS["dp_adam"]().params.model_dump() == {"beta1": 0.9, "beta2": 0.999, "eps_adam": 1e-8,
                                                           "accountant": "rdp", "backend": "auto"}


@pytest.mark.parametrize("model_name", ["logreg", "mlp"])
def test_dp_adam_fused_with_dp_sgd_equals_each_alone(data, model_name):
    """dp_sgd, dp_adam and both with adaptive clipping on one batch stream and one noise draw per seed: each cell's
    θ and derived values are those of the cell trained alone, bit for bit."""
    X, y = data
    setting = _setting(*X.shape)
    options = {"hidden": 3} if model_name == "mlp" else {}
    model = make_model(model_name, X.shape[1], setting.l2, options)
    configs = [("dp_sgd", {}), ("dp_adam", {}), ("dp_sgd", {"clip_quantile": 0.5}),
               ("dp_adam", {"clip_quantile": 0.3, "clip_lr": 0.5}), ("dp_adam", {"beta1": 0.5})]
    seeds = [2, 9]
    streams = SharedStreams(seeds)
    prepared = [ALGORITHMS[name](params).prepare(setting, model, X, y, streams) for name, params in configs]
    streams.close()
    assert len({p.chain.stream for p in prepared}) == 1
    together = train_together(model, prepared)
    for (name, params), outcome in zip(configs, together):
        alone = ALGORITHMS[name](params).fit(setting, model, X, y, ReplicaStreams(seeds))
        assert np.array_equal(outcome.theta, alone.theta) and outcome.derived == alone.derived, (name, params)
    assert len({outcome.theta.tobytes() for outcome in together}) == len(configs)


@needs_numba
@pytest.mark.parametrize("batch_size", [40, 300])  # the mini-batch backend; the full batch (q = 1)
@pytest.mark.parametrize("params", [{}, {"beta1": 0.5, "beta2": 0.9, "eps_adam": 1e-3},
                                    {"clip_quantile": 0.5, "clip_count_noise": 0.2}])
def test_dp_adam_compiled_equals_numpy(data, batch_size, params):
    """The tail's ADAM (moments kept per chain and replica across the kernel's calls) against `ops.Adam`: the same
    numbers up to the gradient sum's order."""
    X, y = data
    setting = _setting(*X.shape, batch_size=batch_size, epochs=3, trace_every=150)
    model = make_model("logreg", X.shape[1], setting.l2)
    runs = {}
    for backend in ("numpy", "numba"):
        prepared = ALGORITHMS["dp_adam"]({**params, "backend": backend}).prepare(setting, model, X, y,
                                                                                   ReplicaStreams([1, 4]))
        runs[backend] = prepared.train(model), prepared.chain.ran_on
    assert runs["numba"][1] == "numba" and runs["numpy"][1] == "numpy"
    np.testing.assert_allclose(runs["numba"][0].theta, runs["numpy"][0].theta, rtol=1e-12, atol=1e-15)
    for (_, loss_c, _), (_, loss_n, _) in zip(runs["numba"][0].trace, runs["numpy"][0].trace):
        np.testing.assert_allclose(loss_c, loss_n, rtol=1e-12)
    assert not np.array_equal(runs["numpy"][0].theta, model.init([np.random.default_rng(0)] * 2))


GRID = """
grids:
  - name: beyond
    datasets: [{name: synthetic, n: 300, dim: 5}]
    models: [logreg, {name: mlp, hidden: 3}]
    algorithms: [dp_sgd, dp_adam, {name: dp_sgd, clip_quantile: 0.5}, {name: dp_adam, clip_quantile: 0.7, lr: [0.01]}]
    epsilon: [1, 4]
    batch_size: [30]
    lr: [0.05]
    seeds: 2
    epochs: 1
"""


def test_a_grid_of_dp_adam_and_adaptive_clipping_fused_equals_its_cells_one_by_one(write_grid, tmp_path, monkeypatch):
    """From the grid file: dp_adam and adaptive clipping fuse with dp_sgd (one task per model) and their rows are
    those of the cells run one by one, bit for bit."""
    import pandas as pd

    from dpsgd_cli.config import load_grid_file
    from dpsgd_cli.engine import execute, plan_grid
    from dpsgd_cli.engine.runner import FUSE_ENV

    grid = load_grid_file(write_grid(GRID)).grids[0]
    frames = {}
    for fuse in (True, False):
        monkeypatch.setenv(FUSE_ENV, "1" if fuse else "0")
        plan = plan_grid(grid, tmp_path / str(fuse))
        assert len(plan.tasks) == (2 if fuse else 16)
        execute(plan)
        frame = pd.read_csv(tmp_path / str(fuse) / "beyond" / "runs.csv")
        frames[fuse] = frame.drop(columns=["wall_time"]).sort_values("run_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(frames[True], frames[False])
    assert (frames[True]["status"] == "ok").all() and frames[True]["run_id"].nunique() == 32
