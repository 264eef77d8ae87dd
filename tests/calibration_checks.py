"""What a calibration must satisfy, stated as properties rather than bits: a σ found on another CPU (whose
vectorised exp and log may differ from this one's by an ulp) passes exactly when it is the search's answer there."""

from __future__ import annotations

import math
from collections.abc import Callable

from dpsgd_cli.privacy.calibration import _LATTICE_LEVELS, LATTICE_STEP, EpsilonCurve

REL_TOL = 1e-3


def curve_of(epsilon_of_sigma: Callable[[float], float], sigma_min: float = 1e-2) -> EpsilonCurve:
    """The accountant curve of a mechanism calibrated by `calibration.calibrate`, for `assert_lattice_point`."""
    return EpsilonCurve(lambda sigma: (epsilon_of_sigma(sigma), None), sigma_min=sigma_min)


def assert_lattice_point(sigma: float, epsilon: float, target: float, curve: EpsilonCurve, recorded_sigma: float,
                         setting: object) -> None:
    """σ is the smallest point of the calibration lattice whose ε meets the target: ε(σ) ≤ target (within rel_tol
    below it, or ε jumps over the window), σ lies on the lattice, the coarse lattice point below σ is not private
    enough, and σ is the recorded σ or its lattice neighbour (ε within an ulp of the target moves it by one)."""
    assert epsilon <= target, (setting, epsilon)
    assert curve.evaluate(sigma)[0] == epsilon, (setting, sigma, "ε is not the accountant's at σ")
    finest = LATTICE_STEP / 2**_LATTICE_LEVELS
    assert math.exp(round(math.log(sigma) / finest) * finest) == sigma, (setting, sigma, "not a lattice point")
    k = math.log(sigma) / LATTICE_STEP
    below = round(k) - 1 if abs(k - round(k)) < 1e-6 else math.floor(k)
    if below * LATTICE_STEP >= math.log(curve.sigma_range[0]):
        assert curve.epsilon(below * LATTICE_STEP) > target, (setting, sigma, "a smaller lattice σ meets the target")
    if epsilon < (1 - REL_TOL) * target:  # allowed only where ε(σ) steps over the window just below σ
        assert curve.evaluate(sigma * math.exp(-finest))[0] > target, (setting, sigma, epsilon)
    assert abs(math.log(sigma / recorded_sigma)) <= LATTICE_STEP * (1 + 1e-6), (setting, sigma, recorded_sigma)
