"""What a calibration must satisfy, stated as properties rather than bits: a σ found on another CPU (whose
vectorised exp and log may differ from this one's by an ulp) passes exactly when it is the search's answer there."""

from __future__ import annotations

import math

from dpsgd_cli.privacy.calibration import _LATTICE_LEVELS, LATTICE_STEP, EpsilonCurve

# Brent's search stops at the first σ whose ε is in [(1 − 1e-3)·target, target]: two machines may stop at two points
# of that window, whose σ differ by at most rel_tol / |d log ε / d log σ| (≥ 0.5 on every mechanism here)
BRENT_SIGMA_RTOL = 2e-3
REL_TOL = 1e-3


def assert_lattice_point(sigma: float, epsilon: float, target: float, curve: EpsilonCurve, recorded_sigma: float,
                         setting: object) -> None:
    """σ is the smallest point of the calibration lattice whose ε meets the target: ε(σ) ≤ target (within rel_tol
    below it, or ε jumps over the window), σ lies on the lattice, the coarse lattice point below σ is not private
    enough, and σ is the recorded σ or its lattice neighbour (ε within an ulp of the target moves it by one)."""
    assert epsilon <= target, (setting, epsilon)
    finest = LATTICE_STEP / 2**_LATTICE_LEVELS
    assert math.exp(round(math.log(sigma) / finest) * finest) == sigma, (setting, sigma, "not a lattice point")
    k = math.log(sigma) / LATTICE_STEP
    below = round(k) - 1 if abs(k - round(k)) < 1e-6 else math.floor(k)
    if below * LATTICE_STEP >= math.log(curve.sigma_range[0]):
        assert curve.epsilon(below * LATTICE_STEP) > target, (setting, sigma, "a smaller lattice σ meets the target")
    if epsilon < (1 - REL_TOL) * target:  # allowed only where ε(σ) steps over the window just below σ
        assert curve.evaluate(sigma * math.exp(-finest))[0] > target, (setting, sigma, epsilon)
    assert abs(math.log(sigma / recorded_sigma)) <= LATTICE_STEP * (1 + 1e-6), (setting, sigma, recorded_sigma)


def assert_in_window(sigma: float, epsilon: float, target: float, recorded: tuple[float, float],
                     setting: object) -> None:
    """Brent's calibrations: ε(σ) within rel_tol below the target, σ and ε where the recorded search stopped up to
    the window's width."""
    assert epsilon <= target * (1 + 1e-12), (setting, epsilon)
    assert math.isclose(sigma, recorded[0], rel_tol=BRENT_SIGMA_RTOL), (setting, sigma, recorded[0])
    assert math.isclose(epsilon, recorded[1], rel_tol=REL_TOL), (setting, epsilon, recorded[1])
