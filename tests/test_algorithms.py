"""Samplers, noise, replica independence, and the non-private references."""

import numpy as np
import pytest
from scipy import stats

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.ops import Clip, Noise
from dpsgd_cli.algorithms.sampling import poisson_batches, poisson_indices
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.accounting import calibrate_sigma


@pytest.fixture(scope="module")
def data(make_logistic_data):
    return make_logistic_data(1, 400, [1.0, -2.0, 0.5, 0.0, 1.0], 0.1)


def test_poisson_inclusion_rates_and_batch_sizes():
    n, q, steps = 200, 0.05, 20000
    idx = poisson_indices(np.random.default_rng(0), n, q, steps, width=60)
    sizes = (idx >= 0).sum(axis=1)
    counts = np.bincount(idx[idx >= 0], minlength=n)
    # every example is kept with probability q: chi-square of the inclusion counts
    assert stats.chisquare(counts).pvalue > 1e-3
    assert counts.sum() / (n * steps) == pytest.approx(q, rel=0.01)
    # batch size ~ Binomial(n, q)
    observed = np.bincount(sizes, minlength=40)[:40]
    expected = stats.binom.pmf(np.arange(40), n, q) * steps
    keep = expected > 5
    assert stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue > 1e-3
    # a wrong rate is detected by the same statistic (the test can fail)
    wrong = stats.binom.pmf(np.arange(40), n, 1.1 * q) * steps
    assert stats.chisquare(observed[keep], wrong[keep] * observed[keep].sum() / wrong[keep].sum()).pvalue < 1e-6


def test_poisson_rows_extended_exactly_when_width_is_too_small():
    n, q = 100, 0.3
    idx = poisson_indices(np.random.default_rng(0), n, q, 2000, width=5)  # forces the extension path
    sizes = (idx >= 0).sum(axis=1)
    assert sizes.mean() == pytest.approx(n * q, rel=0.02)
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.15)
    for row in idx[:50]:
        kept = row[row >= 0]
        assert np.all(np.diff(kept) > 0) and kept.max() < n


def test_batches_trim_padding_and_share_replica_streams(data):
    X, y = data
    a = next(poisson_batches(X, y, 0.1, ReplicaStreams([0, 1, 2])))
    b = next(poisson_batches(X, y, 0.1, ReplicaStreams([2])))
    assert a.weight.sum(axis=1).max() == a.weight.shape[1]  # no all-padding column
    np.testing.assert_array_equal(a.X[2][a.weight[2] > 0], b.X[0][b.weight[0] > 0])


def _setting(n, d, **kw):
    base = dict(n=n, d=d, delta=1e-5, l2=1e-3, epsilon=1.0, batch_size=40, lr=0.5, epochs=2, clip_norm=1.0)
    return Setting(**{**base, **kw})


@pytest.mark.parametrize("name", ["sgd", "dp_sgd"])
def test_replicas_are_independent_of_each_other(data, name):
    X, y = data
    model = make_model("logreg", X.shape[1], 1e-3)
    algo = ALGORITHMS[name]()
    together = algo.fit(_setting(*X.shape), model, X, y, ReplicaStreams([0, 1, 2])).theta
    alone = algo.fit(_setting(*X.shape), model, X, y, ReplicaStreams([2])).theta
    np.testing.assert_allclose(together[2], alone[0], rtol=1e-12)
    assert not np.allclose(together[0], together[1])


def test_dp_sgd_without_noise_or_clipping_is_sgd(data):
    X, y = data
    model = make_model("logreg", X.shape[1], 1e-3)
    setting, streams = _setting(*X.shape), ReplicaStreams([0, 1])
    sgd = ALGORITHMS["sgd"]()
    reference = sgd.fit(setting, model, X, y, streams).theta
    silent = Noise(0.0, streams.normal("noise", (X.shape[1],)))
    chain = ALGORITHMS["dp_sgd"]().chain(setting, X, y, streams, (Clip(1e12), silent))
    np.testing.assert_allclose(chain.run(model, np.zeros((2, X.shape[1])), setting.steps), reference, rtol=1e-12)


def test_dp_sgd_noise_has_std_sigma_times_clip():
    """With zero features the only update is the noise: θ₁ = −η σC z / B, so z must be N(0, 1)."""
    n, d, B, C, lr = 1000, 40000, 50, 0.7, 0.3
    X, y = np.zeros((n, d)), np.ones(n)
    setting = _setting(n, d, batch_size=B, epochs=B / n, clip_norm=C, lr=lr, l2=0.0, epsilon=2.0)
    assert setting.steps == 1
    out = ALGORITHMS["dp_sgd"]().fit(setting, make_model("logreg", d, 0.0), X, y, ReplicaStreams([0, 1, 2]))
    sigma = out.derived["sigma"]
    assert sigma == calibrate_sigma(2.0, 1e-5, B / n, 1).sigma
    z = (-out.theta * B / (lr * sigma * C)).ravel()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z / 1.05, "norm").pvalue < 1e-6  # a 5% error in the std would be caught


def test_erm_matches_scikit_learn(data):
    from sklearn.linear_model import LogisticRegression

    X, y = data
    l2 = 1e-2
    model = make_model("logreg", X.shape[1], l2)
    theta = ALGORITHMS["erm"]().fit(_setting(*X.shape, l2=l2), model, X, y, ReplicaStreams([0, 1])).theta
    # scikit-learn minimises C Σ loss + ½‖w‖², the same minimiser as ours with λ = 1/(C n)
    ref = LogisticRegression(C=1 / (l2 * X.shape[0]), fit_intercept=False, tol=1e-12, max_iter=10000).fit(X, y)
    np.testing.assert_allclose(theta[0], ref.coef_[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(theta[0], theta[1])
    assert np.linalg.norm(model.gradient(theta[:1], X, y)) < 1e-7


@pytest.mark.parametrize("model_name", ["logreg", "mlp"])
def test_float32_training_matches_float64_and_keeps_its_dtype(data, model_name):
    X, y = data
    model = make_model(model_name, X.shape[1], 1e-3)
    setting = _setting(*X.shape)
    wide = ALGORITHMS["dp_sgd"]().fit(setting, model, X, y, ReplicaStreams([0, 1])).theta
    narrow = ALGORITHMS["dp_sgd"]().fit(setting, model, X.astype(np.float32), y.astype(np.float32),
                                        ReplicaStreams([0, 1])).theta
    assert narrow.dtype == np.float32 and wide.dtype == np.float64
    np.testing.assert_allclose(narrow, wide, rtol=1e-4, atol=1e-5)  # same batches and noise, rounding only
    accuracy = [np.mean(np.sign(model.decision(t.astype(np.float64), X)) == y, axis=-1) for t in (narrow, wide)]
    np.testing.assert_allclose(accuracy[0], accuracy[1], atol=1.5 / X.shape[0])  # at most one example flips


def test_a_setting_reads_the_axes_an_algorithm_uses_without_none():
    setting = Setting(n=10, d=2, delta=0.1, l2=0.0, batch_size=5, epochs=2, lr=0.5)
    assert (setting.required.lr, setting.required.batch_size, setting.steps, setting.sample_rate) == (0.5, 5, 4, 0.5)
    with pytest.raises(ValueError, match="no epsilon"):
        setting.required.epsilon  # noqa: B018
    with pytest.raises(ValueError, match="no batch_size"):
        Setting(n=10, d=2, delta=0.1, l2=0.0, epochs=2).steps  # noqa: B018
