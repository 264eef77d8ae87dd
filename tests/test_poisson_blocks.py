"""The Poisson sampler's faster paths draw exactly what NumPy's `Generator.geometric` and np.pad draw."""

import numpy as np
import pytest

from dpsgd_cli.algorithms import sampling
from dpsgd_cli.algorithms.streams import ReplicaStreams


@pytest.mark.parametrize("q", [0.5, 1 / 3, 0.3, 0.0085, 1e-7, 1e-13])
def test_geometric_draws_are_numpys_and_leave_the_same_state(q):
    assert sampling._inversion_matches()  # else the fast path is never taken (and this test could not fail)
    want, wanted = np.random.default_rng(7), np.random.default_rng(7)
    expected = wanted.geometric(q, size=(64, 300))
    got = sampling._geometric(want, q, (64, 300))
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == expected.dtype and want.bit_generator.state == wanted.bit_generator.state


def padded(parts, axis):
    """The reference: each part padded with −1 to the widest, then concatenated."""
    width = max(p.shape[-1] for p in parts)
    pads = [np.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, width - p.shape[-1])], constant_values=-1) for p in parts]
    return np.concatenate(pads, axis=axis)


@pytest.mark.parametrize("axis", [0, 1])
def test_stacked_is_pad_and_concatenate(axis):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 9, size=(3, 2, w)) if axis == 0 else rng.integers(0, 9, size=(3, 1, w)) for w in (4, 7, 5)]
    np.testing.assert_array_equal(sampling._stacked(parts, axis), padded(parts, axis))


def test_blocks_pad_each_replica_to_the_widest_with_minus_one():
    """A width too small for some rows (extended gap sequences) gives replicas of different widths."""
    batches = sampling.poisson_batches(np.zeros((300, 2)), np.ones(300), 0.1, ReplicaStreams((1, 2, 3)), width=25)
    idx = batches.take(130)  # across three blocks
    streams = ReplicaStreams((1, 2, 3))
    gens = streams.generators("sampling")
    draws = [[sampling.poisson_indices(g, 300, 0.1, 64, 25) for g in gens] for _ in range(3)]
    blocks = [padded([d[:, None] for d in block], axis=1) for block in draws]
    np.testing.assert_array_equal(idx, padded(blocks, axis=0)[:130])
    assert len({d.shape[1] for block in draws for d in block}) > 1
