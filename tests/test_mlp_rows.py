"""The MLP's row-sparse compiled products (models/_mlp_numba.py, used by `sgd`/`dp_sgd` chains with backend auto
or numba on data whose rows are mostly zeros): the same gradients as the dense NumPy path (rtol 1e-12 in float64)
and as the naive per-example loop, whole runs equal to backend numpy, and a replica's run independent of the
others bit for bit. Also the numba fill of the noise streams: the same numbers as NumPy's, bit for bit."""

import numpy as np
import pytest
from test_mlp import naive_per_example

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.algorithms.base import Setting
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model
from dpsgd_cli.models.rows import RowNonzeros, gather, row_norms

pytestmark = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed (pip install 'dpsgd[numba]')")


def one_hot_data(n=240, seed=0, dtype=np.float64):
    """2 continuous columns and 3 one-hot groups of sizes 8, 10, 14 (d = 34, 5 nonzeros per row), rows in the unit
    ball, as the tabular datasets are."""
    rng = np.random.default_rng(seed)
    parts = [rng.uniform(-1, 1, size=(n, 2))]
    for size in (8, 10, 14):
        parts.append(np.eye(size)[rng.integers(0, size, n)])
    X = np.hstack(parts)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.where(X[:, 0] + X[:, 3] - X[:, 12] + 0.3 * rng.standard_normal(n) > 0, 1.0, -1.0)
    return X.astype(dtype), y.astype(dtype)


def batch_of(X, y, idx):
    return gather(X, y, row_norms(X), idx, lambda: RowNonzeros.of(X))


@pytest.mark.parametrize("activation", ["tanh", "sigmoid", "relu"])
@pytest.mark.parametrize("clip", [None, 0.2])
def test_row_sparse_gradient_equals_the_dense_path_and_the_naive_loop(activation, clip):
    X, y = one_hot_data()
    model = make_model("mlp", X.shape[1], 1e-3, {"hidden": 37, "activation": activation})  # 37: not a multiple of 32
    rng = np.random.default_rng(1)
    theta = rng.normal(size=(3, model.n_params))
    idx = rng.integers(0, len(X), size=(3, 29))
    idx[1, 20:] = -1  # padding
    batch = batch_of(X, y, idx)
    assert RowNonzeros.of(X) is not None
    got = model.clipped_grad_sum(theta, batch, clip)
    dense = model.clipped_grad_sum(theta, batch.plain(), clip)
    np.testing.assert_allclose(got, dense, rtol=1e-12, atol=1e-14)
    assert not np.array_equal(got, dense) or activation == "relu"  # really another path (another summation order)
    if clip is None:  # against the per-example gradients written out from the definition (FD-checked in test_mlp)
        per = naive_per_example(model, theta, X, y)
        naive = np.stack([per[r, np.maximum(idx[r], 0)][idx[r] >= 0].sum(axis=0) for r in range(3)])
        np.testing.assert_allclose(got, naive, rtol=1e-10, atol=1e-12)


def test_float32_row_sparse_gradient_is_close_to_float64():
    X, y = one_hot_data()
    model = make_model("mlp", X.shape[1], 1e-3, {"hidden": 9})
    theta = np.random.default_rng(2).normal(size=(2, model.n_params))
    idx = np.random.default_rng(3).integers(0, len(X), size=(2, 40))
    g64 = model.clipped_grad_sum(theta, batch_of(X, y, idx), 0.5)
    g32 = model.clipped_grad_sum(theta.astype(np.float32), batch_of(X.astype(np.float32), y.astype(np.float32), idx),
                                 0.5)
    assert g32.dtype == np.float32
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-5)


def test_dense_rows_keep_the_blas_path():
    X = np.random.default_rng(0).normal(size=(50, 8))
    assert RowNonzeros.of(X) is None
    X[:, 1:] = 0.0  # 1 nonzero, padded to GROUP = 8: 8 of 16 columns, above MAX_DENSITY
    assert RowNonzeros.of(np.hstack([X, np.zeros((50, 8))])) is None
    assert RowNonzeros.of(np.hstack([X, np.zeros((50, 24))])) is not None  # 8 of 32: at MAX_DENSITY


def _setting(n, d, **kw):
    return Setting(**{**dict(n=n, d=d, delta=1e-5, l2=1e-3, epsilon=2.0, batch_size=24, lr=0.5, epochs=2,
                             clip_norm=0.5), **kw})


@pytest.mark.parametrize("name", ["sgd", "dp_sgd"])
def test_runs_equal_backend_numpy_and_replicas_are_independent_bit_for_bit(name):
    X, y = one_hot_data()
    model = make_model("mlp", X.shape[1], 1e-3, {"hidden": 11})
    setting = _setting(*X.shape)
    auto = ALGORITHMS[name]().fit(setting, model, X, y, ReplicaStreams([0, 4, 9])).theta
    numpy = ALGORITHMS[name]({"backend": "numpy"}).fit(setting, model, X, y, ReplicaStreams([0, 4, 9])).theta
    np.testing.assert_allclose(auto, numpy, rtol=1e-12, atol=1e-13)
    assert not np.array_equal(auto, numpy)  # the compiled products ran
    alone = ALGORITHMS[name]().fit(setting, model, X, y, ReplicaStreams([4])).theta
    assert np.array_equal(auto[1], alone[0])  # M, the padded batch width, differs: the kernel's sums do not care


def test_chain_reports_the_compiled_rows_it_ran_on():
    """`ran_on` (a run's `backend`) names the row-sparse kernels when the MLP's step read the rows compiled."""
    X, y = one_hot_data()
    model = make_model("mlp", X.shape[1], 1e-3, {"hidden": 11})
    setting = _setting(*X.shape)
    for backend, expected in (("auto", "numba-rows"), ("numpy", "numpy")):
        prepared = ALGORITHMS["dp_sgd"]({"backend": backend}).prepare(setting, model, X, y, ReplicaStreams([0, 4]))
        prepared.chain.run(model, np.zeros((2, model.n_params)), 3)
        assert prepared.chain.ran_on == expected
    dense = np.random.default_rng(0).uniform(-1, 1, size=X.shape) / np.sqrt(X.shape[1])  # no zeros: the dense path
    prepared = ALGORITHMS["dp_sgd"]().prepare(setting, model, dense, y, ReplicaStreams([0]))
    prepared.chain.run(model, np.zeros((1, model.n_params)), 3)
    assert prepared.chain.ran_on == "numpy"


def test_numba_noise_fill_equals_numpy_draws(monkeypatch):
    streams = ReplicaStreams([0, 3, 11])
    fast = streams.normal("noise", (7, 3))
    got = [next(fast) for _ in range(150)]  # across block boundaries (64 steps a block)
    monkeypatch.setattr(compiled, "HAVE_NUMBA", False)
    slow = streams.normal("noise", (7, 3))
    want = [next(slow) for _ in range(150)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and got[0].shape == (3, 7, 3)


def test_row_nonzeros_numba_equals_numpy(monkeypatch):
    X, _ = one_hot_data(n=50)
    X[3] = 0.0  # an empty row
    X[7, :] = 0.5  # a full row: K = d rounded up to 4
    fast = RowNonzeros.of(np.hstack([X, np.zeros((50, 150))]))
    monkeypatch.setattr(compiled, "HAVE_NUMBA", False)
    slow = RowNonzeros.of(np.hstack([X, np.zeros((50, 150))]))
    for name in ("cols", "vals", "nnz"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert fast.nnz[3] == 0 and fast.nnz[7] == 40 and fast.nnz[0] == 8  # 0, 34 and 5 rounded up to 8s
    assert np.array_equal(fast.cols[0, :5], np.flatnonzero(X[0])) and not fast.vals[0, 5:].any()


def test_fused_epsilon_axis_equals_each_cell_alone_bit_for_bit():
    from dpsgd_cli.algorithms.chain import train_together
    from dpsgd_cli.algorithms.streams import SharedStreams

    X, y = one_hot_data(dtype=np.float32)
    model, seeds = make_model("mlp", X.shape[1], 1e-3, {"hidden": 7}), [2, 5]
    settings = [_setting(*X.shape, epsilon=eps) for eps in (0.5, 4.0)]
    streams = SharedStreams(seeds)
    prepared = [ALGORITHMS["dp_sgd"]().prepare(s, model, X, y, streams) for s in settings]
    streams.close()
    for s, outcome in zip(settings, train_together(model, prepared)):
        alone = ALGORITHMS["dp_sgd"]().fit(s, model, X, y, ReplicaStreams(seeds))
        assert outcome.theta.dtype == np.float32 and np.array_equal(outcome.theta, alone.theta)


def test_kernels_sum_in_the_documented_order_bit_for_bit():
    """hidden: z_k = ((0 + group₀) + group₁ + …) + b_k, each group ((v₀w₀ + v₁w₁) + (v₂w₂ + v₃w₃)) + ((…) + (…));
    backward: row by row in batch order from 0, δ_i = u_i · coef_i; all in float32 (rows of 0, 1, 2 and 3 groups)."""
    from dpsgd_cli.models import _mlp_numba as compiled

    f = np.float32
    rng = np.random.default_rng(3)
    n, d, h, R, M = 12, 30, 3, 2, 6
    X = np.zeros((n, d), f)
    for i, k in enumerate([0, 3, 8, 9, 17, 20] * 2):
        X[i, rng.choice(d, k, replace=False)] = rng.normal(size=k)
    rows = RowNonzeros.of(X, max_density=1.0).take(rng.permutation(n)[: R * M].reshape(R, M))
    cols, vals, nnz = rows
    WT, b1 = rng.normal(size=(R, d, h)).astype(f), rng.normal(size=(R, h)).astype(f)
    u, a, coef = (rng.normal(size=s).astype(f) for s in ((R, M, h), (R, M, h), (R, M)))
    z = np.empty((R, M, h), f)
    compiled.hidden(*rows, WT, b1, z)
    G, gb1, gw2, gb2 = np.empty((R, d, h), f), np.empty((R, h), f), np.empty((R, h), f), np.empty(R, f)
    compiled.backward(*rows, u, coef, a, G, gb1, gw2, gb2)
    for r in range(R):
        want_G, want_b1, want_w2, want_b2 = np.zeros((d, h), f), np.zeros(h, f), np.zeros(h, f), f(0)
        for i in range(M):
            for k in range(h):
                acc = f(0)
                for s in range(0, int(nnz[r, i]), 8):
                    p = [vals[r, i, s + j] * WT[r, cols[r, i, s + j], k] for j in range(8)]
                    acc = acc + (((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])))
                assert (acc + b1[r, k]).tobytes() == z[r, i, k].tobytes()
            c = coef[r, i]
            delta = u[r, i] * c
            want_b2 = want_b2 + c
            want_b1, want_w2 = want_b1 + delta, want_w2 + c * a[r, i]
            for s in range(int(nnz[r, i])):
                if vals[r, i, s] != 0:
                    want_G[cols[r, i, s]] += vals[r, i, s] * delta
        assert np.array_equal(G[r], want_G) and np.array_equal(gb1[r], want_b1)
        assert np.array_equal(gw2[r], want_w2) and want_b2.tobytes() == gb2[r].tobytes()


def test_scratch_is_reused_per_name_and_thread_and_grows():
    import threading

    from dpsgd_cli.models.mlp import _scratch

    a = _scratch("test", (2, 3), np.float32)
    b = _scratch("test", (3, 2), np.float32)
    assert b.shape == (3, 2) and b.flags.c_contiguous and np.shares_memory(a, b)
    assert not np.shares_memory(a, _scratch("test", (2, 3), np.float64))  # per dtype
    big = _scratch("test", (50, 50), np.float32)
    assert big.shape == (50, 50) and not np.shares_memory(a, big)
    other = []
    thread = threading.Thread(target=lambda: other.append(_scratch("test", (50, 50), np.float32)))
    thread.start()
    thread.join()
    assert not np.shares_memory(big, other[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_clip_coefficients_equal_numpys(dtype):
    """`_mlp_numba.clipped_coefficients` (after scipy's expit) gives `mlp._coefficients`' numbers, zeros' signs
    included, and NaN where it has NaN (diverged replicas: NaN and ±inf logits and norms)."""
    from scipy.special import expit

    from dpsgd_cli.models import _mlp_numba as compiled
    from dpsgd_cli.models.mlp import _coefficients

    rng = np.random.default_rng(1)
    R, M = 4, 500
    y = np.where(rng.random((R, M)) > 0.5, 1.0, -1.0).astype(dtype)
    f = (rng.normal(size=(R, M)) * 6).astype(dtype)
    w = (rng.random((R, M)) > 0.1).astype(dtype)  # padding rows: weight 0
    x_norm, aa, uu = (rng.random((R, M)) * s for s in (2, 50, 3))
    f[0, :4], uu[1, :2], aa[2, :2] = [np.nan, np.inf, -np.inf, 200], [np.inf, np.nan], [np.inf, 0]
    x_norm, aa, uu = (v.astype(dtype) for v in (x_norm, aa, uu))
    for clip in (0.1, 1.0, 3.7):
        want = _coefficients(y, f, w, clip, x_norm, (aa, uu))
        got = np.empty_like(f)
        compiled.clipped_coefficients(-y, expit(-y * f), w, x_norm, aa, uu, dtype(1), dtype(clip), got)
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).any()
        ok = ~np.isnan(want)
        assert np.array_equal(got[ok], want[ok]) and np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
