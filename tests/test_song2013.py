"""song2013 / song2013_nonprivate (Song, Chaudhuri & Sarwate, GlobalSIP 2013): update, noise, sampling, projection."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from scipy.special import expit

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms import song2013 as song_module
from dpsgd_cli.algorithms.ops import Clip, ProjectBall
from dpsgd_cli.algorithms.streams import BLOCK_STEPS, ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.mechanisms import advanced_composition, gamma_norm_noise

PRIVATE, NONPRIVATE = ALGORITHMS["song2013"], ALGORITHMS["song2013_nonprivate"]


def _setting(n, d, **kw):
    base = dict(n=n, d=d, delta=1e-5, l2=1e-3, epsilon=1.0, batch_size=5, lr=1.0, epochs=1)
    return Setting(**{**base, **kw})


def _data(n, d, seed=1, max_norm=1.0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    X *= max_norm * rng.uniform(0.2, 1.0, size=(n, 1)) / np.linalg.norm(X, axis=1, keepdims=True)
    y = np.where(X @ rng.normal(size=d) + 0.2 * rng.normal(size=n) > 0, 1.0, -1.0)
    return X, y


@pytest.fixture(scope="module")
def data():
    return _data(200, 4)


def test_noise_norm_is_gamma_d_2_over_alpha_and_direction_uniform():
    """Zero features: the only update is the noise, θ₁ = −η₁ Z₁ / b, so Z₁ = −b θ₁ / η₁ (one per replica)."""
    R, d, b, eps, lr = 2000, 50, 2, 2.0, 0.5
    X, y = np.zeros((b, d)), np.ones(b)
    setting = _setting(b, d, batch_size=b, epsilon=eps, lr=lr, epochs=1)
    out = PRIVATE().fit(setting, make_model("logreg", d, setting.l2), X, y, ReplicaStreams(range(R)))
    assert out.derived["steps"] == 1 and out.derived["alpha_per_pass"] == eps
    assert out.derived["noise_norm_mean"] == 2 * d / eps and out.derived["noise_norm_scale"] == 2 / eps
    assert np.linalg.norm(out.theta, axis=1).max() < 1 / setting.l2  # the projection did not act
    Z = -b * out.theta / lr
    norms = np.linalg.norm(Z, axis=1)
    # E‖Z‖ = 2d/α within 4 standard errors
    assert abs(norms.mean() - 2 * d / eps) < 4 * norms.std(ddof=1) / np.sqrt(R)
    # ‖Z‖ ~ Gamma(d, scale 2/α); a 5% error in the scale is caught by the same test
    assert stats.kstest(norms, stats.gamma(d, scale=2 / eps).cdf).pvalue > 1e-3
    assert stats.kstest(norms, stats.gamma(d, scale=1.05 * 2 / eps).cdf).pvalue < 1e-6
    assert stats.kstest(norms, stats.gamma(d, scale=0.95 * 2 / eps).cdf).pvalue < 1e-6
    # direction uniform on the sphere: u₁² ~ Beta(1/2, (d−1)/2), and no preferred direction
    u = Z / norms[:, None]
    assert stats.kstest(u[:, 0] ** 2, stats.beta(0.5, (d - 1) / 2).cdf).pvalue > 1e-3
    assert np.linalg.norm(u.mean(axis=0)) < 4 / np.sqrt(R)


def _hand(X, y, seed, *, b, steps, alpha, eta, l2, radius):
    """The paper's update, example by example, with the streams' generators (the noise drawn in 64-step blocks)."""
    n, d = X.shape
    streams = ReplicaStreams([seed])
    sampling, noise = streams.generators("sampling")[0], streams.generators("noise")[0]
    per_pass = n // b
    order = np.concatenate([sampling.permutation(n)[: per_pass * b] for _ in range(-(-steps // per_pass))])
    Z = np.concatenate([gamma_norm_noise(noise, alpha, d, size=BLOCK_STEPS)
                        for _ in range(-(-steps // BLOCK_STEPS))]) if alpha else np.zeros((steps, d))
    w = np.zeros(d)
    for t in range(1, steps + 1):
        total = np.zeros(d)
        for i in order[(t - 1) * b: t * b]:
            g = -y[i] * expit(-y[i] * (w @ X[i])) * X[i]
            total += g / max(1.0, np.linalg.norm(g))  # ‖∇ℓ‖ ≤ 1 by clipping
        w = w - eta(t) * (l2 * w + total / b + Z[t - 1] / b)
        w = w * min(1.0, radius / np.linalg.norm(w)) if np.linalg.norm(w) > 0 else w
    return w


@pytest.mark.parametrize("schedule", ["inv_sqrt", "inv_t", "constant"])
def test_trajectory_and_derived_constants_match_hand_computation(schedule):
    """n = 7, b = 2: ⌊7/2⌋ = 3 steps per pass; epochs 2 → T = 6 steps over k = 2 passes → α = ε/2 per pass."""
    X, y = _data(7, 3, seed=3, max_norm=3.0)  # rows up to norm 3: the clip to ‖∇ℓ‖ ≤ 1 is active
    eps, l2, lr, radius = 1.5, 0.2, 0.7, 0.4
    setting = _setting(7, 3, batch_size=2, epochs=2, epsilon=eps, l2=l2, lr=lr)
    algo = PRIVATE({"schedule": schedule, "radius": radius})
    out = algo.fit(setting, make_model("logreg", 3, l2), X, y, ReplicaStreams([0, 5]))
    eta = {"inv_sqrt": lambda t: lr / np.sqrt(t), "inv_t": lambda t: 1 / (l2 * t), "constant": lambda t: lr}[schedule]
    alpha = eps / 2
    for r, seed in enumerate([0, 5]):
        expected = _hand(X, y, seed, b=2, steps=6, alpha=alpha, eta=eta, l2=l2, radius=radius)
        np.testing.assert_allclose(out.theta[r], expected, rtol=1e-10, atol=1e-13)
    derived = out.derived
    assert (derived["steps"], derived["steps_per_pass"], derived["passes"]) == (6, 3, 2)
    assert derived["alpha_per_pass"] == pytest.approx(alpha, rel=1e-15)
    assert derived["sensitivity"] == 2.0 and derived["noise_norm_scale"] == pytest.approx(2 / alpha)
    assert derived["noise_norm_mean"] == pytest.approx(2 * 3 / alpha)
    assert derived["epsilon_achieved"] == eps and derived["delta_achieved"] == 0.0 and derived["accountant"] == "basic"
    assert derived["sample_rate"] == 2 / 7 and derived["radius"] == radius
    assert derived["step_size_first"] == pytest.approx(eta(1)) and derived["step_size_last"] == pytest.approx(eta(6))
    assert derived["clip_active"]
    assert derived["gradient_bound_without_clip"] == pytest.approx(np.linalg.norm(X, axis=1).max())
    assert out.guarantee == "proved"


def test_one_pass_is_pure_alpha_and_unit_ball_data_needs_no_clip(data):
    X, y = data
    out = PRIVATE().fit(_setting(*X.shape, epsilon=0.3), make_model("logreg", 4, 1e-3), X, y, ReplicaStreams([0]))
    assert out.derived["passes"] == 1 and out.derived["alpha_per_pass"] == 0.3 and out.derived["accountant"] == "pure"
    assert not out.derived["clip_active"] and out.guarantee == "proved"


def test_clip_binding_is_recorded():
    """Rows outside the unit ball (Song et al.'s order: ball, then projection): the share of such rows, and the
    share of examples whose gradient |r|·‖x‖ at the final θ exceeds the clip at 1, by hand."""
    X, y = _data(200, 4)
    X[:50] *= 3.0  # 50 rows with norm in (0.6, 3]
    model = make_model("logreg", 4, 1e-3)
    der = PRIVATE().fit(_setting(*X.shape), model, X, y, ReplicaStreams([0, 1])).derived
    norms = np.linalg.norm(X, axis=1)
    assert der["rows_outside_unit_ball"] == pytest.approx((norms > 1).mean())
    assert der["max_row_norm"] == pytest.approx(norms.max())
    out = PRIVATE().fit(_setting(*X.shape), model, X, y, ReplicaStreams([0, 1]))
    residual = expit(-y * (out.theta @ X.T))  # |r| = σ(−y θ·x)
    assert der["clip_binds_at_final"] == pytest.approx(((residual * norms) > 1).sum(axis=1).mean() / 200)
    assert 0 < der["clip_binds_at_final"] <= der["rows_outside_unit_ball"]
    inside = PRIVATE().fit(_setting(200, 4), model, *_data(200, 4), ReplicaStreams([0])).derived
    assert inside["rows_outside_unit_ball"] == 0 and inside["clip_binds_at_final"] == 0


def test_advanced_composition_option():
    n, k, eps, delta = 20, 50, 1.0, 1e-5
    X, y = _data(n, 3)
    setting = _setting(n, 3, batch_size=n, epochs=k, epsilon=eps, delta=delta)
    model = make_model("logreg", 3, setting.l2)
    basic = PRIVATE().fit(setting, model, X, y, ReplicaStreams([0])).derived
    adv = PRIVATE({"composition": "advanced"}).fit(setting, model, X, y, ReplicaStreams([0])).derived
    assert basic["alpha_per_pass"] == eps / k and basic["delta_achieved"] == 0.0
    assert adv["alpha_per_pass"] > eps / k and adv["accountant"] == "advanced" and adv["delta_achieved"] == delta
    total, total_delta = advanced_composition(adv["alpha_per_pass"], 0.0, k, delta)
    assert total == pytest.approx(eps, rel=1e-9) and total_delta == delta
    # two passes: advanced composition is worse than ε/2, so basic composition (pure DP) is kept
    two = PRIVATE({"composition": "advanced"}).fit(_setting(n, 3, batch_size=n, epochs=2, epsilon=eps), model, X, y,
                                                   ReplicaStreams([0])).derived
    assert two["alpha_per_pass"] == eps / 2 and two["accountant"] == "basic" and two["delta_achieved"] == 0.0


def test_iterates_stay_in_the_ball(data, monkeypatch):
    """Every iterate (recorded at each projection) lies in the ball of radius 1/λ, and the projection acted."""
    X, y = data
    seen = []
    real = ProjectBall.project

    def recording(self, theta):
        out = real(self, theta)
        seen.append((np.linalg.norm(theta, axis=1), np.linalg.norm(out, axis=1), self.radius))
        return out

    monkeypatch.setattr(ProjectBall, "project", recording)
    l2 = 0.05
    setting = _setting(*X.shape, l2=l2, epsilon=0.5, batch_size=2, epochs=2)
    PRIVATE({"schedule": "inv_t", "backend": "numpy"}).fit(setting, make_model("logreg", 4, l2), X, y,
                                                             ReplicaStreams([0, 1]))
    assert len(seen) == 200 and all(r == 1 / l2 for _, _, r in seen)
    before = np.array([b for b, _, _ in seen])
    after = np.array([a for _, a, _ in seen])
    assert after.max() <= (1 / l2) * (1 + 1e-12)
    assert (before > 1 / l2).any()  # the noise pushed iterates out and the projection brought them back


def test_noise_off_is_the_nonprivate_version(data):
    X, y = data  # rows in the unit ball: the private clip at ‖∇ℓ‖ = 1 is the identity
    setting = _setting(*X.shape, batch_size=4, epochs=3, l2=1e-2)
    model, streams = make_model("logreg", 4, 1e-2), ReplicaStreams([0, 1])
    reference = NONPRIVATE().fit(setting, model, X, y, streams)
    assert reference.guarantee == "non-private"
    private = PRIVATE()
    silent = private.chain(setting, X, y, streams, (Clip(song_module.GRADIENT_BOUND),))
    np.testing.assert_array_equal(silent.run(model, model.init(streams.generators("init")), reference.derived["steps"]),
                                  reference.theta)
    # and through fit, an enormous ε makes the noise negligible
    loud = private.fit(Setting(**{**setting.__dict__, "epsilon": 1e12}), model, X, y, streams)
    np.testing.assert_allclose(loud.theta, reference.theta, atol=1e-7)


def test_one_pass_processes_each_example_exactly_once():
    n, b, seeds = 60, 4, [0, 1, 2]
    X = np.arange(n, dtype=float)[:, None] / n  # the feature names the example
    y = np.ones(n)
    chain = PRIVATE().chain(_setting(n, 1, batch_size=b), X, y, ReplicaStreams(seeds))
    passes = []
    for _ in range(2):
        batches = [next(chain.batches) for _ in range(n // b)]
        assert all(batch.X.shape[:2] == (len(seeds), b) and batch.weight.all() for batch in batches)
        passes.append(np.round(np.concatenate([batch.X[:, :, 0] for batch in batches], axis=1) * n).astype(int))
    for order in passes:
        for r in range(len(seeds)):
            np.testing.assert_array_equal(np.sort(order[r]), np.arange(n))  # every example once per pass
    assert not np.array_equal(passes[0][0], passes[1][0])  # a fresh permutation each pass
    assert not np.array_equal(passes[0][0], passes[0][1])  # replicas shuffle independently


@pytest.mark.parametrize("algorithm", [PRIVATE, NONPRIVATE])
def test_replicas_are_independent_of_each_other(data, algorithm):
    X, y = data
    setting, model = _setting(*X.shape, batch_size=3, epochs=2), make_model("logreg", 4, 1e-3)
    together = algorithm().fit(setting, model, X, y, ReplicaStreams([0, 1, 2])).theta
    alone = algorithm().fit(setting, model, X, y, ReplicaStreams([2])).theta
    np.testing.assert_allclose(together[2], alone[0], rtol=1e-12)
    assert not np.allclose(together[0], together[1])


def test_traces_every_k_examples(data):
    X, y = data
    model = make_model("logreg", 4, 1e-3)
    setting = _setting(*X.shape, batch_size=5, epochs=1, trace_every=40)
    out = PRIVATE().fit(setting, model, X, y, ReplicaStreams([0, 1]))
    assert [row[0] for row in out.trace] == [40, 80, 120, 160, 200]  # examples processed, b = 5 per step
    assert all(obj.shape == (2,) and acc.shape == (2,) for _, obj, acc in out.trace)
    np.testing.assert_allclose(out.trace[-1][1], model.objective(out.theta, X, y))
    np.testing.assert_allclose(out.trace[-1][2], model.accuracy(out.theta, X, y))


@pytest.mark.parametrize("kw, match", [({"l2": 0.0}, "l2 = 0.0"), ({"lr": None}, "needs lr")])
def test_bad_settings_are_user_errors(data, kw, match):
    X, y = data
    with pytest.raises(UserError, match=match):
        PRIVATE().fit(_setting(*X.shape, **kw), make_model("logreg", 4, 0.0), X, y, ReplicaStreams([0]))


def test_end_to_end_through_the_engine(run_grid):
    runs = run_grid("""
        grids:
          - name: song
            datasets: [{name: synthetic, n: 600}]
            algorithms: [song2013, song2013_nonprivate, {name: song2013, schedule: inv_t}]
            epsilon: [1]
            batch_size: [5]
            lr: [1]
            epochs: 1
            l2: 1.0e-3
            seeds: 2
            trace_every: 120
    """)
    assert len(runs) == 6 and set(runs["status"]) == {"ok"}
    private = runs[runs["algorithm"] == "song2013"]
    assert (private["epsilon_achieved"] == 1).all() and set(private["accountant"]) == {"pure"}
    assert (private["steps"] == 96).all() and (private["sample_rate"] == 5 / 480).all()
    assert set(private["guarantee"]) == {"proved"} and private["derived"].str.contains("alpha_per_pass").all()
    assert set(runs[runs["algorithm"] == "song2013_nonprivate"]["guarantee"]) == {"non-private"}
    traces = pd.read_csv(run_grid.folder / "traces.csv")
    assert len(traces) == 6 * 4 and set(traces["examples"]) == {120, 240, 360, 480}
