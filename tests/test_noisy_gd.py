"""Noisy GD (Chourasia, Ye, Shokri 2021): the Rényi bounds, their calibration, the algorithm, the figure."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from pydantic import ValidationError
from scipy import stats

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.accounting import epsilon_for
from dpsgd_cli.privacy.dynamics import (
    SATURATION_ROOT,
    calibrate_noisy_gd,
    composition_rdp,
    dynamics_rdp,
    minimum_rdp,
    noisy_gd_epsilon,
    privacy_curve,
    squared_loss_lower_bound,
)

TALK = dict(alpha=30.0, sigma=0.02, sensitivity=4.0, eta=0.02, lam=1.0, n=5000)


def dyn(K, alpha=30.0, sigma=0.02, sensitivity=4.0, eta=0.02, lam=1.0, n=5000):
    return dynamics_rdp(alpha, K, eta, sigma, lam, n, sensitivity)


def comp(K, alpha=30.0, sigma=0.02, sensitivity=4.0, eta=0.02, lam=1.0, n=5000):
    return composition_rdp(alpha, K, eta, sigma, n, sensitivity)


def low(K, alpha=30.0, sigma=0.02, sensitivity=4.0, eta=0.02, lam=1.0, n=5000):
    return squared_loss_lower_bound(alpha, K, eta, sigma, n, sensitivity)


# --- the bounds ------------------------------------------------------------------------------------------------
def test_formulas_by_hand_on_a_tiny_case():
    # α = 2, K = 3, η = 0.5, σ = 2, λ = 0.1, n = 10, S_g = 4
    assert dynamics_rdp(2, 3, 0.5, 2, 0.1, 10, 4) == pytest.approx(2 * 16 / (0.1 * 4 * 100) * (1 - math.exp(-0.075)),
                                                                   rel=1e-14)
    assert composition_rdp(2, 3, 0.5, 2, 10, 4) == pytest.approx(2 * 0.5 * 3 * 16 / (4 * 4 * 100), rel=1e-14)  # 0.03
    assert squared_loss_lower_bound(2, 3, 0.5, 2, 10, 4) == pytest.approx(2 * 16 / (4 * 4 * 100) * (1 - math.exp(-1.5)),
                                                                          rel=1e-14)
    # composition = K × the Gaussian mechanism's αΔ²/(2s²) with Δ = ηS_g/n = 0.2, s² = 2ησ² = 4
    assert composition_rdp(2, 3, 0.5, 2, 10, 4) == pytest.approx(3 * 2 * 0.2**2 / (2 * 4), rel=1e-14)
    with pytest.raises(UserError):
        dynamics_rdp(2, 3, 0.5, 2, 0.0, 10, 4)  # λ = 0: no strong convexity
    with pytest.raises(UserError):
        composition_rdp(1.0, 3, 0.5, 2, 10, 4)  # α must be > 1


def test_composition_is_the_k_fold_gaussian_mechanism_of_dp_accounting():
    """Same (ε, δ) as dp-accounting's RDP accountant for K Gaussian mechanisms of noise multiplier s/Δ."""
    K, eta, sigma, n, S = 40, 0.5, 0.05, 1000, 2.0
    z = math.sqrt(2 * eta) * sigma / (eta * S / n)
    ref = epsilon_for(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), K), 1e-6, "rdp")
    assert noisy_gd_epsilon(sigma, 1e-6, K, eta, 1.0, n, S, "composition") == pytest.approx(ref, rel=1e-9)


def test_composition_is_linear_in_k_and_alpha():
    K = np.array([1.0, 7.0, 100.0, 5000.0])
    np.testing.assert_allclose(comp(2 * K), 2 * comp(K), rtol=1e-14)
    np.testing.assert_allclose(comp(K) / K, comp(1.0), rtol=1e-14)
    np.testing.assert_allclose(comp(K, alpha=60.0), 2 * comp(K), rtol=1e-14)


def test_dynamics_is_increasing_and_saturates():
    K = np.unique(np.round(np.geomspace(1, 1e6, 400)))
    d = dyn(K)
    limit = TALK["alpha"] * TALK["sensitivity"] ** 2 / (TALK["lam"] * TALK["sigma"] ** 2 * TALK["n"] ** 2)
    assert limit == pytest.approx(0.048)
    assert np.all(np.diff(d) >= 0) and np.all(d <= limit)
    assert np.all(np.diff(d[K <= 3000]) > 0) and np.all(d[K <= 3000] < limit)  # ληK/2 ≤ 30: still below
    assert dyn(1e6) == pytest.approx(limit, rel=1e-12)
    assert dyn(2 / (TALK["lam"] * TALK["eta"])) == pytest.approx(limit * (1 - math.exp(-1)), rel=1e-12)


def test_at_small_k_the_dynamics_bound_has_twice_the_composition_slope():
    """The issue expects dynamics ≤ composition at small K; with the paper's formulas the opposite holds:
    dynamics ≈ αS_g²ηK/(2σ²n²) = 2 × composition. The composition bound is the smaller one exactly until
    ληK/2 reaches x* (1 − e^{−x*} = x*/2), the dynamics bound after."""
    for params in (TALK, dict(TALK, lam=1e-2, eta=3.0, n=30000, sensitivity=2.0, sigma=0.004)):
        ratio = dyn(1e-7, **params) / comp(1e-7, **params)
        assert ratio == pytest.approx(2.0, rel=1e-6)
        k_cross = 2 * SATURATION_ROOT / (params["lam"] * params["eta"])
        assert dyn(k_cross, **params) == pytest.approx(comp(k_cross, **params), rel=1e-12)
        K = np.geomspace(k_cross / 100, k_cross * 100, 200)
        before, after = k_cross * (1 - 1e-9) > K, k_cross * (1 + 1e-9) < K
        assert np.all(dyn(K[before], **params) > comp(K[before], **params))
        assert np.all(dyn(K[after], **params) < comp(K[after], **params))
    assert 1 - math.exp(-SATURATION_ROOT) == pytest.approx(SATURATION_ROOT / 2, abs=1e-15)
    assert 2 * SATURATION_ROOT / (TALK["lam"] * TALK["eta"]) == pytest.approx(159.36, abs=0.01)  # talk: K* ≈ 159


def test_lower_bound_is_below_both_and_matches_composition_at_one_step():
    K = np.unique(np.round(np.geomspace(1, 1e5, 300)))
    for eta in (0.005, 0.02, 0.3, 0.9):
        p = dict(TALK, eta=eta)
        assert np.all(low(K, **p) <= dyn(K, **p)) and np.all(low(K, **p) <= comp(K, **p))
    assert low(1e-7) / comp(1e-7) == pytest.approx(1.0, rel=1e-6)  # one step is one Gaussian mechanism
    assert low(1e7) == pytest.approx(dyn(1e7) / 4, rel=1e-12)  # limits αS²/(4σ²n²) and αS²/(σ²n²) (λ = 1)


@pytest.mark.parametrize("eta", [0.01, 0.1, 0.5])
def test_exact_renyi_divergence_of_the_squared_loss_lies_between_the_bounds(eta):
    """ℓ(θ; x) = ½‖θ − x‖² (λ = β = 1), neighbours with ‖x − x'‖ = S_g: θ_K are Gaussians of equal covariance v_K I
    and means μ_K apart, D_α = α‖μ_K‖²/(2v_K) exactly. It must satisfy lower ≤ D_α ≤ min(dynamics, composition)."""
    alpha, sigma, S, n = 30.0, 0.02, 4.0, 5000
    K = np.arange(1, 3000)
    mean_gap = (1 - (1 - eta) ** K) * S / n
    var = 2 * eta * sigma**2 * (1 - (1 - eta) ** (2 * K)) / (1 - (1 - eta) ** 2)
    exact = alpha * mean_gap**2 / (2 * var)
    kw = dict(alpha=alpha, sigma=sigma, sensitivity=S, eta=eta, lam=1.0, n=n)
    assert np.all(low(K, **kw) <= exact * (1 + 1e-12))
    assert np.all(exact <= dyn(K, **kw) * (1 + 1e-12)) and np.all(exact <= comp(K, **kw) * (1 + 1e-12))
    assert exact[0] == pytest.approx(comp(1, **kw), rel=1e-12)


def test_privacy_curve_frame_and_figure(tmp_path):
    from dpsgd_cli.plots.privacy_curve import k_values, plot_privacy_curve

    frame = privacy_curve(k_values(1000, 50, log=True))
    assert list(k_values(10, 4)) == [1, 4, 7, 10]
    assert list(frame.columns) == ["K", "dynamics", "composition", "lower_bound"]
    assert frame.attrs["alpha"] == 30 and frame.attrs["saturation"] == pytest.approx(0.048)
    np.testing.assert_allclose(frame["dynamics"], dyn(frame["K"].to_numpy()), rtol=1e-14)
    assert frame["K"].iloc[0] == 1 and frame["K"].iloc[-1] == 1000 and frame["K"].is_monotonic_increasing
    path = plot_privacy_curve(frame, tmp_path / "fig" / "privacy_curve.png")
    assert path.exists() and path.stat().st_size > 10_000
    with pytest.raises(UserError):
        plot_privacy_curve(frame.drop(columns="lower_bound"), tmp_path / "x.png")


# --- calibration -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["dynamics", "composition"])
@pytest.mark.parametrize("target", [0.3, 1.0, 3.0, 8.0])
def test_calibration_round_trips(accountant, target):
    n, delta, K, eta, lam, S = 30162, 1 / 30162**2, 300, 3.9, 1e-3, 2.0
    point = calibrate_noisy_gd(target, delta, K, eta, lam, n, S, accountant)
    eps = noisy_gd_epsilon(point.sigma, delta, K, eta, lam, n, S, accountant)
    assert eps == point.epsilon and 0.999 * target <= eps <= target
    assert noisy_gd_epsilon(point.sigma * 0.99, delta, K, eta, lam, n, S, accountant) > target  # smallest σ


def test_equal_epsilon_means_equal_rdp_slope():
    """Both curves are c·α, so equal (ε, δ) means equal c: σ_dyn²/σ_comp² = 2(1 − e^{−x})/x, x = ληK/2."""
    n, delta, K, eta, lam, S = 30162, 1e-9, 300, 3.9, 1e-3, 2.0
    s_dyn = calibrate_noisy_gd(1.0, delta, K, eta, lam, n, S, "dynamics").sigma
    s_comp = calibrate_noisy_gd(1.0, delta, K, eta, lam, n, S, "composition").sigma
    x = lam * eta * K / 2
    assert (s_dyn / s_comp) ** 2 == pytest.approx(2 * (1 - math.exp(-x)) / x, rel=3e-3)


# --- the algorithm ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(make_logistic_data):
    return make_logistic_data(7, 300, [1.0, -2.0, 0.5, 0.0, 1.0], 0.3)


def _setting(n, d, **kw):
    base = dict(n=n, d=d, delta=1e-5, l2=0.05, epsilon=1.0, batch_size=None, lr=2.0, epochs=30, clip_norm=1.0)
    return Setting(**{**base, **kw})


@pytest.mark.parametrize("accountant", ["dynamics", "composition"])
def test_derived_constants(data, accountant):
    X, y = data
    setting = _setting(*X.shape, clip_norm=1.5)
    out = ALGORITHMS["noisy_gd"]({"accountant": accountant}).fit(setting, make_model("logreg", 5, 0.05), X, y,
                                                                  ReplicaStreams([0]))
    cal = calibrate_noisy_gd(1.0, 1e-5, 30, 2.0, 0.05, 300, 3.0, accountant)
    der = out.derived
    assert der["sigma"] == cal.sigma and der["epsilon_achieved"] == cal.epsilon and der["accountant"] == accountant
    assert der["steps"] == 30 and der["sensitivity"] == 3.0 and der["sample_rate"] == 1.0
    assert der["step_noise_std"] == pytest.approx(math.sqrt(2 * 2.0) * cal.sigma, rel=1e-14)
    assert der["beta"] == pytest.approx(0.25 + 0.05) and der[f"epsilon_{accountant}"] == pytest.approx(cal.epsilon)
    assert out.guarantee == "proved"


def test_noise_is_gaussian_with_std_sqrt_2_eta_sigma():
    """Zero features, θ₀ = 0, one step: θ₁ = √(2ησ²) z, so θ₁/√(2ησ²) must be N(0, I) (5% scale error caught)."""
    n, d, eta = 50, 40000, 3.0
    setting = _setting(n, d, lr=eta, epochs=1, l2=0.05)  # η = 3 ≤ 1/β = 1/0.3
    out = ALGORITHMS["noisy_gd"]({"accountant": "dynamics"}).fit(
        setting, make_model("logreg", d, 0.05), np.zeros((n, d)), np.ones(n), ReplicaStreams([0, 1, 2]))
    assert out.guarantee == "proved"
    z = (out.theta / math.sqrt(2 * eta * out.derived["sigma"] ** 2)).ravel()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z / 1.05, "norm").pvalue < 1e-6 and stats.kstest(z * 1.05, "norm").pvalue < 1e-6


def test_without_noise_it_is_projected_gradient_descent(data):
    X, y = data
    model = make_model("logreg", 5, 0.05)
    setting = _setting(*X.shape)
    for radius in (None, 0.3):
        algo = ALGORITHMS["noisy_gd"]({"radius": radius})
        theta0 = np.random.default_rng(1).normal(size=(2, 5))
        got = algo.chain(setting, X, y, ReplicaStreams([0, 1]), noise_std=0.0).run(model, theta0, 30)
        theta = theta0.copy()
        for _ in range(30):
            theta = theta - setting.lr * model.gradient(theta, X, y)  # C = 1 ≥ ‖∇ℓ‖: clipping is a no-op
            if radius is not None:
                theta = theta * np.minimum(1, radius / np.linalg.norm(theta, axis=1, keepdims=True))
        np.testing.assert_allclose(got, theta, rtol=1e-11, atol=1e-13)


def test_projection_keeps_every_iterate_in_the_ball(data):
    X, y = data
    model = make_model("logreg", 5, 0.05)
    chain = ALGORITHMS["noisy_gd"]({"radius": 0.2}).chain(_setting(*X.shape), X, y, ReplicaStreams([0, 1]),
                                                          noise_std=5.0)
    theta = model.init([np.random.default_rng(0)] * 2)
    for _ in range(40):
        theta = chain.run(model, theta, 1)
        assert np.all(np.linalg.norm(theta, axis=1) <= 0.2 * (1 + 1e-12))
    assert np.all(np.linalg.norm(theta, axis=1) > 0.19)  # the noise pushes it to the boundary


def test_replicas_are_independent(data):
    X, y = data
    model = make_model("logreg", 5, 0.05)
    algo = ALGORITHMS["noisy_gd"]()
    together = algo.fit(_setting(*X.shape), model, X, y, ReplicaStreams([0, 1, 2])).theta
    alone = algo.fit(_setting(*X.shape), model, X, y, ReplicaStreams([2])).theta
    # bit for bit: a seed's run must not depend on the seeds beside it (one gemm over the full batch's replicas
    # would round differently with their number; docs/design.md, the bit-for-bit rule)
    np.testing.assert_array_equal(together[2], alone[0])
    assert not np.allclose(together[0], together[1])


def test_guarantee_names_the_failed_assumption(data):
    X, y = data
    algo, model = ALGORITHMS["noisy_gd"](), make_model("logreg", 5, 0.05)

    def guarantee(X=X, model=model, **kw):
        return algo.fit(_setting(*X.shape, **kw), model, X, y, ReplicaStreams([0])).guarantee

    assert guarantee() == "proved"
    assert guarantee(lr=1 / 0.3) == "proved"  # η = 1/β exactly
    assert guarantee(lr=4.0).startswith("none: step size η = 4 > 1/β = 3.333")
    assert guarantee(clip_norm=0.5).startswith("none: clipping active (C = 0.5 < L = 1)")
    assert guarantee(X=X * 2).startswith("none: rows outside the unit ball (max ‖x‖ = 2")
    nonconvex = make_model("logreg", 5, 0.05)
    nonconvex.convex = False
    assert guarantee(model=nonconvex) == "none: non-convex model"
    with pytest.raises(UserError, match="l2 > 0"):
        guarantee(l2=0.0)
    # composition needs none of these: only the clipping
    comp_algo = ALGORITHMS["noisy_gd"]({"accountant": "composition"})
    for kw in (dict(l2=0.0), dict(lr=4.0), dict(clip_norm=0.5)):
        assert comp_algo.fit(_setting(*X.shape, **kw), model, X, y, ReplicaStreams([0])).guarantee == "proved"
    with pytest.raises(UserError, match="epochs"):
        guarantee(epochs=0.4)
    with pytest.raises(ValidationError):
        ALGORITHMS["noisy_gd"]({"radius": 0})


def test_minimum_bound_is_never_above_either_and_equals_the_smaller():
    K = np.arange(0, 400)
    for alpha in (2.0, 30.0):
        d = dyn(K, alpha=alpha)
        c = comp(K, alpha=alpha)
        m = minimum_rdp(alpha, K, TALK["eta"], TALK["sigma"], TALK["lam"], TALK["n"], TALK["sensitivity"])
        assert (m <= d).all() and (m <= c).all()
        x = TALK["lam"] * TALK["eta"] * K / 2
        np.testing.assert_array_equal(m[x <= SATURATION_ROOT], c[x <= SATURATION_ROOT])  # composition smaller
        np.testing.assert_array_equal(m[x > SATURATION_ROOT], d[x > SATURATION_ROOT])  # dynamics smaller
        assert (x <= SATURATION_ROOT).any() and (x > SATURATION_ROOT).any()


@pytest.mark.parametrize("lam, smaller", [(1e-4, "composition"), (0.05, "dynamics")])
def test_minimum_accountant_calibrates_to_the_smaller_bound(lam, smaller):
    """The `algorithms` grid's case (λ = 1e-4, η = 3.99, K = 300: ληK/2 = 0.06) gets composition's σ, and a
    large ληK/2 the dynamics σ; never more noise than either."""
    n, delta, K, eta, S = 30162, 1 / 30162**2, 300, 3.99, 2.0
    sigmas = {a: calibrate_noisy_gd(1.0, delta, K, eta, lam, n, S, a).sigma
              for a in ("dynamics", "composition", "minimum")}
    assert sigmas["minimum"] == pytest.approx(sigmas[smaller], rel=2e-3)
    assert sigmas["minimum"] <= min(sigmas["dynamics"], sigmas["composition"]) * (1 + 2e-3)


def test_traces_or_minimum_change_the_guarantee(data):
    """The dynamics bound covers θ_K only: recording intermediate θ (trace_every) is not proved under it; the
    minimum accountant is proved where it equals composition (ληK/2 ≤ 1.594) even if dynamics' assumptions fail."""
    X, y = data
    model = make_model("logreg", 5, 0.05)

    def guarantee(accountant, **kw):
        algo = ALGORITHMS["noisy_gd"]({"accountant": accountant})
        return algo.fit(_setting(*X.shape, **kw), model, X, y, ReplicaStreams([0])).guarantee

    assert guarantee("dynamics", trace_every=300).startswith("none: intermediate θ recorded")
    assert guarantee("composition", trace_every=300) == "proved"
    assert guarantee("minimum") == "proved"  # λη K/2 = 1.5 ≤ 1.594: composition is the minimum
    assert guarantee("minimum", trace_every=300) == "proved"
    assert guarantee("minimum", epochs=200, trace_every=300).startswith("none: intermediate θ recorded")
    assert guarantee("minimum", epochs=200, lr=4.0).startswith("none: step size")


def test_lower_bound_only_for_lambda_one():
    frame = privacy_curve([1, 10], lam=0.5)
    assert frame["lower_bound"].isna().all() and "λ = β = 1" in frame.attrs["lower_bound_note"]
    assert privacy_curve([1, 10])["lower_bound"].notna().all() and "lower_bound_note" not in privacy_curve([1]).attrs
    # the talk's tightness: dynamics ≤ 4 · lower bound at λ = 1, the ratio 4/(1 + e^{−ηK/2}) tends to 4
    K = np.array([1, 10, 100, 1000, 10**5])
    ratio = dyn(K) / low(K)
    np.testing.assert_allclose(ratio, 4 / (1 + np.exp(-TALK["eta"] * K / 2)), rtol=1e-9)
    assert (ratio <= 4).all() and ratio[-1] == pytest.approx(4)


GRID = """
grids:
  - name: ngd
    datasets: [{name: synthetic, n: 600}]
    algorithms:
      - {name: noisy_gd, accountant: dynamics}
      - {name: noisy_gd, accountant: composition, radius: 5}
    epsilon: [1, 3]
    lr: [2.0]
    l2: [0.01]
    seeds: 2
    epochs: 20
"""


def test_end_to_end_through_the_engine(run_grid):
    runs = run_grid(GRID)
    assert len(runs) == 8 and set(runs["status"]) == {"ok"} and set(runs["guarantee"]) == {"proved"}
    assert (runs["sigma"] > 0).all() and set(runs["accountant"]) == {"dynamics", "composition"}
    assert (runs["epsilon_achieved"] <= runs["epsilon"]).all()
    assert (runs["epsilon_achieved"] >= 0.999 * runs["epsilon"]).all()
    assert (runs["steps"] == 20).all() and runs["batch_size"].isna().all()
    assert runs["derived"].str.contains('"sensitivity": 2.0').all()
