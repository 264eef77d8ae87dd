"""The numba code of the full-batch backend (backends.py; imported on first use: numba is optional).
Module-level functions, so numba's on-disk cache finds them again.

Columns are the (chain, replica) pairs of one call, padded to a multiple of LANES. Every column's numbers are
computed by the same sequence of IEEE operations whatever its position and the number of columns: its dot
product is a plain sum over the features in order, its gradient a plain sum over the rows in order, and the loops
across columns are elementwise (vectorised across columns by LLVM without reassociating anything; no fast-math,
so no contraction of a multiply and an add either). Hence a replica's run does not depend on what shares the call.
"""

import numba
import numpy as np

from dpsgd_cli.algorithms._tail_numba import adaptive_release, fixed_rows, tail
from dpsgd_cli.models._logreg_numba import clip_residual, residual_from_exp

LANES = 8  # the columns are padded to a multiple of this (whole vectors)
ROWS = 4  # rows per block of the gradient (written out below: G[j, k] + a_0 x_0 + … + a_3 x_3, left to right)


@numba.njit(cache=True, nogil=True)
def _dots(TH, X, i, S):  # pragma: no cover
    """S_k = Σ_j X[i, j] TH[j, k], each column's sum in feature order (the loop across columns is elementwise)."""
    d, K = TH.shape
    for k in range(K):
        S[k] = 0.0
    for j in range(d):
        xj = X[i, j]
        for k in range(K):
            S[k] += xj * TH[j, k]


@numba.njit(cache=True, nogil=True)
def _add_rows4(G, A, X, i):  # pragma: no cover
    """G[:, k] += A[q, k] X[i + q] for q = 0..3, added one after the other (as four `_add_row`), G read once."""
    d, K = G.shape
    for j in range(d):
        x0 = X[i, j]
        x1 = X[i + 1, j]
        x2 = X[i + 2, j]
        x3 = X[i + 3, j]
        for k in range(K):
            G[j, k] = (((G[j, k] + A[0, k] * x0) + A[1, k] * x1) + A[2, k] * x2) + A[3, k] * x3


@numba.njit(cache=True, nogil=True)
def _add_row(G, A, q, X, i):  # pragma: no cover
    d, K = G.shape
    for j in range(d):
        xj = X[i, j]
        for k in range(K):
            G[j, k] += A[q, k] * xj


@numba.njit(cache=True, nogil=True)
def gd_logreg(TH, X, y, x_norm, clip, do_clip, codes, vals, slot, rep, noise, lrs, active, G, S, A, M1,
              M2, counts, count_slot, adapt, U, fixed):  # pragma: no cover
    """m full-batch steps (m = lrs.shape[1]) of every column of TH (d, K), K a multiple of LANES, in place:

        for each row i (in order):  s_k = Σ_j x_ij θ_jk (j in order);  a_k = −y_i σ(−y_i s_k);
                                    u_k += 1[|a_k|‖x_i‖ ≤ C_k];
                                    a_k ← a_k C_k / max(|a_k|‖x_i‖, C_k) (if do_clip_k);  g_jk += a_k x_ij
        then per column: the rows of fixed gradient (`_tail_numba.fixed_rows`), an adaptive clip's
        `adaptive_release` (count_slot_k ≥ 0: its count's noise counts[count_slot_k, t, rep_k], its fields adapt[k];
        C_k moved in place), the tail program (codes[k], vals[k]) with z = noise[slot_k, t, rep_k, :] (none: slot < 0).
    G (d, K), S (K,), A (ROWS, K) and U (K,) are scratch. fixed: the rows of fixed gradient
    (`models.base.FixedGradients`) as (fcounts (m,): X's rows of each, weight (R, m), idx, val, raw norm,
    proj (steps, K, m) out), fcounts empty when there are none."""
    d, K = TH.shape
    n = X.shape[0]
    m = lrs.shape[1]
    fcounts, fweight, fidx, fval, fraw, fproj = fixed
    has_fixed = fcounts.shape[0] > 0
    for t in range(m):
        for j in range(d):
            for k in range(K):
                G[j, k] = 0.0
        for k in range(K):
            U[k] = 0.0
        i = 0
        while i < n:  # blocks of ROWS rows: their dot products, then their gradient (G read once a block)
            rows = min(ROWS, n - i)
            for q in range(rows):
                _dots(TH, X, i + q, S)
                yi = y[i + q]
                xn = x_norm[i + q]
                for k in range(K):
                    a = residual_from_exp(yi, np.exp(yi * S[k]))
                    U[k] += 1.0 if abs(a) * xn <= clip[k] else 0.0
                    if do_clip[k]:
                        a = clip_residual(a, xn, clip[k])
                    A[q, k] = a
            if rows == ROWS:
                _add_rows4(G, A, X, i)
            else:
                for q in range(rows):
                    _add_row(G, A, q, X, i + q)
            i += rows
        for k in range(K):
            if active[k]:
                s = slot[k]
                z = noise[max(s, 0), min(t, noise.shape[1] - 1), min(rep[k], noise.shape[2] - 1)]
                if has_fixed:
                    fixed_rows(TH[:, k], G[:, k], fcounts, fweight[rep[k]], fidx, fval, fraw, clip[k], do_clip[k],
                               fproj[t, k])
                if count_slot[k] >= 0:
                    clip[k] = adaptive_release(G[:, k], z, clip[k], U[k], n, counts[count_slot[k], t, rep[k]],
                                               adapt[k])
                tail(TH[:, k], G[:, k], codes[k], vals[k], z, s >= 0, lrs[k, t], M1[k], M2[k])
    return TH
