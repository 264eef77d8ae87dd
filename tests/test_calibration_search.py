"""The σ search reads few points and still finds the point its definition names: on monotone curves of every kind
(smooth power laws, discretised step functions, jumps over the window) it returns exactly what a plain bisection
from the same start returns (the reference below), and on DP-SGD's accountants it takes a handful of evaluations."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy import accounting as acc
from dpsgd_cli.privacy import single_example_gaussian as seg
from dpsgd_cli.privacy.calibration import _LATTICE_LEVELS, LATTICE_STEP, EpsilonCurve


def reference_calibrate(epsilon_of_sigma: Callable[[float], float], target: float, sigma_guess: float = 1.0,
                        rel_tol: float = 1e-3, sigma_min: float = 1e-2,
                        sigma_max: float = 1e6) -> tuple[float, float, bool, int]:
    """(σ, ε, in window, evaluations) by the definition's plain search: outwards from the guess by doubling steps
    of 64 lattice points, bisection down to adjacent lattice points, then the step halved up to `_LATTICE_LEVELS`
    times while ε(σ) jumps over the window. Raises UserError where no σ in the range reaches the target, or
    where sigma_min already beats it by more than rel_tol."""
    memo: dict[float, float] = {}

    def eps(x: float) -> float:
        if x not in memo:
            memo[x] = float(epsilon_of_sigma(math.exp(x)))
        return memo[x]

    k_min, k_max = math.ceil(math.log(sigma_min) / LATTICE_STEP), math.floor(math.log(sigma_max) / LATTICE_STEP)
    above: int | None = None
    below: int | None = None
    k, step = min(k_max, max(k_min, round(math.log(sigma_guess) / LATTICE_STEP))), 64
    while above is None or below is None:
        k = min(k_max, max(k_min, k))
        if eps(k * LATTICE_STEP) <= target:
            below = k
            if k == k_min:
                e = eps(k * LATTICE_STEP)
                if e < (1 - rel_tol) * target:
                    raise UserError("too loose")
                return math.exp(k * LATTICE_STEP), e, True, len(memo)
            k -= step
        else:
            above = k
            if k == k_max:
                raise UserError("unreachable")
            k += step
        step *= 2
    while below - above > 1:
        k = (above + below) // 2
        if eps(k * LATTICE_STEP) <= target:
            below = k
        else:
            above = k
    x_above, x_below = above * LATTICE_STEP, below * LATTICE_STEP
    for _ in range(_LATTICE_LEVELS):
        if eps(x_below) >= (1 - rel_tol) * target:
            return math.exp(x_below), eps(x_below), True, len(memo)
        mid = 0.5 * (x_above + x_below)
        if eps(mid) > target:
            x_above = mid
        else:
            x_below = mid
    e = eps(x_below)
    return math.exp(x_below), e, e >= (1 - rel_tol) * target, len(memo)


def _monotone_curves(rng: np.random.Generator) -> list[Callable[[float], float]]:
    """Non-increasing ε(σ) of many shapes: power laws of every steepness, sums of them (RDP-like: ~1/σ² at small σ,
    ~1/σ at large σ), and step functions (a discretised accountant: ε rounded up to a grid, coarse or fine, and
    a jump over any window)."""
    curves: list[Callable[[float], float]] = []
    for _ in range(12):
        c, p = float(rng.uniform(0.1, 30.0)), float(rng.choice([0.3, 0.7, 1.0, 1.5, 2.0, 3.0, 8.0, 40.0]))
        curves.append(lambda s, c=c, p=p: c * s**-p)
        a, b = float(rng.uniform(0.05, 5.0)), float(rng.uniform(0.05, 5.0))
        curves.append(lambda s, a=a, b=b: a / s + b / s**2 + 1e-3 * math.exp(-s))
        grid = float(10.0 ** rng.uniform(-5.0, -1.0))  # ε rounded up to a grid: a staircase
        curves.append(lambda s, c=c, p=p, grid=grid: math.ceil(c * s**-p / grid) * grid)
        at = float(10.0 ** rng.uniform(-1.0, 2.0))  # a jump of 20 % at one σ on a smooth curve
        curves.append(lambda s, c=c, at=at: c / s * (1.2 if s < at else 1.0))
    return curves


def test_the_search_returns_the_reference_point_on_monotone_curves():
    rng = np.random.default_rng(20261128)
    compared = 0
    for curve in _monotone_curves(rng):
        for _ in range(6):
            target = float(10.0 ** rng.uniform(-3.0, 1.5))
            guess = float(10.0 ** rng.uniform(-1.5, 3.0))
            try:
                want = reference_calibrate(curve, target, guess)
            except UserError as exc:
                with pytest.raises(UserError, match="too loose" if "loose" in str(exc) else "unreachable"):
                    EpsilonCurve(lambda s, f=curve: (f(s), None)).calibrate(target, guess)
                continue
            got = EpsilonCurve(lambda s, f=curve: (f(s), None)).calibrate(target, guess)
            assert (got.sigma, got.epsilon, got.in_window) == want[:3], (target, guess, got, want)
            assert got.evaluations <= want[3], (target, guess, got, want)
            compared += 1
    assert compared > 250  # the errors are checked too, but most draws must be calibrations


def test_the_search_returns_the_reference_point_on_a_shared_curve():
    """An ε axis on one curve: each target finds what it finds alone, whatever was read before it."""
    rng = np.random.default_rng(7)
    for curve in _monotone_curves(rng)[:16]:
        shared = EpsilonCurve(lambda s, f=curve: (f(s), None))
        for target in rng.permutation(np.geomspace(0.01, 5.0, 9)):
            try:
                want = reference_calibrate(curve, float(target), 1.0)
            except UserError:
                continue
            got = shared.calibrate(float(target), float(10.0 ** rng.uniform(-1.0, 2.0)))
            assert (got.sigma, got.epsilon, got.in_window) == want[:3]


KANG_N = 36178  # adult, split random, the training set of a kang cell's final run
KANG_Q, KANG_T = 256 / KANG_N, round(2 * KANG_N / 256)


@pytest.mark.parametrize(("accountant", "targets"), [("rdp", (0.01, 0.1, 0.3, 1.0, 3.0)),
                                                     pytest.param("pld", (0.01, 1.0), marks=pytest.mark.slow)])
def test_dpsgd_calibrations_take_a_handful_of_evaluations(accountant, targets):
    """A kang baseline (B = 256, 2 epochs, δ = 1/n²): the bisection takes 15-18 evaluations a target, the search
    at most 10 (RDP: ε(σ) has kinks where the best order changes), for the same σ."""
    delta = 1.0 / KANG_N**2
    neighbours = "add_remove" if accountant == "rdp" else "replace_one"
    for target in targets:
        curve = acc.dpsgd_curve.__wrapped__(delta, KANG_Q, KANG_T, accountant, neighbours)
        guess = acc._sigma_guess(target, delta, KANG_Q, KANG_T)
        point = curve.calibrate(target, sigma_guess=guess)
        want = reference_calibrate(lambda s, c=curve: c.evaluate(s)[0], target, guess)
        assert (point.sigma, point.epsilon, point.in_window) == want[:3]
        assert point.evaluations <= 10 < want[3], (target, point.evaluations, want[3])


@pytest.mark.slow
def test_single_example_pld_calibration_takes_few_evaluations():
    """pidp_sgd's noisy steps at a kang-like setting (ε₁ = 3/4, δ₁ = 1/(2n²), T = 2n, replace-one PLD; n smaller
    to keep the test quick): the bisection takes 16 evaluations, the search at most 8, for the same σ."""
    n = 2000

    def eps(z: float) -> float:
        return seg.pld_epsilon(z, n, 2 * n, 0.5 / n**2)[0]

    point = EpsilonCurve(lambda z: (eps(z), None)).calibrate(0.75, sigma_guess=1.0)
    want = reference_calibrate(eps, 0.75, 1.0)
    assert (point.sigma, point.epsilon, point.in_window) == want[:3]
    assert point.evaluations <= 8 < want[3], (point.evaluations, want[3])
