"""L2-regularised logistic regression: ℓ(θ; x, y) = log(1 + exp(−y θ·x))."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import expit

from dpsgd_cli.compiled import optional_compiled
from dpsgd_cli.models.base import Batch, ClipNorm, Model, accuracy_of, logistic_loss
from dpsgd_cli.models.rows import cached_nonzeros


class LogisticRegression(Model):
    """Linear model; ∇ℓ = −y σ(−y θ·x) x, so ‖∇ℓ‖ = |residual|·‖x‖ and clipping needs no per-example gradients."""

    name = "logreg"
    convex = True
    stacked_metrics = True  # on float64 data, `logistic_metrics`: a θ's numbers do not depend on the θs beside it

    def lipschitz(self, x_max: float) -> float:
        return x_max  # |σ(·)| ≤ 1

    def smoothness(self, x_max: float) -> float:
        return x_max**2 / 4  # σ' ≤ 1/4

    @property
    def n_params(self) -> int:
        return self.d

    def init(self, generators: Sequence[np.random.Generator]) -> np.ndarray:
        return np.zeros((len(generators), self.d))

    def decision(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return theta @ X.T

    def data_loss(self, theta, X, y):
        return logistic_loss(self.decision(theta, X), y)

    def data_loss_and_accuracy(self, theta, X, y):
        """On float64 data, `logistic_metrics` (one pass over X for all θs); on float32 data, NumPy in float32."""
        if X.dtype != np.float64 or type(self).decision is not LogisticRegression.decision:
            return super().data_loss_and_accuracy(theta, X, y)
        return logistic_metrics(theta, X, y)

    def data_gradient(self, theta, X, y):
        return logistic_residual(self.decision(theta, X), y) @ X / X.shape[0]

    def _residual(self, theta: np.ndarray, batch: Batch) -> np.ndarray:
        return logistic_residual(np.matmul(batch.X, theta[:, :, None])[..., 0], batch.y)

    def per_example_grad_norms(self, theta, batch):
        return np.abs(self._residual(theta, batch)) * batch.x_norm

    def clipped_grad_sum(self, theta, batch, clip: ClipNorm):
        split = self._clipped_grad_sum_per_replica(theta, batch, clip)  # the product below is BLAS's: rounds by M
        if split is not None:
            return split
        residual = self._residual(theta, batch)
        if clip is None:
            return np.matmul((batch.weight * residual)[:, None, :], batch.X)[:, 0]
        scale = clipped_residual(residual, batch.x_norm, clip, batch.weight)
        return np.matmul(scale[:, None, :], batch.X)[:, 0]

    def hvp(self, theta, X, y, v):
        """∇²F(θ) v = (1/n) Σ σ'(m_i) (x_i·v) x_i + λv, m_i = θ·x_i, σ'(m) = σ(m)σ(−m) (y² = 1): (R, P)."""
        margin = self.decision(theta, X)  # (R, n)
        weight = expit(margin) * expit(-margin)
        return (weight * (v @ X.T)) @ X / X.shape[0] + self.l2 * v


MAX_ABS_SIGMOID_2ND = 1.0 / (6.0 * math.sqrt(3.0))  # max |σ''| of the logistic sigmoid, at σ = (3 ± √3)/6
HESSIAN_ROWS = 4096  # rows per block of `logistic_hessian` (bounds memory to R·block·d)


def margins(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    """θ_r·x for rows X shared (m, d) or per replica (R, m, d): (R, m)."""
    return theta @ X.T if X.ndim == 2 else np.matmul(X, theta[:, :, None])[..., 0]


def _weighted_gram(X: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Σ_i w_ri x_i x_iᵀ by BLAS for rows X shared (m, d) or per replica (R, m, d): (R, d, d)."""
    if X.ndim == 2:
        return np.matmul(X.T[None] * w[:, None, :], X)
    return np.matmul(np.swapaxes(X, 1, 2) * w[:, None, :], X)


def logistic_hessian(theta: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float, features=None) -> np.ndarray:
    """∇²F(θ) = (1/n) Σ σ'(y_i θ·x_i) x_i x_iᵀ + λI for every replica: (R, d, d); blocks of rows, no example loop.

    `features` (rows (m, d_in) → (R, m, d)) replaces each block of rows by per-replica features first: the output
    layer of an MLP is this logistic regression on ã = [a(x), 1] (`MLP.output_features`)."""
    n = X.shape[0]
    d = theta.shape[1]
    H = np.zeros((theta.shape[0], d, d))
    for start in range(0, n, HESSIAN_ROWS):
        Xc = X[start:start + HESSIAN_ROWS]
        if features is not None:
            Xc = features(Xc)
        m = margins(theta, Xc) * y[start:start + HESSIAN_ROWS]  # (R, chunk) margins
        w = expit(m) * expit(-m)  # σ'(m), symmetric in m
        H += _weighted_gram(Xc, w)
    H /= n
    H += l2 * np.eye(d)
    return H


def logistic_residual(margin: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dℓ/d(θ·x) = −y σ(−y θ·x) of the margins θ·x: ∇ℓ = residual · x."""
    return -y * expit(-y * margin)


def clipped_residual(residual: np.ndarray, x_norm: np.ndarray, clip: float | np.ndarray,
                     weight: np.ndarray | None = None) -> np.ndarray:
    """(weight ·) residual · min(1, C/‖∇ℓ‖), ‖∇ℓ‖ = |residual|·‖x‖ (safe at 0): the clipped gradient is this · x."""
    scale = residual if weight is None else weight * residual
    return scale * clip / np.maximum(np.abs(residual) * x_norm, clip)


# --- the metrics: mean logistic loss and accuracy of a stack of θs, one pass over the data ---------------------------


def logistic_metrics(theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean log(1 + exp(−y θ·x)) (K,), accuracy (K,)) of every θ (K, d) on (X (n, d), y (n,) in {−1, +1}), in
    float64, each θ's numbers in a fixed order (docs/design.md, bit-for-bit); without numba, the means by NumPy's
    pairwise sum (≤ ~1e-15 relative from the compiled ones)."""
    theta = np.asarray(theta, dtype=np.float64)
    X = np.asarray(X)
    y = np.ascontiguousarray(y, dtype=np.float64)
    if theta.ndim != 2 or X.ndim != 2 or theta.shape[1] != X.shape[1] or y.shape != X.shape[:1]:
        raise ValueError(f"logistic_metrics: expected theta (K, d), X (n, d), y (n,); got theta {theta.shape}, "
                         f"X {X.shape}, y {y.shape}")
    compiled = optional_compiled("models._logreg_numba")  # None (numba missing or broken): NumPy
    if compiled is None:
        return _numpy_metrics(theta, X, y)
    K, n = theta.shape[0], X.shape[0]
    hi, lo, correct = np.zeros(K), np.zeros(K), np.zeros(K, dtype=np.int64)
    thetaT = np.ascontiguousarray(theta.T)
    nonzeros = _row_nonzeros(X)
    if nonzeros is None:
        compiled.dense_metrics(thetaT, np.ascontiguousarray(X, dtype=np.float64), y, hi, lo, correct)
    else:
        compiled.sparse_metrics(thetaT, nonzeros.cols, nonzeros.vals, nonzeros.nnz, y, hi, lo, correct)
    total = np.where(np.isfinite(hi), hi + lo, hi)  # an infinite or NaN sum stays as summed (lo is NaN then)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / n, correct / n


def _numpy_metrics(theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`logistic_metrics` without numba: the kernel's margins, rows in chunks that stay in cache."""
    margin = np.empty((theta.shape[0], X.shape[0]))
    for start in range(0, X.shape[0], _CHUNK_ROWS):
        columns = np.ascontiguousarray(X[start:start + _CHUNK_ROWS].T, dtype=np.float64)  # (d, rows)
        out = margin[:, start:start + columns.shape[1]]
        out[:] = 0.0
        for j in range(columns.shape[0]):
            out += theta[:, j, None] * columns[j]
    with np.errstate(all="ignore"):
        return logistic_loss(margin, y), accuracy_of(margin, y)


_CHUNK_ROWS = 8192  # rows per chunk: 2× faster than 2048 on adult (K = 24)




def _row_nonzeros(X: np.ndarray):
    """`RowNonzeros.of(X)` (None: too dense) for float64 X, kept per read-only X (`rows.per_array`); a writeable X
    is read densely (the same numbers)."""
    if X.flags.writeable or X.dtype != np.float64:
        return None
    return cached_nonzeros(X)
