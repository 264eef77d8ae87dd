"""Classical DP building blocks: noise calibration, samplers, amplification and composition; bad input raises
:class:`~dpsgd_cli.errors.UserError` naming the parameter, value and allowed range."""

from __future__ import annotations

import math

import numpy as np

from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy import validate as check

# imported on first use (dp-accounting is slow to import): the algorithm registry imports this module for every run
_dp = LazyModule("dp_accounting")
optimize = LazyModule("scipy.optimize")

__all__ = [
    "advanced_composition",
    "advanced_composition_epsilon_per_step",
    "amplify_by_subsampling",
    "analytic_gaussian_epsilon",
    "analytic_gaussian_sigma",
    "basic_composition",
    "gamma_norm_noise",
    "gaussian_noise",
    "gaussian_sigma",
    "gaussian_sigma_valid",
    "laplace_noise",
    "laplace_scale",
]

Size = int | tuple[int, ...] | None


# --- Laplace ------------------------------------------------------------------------------------------------------


def laplace_scale(sensitivity: float, epsilon: float) -> float:
    """Scale b = Delta_1 / epsilon of the epsilon-DP Laplace mechanism (Dwork, McSherry, Nissim & Smith 2006)."""
    delta_1 = check.positive("sensitivity", sensitivity)
    eps = check.positive("epsilon", epsilon)
    return delta_1 / eps


def laplace_noise(rng: np.random.Generator, scale: float, size: Size = None) -> np.ndarray:
    """i.i.d. Laplace(0, scale) noise, density exp(-|x|/b) / (2b) (Dwork et al. 2006)."""
    b = check.positive("scale", scale)
    return rng.laplace(0.0, b, size)


# --- Gaussian -----------------------------------------------------------------------------------------------------


def gaussian_sigma_valid(epsilon: float) -> bool:
    """Whether the classical bound of :func:`gaussian_sigma` is proven: 0 < epsilon < 1."""
    return 0.0 < float(epsilon) < 1.0


def gaussian_sigma(
    sensitivity: float, epsilon: float, delta: float, *, strict: bool = True
) -> float:
    """σ = Δ₂√(2 ln(1.25/δ))/ε (Dwork & Roth 2014, Thm A.1), proven for 0 < ε < 1 only: at ε ≥ 1 a UserError, or with
    ``strict=False`` the formula's value without guarantee (to plot it); :func:`analytic_gaussian_sigma` is valid."""
    delta_2 = check.positive("sensitivity", sensitivity)
    eps = check.positive("epsilon", epsilon)
    d = check.open_unit("delta", delta)
    if strict and not gaussian_sigma_valid(eps):
        raise UserError(
            f"epsilon must be in (0, 1) for the classical Gaussian mechanism bound "
            f"(Dwork & Roth Thm A.1), got {epsilon!r}; use analytic_gaussian_sigma or strict=False"
        )
    return delta_2 * math.sqrt(2.0 * math.log(1.25 / d)) / eps


def analytic_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """Smallest σ making the Gaussian mechanism (ε, δ)-DP at any ε > 0 (Balle & Wang 2018, Thm 8, by dp-accounting)."""
    delta_2 = check.positive("sensitivity", sensitivity)
    eps = check.positive("epsilon", epsilon)
    d = check.open_unit("delta", delta)
    return delta_2 * float(_dp.get_sigma_gaussian(eps, d))


def analytic_gaussian_epsilon(sensitivity: float, sigma: float, delta: float, releases: int = 1) -> float:
    """The exact ε at δ of `releases` Gaussian mechanisms of L2 sensitivity Δ: k releases at z = σ/Δ compose to one at
    z/√k (their privacy losses are Gaussian), whose ε is Balle & Wang's (2018, Thm 8)."""
    delta_2 = check.positive("sensitivity", sensitivity)
    s = check.positive("sigma", sigma)
    d = check.open_unit("delta", delta)
    if releases < 1:
        raise UserError(f"releases must be >= 1, got {releases!r}")
    return float(_dp.get_epsilon_gaussian(s / (delta_2 * math.sqrt(releases)), d))


def gaussian_noise(rng: np.random.Generator, sigma: float, size: Size = None) -> np.ndarray:
    """i.i.d. N(0, sigma^2) noise (Gaussian mechanism, Dwork & Roth 2014, App. A)."""
    s = check.positive("sigma", sigma)
    return rng.normal(0.0, s, size)


# --- Amplification by subsampling ---------------------------------------------------------------------------------


def amplify_by_subsampling(
    epsilon: float, q: float, delta: float = 0.0, tight: bool = True
) -> tuple[float, float]:
    """(epsilon', delta') of an (epsilon, delta)-DP mechanism run on a q-subsample.

    ``tight=True``: epsilon' = ln(1 + q (e^epsilon - 1)), delta' = q delta, for Poisson
    (Bernoulli) subsampling with add/remove neighbours, or sampling without replacement with
    q = m/n and replace-one neighbours (Li, Qardaji & Su 2012; tight: Balle, Barthe & Gaboardi
    2018, Thm 9/10).  ``tight=False``: the lecture bound epsilon' = 2 q epsilon, delta' = q delta
    (Kasiviswanathan et al. 2008/2011; valid for epsilon <= 1 because
    ln(1 + q(e^eps - 1)) <= q (e - 1) eps <= 2 q eps there): raises :class:`UserError` for
    epsilon > 1, where it is *not* an upper bound.
    """
    eps = check.positive("epsilon", epsilon)
    rate = check.sample_rate("q", q)
    d = check.half_open_unit_left_closed("delta", delta)
    if tight:
        return math.log1p(rate * math.expm1(eps)), rate * d
    if eps > 1.0:
        raise UserError(
            f"epsilon must be in (0, 1] for the approximate amplification bound 2*q*epsilon, "
            f"got {epsilon!r}; use tight=True"
        )
    return 2.0 * rate * eps, rate * d


# --- Composition --------------------------------------------------------------------------------------------------


def basic_composition(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """k-fold composition of (epsilon, delta)-DP mechanisms: (k epsilon, k delta) (Dwork & Roth 2014, Thm 3.16)."""
    eps = check.positive("epsilon", epsilon)
    d = check.half_open_unit_left_closed("delta", delta)
    n = check.count("k", k)
    return n * eps, n * d


def advanced_composition(
    epsilon: float, delta: float, k: int, delta_prime: float
) -> tuple[float, float]:
    """Advanced composition (Dwork, Rothblum & Vadhan 2010, Thm III.3): k adaptive (ε, δ)-DP mechanisms are
    (ε√(2k ln(1/δ')) + kε(e^ε − 1), kδ + δ')-DP."""
    eps = check.positive("epsilon", epsilon)
    d = check.half_open_unit_left_closed("delta", delta)
    n = check.count("k", k)
    dp = check.open_unit("delta_prime", delta_prime)
    total_eps = eps * math.sqrt(2.0 * n * math.log(1.0 / dp)) + n * eps * math.expm1(eps)
    return total_eps, n * d + dp


def advanced_composition_epsilon_per_step(
    total_epsilon: float, total_delta: float, k: int, delta_prime: float | None = None
) -> tuple[float, float]:
    """Per-step (ε, δ) whose k-fold :func:`advanced_composition` is the total budget: δ' = ``delta_prime`` (default
    total_delta/2), per-step δ = (total_delta − δ')/k, ε the root of ε√(2k ln(1/δ')) + kε(e^ε − 1) = total (Brent).
    ``delta_prime=total_delta`` gives pure-DP steps; for small k this can be worse than :func:`basic_composition`."""
    total_eps = check.positive("total_epsilon", total_epsilon)
    total_d = check.open_unit("total_delta", total_delta)
    n = check.count("k", k)
    dp = total_d / 2.0 if delta_prime is None else check.open_unit("delta_prime", delta_prime)
    if dp > total_d:
        raise UserError(
            f"delta_prime must be in (0, total_delta={total_d!r}], got {delta_prime!r}"
        )
    step_delta = max(0.0, (total_d - dp) / n)
    root_term = math.sqrt(2.0 * n * math.log(1.0 / dp))

    def excess(eps: float) -> float:
        return eps * root_term + n * eps * math.expm1(eps) - total_eps

    # excess(0) < 0; excess(upper) >= 0 since the second term is >= 0.
    upper = total_eps / root_term
    eps = optimize.brentq(excess, 0.0, upper, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)
    return float(eps), step_delta


# --- Noise with density proportional to exp(-(alpha/2) ||z||) -----------------------------------------------------


def gamma_norm_noise(
    rng: np.random.Generator, alpha: float, d: int, size: Size = None
) -> np.ndarray:
    """Noise in R^d with density ∝ exp(−(α/2)‖z‖₂) (Song, Chaudhuri & Sarwate 2013): ‖Z‖ ~ Gamma(d, 2/α) times a
    uniform direction; shape ``(d,)`` if ``size`` is None, else ``(*size, d)``; for d = 1 Laplace(0, 2/α)."""
    a = check.positive("alpha", alpha)
    dim = check.count("d", d)
    if size is None:
        batch: tuple[int, ...] = ()
    elif isinstance(size, (tuple, list)):
        batch = tuple(int(s) for s in size)
    else:
        batch = (int(size),)
    if any(s < 0 for s in batch):
        raise UserError(f"size must be non-negative, got {size!r}")
    return gamma_norm_draws(rng, 2.0 / a, dim, batch)


def gamma_norm_draws(rng: np.random.Generator, scale: float, d: int, batch: tuple[int, ...]) -> np.ndarray:
    """`gamma_norm_noise` without its checks (scale = 2/α > 0, d ≥ 1, batch a tuple of sizes): the same draws,
    for callers that check once and draw many blocks (song2013's Z_t, 64 steps a call)."""
    norms = rng.gamma(shape=float(d), scale=scale, size=batch)
    directions = rng.standard_normal(batch + (d,))
    # ‖·‖ as np.linalg.norm computes it (sqrt of add.reduce of the squares: the same bits), without its overhead
    lengths = np.sqrt(np.add.reduce(directions * directions, axis=-1, keepdims=True))
    directions /= np.where(lengths > 0, lengths, 1.0)  # a zero vector has probability 0
    return norms[..., None] * directions
