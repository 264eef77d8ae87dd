"""Rényi-DP bounds of noisy full-batch gradient descent (Chourasia, Ye & Shokri, NeurIPS 2021, arXiv:2102.05855):
dynamics bound, K-fold composition, their minimum and the squared-loss lower bound; docs/algorithms.md (noisy_gd)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy import validate as check
from dpsgd_cli.privacy.accounting import RDP_ORDERS, rdp_curve_to_epsilon
from dpsgd_cli.privacy.calibration import CalibrationPoint, calibrate

__all__ = [
    "ACCOUNTANTS",
    "SATURATION_ROOT",
    "calibrate_noisy_gd",
    "composition_rdp",
    "dynamics_rdp",
    "minimum_rdp",
    "noisy_gd_epsilon",
    "privacy_curve",
    "squared_loss_lower_bound",
]

ACCOUNTANTS: tuple[str, ...] = ("dynamics", "composition", "minimum")

SATURATION_ROOT: float = 1.5936242600400401
"""x* > 0 with 1 − e^{−x*} = x*/2: the dynamics and composition bounds cross at ληK/2 = x*."""


def _common(alpha: ArrayLike, K: ArrayLike, eta: float, sigma: float, n: float,
            sensitivity: float) -> tuple[np.ndarray, np.ndarray, float, float, float, float]:
    a = np.asarray(alpha, dtype=float)
    k = np.asarray(K, dtype=float)
    if np.any(~(a > 1)) or np.any(~np.isfinite(a)):
        raise UserError(f"alpha (the Rényi order) must be finite and > 1, got {alpha!r}")
    if np.any(~(k >= 0)) or np.any(~np.isfinite(k)):
        raise UserError(f"K (the number of steps) must be finite and ≥ 0, got {K!r}")
    return (a, k, check.positive("eta", eta), check.positive("sigma", sigma), check.positive("n", n),
            check.non_negative("sensitivity", sensitivity))


def dynamics_rdp(alpha: ArrayLike, K: ArrayLike, eta: float, sigma: float, lam: float, n: float,
                 sensitivity: float) -> np.ndarray:
    """ε(α) = αS_g²/(λσ²n²)·(1 − e^{−ληK/2}) (Chourasia et al. 2021), array-valued in α, K; for a λ-strongly convex,
    β-smooth loss with η < 1/β (checked by the caller)."""
    a, k, eta, sigma, n, s = _common(alpha, K, eta, sigma, n, sensitivity)
    lam = check.positive("lam (strong convexity λ)", lam)
    return a * s**2 / (lam * sigma**2 * n**2) * -np.expm1(-lam * eta * k / 2.0)


def composition_rdp(alpha: ArrayLike, K: ArrayLike, eta: float, sigma: float, n: float,
                    sensitivity: float) -> np.ndarray:
    """ε(α) = K · αΔ²/(2s²) with Δ = ηS_g/n, s² = 2ησ²:  α η K S_g² / (4 σ² n²); array-valued in α, K."""
    a, k, eta, sigma, n, s = _common(alpha, K, eta, sigma, n, sensitivity)
    delta_2 = eta * s / n  # L2 sensitivity of one step θ − η∇L_D(θ) (replace-one)
    rdp: np.ndarray = k * a * delta_2**2 / (2.0 * 2.0 * eta * sigma**2)
    return rdp


def squared_loss_lower_bound(alpha: ArrayLike, K: ArrayLike, eta: float, sigma: float, n: float,
                             sensitivity: float) -> np.ndarray:
    """α S_g² / (4 σ² n²) · (1 − e^{−ηK}): Chourasia et al.'s lower bound for ℓ(θ; x) = ½‖θ − x‖² (λ = 1)."""
    a, k, eta, sigma, n, s = _common(alpha, K, eta, sigma, n, sensitivity)
    return a * s**2 / (4.0 * sigma**2 * n**2) * -np.expm1(-eta * k)


def privacy_curve(K_values: Sequence[float] | np.ndarray, alpha: float = 30, sigma: float = 0.02,
                  sensitivity: float = 4, eta: float = 0.02, lam: float = 1, n: float = 5000) -> pd.DataFrame:
    """ε(α) against K for the three bounds (columns K, dynamics, composition, lower_bound; parameters in ``attrs``),
    defaults: the paper's Figure 1; the lower bound holds for λ = β = 1 only, else NaN (attrs["lower_bound_note"])."""
    K = np.asarray(K_values, dtype=float).ravel()
    if K.size == 0:
        raise UserError("K_values must not be empty")
    frame = pd.DataFrame({
        "K": K,
        "dynamics": dynamics_rdp(alpha, K, eta, sigma, lam, n, sensitivity),
        "composition": composition_rdp(alpha, K, eta, sigma, n, sensitivity),
        "lower_bound": squared_loss_lower_bound(alpha, K, eta, sigma, n, sensitivity),
    })
    if float(lam) != 1.0:
        frame["lower_bound"] = np.nan
        frame.attrs["lower_bound_note"] = (f"lower bound omitted: it holds for ℓ(θ; x) = ‖θ − x‖²/2, i.e. λ = β = 1, "
                                           f"not λ = {float(lam):g}")
    frame.attrs.update(alpha=float(alpha), sigma=float(sigma), sensitivity=float(sensitivity), eta=float(eta),
                       lam=float(lam), n=float(n),
                       saturation=float(alpha) * float(sensitivity) ** 2 / (float(lam) * float(sigma) ** 2
                                                                            * float(n) ** 2))
    return frame


# --- (ε, δ) and calibration --------------------------------------------------------------------------------------
Accountant = Literal["dynamics", "composition", "minimum"]


def minimum_rdp(alpha: ArrayLike, K: ArrayLike, eta: float, sigma: float, lam: float, n: float,
                sensitivity: float) -> np.ndarray:
    """min(dynamics_rdp, composition_rdp) at each order α: both are valid Rényi upper bounds of the same
    mechanism when the dynamics bound's assumptions hold, so their per-order minimum is one too (the RDP curve
    is then converted to (ε, δ) over all orders as usual)."""
    rdp: np.ndarray = np.minimum(dynamics_rdp(alpha, K, eta, sigma, lam, n, sensitivity),
                                 composition_rdp(alpha, K, eta, sigma, n, sensitivity))
    return rdp


def _rdp_slope(accountant: str, K: int, eta: float, lam: float, n: int, sensitivity: float) -> Callable[[float], float]:
    """σ ↦ c(σ) with ε(α) = c(σ)·α (all three bounds are linear in α)."""
    if accountant == "dynamics":
        return lambda sigma: float(dynamics_rdp(2.0, K, eta, sigma, lam, n, sensitivity)) / 2.0
    if accountant == "composition":
        return lambda sigma: float(composition_rdp(2.0, K, eta, sigma, n, sensitivity)) / 2.0
    if accountant == "minimum":
        return lambda sigma: float(minimum_rdp(2.0, K, eta, sigma, lam, n, sensitivity)) / 2.0
    raise UserError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")


def noisy_gd_epsilon(sigma: float, delta: float, K: int, eta: float, lam: float, n: int, sensitivity: float,
                     accountant: Accountant = "dynamics") -> float:
    """ε at δ of noisy GD: the RDP curve of ``accountant`` converted by ``rdp_curve_to_epsilon`` over RDP_ORDERS."""
    c = _rdp_slope(accountant, K, eta, lam, n, sensitivity)(check.positive("sigma", sigma))
    orders = np.asarray(RDP_ORDERS)
    return rdp_curve_to_epsilon(orders, c * orders, delta)


def calibrate_noisy_gd(target_epsilon: float, delta: float, K: int, eta: float, lam: float, n: int,
                       sensitivity: float, accountant: Accountant = "dynamics") -> CalibrationPoint:
    """The smallest lattice σ (the paper's noise parameter) whose ε meets the target (``calibrate``)."""
    target = check.positive("target_epsilon", target_epsilon)
    d = check.open_unit("delta", delta)
    check.positive("sensitivity", sensitivity)
    slope = _rdp_slope(accountant, K, eta, lam, n, sensitivity)
    # ε ≈ c + 2√(c ln(1/δ)) for an RDP curve c·α, and c ∝ 1/σ²: a first guess for σ
    log_inv = math.log(1.0 / d)
    c_target = (math.sqrt(log_inv + target) - math.sqrt(log_inv)) ** 2
    guess = math.sqrt(slope(1.0) / c_target)
    orders = np.asarray(RDP_ORDERS)
    context = f" (noisy_gd, accountant={accountant!r}, delta={d:g}, K={K}, eta={eta:g}, n={n})"
    return calibrate(lambda s: rdp_curve_to_epsilon(orders, slope(s) * orders, d), target,
                     sigma_min=guess * 1e-4, sigma_max=guess * 1e4, sigma_guess=guess, context=context)
