"""The numba code of the single-example backend (backends.py; imported on first use: numba is optional).

Where one example per step is inherent (song2013 with b = 1, bassily2014, pidp_sgd) a step's work is a few
P-vectors, dominated by NumPy's per-call overhead; these kernels run a whole chunk of steps per call, replica by
replica: the example's clipped gradient into g, then the chain's tail (`_tail_numba.tail`). Logistic regression
(ℓ = log(1 + e^{−y θ·x}), ∇ℓ = a x with a = −y σ(−y θ·x), clipped: a ← a · C / max(|a|‖x‖, C)) and the
one-hidden-layer MLP (models/mlp.py: θ = [W₁ (h×d, row-major) | b₁ (h) | w₂ (h) | b₂], ‖∇ℓ‖ = |res| √(1 + ‖a‖² +
‖u‖²(‖x‖² + 1))), every parameter in θ's layout order.
"""

import numba
import numpy as np

from dpsgd_cli.algorithms._tail_numba import tail
from dpsgd_cli.models._logreg_numba import clip_residual, residual_from_exp


@numba.njit(cache=True, nogil=True)
def sgd1_logreg(theta, X, y, x_norm, idx, noise, noisy, lrs, clip, do_clip, codes, vals, M1, M2):  # pragma: no cover
    """m = lrs.shape[0] steps of every replica r: example idx[t, r], noise noise[t, r] (when the chain has noise,
    on the steps noisy[t, r]), clip norm clip[r]; θ (R, d) in place."""
    R, d = theta.shape
    g = np.empty(d)
    for r in range(R):
        for t in range(lrs.shape[0]):
            i = idx[t, r]
            dot = 0.0
            for j in range(d):
                dot += X[i, j] * theta[r, j]
            yi = y[i]
            a = residual_from_exp(yi, np.exp(yi * dot))
            if do_clip:
                a = clip_residual(a, x_norm[i], clip[r])
            for j in range(d):
                g[j] = a * X[i, j]
            tail(theta[r], g, codes, vals, noise[min(t, noise.shape[0] - 1), min(r, noise.shape[1] - 1)],
                 noisy[t, r], lrs[t], M1[r], M2[r])
    return theta


@numba.njit(cache=True, nogil=True)
def sgd1_mlp(theta, X, y, x_norm, idx, noise, noisy, lrs, clip, do_clip, codes, vals, M1, M2, h,
             act):  # pragma: no cover
    """`sgd1_logreg` on the MLP's gradient (act: 0 tanh, 1 sigmoid, 2 relu), from the θ of before the step."""
    R, P = theta.shape
    d = X.shape[1]
    o_b1, o_w2, o_b2 = h * d, h * d + h, h * d + 2 * h
    a = np.empty(h)
    delta = np.empty(h)
    grad = np.empty(P)
    for r in range(R):
        for t in range(lrs.shape[0]):
            i = idx[t, r]
            f = theta[r, o_b2]
            sq_a = 0.0
            sq_u = 0.0
            for k in range(h):  # forward: z = W₁x + b₁, a = φ(z); u = w₂ ⊙ φ'(z) kept in `delta`
                z = theta[r, o_b1 + k]
                for j in range(d):
                    z += theta[r, k * d + j] * X[i, j]
                if act == 0:
                    ak = np.tanh(z)
                    dk = 1.0 - ak * ak
                elif act == 1:
                    ak = 1.0 / (1.0 + np.exp(-z))
                    dk = (1.0 - ak) * ak
                else:
                    ak = z if z > 0.0 else 0.0
                    dk = 1.0 if z > 0.0 else 0.0
                a[k] = ak
                f += theta[r, o_w2 + k] * ak
                u = dk * theta[r, o_w2 + k]
                delta[k] = u
                sq_a += ak * ak
                sq_u += u * u
            yi = y[i]
            res = residual_from_exp(yi, np.exp(yi * f))  # ∂ℓ/∂f
            if do_clip:
                norm = abs(res) * np.sqrt(1.0 + sq_a + sq_u * (x_norm[i] * x_norm[i] + 1.0))
                res = res * (clip[r] / max(norm, clip[r]))
            for k in range(h):
                delta[k] = delta[k] * res
            for k in range(h):  # the gradient in θ's layout order
                for j in range(d):
                    grad[k * d + j] = delta[k] * X[i, j]
                grad[o_b1 + k] = delta[k]
                grad[o_w2 + k] = res * a[k]
            grad[o_b2] = res
            tail(theta[r], grad, codes, vals, noise[min(t, noise.shape[0] - 1), min(r, noise.shape[1] - 1)],
                 noisy[t, r], lrs[t], M1[r], M2[r])
    return theta
