"""`bassily2014`: noisy projected SGD, one example per step (Bassily, Smith & Thakurta, FOCS 2014).

Source: R. Bassily, A. Smith, A. Thakurta, "Private Empirical Risk Minimization: Efficient Algorithms and Tight
Error Bounds", FOCS 2014, Algorithm 1 (A_Noise-SGD), as taught in A. Bellet's lecture on private ERM.

Update (on OUR scale: the mean objective F(θ) = (1/n) Σ ℓ(θ; z_i) + (λ/2)‖θ‖²)::

    i_t ~ uniform{1..n}                      (one example per step, drawn with replacement across steps)
    g_t = clip_l(∇ℓ(θ_t; z_{i_t})) + λθ_t + b_t,   b_t ~ N(0, σ² I_d)
    θ_{t+1} = Π_C(θ_t − γ_t g_t),            C = {‖θ‖ ≤ R},  θ_1 = 0,  output θ_{T+1} (the last iterate)

Scale of σ. The paper minimises the SUM L = Σ_i ℓ and steps along n∇ℓ(θ; d) + b with b ~ N(0, σ_P² I),
σ_P² = 32 L² n² log(n/δ) log(1/δ) / ε², for T = n² steps. Its update θ − η(n∇ℓ + b) equals ours,
θ − γ(∇ℓ + b/n), with γ = nη: on our scale the noise added to the single-example gradient ∇ℓ is σ = σ_P / n::

    paper (T = n²):  σ = √32 · l · √(log(n/δ) · log(1/δ)) / ε
    paper, T steps:  σ = √32 · l · √(T · ln(T/(nδ)) · ln(1/δ)) / (n ε)         (formula: paper; = the above at T = n²)
    lecture:         σ = 16 · l · √(T · ln(2/δ) · ln(2.5T/(δn))) / (n ε)          (formula: lecture, the default)

The lecture's σ (Bellet, lecture 5, "Differentially private SGD: algorithm & privacy guarantees") is the only σ
in the source texts; the √32 form was written from memory of Bassily et al. and is NOT verified against their
paper (not among the sources): `formula: paper` is kept for comparison and labelled unverified.

The T-step form of the paper keeps its derivation: per-step δ₀ = nδ/(2T) (→ log(n/δ) at T = n²) and δ' ≈ δ for
advanced composition. The lecture's constant 16 comes from Gaussian mechanism (sensitivity 2l under replace-one)
→ amplification 2qε₀ with q = 1/n → advanced composition with δ' = δ/2, leading term doubled to absorb the
second term; the paper's √32 ≈ 5.66 is 2.83× smaller: the lecture's lemmas (2qε₀) would certify only ≈ √2·ε for
it, but with the tight amplification ln(1 + q(e^ε₀ − 1)) they do certify it at T = n² (measured ε = 0.82-0.93 of
the target for n = 20…1000, ε ≤ 1). Either is only *proved* when every lemma of that derivation applies: ε ≤ 1,
per-step ε₀ < 1, and the chain certifies ε — which for T = epochs·n ≪ n² fails (adult, T = 5n, lecture:
ε₀ ≈ 3ε; paper: ε₀ ≈ 8.7ε): the run is then recorded with `guarantee: none: ...` and `epsilon_rdp` tells what
the exact-scheme RDP accountant certifies for that σ (paper, ε = 1: 1.58; ε = 3: ~900, i.e. not private).

Assumptions: ℓ convex and l-Lipschitz in θ (logistic loss with ‖x‖ ≤ 1: l = 1; per-example gradients are
clipped to l, so the sensitivity 2l holds whatever the data), rows in the unit L2 ball, neighbouring datasets
differ in one replaced record (the paper's relation). l = model.lipschitz(1): the public row-norm bound, not the
data's max norm (which would leak).

Accounting (`accounting`), each gives σ for the target (ε, δ); σ and the achieved ε are recorded:

* `closed_form`: the formula above (`formula: paper|lecture`), ε achieved = target exactly. Guarantee "proved"
  iff ε ≤ 1 and the standard chain below (classical Gaussian with ε₀ < 1, tight amplification, advanced
  composition) certifies ε for that σ.
* `advanced_composition`: per-step Gaussian mechanism (Δ = 2l, δ₀ = nδ/(2T)) → amplification by subsampling,
  q = 1/n (`amplification: tight`: ε₁ = ln(1 + q(e^ε₀ − 1)), with the analytic Gaussian of Balle & Wang, valid
  for every ε₀; `approx`: the lecture's ε₁ = 2qε₀ with the classical Gaussian σ = Δ√(2 ln(1.25/δ₀))/ε₀, both
  valid only for ε₀ ≤ 1) → advanced composition over T steps with δ' = δ/2 (Dwork–Rothblum–Vadhan). Solved for
  the per-step ε₁ that gives the target, then refined with `calibrate`.
* `rdp`: dp-accounting RdpAccountant, relation REPLACE_ONE, event
  SelfComposed(SampledWithoutReplacement(n, 1, Gaussian(σ/(2l))), T). One example drawn uniformly is exactly a
  size-1 sample without replacement (steps independent = "with replacement" across steps), so this is the
  mechanism itself (Wang, Balle & Kasiviswanathan 2019, Thm 27). dp-accounting's SampledWithReplacementDpEvent is
  supported by neither accountant.
* `pld`: dp-accounting PLDAccountant, relation REPLACE_ONE, event SelfComposed(PoissonSampled(1/n,
  Gaussian(σ/(2l))), T): the pair P* = qN(−2l, σ²) + (1−q)N(0, σ²), Q* = qN(2l, σ²) + (1−q)N(0, σ²). The PLD
  accountant has no sampling-without-replacement event; this pair is a valid (slightly conservative) dominating
  pair of our step: by advanced joint convexity (Balle, Barthe & Gaboardi 2018, Thm 2) a step's hockey-stick
  divergence is ≤ q·H_γ(N(2l)‖N(0)), which the pair's H_γ bounds from above (γ ≥ 1; γ < 1 by the symmetry of
  the pair and of the replace-one relation), and dominating pairs compose (Zhu, Dong & Wang 2022). See
  `tests/test_bassily.py` for a numerical check.

Step sizes (`schedule`): `strongly_convex`: γ_t = 1/(s t) with s = λ (F is λ-strongly convex); `convex`: the
paper's γ_t = ‖C‖₂/(G√t) with ‖C‖₂ = 2R the diameter of C and G² = dσ² + (l + λR)² ≥ E‖g_t‖² (the paper's
G = √(pσ_P² + n²L²) on our scale, plus the regulariser's gradient); `auto`: strongly_convex if λ > 0 else convex.
Radius R (`radius`): default l/λ (the minimiser of F satisfies ‖θ*‖ = ‖∇L(θ*)‖/λ ≤ l/λ) if λ > 0, else 10.
Steps: T = round(epochs · n) (the paper's T = n² would be 30162² ≈ 9·10⁸ steps on adult).
Backend (`backend`): with logistic regression the steps run in the numba kernel of `kernels.py` when numba is
installed (auto; `numpy` forces the chain): the same examples and noise draws, the same result.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dpsgd_cli import diskcache
from dpsgd_cli.algorithms import kernels
from dpsgd_cli.algorithms.base import ROW_NORM_TOLERANCE, Algorithm, Outcome, Setting
from dpsgd_cli.algorithms.chain import (Checkpoints, GradientChain, NoiseSource, Schedule, add_l2, add_noise,
                                        inverse_sqrt, inverse_time, project_to_ball)
from dpsgd_cli.algorithms.sampling import IndexedBatches
from dpsgd_cli.algorithms.streams import BLOCK_STEPS, ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.models import Model
from dpsgd_cli.models.rows import cached_row_norms
from dpsgd_cli.privacy.accounting import (CALIBRATION_VERSION, LIBRARY, calibrate, rdp_epsilon_and_order,
                                          rdp_epsilon_floor)
from dpsgd_cli.privacy.mechanisms import (advanced_composition, advanced_composition_epsilon_per_step,
                                          amplify_by_subsampling, analytic_gaussian_sigma, gaussian_sigma)

# dp-accounting (~1 s of imports) on first use: the registry imports this module for every `dpsgd run`
_dp = LazyModule("dp_accounting")
dp_event = LazyModule("dp_accounting.dp_event")


PLD_RHO_BASSILY = 0.04  # see pld_epsilon
BASSILY_CALIBRATION_VERSION = "1"  # part of the disk cache key: bump it with any change that could move σ or ε
# calibrations (1-3 s each with PLD or RDP at T = n steps) are kept on disk like calibrate_sigma's
_ON_DISK = {"library": LIBRARY, "scipy": importlib.metadata.version("scipy"), "rho": PLD_RHO_BASSILY,
            "calibration_version": CALIBRATION_VERSION, "bassily_version": BASSILY_CALIBRATION_VERSION}


# --------------------------------------------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------------------------------------------


def closed_form_sigma(epsilon: float, delta: float, n: int, steps: int, lipschitz: float,
                      formula: Literal["paper", "lecture"] = "lecture") -> float:
    """σ on the mean-objective scale (noise added to the single-example gradient ∇ℓ), see the module docstring.

    paper:   σ = √32 · l · √(T ln(T/(nδ)) ln(1/δ)) / (n ε)   (BST14 Alg. 1 σ_P² = 32 L² n² log(n/δ) log(1/δ)/ε²,
             divided by n, with T = n² generalised to T)
    lecture: σ = 16 · l · √(T ln(2/δ) ln(2.5T/(δn))) / (n ε)
    """
    T = steps
    if formula == "paper":
        inner = math.log(T / (n * delta))
        if inner <= 0:
            raise UserError(f"bassily2014: the paper's closed form needs T > nδ (ln(T/(nδ)) > 0), got T={T}, "
                            f"n={n}, delta={delta:g}; use more epochs or accounting: rdp")
        return math.sqrt(32.0) * lipschitz * math.sqrt(T * inner * math.log(1.0 / delta)) / (n * epsilon)
    if formula == "lecture":
        return 16.0 * lipschitz * math.sqrt(T * math.log(2.0 / delta) * math.log(2.5 * T / (delta * n))) / (
            n * epsilon)
    raise UserError(f"bassily2014: formula must be 'paper' or 'lecture', got {formula!r}")


@dataclass(frozen=True)
class ChainBound:
    """Gaussian mechanism → amplification (q = 1/n) → advanced composition, for a given σ."""

    eps0: float  # per-step Gaussian ε at δ₀ (before amplification)
    delta0: float  # δ₀ = nδ/(2T)
    eps1: float  # per-step ε after amplification
    epsilon: float  # total ε after T-fold advanced composition with δ' = δ/2
    valid: bool  # every lemma applies (classical Gaussian: ε₀ < 1; 2qε amplification: ε₀ ≤ 1)
    reason: str  # why not valid ("" if valid)


def chain_bound(sigma: float, delta: float, n: int, steps: int, lipschitz: float,
                amplification: Literal["tight", "approx"] = "tight",
                gaussian: Literal["classical", "analytic"] = "analytic") -> ChainBound:
    """Total ε of T steps by the lecture's chain; δ is split δ' = δ/2 (composition) + T·qδ₀ = δ/2 (steps).

    classical Gaussian: ε₀ = Δ √(2 ln(1.25/δ₀)) / σ with Δ = 2l (Dwork & Roth Thm A.1, ε₀ < 1 only);
    analytic: the exact ε₀ of the Gaussian mechanism at δ₀ (Balle & Wang 2018, `get_epsilon_gaussian`).
    """
    q = 1.0 / n
    delta0 = n * delta / (2.0 * steps)
    if not 0 < delta0 < 1:
        raise UserError(f"bassily2014: per-step delta n·δ/(2T) = {delta0:g} must be in (0, 1); use more epochs")
    sensitivity = 2.0 * lipschitz
    if gaussian == "classical":
        eps0 = sensitivity * math.sqrt(2.0 * math.log(1.25 / delta0)) / sigma
    else:
        eps0 = float(_dp.get_epsilon_gaussian(sigma / sensitivity, delta0))
    reasons = []
    if gaussian == "classical" and not eps0 < 1:
        reasons.append(f"per-step ε₀ = {eps0:.3g} ≥ 1 (classical Gaussian mechanism needs ε₀ < 1)")
    if amplification == "tight":
        eps1, delta1 = amplify_by_subsampling(eps0, q, delta0, tight=True)
    elif eps0 <= 1:
        eps1, delta1 = amplify_by_subsampling(eps0, q, delta0, tight=False)
    else:  # the lecture's 2qε is no bound here: keep the formula's value, flagged as unproved
        eps1, delta1 = 2.0 * q * eps0, q * delta0
        reasons.append(f"per-step ε₀ = {eps0:.3g} > 1 (2qε amplification needs ε₀ ≤ 1)")
    total, _ = advanced_composition(eps1, delta1, steps, delta / 2.0)
    return ChainBound(eps0, delta0, eps1, total, not reasons, "; ".join(reasons))


# --------------------------------------------------------------------------------------------------------------
# dp-accounting, replace-one relation (the shared accounting module fixes ADD_OR_REMOVE_ONE)
# --------------------------------------------------------------------------------------------------------------


def rdp_event(noise_multiplier: float, n: int, steps: int) -> dp_event.DpEvent:
    """T steps, each one example drawn uniformly (a size-1 sample without replacement) + Gaussian noise."""
    return dp_event.SelfComposedDpEvent(
        dp_event.SampledWithoutReplacementDpEvent(n, 1, dp_event.GaussianDpEvent(noise_multiplier)), steps)


def pld_event(noise_multiplier: float, n: int, steps: int) -> dp_event.DpEvent:
    """The dominating pair of the module docstring: Poisson(1/n)-sampled Gaussian under REPLACE_ONE (shifts ±2l)."""
    return dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(1.0 / n, dp_event.GaussianDpEvent(noise_multiplier)), steps)


def rdp_epsilon(noise_multiplier: float, n: int, steps: int, delta: float) -> tuple[float, float]:
    """(ε, optimal order) of `rdp_event` under replace-one neighbours, over the shared order grid."""
    return rdp_epsilon_and_order(rdp_event(noise_multiplier, n, steps), delta, _dp.NeighboringRelation.REPLACE_ONE)


@functools.lru_cache(maxsize=256)
def _cached_rdp_epsilon(noise_multiplier: float, n: int, steps: int, delta: float) -> float:
    # in the process only: on disk, checking a cached ε would cost its computation
    return rdp_epsilon(noise_multiplier, n, steps, delta)[0]


def pld_epsilon(noise_multiplier: float, n: int, steps: int, delta: float) -> tuple[float, float]:
    """(ε, discretisation h) of `pld_event`, pessimistic; h = PLD_RHO_BASSILY·ε/√T snapped to 10^(−k/4), by the
    fixed-point rule of `dpsgd_cli.privacy.accounting` (each pass is an upper bound).

    ρ = 0.04 instead of the shared 0.005: with T ~ 10⁵ steps the shared rule costs 5-10 s per evaluation
    (h ~ 1e-5) and ~1-3 min per calibration; measured on adult (T = 5n, z = 0.63) h = 1e-4 (ρ ≈ 0.04) is within
    0.3 % of h = 1e-5, and every h gives an upper bound (pessimistic rounding), so a coarser h only adds noise."""
    event = pld_event(noise_multiplier, n, steps)

    def once(h: float) -> float:
        accountant = _dp.pld.PLDAccountant(_dp.NeighboringRelation.REPLACE_ONE, value_discretization_interval=h)
        accountant.compose(event)
        return float(accountant.get_epsilon(delta))

    h = 1e-2
    eps = once(h)
    for _ in range(8):
        if not (math.isfinite(eps) and eps > 0):
            break
        h_new = max(1e-10, 10.0 ** (math.floor(4.0 * math.log10(PLD_RHO_BASSILY * eps / math.sqrt(steps))) / 4.0))
        if h_new >= h:
            break
        h, eps = h_new, once(h_new)
    return eps, h


# --------------------------------------------------------------------------------------------------------------
# Calibration: σ for the target ε, per accounting option
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Privacy:
    sigma: float
    epsilon: float  # achieved by the option's own analysis
    accountant: str
    details: dict
    proved: bool = True  # the option's lemmas apply (closed forms and 2qε may not)
    reason: str = ""


def _privacy_of(stored: dict) -> Privacy:
    privacy = Privacy(**stored)
    if not (isinstance(privacy.sigma, float) and math.isfinite(privacy.sigma) and privacy.sigma > 0):
        raise ValueError("not a calibrated sigma")
    return privacy


def _verify(privacy: Privacy, epsilon: float, delta: float, n: int, steps: int, lipschitz: float, accounting: str,
            formula: str = "lecture", amplification: str = "tight") -> Privacy:
    """A cached calibration checked by one evaluation of its own analysis at its σ: ε ≤ the target and within
    0.1 % of it (or the analysis steps over that window just below σ); the Privacy returned carries that
    evaluation's ε. Closed forms cost no more than their check: recomputed. Raises `diskcache.Rejected`."""
    if accounting == "closed_form":
        return _calibrate_bassily(epsilon, delta, n, steps, lipschitz, accounting, formula, amplification)
    if accounting == "advanced_composition":
        gaussian = privacy.details["gaussian"]

        def evaluate(sigma: float) -> tuple[Privacy, float]:
            b = chain_bound(sigma, delta, n, steps, lipschitz, amplification, gaussian)  # type: ignore[arg-type]
            details = {"amplification": amplification, "gaussian": gaussian, "eps0": b.eps0, "delta0": b.delta0,
                       "eps1": b.eps1}
            return Privacy(sigma, b.epsilon, f"advanced_composition_{amplification}", details, b.valid,
                           b.reason), b.epsilon
        scale = 1.0
    else:
        z = privacy.details["noise_multiplier"]
        scale = 2.0 * lipschitz
        if not (isinstance(z, float) and privacy.sigma == scale * z):
            raise diskcache.Rejected(f"its sigma {privacy.sigma!r} is not 2·lipschitz × its noise multiplier {z!r}")
        key = "rdp_order" if accounting == "rdp" else "value_discretization_interval"

        def evaluate(sigma: float) -> tuple[Privacy, float]:
            e, x = (rdp_epsilon if accounting == "rdp" else pld_epsilon)(sigma / scale, n, steps, delta)
            return Privacy(sigma, e, accounting, {**privacy.details, key: x}), e
    fresh, e = evaluate(privacy.sigma)
    if not (e <= epsilon and (e >= (1.0 - 1e-3) * epsilon or evaluate(privacy.sigma * (1.0 - 1e-6))[1] > epsilon)):
        raise diskcache.Rejected(f"sigma = {privacy.sigma!r} gives epsilon = {e:.6g} by {accounting}, not the "
                                 f"target {epsilon:g} (within 0.1 % below)")
    return fresh


@functools.lru_cache(maxsize=256)
@diskcache.on_disk("bassily2014", _ON_DISK, encode=dataclasses.asdict, decode=_privacy_of, verify=_verify)
def calibrate_bassily(epsilon: float, delta: float, n: int, steps: int, lipschitz: float, accounting: str,
                      formula: str = "lecture", amplification: str = "tight") -> Privacy:
    """σ (on the mean scale) whose ε under `accounting` is the target (within 0.1 % below; exact for closed forms);
    kept on disk, and checked against its analysis when read back (`_verify`)."""
    return _calibrate_bassily(epsilon, delta, n, steps, lipschitz, accounting, formula, amplification)


def _calibrate_bassily(epsilon: float, delta: float, n: int, steps: int, lipschitz: float, accounting: str,
                       formula: str = "lecture", amplification: str = "tight") -> Privacy:
    context = f" (bassily2014, accounting={accounting}, n={n}, T={steps}, delta={delta:g})"
    if accounting == "closed_form":
        sigma = closed_form_sigma(epsilon, delta, n, steps, lipschitz, formula)  # type: ignore[arg-type]
        check = chain_bound(sigma, delta, n, steps, lipschitz, "tight", "classical")
        proved, reason = True, ""
        if epsilon > 1:
            proved, reason = False, f"epsilon = {epsilon:g} > 1 (closed form valid for ε ≤ 1)"
        elif not check.valid:
            proved, reason = False, check.reason + f"; T = {steps} steps is too few for the closed form"
        elif check.epsilon > epsilon * (1 + 1e-9):
            proved, reason = False, (f"Gaussian + tight amplification + advanced composition certify only "
                                     f"ε = {check.epsilon:.4g} > {epsilon:g} for this σ")
        details = {"formula": formula, "eps0": check.eps0, "delta0": check.delta0,
                   "epsilon_chain": check.epsilon}
        return Privacy(sigma, epsilon, f"closed_form_{formula}", details, proved, reason)
    if accounting == "advanced_composition":
        gaussian = "analytic" if amplification == "tight" else "classical"
        eps1, delta1 = advanced_composition_epsilon_per_step(epsilon, delta, steps)
        q = 1.0 / n
        eps0 = math.log1p(math.expm1(eps1) / q) if amplification == "tight" else eps1 / (2.0 * q)
        delta0 = delta1 / q
        if gaussian == "analytic":
            guess = analytic_gaussian_sigma(2.0 * lipschitz, eps0, delta0)
        else:
            guess = gaussian_sigma(2.0 * lipschitz, eps0, delta0, strict=False)

        def eps_of(sigma: float) -> float:
            return chain_bound(sigma, delta, n, steps, lipschitz, amplification, gaussian).epsilon  # type: ignore

        point = calibrate(eps_of, epsilon, sigma_guess=guess, context=context)
        b = chain_bound(point.sigma, delta, n, steps, lipschitz, amplification, gaussian)  # type: ignore[arg-type]
        details = {"amplification": amplification, "gaussian": gaussian, "eps0": b.eps0, "delta0": b.delta0,
                   "eps1": b.eps1}
        return Privacy(point.sigma, point.epsilon, f"advanced_composition_{amplification}", details, b.valid,
                       b.reason)
    if accounting in ("rdp", "pld"):
        if accounting == "rdp" and epsilon <= rdp_epsilon_floor(delta):
            raise UserError(f"bassily2014: target epsilon={epsilon:g} is below what the RDP conversion can certify "
                            f"at delta={delta:g}; use accounting: pld")
        extra: dict[float, float] = {}
        func = rdp_epsilon if accounting == "rdp" else pld_epsilon

        def eps_of(multiplier: float) -> float:
            e, x = func(multiplier, n, steps, delta)
            extra[multiplier] = x
            return e

        # guess: the CLT asymptote ε ≈ q√(2T ln(1/δ))·2/z (replace-one ~ twice add/remove)
        guess = max(0.5, 2.0 * math.sqrt(2.0 * steps * math.log(1.0 / delta)) / (n * epsilon))
        point = calibrate(eps_of, epsilon, sigma_guess=guess, context=context)
        key = "rdp_order" if accounting == "rdp" else "value_discretization_interval"
        details = {"noise_multiplier": point.sigma, key: extra[point.sigma], "neighboring_relation": "replace_one",
                   "event": ("SampledWithoutReplacement(n, 1, Gaussian)" if accounting == "rdp"
                             else "PoissonSampled(1/n, Gaussian) as a dominating pair")}
        return Privacy(2.0 * lipschitz * point.sigma, point.epsilon, accounting, details)
    raise UserError(f"bassily2014: unknown accounting {accounting!r}")


# --------------------------------------------------------------------------------------------------------------
# The algorithm
# --------------------------------------------------------------------------------------------------------------


def uniform_example_blocks(X: np.ndarray, y: np.ndarray, streams: ReplicaStreams) -> IndexedBatches:
    """One example drawn uniformly per step and replica: the same draws as `sampling.uniform_examples(X, y,
    streams, 1)`, as indices (a compiled step `take`s them)."""
    n = X.shape[0]

    def blocks() -> Iterator[np.ndarray]:
        gens = streams.generators("sampling")
        while True:
            yield np.stack([g.integers(0, n, size=(BLOCK_STEPS, 1)) for g in gens], axis=1)  # (K, R, 1)

    return IndexedBatches(X, y, blocks(), streams.replicas)


class BassilyParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    accounting: Literal["closed_form", "advanced_composition", "rdp", "pld"] = Field(
        "closed_form", description="how σ is calibrated to (ε, δ)")
    formula: Literal["paper", "lecture"] = Field(
        "lecture", description="closed_form only: the lecture's σ = 16·l·√(T ln(2/δ) ln(2.5T/(δn)))/(nε) (the "
        "only σ in the sources, the default) or 'paper': √32·l·… recalled from Bassily et al., not verified "
        "against a source text")
    amplification: Literal["tight", "approx"] = Field(
        "tight", description="advanced_composition only: ln(1 + q(e^ε − 1)) or the lecture's 2qε")
    radius: Optional[float] = Field(None, gt=0, description="radius R of the ball C (default l/λ, or 10 if λ = 0)")
    schedule: Literal["auto", "convex", "strongly_convex"] = Field(
        "auto", description="γ_t = 2R/(G√t) (convex) or 1/(λt) (strongly convex); auto: the latter if λ > 0")
    backend: kernels.Backend = Field(
        "auto", description="logreg: the numba kernel (auto: when numba is installed) or numpy; same result")

    @model_validator(mode="before")
    @classmethod
    def _formula_default(cls, raw: Any) -> Any:
        """`formula` acts only under closed_form; elsewhere an unset formula is pinned to 'paper', the default
        before the lecture's became it, so that the run ids of unchanged mechanisms stay as they were."""
        if isinstance(raw, dict) and "formula" not in raw and raw.get("accounting", "closed_form") != "closed_form":
            return {**raw, "formula": "paper"}
        return raw


class Bassily2014(Algorithm):
    """Noisy projected SGD, one uniformly drawn example per step (Bassily, Smith & Thakurta, FOCS 2014, Alg. 1).

    See the module docstring for the formulas, the scale of σ and the accounting options.
    """

    name = "bassily2014"
    neighbours = "replace_one"
    private = True
    uses = frozenset({"epsilon", "epochs", "l2"})
    execution_params = frozenset({"backend"})
    Params = BassilyParams
    source = "Bassily, Smith & Thakurta, Private Empirical Risk Minimization: Efficient Algorithms and Tight " \
             "Error Bounds, FOCS 2014"

    @staticmethod
    def steps(setting: Setting) -> int:
        """T = round(epochs · n) single-example steps."""
        return max(1, round(setting.epochs * setting.n))

    def radius(self, setting: Setting, lipschitz: float) -> float:
        if self.params.radius is not None:
            return self.params.radius
        return lipschitz / setting.l2 if setting.l2 > 0 else 10.0

    def dp_event(self, setting: Setting, derived: dict) -> "dp_event.DpEvent":
        """T steps, each one uniformly drawn example's gradient (sensitivity 2l, replace-one) plus N(0, σ²I)."""
        return rdp_event(derived["sigma"] / derived["sensitivity"], setting.n, derived["steps"])

    def check(self, setting: Setting, model_name: str = "") -> None:
        if self.params.schedule == "strongly_convex" and not setting.l2 > 0:
            raise UserError("bassily2014: schedule strongly_convex needs l2 > 0 (F is λ-strongly convex); "
                            "use schedule: convex")

    def schedule(self, setting: Setting, sigma: float, lipschitz: float, radius: float,
                 n_params: int) -> tuple[Schedule, dict]:
        kind = self.params.schedule
        if kind == "auto":
            kind = "strongly_convex" if setting.l2 > 0 else "convex"
        if kind == "strongly_convex":
            if not setting.l2 > 0:
                raise UserError("bassily2014: schedule strongly_convex needs l2 > 0 (F is λ-strongly convex); "
                                "use schedule: convex")
            return inverse_time(1.0 / setting.l2), {"schedule": "1/(λt)", "step_c": 1.0 / setting.l2}
        G = math.sqrt(n_params * sigma**2 + (lipschitz + setting.l2 * radius) ** 2)  # E‖noisy gradient‖² bound
        c = 2.0 * radius / G
        return inverse_sqrt(c), {"schedule": "2R/(G√t)", "step_c": c, "G": G}

    def chain(self, setting: Setting, X, y, streams: ReplicaStreams, model: Model, sigma: float, lipschitz: float,
              radius: float, schedule: Schedule) -> GradientChain:
        noise = [add_noise(sigma, streams.normal("noise", (model.n_params,)))] if sigma > 0 else []
        return GradientChain(
            batches=uniform_example_blocks(X, y, streams),
            clip=lipschitz,
            transforms=[*noise, add_l2(setting.l2)],
            schedule=schedule,
            project=project_to_ball(radius),
            checkpoints=Checkpoints(setting.trace_every, X, y) if setting.trace_every else None,
            examples_per_step=1,
            backend=self.params.backend,  # the single-example kernel where it applies
            noise_source=NoiseSource(streams, "noise", (model.n_params,)) if sigma > 0 else None,
        )

    def privacy(self, setting: Setting, lipschitz: float) -> Privacy:
        p = self.params
        return calibrate_bassily(float(setting.epsilon), float(setting.delta), int(setting.n), self.steps(setting),
                                 float(lipschitz), p.accounting, p.formula, p.amplification)

    def fit(self, setting: Setting, model: Model, X, y, streams: ReplicaStreams) -> Outcome:
        lipschitz = model.lipschitz(1.0)  # the public bound ‖x‖ ≤ 1, not the data's max norm
        l_used = lipschitz if lipschitz is not None else 1.0  # no bound: clip to 1 (guarantee says none)
        steps = self.steps(setting)
        priv = self.privacy(setting, l_used)
        radius = self.radius(setting, l_used)
        schedule, step_info = self.schedule(setting, priv.sigma, l_used, radius, model.n_params)
        init = model.init(streams.generators("init"))
        x_norm = cached_row_norms(X)  # the batches' and the kernel's too (once per read-only X)
        chain = self.chain(setting, X, y, streams, model, priv.sigma, l_used, radius, schedule)
        theta = chain.run(model, init, steps)
        trace = chain.checkpoints.rows if chain.checkpoints else []
        backend = chain.ran_on
        max_norm = float(x_norm.max()) if len(X) else 0.0  # = max_row_norm(X): √ is monotone, correctly rounded
        derived = {"steps": steps, "sample_rate": 1.0 / setting.n, "sigma": priv.sigma,
                   "epsilon_achieved": priv.epsilon, "accountant": priv.accountant, "accountant_library": LIBRARY,
                   "lipschitz": l_used, "sensitivity": 2.0 * l_used, "radius": radius, "max_row_norm": max_norm,
                   "backend": backend, **step_info, **priv.details}
        if priv.accountant != "rdp":
            # what the exact-scheme RDP accountant certifies for the σ used (for "what tighter accounting buys")
            derived["epsilon_rdp"] = _cached_rdp_epsilon(priv.sigma / (2.0 * l_used), setting.n, steps,
                                                         setting.delta)
        return Outcome(theta, derived, guarantee=self.guarantee(model, lipschitz, max_norm, priv), trace=trace)

    @staticmethod
    def guarantee(model: Model, lipschitz: Optional[float], max_norm: float, priv: Privacy) -> str:
        if not model.convex:
            return "none: non-convex model"
        if max_norm > 1.0 + ROW_NORM_TOLERANCE:
            return f"none: rows outside the unit ball (max ‖x‖ = {max_norm:.4g} > 1)"
        if lipschitz is None:
            return "none: the model's loss has no Lipschitz bound"
        if not priv.proved:
            return f"none: {priv.reason}"
        return "proved"
