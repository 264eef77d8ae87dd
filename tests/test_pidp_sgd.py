"""PIDP-SGD (Kang et al., Algorithm 1): the per-coordinate test against the paper's two-stage formula and its
reduction, the closed-form skip probability (against sampling and against runs), the guarantee in both regimes,
the constants by hand, the Hessian and influence vectors, both branches, NumPy = numba, the variants, the mlp."""

import json
import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import expit

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms import pidp_sgd as P
from dpsgd_cli.algorithms.chain import GradientChain
from dpsgd_cli.algorithms.ops import Clip, Noise, Sgd, WeightDecay, constant
from dpsgd_cli.algorithms.sampling import fixed_batches, uniform_examples
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model
from dpsgd_cli.models.logreg import MAX_ABS_SIGMOID_2ND, logistic_hessian
from dpsgd_cli.privacy.accounting import calibrate_sigma
from dpsgd_cli.privacy.single_example_gaussian import calibrate_bassily

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed")


@pytest.fixture(autouse=True)
def _one_blas_thread():
    """Small matrices: BLAS threads only add contention (the engine's workers run single-threaded too)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        yield


@pytest.fixture(scope="module")
def data(make_logistic_data):
    return make_logistic_data(7, 300, [1.0, -2.0, 0.5, 0.0, 1.0, 0.3], 0.2)


def _setting(n, d, **kw):
    base = {"n": n, "d": d, "delta": 1e-5, "l2": 1e-3, "epsilon": 1.0, "batch_size": 1, "lr": 0.5, "epochs": 2}
    return Setting(**{**base, **kw})


def _fit(X, y, seeds=(0, 1), params=None, **kw):
    setting = _setting(*X.shape, **kw)
    model = make_model("logreg", X.shape[1], setting.l2)
    return ALGORITHMS["pidp_sgd"](params or {}).fit(setting, model, X, y, ReplicaStreams(seeds)), setting, model


def _half_pass_radius(n, d, rounds=2, epsilon=1.0, delta=1e-5, zeta=0.05, share=0.5):
    """r for which a zero contribution passes the coordinate test with probability `share` (m = d coordinates)."""
    sigma_c = P.contribution_sigma(1.0, rounds, delta / 2, n, zeta, epsilon / 4)
    tau = sigma_c * stats.norm.ppf(0.5 + 0.5 * share ** (1 / d))
    return tau / (2 * (delta / 2) * (1 + math.exp(-0.75 * epsilon)))


# --- the decision rule: the paper's two-stage test and its reduction -----------------------------------------


def test_threshold_by_hand_and_the_two_stage_test_on_hand_made_vectors():
    r, eps1, delta1 = 10.0, 0.75, 0.01
    # τ = 2rδ₁(1 + e^{−ε₁}) = 0.2·(1 + 0.4723665527) = 0.29447331054; stage 1 at a/k = 2re^{ε₁}δ₁/(e^{ε₁} − 1)
    # = 0.2·2.1170000166/1.1170000166 = 0.37905103...
    tau = P.coordinate_threshold(r, eps1, delta1)
    assert tau == pytest.approx(0.29447331054, rel=1e-10)
    stage1 = 2 * r * math.exp(eps1) * delta1 / math.expm1(eps1)
    assert stage1 == pytest.approx(0.379051, rel=1e-5) and tau < stage1
    cases = {  # vector → noiseless?
        (0.0, 0.0, 0.0): True,
        (0.29, -0.29, 0.1): True,  # every |c_i| < τ
        (-0.2944, 0.0): True,
        (0.2946, 0.0): False,  # between τ and the stage-1 bound: the ln test (line 10) fails
        (0.0, -0.30): False,  # negative coordinate: sign(c)c = |c|
        (0.1, 0.38): False,  # ≥ the stage-1 bound: "jump to line 13"
        (5.0,): False,
    }
    for c, noiseless in cases.items():
        assert P.paper_two_stage_test(np.array(c), r, eps1, delta1) is noiseless, c
        assert bool(np.max(np.abs(c)) <= tau) is noiseless, c
    # the ln of line 10 at |c| = 0.2946 exceeds 2ε₁ = 1.5 by hand: a = 0.42340000, k = 1.1170000,
    # a − k·0.2946 = 0.0943318, ln(0.4234/0.0943318) = 1.50150 > 1.5
    a, k = 2 * r * math.exp(eps1) * delta1, math.expm1(eps1)
    assert math.log(a / (a - k * 0.2946)) == pytest.approx(1.50150, abs=1e-4)


@pytest.mark.parametrize("eps1,delta1,r", [(0.0075, 1e-10, 3e7), (0.75, 1e-3, 50.0), (2.25, 5e-6, 1e4)])
def test_two_stage_test_equals_the_reduced_rule_on_random_vectors(eps1, delta1, r):
    tau = P.coordinate_threshold(r, eps1, delta1)
    rng = np.random.default_rng(0)
    C = tau * rng.uniform(-1.6, 1.6, size=(4000, 3))
    C = C[np.abs(np.abs(C).max(axis=1) / tau - 1) > 1e-9]  # away from the boundary (rounding of the ln)
    literal = np.array([P.paper_two_stage_test(c, r, eps1, delta1) for c in C])
    assert (literal == (np.abs(C).max(axis=1) <= tau)).all() and 0.05 < literal.mean() < 0.5


def test_error_is_added_per_coordinate_away_from_zero():
    v = np.array([[[0.3, -0.2, 0.0]], [[-1.0, 1.0, 2.0]]])
    np.testing.assert_allclose(P.with_error(v, 0.1), [[[0.4, -0.3, 0.1]], [[-1.1, 1.1, 2.1]]])
    np.testing.assert_allclose(P.with_error(v, np.array([0.1, 0.0])), [[[0.4, -0.3, 0.1]], [[-1.0, 1.0, 2.0]]])


def test_coordinate_rule_with_zero_noise_is_the_threshold_on_2c_plus_E():
    rule = P.DecisionRule("coordinate", 0.0, 1.0)
    v = np.array([[[0.4, -0.1], [0.45, 0.0], [0.0, -0.51]]])
    # 2(|v| + E) ≤ 1 with E = 0.05: 0.9 ✓, 1.0 ✓ (equality passes: line 10 is ≤), 1.12 ✗
    np.testing.assert_array_equal(rule.passes(v, 0.05, [np.random.default_rng(0)]), [[True, True, False]])


def test_pass_probability_closed_form_against_sampling():
    mu = np.array([0.3, -0.1, 0.0, 0.05])
    sigma, tau = 0.4, 0.9
    b = np.random.default_rng(0).normal(size=(200_000, 4)) * sigma
    sampled = (np.abs(2 * mu + b).max(axis=1) <= tau).mean()
    exact = P.coordinate_pass_probability(mu, sigma, tau)
    assert abs(sampled - exact) < 4 * math.sqrt(exact * (1 - exact) / 200_000)
    # by hand, one coordinate at μ = 0: 2Φ(τ/σ) − 1 = 2Φ(2.25) − 1 = 0.9755510
    assert P.coordinate_pass_probability(np.zeros(1), sigma, tau) == pytest.approx(0.9755510, rel=1e-6)
    # upper tail without cancellation: μ far from 0
    assert P.coordinate_pass_probability(np.array([20.0]), 1.0, 1.0) == pytest.approx(
        stats.norm.sf(39.0) - stats.norm.sf(41.0), rel=1e-6)


def test_skip_probability_bound_is_the_worst_case_over_contributions():
    sigma, tau, E, m = 0.5, 0.8, 0.02, 6
    p = P.skip_probability_bound("coordinate", m, sigma, tau, E)
    assert p == pytest.approx(P.coordinate_pass_probability(np.full(m, E), sigma, tau), rel=1e-12)
    rng = np.random.default_rng(1)
    for _ in range(200):  # every contribution the reading allows (|μ_i| ≥ E) passes with probability ≤ p
        mu = np.sign(rng.normal(size=m)) * (E + rng.exponential(0.3, size=m))
        assert P.coordinate_pass_probability(mu, sigma, tau) <= p * (1 + 1e-12)
    # l2_radius: the non-central χ² CDF at ‖c‖ = E against sampling
    r = 1.5
    b = rng.normal(size=(200_000, m)) * sigma
    c = np.zeros(m)
    c[0] = 2 * E
    sampled = (np.linalg.norm(c + b, axis=1) <= r).mean()
    exact = P.skip_probability_bound("l2_radius", m, sigma, r, E)
    assert abs(sampled - exact) < 4 * math.sqrt(exact * (1 - exact) / 200_000)
    assert P.skip_probability_bound("l2_radius", m, sigma, r, 0.0) == pytest.approx(stats.chi2.cdf(9.0, m))


def test_certified_delta_by_hand_and_the_guarantee_text():
    # δ + (1 + e^{ε₁})·T·p = 1e-5 + (1 + e^{0.75})·1000·1e-9 = 1e-5 + 3.1170000166e-6
    assert P.certified_delta(1e-5, 0.75, 1000, 1e-9) == pytest.approx(1.31170000166e-5, rel=1e-10)
    text, delta = P.tv_guarantee(1.0, 1e-5, 0.75, 1000, 1e-9)
    assert text.startswith("tv-bound: (1, 1.31e-05)-DP") and delta == pytest.approx(1.3117e-5, rel=1e-4)
    text, delta = P.tv_guarantee(1.0, 1e-5, 0.75, 1000, 1e-3)
    assert text.startswith("none: a step may skip the noise with probability p = 0.001") and math.isnan(delta)


# --- constants by hand -------------------------------------------------------------------------------------------


def test_sigma_c_and_error_bound_by_hand():
    # σ_c = 2.83·G·R·√(ln(1.25R/δ₂))/(nζε₂), G=1, R=2, δ₂=1e-4, n=100, ζ=0.5, ε₂=0.25:
    # ln(25000) = 10.126631, √ = 3.1822368, 2.83·2·3.1822368 = 18.011460, / (100·0.5·0.25 = 12.5) = 1.4409168
    assert P.contribution_sigma(1.0, 2, 1e-4, 100, 0.5, 0.25) == pytest.approx(1.4409168, rel=1e-7)
    # E = (2LG + CG²/ζ)/(ζ²n²), L=1/4, G=1, C=1/(6√3)=0.09622504, ζ=0.5, n=100:
    # (0.5 + 0.19245009)/(0.25·10⁴) = 2.7698004e-4
    assert P.influence_error_bound(0.25, 1.0, 1 / (6 * math.sqrt(3)), 0.5, 100) == pytest.approx(2.7698004e-4, rel=1e-7)
    m = np.linspace(-10, 10, 2_000_001)
    assert np.abs(expit(m) * expit(-m) * (1 - 2 * expit(m))).max() == pytest.approx(MAX_ABS_SIGMOID_2ND, rel=1e-9)


def test_fit_derives_the_paper_constants(data):
    X, y = data
    out, _, _ = _fit(X, y, params={"zeta": 0.05, "rounds": 3, "local_steps": 200})
    d = out.derived
    n, R = X.shape[0], 3
    assert (d["rounds"], d["local_steps"], d["steps"]) == (3, 200, 600)
    assert (d["epsilon_1"], d["epsilon_2"], d["delta_1"], d["delta_2"]) == (0.75, 0.25, 5e-6, 5e-6)
    assert (d["rule"], d["sampling"], d["contribution_noise"]) == ("coordinate", "single", "per_round")
    assert list(d["deviations"]) == ALGORITHM_1_READINGS  # Algorithm 1 as run by default: the labelled readings
    assert d["deviations"] == {k: P.DEVIATIONS[k] for k in ALGORITHM_1_READINGS}
    by_hand = 2.83 * 1.0 * R * math.sqrt(math.log(1.25 * R / 5e-6)) / (n * 0.05 * 0.25)
    assert d["sigma_c"] == pytest.approx(by_hand, rel=1e-12)
    assert d["threshold"] == pytest.approx(2 * 10 * 5e-6 * (1 + math.exp(-0.75)), rel=1e-12)
    E = (2 * 0.25 * 1.0 + (1 / (6 * math.sqrt(3))) / 0.05) / (0.05**2 * n**2)
    assert d["influence_error_bound"] == pytest.approx(E, rel=1e-12)
    priv = calibrate_bassily(0.75, 5e-6, n, 600, 1.0, "pld")  # one example per step, replace-one, PLD (auto)
    assert d["noise_std"] == priv.sigma and d["epsilon_achieved"] == pytest.approx(priv.epsilon + 0.25)
    assert d["accountant"] == "pld"  # the name the baselines' rows record, so captions see one accountant
    assert d["epsilon_achieved"] <= 1.0 and d["hessian_damped"] is True
    p = P.skip_probability_bound("coordinate", 6, d["sigma_c"], d["threshold"], E)
    assert d["skip_probability_bound"] == pytest.approx(p) and out.guarantee.startswith("tv-bound: (1, 1e-05)-DP")


def test_default_schedule_is_one_round_per_epoch(data):
    X, y = data
    s = _setting(*X.shape, epochs=3)
    assert ALGORITHMS["pidp_sgd"]().schedule(s) == (3, 300) and s.steps == 900


# --- Hessian and influence vectors -------------------------------------------------------------------------------


def test_hessian_matches_finite_differences_of_the_gradient(data):
    X, y = data
    l2, d = 1e-2, X.shape[1]
    model = make_model("logreg", d, l2)
    theta = np.random.default_rng(0).normal(size=(2, d))
    H = logistic_hessian(theta, X, y, l2)
    h = 1e-5
    for j in range(d):
        e = np.zeros(d)
        e[j] = h
        column = (model.gradient(theta + e, X, y) - model.gradient(theta - e, X, y)) / (2 * h)
        np.testing.assert_allclose(H[:, :, j], column, atol=1e-8)
    np.testing.assert_allclose(H, np.swapaxes(H, 1, 2))
    Hd, damped = P.damped(H, l2, 0.5)
    assert damped and np.linalg.eigvalsh(Hd).min() >= 0.5
    assert P.damped(H, l2, l2)[1] is False  # λ ≥ ζ: H already has λ_min ≥ ζ, nothing added


def test_influence_vectors_match_a_dense_solve(data):
    X, y = data
    n, d = X.shape
    theta = np.random.default_rng(1).normal(size=(3, d))
    x_norm = np.linalg.norm(X, axis=1)
    model = make_model("logreg", d, 0.0)
    for G in (1.0, 0.2):  # 0.2 clips most gradients
        inf = P.round_influence("full", None, theta, X, y, x_norm, 1e-3, 0.05, G)
        H, _ = P.damped(logistic_hessian(theta, X, y, 1e-3), 1e-3, 0.05)
        v = inf.vectors(X[:20], y[:20], x_norm[:20])
        for r in range(3):
            for i in range(20):
                g = model.data_gradient(theta[r:r + 1], X[i:i + 1], y[i:i + 1])[0]
                g = g * min(1.0, G / np.linalg.norm(g))
                np.testing.assert_allclose(v[r, i], np.linalg.solve(H[r], g) / n, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(inf.vectors(X[:20], y[:20], x_norm[:20], slice(1, 2))[0], v[1])
        norms = inf.norms(X, y, x_norm)
        np.testing.assert_allclose(norms[:, :20], np.linalg.norm(v, axis=-1), rtol=1e-10)
        assert norms.max() <= G / (n * 0.05) + 1e-15  # ‖H⁻¹‖ ≤ 1/ζ: the bound σ_c uses


def test_noised_norm_is_the_norm_of_2c_plus_gaussian_vector():
    """l2_radius: the exact shortcut √((2‖c‖ + σZ)² + σ²χ²_{d−1}) against brute-force vectors 2c + N(0, σ²I)."""
    d, sigma, N = 12, 0.3, 40000
    c = np.full((1, N), 0.4)
    fast = P.noised_norms(c, sigma, d, [np.random.default_rng(0)])[0]
    direction = np.random.default_rng(1).normal(size=d)
    vec = 2 * 0.4 * direction / np.linalg.norm(direction)
    slow = np.linalg.norm(vec + sigma * np.random.default_rng(2).normal(size=(N, d)), axis=1)
    assert stats.ks_2samp(fast, slow).pvalue > 1e-3
    wrong = np.linalg.norm(vec + 1.05 * sigma * np.random.default_rng(2).normal(size=(N, d)), axis=1)
    assert stats.ks_2samp(fast, wrong).pvalue < 1e-6  # a 5% error in σ_c would be caught


# --- noiseless fraction against the closed form --------------------------------------------------------------


def _pass_probabilities(X, y, params, epsilon=1.0, delta=1e-5):
    """Closed-form pass probability of every example at θ = 0 (the first round's model): (n,)."""
    n, d = X.shape
    x_norm = np.linalg.norm(X, axis=1)
    inf = P.round_influence("full", None, np.zeros((1, d)), X, y, x_norm, 1e-3, params["zeta"], 1.0)
    E = P.influence_error_bound(0.25, 1.0, MAX_ABS_SIGMOID_2ND, params["zeta"], n)
    sigma_c = P.contribution_sigma(1.0, params["rounds"], delta / 2, n, params["zeta"], epsilon / 4)
    tau = P.coordinate_threshold(params["radius"], 0.75 * epsilon, delta / 2)
    return P.coordinate_pass_probability(P.with_error(inf.vectors(X, y, x_norm), E)[0], sigma_c, tau)


@pytest.mark.parametrize("mode", ["per_step", "per_round"])
def test_noiseless_fraction_matches_the_closed_form_skip_probability(data, mode):
    X, y = data
    n, d = X.shape
    params = {"zeta": 0.05, "rounds": 1, "local_steps": 600, "contribution_noise": mode,
              "radius": _half_pass_radius(n, d, rounds=1), "backend": "numpy"}
    seeds = tuple(range(8))
    out, _, _ = _fit(X, y, seeds=seeds, params=params)
    expected = _pass_probabilities(X, y, params).mean()  # uniform example, one round at θ = 0
    assert 0.3 < expected < 0.7
    fractions = np.array(out.derived["noiseless_fraction"])
    if mode == "per_step":  # 4800 independent Bernoulli steps
        assert abs(fractions.mean() - expected) < 4 * math.sqrt(expected * (1 - expected) / 4800)
    else:  # one test per example and seed: 2400 Bernoulli tests (the steps reuse them)
        eligible = np.array(out.derived["eligible_fraction"])
        assert abs(eligible.mean() - expected) < 4 * math.sqrt(expected * (1 - expected) / 2400)
        assert abs(fractions.mean() - eligible.mean()) < 0.05
    assert out.derived["skip_probability_bound"] >= _pass_probabilities(X, y, params).max()


# --- the two branches, NumPy = numba ------------------------------------------------------------------------------


def test_all_noiseless_is_sgd_and_all_noisy_is_single_example_dp_sgd(data):
    X, y = data
    n, d = X.shape
    kw = {"epochs": 2, "lr": 0.5}
    quiet, s, model = _fit(X, y, params={"zeta": 1e6, "radius": 1e12, "backend": "numpy"}, **kw)
    assert quiet.derived["noiseless_fraction"] == [1.0, 1.0] and quiet.derived["noiseless_fraction_mean"] == 1.0
    assert quiet.guarantee.startswith("none: a step may skip the noise")
    streams = ReplicaStreams([0, 1])
    plain = GradientChain(uniform_examples(X, y, streams), [Clip(1.0), WeightDecay(s.l2), Sgd(constant(s.lr))])
    np.testing.assert_allclose(quiet.theta, plain.run(model, np.zeros((2, d)), s.steps), rtol=1e-12)

    loud, s, model = _fit(X, y, params={"backend": "numpy"}, **kw)  # the paper's rule at δ = 1e-5, r = 10
    assert loud.derived["noiseless_fraction"] == [0.0, 0.0] and loud.derived["eligible_fraction"] == [0.0, 0.0]
    assert loud.guarantee.startswith("tv-bound: (1, 1e-05)-DP")
    streams = ReplicaStreams([0, 1])
    std = calibrate_bassily(0.75, 5e-6, n, s.steps, 1.0, "pld").sigma
    noisy = GradientChain(uniform_examples(X, y, streams), [Clip(1.0), Noise(std, streams.normal("noise", (d,))),
                                                            WeightDecay(s.l2), Sgd(constant(s.lr))])
    np.testing.assert_allclose(loud.theta, noisy.run(model, np.zeros((2, d)), s.steps), rtol=1e-12)


@needs_numba
@pytest.mark.parametrize("extra", [{}, {"contribution_noise": "per_step"}, {"project": True, "rule": "l2_radius"},
                                   {"project": "box"}])
def test_numpy_and_numba_give_the_same_run(data, extra):
    X, y = data
    n, d = X.shape
    sigma_c = P.contribution_sigma(1.0, 2, 5e-6, n, 0.05, 0.25)
    radius = _half_pass_radius(n, d) if extra.get("rule") != "l2_radius" else sigma_c * math.sqrt(d - 0.5)
    params = {"zeta": 0.05, "radius": radius, "rounds": 2, "local_steps": 300, **extra}
    a, _, _ = _fit(X, y, seeds=(0, 5), params={**params, "backend": "numpy"})
    b, _, _ = _fit(X, y, seeds=(0, 5), params={**params, "backend": "numba"})
    assert (a.derived["backend"], b.derived["backend"]) == ("numpy", "numba")
    np.testing.assert_allclose(a.theta, b.theta, rtol=1e-12, atol=1e-14)
    assert a.derived["noiseless_fraction"] == b.derived["noiseless_fraction"]
    assert all(0 < f < 1 for f in a.derived["noiseless_fraction"])


def test_noisy_step_noise_has_the_calibrated_std():
    """One step from θ = 0: θ_noisy − θ_noiseless = −η s z with z ~ N(0, I)."""
    rng = np.random.default_rng(3)
    n, d, lr, seeds = 120, 250, 0.7, tuple(range(48))
    X = rng.normal(size=(n, d))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.where(rng.random(n) < 0.5, 1.0, -1.0)
    common = {"seeds": seeds, "lr": lr, "epsilon": 1.0, "epochs": 1 / n}
    noisy, _, _ = _fit(X, y, params={"backend": "numpy"}, **common)
    quiet, _, _ = _fit(X, y, params={"zeta": 1e6, "radius": 1e12, "backend": "numpy"}, **common)
    assert noisy.derived["noiseless_fraction_mean"] == 0.0 and quiet.derived["noiseless_fraction_mean"] == 1.0
    assert noisy.derived["steps"] == 1
    std = lr * noisy.derived["noise_std"]
    z = ((noisy.theta - quiet.theta) / -std).ravel()  # 12000 draws
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.chi2.cdf(((z / 1.05) ** 2).sum(), z.size) < 1e-6  # std 5% too small would be caught
    assert stats.chi2.sf(((z * 1.05) ** 2).sum(), z.size) < 1e-6  # std 5% too large would be caught


# --- variants, replicas, errors ------------------------------------------------------------------------------------


def test_poisson_variant_is_labelled_and_uses_dp_sgd_noise(data):
    X, y = data
    out, s, _ = _fit(X, y, batch_size=10, params={"sampling": "poisson", "rule": "l2_radius", "project": True,
                                                    "radius": 0.3})
    d = out.derived
    assert list(d["deviations"]) == ["rule_l2_radius", "sampling_poisson", "projection_ball", "theta0",
                                     "hessian_point", "curvature", "gradient_clip", "regulariser_after_clip",
                                     "noise_accountant"]
    cal = calibrate_sigma(0.75, 5e-6, 10 / X.shape[0], s.steps, accountant="pld")  # auto: PLD
    assert d["sigma"] == cal.sigma and d["noise_std"] == pytest.approx(cal.sigma / 10)
    assert (np.linalg.norm(out.theta, axis=1) <= 0.3 * (1 + 1e-12)).all()


@pytest.mark.parametrize("accountant, single, pld", [("auto", True, True), ("pld", True, True), ("rdp", True, False),
                                                     ("auto", False, True), ("rdp", False, False)])
def test_auto_accountant_is_pld_the_baselines_footing(accountant, single, pld):
    """auto calibrates the noisy steps by PLD, as the PLD-calibrated baselines of the comparison grids are; rdp
    stays available (and falls back to PLD for one example per step only where RDP cannot reach ε₁)."""
    n, steps = 400, 800
    cal = (P.calibrate_single_steps(0.75, 5e-6, n, steps, 1.0, accountant) if single
           else P.calibrate_noisy_steps(0.75, 5e-6, 10 / n, steps, accountant))
    by = "pld" if pld else "rdp"
    expected = (calibrate_bassily(0.75, 5e-6, n, steps, 1.0, by).sigma if single
                else calibrate_sigma(0.75, 5e-6, 10 / n, steps, accountant=by).sigma)
    assert cal.accountant == by and cal.std == expected


def test_bad_combinations_are_refused(data):
    X, y = data
    with pytest.raises(P.UserError, match="sampling: single .* needs batch_size 1, got 10"):
        _fit(X, y, batch_size=10)
    with pytest.raises(P.UserError, match="per_step needs sampling: single"):
        _fit(X, y, batch_size=10, params={"sampling": "poisson", "contribution_noise": "per_step"})
    with pytest.raises(P.UserError, match="composition is for sampling: poisson"):
        _fit(X, y, params={"accountant": "composition"})


def test_replicas_are_independent(data):
    X, y = data
    n, d = X.shape
    params = {"zeta": 0.05, "radius": _half_pass_radius(n, d), "rounds": 2, "local_steps": 300, "backend": "numpy"}
    together, _, _ = _fit(X, y, seeds=(1, 3, 5), params=params)
    alone, _, _ = _fit(X, y, seeds=(3,), params=params)
    np.testing.assert_allclose(together.theta[1], alone.theta[0], rtol=1e-12)
    assert together.derived["noiseless_fraction"][1] == alone.derived["noiseless_fraction"][0]
    assert together.derived["eligible_fraction"][1] == alone.derived["eligible_fraction"][0]
    assert not np.allclose(together.theta[0], together.theta[2])


def test_trace_counts_examples_across_rounds(data):
    X, y = data
    setting = _setting(*X.shape, trace_every=100)
    model = make_model("logreg", X.shape[1], setting.l2)
    out = ALGORITHMS["pidp_sgd"]({"rounds": 3, "local_steps": 200}).fit(setting, model, X, y, ReplicaStreams([0, 1]))
    assert [row[0] for row in out.trace] == list(range(100, 601, 100))
    assert all(row[1].shape == (2,) and np.isfinite(row[1]).all() for row in out.trace)


@needs_numba
def test_checkpoints_across_rounds_are_the_same_on_both_backends(data):
    """Each round's chain counts its checkpoints from the examples of the rounds before it (`Checkpoints.offset`),
    in the kernel as on NumPy, also when a round is not a whole number of periods (the kernel stops at each)."""
    X, y = data
    setting = _setting(*X.shape, trace_every=100)
    model = make_model("logreg", X.shape[1], setting.l2)

    def fit(backend, local):
        algo = ALGORITHMS["pidp_sgd"]({"rounds": 3, "local_steps": local, "backend": backend})
        return algo.fit(setting, model, X, y, ReplicaStreams([0, 1]))

    for local in (200, 150):
        a, b = fit("numpy", local), fit("numba", local)
        assert (a.derived["backend"], b.derived["backend"]) == ("numpy", "numba")
        assert [row[0] for row in a.trace] == [row[0] for row in b.trace] == list(range(100, 3 * local + 1, 100))
        for row_a, row_b in zip(a.trace, b.trace):
            np.testing.assert_allclose(row_a[1], row_b[1], rtol=1e-12)
        np.testing.assert_allclose(b.theta, a.theta, rtol=1e-12, atol=1e-14)


# --- end to end ---------------------------------------------------------------------------------------------------


def test_runs_through_the_engine(run_grid):
    runs = run_grid("""
        grids:
          - name: pidp
            datasets: [{name: synthetic, n: 375}]
            algorithms:
              - {name: pidp_sgd, zeta: 0.05, batch_size: [1]}
              - {name: pidp_sgd, zeta: 0.05, batch_size: [1], radius: 1.0e+12}
            epsilon: [1]
            batch_size: [16]
            lr: [0.5]
            epochs: 2
            delta: 1.0e-5
            seeds: 2
    """)
    assert len(runs) == 4 and set(runs["status"]) == {"ok"}, runs[["status", "message"]]
    paper = runs[runs["algorithm_params"].map(lambda p: json.loads(p)["radius"] == 10.0)]
    loose = runs.drop(paper.index)
    assert paper["guarantee"].str.startswith("tv-bound").all() and (paper["noiseless_fraction"] == 0).all()
    assert (paper["delta_certified"] >= paper["delta"]).all()
    assert paper["delta_certified"].to_numpy() == pytest.approx(paper["delta"].to_numpy())
    assert loose["guarantee"].str.startswith("none: a step may skip").all() and loose["delta_certified"].isna().all()
    assert (loose["noiseless_fraction"] == 1).all()
    assert (runs["epsilon_achieved"] <= runs["epsilon"]).all() and (runs["steps"] == 2 * runs["n_train"]).all()
    assert set(runs["n_train"]) == {300}
    for d in runs["derived"].map(json.loads):
        assert 0 <= d["eligible_fraction"] <= 1 and "noiseless_fraction" not in d  # this seed's own, a column
        assert d["sigma_c"] > 0 and d["influence_error_bound"] > 0


# --- the mlp: full influence (dense Hessian from Hessian–vector products) and the output-layer restriction -------


def _tiny_mlp(activation="tanh", n=60, seed=11, l2=1e-2, R=2):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    y = np.where(X @ np.array([1.0, -1.0, 0.5]) + 0.3 * rng.normal(size=n) > 0, 1.0, -1.0)
    model = make_model("mlp", 3, l2, {"hidden": 3, "activation": activation})
    return model, X, y, rng.normal(size=(R, model.n_params))


def _naive_clipped_gradient(model, theta_r, x, y, G):
    g = model.data_gradient(theta_r[None], x[None], np.array([y]))[0]
    return g * min(1.0, G / np.linalg.norm(g))


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_full_influence_of_the_mlp_is_the_dense_solve(activation):
    model, X, y, theta = _tiny_mlp(activation)
    n, n_params = X.shape[0], model.n_params
    assert n_params == 16
    H = model.hessian(theta, X, y)
    h = 1e-5
    for j in range(n_params):  # central differences of the full gradient ∇F (λθ included)
        e = np.zeros(n_params)
        e[j] = h
        column = (model.gradient(theta + e, X, y) - model.gradient(theta - e, X, y)) / (2 * h)
        np.testing.assert_allclose(H[:, :, j], column, atol=1e-8)
    np.testing.assert_array_equal(H, np.swapaxes(H, 1, 2))
    zeta, G = 0.05, 0.3  # G = 0.3 clips most gradients
    Hd, shift, mu = P.damped_by_spectrum(H, zeta)
    assert (mu < 0).all()  # the tiny network's Hessian is indefinite: +ζI alone would not do
    np.testing.assert_allclose(np.linalg.eigvalsh(Hd)[:, 0], zeta, rtol=1e-9)
    x_norm = np.linalg.norm(X, axis=1)
    inf = P.round_influence("full", model, theta, X, y, x_norm, model.l2, zeta, G)
    v = inf.vectors(X, y, x_norm)
    for r in range(2):
        for i in range(0, n, 7):
            g = _naive_clipped_gradient(model, theta[r], X[i], y[i], G)
            np.testing.assert_allclose(v[r, i], np.linalg.solve(Hd[r], g) / n, rtol=1e-8, atol=1e-14)
    assert np.linalg.norm(v, axis=-1).max() <= G / (n * zeta) * (1 + 1e-9)  # ‖H⁻¹‖ ≤ 1/ζ: σ_c's sensitivity


def test_spectral_damping_is_the_logreg_rule_on_psd_matrices():
    Q = np.linalg.qr(np.random.default_rng(0).normal(size=(4, 4)))[0]
    H = np.stack([Q @ np.diag(ev) @ Q.T for ev in ([-0.3, 0.1, 1, 2], [0.02, 0.1, 1, 2], [0.2, 0.3, 1, 2])])
    Hd, shift, mu = P.damped_by_spectrum(H, 0.05)
    np.testing.assert_allclose(mu, [-0.3, 0.02, 0.2], atol=1e-12)
    np.testing.assert_allclose(shift, [0.35, 0.05, 0.0], atol=1e-12)  # ζ + max(0, −μ) where μ < ζ
    np.testing.assert_allclose(np.linalg.eigvalsh(Hd)[:, 0], [0.05, 0.07, 0.2], atol=1e-12)


@pytest.mark.parametrize("activation", ["tanh", "sigmoid", "relu"])
def test_output_layer_is_the_logreg_block_of_the_dense_hessian(activation):
    model, X, y, theta = _tiny_mlp(activation, seed=3)
    n, k = X.shape[0], model.hidden + 1
    w = model.output_layer_params(theta)
    A_rows = model.output_features(theta, X)  # ã = [a, 1]: f = ã·[w₂, b₂]
    np.testing.assert_allclose(np.einsum("rmk,rk->rm", A_rows, w), model.decision(theta, X), atol=1e-14)
    H_out = logistic_hessian(w, X, y, model.l2, features=lambda rows: model.output_features(theta, rows))
    np.testing.assert_allclose(H_out, model.hessian(theta, X, y)[:, -k:, -k:], atol=1e-13)
    # influence vectors: (1/n) H_out⁻¹ clip_G(r ã), the output-layer part of ∇ℓ clipped on its own norm
    G, zeta = 0.5, 0.05
    H_d, _ = P.damped(H_out, model.l2, zeta)
    x_norm = np.linalg.norm(X, axis=1)
    v = P.round_influence("output_layer", model, theta, X, y, x_norm, model.l2, zeta, G).vectors(X, y, x_norm)
    for r in range(2):
        for i in range(0, n, 9):
            g = _naive_clipped_gradient(model, theta[r], X[i], y[i], np.inf)[-k:]
            g *= min(1.0, G / np.linalg.norm(g))
            np.testing.assert_allclose(v[r, i], np.linalg.solve(H_d[r], g) / n, rtol=1e-8, atol=1e-14)
    # A bounds ‖ã‖ over the unit ball (tanh, sigmoid: √(h+1) for every θ; relu: from θ's hidden layer)
    U = np.random.default_rng(1).normal(size=(2000, 3))
    U /= np.linalg.norm(U, axis=1, keepdims=True) / np.random.default_rng(2).random((2000, 1)) ** (1 / 3)
    A = model.output_feature_bound(3 * theta)
    assert (np.linalg.norm(model.output_features(3 * theta, U), axis=-1) <= A[:, None]).all()
    if activation != "relu":
        np.testing.assert_array_equal(A, [2.0, 2.0])  # √(3 + 1)


def test_output_layer_constants_by_hand():
    model, _, _, theta = _tiny_mlp("tanh")
    c = P.error_constants("output_layer", model, theta, 1.0, 0.05, 100)
    # A = √(h+1) = 2: L = A²/4 = 1, C = A³/(6√3) = 8·0.0962250449 = 0.7698003589, G = 1 (the clip):
    # E = (2·1·1 + 0.7698003589/0.05)/(0.05²·100²) = (2 + 15.396007178)/25 = 0.6958402871
    np.testing.assert_allclose(c.L, 1.0)
    np.testing.assert_allclose(c.C, 0.7698003589, rtol=1e-9)
    np.testing.assert_allclose(c.E, 0.6958402871, rtol=1e-9)
    # with G = A = 2 (the unclipped loss): (2·1·2 + 0.7698003589·4/0.05)/25 = (4 + 61.584028712)/25
    np.testing.assert_allclose(c.E_unclipped, 2.6233611485, rtol=1e-9)
    assert P.error_constants("full", model, theta, 1.0, 0.05, 100).E == 0.0  # no bound for the whole network


def test_influence_resolution_and_the_parameter_cap():
    small = make_model("mlp", 5, 1e-3, {"hidden": 4})
    big = make_model("mlp", 60, 1e-3)  # P = 60·60 + 121 = 3721 > 3000
    assert big.n_params > P.FULL_INFLUENCE_MAX_PARAMS >= small.n_params
    assert [P.resolve_influence(i, small) for i in ("auto", "full", "output_layer")] == ["full", "full", "output_layer"]
    assert P.resolve_influence("auto", big) == "output_layer"
    assert {P.resolve_influence(i, make_model("logreg", 5, 1e-3)) for i in ("auto", "full", "output_layer")} == {"full"}
    X = np.zeros((100, 60))
    y = np.ones(100)
    algo = ALGORITHMS["pidp_sgd"]({"influence": "full"})
    with pytest.raises(P.UserError, match=r"P = 3721 parameters > 3000.*use influence: output_layer"):
        algo.fit(_setting(100, 60), big, X, y, ReplicaStreams([0]))


def test_mlp_replicas_are_independent_and_output_layer_is_a_labelled_deviation():
    model, X, y, _ = _tiny_mlp("tanh", n=300)
    setting = _setting(300, 3)
    for influence, dim in (("full", model.n_params), ("output_layer", model.hidden + 1)):
        algo = ALGORITHMS["pidp_sgd"]({"zeta": 0.05, "radius": _half_pass_radius(300, dim), "rounds": 2,
                                       "local_steps": 300, "influence": influence})
        together = algo.fit(setting, model, X, y, ReplicaStreams([1, 3, 5]))
        alone = algo.fit(setting, model, X, y, ReplicaStreams([3]))
        np.testing.assert_allclose(together.theta[1], alone.theta[0], rtol=1e-12)
        for key in ("noiseless_fraction", "eligible_fraction", "hessian_shift", "hessian_min_eigenvalue"):
            if key in together.derived:
                assert together.derived[key][1] == alone.derived[key][0], key
        assert 0 < together.derived["noiseless_fraction_mean"] < 1 and together.derived["influence"] == influence
        mlp_readings = [k.replace("gradient_clip", "gradient_clip_mlp") for k in ALGORITHM_1_READINGS]
        assert list(together.derived["deviations"]) == mlp_readings + (["influence_output_layer"] if influence ==
                                                                       "output_layer" else ["error_zero"])
        assert together.guarantee.startswith("none: a step may skip the noise")  # T·p ≥ 1 here


# --- the mlp with one example per step: the numba kernel (sgd1_mlp) ----------------------------------------------


@needs_numba
@pytest.mark.parametrize("activation, influence, extra", [
    ("tanh", "output_layer", {}), ("relu", "full", {"contribution_noise": "per_step"}),
    ("sigmoid", "output_layer", {"project": True}),
])
def test_mlp_numpy_and_numba_give_the_same_run(activation, influence, extra):
    """Algorithm 1 on the mlp (b = 1): the kernel equals the NumPy chain (same seed → same θ, same decisions),
    with noisy and noiseless steps mixed, clipping acting (rows up to norm 1, G = 1) and the projection."""
    model, X, y, _ = _tiny_mlp(activation, n=200)
    X = X * 3.0  # larger rows: the clip to G = 1 acts on some steps
    dim = model.n_params if influence == "full" else model.hidden + 1
    params = {"zeta": 0.05, "radius": 2.0 if extra.get("project") else _half_pass_radius(200, dim), "rounds": 2,
              "local_steps": 150, "influence": influence, **extra}
    setting = _setting(200, 3, lr=0.3)
    runs = [ALGORITHMS["pidp_sgd"]({**params, "backend": b}).fit(setting, model, X, y, ReplicaStreams([0, 4]))
            for b in ("numpy", "numba")]
    a, b = runs
    assert (a.derived.pop("backend"), b.derived.pop("backend")) == ("numpy", "numba")
    np.testing.assert_allclose(b.theta, a.theta, rtol=1e-12, atol=1e-13)
    assert a.derived.keys() == b.derived.keys() and a.guarantee == b.guarantee
    for key, value in a.derived.items():  # the same decisions; θ (and so a later round's Hessian) up to rounding
        if isinstance(value, (float, list)) and not isinstance(value, bool):
            np.testing.assert_allclose(b.derived[key], value, rtol=1e-10, err_msg=key)  # NaN == NaN
        else:
            assert b.derived[key] == value, key
    assert not np.allclose(a.theta[0], a.theta[1])
    if not extra.get("project"):
        assert all(0 < f < 1 for f in a.derived["noiseless_fraction"])  # both branches ran


@needs_numba
@pytest.mark.parametrize("activation", ["tanh", "sigmoid", "relu"])
def test_mlp_kernel_step_is_minus_the_gradient_by_finite_differences(activation):
    """One kernel step with η = 1, no clip, noise or λ moves θ by −∇ℓ(θ; x_i, y_i): central differences of the
    model's loss on that example."""
    model, X, y, theta = _tiny_mlp(activation, R=1)
    for i in (0, 7, 31):
        chain = GradientChain(fixed_batches(X, y, np.array([[[i]]])), [Sgd(constant(1.0))], backend="numba")
        step = chain.run(model, theta, 1)
        assert chain.ran_on == "numba"
        h = 1e-6
        fd = np.array([(model.data_loss(theta + h * e, X[i:i + 1], y[i:i + 1])
                        - model.data_loss(theta - h * e, X[i:i + 1], y[i:i + 1]))[0] / (2 * h)
                       for e in np.eye(model.n_params)])
        np.testing.assert_allclose(theta[0] - step[0], fd, rtol=1e-6, atol=1e-9)


ALGORITHM_1_READINGS = ["no_projection", "theta0", "hessian_point", "curvature", "error_per_coordinate",
                        "contribution_noise_per_round", "gradient_clip", "regulariser_after_clip", "noise_accountant"]


def test_box_projection_keeps_theta_in_the_proofs_parameter_space(data):
    X, y = data
    out, _, _ = _fit(X, y, params={"project": "box", "radius": 0.05})
    assert np.abs(out.theta).max() <= 0.05 and np.isclose(np.abs(out.theta).max(), 0.05)
    assert "projection_box" in out.derived["deviations"] and "no_projection" not in out.derived["deviations"]
    free, _, _ = _fit(X, y, params={"radius": 0.05})  # as Algorithm 1 is written: θ leaves the proof's space
    assert np.abs(free.theta).max() > 0.05 and "no_projection" in free.derived["deviations"]


def test_no_bound_names_its_trigger_the_certified_delta():
    from dpsgd_cli.algorithms.pidp_sgd import tv_guarantee

    guarantee, delta = tv_guarantee(1.0, 1e-6, 0.75, 1000, 1e-3)  # T·p = 1 < δ′ ≈ 3.1: the trigger is δ′ ≥ 1
    assert math.isnan(delta) and "δ′ = δ₁ + (1 + e^ε₁)·T·p ≥ 1" in guarantee
    guarantee, delta = tv_guarantee(1.0, 1e-6, 0.75, 1000, 1e-4)  # T·p = 0.1: δ′ = 0.31 < 1, a bound
    assert guarantee.startswith("tv-bound") and delta < 1


# --- the departures from Algorithm 1 (`DEVIATIONS`): each key's text is what the code does ------------------------


@pytest.mark.parametrize("model_name", ["logreg", "mlp"])
def test_updates_clip_the_gradient_to_G_and_add_the_regulariser_after_the_clip(model_name):
    """Lines 11 and 14 as run (`gradient_clip`, `gradient_clip_mlp`, `regulariser_after_clip`): on rows of norm 5
    the noiseless run is SGD on clip_1(∇ℓ) + λθ from the model's initialisation (`theta0`), not SGD on ∇ℓ."""
    model, X, y, _ = _tiny_mlp(n=200)
    X = 5.0 * X
    if model_name == "logreg":
        model = make_model("logreg", X.shape[1], 1e-2)
    setting = _setting(*X.shape, l2=1e-2, epochs=1, lr=0.2)
    out = ALGORITHMS["pidp_sgd"]({"zeta": 1e6, "radius": 1e12, "backend": "numpy"}).fit(
        setting, model, X, y, ReplicaStreams([0, 1]))
    assert out.derived["noiseless_fraction"] == [1.0, 1.0]
    assert {"theta0", "regulariser_after_clip", f"gradient_clip{'_mlp' if model_name == 'mlp' else ''}"} <= set(
        out.derived["deviations"])

    def sgd(clip):
        streams = ReplicaStreams([0, 1])
        chain = GradientChain(uniform_examples(X, y, streams),
                              [Clip(clip), WeightDecay(setting.l2), Sgd(constant(setting.lr))])
        return chain.run(model, model.init(streams.generators("init")), setting.steps)

    np.testing.assert_allclose(out.theta, sgd(1.0), rtol=1e-10, atol=1e-12)
    assert not np.allclose(out.theta, sgd(1e12))  # the clip binds on these rows


def test_hessian_is_taken_at_each_rounds_global_model(data, monkeypatch):
    """`hessian_point`: round k's influence (line 4) is computed at the model the previous round ended with."""
    X, y = data
    seen, ends = [], []
    influence, run = P.round_influence, GradientChain.run

    def spy_influence(kind, model, theta, *args):
        seen.append(theta.copy())
        return influence(kind, model, theta, *args)

    def spy_run(self, model, theta, steps):
        ends.append(run(self, model, theta, steps))
        return ends[-1]

    monkeypatch.setattr(P, "round_influence", spy_influence)
    monkeypatch.setattr(GradientChain, "run", spy_run)
    _fit(X, y, params={"rounds": 3, "local_steps": 50, "backend": "numpy"})
    assert len(seen) == 3 and not seen[0].any()  # round 0 at the initialisation (0 for logreg)
    for k in (1, 2):
        np.testing.assert_array_equal(seen[k], ends[k - 1])


@pytest.mark.parametrize("mode", ["per_round", "per_step"])
def test_contribution_noise_is_drawn_once_per_example_and_round_or_at_every_step(data, monkeypatch, mode):
    """`contribution_noise_per_round`: one b^(c) per example and round (n tests a round, whatever the draws); per_step
    (line 8 as written): one per step. Counted as the rows the test sees."""
    X, y = data
    tested = []
    passes = P.DecisionRule.passes

    def spy(self, v, E, generators):
        tested.append(v.shape[0] * v.shape[1])
        return passes(self, v, E, generators)

    monkeypatch.setattr(P.DecisionRule, "passes", spy)
    out, _, _ = _fit(X, y, seeds=(0,), params={"rounds": 2, "local_steps": 70, "contribution_noise": mode})
    assert sum(tested) == (2 * X.shape[0] if mode == "per_round" else 2 * 70)
    assert ("contribution_noise_per_round" in out.derived["deviations"]) == (mode == "per_round")


def test_an_rdp_calibration_that_falls_back_to_pld_is_a_labelled_deviation(data, monkeypatch):
    X, y = data
    real = P.calibrate_bassily

    def no_rdp(*args):
        if args[-1] == "rdp":
            raise P.UserError("no σ reaches ε₁ under RDP")
        return real(*args)

    monkeypatch.setattr(P, "calibrate_bassily", no_rdp)
    out, _, _ = _fit(X, y, params={"accountant": "rdp"})
    assert out.derived["accountant"] == "pld" and "accountant_fallback" in out.derived["deviations"]
    out, _, _ = _fit(X, y)
    assert "accountant_fallback" not in out.derived["deviations"]


DEVIATION_TESTS = {
    "rule_l2_radius": test_poisson_variant_is_labelled_and_uses_dp_sgd_noise,
    "sampling_poisson": test_poisson_variant_is_labelled_and_uses_dp_sgd_noise,
    "projection_ball": test_poisson_variant_is_labelled_and_uses_dp_sgd_noise,
    "projection_box": test_box_projection_keeps_theta_in_the_proofs_parameter_space,
    "no_projection": test_box_projection_keeps_theta_in_the_proofs_parameter_space,
    "theta0": test_updates_clip_the_gradient_to_G_and_add_the_regulariser_after_the_clip,
    "hessian_point": test_hessian_is_taken_at_each_rounds_global_model,
    "curvature": test_spectral_damping_is_the_logreg_rule_on_psd_matrices,
    "error_per_coordinate": test_error_is_added_per_coordinate_away_from_zero,
    "contribution_noise_per_round": test_contribution_noise_is_drawn_once_per_example_and_round_or_at_every_step,
    "gradient_clip": test_updates_clip_the_gradient_to_G_and_add_the_regulariser_after_the_clip,
    "gradient_clip_mlp": test_updates_clip_the_gradient_to_G_and_add_the_regulariser_after_the_clip,
    "regulariser_after_clip": test_updates_clip_the_gradient_to_G_and_add_the_regulariser_after_the_clip,
    "noise_accountant": test_auto_accountant_is_pld_the_baselines_footing,
    "accountant_fallback": test_an_rdp_calibration_that_falls_back_to_pld_is_a_labelled_deviation,
    "influence_output_layer": test_mlp_replicas_are_independent_and_output_layer_is_a_labelled_deviation,
    "error_zero": test_output_layer_constants_by_hand,
}


def test_every_deviation_has_a_test_of_what_it_says():
    assert set(DEVIATION_TESTS) == set(P.DEVIATIONS)


# --- the privacy argument priced as run: ε₂ and the sensitivity of line 9 ----------------------------------------


@pytest.mark.parametrize("z, releases, delta", [(0.8, 1, 1e-5), (3.0, 5, 1e-9), (20.0, 10, 1e-10)])
def test_composed_gaussian_epsilon_is_the_accountants(z, releases, delta):
    """k Gaussian releases at multiplier z = one at z/√k: against dp-accounting's PLD of the k-fold composition."""
    import dp_accounting as dp

    from dpsgd_cli.privacy.mechanisms import analytic_gaussian_epsilon, analytic_gaussian_sigma

    eps = analytic_gaussian_epsilon(2.0, 2.0 * z, delta, releases)  # sensitivity 2, σ = 2z
    pld = dp.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp.GaussianDpEvent(z), releases)
    assert pld.get_epsilon(delta) == pytest.approx(eps, rel=2e-3)
    if releases == 1:
        assert analytic_gaussian_sigma(2.0, eps, delta) == pytest.approx(2.0 * z, rel=1e-6)


def test_line_9_doubles_the_sensitivity_sigma_c_is_sized_for():
    """σ_c = c'GR√(log(1.25R/δ₂))/(nζε₂), c' = 2.83 ≈ 2√2: Lemma 3 at S = 2G/(nζ) and (ε₂/R, δ₂/R) per release. The
    release 2c^(o) + b^(c) has sensitivity 4G/(nζ): by exact composition its ε is that of S = 2G/(nζ) at σ_c/2."""
    from dpsgd_cli.privacy.mechanisms import analytic_gaussian_epsilon

    n, zeta, R, eps_2, delta_2 = 30_000, 0.01, 5, 0.25, 1 / (2 * 30_000**2)
    sigma_c = P.contribution_sigma(1.0, R, delta_2, n, zeta, eps_2)
    lemma_3 = math.sqrt(2 * math.log(1.25 * R / delta_2)) * (2 / (n * zeta)) / (eps_2 / R)
    assert sigma_c == pytest.approx(lemma_3, rel=1e-3)  # 2.83 against 2√2 = 2.8284
    stated, line9 = P.contribution_release_epsilons(sigma_c, R, n, zeta, 1.0, delta_2)
    assert stated == analytic_gaussian_epsilon(2 / (n * zeta), sigma_c, delta_2, R)
    assert line9 == pytest.approx(analytic_gaussian_epsilon(2 / (n * zeta), sigma_c / 2, delta_2, R), rel=1e-9)
    assert 2.0 < line9 / stated < 2.2 and stated < eps_2  # about twice; the loose c' leaves room at R = 5
    note = P.sensitivity_note(sigma_c, R, eps_2, delta_2, stated, line9, "per_round")
    assert "(2ε₂, δ₂) = (0.5, " in note and f"({line9:.3g}, δ₂)-DP" in note


def test_privacy_note_prices_epsilon_2_from_what_the_run_recorded(data):
    X, y = data
    loud, s, _ = _fit(X, y, params={"rounds": 2, "local_steps": 150})  # the paper's rule: no step skips
    quiet, _, _ = _fit(X, y, params={"zeta": 1e6, "radius": 1e12, "rounds": 2, "local_steps": 150})
    assert loud.derived["noiseless_fraction"] == [0.0, 0.0] and quiet.derived["noiseless_fraction"] == [1.0, 1.0]
    assert "ε₂ = 0.25 is charged for the influence test (lines 7-10), which skipped the noise on no step" in \
        loud.derived["privacy_note"]
    assert "skipped the noise on 100% of the steps" in quiet.derived["privacy_note"]
    assert "skipped the noise on no step" not in quiet.derived["privacy_note"]
    stated, line9 = P.contribution_release_epsilons(loud.derived["sigma_c"], 2, X.shape[0], 0.01, 1.0, 5e-6)
    assert (loud.derived["epsilon_2_stated_sensitivity"], loud.derived["epsilon_2_line9"]) == (stated, line9)
    assert "line 9 releases 2c_t^(o) + b^(c), sensitivity 4G/(nζ)" in loud.derived["privacy_note"]
    assert P.epsilon_2_note([0.0, 0.25], 0.1, 0.75, 0.25).startswith("the influence test")
    assert "p = 0 per step in floating point" in P.epsilon_2_note([0.0], 0.0, 0.75, 0.25)
