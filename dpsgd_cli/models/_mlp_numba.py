"""The numba code of the MLP's row-sparse mini-batch products (models/mlp.py; imported on first use: numba is
optional). Each batch row is read from the dataset's nonzeros (`sampling.RowNonzeros`: column order, padded with
zeros to a multiple of 4), so a one-hot row costs its nonzeros, not d. Every replica's sums run in one fixed
order whatever the number of replicas, so a replica's numbers never depend on the others trained beside it:
z_k = ((v₀w₀ + v₁w₁) + (v₂w₂ + v₃w₃)) + … over a row's nonzeros 4 at a time (4 weight rows per load and store of
the accumulator), then + b₁; the weight gradient row by row in batch order. The hidden axis is padded to a
multiple of 32 in the kernels' own buffers (LLVM vectorises the loops 8 lanes × 4 and would run a remainder,
104 = 3·32 + 8, one number at a time).
"""

import numba
import numpy as np

LANES = 32


@numba.njit(cache=True, nogil=True)
def hidden(cols, vals, nnz, rows, W1, b1, z):
    """z[r, i] = W₁[r] x_{rows[r, i]} + b₁[r] for every replica r and batch row i; W₁ (R, h, d), b₁ (R, h),
    z (R, M, h) (written)."""
    R, M = rows.shape
    h, d = W1.shape[1], W1.shape[2]
    hp = -(-h // LANES) * LANES
    WT = np.zeros((d, hp), dtype=z.dtype)
    acc = np.empty(hp, dtype=z.dtype)
    for r in range(R):
        for k in range(h):
            for j in range(d):
                WT[j, k] = W1[r, k, j]
        for i in range(M):
            row = rows[r, i]
            acc[:] = 0.0
            for s in range(0, nnz[row], 4):
                w0, w1, w2, w3 = WT[cols[row, s]], WT[cols[row, s + 1]], WT[cols[row, s + 2]], WT[cols[row, s + 3]]
                v0, v1, v2, v3 = vals[row, s], vals[row, s + 1], vals[row, s + 2], vals[row, s + 3]
                for k in range(hp):
                    acc[k] += (v0 * w0[k] + v1 * w1[k]) + (v2 * w2[k] + v3 * w3[k])
            for k in range(h):
                z[r, i, k] = acc[k] + b1[r, k]


@numba.njit(cache=True, nogil=True)
def backward(cols, vals, nnz, rows, delta, coef, a, gW1, gb1, gw2, gb2):
    """The batch's sums, row by row in batch order (padding rows, weight 0, add zeros): W₁'s Σ_i δ_i x_iᵀ (R, h, d),
    b₁'s Σ_i δ_i, w₂'s Σ_i coef_i a_i, b₂'s Σ_i coef_i (written); δ, a (R, M, h), coef (R, M)."""
    R, M = rows.shape
    h, d = gW1.shape[1], gW1.shape[2]
    hp = -(-h // LANES) * LANES
    G = np.empty((d, hp), dtype=gW1.dtype)
    dl = np.zeros(hp, dtype=gW1.dtype)
    for r in range(R):
        G[:, :] = 0.0
        gb1[r, :] = 0.0
        gw2[r, :] = 0.0
        gb2[r] = 0.0
        for i in range(M):
            row = rows[r, i]
            c = coef[r, i]
            gb2[r] += c
            for k in range(h):
                dl[k] = delta[r, i, k]
                gb1[r, k] += dl[k]
                gw2[r, k] += c * a[r, i, k]
            for s in range(nnz[row]):
                g = G[cols[row, s]]
                v = vals[row, s]
                for k in range(hp):
                    g[k] += v * dl[k]
        for k in range(h):
            for j in range(d):
                gW1[r, k, j] = G[j, k]
