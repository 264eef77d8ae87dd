"""PIDP-SGD: DP-SGD that skips the noise on steps whose example barely moves the model (Kang, Li, Liu, Wang, "Data
Heterogeneity Differential Privacy", Algorithm 1, Theorems 4-5). "Line k" is the paper's numbering of Algorithm 1;
the algorithm as run, its readings (`DEVIATIONS`), τ and the TV bound: docs/algorithms.md (pidp_sgd)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, Field
from scipy.special import ndtr

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Setting, Tags
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.ops import Clip, MaskedNoise, Op, ProjectBall, ProjectBox, Scale, Sgd, WeightDecay, constant
from dpsgd_cli.algorithms.sampling import fixed_batches, poisson_batches, uniform_examples
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.compiled import Backend
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.models import MLP, Model
from dpsgd_cli.models.logreg import (
    MAX_ABS_SIGMOID_2ND,
    LogisticRegression,
    clipped_residual,
    logistic_hessian,
    logistic_residual,
    margins,
)
from dpsgd_cli.models.rows import cached_row_norms
from dpsgd_cli.privacy.accounting import calibrate_sigma
from dpsgd_cli.privacy.mechanisms import advanced_composition_epsilon_per_step, analytic_gaussian_epsilon
from dpsgd_cli.privacy.single_example_gaussian import calibrate_bassily

scipy_stats = LazyModule("scipy.stats")  # slow to import, and only the l2_radius bound needs it
C_PRIME = 2.83  # the paper's constant in σ_c (proof of Theorem 5: "with c′ = 2.83")
EPSILON_1_SHARE = 0.75  # ε₁ = 3ε/4 for the training steps, ε₂ = ε/4 for the contributions (§7)
_ROW_CHUNK = 4096  # rows per block when forming H and H⁻¹x for all examples (bounds memory to R·chunk·d)
GRADIENT_CLIP = 1.0  # G: every per-example gradient is clipped to it (= model.lipschitz(1) for logreg: a no-op)
# `influence: full` builds the dense P × P Hessian from P Hessian–vector products (cost ≈ P full-data passes, plus
# n·P² per round for H⁻¹∇ℓ of every example): refused above this many parameters (use `output_layer`).
FULL_INFLUENCE_MAX_PARAMS = 3000
Num = float | np.ndarray  # a number, or one per replica
_BLOCK_ELEMENTS = 1 << 21  # numbers per (R, chunk, P) temporary of the per-example influence vectors


class PIDPSGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    zeta: float = Field(0.01, gt=0, description="ζ: lower bound on λ_min(H); added to H's diagonal when λ < ζ")
    radius: float = Field(10.0, gt=0, description="r: the radius of the bounded parameter space in the threshold "
                                                  "(coordinate: |[c_t]_i| ≤ 2rδ₁(1 + e^{−ε₁}); l2_radius: ‖c̃‖ ≤ r)")
    rule: Literal["coordinate", "l2_radius"] = Field(
        "coordinate", description="coordinate: Algorithm 1's per-coordinate test (lines 9-10); l2_radius: the "
                                  "earlier non-paper test ‖2c + N(0, σ_c² I)‖ ≤ r")
    sampling: Literal["single", "poisson"] = Field(
        "single", description="single: one uniformly drawn example per step (line 6; needs batch_size 1); "
                              "poisson: mini-batches of expected size batch_size (non-paper variant)")
    contribution_noise: Literal["per_round", "per_step"] = Field(
        "per_round", description="b^(c) drawn once per example and round (the proof's R releases, default) or at "
                                 "every step (line 8 as written)")
    project: bool | Literal["box"] = Field(
        False, description="after each step, box: clip θ to [−r, r]^m (the parameter space Theorem 5's proof "
        "assumes); true: project onto ‖θ‖ ≤ r; false: none, as Algorithm 1 is written")
    rounds: int | None = Field(None, ge=1, description="R global rounds (Hessian recomputed each); "
                                                          "default one per epoch, round(epochs)")
    local_steps: int | None = Field(None, ge=1, description="T_local steps per round; default "
                                                               "round(epochs·n/B / R)")
    accountant: Literal["auto", "rdp", "pld", "composition"] = Field(
        "auto", description="σ of the noisy steps for (3ε/4, δ/2) over T steps: auto and pld: dp-accounting's PLD "
                            "(the tightest accountant of the mechanism, as the baselines of a comparison grid get); "
                            "rdp: its RDP (single: PLD where RDP cannot reach ε₁); poisson also: classical Gaussian "
                            "+ amplification + composition")
    influence: Literal["auto", "full", "output_layer"] = Field(
        "auto", description="parameters the influence c_z = (1/n) H⁻¹∇ℓ is computed over: full (dense Hessian of "
                            f"F, P ≤ {FULL_INFLUENCE_MAX_PARAMS}), output_layer (mlp: (w₂, b₂) only, Koh & Liang "
                            "2017; a deviation), auto (full for logreg and small networks, else output_layer)")
    backend: Backend = Field(
        "auto", description="sampling single (logreg, mlp): the numba single-example kernel (auto: when numba is "
                            "installed) or numpy; same result")


# --- Formulas (module-level so that the tests check them by hand) -------------------------------------------------


def contribution_sigma(G: float, rounds: int, delta_2: float, n: int, zeta: float, epsilon_2: float,
                       c_prime: float = C_PRIME) -> float:
    """σ_c = c' G R √(log(1.25 R/δ₂)) / (n ζ ε₂) (Kang et al., Theorem 5)."""
    return c_prime * G * rounds * math.sqrt(math.log(1.25 * rounds / delta_2)) / (n * zeta * epsilon_2)


def influence_error_bound(L: Num, G: Num, C: Num, zeta: float, n: int) -> Num:
    """E = (2LG + CG²/ζ) / (ζ² n²) (Kang et al., Theorem 4): L smoothness, G Lipschitz, C Hessian-Lipschitz."""
    return (2.0 * L * G + C * G**2 / zeta) / (zeta**2 * n**2)


def coordinate_threshold(radius: float, epsilon_1: float, delta_1: float) -> float:
    """τ = 2rδ₁(1 + e^{−ε₁}): Algorithm 1's two-stage test (lines 9-10) reduced to max_i |[c_t]_i| ≤ τ
    (docs/algorithms.md)."""
    return 2.0 * radius * delta_1 * (1.0 + math.exp(-epsilon_1))


def paper_two_stage_test(c: np.ndarray, radius: float, epsilon_1: float, delta_1: float) -> bool:
    """Algorithm 1 lines 9-10 literally, for one vector c_t: True (noiseless step) iff no |[c_t]_i| ≥
    2re^{ε₁}δ₁/(e^{ε₁} − 1) and ln(2re^{ε₁}δ₁/(2re^{ε₁}δ₁ − (e^{ε₁} − 1) sign([c_t]_i)[c_t]_i)) ≤ 2ε₁ for all i."""
    a, k = 2.0 * radius * math.exp(epsilon_1) * delta_1, math.expm1(epsilon_1)
    c = np.asarray(c, dtype=float)
    if np.any(np.abs(c) >= a / k):
        return False  # "jump to line 13": the noisy step
    return bool(np.all(np.log(a / (a - k * np.sign(c) * c)) <= 2.0 * epsilon_1))


def _interval_probability(lo: ArrayLike, hi: ArrayLike) -> np.ndarray:
    """P(lo ≤ Z ≤ hi), Z ~ N(0, 1), without cancellation in the upper tail."""
    lo, hi = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
    return cast(np.ndarray, np.where(lo > 0, ndtr(-lo) - ndtr(-hi), ndtr(hi) - ndtr(lo)))


def coordinate_pass_probability(mu: np.ndarray, sigma_c: float, tau: float) -> np.ndarray:
    """P(max_i |2μ_i + b_i| ≤ τ), b ~ N(0, σ_c² I): Π_i P(|2μ_i + σ_c Z| ≤ τ), over the last axis of μ."""
    mu = np.asarray(mu, dtype=float)
    factors = _interval_probability((-tau - 2.0 * mu) / sigma_c, (tau - 2.0 * mu) / sigma_c)
    return cast(np.ndarray, np.prod(factors, axis=-1))


def skip_probability_bound(rule: str, dim: int, sigma_c: float, threshold: float, E: float) -> float:
    """p ≥ P(a step skips the noise) on every dataset (docs/algorithms.md): the pass probability at the smallest
    contribution the reading of "c_z + E" allows, |[c^(o)]_i| = E (coordinate) or ‖c^(o)‖ = E (l2_radius).
    `threshold`: τ (coordinate) or r (l2_radius)."""
    if rule == "coordinate":
        factor = float(_interval_probability((-threshold - 2.0 * E) / sigma_c, (threshold - 2.0 * E) / sigma_c))
        return float(math.exp(dim * math.log(factor))) if factor > 0 else 0.0
    x, nc = (threshold / sigma_c) ** 2, (2.0 * E / sigma_c) ** 2
    return float(scipy_stats.ncx2.cdf(x, dim, nc) if nc > 0 else scipy_stats.chi2.cdf(x, dim))


def certified_delta(delta: float, epsilon_1: float, steps: int, p: float) -> float:
    """δ + (1 + e^{ε₁})·T·p: the δ of the total-variation bound (docs/algorithms.md), for δ = δ₁ + δ₂."""
    return delta + (1.0 + math.exp(epsilon_1)) * steps * p


def tv_guarantee(epsilon: float, delta: float, epsilon_1: float, steps: int, p: float) -> tuple[str, float]:
    """(guarantee text, certified δ or NaN): the total-variation bound where it is < 1, else "none"."""
    bound = certified_delta(delta, epsilon_1, steps, p)
    if bound >= 1.0:
        return (f"none: a step may skip the noise with probability p = {p:.3g}, so the certified δ′ = δ₁ + "
                f"(1 + e^ε₁)·T·p ≥ 1 (T·p = {steps * p:.3g}): no DP bound (Theorem 5's proof does not cover the "
                f"noiseless steps)", float("nan"))
    return (f"tv-bound: ({epsilon:.4g}, {bound:.3g})-DP [DP-SGD at (ε₁, δ₁) within total variation T·p, "
            f"p = {p:.3g} per step on every dataset, T = {steps}]", bound)


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


def noised_norms(c_norm: np.ndarray, sigma_c: float, d: int, generators: list[np.random.Generator]) -> np.ndarray:
    """‖2c + N(0, σ_c² I_d)‖ for c of norm `c_norm` (R, n), one generator per replica.

    Exact in distribution: rotate 2c onto e₁, then ‖·‖² = (2‖c‖ + σ_c Z)² + σ_c² χ²_{d−1}.
    """
    n = c_norm.shape[1]
    z = np.stack([g.standard_normal(n) for g in generators])
    chi2 = np.stack([g.chisquare(d - 1, n) if d > 1 else np.zeros(n) for g in generators])
    return np.sqrt((2.0 * c_norm + sigma_c * z) ** 2 + sigma_c**2 * chi2)


# --- one round's influence and the private test -------------------------------------------------------------


@dataclass
class RoundInfluence:
    """One round's influence machinery at the global model: c_z = (1/n) H⁻¹ clip_G(∇ℓ(θ_k, z)) for any rows.

    kind: full (logreg or dense mlp) or output_layer; at: θ_k (R, P) (diverged replicas evaluated at 0); w: the
    parameters c_z is taken over (θ_k, or the output layer (R, h + 1)); H_inv (R, m, m); dim = m; damped: ζ was
    added (bool, or (R,) for the dense mlp); shift, min_eigenvalue (R,): the dense mlp's spectral damping."""
    kind: str
    model: Model | None
    at: np.ndarray
    w: np.ndarray
    H_inv: np.ndarray
    n: int
    G: float
    damped: bool | np.ndarray
    shift: np.ndarray | None = None
    min_eigenvalue: np.ndarray | None = None

    @property
    def dim(self) -> int:
        return int(self.H_inv.shape[-1])

    @property
    def rows_per_block(self) -> int:
        return max(1, min(_ROW_CHUNK, _BLOCK_ELEMENTS // max(1, int(self.at.shape[0]) * self.dim)))

    def vectors(self, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, replicas: slice = slice(None)) -> np.ndarray:
        """c_z (without E) for the rows X (k, d) and the chosen replicas: (R', k, m). H⁻¹ is symmetric, so the rows
        of g H⁻¹ are (H⁻¹ g)ᵀ."""
        at, w, H_inv = self.at[replicas], self.w[replicas], self.H_inv[replicas]
        if self.kind == "full" and isinstance(self.model, MLP):
            g = self.model.per_example_clipped_gradients(at, X, y, x_norm, self.G)
            return cast(np.ndarray, np.matmul(g, H_inv) / self.n)
        if self.kind == "output_layer" and isinstance(self.model, MLP):
            F = self.model.output_features(at, X)  # (R', k, h + 1)
            a = clipped_residual(logistic_residual(margins(w, F), y), np.sqrt(np.einsum("rmd,rmd->rm", F, F)), self.G)
            return cast(np.ndarray, a[..., None] * np.matmul(F, H_inv) / self.n)
        a = clipped_residual(logistic_residual(margins(w, X), y), x_norm, self.G)  # logistic regression
        return cast(np.ndarray, a[..., None] * np.matmul(X[None], H_inv) / self.n)

    def blocks(self, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray,
               replicas: slice = slice(None)) -> Iterator[tuple[slice, np.ndarray]]:
        for start in range(0, X.shape[0], self.rows_per_block):
            sl = slice(start, start + self.rows_per_block)
            yield sl, self.vectors(X[sl], y[sl], x_norm[sl], replicas)

    def norms(self, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray) -> np.ndarray:
        """‖c_z‖ for every row: (R, n)."""
        out = np.empty((self.at.shape[0], X.shape[0]))
        for sl, v in self.blocks(X, y, x_norm):
            out[:, sl] = np.linalg.norm(v, axis=-1)
        return out


def _finite(theta: np.ndarray) -> np.ndarray:
    """θ with each diverged replica (a non-finite entry) at 0: the round's computations stay finite for the others."""
    return np.where(np.isfinite(theta).all(axis=1, keepdims=True), theta, 0.0)


def round_influence(influence: str, model: Model | None, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                    x_norm: np.ndarray, l2: float, zeta: float, G: float) -> RoundInfluence:
    """The Hessian at the global model θ (R, P) for `influence` ∈ {full, output_layer}, damped and inverted once
    (line 4). A diverged replica (non-finite θ) is evaluated at 0 and stays NaN; the others are unaffected."""
    at = _finite(theta)
    n = X.shape[0]
    if influence == "full" and (model is None or model.name == "logreg"):
        H, was_damped = damped(logistic_hessian(at, X, y, l2), l2, zeta)
        return RoundInfluence("full", model, at, at, symmetric_inverse(H), n, G, was_damped)
    if influence == "full" and model is not None:
        H, shift, mu = damped_by_spectrum(model.hessian(at, X, y), zeta)
        return RoundInfluence("full", model, at, at, symmetric_inverse(H), n, G, shift > 0, shift, mu)
    if influence == "output_layer" and isinstance(model, MLP):
        mlp = model
        w = mlp.output_layer_params(at)
        H, was_damped = damped(logistic_hessian(w, X, y, l2, features=lambda rows: mlp.output_features(at, rows)),
                               l2, zeta)
        return RoundInfluence("output_layer", model, at, w, symmetric_inverse(H), n, G, was_damped)
    raise ValueError(f"influence {influence!r} is not defined for model {getattr(model, 'name', model)!r}")


def with_error(v: np.ndarray, E: float | np.ndarray) -> np.ndarray:
    """c^(o) = c_z + E read per coordinate: sign([c_z]_i)(|[c_z]_i| + E), sign(0) = +1 (docs/algorithms.md).
    v (R', k, m); E a number or one per replica (R',)."""
    E = np.asarray(E, dtype=float)
    E = E[:, None, None] if E.ndim == 1 else E
    return cast(np.ndarray, v + np.where(v >= 0, 1.0, -1.0) * E)


@dataclass(frozen=True)
class DecisionRule:
    """The private test of one run: rule, σ_c, its threshold (τ for coordinate, r for l2_radius)."""
    rule: str
    sigma_c: float
    threshold: float

    def passes(self, v: np.ndarray, E: float | np.ndarray, generators: list[np.random.Generator]) -> np.ndarray:
        """(R', k) bool, one generator per replica: coordinate: max_i |2c^(o)_i + b_i| ≤ τ with b ~ N(0, σ_c² I_m)
        drawn in full (lines 8-10); l2_radius: ‖2c + b‖ ≤ r with ‖c‖ = ‖c_z‖ + E (sampled through the norm)."""
        k, m = v.shape[1], v.shape[2]
        if self.rule == "coordinate":
            b = np.stack([g.standard_normal((k, m)) for g in generators])
            noised = np.max(np.abs(2.0 * with_error(v, E) + self.sigma_c * b), axis=-1)
            return cast(np.ndarray, noised <= self.threshold)
        E = np.asarray(E, dtype=float)
        c_norm = np.linalg.norm(v, axis=-1) + (E[:, None] if E.ndim == 1 else E)
        return noised_norms(c_norm, self.sigma_c, m, generators) <= self.threshold


def round_eligible(inf: RoundInfluence, rule: DecisionRule, E: float | np.ndarray, X: np.ndarray, y: np.ndarray,
                   x_norm: np.ndarray, generators: list[np.random.Generator]) -> np.ndarray:
    """`contribution_noise: per_round`: one test per example and replica at the round's model: (R, n) bool."""
    out = np.empty((inf.at.shape[0], X.shape[0]), dtype=bool)
    for sl, v in inf.blocks(X, y, x_norm):
        out[:, sl] = rule.passes(v, E, generators)
    return out


def step_noiseless(inf: RoundInfluence, rule: DecisionRule, E: float | np.ndarray, X: np.ndarray, y: np.ndarray,
                   x_norm: np.ndarray, idx: np.ndarray, generators: list[np.random.Generator]) -> np.ndarray:
    """`contribution_noise: per_step`: a fresh test for every step's example idx (T, R): (T, R) bool."""
    E = np.asarray(E, dtype=float)
    out = np.empty(idx.shape, dtype=bool)
    for r, gen in enumerate(generators):
        rows = idx[:, r]
        E_r = E[r] if E.ndim == 1 else E
        for sl, v in inf.blocks(X[rows], y[rows], x_norm[rows], slice(r, r + 1)):
            out[sl, r] = rule.passes(v, E_r, [gen])[0]
    return out


def _no_hessian(model_name: str) -> UserError:
    return UserError(f"pidp_sgd needs the loss's Hessian: implemented for logreg and mlp; got model {model_name!r}: "
                     f"use models: [logreg] or [mlp]")


def resolve_influence(requested: str, model: Model) -> str:
    """`influence` as run: logreg → full (its only layer is its output layer); mlp: auto → full when
    P ≤ FULL_INFLUENCE_MAX_PARAMS else output_layer; full above the cap is refused."""
    if model.name == "logreg":
        return "full"
    if not isinstance(model, MLP):
        raise _no_hessian(model.name)
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
    E_unclipped: float | np.ndarray | None = None  # E with G = A, the Lipschitz constant of the unclipped output loss


def error_constants(influence: str, model: Model, theta: np.ndarray, G: float, zeta: float, n: int) -> ErrorConstants:
    """logreg (‖x‖ ≤ 1): L = 1/4, C = max|σ''| (docs/algorithms.md). mlp, full: no global L, C (non-convex, unbounded
    Hessian): E = 0. mlp, output_layer: ℓ as a function of (w₂, b₂) is logistic regression on ã with ‖ã‖ ≤ A
    (`output_feature_bound`), so L = A²/4 and C = max|σ''| A³; G is the clip bound (the test's gradients are
    clipped to it), E_unclipped uses G = A (the unclipped loss is A-Lipschitz)."""
    if isinstance(model, LogisticRegression):
        L, C = model.smoothness(1.0), MAX_ABS_SIGMOID_2ND
        return ErrorConstants(influence_error_bound(L, G, C, zeta, n), L, C)
    if influence == "full" or not isinstance(model, MLP):
        return ErrorConstants(0.0, None, None)
    A = model.output_feature_bound(_finite(theta))
    L_A, C_A = A**2 / 4.0, MAX_ABS_SIGMOID_2ND * A**3
    return ErrorConstants(influence_error_bound(L_A, G, C_A, zeta, n), L_A, C_A, A,
                          influence_error_bound(L_A, A, C_A, zeta, n))


def _per_replica(values: list[Any], reduce: Callable[..., np.ndarray]) -> float | list[float] | None:
    """Reduce (rounds, R) values over rounds: a number when every replica has the same, else one per replica
    (the engine gives each seed's row its own)."""
    if values[0] is None:
        return None
    arr = reduce(np.asarray(values, dtype=float).reshape(len(values), -1), axis=0)
    return float(arr[0]) if np.all(arr == arr[0]) else [float(v) for v in arr]


def round_summary(rounds_info: list[tuple[RoundInfluence, ErrorConstants]]) -> dict[str, Any]:
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
        out["hessian_damped"] = [bool(v) for v in np.any(np.array([inf.damped for inf in infs]), axis=0)]
        out["hessian_shift"] = [float(v) for v in np.max(np.array([inf.shift for inf in infs]), axis=0)]
        lowest = np.min(np.array([inf.min_eigenvalue for inf in infs]), axis=0)
        out["hessian_min_eigenvalue"] = [float(v) for v in lowest]
    return out


# H⁻¹ is computed from the data: one record changes H by ≤ 2β/n, so every other example's c_z moves too (by up
# to 2βG/(n²ζ²)); the proof of Theorem 5 counts only the changed example's contribution (bound 2G/(nζ)).
_DATA_DEPENDENT_H = ("σ_c's sensitivity 2G/(nζ) bounds the changed example's contribution only: H⁻¹ depends on the "
                     "data, so every other example's c_z moves too (≤ 2βG/(n²ζ²)), which the proof does not count")
PRIVACY_NOTES = {
    "logreg": "Theorem 5's proof does not cover the noiseless steps (see `guarantee` for what is proved); "
              + _DATA_DEPENDENT_H,
    "full": "non-convex model: the dense Hessian is damped to λ_min ≥ ζ, so ‖H⁻¹‖ ≤ 1/ζ; "
            + _DATA_DEPENDENT_H + "; "
            "Theorem 4's E needs global Lipschitz, smoothness and Hessian-Lipschitz constants the mlp lacks: E = 0 "
            "is used, not a bound",
    "output_layer": "deviation: c_z over the output layer only (Koh & Liang 2017), the paper takes all m "
                    "parameters; E is Theorem 4's bound for the logistic regression on the frozen hidden features "
                    "(‖ã‖ ≤ A, L = A²/4, C = max|σ''|A³, G = the clip), not for the network",
}

# Every departure of a run from Algorithm 1 (lines in the paper's numbering, docs/algorithms.md), readings included,
# by key; `PIDPSGD.deviations` lists those of a run in `derived.deviations`.
DEVIATIONS = {
    "rule_l2_radius": "rule l2_radius: the test ‖2c + N(0, σ_c² I)‖ ≤ r, not in the paper (lines 9-10 test each "
                      "coordinate)",
    "sampling_poisson": "Poisson mini-batches with dp_sgd's σ (line 6: one example per step)",
    "projection_ball": "projection onto ‖θ‖ ≤ r after each step (not in Algorithm 1)",
    "projection_box": "projection onto [−r, r]^m, the parameter space of Theorem 5's proof (not in Algorithm 1)",
    "no_projection": "θ not kept in [−r, r]^m, the parameter space Theorem 5's proof assumes (project: box does)",
    "theta0": "θ₀ = the model's initialisation (line 2: θ̃, a (near) optimal model)",
    "hessian_point": "H at the round's global model (line 4; eq. (11): at a (near) optimal θ̃)",
    "curvature": "λ_min(H) ≥ ζ enforced (the paper states ‖H‖₂ ≥ ζ, which does not bound ‖H⁻¹‖ ≤ 1/ζ)",
    "error_per_coordinate": "\"c_z + E\" (line 7) read per coordinate, sign([c_z]_i)(|[c_z]_i| + E): the paper adds "
                            "the scalar E to the vector c_z",
    "contribution_noise_per_round": "b^(c) drawn once per example and round, reused by the round's steps that draw "
                                    "the example (line 8 draws it at every step; the proof of Theorem 5 counts R "
                                    "releases per example, as σ_c pays for)",
    "gradient_clip": "gradients clipped to G = 1 in c_z (line 7) and in the updates (lines 11, 14); the paper uses "
                     "∇ℓ as is, assuming ℓ G-Lipschitz: a no-op for logreg on rows with ‖x‖ ≤ 1",
    "gradient_clip_mlp": "gradients clipped to G = 1 in c_z (line 7) and in the updates (lines 11, 14); the paper "
                         "uses ∇ℓ as is, assuming ℓ G-Lipschitz, which the mlp is not: the clip binds",
    "regulariser_after_clip": "λθ added after the clip in lines 11 and 14 (data-independent, as the baselines do)",
    "noise_accountant": "σ of line 13 calibrated for (ε₁, δ₁) by the run's `accountant` (Theorem 5: σ ≥ "
                        "cG√(T log(1/δ₁))/(nε₁), an unstated c, \"via moments accountant\")",
    "accountant_fallback": "accountant rdp requested, PLD used: no σ reaches ε₁ under RDP's conversion",
    "influence_output_layer": "influence over the output layer only (line 7; the paper: all m parameters)",
    "error_zero": "E = 0 in line 7: Theorem 4's constants do not exist for the network",
}


def contribution_release_epsilons(sigma_c: float, rounds: int, n: int, zeta: float, G: float,
                                  delta_2: float) -> tuple[float, float]:
    """(ε at the sensitivity 2G/(nζ) the proof of Theorem 5 states, ε at the 4G/(nζ) of line 9's 2c_t^(o) + b^(c))
    of the R releases of each example's contribution at σ_c, at δ₂, by exact Gaussian composition."""
    stated = 2.0 * G / (n * zeta)
    return (analytic_gaussian_epsilon(stated, sigma_c, delta_2, rounds),
            analytic_gaussian_epsilon(2.0 * stated, sigma_c, delta_2, rounds))


def epsilon_2_note(fractions: list[float], p: float, epsilon_1: float, epsilon_2: float) -> str:
    """What ε₂ bought in this run, from its recorded noiseless fractions (one per seed) and its skip bound p."""
    bound = f"p = {p:.3g} per step" if p > 0 else "p = 0 per step in floating point"
    if max(fractions) == 0.0:
        return (f"ε₂ = {epsilon_2:.3g} is charged for the influence test (lines 7-10), which skipped the noise on no "
                f"step of this run (noiseless fraction 0 in every seed; {bound}): as run, the "
                f"single-example DP-SGD of lines 13-14 at ε₁ = {epsilon_1:.3g}, and the bound of `guarantee` holds "
                f"at ε₁ already (the test's release is not part of the output)")
    return (f"the influence test (lines 7-10, charged ε₂ = {epsilon_2:.3g}) skipped the noise on "
            f"{100 * float(np.mean(fractions)):.3g}% of the steps (mean over seeds; {bound})")


def sensitivity_note(sigma_c: float, rounds: int, epsilon_2: float, delta_2: float, eps_stated: float,
                     eps_line9: float, contribution_noise: str) -> str:
    """The gap of the paper's σ_c (docs/algorithms.md), with this run's numbers."""
    chain = (f"(2ε₂, δ₂) = ({2 * epsilon_2:.3g}, {delta_2:.3g})-DP" if 2 * epsilon_2 / rounds < 1
             else "not bounded (per-release ε ≥ 1, beyond Lemma 3)")
    per_step = ("; per_step draws a b^(c) each time an example is drawn, more releases than the R counted here"
                if contribution_noise == "per_step" else "")
    return (f"a gap in the paper: line 9 releases 2c_t^(o) + b^(c), sensitivity 4G/(nζ), but σ_c = {sigma_c:.3g} is "
            f"sized (Theorem 5's proof, c′ = 2.83) for S(c_t) ≤ 2G/(nζ): by the proof's own chain (Lemma 3, "
            f"R = {rounds} releases composed) the test is {chain}, not (ε₂, δ₂); by exact Gaussian composition "
            f"({eps_line9:.3g}, δ₂)-DP ({eps_stated:.3g} at the stated 2G/(nζ)){per_step}")


# --- Noise of the noisy steps -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoisyStepCalibration:
    std: float  # standard deviation of the noise added to the step's (sum of) clipped gradient(s)
    multiplier: float  # std / G
    epsilon: float  # achieved ε₁ (≤ target)
    accountant: str
    library: str
    valid: bool = True  # classical Gaussian bound holds (composition accountant: per-step ε₀ < 1)
    note: str = ""


def resolve_accountant(accountant: str) -> str:
    """`accountant` as run: auto is PLD, the tightest accountant dp-accounting has for both samplings, so that
    PIDP-SGD's ε holds on the footing of the PLD-calibrated baselines it is compared with."""
    return "pld" if accountant == "auto" else accountant


def calibrate_single_steps(epsilon_1: float, delta_1: float, n: int, steps: int, G: float,
                           accountant: str) -> NoisyStepCalibration:
    """One uniformly drawn example per step, replace-one neighbours (the paper's relation, Remark 6): the noise
    std s on the clipped gradient (sensitivity 2G) for (ε₁, δ₁) over T steps (`calibrate_bassily`, the
    same mechanism). auto, pld: PLD; rdp: RDP, or PLD where no σ reaches ε₁ under RDP's conversion (the run's
    `accountant` column then says pld)."""
    try:  # accountant composition is refused by `PIDPSGD.check`
        priv = calibrate_bassily(float(epsilon_1), float(delta_1), int(n), int(steps), float(G),
                                 resolve_accountant(accountant))
    except UserError:
        if accountant != "rdp":
            raise
        priv = calibrate_bassily(float(epsilon_1), float(delta_1), int(n), int(steps), float(G), "pld")
    # the accountant's name alone, as the baselines record theirs: the relation is the run's `neighbours` column
    return NoisyStepCalibration(priv.sigma, priv.sigma / G, priv.epsilon, priv.accountant, "dp-accounting")


def calibrate_noisy_steps(epsilon_1: float, delta_1: float, q: float, steps: int,
                          accountant: str) -> NoisyStepCalibration:
    """`sampling: poisson`: the noise multiplier of `dp_sgd` (add/remove, Poisson rate q) for (ε₁, δ₁)."""
    if accountant in ("auto", "rdp", "pld"):
        cal = calibrate_sigma(epsilon_1, delta_1, q, steps, accountant="rdp" if accountant == "rdp" else "pld")
        return NoisyStepCalibration(cal.sigma, cal.sigma, cal.epsilon, cal.accountant, cal.library)
    # Classical: per-step (ε_s, δ_s) from the better of basic and advanced composition over T steps, then
    # invert tight Poisson amplification ε_s = ln(1 + q(e^{ε₀} − 1)), δ_s = q δ₀, then σ = √(2 ln(1.25/δ₀))/ε₀.
    eps_adv, delta_adv = advanced_composition_epsilon_per_step(epsilon_1, delta_1, steps)
    eps_s, delta_s = max((eps_adv, delta_adv), (epsilon_1 / steps, delta_1 / steps))
    eps_0 = math.log1p(math.expm1(eps_s) / q)
    delta_0 = min(delta_s / q, 0.5)
    sigma = math.sqrt(2.0 * math.log(1.25 / delta_0)) / eps_0
    valid = eps_0 < 1.0 and delta_s / q < 1.0
    note = "" if valid else f"per-step ε₀ = {eps_0:.3g} ≥ 1 (classical Gaussian bound valid for ε < 1)"
    return NoisyStepCalibration(sigma, sigma, epsilon_1, "composition", "closed form (dpsgd_cli.privacy.mechanisms)",
                                valid, note)


# --- The algorithm ------------------------------------------------------------------------------------------------


def round_noiseless(eligible: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`contribution_noise: per_round`: step t of replica r is noiseless iff its batch idx[t, r] (−1 padded) is
    non-empty and each of its examples passed the round's test `eligible` (R, n): (T, R) bool."""
    valid = idx >= 0
    passed = np.where(valid, eligible[np.arange(idx.shape[1])[:, None], np.maximum(idx, 0)], True)
    return np.logical_and(passed.all(axis=2), valid.any(axis=2))


class PIDPSGD(Algorithm):
    """PIDP-SGD (Kang et al., Algorithm 1): DP-SGD with one example per step whose noise is skipped when the
    privately tested influence of the example passes the paper's per-coordinate threshold. Models: logreg, mlp.
    Formulas, readings of the pseudo-code, non-paper variants and the guarantee: docs/algorithms.md (pidp_sgd)."""

    name = "pidp_sgd"
    tags = Tags("PIDP-SGD", private=True, neighbours="replace_one",
                own_analysis="Kang et al.'s analysis of Algorithm 1: (ε₁, δ₁) for the noisy steps, (ε₂, δ₂) for the "
                             "private influence test, with the labelled deviations of docs/algorithms.md")
    uses = frozenset({"epsilon", "batch_size", "lr", "epochs", "l2"})
    execution_params = frozenset({"backend"})
    Params = PIDPSGDParams
    source = "Kang, Li, Liu, Wang, Data Heterogeneity Differential Privacy: From Theory to Algorithm"

    def native_neighbours(self) -> Literal["add_remove", "replace_one"]:
        """Replace-one for one example per step (Remark 6); add/remove for the Poisson variant (dp_sgd's σ)."""
        return "add_remove" if self.params.sampling == "poisson" else "replace_one"

    def schedule(self, setting: Setting) -> tuple[int, int]:
        """(R, T_local)."""
        rounds = self.params.rounds or max(1, round(setting.required.epochs))
        local = self.params.local_steps or max(1, round(setting.steps / rounds))
        return rounds, local

    def deviations(self, influence: str, model_name: str, l2: float, accountant: str) -> dict[str, str]:
        """This run's departures from Algorithm 1, readings included: {key of `DEVIATIONS`: its text}.
        `accountant`: the one that calibrated the noisy steps (the rdp → pld fallback shows here)."""
        p, mlp = self.params, model_name == "mlp"
        projection = {True: "projection_ball", "box": "projection_box", False: "no_projection"}[p.project]
        applies = [("rule_l2_radius", p.rule == "l2_radius"), ("sampling_poisson", p.sampling == "poisson"),
                   (projection, True), ("theta0", True), ("hessian_point", True), ("curvature", True),
                   ("error_per_coordinate", p.rule == "coordinate"),
                   ("contribution_noise_per_round", p.sampling == "single" and p.contribution_noise == "per_round"),
                   ("gradient_clip_mlp" if mlp else "gradient_clip", True), ("regulariser_after_clip", l2 > 0),
                   ("noise_accountant", True), ("accountant_fallback", accountant != resolve_accountant(p.accountant)),
                   ("influence_output_layer", influence == "output_layer"), ("error_zero", influence == "full" and mlp)]
        keys = [key for key, holds in applies if holds]
        return {k: DEVIATIONS[k] for k in keys}

    def check(self, setting: Setting, model_name: str = "") -> None:
        p, n, B = self.params, setting.n, setting.required.batch_size
        if model_name and model_name not in ("logreg", "mlp"):
            raise _no_hessian(model_name)
        if p.sampling == "single" and B != 1:
            raise UserError(f"pidp_sgd: sampling: single (Algorithm 1 line 6: one example per step) needs "
                            f"batch_size 1, got {B}: give pidp_sgd batch_size: [1], or sampling: poisson "
                            f"(the non-paper mini-batch variant)")
        if not 1 <= B <= n:
            raise UserError(f"pidp_sgd: batch_size = {B} must be in [1, n = {n}]")
        if p.sampling == "poisson" and p.contribution_noise == "per_step":
            raise UserError("pidp_sgd: contribution_noise: per_step needs sampling: single (one example per step)")
        if p.sampling == "single" and p.accountant == "composition":
            raise UserError("pidp_sgd: accountant: composition is for sampling: poisson; use auto, rdp or pld")

    def fit(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams) -> Outcome:
        p = self.params
        influence = resolve_influence(p.influence, model)
        self.check(setting, model.name)
        n, B, epsilon = setting.n, setting.required.batch_size, setting.required.epsilon
        rounds, local = self.schedule(setting)
        steps = rounds * local
        eps_1, eps_2 = EPSILON_1_SHARE * epsilon, (1 - EPSILON_1_SHARE) * epsilon
        delta_1 = delta_2 = setting.delta / 2
        G = GRADIENT_CLIP
        sigma_c = contribution_sigma(G, rounds, delta_2, n, p.zeta, eps_2)
        tau = coordinate_threshold(p.radius, eps_1, delta_1)
        rule = DecisionRule(p.rule, sigma_c, tau if p.rule == "coordinate" else p.radius)
        single = p.sampling == "single"
        cal = (calibrate_single_steps(eps_1, delta_1, n, steps, G, p.accountant) if single
               else calibrate_noisy_steps(eps_1, delta_1, setting.sample_rate, steps, p.accountant))

        x_norm = cached_row_norms(X)
        test_gens = [g.spawn(1)[0] for g in streams.generators("noise")]  # independent of the step noise
        ckpt = Checkpoints(setting.trace_every, X, y) if setting.trace_every else None
        sampler = uniform_examples(X, y, streams) if single else poisson_batches(X, y, setting.sample_rate, streams)
        # the step noise: one stream for the whole run, continued by every round's chain on any backend
        draws = streams.normal("noise", (model.n_params,))
        noiseless = np.zeros(streams.replicas)
        eligible_share, rounds_info, ran_on = [], [], "numpy"
        theta = model.init(streams.generators("init"))
        for k in range(rounds):
            constants = error_constants(influence, model, theta, G, p.zeta, n)
            inf = round_influence(influence, model, theta, X, y, x_norm, setting.l2, p.zeta, G)
            rounds_info.append((inf, constants))
            idx = (np.broadcast_to(np.arange(n), (local, streams.replicas, n)) if sampler.full  # q = 1
                   else sampler.take(local))  # (T_local, R, M), −1 padded: the round's batches
            if p.contribution_noise == "per_round":
                eligible = round_eligible(inf, rule, constants.E, X, y, x_norm, test_gens)
                eligible_share.append(eligible.mean(axis=1))
                quiet = round_noiseless(eligible, idx)
            else:
                quiet = step_noiseless(inf, rule, constants.E, X, y, x_norm, idx[:, :, 0], test_gens)
            chain = GradientChain(
                batches=fixed_batches(X, y, idx, padded=not single),
                ops=[Clip(G), MaskedNoise(cal.std, draws, ~quiet), *([] if single else [Scale(1.0 / B)]),
                     WeightDecay(setting.l2), Sgd(constant(setting.required.lr)), *self._projection()],
                checkpoints=ckpt.shifted(round(k * local * B)) if ckpt else None, examples_per_step=B,
                backend=p.backend)
            theta = chain.run(model, theta, local)
            ran_on = chain.ran_on or ran_on
            noiseless += quiet.sum(axis=0)

        fraction = [float(f) for f in noiseless / steps]
        p_step = self.skip_bound(rule, rounds_info[0][0].dim, rounds_info, setting, rounds, eps_2)
        notes = [PRIVACY_NOTES["logreg" if model.name == "logreg" else influence],
                 epsilon_2_note(fraction, p_step, cal.epsilon, eps_2)]
        eps_stated = eps_line9 = None
        if single:  # σ_c pays for R releases of one example's contribution under replace-one neighbours
            eps_stated, eps_line9 = contribution_release_epsilons(sigma_c, rounds, n, p.zeta, G, delta_2)
            notes.append(sensitivity_note(sigma_c, rounds, eps_2, delta_2, eps_stated, eps_line9,
                                          p.contribution_noise))
        guarantee, delta_cert = (f"none: {cal.note}", float("nan")) if not cal.valid else \
            tv_guarantee(epsilon, setting.delta, eps_1, steps, p_step)
        derived = {
            "steps": steps, "sample_rate": setting.sample_rate, "sigma": cal.multiplier,
            "epsilon_achieved": cal.epsilon + eps_2, "accountant": cal.accountant, "accountant_library": cal.library,
            "rounds": rounds, "local_steps": local, "epsilon_1": eps_1, "epsilon_2": eps_2,
            "delta_1": delta_1, "delta_2": delta_2, "epsilon_1_achieved": cal.epsilon,
            "noise_std": cal.std / B, "sigma_c": sigma_c, "c_prime": C_PRIME, "rule": p.rule,
            "threshold": rule.threshold, "sampling": p.sampling, "contribution_noise": p.contribution_noise,
            "influence": influence, "influence_dim": rounds_info[0][0].dim,
            "lipschitz_G": G, **round_summary(rounds_info),
            "zeta": p.zeta, "radius": p.radius, "backend": ran_on,
            "skip_probability_bound": p_step, "delta_certified": delta_cert,
            "noiseless_fraction": fraction, "noiseless_fraction_mean": float(np.mean(fraction)),
            "epsilon_2_stated_sensitivity": eps_stated, "epsilon_2_line9": eps_line9,
            "deviations": self.deviations(influence, model.name, setting.l2, cal.accountant),
            "privacy_note": "; ".join(notes),
        }
        if eligible_share:
            derived["eligible_fraction"] = [float(f) for f in np.mean(eligible_share, axis=0)]
        return Outcome(theta, derived, guarantee, trace=ckpt.rows if ckpt else [])

    def skip_bound(self, rule: DecisionRule, dim: int, rounds_info: list[tuple[RoundInfluence, ErrorConstants]],
                   setting: Setting, rounds: int, eps_2: float) -> float:
        """p of the total-variation bound: the largest pass probability over datasets (docs/algorithms.md), with E
        the smallest over rounds and replicas (E is data-independent: it depends on n and the model's constants,
        and, for a relu output layer, on the round's hidden layer, so the minimum is taken). sampling: poisson
        (add/remove neighbours): the maximum over n − 1, n, n + 1 (σ_c, τ's inputs and E depend on n)."""
        E = min(float(np.min(c.E)) for _, c in rounds_info)
        sizes = [setting.n] if self.params.sampling == "single" else [setting.n - 1, setting.n, setting.n + 1]
        bounds = []
        for n in sizes:
            scale_n = setting.n / n  # σ_c ∝ 1/n, E ∝ 1/n² (Theorems 4-5)
            sigma_c = contribution_sigma(GRADIENT_CLIP, rounds, setting.delta / 2, n, self.params.zeta, eps_2)
            bounds.append(skip_probability_bound(rule.rule, dim, sigma_c, rule.threshold, E * scale_n**2))
        return max(bounds)

    def _projection(self) -> list[Op]:
        p = self.params
        return [ProjectBox(p.radius)] if p.project == "box" else [ProjectBall(p.radius)] if p.project else []
