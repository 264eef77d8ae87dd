"""The numba code of the MLP's row-sparse mini-batch products (models/mlp.py; imported on first use: numba is
optional). Each batch row is given by its nonzeros (gathered by NumPy first: ~1.7× faster than the kernels reading
the dataset), so a one-hot row costs its nonzeros, not d (adult: 14 of 104). Every replica's sums run in one fixed
order whatever R and M: z_k = ((v₀w₀ + v₁w₁) + (v₂w₂ + v₃w₃)) + ((v₄w₄ + v₅w₅) + (v₆w₆ + v₇w₇)) + … over a row's
nonzeros 8 at a time (4 was 1.35× slower in float64), then + b₁; the gradient's sums row by row in batch order.
All arrays C-contiguous (LLVM vectorises the loops over the hidden units only on unit strides).
"""

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def hidden(cols, vals, nnz, WT, b1, z):
    """z[r, i] = W₁[r] x_i + b₁[r] for every replica r and batch row i, x_i's nonzeros cols, vals (R, M, K),
    nnz (R, M); W₁ᵀ (R, d, h), b₁ (R, h), z (R, M, h) (written). Each z_k is ((0 + group₀) + group₁ + …) + b_k in
    z's dtype; the zero start and the bias are added in the first and last group's pass (one pass over z_i for
    adult's two groups, not four: the same operations, ~20% faster)."""
    R, M = nnz.shape
    h = z.shape[2]
    zero = np.zeros(1, dtype=z.dtype)[0]
    for r in range(R):
        W, b = WT[r], b1[r]
        for i in range(M):
            out = z[r, i]
            n = nnz[r, i]
            if n == 0:
                for k in range(h):
                    out[k] = zero + b[k]
            for s in range(0, n, 8):
                w0, w1, w2, w3 = W[cols[r, i, s]], W[cols[r, i, s + 1]], W[cols[r, i, s + 2]], W[cols[r, i, s + 3]]
                w4, w5, w6, w7 = W[cols[r, i, s + 4]], W[cols[r, i, s + 5]], W[cols[r, i, s + 6]], W[cols[r, i, s + 7]]
                v0, v1, v2, v3 = vals[r, i, s], vals[r, i, s + 1], vals[r, i, s + 2], vals[r, i, s + 3]
                v4, v5, v6, v7 = vals[r, i, s + 4], vals[r, i, s + 5], vals[r, i, s + 6], vals[r, i, s + 7]
                first, last = s == 0, s + 8 >= n
                if first and last:
                    for k in range(h):
                        out[k] = (zero + (((v0 * w0[k] + v1 * w1[k]) + (v2 * w2[k] + v3 * w3[k]))
                                          + ((v4 * w4[k] + v5 * w5[k]) + (v6 * w6[k] + v7 * w7[k])))) + b[k]
                elif first:
                    for k in range(h):
                        out[k] = zero + (((v0 * w0[k] + v1 * w1[k]) + (v2 * w2[k] + v3 * w3[k]))
                                         + ((v4 * w4[k] + v5 * w5[k]) + (v6 * w6[k] + v7 * w7[k])))
                elif last:
                    for k in range(h):
                        out[k] = (out[k] + (((v0 * w0[k] + v1 * w1[k]) + (v2 * w2[k] + v3 * w3[k]))
                                            + ((v4 * w4[k] + v5 * w5[k]) + (v6 * w6[k] + v7 * w7[k])))) + b[k]
                else:
                    for k in range(h):
                        out[k] += (((v0 * w0[k] + v1 * w1[k]) + (v2 * w2[k] + v3 * w3[k]))
                                   + ((v4 * w4[k] + v5 * w5[k]) + (v6 * w6[k] + v7 * w7[k])))


@numba.njit(cache=True, nogil=True)
def backward(cols, vals, nnz, u, coef, a, G, gb1, gw2, gb2):
    """The batch's sums, row by row in batch order (written): with δ_i = coef_i u_i, W₁ᵀ's Σ_i x_i δ_iᵀ G (R, d, h),
    b₁'s Σ_i δ_i (R, h), w₂'s Σ_i coef_i a_i (R, h), b₂'s Σ_i coef_i (R,); u, a (R, M, h), coef (R, M); the rows'
    nonzeros as for `hidden`."""
    R, M = nnz.shape
    h = u.shape[2]
    G[:] = 0.0
    gb1[:] = 0.0
    gw2[:] = 0.0
    gb2[:] = 0.0
    dl = np.empty(h, dtype=G.dtype)
    for r in range(R):
        Gr, s1, s2 = G[r], gb1[r], gw2[r]
        for i in range(M):
            c = coef[r, i]
            gb2[r] += c
            ui, ai = u[r, i], a[r, i]
            for k in range(h):  # one pass for δ_i, b₁'s and w₂'s sums (three loops: ~11% slower)
                x = ui[k] * c
                dl[k] = x
                s1[k] += x
                s2[k] += c * ai[k]
            m = 0  # the row's true nonzeros: the leading slots (the padding, zeros, comes last; a nonzero is never 0)
            while m < nnz[r, i] and vals[r, i, m] != 0.0:
                m += 1
            s = 0
            while s + 4 <= m:  # four (distinct) rows of G per pass over δ_i: fewer loop overheads, the same sums
                v0, v1, v2, v3 = vals[r, i, s], vals[r, i, s + 1], vals[r, i, s + 2], vals[r, i, s + 3]
                g0, g1, g2, g3 = Gr[cols[r, i, s]], Gr[cols[r, i, s + 1]], Gr[cols[r, i, s + 2]], Gr[cols[r, i, s + 3]]
                for k in range(h):
                    x = dl[k]
                    g0[k] += v0 * x
                    g1[k] += v1 * x
                    g2[k] += v2 * x
                    g3[k] += v3 * x
                s += 4
            while s < m:
                v, g = vals[r, i, s], Gr[cols[r, i, s]]
                for k in range(h):
                    g[k] += v * dl[k]
                s += 1


ACTIVATIONS = {"tanh": 0, "sigmoid": 1, "relu": 2}


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def row_terms(a, kind, one, w2, b2, u, f, aa, uu):
    """Per replica r and row i, from the activations a = φ(z): u = φ'(z) ⊙ w₂ (φ' from a as `mlp._activate` computes
    it: tanh 1 − a², sigmoid (1 − a)·a, relu [a > 0]), f = a·w₂ + b₂, aa = ‖a‖², uu = ‖u‖² (all written). The
    three dots are LLVM's vectorised reductions (`reassoc` only: no FMA contraction, NaN and ∞ kept): lanes summed
    in an order fixed by the compiled kernel and h, never by R or M. `one`: 1 in a's dtype (a float literal would
    compute float32 rows in float64)."""
    R, M, h = a.shape
    for r in range(R):
        w = w2[r]
        for i in range(M):
            ai, ui = a[r, i], u[r, i]
            if kind == 0:
                for k in range(h):
                    ui[k] = (one - ai[k] * ai[k]) * w[k]
            elif kind == 1:
                for k in range(h):
                    ui[k] = ((one - ai[k]) * ai[k]) * w[k]
            else:
                for k in range(h):
                    ui[k] = (one if ai[k] > 0 else one - one) * w[k]
            s_f = 0.0 * w[0]
            s_a = 0.0 * w[0]
            s_u = 0.0 * w[0]
            for k in range(h):
                s_f += ai[k] * w[k]
            for k in range(h):
                s_a += ai[k] * ai[k]
            for k in range(h):
                s_u += ui[k] * ui[k]
            f[r, i] = s_f + b2[r]
            aa[r, i] = s_a
            uu[r, i] = s_u


@numba.njit(cache=True, nogil=True)
def clipped_coefficients(minus_y, e, w, x_norm, aa, uu, one, clip, coef):
    """coef = r·w·(C / max(‖∇ℓ‖, C)) with r = (−y)·e, e = σ(−y f) (from NumPy: `mlp._coefficients` computes it with
    scipy's expit), ‖∇ℓ‖ = |r| √((1 + ‖a‖²) + ‖u‖²(‖x‖² + 1)): `_coefficients`' operations in its order, each rounded
    to the arrays' dtype (one, clip given in it), max as NumPy's (a NaN norm gives NaN); all (R, M) (coef written)."""
    R, M = coef.shape
    for r_ in range(R):
        for i in range(M):
            r = minus_y[r_, i] * e[r_, i]
            xn = x_norm[r_, i]
            norm = abs(r) * np.sqrt((one + aa[r_, i]) + uu[r_, i] * (xn * xn + one))
            m = clip if norm < clip else norm
            coef[r_, i] = (r * w[r_, i]) * (clip / m)
