"""The numba code of logistic regression's metrics (`models/logreg.py::logistic_metrics`; imported on first use: numba
is optional): one pass over X for every θ of a stack, in a fixed order (docs/design.md, bit-for-bit). A row read by
its nonzeros gives the dense row's margin bit for bit: the skipped terms are ±0, and m + (±0) = m for an m that
starts at +0 (round to nearest never makes −0 from a sum with a +0 operand) — for finite θ.
"""

import math

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, inline="always", error_model="numpy")
def residual_from_exp(y, e):  # pragma: no cover
    """∂ℓ/∂m of the logistic loss ℓ = log(1 + e^{−y m}) from e = e^{y m}: −y σ(−y m) = −y / (1 + e^{y m}), so that
    ∇ℓ = (∂ℓ/∂m) x (as `LogisticRegression`'s `−y expit(−y m)`). The exp is the caller's: libm's, or the kernels'
    lane-friendly `exp_fixed`."""
    return -y * (1.0 / (1.0 + e))


@numba.njit(cache=True, nogil=True, inline="always", error_model="numpy")
def clip_residual(a, x_norm, clip):  # pragma: no cover
    """The residual a scaled so that the per-example gradient a·x has norm ≤ clip (‖a x‖ = |a|·‖x‖)."""
    return a * clip / max(abs(a) * x_norm, clip)


@numba.njit(cache=True, nogil=True, inline="always")
def _log1p_exp(z):  # pragma: no cover
    """log(1 + eᶻ) = max(z, 0) + log1p(e^−|z|) without overflow (as NumPy's `logaddexp(0, z)`), with log1p(u) =
    log(w)·u/(w − 1), w = 1 + u (Goldberg 1991, "What every computer scientist should know about floating-point
    arithmetic", Thm 4: relative error ≤ 5ε): cheaper than glibc's log1p."""
    u = math.exp(-abs(z))
    w = 1.0 + u
    log1p = u if w == 1.0 else math.log(w) * (u / (w - 1.0))
    return log1p + (z if z > 0.0 else 0.0)  # NaN stays NaN (log1p is NaN)


@numba.njit(cache=True, nogil=True, inline="always")
def _add_row(margin, y, hi, lo, correct, terms):  # pragma: no cover
    """Add row i's terms for every θ_k: loss log(1 + exp(−y m)) into (hi, lo) by TwoSum (Knuth, TAOCP 2 §4.2.2,
    Thm B; Ogita, Rump & Oishi 2005, Alg. 4.4 `Sum2`: the sum as if in twice the working precision, then rounded),
    and 1 into `correct` when sign(m) = y (m = 0 counts as +1, as `base.accuracy_of`). `terms` (K,) is scratch:
    the libm calls apart from the sums let LLVM vectorise the sums."""
    K = margin.shape[0]
    for k in range(K):  # scalar libm calls
        terms[k] = _log1p_exp(-y * margin[k])
    for k in range(K):
        term = terms[k]
        s = hi[k] + term
        b = s - hi[k]
        lo[k] += (hi[k] - (s - b)) + (term - b)
        hi[k] = s
        correct[k] += 1 if (1.0 if margin[k] >= 0.0 else -1.0) == y else 0


@numba.njit(cache=True, nogil=True)
def dense_metrics(thetaT, X, y, hi, lo, correct):  # pragma: no cover
    """Accumulate every θ's loss sum and correct count over the rows of X (n, d); θᵀ (d, K); hi, lo, correct (K,)."""
    n, d = X.shape
    margin, terms = np.empty(thetaT.shape[1]), np.empty(thetaT.shape[1])
    for i in range(n):
        margin[:] = 0.0
        for j in range(d):
            x = X[i, j]
            w = thetaT[j]
            for k in range(margin.shape[0]):
                margin[k] += w[k] * x
        _add_row(margin, y[i], hi, lo, correct, terms)


@numba.njit(cache=True, nogil=True)
def sparse_metrics(thetaT, cols, vals, nnz, y, hi, lo, correct):  # pragma: no cover
    """As `dense_metrics`, each row i given by its nonzeros cols[i, :nnz[i]], vals[i, :nnz[i]] in column order."""
    n = nnz.shape[0]
    margin, terms = np.empty(thetaT.shape[1]), np.empty(thetaT.shape[1])
    for i in range(n):
        margin[:] = 0.0
        for s in range(nnz[i]):
            x = vals[i, s]
            w = thetaT[cols[i, s]]
            for k in range(margin.shape[0]):
                margin[k] += w[k] * x
        _add_row(margin, y[i], hi, lo, correct, terms)
