"""DP-LSSGD: the FFT Laplacian solve, its place in the DP-SGD chain, its noise, and a run through the engine."""


import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.ops import (
    Clip,
    LaplacianSmoothing,
    Noise,
    laplacian_eigenvalues,
    smoothed_noise_variance_factor,
)
from dpsgd_cli.algorithms.sampling import poisson_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.accounting import calibrate_sigma


def dense_laplacian(P: int) -> np.ndarray:
    """Δ with (Δv)_i = v_{i−1} − 2v_i + v_{i+1}, indices mod P, built entry by entry (adds up when neighbours
    coincide: P = 1 gives Δ = 0, P = 2 gives [[−2, 2], [2, −2]])."""
    L = np.zeros((P, P))
    for i in range(P):
        L[i, i] -= 2.0
        L[i, (i - 1) % P] += 1.0
        L[i, (i + 1) % P] += 1.0
    return L


@pytest.fixture(scope="module")
def data(make_logistic_data):
    return make_logistic_data(3, 400, [1.0, -2.0, 0.5, 0.0, 1.0, -0.5], 0.1)


def _setting(n, d, **kw):
    base = dict(n=n, d=d, delta=1e-5, l2=1e-2, epsilon=1.0, batch_size=40, lr=0.5, epochs=2, clip_norm=1.0)
    return Setting(**{**base, **kw})


def smooth(sigma_ls, g):
    """The `LaplacianSmoothing` op's update of g (its state made from g's length)."""
    op = LaplacianSmoothing(sigma_ls)
    return op.update(g, op.init(g), g)[0]


def test_small_cases_by_hand():
    np.testing.assert_array_equal(dense_laplacian(1), [[0.0]])
    np.testing.assert_array_equal(dense_laplacian(2), [[-2.0, 2.0], [2.0, -2.0]])
    np.testing.assert_allclose(laplacian_eigenvalues(0.5, 4), [1.0, 2.0, 3.0, 2.0])  # 1 + 2·0.5·(1 − cos(πk/2))
    g = np.array([[1.0, 3.0]])  # P = 2, σ = 1: A = [[3, −2], [−2, 3]], A⁻¹ = [[3, 2], [2, 3]]/5, A⁻¹g = [9, 11]/5
    np.testing.assert_allclose(smooth(1.0, g), [[9 / 5, 11 / 5]], rtol=1e-14)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8, 17, 64])
@pytest.mark.parametrize("sigma_ls", [0.1, 1.0, 7.5])
def test_fft_solve_equals_the_dense_inverse(P, sigma_ls):
    A = np.eye(P) - sigma_ls * dense_laplacian(P)
    np.testing.assert_allclose(np.sort(laplacian_eigenvalues(sigma_ls, P)), np.linalg.eigvalsh(A), rtol=1e-12)
    g = np.random.default_rng(P).normal(size=(3, P))
    expected = np.linalg.solve(A, g.T).T
    np.testing.assert_allclose(smooth(sigma_ls, g), expected, rtol=1e-11, atol=1e-13)
    assert smooth(sigma_ls, g).shape == g.shape
    factor = np.mean(np.diag(np.linalg.inv(A) @ np.linalg.inv(A).T))  # Var((A⁻¹z)_i) averaged over i
    assert smoothed_noise_variance_factor(sigma_ls, P) == pytest.approx(factor, rel=1e-10)


def test_smoothing_zero_is_the_identity_and_bad_values_are_rejected():
    g = np.random.default_rng(0).normal(size=(2, 9))
    assert smooth(0.0, g) is g
    with pytest.raises(UserError):
        LaplacianSmoothing(-1.0)
    with pytest.raises(ValidationError):
        ALGORITHMS["dp_lssgd"]({"smoothing": -0.1})
    with pytest.raises(ValidationError):
        ALGORITHMS["dp_lssgd"]({"smoothng": 1.0})


def test_smoothing_zero_is_dp_sgd_exactly(data):
    X, y = data
    model = make_model("logreg", X.shape[1], 1e-2)
    setting, seeds = _setting(*X.shape), [0, 5]
    ref = ALGORITHMS["dp_sgd"]().fit(setting, model, X, y, ReplicaStreams(seeds))
    out = ALGORITHMS["dp_lssgd"]({"smoothing": 0.0}).fit(setting, model, X, y, ReplicaStreams(seeds))
    np.testing.assert_array_equal(out.theta, ref.theta)
    assert out.derived["sigma"] == ref.derived["sigma"] and out.guarantee == "proved"
    assert out.derived["smoothed_noise_variance_factor"] == 1.0


def test_same_calibration_as_dp_sgd_and_derived_values(data):
    X, y = data
    model = make_model("logreg", X.shape[1], 1e-2)
    setting = _setting(*X.shape)
    for accountant in ("rdp", "pld"):
        out = ALGORITHMS["dp_lssgd"]({"smoothing": 2.0, "accountant": accountant}).fit(
            setting, model, X, y, ReplicaStreams([0]))
        cal = calibrate_sigma(setting.epsilon, setting.delta, setting.sample_rate, setting.steps, accountant=accountant)
        assert out.derived["sigma"] == cal.sigma and out.derived["epsilon_achieved"] == cal.epsilon
        assert out.derived["accountant"] == accountant and out.derived["steps"] == setting.steps == 20
        assert out.derived["smoothing"] == 2.0
        assert out.derived["smoothed_noise_variance_factor"] == pytest.approx(
            np.mean((1 + 4 * (1 - np.cos(2 * np.pi * np.arange(6) / 6))) ** -2.0))


def test_without_noise_it_is_laplacian_smoothing_sgd_with_the_regulariser_smoothed(data):
    """θ ← θ − η A⁻¹((1/B) Σ ∇ℓ_i + λθ) on the same Poisson batches, A⁻¹ as a dense inverse."""
    X, y = data
    l2, sigma_ls = 0.05, 1.5
    model = make_model("logreg", X.shape[1], l2)
    setting, streams = _setting(*X.shape, l2=l2), ReplicaStreams([0, 1])
    algo = ALGORITHMS["dp_lssgd"]({"smoothing": sigma_ls})
    silent = Noise(0.0, streams.normal("noise", (X.shape[1],)))
    theta0 = np.random.default_rng(9).normal(size=(2, X.shape[1]))  # λθ ≠ 0 from the first step
    got = algo.chain(setting, X, y, streams, (Clip(1e12), silent)).run(model, theta0, setting.steps)
    A_inv = np.linalg.inv(np.eye(X.shape[1]) - sigma_ls * dense_laplacian(X.shape[1]))
    theta, batches = theta0.copy(), poisson_batches(X, y, setting.sample_rate, ReplicaStreams([0, 1]))
    for _ in range(setting.steps):
        g = model.clipped_grad_sum(theta, next(batches), None) / setting.batch_size + l2 * theta
        theta = theta - setting.lr * g @ A_inv.T
    np.testing.assert_allclose(got, theta, rtol=1e-10, atol=1e-12)


def test_noise_is_smoothed_gaussian_with_std_sigma_times_clip():
    """Zero features: θ₁ = −η A⁻¹(σC z)/B, so −B A θ₁ /(ησC) must be N(0, I) (a 5% scale error is caught)."""
    n, d, B, C, lr, sigma_ls = 20, 40000, 10, 0.7, 0.3, 1.0
    X, y = np.zeros((n, d)), np.ones(n)
    setting = _setting(n, d, batch_size=B, epochs=B / n, clip_norm=C, lr=lr, l2=0.0, epsilon=2.0)
    assert setting.steps == 1
    out = ALGORITHMS["dp_lssgd"]({"smoothing": sigma_ls}).fit(setting, make_model("logreg", d, 0.0), X, y,
                                                              ReplicaStreams([0, 1, 2]))
    sigma = out.derived["sigma"]
    assert sigma == calibrate_sigma(2.0, 1e-5, B / n, 1).sigma
    # apply A = I − σ_ls Δ to θ₁ directly (no solve): (Aθ)_i = (1 + 2σ)θ_i − σ(θ_{i−1} + θ_{i+1})
    theta = out.theta
    A_theta = (1 + 2 * sigma_ls) * theta - sigma_ls * (np.roll(theta, 1, axis=1) + np.roll(theta, -1, axis=1))
    z = (-A_theta * B / (lr * sigma * C)).ravel()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z / 1.05, "norm").pvalue < 1e-6
    # the smoothed noise itself has the predicted per-coordinate variance
    smoothed = (-theta * B / (lr * sigma * C)).ravel()
    assert np.var(smoothed) == pytest.approx(smoothed_noise_variance_factor(sigma_ls, d), rel=0.03)


def test_replicas_are_independent(data):
    X, y = data
    model = make_model("logreg", X.shape[1], 1e-2)
    algo = ALGORITHMS["dp_lssgd"]({"smoothing": 1.0})
    together = algo.fit(_setting(*X.shape), model, X, y, ReplicaStreams([0, 1, 2])).theta
    alone = algo.fit(_setting(*X.shape), model, X, y, ReplicaStreams([2])).theta
    np.testing.assert_allclose(together[2], alone[0], rtol=1e-12)
    assert not np.allclose(together[0], together[1])


GRID = """
grids:
  - name: lssgd
    datasets: [{name: synthetic, n: 600}]
    algorithms: [dp_sgd, {name: dp_lssgd, smoothing: 1.0}, {name: dp_lssgd, smoothing: 0.0, accountant: pld}]
    epsilon: [1]
    batch_size: [32]
    lr: [0.5]
    seeds: 2
    epochs: 2
"""


def test_end_to_end_through_the_engine(run_grid):
    runs = run_grid(GRID)
    lssgd = runs[runs["algorithm"] == "dp_lssgd"]
    assert len(lssgd) == 4 and set(lssgd["status"]) == {"ok"} and set(lssgd["guarantee"]) == {"proved"}
    assert (lssgd["sigma"] > 0).all() and set(lssgd["accountant"]) == {"rdp", "pld"}
    assert (lssgd["epsilon_achieved"] <= 1).all() and (lssgd["epsilon_achieved"] >= 0.999).all()
    assert lssgd["derived"].str.contains('"smoothing"').all()
    # smoothing 0 with the same seeds and accountant is dp_sgd (here: pld vs rdp differ, so compare rdp rows)
    dp = runs[runs["algorithm"] == "dp_sgd"].sort_values("seed")
    smooth = lssgd[lssgd["accountant"] == "rdp"].sort_values("seed")
    np.testing.assert_array_equal(dp["sigma"].to_numpy(), smooth["sigma"].to_numpy())
