"""Accounting of T steps that each add Gaussian noise to one uniformly drawn example's clipped gradient
(Bassily, Smith & Thakurta, FOCS 2014, Algorithm 1; `pidp_sgd`'s noisy steps): closed forms, the lecture's chain,
RDP and PLD events under replace-one, and :func:`calibrate_bassily`. Derivations: docs/algorithms.md (bassily2014)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from dpsgd_cli import diskcache
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy.accounting import (
    ACCOUNTANTS,
    CALIBRATION_VERSION,
    LIBRARY,
    AccountantName,
    memoised,
    rdp_epsilon_and_order,
    rdp_epsilon_floor,
    snap_down,
)
from dpsgd_cli.privacy.calibration import cached, calibrate, positive_sigma, verify_lattice_point
from dpsgd_cli.privacy.mechanisms import (
    advanced_composition,
    advanced_composition_epsilon_per_step,
    amplify_by_subsampling,
    analytic_gaussian_sigma,
    gaussian_sigma,
)

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

# dp-accounting (slow to import) on first use: a run whose calibrations come from the disk cache never imports it
_dp = LazyModule("dp_accounting")
_events = LazyModule("dp_accounting.dp_event")

__all__ = [
    "PLD_RHO_SINGLE_EXAMPLE",
    "ChainBound",
    "Privacy",
    "calibrate_bassily",
    "cached_rdp_epsilon",
    "chain_bound",
    "closed_form_sigma",
    "pld_epsilon",
    "pld_event",
    "rdp_epsilon",
    "rdp_event",
]

PLD_RHO_SINGLE_EXAMPLE = 0.04  # see pld_epsilon
VERSION = "2"  # part of the disk cache key: bump it with any change that could move σ or ε
_VERSIONS = {"library": LIBRARY, "scipy": importlib.metadata.version("scipy"), "rho": repr(PLD_RHO_SINGLE_EXAMPLE),
             "calibration_version": CALIBRATION_VERSION, "single_example_version": VERSION}

Accounting = Literal["closed_form", "advanced_composition", AccountantName]
Formula = Literal["paper", "lecture"]
Amplification = Literal["tight", "approx"]
Gaussian = Literal["classical", "analytic"]


# --- Closed forms and the lecture's chain -------------------------------------------------------------------------


def closed_form_sigma(epsilon: float, delta: float, n: int, steps: int, lipschitz: float,
                      formula: str = "lecture") -> float:
    """σ on the mean-objective scale: `paper` √32·l·√(T ln(T/(nδ)) ln(1/δ))/(nε) (BST14 Alg. 1, recalled), `lecture`
    16·l·√(T ln(2/δ) ln(2.5T/(δn)))/(nε) (Bellet, lecture 5); docs/algorithms.md (bassily2014)."""
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
                amplification: str = "tight", gaussian: str = "analytic") -> ChainBound:
    """Total ε of T steps by the lecture's chain, docs/algorithms.md (bassily2014); δ split δ' = δ/2 (composition) +
    T·qδ₀ = δ/2 (steps); ε₀ by the classical (ε₀ < 1 only) or the analytic Gaussian (Balle & Wang 2018)."""
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


# --- dp-accounting, replace-one relation --------------------------------------------------------------------------


def rdp_event(noise_multiplier: float, n: int, steps: int) -> DpEvent:
    """T steps, each one example drawn uniformly (a size-1 sample without replacement) + Gaussian noise."""
    return cast("DpEvent", _events.SelfComposedDpEvent(
        _events.SampledWithoutReplacementDpEvent(n, 1, _events.GaussianDpEvent(noise_multiplier)), steps))


def pld_event(noise_multiplier: float, n: int, steps: int) -> DpEvent:
    """The dominating pair of docs/algorithms.md (bassily2014): Poisson(1/n)-sampled Gaussian, replace-one, ±2l."""
    return cast("DpEvent", _events.SelfComposedDpEvent(
        _events.PoissonSampledDpEvent(1.0 / n, _events.GaussianDpEvent(noise_multiplier)), steps))


def rdp_epsilon(noise_multiplier: float, n: int, steps: int, delta: float) -> tuple[float, float]:
    """(ε, optimal order) of `rdp_event` under replace-one neighbours, over the shared order grid."""
    return rdp_epsilon_and_order(rdp_event(noise_multiplier, n, steps), delta, _dp.NeighboringRelation.REPLACE_ONE)


@functools.lru_cache(maxsize=256)
def cached_rdp_epsilon(noise_multiplier: float, n: int, steps: int, delta: float) -> float:
    """ε of `rdp_event`, kept in the process only: on disk, checking a cached ε would cost its computation."""
    return rdp_epsilon(noise_multiplier, n, steps, delta)[0]


def pld_epsilon(noise_multiplier: float, n: int, steps: int, delta: float) -> tuple[float, float]:
    """(ε, discretisation h) of `pld_event`, pessimistic; h = PLD_RHO_SINGLE_EXAMPLE·ε/√T snapped to 10^(−k/4), by
    the fixed-point rule of `dpsgd_cli.privacy.accounting` (each pass is an upper bound).

    ρ = 0.04 instead of the shared 0.005: with T ~ 10⁵ steps the shared rule's h ~ 1e-5 is far slower, and on
    adult h = 1e-4 is within 0.3 % of it; every h gives an upper bound (pessimistic rounding), so a coarser h only
    adds noise."""
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
        h_new = max(1e-10, snap_down(PLD_RHO_SINGLE_EXAMPLE * eps / math.sqrt(steps)))
        if h_new >= h:
            break
        h, eps = h_new, once(h_new)
    return eps, h


# --- Calibration: σ for the target ε, per accounting --------------------------------------------------------------


@dataclass(frozen=True)
class Privacy:
    sigma: float
    epsilon: float  # achieved by the accounting's own analysis
    accountant: str
    details: dict[str, Any]
    proved: bool = True  # the accounting's lemmas apply (closed forms and 2qε may not)
    reason: str = ""


def _advanced_composition_privacy(sigma: float, delta: float, n: int, steps: int, lipschitz: float,
                                  amplification: str, gaussian: str) -> Privacy:
    b = chain_bound(sigma, delta, n, steps, lipschitz, amplification, gaussian)
    details = {"amplification": amplification, "gaussian": gaussian, "eps0": b.eps0, "delta0": b.delta0,
               "eps1": b.eps1}
    return Privacy(sigma, b.epsilon, f"advanced_composition_{amplification}", details, b.valid, b.reason)


_DETAIL = {"rdp": "rdp_order", "pld": "value_discretization_interval"}  # what each accountant records at σ
_GAUSSIAN = {"tight": "analytic", "approx": "classical"}  # advanced composition's Gaussian step, by amplification


def _accountant_details(accounting: str, noise_multiplier: float, at_sigma: float) -> dict[str, Any]:
    """The details of a calibration by the RDP or PLD accountant: the noise multiplier z = σ / (2·lipschitz) and
    what the accountant records at it (`_DETAIL`)."""
    return {"noise_multiplier": noise_multiplier, _DETAIL[accounting]: at_sigma, "neighboring_relation": "replace_one",
            "event": ("SampledWithoutReplacement(n, 1, Gaussian)" if accounting == "rdp"
                      else "PoissonSampled(1/n, Gaussian) as a dominating pair")}


def _verified(stored: dict[str, Any], epsilon: float, delta: float, n: int, steps: int, lipschitz: float,
              accounting: str, formula: str, amplification: str) -> Privacy:
    """A cached calibration checked by one evaluation of its own analysis at its σ (a point of the calibration
    lattice, ε in the window, or the analysis steps over it just below σ: `verify_lattice_point`); returned with that
    evaluation's ε and details, never the stored ones (whose fields must be exactly those recomputed). Closed forms
    cost no more than their check: recomputed. Raises `diskcache.Rejected`."""
    if accounting == "closed_form":
        fresh = _calibrate_bassily(epsilon, delta, n, steps, lipschitz, accounting, formula, amplification)
        diskcache.exact_fields(stored["details"], fresh.details, "details")
        return fresh
    privacy = Privacy(**stored)
    sigma = positive_sigma(privacy.sigma)
    context = f" by {accounting}"
    if accounting == "advanced_composition":
        gaussian = _GAUSSIAN[amplification]

        def chain(s: float) -> tuple[float, Privacy]:
            at = _advanced_composition_privacy(s, delta, n, steps, lipschitz, amplification, gaussian)
            return at.epsilon, at

        fresh = verify_lattice_point(sigma, epsilon, chain, context=context)[1]
        if diskcache.exact_fields(privacy.details, fresh.details, "details")["gaussian"] != gaussian:
            raise diskcache.Rejected(f"its Gaussian step {privacy.details['gaussian']!r} is not the {gaussian} one "
                                     f"that {amplification} amplification calibrates")
        return fresh
    z = diskcache.exact_fields(privacy.details, _accountant_details(accounting, 0.0, 0.0),
                               "details")["noise_multiplier"]
    if not (isinstance(z, float) and sigma == 2.0 * lipschitz * z):
        raise diskcache.Rejected(f"its sigma {sigma!r} is not 2·lipschitz × its noise multiplier {z!r}")
    func = rdp_epsilon if accounting == "rdp" else pld_epsilon
    e, x = verify_lattice_point(z, epsilon, lambda m: func(m, n, steps, delta), context=context)
    return Privacy(sigma, e, accounting, _accountant_details(accounting, z, x))


@memoised(maxsize=256)
def calibrate_bassily(epsilon: float, delta: float, n: int, steps: int, lipschitz: float, accounting: str,
                      formula: str = "lecture", amplification: str = "tight") -> Privacy:
    """σ (on the mean scale) whose ε under `accounting` is the target (within 0.1 % below; exact for closed forms),
    kept in the process and in the calibration disk cache (checked against its analysis when read back)."""
    key = {"mechanism": "single_example_gaussian", "target_epsilon": repr(epsilon), "delta": repr(delta), "n": n,
           "steps": steps, "lipschitz": repr(lipschitz), "accounting": accounting, "formula": formula,
           "amplification": amplification, **_VERSIONS}
    return cached(key, [f.name for f in dataclasses.fields(Privacy)],
                  lambda: _calibrate_bassily(epsilon, delta, n, steps, lipschitz, accounting, formula, amplification),
                  lambda stored: _verified(stored, epsilon, delta, n, steps, lipschitz, accounting, formula,
                                           amplification),
                  dataclasses.asdict)


def _calibrate_bassily(epsilon: float, delta: float, n: int, steps: int, lipschitz: float, accounting: str,
                       formula: str = "lecture", amplification: str = "tight") -> Privacy:
    context = f" (bassily2014, accounting={accounting}, n={n}, T={steps}, delta={delta:g})"
    if accounting == "closed_form":
        sigma = closed_form_sigma(epsilon, delta, n, steps, lipschitz, formula)
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
        gaussian = _GAUSSIAN[amplification]
        eps1, delta1 = advanced_composition_epsilon_per_step(epsilon, delta, steps)
        q = 1.0 / n
        eps0 = math.log1p(math.expm1(eps1) / q) if amplification == "tight" else eps1 / (2.0 * q)
        delta0 = delta1 / q
        if gaussian == "analytic":
            guess = analytic_gaussian_sigma(2.0 * lipschitz, eps0, delta0)
        else:
            guess = gaussian_sigma(2.0 * lipschitz, eps0, delta0, strict=False)

        def eps_of(sigma: float) -> float:
            return chain_bound(sigma, delta, n, steps, lipschitz, amplification, gaussian).epsilon

        point = calibrate(eps_of, epsilon, sigma_guess=guess, context=context)
        return _advanced_composition_privacy(point.sigma, delta, n, steps, lipschitz, amplification, gaussian)
    if accounting in ACCOUNTANTS:
        if accounting == "rdp" and epsilon <= rdp_epsilon_floor(delta):
            raise UserError(f"bassily2014: target epsilon={epsilon:g} is below what the RDP conversion can certify "
                            f"at delta={delta:g}; use accounting: pld")
        extra: dict[float, float] = {}
        func = rdp_epsilon if accounting == "rdp" else pld_epsilon

        def eps_of_multiplier(multiplier: float) -> float:
            e, x = func(multiplier, n, steps, delta)
            extra[multiplier] = x
            return e

        # guess: the CLT asymptote ε ≈ q√(2T ln(1/δ))·2/z (replace-one ~ twice add/remove)
        guess = max(0.5, 2.0 * math.sqrt(2.0 * steps * math.log(1.0 / delta)) / (n * epsilon))
        point = calibrate(eps_of_multiplier, epsilon, sigma_guess=guess, context=context)
        return Privacy(2.0 * lipschitz * point.sigma, point.epsilon, accounting,
                       _accountant_details(accounting, point.sigma, extra[point.sigma]))
    raise UserError(f"bassily2014: unknown accounting {accounting!r}")
