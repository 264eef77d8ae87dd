"""The one σ search (:class:`EpsilonCurve`, :func:`calibrate`: the smallest lattice point whose ε meets the target)
and the one verified disk cache of calibrations (:func:`cached`); docs/accounting.md#calibration."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from dpsgd_cli import diskcache
from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy import validate as check

__all__ = [
    "LATTICE_STEP",
    "CalibrationPoint",
    "EpsilonCurve",
    "cache_folder",
    "cached",
    "calibrate",
    "positive_sigma",
    "verify_lattice_point",
]


class CalibrationPoint(NamedTuple):
    """Result of a calibration: the noise, its epsilon and how many evaluations it took."""

    sigma: float
    epsilon: float
    evaluations: int
    in_window: bool = True  # False: epsilon(sigma) jumps over the window; epsilon < (1 - rel_tol) * target


def _unreachable(target: float, s_max: float, e: float, context: str) -> UserError:
    return UserError(f"target_epsilon={target:g} is unreachable: even sigma={s_max:g} gives epsilon={e:.4g}{context}")


def _too_loose(target: float, e: float, low_ok: float, s_min: float, s_max: float, context: str) -> UserError:
    return UserError(f"target_epsilon={target:g} is too loose: already sigma={s_min:g} gives epsilon={e:.4g} < "
                     f"{low_ok:.4g}; calibration searches sigma in [{s_min:g}, {s_max:g}]{context}")


def _log_ratio(epsilon: float, log_target: float) -> float:
    """log(epsilon / target), -inf for an epsilon of 0 (the search then bisects)."""
    return math.log(epsilon) - log_target if epsilon > 0.0 else -math.inf


LATTICE_STEP: float = 2.0**-12
"""Spacing in log sigma of the lattice every calibrated sigma lies on (ratio 1.00024 between neighbours: epsilon
moves < 0.1 % per step wherever |d log epsilon / d log sigma| < 4, measured <= 3 on DP-SGD)."""
_FIRST_STEP = round(math.log(2.0) / LATTICE_STEP)  # the first step from the start, at most (a factor 2 in σ)
# halvings (down to a relative 2.4e-7 in sigma) of a step that jumps over the window, before epsilon(sigma) counts
# as a step function
_LATTICE_LEVELS = 10


class EpsilonCurve:
    """ε(σ) of one mechanism by its accountant, evaluated on a fixed lattice in x = log σ (x = k·LATTICE_STEP),
    memoised and shared by every target of the process (an ε axis reads one curve).

    :meth:`calibrate` returns the smallest lattice σ whose ε meets the target, a function of the target alone: the
    adjacent lattice points with ε(k − 1) > target ≥ ε(k); where ε(σ) jumps over the window
    [(1 − rel_tol)·target, target] (a discretised PLD is a step function of σ), the step (k − 1, k] is halved
    up to `_LATTICE_LEVELS` times, and those halvings are part of the definition. ε must be non-increasing in σ;
    where it is not (the single-example PLD wobbles by ~0.5 % between neighbouring lattice points), σ is still
    such a pair's k, but which one depends on the points read. How k is found (:meth:`_bracket`: secant steps in
    (log σ, log ε) from the start it is given, safeguarded by bisection) changes only the cost: 4–9 evaluations
    on DP-SGD's curves where doubling steps and bisection from the same start take 15–18.
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
        sigma_min already meets the target.

        Which points are read changes only the cost, not the answer, wherever epsilon is non-increasing (it is the
        smallest k meeting the target): from `first`, a step a little past where the line through the last two
        points in (log sigma, log epsilon) meets the target (from the first point alone: the line of slope -1,
        epsilon ~ 1/sigma), until the target is enclosed; inside, the same secant, or regula falsi between the
        enclosing points (Illinois-weighted), and a bisection step wherever those do not at least halve the step
        before last (Brent's rule) or the last two points lie on one step of a staircase."""
        above: int | None = None  # too little noise
        below: int | None = None  # enough
        log_target = math.log(target)
        last: list[tuple[int, float]] = []  # the last two points read, (k, log epsilon - log target)
        moves: list[int] = []  # distance between consecutive points read
        k, step = first, 64  # step: where no slope can be read, doubling steps outwards
        stale = side = 0  # Illinois: how many points in a row moved the same end of the bracket, and which
        while True:
            e = self._at(k)
            if e <= target:
                if k == self._k_min:
                    return None, k
                below = k if below is None else min(below, k)
            else:
                if k == self._k_max:
                    raise _unreachable(target, self.sigma_range[1], e, self.context)
                above = k if above is None else max(above, k)
            moved = -1 if e <= target else 1
            stale, side = (stale + 1 if moved == side else 1), moved
            if last:
                moves.append(abs(k - last[-1][0]))
            u = _log_ratio(e, log_target)
            last = [*last[-1:], (k, u)]
            if above is None or below is None:
                k = self._outside(k, u, last, step)
                step *= 2
            elif below - above == 1:
                return above, below
            else:
                k = self._inside(above, below, log_target, last, moves, stale, side)

    def _slope(self, last: list[tuple[int, float]]) -> float | None:
        """d(log epsilon)/dk through the last two points read, where they show epsilon falling."""
        if len(last) < 2:
            return None
        (k0, u0), (k1, u1) = last
        if k0 == k1 or not (math.isfinite(u0) and math.isfinite(u1)):
            return None
        slope = (u1 - u0) / (k1 - k0)
        return slope if slope < 0.0 else None

    def _outside(self, k: int, u: float, last: list[tuple[int, float]], step: int) -> int:
        """The next point while every point read lies on one side of the target: a little past the crossing of
        the line (10 % and one lattice point; from the start, at most a factor 2 in σ), `step` where there is no
        line."""
        slope = self._slope(last)
        first = len(last) == 1
        if slope is None and first:
            slope = -LATTICE_STEP
        if slope is None or not math.isfinite(u):
            distance = step
        else:
            distance = min(self._k_max - self._k_min, math.ceil(1.1 * abs(u / slope)) + 1)
            if first:  # σ at most doubled or halved on a guessed slope (steep curves: single-example PLD)
                distance = min(distance, _FIRST_STEP)
        return min(self._k_max, max(self._k_min, k + distance if u > 0 else k - distance))

    def _inside(self, above: int, below: int, log_target: float, last: list[tuple[int, float]],
                moves: list[int], stale: int, side: int) -> int:
        """The next point strictly inside the bracket (above, below)."""
        slope = self._slope(last)
        k1, u1 = last[-1]
        guess = math.nan if slope is None else k1 - u1 / slope  # the secant
        ua, ub = (_log_ratio(self.points[k * LATTICE_STEP], log_target) for k in (above, below))
        if slope is not None and not above < guess < below and ua > ub:
            if stale >= 2:  # the same end moved twice in a row: weigh the other one down
                ua, ub = (ua / 2.0 ** (stale - 1), ub) if side < 0 else (ua, ub / 2.0 ** (stale - 1))
            guess = above + (below - above) * ua / (ua - ub)
        if not math.isfinite(guess) or (len(moves) >= 2 and abs(guess - k1) > moves[-2] / 2):
            return (above + below) // 2
        return min(below - 1, max(above + 1, math.ceil(guess)))

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
        """(ε, info) at a σ read back from a cache, by one evaluation (:func:`verify_lattice_point`)."""
        return verify_lattice_point(sigma, target, self.evaluate, self.rel_tol, self.context)


def calibrate(epsilon_of_sigma: Callable[[float], float], target_epsilon: float, *, sigma_guess: float = 1.0,
              rel_tol: float = 1e-3, sigma_min: float = 1e-2, sigma_max: float = 1e6, max_evaluations: int = 200,
              context: str = "") -> CalibrationPoint:
    """The smallest lattice σ whose ε = `epsilon_of_sigma(σ)` meets `target_epsilon` (:meth:`EpsilonCurve.calibrate`
    on a curve of its own), searched in [`sigma_min`, `sigma_max`] from `sigma_guess` (a start only). Raises
    :class:`UserError` for a target no σ in the range reaches, or one that `sigma_min` already beats by more than
    `rel_tol`; ``context`` is appended to error messages."""
    curve = EpsilonCurve(lambda sigma: (epsilon_of_sigma(sigma), None), rel_tol=rel_tol, sigma_min=sigma_min,
                         sigma_max=sigma_max, max_evaluations=max_evaluations, context=context)
    return curve.calibrate(target_epsilon, sigma_guess)


_I = TypeVar("_I")


def verify_lattice_point(sigma: object, target: float, epsilon_and_info: Callable[[float], tuple[float, _I]],
                         rel_tol: float = 1e-3, context: str = "") -> tuple[float, _I]:
    """(ε, info) at a σ read back from a cache, by one evaluation of `epsilon_and_info`; :class:`diskcache.Rejected`
    unless σ is exactly a point of the search's lattice (so a changed bit, or a σ some other search found, is seen)
    and ε(σ) meets the target within `rel_tol` below it (or ε jumps over that window between σ and the finest
    lattice point below it, evaluated only then)."""
    x = positive_sigma(sigma)
    finest = LATTICE_STEP / 2**_LATTICE_LEVELS  # the search's points are exp(k · finest), x = k · finest exactly
    k = round(math.log(x) / finest)
    if math.exp(k * finest) != x:
        raise diskcache.Rejected(f"sigma = {x!r} is not a point of the calibration lattice")
    e, info = epsilon_and_info(x)
    if not (e <= target and (e >= (1.0 - rel_tol) * target
                             or epsilon_and_info(math.exp((k - 1) * finest))[0] > target)):  # evaluated only then
        raise diskcache.Rejected(f"sigma = {x!r} gives epsilon = {e:.6g}{context}, not the target {target:g} "
                                 f"(within {rel_tol:g} below)")
    return e, info


# --- The disk cache -----------------------------------------------------------------------------------------------

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
