"""Logistic regression: loss and gradients against finite differences; clipping never exceeds C."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dpsgd_cli.models import make_model
from dpsgd_cli.models.rows import gather


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 4))
    y = np.where(rng.random(50) < 0.5, -1.0, 1.0)
    theta = rng.normal(size=(3, 4))
    return X, y, theta, make_model("logreg", d=4, l2=0.3)


def test_loss_matches_definition(problem):
    X, y, theta, model = problem
    expected = np.mean(np.log1p(np.exp(-y * (X @ theta[1])))) + 0.15 * theta[1] @ theta[1]
    assert model.objective(theta, X, y)[1] == pytest.approx(expected, rel=1e-12)


def test_gradient_matches_finite_differences(problem):
    X, y, theta, model = problem
    grad = model.gradient(theta, X, y)
    h = 1e-6
    for j in range(theta.shape[1]):
        step = np.zeros_like(theta)
        step[:, j] = h
        numeric = (model.objective(theta + step, X, y) - model.objective(theta - step, X, y)) / (2 * h)
        np.testing.assert_allclose(grad[:, j], numeric, rtol=1e-6, atol=1e-9)


def _batch(X, y, replicas):
    idx = np.tile(np.arange(X.shape[0]), (replicas, 1))
    return gather(X, y, np.linalg.norm(X, axis=1), idx)


def _naive_per_example(model, theta, X, y):
    """(R, n, P) per-example data-loss gradients by finite differences of single-example losses."""
    h = 1e-6
    out = np.empty((theta.shape[0], X.shape[0], theta.shape[1]))
    for i in range(X.shape[0]):
        for j in range(theta.shape[1]):
            step = np.zeros_like(theta)
            step[:, j] = h
            out[:, i, j] = (model.data_loss(theta + step, X[i:i + 1], y[i:i + 1])
                            - model.data_loss(theta - step, X[i:i + 1], y[i:i + 1])) / (2 * h)
    return out


def test_per_example_norms_and_clipped_sum_match_naive(problem):
    X, y, theta, model = problem
    X, y = X[:12], y[:12]
    per_example = _naive_per_example(model, theta, X, y)
    batch = _batch(X, y, theta.shape[0])
    norms = np.linalg.norm(per_example, axis=2)
    np.testing.assert_allclose(model.per_example_grad_norms(theta, batch), norms, rtol=1e-6)
    C = 0.3
    clipped = per_example * np.minimum(1.0, C / norms)[..., None]
    np.testing.assert_allclose(model.clipped_grad_sum(theta, batch, C), clipped.sum(axis=1), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(model.clipped_grad_sum(theta, batch, None), per_example.sum(axis=1), rtol=1e-6,
                               atol=1e-9)


def test_padding_is_ignored(problem):
    X, y, theta, model = problem
    idx = np.array([[0, 1, 2, -1, -1], [3, 4, -1, -1, -1], [5, -1, -1, -1, -1]])
    batch = gather(X, y, np.linalg.norm(X, axis=1), idx)
    got = model.clipped_grad_sum(theta, batch, 1.0)
    for r, rows in enumerate([[0, 1, 2], [3, 4], [5]]):
        single = gather(X, y, np.linalg.norm(X, axis=1), np.array([rows]))
        np.testing.assert_allclose(got[r], model.clipped_grad_sum(theta[r:r + 1], single, 1.0)[0])


@settings(max_examples=60, deadline=None)
@given(
    X=arrays(np.float64, (7, 3), elements=st.floats(-50, 50)),
    theta=arrays(np.float64, (2, 3), elements=st.floats(-50, 50)),
    clip=st.floats(1e-3, 10),
)
def test_clipped_per_example_gradients_never_exceed_clip(X, theta, clip):
    y = np.array([1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
    model = make_model("logreg", d=3, l2=0.0)
    batch = _batch(X, y, 2)
    for i in range(X.shape[0]):  # each example alone: its clipped gradient has norm ≤ C
        single = gather(X, y, np.linalg.norm(X, axis=1), np.full((2, 1), i))
        norm = np.linalg.norm(model.clipped_grad_sum(theta, single, clip), axis=1)
        assert np.all(norm <= clip * (1 + 1e-9))
    total = np.linalg.norm(model.clipped_grad_sum(theta, batch, clip), axis=1)
    assert np.all(total <= X.shape[0] * clip * (1 + 1e-9))


def test_accuracy(problem):
    X, y, theta, model = problem
    expected = np.mean(np.sign(X @ theta[0]) == y)
    assert model.accuracy(theta, X, y)[0] == pytest.approx(expected)
