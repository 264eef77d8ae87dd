"""The step tail of every compiled kernel (numba; imported on first use: numba is optional): the chain's ops after
the clipped gradient sum, as an int-coded program with up to three float parameters per op (`backends.program`),
run on one replica's θ and g in the ops' order, each op over the whole vector, the operations of the ops' NumPy
`update`s:

    NOISE v: g ← g + v z (when the step is noisy)   SCALE v: g ← g v   L2 v: g ← g + v θ (skipped at v = 0)
    UPDATE:  θ ← θ − η g                             BALL v: θ ← θ · min(1, v/‖θ‖)   BOX v: θ ← clip(θ, −v, v)
    ADAM β₁ β₂ ε: m ← β₁m + (1 − β₁)g, u ← β₂u + (1 − β₂)g², θ ← θ − η (m/c₁)/(√(u/c₂) + ε)

and, before it, an adaptive clip's release (`ops.AdaptiveClip.release` after the model's sums): `adaptive_release`.
"""

import numba
import numpy as np

from dpsgd_cli.algorithms.backends import ADAM, BALL, BOX, L2, NOISE, SCALE, UPDATE


@numba.njit(cache=True, nogil=True)
def adaptive_release(g, z, norm, unclipped, kept, z_count, adapt):  # pragma: no cover
    """One replica's `ops.AdaptiveClip.release` after the model's sums at the clip norm C_t = `norm`: g (P,) ← g +
    (σ_Δ C_t) z in place; returns C_{t+1} = C_t exp(−η_C (b̄ − γ)), b̄ = (unclipped − kept/2 + σ_b z_count)/B + 1/2
    (kept: the step's examples, unclipped: those of gradient norm ≤ C_t), the same operations in the same order.
    adapt: the op's (σ_Δ, γ, η_C, σ_b, B), `backends.ADAPTIVE_FIELDS`."""
    noise_multiplier, quantile, lr, count_std, expected_batch = adapt[0], adapt[1], adapt[2], adapt[3], adapt[4]
    std = noise_multiplier * norm
    for p in range(g.shape[0]):
        g[p] = g[p] + std * z[p]
    fraction = (unclipped - 0.5 * kept + count_std * z_count) / expected_batch + 0.5
    return norm * np.exp(-lr * (fraction - quantile))


@numba.njit(cache=True, nogil=True)
def tail(theta, g, codes, vals, z, noisy, step, m, u):  # pragma: no cover
    """One replica's step from its clipped sum g (overwritten): θ (P,) in place. z: the step's standard normals
    (read only by NOISE, and only when `noisy`); step: (η_t, c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ); m, u: the replica's Adam
    moments (P,), in place (read only by ADAM)."""
    P = theta.shape[0]
    eta = step[0]
    for o in range(codes.shape[0]):
        code, v = codes[o], vals[o, 0]
        if code == NOISE:
            if noisy:
                for p in range(P):
                    g[p] = g[p] + v * z[p]
        elif code == SCALE:
            for p in range(P):
                g[p] = g[p] * v
        elif code == L2:
            if v != 0.0:
                for p in range(P):
                    g[p] = g[p] + v * theta[p]
        elif code == UPDATE:
            for p in range(P):
                theta[p] = theta[p] - eta * g[p]
        elif code == ADAM:  # as ops.Adam: the same operations in the same order
            b1, b2, eps, c1, c2 = vals[o, 0], vals[o, 1], vals[o, 2], step[1], step[2]
            for p in range(P):
                m[p] = b1 * m[p] + (1.0 - b1) * g[p]
                u[p] = b2 * u[p] + (1.0 - b2) * (g[p] * g[p])
                theta[p] = theta[p] + -(eta * (m[p] / c1) / (np.sqrt(u[p] / c2) + eps))
        elif code == BALL:
            sq = 0.0
            for p in range(P):
                sq += theta[p] * theta[p]
            f = v / max(np.sqrt(sq), 1e-300)
            if f < 1.0:
                for p in range(P):
                    theta[p] = theta[p] * f
        elif code == BOX:
            for p in range(P):  # as np.clip: NaN stays NaN
                if theta[p] < -v:
                    theta[p] = -v
                elif theta[p] > v:
                    theta[p] = v


@numba.njit(cache=True, nogil=True)
def fixed_rows(theta, g, counts, weight, idx, val, raw_norm, clip, do_clip, proj):  # pragma: no cover
    """One replica's rows of fixed gradient in its step (`models.base.FixedGradients`), before its tail: proj[j] =
    ⟨θ, u_j⟩ (θ before the step), then g += counts[j] weight[j] c u_j, counts[j] the step's rows of fixed gradient
    j, c = min(raw_norm, clip) when the chain clips, else raw_norm."""
    c = min(raw_norm, clip) if do_clip else raw_norm
    for j in range(idx.shape[0]):
        s = 0.0
        for k in range(idx.shape[1]):
            s += val[j, k] * theta[idx[j, k]]
        proj[j] = s
        f = counts[j] * weight[j] * c
        if f != 0.0:
            for k in range(idx.shape[1]):
                g[idx[j, k]] += f * val[j, k]
