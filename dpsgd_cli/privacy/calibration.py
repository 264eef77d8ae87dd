"""Calibration: the smallest noise σ whose ε, by an accountant, is in [(1 − rel_tol)·target, target], and the one
disk cache of calibrated values.

Two searches, both over the exact accountant (ε must be non-increasing in σ):

* :class:`EpsilonCurve`: σ on a fixed lattice in log σ (step 2⁻¹²), the smallest lattice point whose ε meets the
  target, by bracketing and bisection: a function of the target alone, so one curve serves a whole ε axis.
  DP-SGD's σ (:func:`dpsgd_cli.privacy.accounting.calibrate_sigma`).
* :func:`calibrate`: Brent's method on log σ, stopped at the first σ whose ε is in the window; the other
  mechanisms' calibrations keep it, as the lattice would move their σ.

:func:`cached` keeps calibrations on disk (one folder, one entry format: key → value with a checksum,
:mod:`dpsgd_cli.diskcache`); a value read back must hold exactly its fields, and is used only after its `verify`
re-evaluates the accountant at its σ (:meth:`EpsilonCurve.verify`, :func:`check_window`), and the ε recorded is
that evaluation's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from dpsgd_cli import diskcache
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy import validate as check

optimize = LazyModule("scipy.optimize")

__all__ = [
    "LATTICE_STEP",
    "CalibrationPoint",
    "EpsilonCurve",
    "cache_folder",
    "cached",
    "calibrate",
    "check_window",
    "positive_sigma",
]


class CalibrationPoint(NamedTuple):
    """Result of :func:`calibrate`: the noise, its epsilon and how many evaluations it took."""

    sigma: float
    epsilon: float
    evaluations: int
    in_window: bool = True  # False: epsilon(sigma) jumps over the window; epsilon < (1 - rel_tol) * target


def _unreachable(target: float, s_max: float, e: float, context: str) -> UserError:
    return UserError(f"target_epsilon={target:g} is unreachable: even sigma={s_max:g} gives epsilon={e:.4g}{context}")


def _too_loose(target: float, e: float, low_ok: float, s_min: float, s_max: float, context: str) -> UserError:
    return UserError(f"target_epsilon={target:g} is too loose: already sigma={s_min:g} gives epsilon={e:.4g} < "
                     f"{low_ok:.4g}; calibration searches sigma in [{s_min:g}, {s_max:g}]{context}")


class _Found(Exception):
    def __init__(self, sigma: float, epsilon: float):
        super().__init__(sigma, epsilon)
        self.sigma = sigma
        self.epsilon = epsilon


_LOG_CLIP = 50.0


def calibrate(
    epsilon_of_sigma: Callable[[float], float],
    target_epsilon: float,
    *,
    rel_tol: float = 1e-3,
    sigma_min: float = 1e-2,
    sigma_max: float = 1e6,
    sigma_guess: float = 1.0,
    max_evaluations: int = 200,
    context: str = "",
) -> CalibrationPoint:
    """Smallest noise sigma with ``(1 - rel_tol) * target <= epsilon_of_sigma(sigma) <= target``.

    Kept (not the lattice) for every calibration but DP-SGD's: their σ is where Brent stops, which the lattice moves.

    ``epsilon_of_sigma`` must be non-increasing in sigma (the privacy loss of any noise-addition
    mechanism) and continuous up to jumps much smaller than ``rel_tol``.  Works on x = log sigma:

    1. bracket: from ``sigma_guess`` step in log sigma (first step predicted from
       epsilon ~ 1/sigma, then doubling) until epsilon crosses the target, within
       ``[sigma_min, sigma_max]``;
    2. refine: Brent's method (bisection safeguarded by secant / inverse-quadratic steps, so it
       can never do worse than bisection) on ``log epsilon(e^x) - log(target * (1 - rel_tol/2))``.

    The stopping rule is on epsilon, not on sigma: it stops at the first evaluated sigma whose
    epsilon lies in the window ``[(1 - rel_tol) * target, target]``; so the returned sigma is
    private enough (epsilon <= target) and at most ~rel_tol too noisy.

    Raises :class:`UserError` if even ``sigma_max`` gives epsilon > target (unreachable target) or
    ``sigma_min`` already gives epsilon below the window (target too loose for the range);
    :class:`RuntimeError` if the function jumps over the window (not continuous enough) or
    ``max_evaluations`` is exhausted.  ``context`` is appended to error messages.
    """
    target = check.positive("target_epsilon", target_epsilon)
    tol = check.open_unit("rel_tol", rel_tol)
    s_min = check.positive("sigma_min", sigma_min)
    s_max = check.positive("sigma_max", sigma_max)
    if not s_min < s_max:
        raise UserError(f"sigma_min must be < sigma_max, got {s_min!r} and {s_max!r}")
    low_ok = (1.0 - tol) * target
    log_aim = math.log(target) + 0.5 * math.log1p(-tol)
    x_min, x_max = math.log(s_min), math.log(s_max)
    n_evals = 0
    # Closest evaluated points on either side of the window, for the error message.
    above = [math.nan, math.nan]  # largest sigma seen with epsilon > target, its epsilon
    below = [math.nan, math.nan]  # smallest sigma seen with epsilon < window, its epsilon

    memo: dict[float, float] = {}  # brentq re-evaluates the bracket ends

    def eps_at(x: float) -> float:
        nonlocal n_evals
        if x in memo:
            return memo[x]
        if n_evals >= max_evaluations:
            raise RuntimeError(
                f"calibration did not converge in {max_evaluations} evaluations{context}"
            )
        n_evals += 1
        sigma = math.exp(x)
        e = float(epsilon_of_sigma(sigma))
        if math.isnan(e):
            raise RuntimeError(f"epsilon is NaN at sigma={sigma!r}{context}")
        if low_ok <= e <= target:
            raise _Found(sigma, e)
        if e > target and not sigma <= above[0]:
            above[:] = [sigma, e]
        if e < low_ok and not sigma >= below[0]:
            below[:] = [sigma, e]
        memo[x] = e
        return e

    def gap(e: float) -> float:  # log(e) - log_aim, clipped so that 0 and inf stay finite
        if e <= 0:
            return -_LOG_CLIP
        if math.isinf(e):
            return _LOG_CLIP
        return min(_LOG_CLIP, max(-_LOG_CLIP, math.log(e) - log_aim))

    try:
        x0 = min(x_max, max(x_min, math.log(check.positive("sigma_guess", sigma_guess))))
        e0 = eps_at(x0)
        # Bracket [x_lo, x_hi]: epsilon(x_lo) > target >= epsilon(x_hi).  Move x away from x0
        # (up if x0 is not private enough, down if it is too noisy) until epsilon crosses.
        direction = 1.0 if e0 > target else -1.0
        x_lo = x_hi = x = x0
        e = e0
        # First step from epsilon ~ 1/sigma (+30 %), at most a factor e^2 in sigma (evaluations
        # far from the answer can be slow: tiny sigma for PLD, huge sigma for RDP), then doubling.
        step = min(2.0, max(0.1, 1.3 * abs(gap(e0))))
        while (e > target) == (direction > 0):  # not crossed yet
            if (direction > 0 and x >= x_max) or (direction < 0 and x <= x_min):
                break
            if direction > 0:
                x_lo = x
            else:
                x_hi = x
            x = min(x_max, max(x_min, x + direction * step))
            e = eps_at(x)
            step *= 2.0
        if direction > 0:
            x_hi = x
        else:
            x_lo = x
        if direction > 0 and e > target:
            raise _unreachable(target, s_max, e, context)
        if direction < 0 and e <= target:
            raise _too_loose(target, e, low_ok, s_min, s_max, context)
        optimize.brentq(
            lambda xx: gap(eps_at(xx)), x_lo, x_hi, xtol=1e-15, rtol=4 * np.finfo(float).eps,
            maxiter=max_evaluations,
        )
    except _Found as found:
        return CalibrationPoint(found.sigma, found.epsilon, n_evals)
    if math.isfinite(below[0]) and math.isfinite(above[0]) and above[0] < below[0] <= above[0] * (1 + 1e-6):
        # epsilon(sigma) steps over the window (a discretised PLD is a step function of sigma): the smallest
        # sigma seen on the private side is still private (epsilon < target), just not within rel_tol of it
        return CalibrationPoint(below[0], below[1], n_evals, in_window=False)
    raise RuntimeError(
        f"calibration could not bring epsilon into [{low_ok:.6g}, {target:.6g}] between "
        f"sigma={above[0]:.9g} (epsilon={above[1]:.6g}) and sigma={below[0]:.9g} (epsilon={below[1]:.6g}){context}"
    )


LATTICE_STEP: float = 2.0**-12
"""Spacing in log sigma of the lattice every calibrated sigma lies on (ratio 1.00024 between neighbours: epsilon
moves < 0.1 % per step wherever |d log epsilon / d log sigma| < 4, measured <= 3 on DP-SGD)."""
# halvings (down to a relative 2.4e-7 in sigma) of a step that jumps over the window, before epsilon(sigma) counts
# as a step function
_LATTICE_LEVELS = 10


class EpsilonCurve:
    """ε(σ) of one mechanism by its accountant, evaluated on a fixed lattice in x = log σ (x = k·LATTICE_STEP),
    memoised and shared by every target of the process (an ε axis reads one curve).

    :meth:`calibrate` returns the smallest lattice σ whose ε meets the target, a function of the target alone: it
    brackets the target between adjacent lattice points (ε(k − 1) > target ≥ ε(k)) by doubling steps from the
    start it is given, then bisects; where ε(σ) jumps over the window [(1 − rel_tol)·target, target] (a
    discretised PLD is a step function of σ), the step (k − 1, k] is halved up to `_LATTICE_LEVELS` times, and
    those halvings are part of the definition. ε must be non-increasing in σ.
    """

    def __init__(self, epsilon_and_info: Callable[[float], tuple[float, object]], *, rel_tol: float = 1e-3,
                 sigma_min: float = 1e-2, sigma_max: float = 1e6, max_evaluations: int = 200, context: str = ""):
        self._epsilon_and_info = epsilon_and_info
        self.rel_tol = check.open_unit("rel_tol", rel_tol)
        s_min, s_max = check.positive("sigma_min", sigma_min), check.positive("sigma_max", sigma_max)
        self._k_min = math.ceil(math.log(s_min) / LATTICE_STEP)  # lattice indices: x = k * LATTICE_STEP
        self._k_max = math.floor(math.log(s_max) / LATTICE_STEP)
        if not self._k_min < self._k_max:
            raise UserError(f"sigma_min must be < sigma_max, got {s_min!r} and {s_max!r}")
        self.sigma_range = (s_min, s_max)
        self.max_evaluations = max_evaluations  # per target: the curve's points outlive any one search
        self._limit = max_evaluations
        self.context = context
        self.points: dict[float, float] = {}  # x = log sigma -> epsilon
        self.info: dict[float, object] = {}  # sigma -> info
        self.evaluations = 0

    def evaluate(self, sigma: float) -> tuple[float, object]:
        """(epsilon, info) of the accountant at `sigma`, computed afresh (not a lattice point of the search)."""
        e, info = self._epsilon_and_info(sigma)
        return float(e), info

    def epsilon(self, x: float) -> float:
        """epsilon at sigma = exp(x), evaluated once per curve."""
        if x not in self.points:
            if self.evaluations >= self._limit:
                raise RuntimeError(f"calibration did not converge in {self.max_evaluations} evaluations{self.context}")
            self.evaluations += 1
            sigma = math.exp(x)
            e, self.info[sigma] = self._epsilon_and_info(sigma)
            if math.isnan(e):
                raise RuntimeError(f"epsilon is NaN at sigma={sigma!r}{self.context}")
            self.points[x] = float(e)
        return self.points[x]

    def _at(self, k: int) -> float:
        return self.epsilon(k * LATTICE_STEP)

    def calibrate(self, target_epsilon: float, sigma_guess: float = 1.0) -> CalibrationPoint:
        """Smallest lattice sigma with ``(1 - rel_tol) * target <= epsilon(sigma) <= target`` (see the class); the
        search starts at the lattice point closest to `sigma_guess` (a start only: σ does not depend on it)."""
        target = check.positive("target_epsilon", target_epsilon)
        guess = math.log(check.positive("sigma_guess", sigma_guess)) / LATTICE_STEP
        start = self.evaluations
        self._limit = start + self.max_evaluations
        k_above, k_below = self._bracket(target, min(self._k_max, max(self._k_min, round(guess))))
        if k_above is None:  # already sigma_min is private enough
            e = self._at(k_below)
            if e < (1.0 - self.rel_tol) * target:
                raise _too_loose(target, e, (1.0 - self.rel_tol) * target, *self.sigma_range, self.context)
            return CalibrationPoint(math.exp(k_below * LATTICE_STEP), e, self.evaluations - start)
        x, e, in_window = self._refine(target, k_above * LATTICE_STEP, k_below * LATTICE_STEP)
        return CalibrationPoint(math.exp(x), e, self.evaluations - start, in_window)

    def _bracket(self, target: float, first: int) -> tuple[int | None, int]:
        """Adjacent lattice indices (k - 1, k) with epsilon(k - 1) > target >= epsilon(k); (None, k_min) where
        sigma_min already meets the target."""
        above: int | None = None  # too little noise
        below: int | None = None  # enough
        k, step = first, 64
        while above is None or below is None:  # outwards from `first` by doubling steps
            k = min(self._k_max, max(self._k_min, k))
            if self._at(k) <= target:
                below = k
                if k == self._k_min:
                    return None, k
                k -= step
            else:
                above = k
                if k == self._k_max:
                    raise _unreachable(target, self.sigma_range[1], self._at(k), self.context)
                k += step
            step *= 2
        while below - above > 1:
            k = (above + below) // 2
            if self._at(k) <= target:
                below = k
            else:
                above = k
        return above, below

    def _refine(self, target: float, x_above: float, x_below: float) -> tuple[float, float, bool]:
        """Halve the step (x_above, x_below] until epsilon(x_below) is in the window; (x, epsilon, in window)."""
        low_ok = (1.0 - self.rel_tol) * target
        for _ in range(_LATTICE_LEVELS):
            if self.epsilon(x_below) >= low_ok:
                return x_below, self.points[x_below], True
            mid = 0.5 * (x_above + x_below)
            if self.epsilon(mid) > target:
                x_above = mid
            else:
                x_below = mid
        # still outside: epsilon(sigma) steps over the window (a discretised PLD is a step function of sigma); the
        # smallest sigma seen on the private side is still private (epsilon < target), just not within rel_tol of it
        e = self.epsilon(x_below)
        return x_below, e, e >= low_ok

    def verify(self, sigma: object, target: float) -> tuple[float, object]:
        """(ε, info) at a σ read back from a cache, by one evaluation; :class:`diskcache.Rejected` unless σ is
        exactly a point of the search's lattice (so a changed bit is seen) and ε(σ) is in the window (or ε jumps
        over the window between σ and the finest lattice point below it)."""
        x = positive_sigma(sigma)
        finest = LATTICE_STEP / 2**_LATTICE_LEVELS  # the search's points are exp(k · finest), x = k · finest exactly
        k = round(math.log(x) / finest)
        if math.exp(k * finest) != x:
            raise diskcache.Rejected(f"sigma = {x!r} is not a point of the calibration lattice")
        e, info = self.evaluate(x)
        check_window(x, e, target, self.rel_tol, lambda: self.evaluate(math.exp((k - 1) * finest))[0],
                     self.context)
        return e, info


# --------------------------------------------------------------------------------------------
# The disk cache
# --------------------------------------------------------------------------------------------

_FIELD = "calibration"  # the value's field in an entry
_V = TypeVar("_V")


def cache_folder() -> Path | None:
    """Where calibrations are kept: $DPSGD_CACHE_DIR/calibration, else <DPSGD_DATA_DIR>/.cache/calibration; None
    (no disk cache) when DPSGD_CACHE_DIR is ``off``."""
    return diskcache.cache_folder("calibration")


def cached(key: dict[str, Any], fields: Iterable[str], compute: Callable[[], _V], verify: Callable[[Any], _V],
           encode: Callable[[_V], Any]) -> _V:
    """The calibration stored under `key` (a JSON-able dict naming everything the value depends on, versions
    included), passed through `verify`; else `compute()`, stored as `encode(value)`, a dict of exactly `fields`.

    A stored value with any other field, or without one of them, is discarded with one line on stderr (its
    checksum cannot tell: anyone can recompute it). `verify(stored)` rebuilds the value from the fields it reads,
    checks it against its accountant by one evaluation and returns it with that evaluation's ε; it raises
    :class:`diskcache.Rejected` for a value that fails the check (then also discarded with one line); a field of
    the wrong type or out of range (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) is discarded
    the same way. A corrupt entry
    (checksum) is discarded by the read itself."""
    folder = cache_folder()
    stored = diskcache.read_entry(folder, key, _FIELD)
    if stored is not None:
        try:
            return verify(diskcache.exact_fields(stored, fields, "calibration"))
        except diskcache.Rejected as exc:
            diskcache.discard(folder, key, str(exc))
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
            diskcache.discard(folder, key, f"its check cannot evaluate it ({type(exc).__name__}: {exc})")
    value = compute()
    diskcache.write_entry(folder, key, _FIELD, encode(value))
    return value


def positive_sigma(sigma: object) -> float:
    """`sigma` if it is a positive finite float, else :class:`diskcache.Rejected`."""
    if not (isinstance(sigma, float) and math.isfinite(sigma) and sigma > 0):
        raise diskcache.Rejected(f"sigma = {sigma!r} is not a positive number")
    return sigma


def check_window(sigma: float, epsilon: float, target: float, rel_tol: float, epsilon_below: Callable[[], float],
                 context: str = "") -> None:
    """:class:`diskcache.Rejected` unless ε(σ) = `epsilon` meets the target within `rel_tol` below it, or ε jumps
    over that window just below σ (`epsilon_below()`, evaluated only then, exceeds the target)."""
    if epsilon <= target and (epsilon >= (1.0 - rel_tol) * target or epsilon_below() > target):
        return
    raise diskcache.Rejected(f"sigma = {sigma!r} gives epsilon = {epsilon:.6g}{context}, not the target {target:g} "
                             f"(within {rel_tol:g} below)")
