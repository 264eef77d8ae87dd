"""The noise streams' compiled draws are NumPy's numbers, bit for bit (streams.ReplicaStreams.normal)."""

import itertools

import numpy as np
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed")


@needs_numba
def test_pcg64_inlined_normals_are_numpys_and_leave_its_state():
    from dpsgd_cli.algorithms import _normals_numba as compiled

    assert compiled.pcg64_matches()
    for seed in (1, 5, 123):  # 3 × 600,003 draws: the ziggurat's wedges (~0.7%) and tail (idx 0) many times each
        g, h = np.random.default_rng([seed, 2]), np.random.default_rng([seed, 2])
        state = compiled.pcg64_state(h)
        out = np.full((3, 2, 100_001), np.nan)
        for _ in range(2):
            compiled.fill_normals_pcg64(state, out, 1)
            assert np.array_equal(out[:, 1], g.standard_normal((3, 100_001)))
            assert np.isnan(out[:, 0]).all()  # the other replica's row untouched
        h.bit_generator.state = {**h.bit_generator.state,
                                 "state": {"state": (int(state[0]) << 64) | int(state[1]),
                                           "inc": (int(state[2]) << 64) | int(state[3])}}
        assert h.bit_generator.state == g.bit_generator.state  # the stream's state advanced exactly


@needs_numba
def test_other_bit_generators_take_the_generator_path():
    from dpsgd_cli.algorithms import _normals_numba as compiled

    assert compiled.pcg64_state(np.random.Generator(np.random.Philox(3))) is None


@pytest.mark.parametrize("numba", [False, True] if compiled.HAVE_NUMBA else [False])
def test_normal_stream_equals_per_replica_standard_normal(monkeypatch, numba):
    monkeypatch.setattr(compiled, "HAVE_NUMBA", numba)
    got = list(itertools.islice(ReplicaStreams([0, 3, 11]).normal("noise", (2, 7)), 70))
    want = list(itertools.islice(ReplicaStreams([0, 3, 11]).per_step(
        "noise", lambda g, k: g.standard_normal((k, 2, 7))), 70))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_float32_training_copy_is_made_once_per_read_only_dataset():
    from dpsgd_cli.models.rows import cached_astype, cached_nonzeros

    X = np.random.default_rng(0).normal(size=(50, 4))
    assert cached_astype(X, np.float32) is not cached_astype(X, np.float32)  # writeable: may change between calls
    X.flags.writeable = False
    a = cached_astype(X, np.float32)
    assert a is cached_astype(X, "float32") and a.dtype == np.float32 and not a.flags.writeable
    assert np.array_equal(a, X.astype(np.float32))
    assert cached_astype(X, np.float64) is X
    X0 = np.zeros((40, 100), dtype=np.float64)
    X0[:, 0] = 1.0
    X0.flags.writeable = False
    copy = cached_astype(X0, np.float32)
    assert cached_nonzeros(copy) is cached_nonzeros(cached_astype(X0, np.float32))  # so its nonzeros are reused


@needs_numba
def test_a_pcg64_path_that_fails_its_check_falls_back_to_the_generator_path(monkeypatch):
    from dpsgd_cli.algorithms import _normals_numba as compiled

    def broken(state, out, r):
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(compiled, "fill_normals_pcg64", broken)
    compiled.pcg64_matches.cache_clear()
    try:
        assert not compiled.pcg64_matches()
        assert compiled.pcg64_state(np.random.default_rng(0)) is None
        got = list(itertools.islice(ReplicaStreams([2, 9]).normal("noise", (5,)), 12))
        want = list(itertools.islice(ReplicaStreams([2, 9]).per_step(
            "noise", lambda g, k: g.standard_normal((k, 5))), 12))
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    finally:
        compiled.pcg64_matches.cache_clear()


@pytest.mark.parametrize("numba", [False, True] if compiled.HAVE_NUMBA else [False])
@pytest.mark.parametrize("sizes", [[1] * 70, [7] * 10, [64, 6], [70], [3, 61, 6]])
def test_a_noise_stream_is_the_same_in_any_block_size(monkeypatch, numba, sizes):
    """Taken m steps at a time or step by step: each replica's generator's standard normals in step order; a
    draw whose numbers depend on its size (song2013's Z_t) is drawn in its fixed blocks whatever is taken."""
    monkeypatch.setattr(compiled, "HAVE_NUMBA", numba)
    normal, blocky = ReplicaStreams([4, 9]).normal("noise", (3,)), ReplicaStreams([4, 9]).per_step(
        "noise", lambda g, k: g.standard_normal((k, 2)) * g.uniform(size=(1, 1)), block=16)
    got = np.concatenate([normal.take(m) for m in sizes])
    want = np.stack([g.standard_normal((70, 3)) for g in ReplicaStreams([4, 9]).generators("noise")], axis=1)
    np.testing.assert_array_equal(got, want)
    blocks = np.concatenate([blocky.take(m) for m in sizes])
    steps = ReplicaStreams([4, 9]).per_step(
        "noise", lambda g, k: g.standard_normal((k, 2)) * g.uniform(size=(1, 1)), block=16)
    np.testing.assert_array_equal(blocks, np.stack([next(steps) for _ in range(70)]))


@needs_numba
def test_states_from_seeds_are_default_rngs():
    """`pcg64_states` computes default_rng([seed, purpose])'s PCG64 state without building it: the same state,
    for seeds across the 32-bit range and beyond it (there read from the generators)."""
    from dpsgd_cli.algorithms import _normals_numba as compiled

    assert compiled.seeding_matches()
    for seeds in ([0, 1, 2, 3, 999, 65536, 2**31 + 1, 2**32 - 1], [5, 2**32, 2**40 + 3]):
        for purpose in ("init", "sampling", "noise", "clip_count"):
            got = ReplicaStreams(seeds).pcg64_states(purpose)
            want = [compiled._state_array(g) for g in ReplicaStreams(seeds).generators(purpose)]
            np.testing.assert_array_equal(got, np.array(want))


def test_generators_are_default_rngs_built_when_used():
    seeds = [4, 0, 2**33 + 1]
    gens = ReplicaStreams(seeds).generators("noise")
    assert len(gens) == 3 and not gens._built  # nothing built until used
    assert np.zeros((len(gens), 2)).shape == make_model("logreg", 2, 0.0).init(gens).shape and not gens._built
    want = [np.random.default_rng([seed, 2]).standard_normal(5) for seed in seeds]
    assert all(np.array_equal(g.standard_normal(5), w) for g, w in zip(gens, want))
    assert gens[-1] is gens[2] and gens[1:] == [gens[1], gens[2]] and len(list(gens)) == 3
    with pytest.raises(IndexError):
        gens[3]
