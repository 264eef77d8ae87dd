"""Adaptive clipping (Andrew et al. 2021): the clip norm's trajectory on data of known per-example norms, the
reduced gradient noise and the two releases' ε against dp-accounting, the refusals before any work, and run ids of
fixed-clip cells unchanged."""

import itertools

import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from pydantic import ValidationError

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.adaptive_clipping import adaptive_event, gradient_noise_multiplier
from dpsgd_cli.algorithms.ops import AdaptiveClip, OpStates, Scale, Sgd, WeightDecay, constant
from dpsgd_cli.algorithms.sampling import poisson_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import plan_grid
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Batch, make_model
from dpsgd_cli.privacy.accounting import calibrate_sigma, dpsgd_event


def _setting(n, d, **kw):
    base = dict(n=n, d=d, delta=1e-5, l2=1e-2, epsilon=1.0, batch_size=40, lr=0.5, epochs=2, clip_norm=1.0)
    return Setting(**{**base, **kw})


def _zeros(shape):
    return itertools.repeat(np.zeros(shape))


def known_norms(n: int, d: int):
    """Rows of norms 2·(0.05 ... 1) (n distinct), so that at θ = 0 (residual −y/2) ‖∇ℓ_i‖ = ‖x_i‖/2 are known."""
    rng = np.random.default_rng(0)
    U = rng.standard_normal((n, d))
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    norms = np.linspace(0.05, 1.0, n)
    X = U * (2 * norms)[:, None]
    y = np.where(rng.random(n) < 0.5, 1.0, -1.0)
    batch = Batch(X=X[None], y=y[None], weight=np.ones((1, n)), x_norm=np.linalg.norm(X, axis=1)[None])
    return norms, batch


def noise_free_trajectory(C0, gamma, eta, steps, n=200, d=3):
    """The norms C_0 ... C_T of a noise-free `AdaptiveClip` (σ_Δ = σ_b = 0) on the full batch, θ kept at 0."""
    norms, batch = known_norms(n, d)
    model = make_model("logreg", d, 0.0)
    op = AdaptiveClip(norm=C0, quantile=gamma, lr=eta, noise_multiplier=0.0, draws=_zeros((1, d)), count_std=0.0,
                      count_draws=_zeros((1,)), expected_batch=float(n))
    states = OpStates((op, Scale(1.0 / n), WeightDecay(0.0), Sgd(constant(0.0))))
    theta = np.zeros((1, d))
    trajectory = [states.clip_norms(theta)[0]]
    for _ in range(steps):
        theta = states.step(states.clipped_sum(model, theta, batch), theta)
        trajectory.append(states.clip_norms(theta)[0])
    assert np.all(theta == 0)
    return norms, np.array(trajectory)


def test_clip_norm_follows_the_closed_form_with_a_noise_free_count():
    """C_t = C_0 · exp(−η_C Σ_{s<t} (b̄_s − γ)), b̄_s the exact fraction of norms ≤ C_s; below every norm b̄ = 0,
    so C_t = C_0 e^{η_C γ t} until C crosses the smallest norm."""
    gamma, eta, C0 = 0.5, 0.2, 0.01
    norms, C = noise_free_trajectory(C0, gamma, eta, 60)
    fractions = np.array([np.mean(norms <= c) for c in C[:-1]])
    expected = C0 * np.exp(-eta * np.cumsum(fractions - gamma))
    np.testing.assert_allclose(C[1:], expected, rtol=1e-12)
    below = int(np.argmax(norms.min() <= C))
    assert below > 5
    np.testing.assert_allclose(C[:below], C0 * np.exp(eta * gamma * np.arange(below)), rtol=1e-12)


@pytest.mark.parametrize("gamma", [0.2, 0.5, 0.9])
def test_clip_norm_converges_to_the_target_quantile(gamma):
    norms, C = noise_free_trajectory(5.0, gamma, 0.2, 400)
    tail = C[-100:]
    assert np.quantile(norms, gamma - 0.05) <= np.exp(np.mean(np.log(tail))) <= np.quantile(norms, gamma + 0.05)
    assert abs(np.mean([np.mean(norms <= c) for c in tail]) - gamma) < 0.02


def test_the_count_is_of_the_centred_indicators_over_the_expected_batch():
    """b̄ = (Σ_i (1[‖g_i‖ ≤ C] − 1/2) + σ_b z)/B + 1/2 with z the seed's count noise: one step by hand."""
    n, d, B, sigma_b = 200, 3, 150.0, 4.0
    norms, batch = known_norms(n, d)
    model = make_model("logreg", d, 0.0)
    z = next(ReplicaStreams([5]).normal("clip_count", ()))
    op = AdaptiveClip(norm=0.3, quantile=0.5, lr=0.2, noise_multiplier=0.0, draws=_zeros((1, d)), count_std=sigma_b,
                      count_draws=ReplicaStreams([5]).normal("clip_count", ()), expected_batch=B)
    _, after = op.release(model, np.zeros((1, d)), batch, np.array([0.3]))
    fraction = (np.sum(norms <= 0.3) - n / 2 + sigma_b * z[0]) / B + 0.5
    np.testing.assert_allclose(after, [0.3 * np.exp(-0.2 * (fraction - 0.5))], rtol=1e-14)


@pytest.mark.parametrize("sigma, sigma_b, q, steps",
                         [(1.1, 2.0, 0.01, 1000), (1.5, 1.0, 0.05, 30), (2.0, 1.5, 1.0, 10)])
def test_the_two_releases_cost_what_sigma_alone_does(sigma, sigma_b, q, steps):
    """σ_Δ⁻² + (2σ_b)⁻² = σ⁻²; dp-accounting's ε of the event (the two Gaussians of one Poisson sample, T times) is
    DP-SGD's at σ, within 1e-6 relative (RDP; and PLD at q = 1, where it composes the two Gaussians itself)."""
    sigma_delta = gradient_noise_multiplier(sigma, sigma_b, 100)
    assert sigma_delta > sigma
    np.testing.assert_allclose(sigma_delta**-2 + (2 * sigma_b) ** -2, sigma**-2, rtol=1e-12)
    event = adaptive_event(sigma_delta, sigma_b, q, steps)
    single = dpsgd_event(sigma, q, steps)
    accountants = [RdpAccountant] + ([PLDAccountant] if q == 1 else [])
    for accountant in accountants:
        both = accountant().compose(event).get_epsilon(1e-5)
        alone = accountant().compose(single).get_epsilon(1e-5)
        assert both == pytest.approx(alone, rel=1e-6)
    # one sample for both releases: separately sampled Gaussians would be another (here less private-looking) event
    gaussians = event.event.event.events if q < 1 else event.event.events
    assert [g.noise_multiplier for g in gaussians] == [sigma_delta, 2 * sigma_b]


def test_dp_sgd_with_adaptive_clipping_claims_what_its_event_gives(make_logistic_data):
    X, y = make_logistic_data(3, 400, [1.0, -2.0, 0.5, 0.0, 1.0], 0.1)
    setting = _setting(*X.shape)
    algo = ALGORITHMS["dp_sgd"]({"clip_quantile": 0.5})
    model = make_model("logreg", X.shape[1], setting.l2)
    outcome = algo.fit(setting, model, X, y, ReplicaStreams([0, 1]))
    d = outcome.derived
    assert d["clip_count_std"] == 0.05 * 40
    assert d["sigma_gradient"] == gradient_noise_multiplier(d["sigma"], d["clip_count_std"], 40)
    eps = RdpAccountant().compose(algo.dp_event(setting, d)).get_epsilon(setting.delta)
    assert eps <= d["epsilon_achieved"] * (1 + 1e-9) and d["epsilon_achieved"] <= setting.epsilon
    alone = algo.fit(setting, model, X, y, ReplicaStreams([1]))
    np.testing.assert_array_equal(outcome.theta[1], alone.theta[0])  # a seed's run does not depend on the others
    assert alone.derived["clip_norm_final"] == d["clip_norm_final"][1:] and len(d["clip_norm_final"]) == 2
    assert all(0 < c != 1.0 for c in d["clip_norm_final"])
    fixed = ALGORITHMS["dp_sgd"]().fit(setting, model, X, y, ReplicaStreams([0, 1])).theta
    assert not np.array_equal(outcome.theta, fixed)


def test_too_little_count_noise_and_replace_one_are_refused():
    setting = _setting(400, 5, epsilon=0.2, batch_size=10)
    algo = ALGORITHMS["dp_sgd"]({"clip_quantile": 0.5, "clip_count_noise": 0.05})  # σ_b = 0.5, σ ≈ 2.7
    with pytest.raises(UserError, match="2σ_b > σ") as refused:
        algo.check(setting, "logreg")
    sigma = calibrate_sigma(*algo.sigma_calibration(setting)).sigma
    assert f"above σ/(2B) = {sigma / 20:.4g}" in str(refused.value)
    ALGORITHMS["dp_sgd"]({"clip_quantile": 0.5, "clip_count_noise": 1.0}).check(setting, "logreg")
    ALGORITHMS["dp_sgd"]().check(setting, "logreg")
    replace = ALGORITHMS["dp_adam"]({"clip_quantile": 0.5, "accountant": "pld"}, "replace_one")
    assert "add/remove" in replace.refuses_neighbours("replace_one")
    assert ALGORITHMS["dp_adam"]({"accountant": "pld"}).refuses_neighbours("replace_one") is None


def test_adaptive_parameters_act_only_with_a_quantile_and_leave_fixed_clip_run_ids_alone():
    with pytest.raises(ValidationError, match="acts only with clip_quantile"):
        ALGORITHMS["dp_sgd"]({"clip_lr": 0.3})
    with pytest.raises(ValidationError):
        ALGORITHMS["dp_sgd"]({"clip_quantile": 1.0})
    assert ALGORITHMS["dp_sgd"]().params.model_dump() == {"accountant": "rdp", "backend": "auto"}
    assert ALGORITHMS["dp_sgd"]({"clip_quantile": 0.5, "clip_lr": 0.2}).params.model_dump() == {
        "accountant": "rdp", "backend": "auto", "clip_quantile": 0.5}
    params = ALGORITHMS["dp_adam"]({"clip_quantile": 0.5, "clip_count_noise": 0.1}).params
    assert type(params)(**params.model_dump()) == params
    assert params.model_dump() == {"beta1": 0.9, "beta2": 0.999, "eps_adam": 1e-8, "accountant": "rdp",
                                   "backend": "auto", "clip_quantile": 0.5, "clip_count_noise": 0.1}


def test_a_grid_with_too_little_count_noise_is_refused_before_any_work(write_grid, tmp_path):
    grid = load_grid_file(write_grid("""
        grids:
          - name: adaptive
            datasets: [{name: synthetic, n: 400, dim: 5}]
            models: [logreg]
            algorithms: [dp_sgd, {name: dp_adam, clip_quantile: 0.5, clip_count_noise: 0.01}]
            epsilon: [0.5]
            batch_size: [20]
            seeds: 1
            epochs: 1
        """)).grids[0]
    with pytest.raises(UserError, match="2σ_b > σ") as refused:
        plan_grid(grid, tmp_path / "out")
    assert "grid 'adaptive'" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out" / "adaptive" / "runs.csv").exists()


@pytest.mark.parametrize("model_name, options", [("logreg", {}), ("mlp", {"hidden": 4}),
                                                 ("mlp", {"hidden": 3, "activation": "relu"})])
def test_the_models_count_is_of_the_examples_the_clip_leaves_alone(make_logistic_data, model_name, options):
    """`unclipped_count` against each example's gradient norm, from its unclipped gradient alone; on Poisson
    batches (replicas of different sizes, padded) each replica's count is its count alone."""
    X, y = make_logistic_data(6, 120, [1.0, -1.0, 0.5, 2.0], 0.2)
    model = make_model(model_name, X.shape[1], 0.0, options)
    theta = model.init([np.random.default_rng(s) for s in (1, 2, 3)]) + 0.3
    batch = next(iter(poisson_batches(X, y, 0.3, ReplicaStreams([0, 5, 9]))))
    assert len(set(np.count_nonzero(batch.weight, axis=1).tolist())) > 1  # padded: the per-replica path
    norms, clip = [], np.zeros((3, 1))
    for r in range(3):
        kept = batch.weight[r] > 0
        one = Batch(X=batch.X[r, kept][:, None, :], y=batch.y[r, kept][:, None], weight=np.ones((kept.sum(), 1)),
                    x_norm=batch.x_norm[r, kept][:, None])
        norms.append(np.linalg.norm(model.clipped_grad_sum(np.repeat(theta[r:r + 1], kept.sum(), axis=0), one,
                                                           None), axis=1))
        ranked = np.sort(norms[r])
        clip[r] = (ranked[r + 3] + ranked[r + 4]) / 2  # between two norms: the count is not decided by rounding
    count = model.unclipped_count(theta, batch, clip)
    np.testing.assert_array_equal(count, [np.sum(norms[r] <= clip[r, 0]) for r in range(3)])
    np.testing.assert_array_equal(count, [4, 5, 6])
