"""PIDP-SGD (Kang et al.): its constants by hand, the Hessian and influence vectors, the private test, both
branches, the noise of a noisy step, replica independence, and a run through the engine."""

import json
import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import expit

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms import pidp_sgd as P
from dpsgd_cli.algorithms.chain import GradientChain, add_l2, add_noise, constant, project_to_ball, scale
from dpsgd_cli.algorithms.sampling import poisson_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.accounting import calibrate_sigma
from dpsgd_cli.privacy.mechanisms import advanced_composition, amplify_by_subsampling


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
    base = {"n": n, "d": d, "delta": 1e-5, "l2": 1e-3, "epsilon": 1.0, "batch_size": 10, "lr": 0.5, "epochs": 2}
    return Setting(**{**base, **kw})


def _fit(X, y, seeds=(0, 1), params=None, **kw):
    setting = _setting(*X.shape, **kw)
    model = make_model("logreg", X.shape[1], setting.l2)
    return ALGORITHMS["pidp_sgd"](params or {}).fit(setting, model, X, y, ReplicaStreams(seeds)), setting, model


# --- constants by hand ----------------------------------------------------------------------------


def test_sigma_c_and_error_bound_by_hand():
    # σ_c = 2.83·G·R·√(ln(1.25R/δ₂))/(nζε₂), G=1, R=2, δ₂=1e-4, n=100, ζ=0.5, ε₂=0.25:
    # ln(25000) = 10.126631, √ = 3.1822368, 2.83·2·3.1822368 = 18.011460, / (100·0.5·0.25 = 12.5) = 1.4409168
    assert P.contribution_sigma(1.0, 2, 1e-4, 100, 0.5, 0.25) == pytest.approx(1.4409168, rel=1e-7)
    # E = (2LG + CG²/ζ)/(ζ²n²), L=1/4, G=1, C=1/(6√3)=0.09622504, ζ=0.5, n=100:
    # (0.5 + 0.19245009)/(0.25·10⁴) = 2.7698004e-4
    assert P.influence_error_bound(0.25, 1.0, 1 / (6 * math.sqrt(3)), 0.5, 100) == pytest.approx(2.7698004e-4, rel=1e-7)
    # C is max |σ''| of the sigmoid (σ'' = σ'(1 − 2σ))
    m = np.linspace(-10, 10, 2_000_001)
    assert np.abs(expit(m) * expit(-m) * (1 - 2 * expit(m))).max() == pytest.approx(P.MAX_ABS_SIGMOID_2ND, rel=1e-9)


def test_fit_derives_the_paper_constants(data):
    X, y = data
    out, _, _ = _fit(X, y, epsilon=2.0, params={"zeta": 0.05, "rounds": 3, "local_steps": 7})
    d = out.derived
    n, R = X.shape[0], 3
    assert (d["rounds"], d["local_steps"], d["steps"]) == (3, 7, 21)
    assert (d["epsilon_1"], d["epsilon_2"], d["delta_1"], d["delta_2"]) == (1.5, 0.5, 5e-6, 5e-6)
    assert (d["lipschitz_G"], d["smoothness_L"]) == (1.0, 0.25)
    by_hand = 2.83 * 1.0 * R * math.sqrt(math.log(1.25 * R / 5e-6)) / (n * 0.05 * 0.5)
    assert d["sigma_c"] == pytest.approx(by_hand, rel=1e-12)
    E = (2 * 0.25 * 1.0 + (1 / (6 * math.sqrt(3))) / 0.05) / (0.05**2 * n**2)
    assert d["influence_error_bound"] == pytest.approx(E, rel=1e-12)
    cal = calibrate_sigma(1.5, 5e-6, 10 / n, 21, accountant="rdp")
    assert d["sigma"] == cal.sigma and d["epsilon_achieved"] == pytest.approx(cal.epsilon + 0.5)
    assert d["epsilon_achieved"] <= 2.0 and d["noise_std"] == pytest.approx(cal.sigma / 10)
    assert d["hessian_damped"] is True and out.guarantee == P.PAPER_CLAIM


def test_default_schedule_is_one_round_per_epoch(data):
    X, y = data
    out, s, _ = _fit(X, y, epochs=3, batch_size=20)
    assert (out.derived["rounds"], out.derived["local_steps"]) == (3, 15) and out.derived["steps"] == s.steps


def test_composition_accountant_is_a_valid_bound(data):
    X, y = data
    T, q = 60, 10 / X.shape[0]
    cal = P.calibrate_noisy_steps(0.75, 5e-6, q, T, "composition")
    # forward: per-step Gaussian (ε₀, δ₀) at σ, amplified by Poisson sampling, composed T times (advanced with
    # δ' = δ₁/2, or basic): the better of the two gives back ε₁ = 0.75
    totals = []
    for delta_0, compose in ((5e-6 / (2 * T * q), lambda e, dl: advanced_composition(e, dl, T, 5e-6 / 2)),
                             (5e-6 / (T * q), lambda e, dl: (T * e, T * dl))):
        e_s, d_s = amplify_by_subsampling(math.sqrt(2 * math.log(1.25 / delta_0)) / cal.sigma, q, delta_0)
        total_eps, total_delta = compose(e_s, d_s)
        assert total_delta <= 5e-6 * (1 + 1e-9)
        totals.append(total_eps)
    assert min(totals) == pytest.approx(0.75, rel=1e-9)
    assert cal.valid and cal.sigma > calibrate_sigma(0.75, 5e-6, q, T).sigma  # RDP is tighter
    out, _, _ = _fit(X, y, params={"accountant": "composition"})
    assert out.derived["accountant"] == "composition" and out.guarantee == P.PAPER_CLAIM


# --- Hessian and influence vectors -----------------------------------------------------------------


def test_hessian_matches_finite_differences_of_the_gradient(data):
    X, y = data
    l2, d = 1e-2, X.shape[1]
    model = make_model("logreg", d, l2)
    theta = np.random.default_rng(0).normal(size=(2, d))
    H = P.logreg_hessian(theta, X, y, l2)
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
    H, _ = P.damped(P.logreg_hessian(theta, X, y, 1e-3), 1e-3, 0.05)
    H_inv = np.linalg.solve(H, np.broadcast_to(np.eye(d), H.shape))
    model = make_model("logreg", d, 0.0)
    for G in (1.0, 0.2):  # 0.2 clips most gradients
        v = P.influence_vectors(theta, X[:20], y[:20], H_inv, n, G)
        for r in range(3):
            for i in range(20):
                g = model.data_gradient(theta[r:r + 1], X[i:i + 1], y[i:i + 1])[0]
                g = g * min(1.0, G / np.linalg.norm(g))
                np.testing.assert_allclose(v[r, i], np.linalg.solve(H[r], g) / n, rtol=1e-9, atol=1e-15)
        norms = P.influence_norms(theta, X, y, np.linalg.norm(X, axis=1), H_inv, G)
        np.testing.assert_allclose(norms[:, :20], np.linalg.norm(v, axis=-1), rtol=1e-10)
        assert norms.max() <= G / (n * 0.05) + 1e-15  # ‖H⁻¹‖ ≤ 1/ζ: the bound σ_c uses


def test_noised_norm_is_the_norm_of_2c_plus_gaussian_vector():
    """The exact shortcut √((2‖c‖ + σZ)² + σ²χ²_{d−1}) against brute-force vectors 2c + N(0, σ²I)."""
    d, sigma, N = 12, 0.3, 40000
    c = np.full((1, N), 0.4)
    fast = P.noised_norms(c, sigma, d, [np.random.default_rng(0)])[0]
    direction = np.random.default_rng(1).normal(size=d)
    vec = 2 * 0.4 * direction / np.linalg.norm(direction)
    slow = np.linalg.norm(vec + sigma * np.random.default_rng(2).normal(size=(N, d)), axis=1)
    assert stats.ks_2samp(fast, slow).pvalue > 1e-3
    wrong = np.linalg.norm(vec + 1.05 * sigma * np.random.default_rng(2).normal(size=(N, d)), axis=1)
    assert stats.ks_2samp(fast, wrong).pvalue < 1e-6  # a 5% error in σ_c would be caught
    assert P.noised_norms(np.zeros((1, 5)), 2.0, 1, [np.random.default_rng(0)]).shape == (1, 5)  # d = 1


def test_contribution_test_adds_E_to_the_norm_and_compares_with_r(data):
    X, y = data
    n, d = X.shape
    theta = np.random.default_rng(2).normal(size=(2, d))
    x_norm = np.linalg.norm(X, axis=1)
    H, _ = P.damped(P.logreg_hessian(theta, X, y, 1e-3), 1e-3, 0.05)
    v = P.influence_norms(theta, X, y, x_norm, np.linalg.inv(H), 1.0)  # (2, n)
    E = 0.5 * v.max()
    gens = [np.random.default_rng(0), np.random.default_rng(1)]
    # σ_c = 0: ‖c̃_z‖ = 2(‖v_z‖ + E) exactly; with r = 2‖v‖max + 1.5E every example passes without E, not with it
    radius = 2 * v.max() + 1.5 * E
    eligible, was_damped = P.contribution_test(theta, X, y, x_norm, 1e-3, 0.05, 1.0, E, 0.0, radius, gens)
    np.testing.assert_array_equal(eligible, 2 * (v + E) <= radius)
    assert was_damped and (2 * v <= radius).all() and 0 < eligible.sum() < 2 * n and not eligible.flat[np.argmax(v)]
    # a diverged replica does not break the others
    bad = theta.copy()
    bad[0] = np.nan
    eligible, _ = P.contribution_test(bad, X, y, x_norm, 1e-3, 0.05, 1.0, E, 0.0, radius, gens)
    np.testing.assert_array_equal(eligible[1], 2 * (v[1] + E) <= radius)


def test_indexed_batches_are_the_dp_sgd_batches(data):
    X, y = data
    plain = poisson_batches(X, y, 0.05, ReplicaStreams([0, 4]))
    indexed = P.indexed_poisson_batches(X, y, 0.05, ReplicaStreams([0, 4]))
    for _ in range(30):
        a, (idx, b) = next(plain), next(indexed)
        for field in ("X", "y", "weight", "x_norm"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_array_equal(X[np.maximum(idx, 0)] * (idx >= 0)[..., None], a.X * a.weight[..., None])


# --- the two branches -------------------------------------------------------------------------------


def test_all_noiseless_is_sgd_and_all_noisy_is_the_dp_sgd_chain(data):
    X, y = data
    d = X.shape[1]
    kw = {"epochs": 2, "batch_size": 10, "lr": 0.5}
    quiet, s, model = _fit(X, y, params={"zeta": 1e6, "radius": 1e6}, **kw)  # σ_c ≈ 0: every example passes
    assert quiet.derived["noiseless_fraction"] == [1.0, 1.0] and quiet.derived["noiseless_fraction_mean"] == 1.0
    reference = ALGORITHMS["sgd"]().fit(s, model, X, y, ReplicaStreams([0, 1])).theta
    np.testing.assert_allclose(quiet.theta, reference, rtol=1e-12)  # noise off: exactly the non-private SGD

    loud, s, model = _fit(X, y, params={"zeta": 1e-9, "radius": 1e6}, **kw)  # σ_c huge: no example passes
    assert loud.derived["noiseless_fraction"] == [0.0, 0.0] and loud.derived["eligible_fraction"] == [0.0, 0.0]
    streams = ReplicaStreams([0, 1])
    chain = GradientChain(poisson_batches(X, y, s.sample_rate, streams), clip=1.0,
                          transforms=[add_noise(loud.derived["sigma"], streams.normal("noise", (d,))),
                                      scale(1 / s.batch_size), add_l2(s.l2)],
                          schedule=constant(s.lr), project=project_to_ball(1e6))
    np.testing.assert_allclose(loud.theta, chain.run(model, np.zeros((2, d)), s.steps), rtol=1e-12)


def test_mixed_case_fraction_in_unit_interval(data):
    X, y = data
    n, d = X.shape
    R, T_local = 2, 40
    sigma_c = P.contribution_sigma(1.0, R, 0.5e-5, n, 0.05, 0.25)
    radius = sigma_c * math.sqrt(d - 0.5)  # ≈ the median of ‖c̃‖: about half the examples pass
    out, _, _ = _fit(X, y, seeds=(0, 1, 2), batch_size=2,
                     params={"zeta": 0.05, "radius": radius, "rounds": R, "local_steps": T_local})
    fractions = np.array(out.derived["noiseless_fraction"])
    assert ((fractions > 0) & (fractions < 1)).all()
    assert np.allclose(fractions * R * T_local, np.round(fractions * R * T_local))  # whole steps
    assert out.derived["noiseless_fraction_mean"] == pytest.approx(fractions.mean())
    assert all(0.2 < e < 0.8 for e in out.derived["eligible_fraction"])


def test_noisy_step_noise_has_std_sigma_G_over_B():
    """One step from θ = 0: θ_noisy − θ_noiseless = −η σ G z / B with z ~ N(0, I)."""
    rng = np.random.default_rng(3)
    n, d, B, lr, seeds = 120, 250, 8, 0.7, tuple(range(48))
    X = rng.normal(size=(n, d))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.where(rng.random(n) < 0.5, 1.0, -1.0)
    common = {"seeds": seeds, "batch_size": B, "lr": lr, "epsilon": 2.0, "epochs": B / n}
    noisy, _, _ = _fit(X, y, params={"zeta": 1e-9, "radius": 1e6}, **common)
    quiet, _, _ = _fit(X, y, params={"zeta": 1e6, "radius": 1e6}, **common)
    assert noisy.derived["noiseless_fraction_mean"] == 0.0 and quiet.derived["noiseless_fraction_mean"] == 1.0
    assert noisy.derived["steps"] == 1 and noisy.derived["sigma"] == quiet.derived["sigma"]
    std = lr * noisy.derived["sigma"] * 1.0 / B
    z = ((noisy.theta - quiet.theta) / -std).ravel()  # 12000 draws
    assert stats.kstest(z, "norm").pvalue > 1e-3
    chi2 = (z**2).sum()
    assert 2 * min(stats.chi2.cdf(chi2, z.size), stats.chi2.sf(chi2, z.size)) > 1e-3
    assert stats.chi2.cdf(((z / 1.05) ** 2).sum(), z.size) < 1e-6  # std 5% too small would be caught
    assert stats.chi2.sf(((z * 1.05) ** 2).sum(), z.size) < 1e-6  # std 5% too large would be caught


# --- projection, replicas, guarantee ----------------------------------------------------------------


def test_projection_keeps_iterates_in_the_ball(data):
    X, y = data
    out, _, _ = _fit(X, y, lr=5.0, params={"radius": 0.3, "rounds": 4, "local_steps": 5})
    assert (np.linalg.norm(out.theta, axis=1) <= 0.3 * (1 + 1e-12)).all()


def test_replicas_are_independent(data):
    X, y = data
    n, d = X.shape
    radius = P.contribution_sigma(1.0, 2, 0.5e-5, n, 0.05, 0.25) * math.sqrt(d - 0.5)
    params = {"zeta": 0.05, "radius": radius, "rounds": 2, "local_steps": 30}
    together, _, _ = _fit(X, y, seeds=(1, 3, 5), batch_size=2, params=params)
    alone, _, _ = _fit(X, y, seeds=(3,), batch_size=2, params=params)
    np.testing.assert_allclose(together.theta[1], alone.theta[0], rtol=1e-12)
    assert together.derived["noiseless_fraction"][1] == alone.derived["noiseless_fraction"][0]
    assert together.derived["eligible_fraction"][1] == alone.derived["eligible_fraction"][0]
    assert not np.allclose(together.theta[0], together.theta[2])


def test_guarantee_names_the_failed_assumption(data):
    X, y = data
    assert _fit(X * 1.5, y)[0].guarantee.startswith("none: rows outside the unit ball (max ‖x‖ = 1.5")
    big = _fit(X, y, epsilon=8.0, params={"rounds": 1, "local_steps": 3})[0]  # ε₂/R = 2
    assert big.guarantee.startswith("none: per-round test budget ε₂/R = 2")
    loose = _fit(X, y, epsilon=3.0, epochs=0.1, params={"accountant": "composition"})[0]
    assert loose.guarantee.startswith("none: per-step ε₀")


def test_trace_counts_examples_across_rounds(data):
    X, y = data
    setting = _setting(*X.shape, trace_every=50, batch_size=10, epochs=2)
    model = make_model("logreg", X.shape[1], setting.l2)
    out = ALGORITHMS["pidp_sgd"]({"rounds": 3, "local_steps": 10}).fit(setting, model, X, y, ReplicaStreams([0, 1]))
    examples = [row[0] for row in out.trace]
    assert examples == list(range(50, 301, 50))  # 3 rounds × 10 steps × 10 examples, counted across rounds
    assert all(row[1].shape == (2,) and np.isfinite(row[1]).all() for row in out.trace)
    assert len(out.derived["empty_step_fraction"]) == 2


# --- end to end ---------------------------------------------------------------------------------------


def test_runs_through_the_engine(run_grid):
    runs = run_grid("""
        grids:
          - name: pidp
            datasets: [{name: synthetic, n: 600}]
            algorithms: [{name: pidp_sgd, zeta: 0.05, radius: 20}]
            epsilon: [1, 3]
            batch_size: [16]
            lr: [0.5]
            epochs: 2
            seeds: 2
    """)
    assert len(runs) == 4 and set(runs["status"]) == {"ok"} and set(runs["guarantee"]) == {P.PAPER_CLAIM}
    assert (runs["sigma"] > 0).all() and set(runs["accountant"]) == {"rdp"}
    assert (runs["epsilon_achieved"] <= runs["epsilon"]).all() and (runs["steps"] > 0).all()
    for _, row in runs.iterrows():
        derived = json.loads(row["derived"])
        assert 0 <= row["noiseless_fraction"] <= 1 and 0 <= derived["noiseless_fraction_mean"] <= 1
        assert 0 <= derived["eligible_fraction"] <= 1  # per-replica values: this seed's own
        assert derived["sigma_c"] > 0 and derived["influence_error_bound"] > 0


def test_noiseless_fraction_is_a_per_run_csv_column(run_grid):
    runs = run_grid("""
        grids:
          - name: pidp
            datasets: [{name: synthetic, n: 400}]
            algorithms: [{name: pidp_sgd, zeta: 0.1, radius: 20}]
            epsilon: [3]
            batch_size: [20]
            lr: [0.5]
            epochs: 2
            seeds: 2
    """)
    assert runs["noiseless_fraction"].between(0, 1).all() and runs["noiseless_fraction"].notna().all()
    assert all("noiseless_fraction" not in json.loads(d) for d in runs["derived"])


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
    H = P.dense_hessian(model, theta, X, y)
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
    norms = P.full_influence_norms(model, theta, X, y, np.linalg.norm(X, axis=1), P.symmetric_inverse(Hd), G)
    for r in range(2):
        for i in range(0, n, 7):
            g = _naive_clipped_gradient(model, theta[r], X[i], y[i], G)
            assert norms[r, i] == pytest.approx(np.linalg.norm(np.linalg.solve(Hd[r], g)) / n, rel=1e-9)
    assert norms.max() <= G / (n * zeta) * (1 + 1e-9)  # ‖H⁻¹‖ ≤ 1/ζ: the sensitivity σ_c uses
    # the model's own CG on (H + sI) agrees with the dense solve
    g = _naive_clipped_gradient(model, theta[0], X[0], y[0], G)[None]
    cg = model.inverse_hvp(theta[:1], X, y, g, damping=float(shift[0]), tol=1e-12)
    np.testing.assert_allclose(cg[0], np.linalg.solve(Hd[0], g[0]), rtol=1e-7, atol=1e-10)


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
    w = P.output_layer_params(model, theta)
    A_rows = P.output_features(model, theta, X)  # ã = [a, 1]: f = ã·[w₂, b₂]
    np.testing.assert_allclose(np.einsum("rmk,rk->rm", A_rows, w), model.decision(theta, X), atol=1e-14)

    def features(rows):
        return P.output_features(model, theta, rows)

    H_out = P.logreg_hessian(w, X, y, model.l2, features=features)
    np.testing.assert_allclose(H_out, P.dense_hessian(model, theta, X, y)[:, -k:, -k:], atol=1e-13)
    # influence norms: (1/n) ‖H_out⁻¹ clip_G(r ã)‖, the output-layer part of ∇ℓ clipped on its own norm
    G, zeta = 0.5, 0.05
    H_d, _ = P.damped(H_out, model.l2, zeta)
    norms = P.influence_norms(w, X, y, None, P.symmetric_inverse(H_d), G, features=features)
    for r in range(2):
        for i in range(0, n, 9):
            g = _naive_clipped_gradient(model, theta[r], X[i], y[i], np.inf)[-k:]
            g *= min(1.0, G / np.linalg.norm(g))
            assert norms[r, i] == pytest.approx(np.linalg.norm(np.linalg.solve(H_d[r], g)) / n, rel=1e-9)
    # A bounds ‖ã‖ over the unit ball (tanh, sigmoid: √(h+1) for every θ; relu: from θ's hidden layer)
    U = np.random.default_rng(1).normal(size=(2000, 3))
    U /= np.linalg.norm(U, axis=1, keepdims=True) / np.random.default_rng(2).random((2000, 1)) ** (1 / 3)
    A = P.output_feature_bound(model, 3 * theta)
    assert (np.linalg.norm(P.output_features(model, 3 * theta, U), axis=-1) <= A[:, None]).all()
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


def test_mlp_replicas_are_independent():
    model, X, y, _ = _tiny_mlp("tanh", n=200)
    setting = _setting(200, 3, batch_size=2, epochs=1)
    for influence, dim in (("full", model.n_params), ("output_layer", model.hidden + 1)):
        radius = P.contribution_sigma(1.0, 2, 0.5e-5, 200, 0.05, 0.25) * math.sqrt(dim - 0.5)  # ≈ half pass
        algo = ALGORITHMS["pidp_sgd"]({"zeta": 0.05, "radius": radius, "rounds": 2, "local_steps": 30,
                                       "influence": influence})
        together = algo.fit(setting, model, X, y, ReplicaStreams([1, 3, 5]))
        alone = algo.fit(setting, model, X, y, ReplicaStreams([3]))
        np.testing.assert_allclose(together.theta[1], alone.theta[0], rtol=1e-12)
        for key in ("noiseless_fraction", "eligible_fraction", "hessian_shift", "hessian_min_eigenvalue"):
            if key in together.derived:
                assert together.derived[key][1] == alone.derived[key][0], key
        assert 0 < together.derived["noiseless_fraction_mean"] < 1
        assert together.guarantee == "none: non-convex model" and together.derived["influence"] == influence


def test_mlp_runs_through_the_engine(run_grid):
    runs = run_grid("""
        grids:
          - name: pidp_mlp
            datasets: [{name: synthetic, n: 400}]
            models: [{name: mlp, hidden: 3}]
            algorithms:
              - {name: pidp_sgd, zeta: 0.05, radius: 20}
              - {name: pidp_sgd, zeta: 0.05, radius: 20, influence: output_layer}
            epsilon: [3]
            batch_size: [20]
            lr: [0.5]
            epochs: 2
            seeds: 2
    """)
    assert len(runs) == 4 and set(runs["status"]) == {"ok"}, runs[["status", "message"]]
    assert set(runs["guarantee"]) == {"none: non-convex model"}
    assert runs["noiseless_fraction"].between(0, 1).all() and (runs["sigma"] > 0).all()
    derived = runs["derived"].map(json.loads)
    assert sorted(derived.map(lambda d: d["influence"])) == ["full", "full", "output_layer", "output_layer"]
    for d in derived:
        assert d["sigma_c"] > 0 and "no claim: non-convex model" in d["privacy_note"]
        if d["influence"] == "full":  # hidden 3 on 5 features: P = 22, the dense Hessian, shifted per replica
            assert d["influence_dim"] == 22 and d["influence_error_bound"] is None and d["hessian_shift"] >= 0
        else:
            assert d["influence_dim"] == 4 and d["output_feature_bound"] == 2.0 and d["influence_error_bound"] > 0
