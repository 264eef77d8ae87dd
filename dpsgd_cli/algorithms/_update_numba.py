"""numba code of `chain.GradientChain.step`'s tail for the chains of `sgd` and `dp_sgd` (imported on first use: numba
is optional): noise, scale, λθ and the update in one pass over θ, the numbers of the NumPy expressions."""

import numba


@numba.njit(cache=True, nogil=True)
def noisy_update(theta, g, z, std, factor, l2, lr, noise, has_l2, buf):
    """θ ← θ − η ((g + std·z) · factor + λθ) per replica row, in θ's dtype as NumPy computes `add_noise`, `scale`,
    `add_l2` and the update one after the other: std·z in float64 (z float64, (R, P)) rounded to θ's dtype, then
    each operation in θ's dtype with factor, λ, η given in it (NumPy rounds a Python float to the array's dtype);
    noise False: no noise term (z unread); has_l2 False: no λθ term (`add_l2` with λ = 0 returns g itself).
    buf: (P,) of θ's dtype (std·z rounded to it: the cast of an array store)."""
    R, P = theta.shape
    for r in range(R):
        th, gr = theta[r], g[r]
        if noise and has_l2:  # one loop per case, one pass over θ each
            zr = z[r]
            for p in range(P):
                buf[p] = std * zr[p]
                th[p] = th[p] - lr * ((gr[p] + buf[p]) * factor + l2 * th[p])
        elif noise:
            zr = z[r]
            for p in range(P):
                buf[p] = std * zr[p]
                th[p] = th[p] - lr * ((gr[p] + buf[p]) * factor)
        elif has_l2:
            for p in range(P):
                th[p] = th[p] - lr * (gr[p] * factor + l2 * th[p])
        else:
            for p in range(P):
                th[p] = th[p] - lr * (gr[p] * factor)
