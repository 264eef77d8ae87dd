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
from dpsgd_cli.models import Batch, Model
from dpsgd_cli.privacy.accounting import calibrate_sigma
from dpsgd_cli.privacy.mechanisms import advanced_composition_epsilon_per_step

C_PRIME = 2.83  # the paper's constant in σ_c (≈ 2√2)
EPSILON_1_SHARE = 0.75  # ε₁ = 3ε/4 for the noisy steps, ε₂ = ε/4 for the contribution tests (paper's experiments)
MAX_ABS_SIGMOID_2ND = 1.0 / (6.0 * math.sqrt(3.0))  # max |σ''| of the logistic sigmoid, at σ = (3 ± √3)/6
_ROW_CHUNK = 4096  # rows per block when forming H and H⁻¹x for all examples (bounds memory to R·chunk·d)

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


def logreg_hessian(theta: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float) -> np.ndarray:
    """∇²F(θ) = (1/n) Σ σ'(y_i θ·x_i) x_i x_iᵀ + λI for every replica: (R, d, d); blocks of rows, no example loop."""
    n, d = X.shape
    H = np.zeros((theta.shape[0], d, d))
    for start in range(0, n, _ROW_CHUNK):
        Xc = X[start:start + _ROW_CHUNK]
        m = (theta @ Xc.T) * y[start:start + _ROW_CHUNK]  # (R, chunk) margins
        w = expit(m) * expit(-m)  # σ'(m), symmetric in m
        H += np.matmul(Xc.T[None] * w[:, None, :], Xc)  # Σ_i w_ri x_i x_iᵀ by BLAS
    H /= n
    H += l2 * np.eye(d)
    return H


def damped(H: np.ndarray, l2: float, zeta: float) -> tuple[np.ndarray, bool]:
    """H + ζI when λ < ζ (so that λ_min ≥ ζ), else H; and whether ζ was added."""
    if l2 < zeta:
        return H + zeta * np.eye(H.shape[-1]), True
    return H, False


def clipped_residuals(theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, G: float) -> np.ndarray:
    """a_i with clip_G(∇ℓ(θ; x_i, y_i)) = a_i x_i: (R, n) (∇ℓ = −y σ(−y θ·x) x, clipped to norm ≤ G)."""
    residual = -y * expit(-y * (theta @ X.T))
    norm = np.abs(residual) * x_norm
    return residual * G / np.maximum(norm, G)


def influence_vectors(theta: np.ndarray, X: np.ndarray, y: np.ndarray, H_inv: np.ndarray, n: int,
                      G: float) -> np.ndarray:
    """v_z = (1/n) H⁻¹ clip_G(∇ℓ(θ, z)) for the rows of X: (R, m, d)."""
    a = clipped_residuals(theta, X, y, row_norms(X), G)
    return np.einsum("rm,rde,me->rmd", a, H_inv, X, optimize=True) / n


def influence_norms(theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, H_inv: np.ndarray,
                    G: float) -> np.ndarray:
    """‖v_z‖ = (1/n) |a_z| ‖H⁻¹ x_z‖ for every example: (R, n), in blocks of rows (H⁻¹ symmetric)."""
    n = X.shape[0]
    out = np.empty((theta.shape[0], n))
    for start in range(0, n, _ROW_CHUNK):
        sl = slice(start, start + _ROW_CHUNK)
        hx = np.matmul(X[sl][None], H_inv)  # (R, chunk, d): rows are (H⁻¹ x_i)ᵀ
        a = clipped_residuals(theta, X[sl], y[sl], x_norm[sl], G)
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


def contribution_test(theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, l2: float, zeta: float,
                      G: float, E: float, sigma_c: float, radius: float,
                      generators: list[np.random.Generator]) -> tuple[np.ndarray, bool]:
    """One round's private test at the global model θ (R, d): (eligible (R, n) = ‖2c_z + N(0, σ_c² I)‖ ≤ r with
    ‖c_z‖ = ‖(1/n) H⁻¹ clip_G(∇ℓ(θ, z))‖ + E, whether ζ was added to H). H is inverted once."""
    d = X.shape[1]
    at = np.where(np.isfinite(theta).all(axis=1, keepdims=True), theta, 0.0)  # a diverged replica stays NaN
    H, was_damped = damped(logreg_hessian(at, X, y, l2), l2, zeta)
    H_inv = np.linalg.solve(H, np.broadcast_to(np.eye(d), H.shape))
    H_inv = 0.5 * (H_inv + np.swapaxes(H_inv, 1, 2))  # exactly symmetric (influence_norms relies on it)
    c_norm = influence_norms(at, X, y, x_norm, H_inv, G) + E
    return noised_norms(c_norm, sigma_c, d, generators) <= radius, was_damped


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
    of the batch passed the private influence test ‖2c_z + N(0, σ_c² I)‖ ≤ r. Assumptions, formulas and every
    reading of the pseudo-code: see the module docstring."""

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
        if getattr(model, "name", None) != "logreg":
            raise UserError(f"pidp_sgd needs the loss's Hessian and its Lipschitz constants, implemented for "
                            f"logreg only; got model {getattr(model, 'name', model)!r}: use models: [logreg]")
        if not 1 <= setting.batch_size <= setting.n:
            raise UserError(f"pidp_sgd: batch_size = {setting.batch_size} must be in [1, n = {setting.n}]")
        p = self.params
        n, d, B = setting.n, model.n_params, setting.batch_size
        rounds, local = self.schedule(setting)
        steps, q = rounds * local, setting.sample_rate
        eps_1, eps_2 = EPSILON_1_SHARE * setting.epsilon, (1 - EPSILON_1_SHARE) * setting.epsilon
        delta_1 = delta_2 = setting.delta / 2
        G, L, C = model.lipschitz(1.0), model.smoothness(1.0), MAX_ABS_SIGMOID_2ND
        E = influence_error_bound(L, G, C, p.zeta, n)
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

        damped_any = False
        theta = model.init(streams.generators("init"))
        for k in range(rounds):
            current["eligible"], damped_any = contribution_test(theta, X, y, x_norm, setting.l2, p.zeta, G, E, sigma_c,
                                                                p.radius, test_gens)
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
            "influence_error_bound": E, "lipschitz_G": G, "smoothness_L": L, "hessian_lipschitz_C": C,
            "zeta": p.zeta, "radius": p.radius, "hessian_damped": damped_any,
            "noiseless_fraction": [float(f) for f in fraction],
            "noiseless_fraction_mean": float(fraction.mean()),
            "eligible_fraction": [float(f) for f in np.mean(eligible_share, axis=0)],
            "empty_step_fraction": [float(f) for f in empty_steps / steps],
            "privacy_note": "paper's claim: noiseless steps are covered by its influence-function argument, "
                            "not by the accountant, whose bound assumes noise on every step",
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
