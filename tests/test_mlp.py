"""The one-hidden-layer MLP: gradients against finite differences and naive per-example loops, clipping never
exceeds C, exact Hessian–vector products against the dense finite-difference Hessian, CG against a dense solve,
the best-of-starts reference minimum, and every generic algorithm running with `model: mlp`."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.algorithms.base import Setting
from dpsgd_cli.algorithms.erm import LBFGS_NONCONVEX, REFERENCE_STARTS, minimize_objective, reference_minimum
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import Batch, Model, make_model, mlp
from dpsgd_cli.models.rows import gather

ACTIVATIONS = ["tanh", "sigmoid", "relu"]
PHI = {"tanh": (np.tanh, lambda z: 1 - np.tanh(z) ** 2),
       "sigmoid": (lambda z: 1 / (1 + np.exp(-z)), lambda z: np.exp(-z) / (1 + np.exp(-z)) ** 2),
       "relu": (lambda z: np.maximum(z, 0), lambda z: (z > 0).astype(float))}


def problem(activation="tanh", d=4, h=3, n=30, R=2, l2=0.1, seed=0):
    rng = np.random.default_rng(seed)
    model = make_model("mlp", d, l2, {"hidden": h, "activation": activation})
    X = rng.normal(size=(n, d)) / np.sqrt(d)
    y = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    theta = rng.normal(size=(R, model.n_params))
    return model, X, y, theta


def naive_example_gradient(model, theta_r, x, y):
    """∇ℓ for ONE example and ONE replica, written out from the definition (independent of the model's code)."""
    d, h = model.d, model.hidden
    W1, b1, w2, b2 = theta_r[: d * h].reshape(h, d), theta_r[d * h: d * h + h], theta_r[d * h + h: -1], theta_r[-1]
    phi, dphi = PHI[model.activation]
    z = W1 @ x + b1
    f = w2 @ phi(z) + b2
    r = -y / (1 + np.exp(y * f))  # d/df log(1 + exp(−y f))
    delta = r * w2 * dphi(z)
    return np.concatenate([np.outer(delta, x).ravel(), delta, r * phi(z), [r]])


def naive_per_example(model, theta, X, y):
    return np.array([[naive_example_gradient(model, theta[r], X[i], y[i]) for i in range(len(X))]
                     for r in range(theta.shape[0])])  # (R, n, P)


def full_batch(X, y, R, weight=None):
    n = X.shape[0]
    return Batch(X=np.broadcast_to(X, (R, *X.shape)), y=np.broadcast_to(y, (R, n)),
                 weight=np.ones((R, n)) if weight is None else weight,
                 x_norm=np.broadcast_to(np.linalg.norm(X, axis=1), (R, n)))


def dense_fd_hessian(model, theta, X, y, h=1e-5):
    """(R, P, P) by central differences of the analytic gradient (float64)."""
    P = theta.shape[1]
    cols = [(model.gradient(theta + h * e, X, y) - model.gradient(theta - h * e, X, y)) / (2 * h) for e in np.eye(P)]
    H = np.stack(cols, axis=2)
    return (H + H.transpose(0, 2, 1)) / 2


# --- parameters and initialisation ----------------------------------------------------------------------------------
def test_layout_options_and_init():
    model = make_model("mlp", 6, 0.0)
    assert model.hidden == 6 and model.activation == "tanh" and model.n_params == 6 * 6 + 6 + 6 + 1
    assert not model.convex and model.lipschitz(1.0) is None and model.smoothness(1.0) is None
    theta = np.arange(2 * model.n_params, dtype=float).reshape(2, -1)
    assert np.array_equal(model.pack(*model.unpack(theta)), theta)
    W1, b1, w2, b2 = model.unpack(theta)
    assert W1.shape == (2, 6, 6) and W1[1, 0, 1] == theta[1, 1] and b2[1] == theta[1, -1]
    with pytest.raises(ValueError):  # pydantic's ValidationError
        make_model("mlp", 6, 0.0, {"width": 3})
    with pytest.raises(ValueError):
        make_model("mlp", 6, 0.0, {"activation": "elu"})
    # seeded, per replica, Glorot (tanh) / He (relu) uniform limits, zero biases
    for activation, lim1 in [("tanh", np.sqrt(6 / 12)), ("relu", np.sqrt(6 / 6))]:
        m = make_model("mlp", 6, 0.0, {"activation": activation})
        together = m.init(ReplicaStreams([1, 3]).generators("init"))
        alone = m.init(ReplicaStreams([3]).generators("init"))
        assert np.array_equal(together[1], alone[0]) and not np.array_equal(together[0], together[1])
        W1, b1, w2, b2 = m.unpack(together)
        assert np.abs(W1).max() <= lim1 and np.abs(W1).max() > 0.8 * lim1
        assert not b1.any() and not b2.any() and w2.any()


# --- gradients ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradient_matches_finite_differences(activation):
    model, X, y, theta = problem(activation)
    grad = model.gradient(theta, X, y)
    h = 1e-6
    numeric = np.stack([(model.objective(theta + h * e, X, y) - model.objective(theta - h * e, X, y)) / (2 * h)
                        for e in np.eye(model.n_params)], axis=1)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)
    value, both = model.objective_and_gradient(theta, X, y)  # one forward pass (what L-BFGS calls)
    np.testing.assert_allclose(value, model.objective(theta, X, y), rtol=1e-13)
    np.testing.assert_allclose(both, grad, rtol=1e-13, atol=1e-15)
    # the objective is the definition: mean logistic loss + (λ/2)‖θ‖² over all parameters
    f = np.array([[naive_f(model, theta[r], x) for x in X] for r in range(2)])
    expected = np.mean(np.log1p(np.exp(-y * f)), axis=1) + 0.05 * np.sum(theta**2, axis=1)
    np.testing.assert_allclose(model.objective(theta, X, y), expected, rtol=1e-12)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_full_batch_rows_of_one_hot_data_give_the_dense_objective_and_gradient(activation, monkeypatch):
    """L-BFGS reads one-hot rows as a sparse matrix: the same F and ∇F up to summation order, in every block."""
    model, _, y, theta = problem(activation, d=16, h=3, n=40)
    rng = np.random.default_rng(1)
    X = np.zeros((40, 16))
    X[np.arange(40), rng.integers(0, 8, 40)] = 0.6  # two one-hot blocks and a sparse numeric column
    X[np.arange(40), rng.integers(8, 15, 40)] = 0.5
    X[::3, 15] = rng.normal(size=14) / 3
    rows = model.full_batch_rows(X)
    assert not isinstance(rows, np.ndarray)
    monkeypatch.setattr(mlp, "BLOCK_ELEMENTS", 2 * 3 * 7)  # blocks of 7 examples
    value, grad = model.objective_and_gradient(theta, X, y)
    value_rows, grad_rows = model.objective_and_gradient(theta, rows, y)
    np.testing.assert_allclose(value_rows, value, rtol=1e-12)
    np.testing.assert_allclose(grad_rows, grad, rtol=1e-12, atol=1e-15)
    h = 1e-6
    numeric = np.stack([(model.objective_and_gradient(theta + h * e, rows, y)[0]
                         - model.objective_and_gradient(theta - h * e, rows, y)[0]) / (2 * h)
                        for e in np.eye(model.n_params)], axis=1)
    np.testing.assert_allclose(grad_rows, numeric, rtol=1e-6, atol=1e-8)
    dense = np.random.default_rng(2).normal(size=(40, 16))
    assert model.full_batch_rows(dense) is dense


def naive_f(model, theta_r, x):
    d, h = model.d, model.hidden
    z = theta_r[: d * h].reshape(h, d) @ x + theta_r[d * h: d * h + h]
    return theta_r[d * h + h: -1] @ PHI[model.activation][0](z) + theta_r[-1]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_per_example_norms_and_clipped_sums_match_naive(activation):
    model, X, y, theta = problem(activation, n=12, R=3)
    per_example = naive_per_example(model, theta, X, y)
    np.testing.assert_allclose(per_example.mean(axis=1), model.data_gradient(theta, X, y), rtol=1e-10, atol=1e-12)
    weight = np.ones((3, 12))
    weight[1, 7:] = 0  # padding
    batch = full_batch(X, y, 3, weight)
    norms = np.linalg.norm(per_example, axis=2)
    np.testing.assert_allclose(model.per_example_grad_norms(theta, batch), norms, rtol=1e-10)
    for C in (0.05, 0.5, None):
        factor = np.ones_like(norms) if C is None else np.minimum(1.0, C / norms)
        expected = np.einsum("rm,rmp->rp", weight * factor, per_example)
        np.testing.assert_allclose(model.clipped_grad_sum(theta, batch, C), expected, rtol=1e-10, atol=1e-12)


def test_padded_batches_from_gather():
    model, X, y, theta = problem(n=8, R=3)
    idx = np.array([[0, 1, 2, -1], [3, 4, -1, -1], [5, -1, -1, -1]])
    got = model.clipped_grad_sum(theta, gather(X, y, np.linalg.norm(X, axis=1), idx), 0.3)
    for r, rows in enumerate([[0, 1, 2], [3, 4], [5]]):
        g = naive_per_example(model, theta[r:r + 1], X[rows], y[rows])[0]
        expected = (g * np.minimum(1, 0.3 / np.linalg.norm(g, axis=1))[:, None]).sum(axis=0)
        np.testing.assert_allclose(got[r], expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), scale=st.floats(0.01, 30.0), clip=st.floats(1e-3, 10.0),
       activation=st.sampled_from(ACTIVATIONS), m=st.integers(1, 9))
def test_every_clipped_example_gradient_is_within_C(seed, scale, clip, activation, m):
    """Replica i holds example i alone (one-hot weights), so its clipped sum is example i's clipped gradient."""
    rng = np.random.default_rng(seed)
    model = make_model("mlp", 3, 0.0, {"hidden": 4, "activation": activation})
    X = rng.normal(size=(m, 3)) * rng.uniform(0, 3)
    y = np.where(rng.random(m) < 0.5, -1.0, 1.0)
    theta = np.tile(rng.normal(size=model.n_params) * scale, (m, 1))
    g = model.clipped_grad_sum(theta, full_batch(X, y, m, np.eye(m)), clip)
    norms = np.linalg.norm(g, axis=1)
    assert np.all(norms <= clip * (1 + 1e-9))
    raw = model.per_example_grad_norms(theta[:1], full_batch(X, y, 1))[0]
    np.testing.assert_allclose(norms, np.minimum(raw, clip), rtol=1e-9, atol=1e-150)  # underflow below


# --- second order ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_hvp_matches_dense_finite_difference_hessian(activation):
    model, X, y, theta = problem(activation, d=3, h=3, n=25, R=2, l2=0.05, seed=1)
    H = dense_fd_hessian(model, theta, X, y)
    v = np.random.default_rng(2).normal(size=theta.shape)
    np.testing.assert_allclose(model.hvp(theta, X, y, v), np.einsum("rpq,rq->rp", H, v), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["mlp", "logreg"])
def test_inverse_hvp_matches_dense_solve(name):
    rng = np.random.default_rng(3)
    if name == "mlp":
        model, X, y, theta = problem("tanh", d=3, h=3, n=40, R=3, l2=0.01, seed=3)
        H = dense_fd_hessian(model, theta, X, y)
    else:
        model, X, y = make_model("logreg", 5, 0.01), rng.normal(size=(40, 5)), np.sign(rng.normal(size=40))
        theta = rng.normal(size=(3, 5))
        s = 1 / (1 + np.exp(-theta @ X.T))
        H = np.einsum("rn,ni,nj->rij", s * (1 - s), X, X) / 40 + 0.01 * np.eye(5)  # closed form
        v = rng.normal(size=theta.shape)
        np.testing.assert_allclose(model.hvp(theta, X, y, v), np.einsum("rpq,rq->rp", H, v), rtol=1e-12)
    P = theta.shape[1]
    zeta = max(0.0, -np.linalg.eigvalsh(H).min()) + 0.05  # H + ζI positive definite
    v = rng.normal(size=theta.shape)
    x, info = model.inverse_hvp(theta, X, y, v, damping=zeta, tol=1e-12, return_info=True)
    expected = np.stack([np.linalg.solve(H[r] + zeta * np.eye(P), v[r]) for r in range(3)])
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-8)
    assert info["converged"].all() and not info["negative_curvature"].any() and (info["residual"] < 1e-9).all()
    assert (info["iterations"] <= P + 5).all()
    # replica r solved alone gives the same answer
    alone = model.inverse_hvp(theta[1:2], X, y, v[1:2], damping=zeta, tol=1e-12)
    np.testing.assert_allclose(alone[0], x[1], rtol=1e-12, atol=1e-14)


class Quadratic(Model):
    """F with Hessian diag(a): for the CG breakdown test."""

    name = "quadratic"

    def __init__(self, a):
        super().__init__(len(a), 0.0)
        self.a = np.asarray(a, dtype=float)

    def hvp(self, theta, X, y, v):
        return v * self.a


def test_cg_stops_on_negative_curvature():
    model = Quadratic([1.0, -1.0, 2.0])
    v = np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    x, info = model.inverse_hvp(np.zeros((2, 3)), None, None, v, return_info=True)
    np.testing.assert_allclose(x[0], [1.0, 0.0, 0.5])
    assert info["converged"].tolist() == [True, False] and info["negative_curvature"].tolist() == [False, True]


# --- reference minimum and algorithms ---------------------------------------------------------------------------------
def test_reference_minimum_best_of_starts():
    model, X, y, _ = problem("tanh", d=3, h=4, n=60, l2=1e-3, seed=5)
    theta, objective, info = reference_minimum(model, X, y, starts=3)
    results = info["start_results"]
    assert info["optimum_method"] == "lbfgs_best_of_3" and info["starts"] == 3 and len(results) == 3
    assert objective == min(r["objective"] for r in results.values()) == results[str(info["best_start"])]["objective"]
    assert objective == pytest.approx(model.objective(theta[None], X, y)[0], rel=1e-12)
    assert info["grad_norm"] < 1e-5
    # each start is L-BFGS from the init of seed s
    assert reference_minimum(model, X, y, starts=1)[1] == results["0"]["objective"]
    logreg = make_model("logreg", 3, 1e-3)
    _, _, info = reference_minimum(logreg, X, y, starts=4)
    assert info["optimum_method"] == "lbfgs" and info["starts"] == 1


def test_a_start_stops_when_its_objective_has_stopped_falling():
    """The plateau rule ends a start once F fell by ≤ τ over its last K iterations, without changing the path:
    L-BFGS capped at the same iteration ends at the same θ. Each start records how it stopped."""
    model, X, y, _ = problem("tanh", d=3, h=4, n=60, l2=1e-3, seed=5)
    theta0 = model.init(ReplicaStreams([0]).generators("init"))[0]
    rule = {"maxiter": 500, "gtol": 1e-12, "ftol": 0.0, "plateau_iterations": 5, "plateau_decrease": 1e-4}
    theta, info = minimize_objective(model, X, y, theta0, **rule)
    assert info["lbfgs_stop"] == "plateau" and not info["lbfgs_converged"]
    assert 5 <= info["lbfgs_iterations"] < 500 and 0.0 <= info["plateau_decrease"] <= 1e-4
    capped, capped_info = minimize_objective(model, X, y, theta0, **{**rule, "maxiter": info["lbfgs_iterations"],
                                                                      "plateau_iterations": 0})
    assert capped_info["lbfgs_stop"] == "cap" and capped_info["plateau_decrease"] > 0
    np.testing.assert_array_equal(capped, theta)
    longer = minimize_objective(model, X, y, theta0, **{**rule, "plateau_decrease": 1e-9})[1]
    assert longer["lbfgs_iterations"] > info["lbfgs_iterations"]
    _, _, reference = reference_minimum(model, X, y, starts=2)
    assert reference["lbfgs_stop"] in ("plateau", "converged")
    for result in reference["start_results"].values():
        assert result["stop"] in ("plateau", "converged") and result["grad_norm"] >= 0
        assert result["stop"] != "plateau" or result["plateau_decrease"] <= LBFGS_NONCONVEX["plateau_decrease"]


def test_erm_returns_best_of_starts_for_every_replica():
    model, X, y, _ = problem("tanh", d=3, h=4, n=60, l2=1e-3, seed=5)
    setting = Setting(n=60, d=3, delta=1e-5, l2=1e-3)
    out = ALGORITHMS["erm"]().fit(setting, model, X, y, ReplicaStreams([4, 7]))
    theta, objective, _ = reference_minimum(model, X, y)
    assert np.array_equal(out.theta, np.tile(theta, (2, 1)))
    assert out.derived["optimum_method"] == f"lbfgs_best_of_{REFERENCE_STARTS}"


def test_dp_sgd_on_mlp_replicas_are_independent():
    model, X, y, _ = problem("tanh", d=4, h=5, n=200, seed=6)
    setting = Setting(n=200, d=4, delta=1e-5, l2=1e-3, epsilon=2.0, batch_size=20, lr=0.5, epochs=1,
                      clip_norm=0.5)
    algo = ALGORITHMS["dp_sgd"]()
    together = algo.fit(setting, model, X, y, ReplicaStreams([0, 5])).theta
    alone = algo.fit(setting, model, X, y, ReplicaStreams([5])).theta
    np.testing.assert_allclose(together[1], alone[0], rtol=1e-12, atol=1e-14)
    assert together.shape == (2, model.n_params) and np.isfinite(together).all()


GRID = """
grids:
  - name: mlp
    datasets: [{name: synthetic, n: 600}]
    models: [{name: mlp, hidden: 6}]
    algorithms:
      - erm
      - sgd
      - dp_sgd
      - {name: dp_lssgd, smoothing: 0.5}
      - song2013
      - noisy_gd
      - {name: noisy_gd, accountant: composition}
      - output_perturbation
      - bolt_on
    epsilon: [0.5]
    batch_size: [32]
    lr: [0.5]
    epochs: 2
    l2: 0.001
    seeds: 2
"""


def test_generic_algorithms_run_with_mlp_through_the_engine(run_grid):
    runs = run_grid(GRID)
    assert len(runs) == 9 * 2 and set(runs["status"]) == {"ok"}, runs[["algorithm", "message"]]
    by_name = runs.groupby("algorithm")["guarantee"].agg(set)
    assert by_name["output_perturbation"] == by_name["bolt_on"] == {"none: non-convex model"}
    assert by_name["dp_sgd"] == by_name["dp_lssgd"] == by_name["song2013"] == {"proved"}  # need only the clip
    assert by_name["noisy_gd"] == {"none: non-convex model", "proved"}  # dynamics / composition
    derived = runs["derived"].map(json.loads)
    assert (derived.map(lambda d: d["optimum_method"]) == f"lbfgs_best_of_{REFERENCE_STARTS}").all()
    erm = runs[runs["algorithm"] == "erm"]
    assert erm["optimality_gap"].abs().max() < 1e-12 and (runs["optimality_gap"] > -1e-9).all()
    assert runs["model_options"].map(json.loads).map(lambda o: o["hidden"]).eq(6).all()
    lipschitz = derived[runs["algorithm"] == "bolt_on"].map(lambda d: d["lipschitz"])
    assert (lipschitz == 1.0).all()


def test_full_data_passes_in_blocks_match_one_block(monkeypatch):
    """Full-data methods cut the examples into blocks (bounded memory); small blocks give the same numbers."""
    from dpsgd_cli.models import mlp

    model, X, y, theta = problem("sigmoid", d=4, h=3, n=50, R=3)
    v = np.random.default_rng(9).normal(size=theta.shape)
    batch = full_batch(X, y, 3)
    whole = [model.objective_and_gradient(theta, X, y), model.hvp(theta, X, y, v), model.decision(theta, X),
             model.clipped_grad_sum(theta, batch, 0.2)]
    monkeypatch.setattr(mlp, "BLOCK_ELEMENTS", 3 * 3 * 7)  # blocks of 7 examples
    blocks = [model.objective_and_gradient(theta, X, y), model.hvp(theta, X, y, v), model.decision(theta, X),
              model.clipped_grad_sum(theta, batch, 0.2)]
    for a, b in zip(whole, blocks):
        for u, w in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            np.testing.assert_allclose(w, u, rtol=1e-12, atol=1e-14)
