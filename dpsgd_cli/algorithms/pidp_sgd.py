"""PIDP-SGD: DP-SGD that skips the noise for steps whose examples barely move the model (Kang et al.).

Kang, Li, Liu, Wang, "Data Heterogeneity Differential Privacy: From Theory to Algorithm", arXiv:2002.08578v2,
Algorithm 1 ("Performance Improving" DP-SGD), Theorem 4 (error of the influence-function estimate).

Idea: the influence function (Koh & Liang 2017) estimates how much removing example z moves the minimiser of
F(θ) = (1/n) Σ ℓ(θ; z_i) + (λ/2)‖θ‖²: Δ_z ≈ (1/n) H⁻¹ ∇ℓ(θ, z), H = ∇²F(θ). Theorem 4 bounds the error of
that estimate by E = (2LG + CG²/ζ) / (ζ² n²) when λ_min(H) ≥ ζ, ℓ is G-Lipschitz, L-smooth and its Hessian is
C-Lipschitz. An example whose (privately tested) contribution is small is trained on without noise; the
steps of the others get the Gaussian noise of DP-SGD.

The algorithm as implemented (R = `rounds` global rounds × T_local = `local_steps` local steps, T = R·T_local):

    for each round k = 1..R, at the global model θ_k (the current iterate):
        H   = (1/n) Σ_i σ'(y_i θ_k·x_i) x_i x_iᵀ + λ I  (+ ζ I if λ < ζ, see "ζ" below); H⁻¹ computed once
        for every example z:  v_z = (1/n) H⁻¹ clip_G(∇ℓ(θ_k, z)),   ‖c_z‖ = ‖v_z‖ + E
                              c̃_z = 2 c_z + N(0, σ_c² I),  σ_c = c' G R √(ln(1.25 R/δ₂)) / (n ζ ε₂),  c' = 2.83
                              z is "eligible" (no noise needed) iff ‖c̃_z‖ ≤ r
        for t = 1..T_local:  Poisson batch B_t (rate q = B/n, as `dp_sgd`), g = Σ_{i∈B_t} clip_G(∇ℓ(θ, z_i))
            if every example of B_t is eligible:  θ ← Π_r(θ − η (g/B + λθ))                 (plain SGD step)
            else:                                 θ ← Π_r(θ − η ((g + σ G N(0, I))/B + λθ))  (DP-SGD step)

with Π_r the projection onto the parameter ball {‖θ‖ ≤ r}, ε₁ = 3ε/4 (noisy steps), ε₂ = ε/4 (tests),
δ₁ = δ₂ = δ/2, and σ the smallest noise multiplier for which T Poisson-subsampled Gaussian steps are
(ε₁, δ₁)-DP (`accountant`). The whole run claims (ε₁ + ε₂, δ₁ + δ₂) = (ε, δ) by basic composition.

Constants for logistic regression with ‖x‖ ≤ 1 (the paper's notation: G-Lipschitz, L-smooth):
G = model.lipschitz(1) = 1 (per-example gradients are clipped to G, a no-op on unit-ball rows),
L = model.smoothness(1) = 1/4, C = max|σ''| = 1/(6√3) (∇²ℓ = σ'(m) x xᵀ, so
‖∇²ℓ(θ) − ∇²ℓ(θ')‖ ≤ max|σ''| ‖x‖³ ‖θ − θ'‖).

The MLP (`model: mlp`, d → h → 1 logit, P = d·h + 2h + 1; Kang et al.'s panels d-f), param `influence`:

* `full`: v_z = (1/n) H⁻¹ clip_G(∇ℓ(θ_k, z)) over all P parameters. H = ∇²F(θ_k) (λ included) is built densely
  from the P exact Hessian–vector products `model.hvp(θ, X, y, e_j)` (columns in chunks, vectorised over replicas ×
  columns), symmetrised, and damped by its spectrum: μ = λ_min(H); if μ < ζ, H + (ζ + max(0, −μ)) I. On a positive
  semi-definite H that is the logreg rule (+ζI); a non-convex model's H is indefinite (it is, already at the
  initialisation), and +ζI alone would not give λ_min ≥ ζ, which σ_c's sensitivity ‖2c_z‖ ≤ 2G/(nζ) needs.
  (`hessian_shift`, `hessian_min_eigenvalue`: per replica, max / min over rounds.) Inverted once per round; the
  per-example clipped gradients (the model's own `clipped_grad_sum`, one example per replica slot) are multiplied
  by H⁻¹ in blocks. Cost per round and replica ≈ P full-data Hessian–vector products + n·P² (adult, P = 2969:
  ≈ 2 min): refused above P = FULL_INFLUENCE_MAX_PARAMS = 3000. The dimension of c̃_z is P. For logreg `full` is
  the closed-form Hessian above (its only layer is its output layer, so every `influence` value means this).
* `output_layer`: the influence restricted to the output layer's parameters (w₂, b₂), as Koh & Liang (ICML 2017)
  did for deep networks (influence on the top layer, the rest frozen). f = ã·(w₂, b₂) with ã = [φ(W₁x + b₁), 1], so
  that block of ∇²F is exactly the logistic-regression Hessian on ã: (1/n) Σ σ'(y f) ã ãᵀ + λI (the same functions
  as logreg, on per-replica features; `damped`'s rule holds: PSD + λI). The gradient is the output-layer part of
  ∇ℓ, r·ã, clipped on its own norm to G (so ‖c_z‖ ≤ G/(nζ) and σ_c hold as for logreg). The dimension of c̃_z is
  h + 1. Cost per round: a forward pass and n·(h + 1)² (adult: 0.35 s for 3 replicas).
* `auto` (default): `full` for logreg and for an mlp with P ≤ 3000, else `output_layer` (adult, h = d: P = 11025).

Which of Theorem 4's constants transfer to the mlp: none to the whole network (non-convex: no global Lipschitz,
smoothness or Hessian-Lipschitz constant; `full` uses E = 0 in the test and records no bound). For `output_layer`,
ℓ as a function of (w₂, b₂) with the hidden layer frozen is logistic regression on ã with ‖ã‖ ≤ A: A = √(h + 1) for
tanh and sigmoid (|φ| ≤ 1, every θ), A = √(1 + 2‖[W₁ b₁]‖₂²) for relu (‖x‖ ≤ 1; θ_k's hidden layer, per replica
and round). Its constants are L = A²/4, C = max|σ''| A³ and Lipschitz A; E uses G = the clip bound (the estimate's
gradients are clipped to G; `influence_error_bound`), and `influence_error_bound_unclipped` uses G = A (the
loss's own Lipschitz constant, Theorem 4's G): the theorem then bounds the error of the frozen-feature influence, not
of the network's (adult, h = 104, ζ = 0.01: E = 0.11 with G = 1, 12 with G = A). The guarantee is therefore
"none: non-convex model" (`privacy_note` says which bounds hold: the test's σ_c does, E does not bound the network).

Decisions where the pseudo-code is ambiguous (the paper's text was not available to us; the issue's summary,
the formulas above and these choices are what is implemented):

* Notation: in E = (2LG + CG²/ζ)/(ζ²n²) L is the smoothness constant and G the Lipschitz constant (the
  authors' notation, "G-Lipschitz, L-smooth"; it is also the only dimensionally consistent reading: E is a
  distance in parameter space). The issue calls L the Lipschitz constant; we follow the paper.
* ζ: added to the Hessian's diagonal only where needed, i.e. when λ < ζ (then λ_min(H + ζI) ≥ ζ); when
  λ ≥ ζ, H itself has λ_min ≥ ζ. Either way ‖H⁻¹‖ ≤ 1/ζ, the bound σ_c and E use. `hessian_damped` records it.
* "c_z + E" (a vector plus a scalar): E bounds the *norm* of the estimate's error, so ‖c_z‖ = ‖v_z‖ + E
  (c_z = v_z extended by E along its own direction). Only ‖c̃_z‖ is used, and ‖2c + N(0, σ_c² I)‖ depends on
  c only through ‖c‖ (rotation invariance), so it is sampled exactly as √((2‖c‖ + σ_c Z)² + σ_c² χ²_{d−1}).
* When the contribution is tested: once per round and example, at the round's global model (the point where
  H is computed, as an influence function requires), with fresh noise; every step of the round reuses that
  example's outcome. So each example's contribution is released R times, which is the R-fold (basic)
  composition that σ_c's formula pays for (c' = 2.83 ≈ 2√2: the Gaussian mechanism σ = Δ√(2 ln(1.25/δ))/ε with
  Δ = ‖2c‖ ≤ 2G/(nζ) at (ε₂/R, δ₂/R) per round).
* Lines 10-11 (the threshold test, with its "jump to line 10"): read as a two-way branch — the step is noiseless
  iff the noised contribution lies in the parameter ball's radius, ‖c̃_z‖ ≤ r; otherwise the noisy step.
  With mini-batches a step is noiseless only if *all* its examples are eligible (the noise protects the whole
  batch); an empty Poisson batch is thus noiseless too (`empty_step_fraction`: ≈ e^{−1} of the steps when
  B = 1). The fraction of noiseless steps per replica is recorded (`noiseless_fraction`, and its mean).
* Rounds: by default one round per epoch (R = round(epochs)) and T_local = round(T_total / R) with
  T_total = round(epochs·n/B), so a round is one expected pass; `rounds`/`local_steps` override.
* Sampling and σ: Poisson sampling with rate B/n and the dp-accounting RDP (or PLD) accountant of the
  subsampled Gaussian over all T steps, i.e. exactly `dp_sgd`'s analysis (the moments-accountant bound
  σ = c G √(T ln(1/δ))/(nε) of the paper's DP-SGD, with the constant computed), counted as if every step were
  noisy (the paper's accounting of the noisy steps; see caveat 2). `composition` is the classical alternative:
  per-step Gaussian mechanism, tight amplification by Poisson subsampling, the better of basic and advanced
  composition.
* Defaults ζ = 0.01 (the usual influence-function damping) and r = 10 are ours: the paper's experimental values
  were not available. They decide the outcome (caveat 3): on adult (n = 30162, d = 104, R = 5) every example
  passes when σ_c√d ≈ 0.092/(ζε) < r.

Privacy caveats (findings, not choices): (1) the noiseless steps are protected only by the paper's
influence-function argument, not by any DP accountant; (2) whether a step is noisy depends on which examples it
sampled, so the accountant's bound for the noisy steps (which assumes every step adds the noise) does not cover
the mechanism as run: for an ineligible z, a step that samples z adds noise while the same step without z (its
other examples eligible) releases its update exactly; (3) with these constants ‖2c_z‖ ≤ 2G/(nζ) is tiny next to
σ_c√d, so eligibility is almost independent of the data: the test mostly decides, at random, whether steps skip
the noise (≈ all when σ_c√d < r, e.g. large ε or ζ; ≈ none otherwise). Hence `guarantee` is never "proved":
when the paper's assumptions hold it is `PAPER_CLAIM` (the paper's claim applies; no accountant backs it),
else the first assumption that fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.special import expit

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Setting, unit_ball_violation
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain, Transform, add_l2, constant, project_to_ball, scale
from dpsgd_cli.algorithms.sampling import gather, poisson_batches, row_norms
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import MLP, Batch, Model
from dpsgd_cli.privacy.accounting import calibrate_sigma
from dpsgd_cli.privacy.mechanisms import advanced_composition_epsilon_per_step

C_PRIME = 2.83  # the paper's constant in σ_c (≈ 2√2)
EPSILON_1_SHARE = 0.75  # ε₁ = 3ε/4 for the noisy steps, ε₂ = ε/4 for the contribution tests (paper's experiments)
MAX_ABS_SIGMOID_2ND = 1.0 / (6.0 * math.sqrt(3.0))  # max |σ''| of the logistic sigmoid, at σ = (3 ± √3)/6
_ROW_CHUNK = 4096  # rows per block when forming H and H⁻¹x for all examples (bounds memory to R·chunk·d)
GRADIENT_CLIP = 1.0  # G: every per-example gradient is clipped to it (= model.lipschitz(1) for logreg: a no-op)
# `influence: full` builds the dense P × P Hessian from P Hessian–vector products (cost ≈ P full-data passes, plus
# n·P² per round for H⁻¹∇ℓ of every example): refused above this many parameters (use `output_layer`).
FULL_INFLUENCE_MAX_PARAMS = 3000
_BLOCK_ELEMENTS = 1 << 21  # numbers per (R, chunk, P) temporary of the dense Hessian / per-example gradients

# The mechanism as run skips noise on data-dependent steps: no accountant covers that (module docstring).
PAPER_CLAIM = "paper-claimed: data-dependent noise skipping is not covered by an accountant"


class PIDPSGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    zeta: float = Field(0.01, gt=0, description="ζ: lower bound on λ_min(H); added to H's diagonal when λ < ζ")
    radius: float = Field(10.0, gt=0, description="r: radius of the parameter ball (projection) and the "
                                                  "threshold ‖c̃‖ ≤ r of the noiseless branch")
    rounds: Optional[int] = Field(None, ge=1, description="R global rounds (Hessian recomputed each); "
                                                          "default one per epoch, round(epochs)")
    local_steps: Optional[int] = Field(None, ge=1, description="T_local steps per round; default "
                                                               "round(epochs·n/B / R)")
    accountant: Literal["rdp", "pld", "composition"] = Field(
        "rdp", description="σ of the noisy steps for (3ε/4, δ/2) over T = R·T_local Poisson-subsampled steps: "
                           "dp-accounting RDP or PLD, or classical Gaussian + amplification + composition")
    influence: Literal["auto", "full", "output_layer"] = Field(
        "auto", description="parameters the influence c_z = (1/n) H⁻¹∇ℓ is computed over: full (dense Hessian of "
                            f"F, P ≤ {FULL_INFLUENCE_MAX_PARAMS}), output_layer (mlp: (w₂, b₂) only, Koh & Liang "
                            "2017), auto (full for logreg and small networks, else output_layer)")


# ------------------------------------------------------------------------------------------------
# Formulas (module-level so that the tests check them by hand)
# ------------------------------------------------------------------------------------------------


def contribution_sigma(G: float, rounds: int, delta_2: float, n: int, zeta: float, epsilon_2: float,
                       c_prime: float = C_PRIME) -> float:
    """σ_c = c' G R √(ln(1.25 R/δ₂)) / (n ζ ε₂) (Kang et al., Algorithm 1)."""
    return c_prime * G * rounds * math.sqrt(math.log(1.25 * rounds / delta_2)) / (n * zeta * epsilon_2)


def influence_error_bound(L: float, G: float, C: float, zeta: float, n: int) -> float:
    """E = (2LG + CG²/ζ) / (ζ² n²) (Kang et al., Theorem 4): L smoothness, G Lipschitz, C Hessian-Lipschitz."""
    return (2.0 * L * G + C * G**2 / zeta) / (zeta**2 * n**2)


def _margins(theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    """θ_r·x for rows X shared (m, d) or per replica (R, m, d): (R, m)."""
    return theta @ X.T if X.ndim == 2 else np.matmul(X, theta[:, :, None])[..., 0]


def _weighted_gram(X: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Σ_i w_ri x_i x_iᵀ by BLAS for rows X shared (m, d) or per replica (R, m, d): (R, d, d)."""
    if X.ndim == 2:
        return np.matmul(X.T[None] * w[:, None, :], X)
    return np.matmul(np.swapaxes(X, 1, 2) * w[:, None, :], X)


def logreg_hessian(theta: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float, features=None) -> np.ndarray:
    """∇²F(θ) = (1/n) Σ σ'(y_i θ·x_i) x_i x_iᵀ + λI for every replica: (R, d, d); blocks of rows, no example loop.

    `features` (rows (m, d_in) → (R, m, d)) replaces each block of rows by per-replica features first: the output
    layer of an MLP is this logistic regression on ã = [a(x), 1] (`output_features`)."""
    n = X.shape[0]
    d = theta.shape[1]
    H = np.zeros((theta.shape[0], d, d))
    for start in range(0, n, _ROW_CHUNK):
        Xc = X[start:start + _ROW_CHUNK]
        if features is not None:
            Xc = features(Xc)
        m = _margins(theta, Xc) * y[start:start + _ROW_CHUNK]  # (R, chunk) margins
        w = expit(m) * expit(-m)  # σ'(m), symmetric in m
        H += _weighted_gram(Xc, w)
    H /= n
    H += l2 * np.eye(d)
    return H


def damped(H: np.ndarray, l2: float, zeta: float) -> tuple[np.ndarray, bool]:
    """H + ζI when λ < ζ (so that λ_min ≥ ζ), else H; and whether ζ was added. Valid for H = PSD + λI (logreg, the
    output-layer block); an MLP's full Hessian may be indefinite: `damped_by_spectrum`."""
    if l2 < zeta:
        return H + zeta * np.eye(H.shape[-1]), True
    return H, False


def damped_by_spectrum(H: np.ndarray, zeta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(H + s_r I, s (R,), μ (R,)) with μ = λ_min(H_r) and s_r = 0 if μ ≥ ζ, else ζ + max(0, −μ).

    Same rule as `damped` when H is positive semi-definite (+ζI where λ_min < ζ); when H is indefinite (a
    non-convex model), the extra −μ makes λ_min(H + sI) = ζ, so ‖(H + sI)⁻¹‖ ≤ 1/ζ still holds (σ_c relies on it)."""
    mu = np.linalg.eigvalsh(H)[:, 0]
    shift = np.where(mu < zeta, zeta + np.maximum(0.0, -mu), 0.0)
    return H + shift[:, None, None] * np.eye(H.shape[-1]), shift, mu


def symmetric_inverse(H: np.ndarray) -> np.ndarray:
    """H⁻¹ for every replica (one solve against I), made exactly symmetric (`influence_norms` relies on it)."""
    H_inv = np.linalg.solve(H, np.broadcast_to(np.eye(H.shape[-1]), H.shape))
    return 0.5 * (H_inv + np.swapaxes(H_inv, 1, 2))


def clipped_residuals(theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, G: float) -> np.ndarray:
    """a_i with clip_G(∇ℓ(θ; x_i, y_i)) = a_i x_i: (R, n) (∇ℓ = −y σ(−y θ·x) x, clipped to norm ≤ G).
    X shared (n, d) or per replica (R, n, d) (then x_norm is (R, n))."""
    residual = -y * expit(-y * _margins(theta, X))
    norm = np.abs(residual) * x_norm
    return residual * G / np.maximum(norm, G)


def influence_vectors(theta: np.ndarray, X: np.ndarray, y: np.ndarray, H_inv: np.ndarray, n: int,
                      G: float) -> np.ndarray:
    """v_z = (1/n) H⁻¹ clip_G(∇ℓ(θ, z)) for the rows of X: (R, m, d)."""
    a = clipped_residuals(theta, X, y, row_norms(X), G)
    return np.einsum("rm,rde,me->rmd", a, H_inv, X, optimize=True) / n


def influence_norms(theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, H_inv: np.ndarray,
                    G: float, features=None) -> np.ndarray:
    """‖v_z‖ = (1/n) |a_z| ‖H⁻¹ x_z‖ for every example: (R, n), in blocks of rows (H⁻¹ symmetric).
    With `features` (see `logreg_hessian`), x_z is the example's feature vector and x_norm is ignored."""
    n = X.shape[0]
    out = np.empty((theta.shape[0], n))
    for start in range(0, n, _ROW_CHUNK):
        sl = slice(start, start + _ROW_CHUNK)
        if features is None:
            Xc, xn = X[sl][None], x_norm[sl]
        else:
            Xc = features(X[sl])
            xn = np.sqrt(np.einsum("rmd,rmd->rm", Xc, Xc))
        hx = np.matmul(Xc, H_inv)  # (R, chunk, d): rows are (H⁻¹ x_i)ᵀ
        a = clipped_residuals(theta, Xc if features is not None else X[sl], y[sl], xn, G)
        out[:, sl] = np.abs(a) * np.linalg.norm(hx, axis=-1) / n
    return out


def noised_norms(c_norm: np.ndarray, sigma_c: float, d: int, generators: list[np.random.Generator]) -> np.ndarray:
    """‖2c + N(0, σ_c² I_d)‖ for c of norm `c_norm` (R, n), one generator per replica.

    Exact in distribution: rotate 2c onto e₁, then ‖·‖² = (2‖c‖ + σ_c Z)² + σ_c² χ²_{d−1}.
    """
    n = c_norm.shape[1]
    z = np.stack([g.standard_normal(n) for g in generators])
    chi2 = np.stack([g.chisquare(d - 1, n) if d > 1 else np.zeros(n) for g in generators])
    return np.sqrt((2.0 * c_norm + sigma_c * z) ** 2 + sigma_c**2 * chi2)


# --- any model with Hessian–vector products: the dense Hessian (`influence: full`) ----------------------------


def dense_hessian(model: Model, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """∇²F(θ) (R, P, P) from P exact Hessian–vector products `model.hvp(θ, X, y, e_j)`, k columns per call (the
    replica axis carries replicas × columns), symmetrised (H e_j is column j; rounding makes H ≠ Hᵀ by ~1e-16)."""
    R, P = theta.shape
    k = max(1, min(P, _BLOCK_ELEMENTS // max(1, R * P)))
    H = np.empty((R, P, P))
    for j0 in range(0, P, k):
        kk = min(k, P - j0)
        V = np.zeros((R, kk, P))
        V[:, np.arange(kk), j0 + np.arange(kk)] = 1.0
        H[:, j0:j0 + kk, :] = model.hvp(np.repeat(theta, kk, axis=0), X, y, V.reshape(R * kk, P)).reshape(R, kk, P)
    return 0.5 * (H + np.swapaxes(H, 1, 2))


def per_example_clipped_gradients(model: Model, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                                  x_norm: np.ndarray, G: float) -> np.ndarray:
    """clip_G(∇ℓ(θ_r; x_i, y_i)) for every replica and row of X (m, d): (R, m, P), by the model's own
    `clipped_grad_sum` with one example per (replica, example) pair (so the clip is exactly the one of the steps)."""
    R, P = theta.shape
    m, d = X.shape
    batch = Batch(X=np.broadcast_to(X, (R, m, d)).reshape(R * m, 1, d),
                  y=np.broadcast_to(y, (R, m)).reshape(R * m, 1), weight=np.ones((R * m, 1)),
                  x_norm=np.broadcast_to(x_norm, (R, m)).reshape(R * m, 1))
    return model.clipped_grad_sum(np.repeat(theta, m, axis=0), batch, G).reshape(R, m, P)


def full_influence_norms(model: Model, theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray,
                         H_inv: np.ndarray, G: float) -> np.ndarray:
    """‖(1/n) H⁻¹ clip_G(∇ℓ(θ, z))‖ for every example: (R, n), per-example gradients in blocks of rows."""
    n = X.shape[0]
    R, P = theta.shape
    rows = max(1, _BLOCK_ELEMENTS // max(1, R * P))
    out = np.empty((R, n))
    for start in range(0, n, rows):
        sl = slice(start, start + rows)
        g = per_example_clipped_gradients(model, theta, X[sl], y[sl], x_norm[sl], G)
        out[:, sl] = np.linalg.norm(np.matmul(g, H_inv), axis=-1) / n
    return out


# --- MLP output layer (`influence: output_layer`) ----------------------------------------------------------------

_ACTIVATIONS = {"tanh": np.tanh, "sigmoid": expit, "relu": lambda z: np.maximum(z, 0.0)}


def output_features(model: MLP, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
    """ã = [φ(W₁x + b₁), 1] for the rows of X (m, d): (R, m, h + 1). f(x) = ã·[w₂, b₂]: the output layer is a
    logistic regression on ã."""
    W1, b1, _, _ = model.unpack(theta)
    z = np.matmul(X, W1.transpose(0, 2, 1))
    z += b1[:, None, :]
    a = _ACTIVATIONS[model.activation](z)
    return np.concatenate([a, np.ones(a.shape[:-1] + (1,))], axis=-1)


def output_layer_params(model: MLP, theta: np.ndarray) -> np.ndarray:
    """[w₂, b₂] (R, h + 1): the last h + 1 entries of θ."""
    _, _, w2, b2 = model.unpack(theta)
    return np.concatenate([w2, b2[:, None]], axis=1)


def output_feature_bound(model: MLP, theta: np.ndarray) -> np.ndarray:
    """A_r ≥ ‖ã‖ for every ‖x‖ ≤ 1: (R,). tanh, sigmoid: |φ| ≤ 1, so A = √(h + 1) for every θ. relu:
    ‖φ(W₁x + b₁)‖ ≤ ‖[W₁ b₁][x; 1]‖ ≤ √2 ‖[W₁ b₁]‖₂, so A = √(1 + 2‖[W₁ b₁]‖₂²) at the round's hidden layer."""
    R = theta.shape[0]
    if model.activation in ("tanh", "sigmoid"):
        return np.full(R, math.sqrt(model.hidden + 1.0))
    W1, b1, _, _ = model.unpack(theta)
    spectral = np.linalg.norm(np.concatenate([W1, b1[:, :, None]], axis=2), ord=2, axis=(1, 2))
    return np.sqrt(1.0 + 2.0 * spectral**2)


# --- one round's influence norms and the private test --------------------------------------------------------


@dataclass
class RoundInfluence:
    """‖v_z‖ = ‖(1/n) H⁻¹ clip_G(∇ℓ(θ_k, z))‖ of one round: norms (R, n); dim: the dimension of v_z; damped: ζ was
    added (bool, or (R,) for `full` on a non-linear model); shift (R,) and min_eigenvalue (R,) of H (full MLP)."""
    norms: np.ndarray
    dim: int
    damped: bool | np.ndarray
    shift: np.ndarray | None = None
    min_eigenvalue: np.ndarray | None = None


def round_influence(influence: str, model: Model | None, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                    x_norm: np.ndarray, l2: float, zeta: float, G: float) -> RoundInfluence:
    """The influence norms at the global model θ (R, P) for `influence` ∈ {full, output_layer}; H inverted once.
    A diverged replica (non-finite θ) is evaluated at 0 and stays NaN; the others are unaffected."""
    at = np.where(np.isfinite(theta).all(axis=1, keepdims=True), theta, 0.0)
    if influence == "full" and (model is None or model.name == "logreg"):
        H, was_damped = damped(logreg_hessian(at, X, y, l2), l2, zeta)
        return RoundInfluence(influence_norms(at, X, y, x_norm, symmetric_inverse(H), G), X.shape[1], was_damped)
    if influence == "full":
        H, shift, mu = damped_by_spectrum(dense_hessian(model, at, X, y), zeta)
        norms = full_influence_norms(model, at, X, y, x_norm, symmetric_inverse(H), G)
        return RoundInfluence(norms, model.n_params, shift > 0, shift, mu)
    if influence == "output_layer":
        w = output_layer_params(model, at)

        def features(rows: np.ndarray) -> np.ndarray:
            return output_features(model, at, rows)

        H, was_damped = damped(logreg_hessian(w, X, y, l2, features=features), l2, zeta)
        norms = influence_norms(w, X, y, x_norm, symmetric_inverse(H), G, features=features)
        return RoundInfluence(norms, w.shape[1], was_damped)
    raise ValueError(f"unknown influence {influence!r}")


def private_test(influence: RoundInfluence, E, sigma_c: float, radius: float,
                 generators: list[np.random.Generator]) -> np.ndarray:
    """eligible (R, n): ‖2c_z + N(0, σ_c² I_dim)‖ ≤ r with ‖c_z‖ = ‖v_z‖ + E (E a number or one per replica (R,))."""
    E = np.asarray(E, dtype=float)
    c_norm = influence.norms + (E[:, None] if E.ndim == 1 else E)
    return noised_norms(c_norm, sigma_c, influence.dim, generators) <= radius


def contribution_test(theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, l2: float, zeta: float,
                      G: float, E: float, sigma_c: float, radius: float,
                      generators: list[np.random.Generator]) -> tuple[np.ndarray, bool]:
    """One round's private test of logistic regression at the global model θ (R, d): (eligible (R, n) =
    ‖2c_z + N(0, σ_c² I)‖ ≤ r with ‖c_z‖ = ‖(1/n) H⁻¹ clip_G(∇ℓ(θ, z))‖ + E, whether ζ was added to H)."""
    influence = round_influence("full", None, theta, X, y, x_norm, l2, zeta, G)
    return private_test(influence, E, sigma_c, radius, generators), influence.damped


def resolve_influence(requested: str, model: Model) -> str:
    """`influence` as run: logreg → full (its only layer is its output layer); mlp: auto → full when
    P ≤ FULL_INFLUENCE_MAX_PARAMS else output_layer; full above the cap is refused."""
    if model.name == "logreg":
        return "full"
    if not isinstance(model, MLP):
        raise UserError(f"pidp_sgd needs the loss's Hessian: implemented for logreg and mlp; got model "
                        f"{getattr(model, 'name', model)!r}: use models: [logreg] or [mlp]")
    P = model.n_params
    if requested == "auto":
        return "full" if P <= FULL_INFLUENCE_MAX_PARAMS else "output_layer"
    if requested == "full" and P > FULL_INFLUENCE_MAX_PARAMS:
        raise UserError(f"pidp_sgd: influence: full needs the dense {P} × {P} Hessian of the mlp (P = {P} "
                        f"parameters > {FULL_INFLUENCE_MAX_PARAMS}, the cap): use influence: output_layer (or auto), "
                        f"or a smaller hidden layer")
    return requested


# --- Theorem 4's constants per influence mode, and what a run records -----------------------------------------


@dataclass
class ErrorConstants:
    """Theorem 4's E = (2LG + CG²/ζ)/(ζ²n²) and its L (smoothness) and C (Hessian-Lipschitz) for one round: numbers,
    or one per replica (R,) when they depend on θ (relu output layer); None where no bound exists (full mlp: E = 0
    is then used in the test, not claimed as a bound). A: the bound on ‖ã‖ of the output layer (R,), else None."""
    E: float | np.ndarray
    L: float | np.ndarray | None
    C: float | np.ndarray | None
    A: np.ndarray | None = None
    E_unclipped: np.ndarray | None = None  # E with G = A, the Lipschitz constant of the unclipped output loss


def error_constants(influence: str, model: Model, theta: np.ndarray, G: float, zeta: float, n: int) -> ErrorConstants:
    """logreg (‖x‖ ≤ 1): L = 1/4, C = max|σ''| (module docstring). mlp, full: no global L, C (non-convex, unbounded
    Hessian): E = 0. mlp, output_layer: ℓ as a function of (w₂, b₂) is logistic regression on ã with ‖ã‖ ≤ A
    (`output_feature_bound`), so L = A²/4 and C = max|σ''| A³; G is the clip bound (the test's gradients are
    clipped to it), E_unclipped uses G = A (the unclipped loss is A-Lipschitz)."""
    if model.name == "logreg":
        L, C = model.smoothness(1.0), MAX_ABS_SIGMOID_2ND
        return ErrorConstants(influence_error_bound(L, G, C, zeta, n), L, C)
    if influence == "full":
        return ErrorConstants(0.0, None, None)
    A = output_feature_bound(model, np.where(np.isfinite(theta).all(axis=1, keepdims=True), theta, 0.0))
    L, C = A**2 / 4.0, MAX_ABS_SIGMOID_2ND * A**3
    return ErrorConstants(influence_error_bound(L, G, C, zeta, n), L, C, A, influence_error_bound(L, A, C, zeta, n))


def _per_replica(values: list, reduce) -> float | list | None:
    """Reduce (rounds, R) values over rounds: a number when every replica has the same, else one per replica
    (the engine gives each seed's row its own)."""
    if values[0] is None:
        return None
    arr = reduce(np.asarray(values, dtype=float).reshape(len(values), -1), axis=0)
    return float(arr[0]) if np.all(arr == arr[0]) else [float(v) for v in arr]


def round_summary(rounds_info: list) -> dict:
    """Derived values of the rounds: Theorem 4's constants (max over rounds), the Hessian's damping."""
    infs = [inf for inf, _ in rounds_info]
    consts = [c for _, c in rounds_info]
    out = {"influence_error_bound": _per_replica([c.E for c in consts], np.max) if consts[0].L is not None else None,
           "smoothness_L": _per_replica([c.L for c in consts], np.max),
           "hessian_lipschitz_C": _per_replica([c.C for c in consts], np.max)}
    if consts[0].A is not None:
        out["output_feature_bound"] = _per_replica([c.A for c in consts], np.max)
        out["influence_error_bound_unclipped"] = _per_replica([c.E_unclipped for c in consts], np.max)
    if infs[0].shift is None:  # logreg, output layer: ζ added iff λ < ζ, the same every round
        out["hessian_damped"] = bool(infs[-1].damped)
    else:  # full Hessian of a non-linear model: per replica
        out["hessian_damped"] = [bool(v) for v in np.any([inf.damped for inf in infs], axis=0)]
        out["hessian_shift"] = [float(v) for v in np.max([inf.shift for inf in infs], axis=0)]
        out["hessian_min_eigenvalue"] = [float(v) for v in np.min([inf.min_eigenvalue for inf in infs], axis=0)]
    return out


_UNCOVERED = "noiseless steps are not covered by the accountant, whose bound assumes noise on every step"
PRIVACY_NOTES = {
    "logreg": "paper's claim: noiseless steps are covered by its influence-function argument, "
              "not by the accountant, whose bound assumes noise on every step",
    "full": "no claim: non-convex model (the paper's argument needs convexity). The full Hessian is damped to "
            "λ_min ≥ ζ, so the test's sensitivity 2G/(nζ) and σ_c hold; Theorem 4's E needs global Lipschitz, "
            "smoothness and Hessian-Lipschitz constants the mlp lacks: E = 0 is used, not a bound; " + _UNCOVERED,
    "output_layer": "no claim: non-convex model. Influence restricted to the output layer (Koh & Liang 2017): c_z is "
                    "the influence in the logistic regression on the frozen hidden features ã = [a(x), 1]; σ_c holds "
                    "(clipped G, λ_min ≥ ζ); E is Theorem 4's bound for that regression (‖ã‖ ≤ A, L = A²/4, "
                    "C = max|σ''|A³, G = the clip), not a bound on the error for the whole network; " + _UNCOVERED,
}


def indexed_poisson_batches(X: np.ndarray, y: np.ndarray, q: float,
                            streams: ReplicaStreams) -> Iterator[tuple[np.ndarray, Batch]]:
    """The batches of `poisson_batches` (same draws, so the same batches as `dp_sgd` for a seed) with their
    example indices (R, M), −1 on padding. Runs the shared sampler on the column of row indices."""
    n = X.shape[0]
    x_norm = row_norms(X)
    for b in poisson_batches(np.arange(n, dtype=float)[:, None], y, q, streams):
        idx = np.where(b.weight > 0, b.X[..., 0], -1).astype(np.int64)
        yield idx, gather(X, y, x_norm, idx)


# ------------------------------------------------------------------------------------------------
# Noise of the noisy steps
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoisyStepCalibration:
    sigma: float  # noise multiplier: N(0, (σG)² I) on the sum of clipped gradients
    epsilon: float  # achieved ε₁ (≤ target)
    accountant: str
    library: str
    valid: bool = True  # classical Gaussian bound holds (composition accountant: per-step ε₀ < 1)
    note: str = ""


def calibrate_noisy_steps(epsilon_1: float, delta_1: float, q: float, steps: int,
                          accountant: str) -> NoisyStepCalibration:
    if accountant in ("rdp", "pld"):
        cal = calibrate_sigma(epsilon_1, delta_1, q, steps, accountant=accountant)
        return NoisyStepCalibration(cal.sigma, cal.epsilon, cal.accountant, cal.library)
    # Classical: per-step (ε_s, δ_s) from the better of basic and advanced composition over T steps, then
    # invert tight Poisson amplification ε_s = ln(1 + q(e^{ε₀} − 1)), δ_s = q δ₀, then σ = √(2 ln(1.25/δ₀))/ε₀.
    eps_adv, delta_adv = advanced_composition_epsilon_per_step(epsilon_1, delta_1, steps)
    eps_s, delta_s = max((eps_adv, delta_adv), (epsilon_1 / steps, delta_1 / steps))
    eps_0 = math.log1p(math.expm1(eps_s) / q)
    delta_0 = min(delta_s / q, 0.5)
    sigma = math.sqrt(2.0 * math.log(1.25 / delta_0)) / eps_0
    valid = eps_0 < 1.0 and delta_s / q < 1.0
    note = "" if valid else f"per-step ε₀ = {eps_0:.3g} ≥ 1 (classical Gaussian bound valid for ε < 1)"
    return NoisyStepCalibration(sigma, epsilon_1, "composition", "closed form (dpsgd_cli.privacy.mechanisms)",
                                valid, note)


# ------------------------------------------------------------------------------------------------
# The algorithm
# ------------------------------------------------------------------------------------------------


class _OffsetCheckpoints:
    """Checkpoints of a chain run that starts after `offset` examples (a round's chain counts from 0)."""

    def __init__(self, inner: Checkpoints, offset: int):
        self.inner, self.offset = inner, offset

    def maybe_record(self, model, theta, before, after):
        self.inner.maybe_record(model, theta, before + self.offset, after + self.offset)


class PIDPSGD(Algorithm):
    """PIDP-SGD (Kang et al., arXiv:2002.08578, Algorithm 1): DP-SGD whose steps skip the noise when every example
    of the batch passed the private influence test ‖2c_z + N(0, σ_c² I)‖ ≤ r. Models: logreg, mlp (`influence`:
    full dense Hessian or output layer). Assumptions, formulas and every reading of the pseudo-code: see the module
    docstring."""

    name = "pidp_sgd"
    private = True
    uses = frozenset({"epsilon", "batch_size", "lr", "epochs", "l2"})
    Params = PIDPSGDParams
    source = "Kang, Li, Liu, Wang, Data Heterogeneity Differential Privacy: From Theory to Algorithm, arXiv:2002.08578"

    def schedule(self, setting: Setting) -> tuple[int, int]:
        """(R, T_local)."""
        rounds = self.params.rounds or max(1, round(setting.epochs))
        local = self.params.local_steps or max(1, round(setting.steps / rounds))
        return rounds, local

    def fit(self, setting: Setting, model: Model, X, y, streams: ReplicaStreams) -> Outcome:
        p = self.params
        influence = resolve_influence(p.influence, model)
        if not 1 <= setting.batch_size <= setting.n:
            raise UserError(f"pidp_sgd: batch_size = {setting.batch_size} must be in [1, n = {setting.n}]")
        n, d, B = setting.n, model.n_params, setting.batch_size
        rounds, local = self.schedule(setting)
        steps, q = rounds * local, setting.sample_rate
        eps_1, eps_2 = EPSILON_1_SHARE * setting.epsilon, (1 - EPSILON_1_SHARE) * setting.epsilon
        delta_1 = delta_2 = setting.delta / 2
        G = GRADIENT_CLIP
        sigma_c = contribution_sigma(G, rounds, delta_2, n, p.zeta, eps_2)
        cal = calibrate_noisy_steps(eps_1, delta_1, q, steps, p.accountant)

        x_norm = row_norms(X)
        batches = indexed_poisson_batches(X, y, q, streams)
        noise = streams.normal("noise", (d,))
        test_gens = [g.spawn(1)[0] for g in streams.generators("noise")]  # independent of the step noise
        ckpt = Checkpoints(setting.trace_every, X, y) if setting.trace_every else None
        current = {"idx": None, "eligible": None}
        noiseless_steps = np.zeros(streams.replicas)
        empty_steps = np.zeros(streams.replicas)  # Poisson batches with no example: noiseless (vacuously)
        eligible_share = []
        rows = np.arange(streams.replicas)[:, None]

        def tracked() -> Iterator[Batch]:
            for idx, batch in batches:
                current["idx"] = idx
                yield batch

        def noise_unless_all_eligible(std: float, draws: Iterator[np.ndarray]) -> Transform:
            def transform(g, theta):
                idx = current["idx"]
                ok = np.where(idx >= 0, current["eligible"][rows, np.maximum(idx, 0)], True).all(axis=1)
                noiseless_steps[:] += ok
                empty_steps[:] += (idx < 0).all(axis=1)
                return g + np.where(ok, 0.0, std)[:, None] * next(draws)
            return transform

        rounds_info: list[tuple[RoundInfluence, ErrorConstants]] = []
        theta = model.init(streams.generators("init"))
        for k in range(rounds):
            constants = error_constants(influence, model, theta, G, p.zeta, n)
            round_inf = round_influence(influence, model, theta, X, y, x_norm, setting.l2, p.zeta, G)
            current["eligible"] = private_test(round_inf, constants.E, sigma_c, p.radius, test_gens)
            rounds_info.append((round_inf, constants))
            eligible_share.append(current["eligible"].mean(axis=1))
            chain = GradientChain(
                batches=tracked(), clip=G,
                transforms=[noise_unless_all_eligible(cal.sigma * G, noise), scale(1.0 / B), add_l2(setting.l2)],
                schedule=constant(setting.lr), project=project_to_ball(p.radius),
                checkpoints=_OffsetCheckpoints(ckpt, round(k * local * B)) if ckpt else None,
                examples_per_step=B,
            )
            theta = chain.run(model, theta, local)

        fraction = noiseless_steps / steps
        guarantee = self.guarantee(model, X, rounds, eps_2, cal)
        derived = {
            "steps": steps, "sample_rate": q, "sigma": cal.sigma, "epsilon_achieved": cal.epsilon + eps_2,
            "accountant": cal.accountant, "accountant_library": cal.library,
            "rounds": rounds, "local_steps": local, "epsilon_1": eps_1, "epsilon_2": eps_2,
            "delta_1": delta_1, "delta_2": delta_2, "epsilon_1_achieved": cal.epsilon,
            "noise_std": cal.sigma * G / B, "sigma_c": sigma_c, "c_prime": C_PRIME,
            "influence": influence, "influence_dim": rounds_info[0][0].dim,
            "lipschitz_G": G, **round_summary(rounds_info),
            "zeta": p.zeta, "radius": p.radius,
            "noiseless_fraction": [float(f) for f in fraction],
            "noiseless_fraction_mean": float(fraction.mean()),
            "eligible_fraction": [float(f) for f in np.mean(eligible_share, axis=0)],
            "empty_step_fraction": [float(f) for f in empty_steps / steps],
            "privacy_note": PRIVACY_NOTES["logreg" if model.name == "logreg" else influence],
        }
        return Outcome(theta, derived, guarantee, trace=ckpt.rows if ckpt else [])

    @staticmethod
    def guarantee(model: Model, X: np.ndarray, rounds: int, eps_2: float, cal: NoisyStepCalibration) -> str:
        """PAPER_CLAIM when the assumptions of the paper's claim hold, else the first one that fails."""
        if not model.convex:
            return "none: non-convex model"
        if unit_ball_violation(X):
            return unit_ball_violation(X)
        if eps_2 / rounds >= 1.0:
            return (f"none: per-round test budget ε₂/R = {eps_2 / rounds:.3g} ≥ 1 (σ_c uses the classical "
                    f"Gaussian mechanism, valid for ε < 1)")
        if not cal.valid:
            return f"none: {cal.note}"
        return PAPER_CLAIM
