"""Logistic regression's metrics kernel (`logreg.logistic_metrics`): the NumPy formulas' numbers, and each θ's in a
fixed order (stacked or alone, sparse or dense rows, with or without numba)."""

from types import SimpleNamespace

import numpy as np
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.engine import runner
from dpsgd_cli.models import LogisticRegression, logreg
from dpsgd_cli.models.base import accuracy_of, logistic_loss

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed (pip install 'dpsgd[numba]')")


def one_hot_like(n: int, d: int, seed: int, read_only: bool = True):
    """Rows like adult's: a few continuous columns and one-hot blocks (~15% nonzeros), labels ±1."""
    rng = np.random.default_rng(seed)
    X = np.zeros((n, d))
    X[:, :3] = rng.normal(size=(n, 3))
    for start in range(3, d, 8):
        X[np.arange(n), start + rng.integers(0, min(8, d - start), size=n)] = 1.0
    y = np.where(rng.random(n) < 0.4, 1.0, -1.0)
    X.flags.writeable = not read_only
    return X, y


def thetas(K: int, d: int, seed: int):
    """Small and huge margins (log(1 + eᶻ) for z up to ~±1000), and θ = 0 (margin 0 counts as +1)."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(K, d)) * np.geomspace(0.01, 300.0, K)[:, None]
    theta[0] = 0.0
    return theta


@pytest.fixture(params=["numba", "numpy"])
def backend(request, monkeypatch):
    if request.param == "numba" and not compiled.HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setattr(compiled, "HAVE_NUMBA", request.param == "numba")
    return request.param


def test_equals_the_numpy_formulas(backend):
    X, y = one_hot_like(3000, 43, seed=0)
    theta = thetas(7, 43, seed=1)
    loss, accuracy = logreg.logistic_metrics(theta, X, y)
    decision = theta @ X.T
    np.testing.assert_allclose(loss, logistic_loss(decision, y), rtol=1e-13, atol=0)
    np.testing.assert_array_equal(accuracy, accuracy_of(decision, y))
    assert loss[0] == pytest.approx(np.log(2.0), rel=1e-15) and accuracy[0] == np.mean(y == 1.0)  # θ = 0: predicts +1


@needs_numba
def test_one_pass_numbers_do_not_depend_on_the_stack_nor_the_row_format():
    X, y = one_hot_like(2000, 43, seed=2)
    assert logreg._row_nonzeros(X) is not None  # read by its nonzeros
    theta = thetas(24, 43, seed=3)
    stacked = logreg.logistic_metrics(theta, X, y)
    alone = [logreg.logistic_metrics(theta[k:k + 1], X, y) for k in range(24)]
    dense = logreg.logistic_metrics(theta, X.copy(), y)  # writeable: read densely
    for got in (tuple(np.concatenate(parts) for parts in zip(*alone)), dense):
        for a, b in zip(got, stacked):
            np.testing.assert_array_equal(a, b)  # bit for bit


@needs_numba
def test_the_numpy_path_has_the_same_margins(monkeypatch):
    X, y = one_hot_like(2000, 43, seed=4)
    theta = thetas(5, 43, seed=5)
    fast = logreg.logistic_metrics(theta, X, y)
    monkeypatch.setattr(compiled, "HAVE_NUMBA", False)
    numpy = logreg.logistic_metrics(theta, X, y)
    np.testing.assert_array_equal(numpy[1], fast[1])
    np.testing.assert_allclose(numpy[0], fast[0], rtol=1e-15, atol=0)


@needs_numba
def test_log1p_exp_is_logaddexp_to_a_few_ulp():
    from dpsgd_cli.models._logreg_numba import _log1p_exp

    z = np.concatenate([np.linspace(-50, 50, 20001), [0.0, -0.0, 1e-300, -1e-300, 37.0, -745.0, 709.0, 800.0,
                                                      -800.0, 1e308]])
    got = np.array([_log1p_exp(v) for v in z])
    want = np.logaddexp(0.0, z)
    np.testing.assert_allclose(got, want, rtol=4 * np.finfo(float).eps, atol=0)
    assert _log1p_exp(np.inf) == np.inf and _log1p_exp(-np.inf) == 0.0 and np.isnan(_log1p_exp(np.nan))


def test_a_fused_task_gets_each_cells_metrics_of_it_alone(backend):
    """`runner._stacked_metrics` (one call for the task) equals `_metrics` per cell, bit for bit, objective too."""
    X, y = one_hot_like(1500, 43, seed=6)
    X_test, y_test = one_hot_like(700, 43, seed=7)
    data = SimpleNamespace(X_train=X, y_train=y, X_test=X_test, y_test=y_test, X_val=X_test[:300], y_val=y_test[:300])
    model = LogisticRegression(43, l2=1e-3)
    cells = {f"c{c}": thetas(3, 43, seed=10 + c) for c in range(4)}
    fused = runner._stacked_metrics(model, data, 0.25, cells)
    for cell_id, theta in cells.items():
        alone = runner._metrics(model, theta, data, 0.25)
        assert fused[cell_id].keys() == alone.keys() >= {"train_objective", "test_loss", "val_accuracy"}
        for key in alone:
            np.testing.assert_array_equal(fused[cell_id][key], alone[key], err_msg=key)


def test_bad_shapes_are_refused():
    X, y = one_hot_like(10, 11, seed=8)
    with pytest.raises(ValueError, match="theta"):
        logreg.logistic_metrics(np.zeros((2, 12)), X, y)
    with pytest.raises(ValueError, match="y"):
        logreg.logistic_metrics(np.zeros((2, 11)), X, y[:5])


def test_erm_rows_have_an_optimality_gap_of_exactly_zero(write_grid, tmp_path):
    """L* is F(θ*) evaluated as the rows' objectives are, so erm (θ = θ*) has gap 0, not ±1 ulp of F."""
    import pandas as pd

    from dpsgd_cli.config import load_grid_file
    from dpsgd_cli.engine import execute, plan_grid

    grid = load_grid_file(write_grid("""
        grids:
          - name: gap
            datasets: [{name: synthetic, n: 1000, dim: 3}]
            models: [logreg]
            algorithms: [erm]
            l2: [0.001, 0.01]  # 0.01: L-BFGS's F(θ*) is 1 ulp above the rows' (found by trying)
            seeds: 2
        """)).grids[0]
    execute(plan_grid(grid, tmp_path / "out"))
    rows = pd.read_csv(tmp_path / "out" / "gap" / "runs.csv")
    assert len(rows) == 4 and (rows["optimality_gap"] == 0.0).all()
