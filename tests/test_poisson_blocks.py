"""The Poisson sampler's faster paths draw exactly what NumPy's `Generator.geometric` and np.pad draw."""

import numpy as np
import pytest

from dpsgd_cli import compiled
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


needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed")


@needs_numba
@pytest.mark.parametrize("seed", [0, 1, 17, 2**31 + 5, 20240917])
def test_compiled_exponentials_are_numpys_and_leave_its_state(seed):
    from dpsgd_cli.algorithms import _normals_numba as numba_streams

    assert numba_streams.exponentials_match()
    g, h = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 1])
    state = numba_streams.pcg64_state(h)
    for size in (1, 2, 255, 10_000, 300_001):  # 300,001 draws pass the ziggurat's tail (idx 0) and wedges many times
        got = np.full(size, np.nan)
        numba_streams.fill_exponentials_pcg64(state, got)
        np.testing.assert_array_equal(got, g.standard_exponential(size))
    h.bit_generator.state = {**h.bit_generator.state,
                             "state": {"state": (int(state[0]) << 64) | int(state[1]),
                                       "inc": (int(state[2]) << 64) | int(state[3])}}
    assert h.bit_generator.state == g.bit_generator.state


@pytest.mark.parametrize("numba", [False, True] if compiled.HAVE_NUMBA else [False])
@pytest.mark.parametrize("n, q, width", [(300, 0.1, 25), (300, 0.1, 60), (2000, 0.032, 120), (50, 0.3, 3),
                                         (1000, 0.5, 600)])
def test_blocks_are_the_per_replica_numpy_draws(monkeypatch, numba, n, q, width):
    """Whichever path draws them (compiled on PCG64's state, or NumPy per generator), the blocks are
    `poisson_indices`' of each replica's generator, padded with −1 (widths too small extend rows, q ≥ 1/3 takes
    NumPy's search)."""
    monkeypatch.setattr(compiled, "HAVE_NUMBA", numba)
    seeds = (0, 3, 11, 12)
    drawn = sampling._compiled_states(compiled.optional_compiled("algorithms._normals_numba"),
                                      ReplicaStreams(seeds), q)
    assert (drawn is not None) == (numba and q < 1 / 3)  # the path this case tests is taken
    got = [next(blocks) for blocks in [sampling._poisson_blocks(n, q, ReplicaStreams(seeds), width)] for _ in range(3)]
    gens = ReplicaStreams(seeds).generators("sampling")
    want = [padded([sampling.poisson_indices(g, n, q, 64, width)[:, None] for g in gens], axis=1) for _ in range(3)]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
