"""A seed's run does not depend on the seeds trained beside it on the NumPy path, and the shared noise block is
never refilled while a step of it is still held."""

import itertools

import numpy as np
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.algorithms.base import Setting
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model


def _dense_data(n=240, d=30, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return X, np.where(X[:, 0] + 0.1 > 0, 1.0, -1.0)


@pytest.mark.parametrize("model_name, options, algorithm_name, params", [
    ("logreg", {}, "dp_sgd", {"backend": "numpy"}),
    ("logreg", {}, "dp_lssgd", {"smoothing": 1.0}),
    ("mlp", {"hidden": 11}, "dp_sgd", {"backend": "numpy"}),
    ("mlp", {"hidden": 11}, "dp_sgd", {}),  # dense rows: the MLP's NumPy path under backend auto too
    ("logreg", {}, "pidp_sgd", {"sampling": "poisson"}),
    ("mlp", {"hidden": 11}, "pidp_sgd", {"sampling": "poisson"}),
])
def test_numpy_path_seed_alone_equals_seed_among_others_bit_for_bit(model_name, options, algorithm_name, params):
    """A Poisson batch is trimmed to the widest replica's size, and a BLAS sum over its M rows rounds differently
    with M: replicas that keep different numbers of rows take their BLAS products on their own rows
    (`Model._clipped_grad_sum_per_replica`), so a seed trained alone equals it trained beside others."""
    X, y = _dense_data()
    model = make_model(model_name, X.shape[1], 1e-3, options)
    setting = Setting(n=X.shape[0], d=X.shape[1], delta=1e-5, l2=1e-3, epsilon=2.0, batch_size=24, lr=0.5, epochs=2,
                      clip_norm=0.5)
    algorithm = ALGORITHMS[algorithm_name](params)
    differ = 0
    for others in ([0, 4, 9], [1, 4, 7], [2, 4, 5, 8]):  # whether the rounding differs depends on the numbers
        many = algorithm.fit(setting, model, X, y, ReplicaStreams(others)).theta
        alone = algorithm.fit(setting, model, X, y, ReplicaStreams([4])).theta
        assert np.array_equal(many[others.index(4)], alone[0])
        differ += not np.array_equal(many[0], many[1])
    assert differ == 3  # the seeds did train differently


@pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed")
def test_noise_block_is_not_refilled_while_one_step_of_it_is_held():
    """`ReplicaStreams._filled` refills its block in place when sys.getrefcount says no step of it is alive. Hold
    exactly one step per block (the hazardous case: one outstanding view, e.g. a lagging tee of a fused task) and
    check it is never overwritten. Guards the refcount threshold, which depends on the interpreter (CPython 3.14
    borrows references on the operand stack, so getrefcount may report one less than on 3.11)."""
    streams = ReplicaStreams([0, 3])
    draws = streams.normal("noise", (5,))
    held, copies = [], []
    for k in range(40):
        step = next(draws)
        if k % 8 == 7:  # the last step of each 8-step block: the only view left when the next block is filled
            held = [step]
            copies = [step.copy()]
        del step
        assert all(np.array_equal(h, c) for h, c in zip(held, copies)), f"held draw overwritten at step {k}"
    want = list(itertools.islice(ReplicaStreams([0, 3]).per_step(
        "noise", lambda g, k: g.standard_normal((k, 5))), 40))
    assert np.array_equal(held[0], want[39])
