"""The compiled update of `sgd`/`dp_sgd` chains (algorithms/_update_numba.py) computes the NumPy transforms'
numbers bit for bit: noise, scale, λθ and θ ← θ − ηg, float32 and float64."""

import numpy as np
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.chain import GradientChain
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model

pytestmark = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed")


def _one_hot(n=300, seed=4):
    """Sparse rows (the MLP's row-sparse path) and a label from them."""
    rng = np.random.default_rng(seed)
    X = np.zeros((n, 40))
    X[np.arange(n), rng.integers(0, 20, n)] = 1.0
    X[np.arange(n), 20 + rng.integers(0, 20, n)] = rng.uniform(0.2, 1.0, n)
    y = np.where(X[:, :10].sum(axis=1) + 0.3 * rng.normal(size=n) > 0.5, 1.0, -1.0)
    return X, y


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("algorithm", ["dp_sgd", "sgd"])
@pytest.mark.parametrize("model_name, l2", [("mlp", 1e-3), ("mlp", 0.0), ("logreg", 1e-3)])
def test_compiled_update_equals_numpy_transforms(monkeypatch, dtype, algorithm, model_name, l2):
    X, y = (a.astype(dtype) for a in _one_hot())
    setting = Setting(n=X.shape[0], d=X.shape[1], delta=1e-5, l2=l2, epsilon=1.0, batch_size=30, lr=0.7, epochs=2,
                      clip_norm=0.5)
    model = make_model(model_name, X.shape[1], l2)
    calls = []
    real = GradientChain._fused_update

    def spy(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(GradientChain, "_fused_update", spy)
    fused = ALGORITHMS[algorithm]().fit(setting, model, X, y, ReplicaStreams([0, 5])).theta
    # float64 logistic regression runs the compiled mini-batch step (no chain step); the others the chain step
    assert (any(calls) and all(calls)) or (model_name == "logreg" and dtype == "float64")
    monkeypatch.setattr(GradientChain, "_fused_update", lambda self, *args: None)
    numpy = ALGORITHMS[algorithm]().fit(setting, model, X, y, ReplicaStreams([0, 5])).theta
    assert fused.dtype == np.dtype(dtype) and np.isfinite(fused).all()
    assert np.array_equal(fused, numpy)


def test_numpy_scalars_keep_the_numpy_transforms():
    """A NumPy float64 learning rate promotes a float32 update to float64 in NumPy: not the kernel's arithmetic."""
    chain = ALGORITHMS["sgd"]().chain(Setting(n=100, d=3, delta=1e-5, l2=1e-2, epsilon=1.0, batch_size=10, lr=0.5,
                                              epochs=1), *_one_hot(100)[:1], np.ones(100), ReplicaStreams([0]))
    chain.backend = "auto"
    theta = np.zeros((1, 40), np.float32)
    assert chain._fused_update(theta, theta.copy(), 0.5) is not None
    assert chain._fused_update(theta, theta.copy(), np.float64(0.5)) is None
    assert chain._fused_update(theta, theta.astype(np.float64), 0.5) is None
