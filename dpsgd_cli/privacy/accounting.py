"""Privacy accounting for DP-SGD, built on Google's ``dp-accounting`` library.

As in ``dp-accounting``, the *mechanism* is described by a :class:`dp_accounting.DpEvent`
(:func:`dpsgd_event`) and the *accountant* turns an event into an (epsilon, delta) guarantee
(:func:`epsilon_for`).  Two accountants are offered:

``"rdp"``
    :class:`dp_accounting.rdp.RdpAccountant` (Renyi DP, Mironov 2017; subsampled-Gaussian RDP of
    Mironov, Talwar & Zhang 2019) with the library's improved RDP -> (epsilon, delta) conversion
    (Balle et al. 2020, Prop. 12; Asoodeh et al. 2020).  Epsilon is the minimum of the conversion
    over the fixed order grid :data:`RDP_ORDERS`:

    * ``1 + x/20`` for ``x = 1..200`` (orders in (1, 11], step 0.05) -- large epsilon (small
      sigma) is decided by orders close to 1;
    * every integer ``12..64``;
    * above 64: integers growing geometrically by 5 % (plus the powers of two 128..32768, so the
      grid contains the library's default orders) up to :data:`RDP_MAX_ORDER` = 32768.

    Why so large: with delta = 1/n^2 ~ 1e-9 the conversion alone costs about ln(1/delta)/(alpha-1),
    so orders capped at 1024 cannot certify any epsilon below ~0.0124 *whatever sigma* (measured:
    sigma = 300, q = 256/30162, T = 590 gives 0.01265 with orders <= 1024 vs 0.0032 with larger
    orders).  epsilon = 0.01 needs alpha ~ 2e3..4e3.  The relative spacing (<= 5 %) costs at most
    ~0.03 % of epsilon compared with a continuum of orders (for an RDP curve ~ a*alpha the loss of
    a grid with ratio r is (sqrt(r) + 1/sqrt(r))/2 - 1); measured against a dense reference grid
    (step 0.01 below 11, every integer to 1024, 2 % above) on 16 DP-SGD settings
    (epsilon 0.0066..102) the loss is <= 0.02 %, except 0.04 % at epsilon = 13.8 (alpha* = 2.78).

    Cost: an integer order alpha is an (alpha+1)-term sum (the library's Python loop: ~2.3 us a
    term), so the orders above 64 are evaluated *lazily*: only if the optimum over the orders <= 64
    sits at 64, the grid is walked upwards until epsilon has increased at two consecutive orders.
    DP-SGD's events (:func:`dpsgd_rdp_epsilon`: the calibration curve and :func:`dpsgd_epsilon`)
    are computed by :mod:`dpsgd_cli.privacy.rdp`, the library's terms vectorised, equal to the
    library's epsilon and order bit for bit (tests/test_rdp.py) and ~40-60x faster, without
    importing it; every other event goes through the library.  Above 64 the per-order bound is
    unimodal in alpha (checked on the dense grid for the same 16 settings), so the result equals the
    minimum over the whole grid; the tests compare with a fresh ``RdpAccountant(orders=RDP_ORDERS up
    to 1024 or 8192)``.  If the bound were not unimodal the walk could stop early: epsilon would be
    looser, never invalid.

``"pld"``
    :class:`dp_accounting.pld.PLDAccountant` (privacy loss distributions, Koskela et al. 2020;
    connect-the-dots discretisation, Doroshenko et al. 2022), pessimistic estimate, i.e. the
    reported epsilon is an upper bound.  Its accuracy is set by ``value_discretization_interval``
    h.  Measured on DP-SGD: the relative error behaves like ``K * n * (h / epsilon)**2`` with n the
    number of compositions and K ~ 2..9.  So neither a fixed h = 1e-4 (error 2.9 % at
    epsilon = 0.019 and 24 % at epsilon = 0.006 for q = 256/30162, T = 590) nor h = epsilon/100
    (error ~10 % at T = 590) is adequate.  We use ``h = rho * epsilon / sqrt(n)`` with
    ``rho = PLD_RHO = 0.005`` (measured: within 2e-5..4e-5 of a 4x finer grid), snapped down to
    the grid 10**(-k/4) and found by fixed-point iteration: start at h = 1e-2, recompute with the
    h implied by the current epsilon until h no longer decreases (2-3 passes; each pass is an
    upper bound).  Measured cost per evaluation: 5-100 ms for T = 590, 35-250 ms for T = 1e4.

Calibration finds the smallest noise multiplier whose epsilon is within ``[0.999 * target, target]``.
:func:`calibrate_sigma` reads one :class:`EpsilonCurve` per (delta, q, T, accountant, neighbours), shared by every
target of the process (an epsilon axis in one pass, :func:`calibrate_sigmas`): sigma is the smallest point of a
fixed lattice in log sigma (step 2^-12) whose epsilon, by the exact accountant, meets the target, found by a plain
bracketing search (steps from a guess, then interpolation safeguarded by bisection), so it depends on the target
alone, not on the other targets calibrated before. An RDP evaluation takes 0.2-2 ms (:mod:`dpsgd_cli.privacy.rdp`,
the library's numbers), ~20 a target; a PLD one 5-250 ms.
Generic :func:`calibrate` (Brent's method on log sigma, stopped by the epsilon window) serves the closed-form
calibrations of other mechanisms, one target at a time.
:func:`calibrate_sigma` keeps its results on disk (:func:`calibration_cache_dir`), shared by processes: a
warm call reads ~0.15 ms of JSON instead of 60-750 ms of accounting (adult, kang_lr's epsilon axis).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, NamedTuple, Sequence, TypeVar, cast

import numpy as np

from dpsgd_cli import diskcache
from dpsgd_cli.diskcache import CACHE_DIR_ENV
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy import _validate as check
from dpsgd_cli.privacy import rdp as _rdp_native

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent
    from dp_accounting.privacy_accountant import NeighboringRelation


# dp-accounting (with scipy.stats and scipy.signal, ~1 s of imports) only when an accountant runs: a run whose
# σ all come from the disk cache never imports it
dp_event = LazyModule("dp_accounting.dp_event")
_rdp_lib = LazyModule("dp_accounting.rdp.rdp_privacy_accountant")
_pld_lib = LazyModule("dp_accounting.pld.pld_privacy_accountant")
_relations = LazyModule("dp_accounting.privacy_accountant")
optimize = LazyModule("scipy.optimize")

__all__ = [
    "ACCOUNTANTS",
    "CACHE_DIR_ENV",  # re-exported from dpsgd_cli.diskcache for callers that set the cache folder
    "CALIBRATION_VERSION",
    "LIBRARY",
    "NEIGHBOURS",
    "PLD_RHO",
    "RDP_BASE_ORDERS",
    "RDP_EXTENSION_ORDERS",
    "RDP_MAX_ORDER",
    "RDP_ORDERS",
    "Calibration",
    "EpsilonCurve",
    "CalibrationPoint",
    "calibrate",
    "calibrate_sigma",
    "calibrate_sigmas",
    "calibration_cache_dir",
    "check_dpsgd_neighbours",
    "dpsgd_epsilon",
    "dpsgd_event",
    "dpsgd_rdp_epsilon",
    "epsilon_for",
    "rdp_curve_to_epsilon",
    "rdp_epsilon_floor",
]

AccountantName = Literal["rdp", "pld"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld")

LIBRARY: str = f"dp-accounting {importlib.metadata.version('dp-accounting')}"
"""Name and version of the accounting library, recorded in every :class:`Calibration`."""

# --------------------------------------------------------------------------------------------
# RDP order grid
# --------------------------------------------------------------------------------------------

RDP_MAX_ORDER: int = 32768
_RDP_GROWTH = 1.05

RDP_BASE_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 20 for x in range(1, 201)] + [float(a) for a in range(12, 65)]
)
"""Orders always evaluated: (1, 11] in steps of 0.05, then every integer 12..64."""


def _extension_orders() -> tuple[float, ...]:
    orders = {2**j for j in range(7, 16)}  # 128 .. 32768: the library's default large orders
    a = 64.0
    while True:
        a *= _RDP_GROWTH
        k = int(round(a))
        if k > RDP_MAX_ORDER:
            break
        orders.add(k)
    return tuple(float(k) for k in sorted(orders) if 64 < k <= RDP_MAX_ORDER)


RDP_EXTENSION_ORDERS: tuple[float, ...] = _extension_orders()
"""Integer orders in (64, 32768], ~5 % apart, evaluated lazily (see the module docstring)."""

RDP_ORDERS: tuple[float, ...] = RDP_BASE_ORDERS + RDP_EXTENSION_ORDERS
"""The full order grid: :func:`epsilon_for` returns the minimum of the conversion over it."""

# --------------------------------------------------------------------------------------------
# PLD discretisation
# --------------------------------------------------------------------------------------------

PLD_RHO: float = 0.005
"""PLD discretisation interval h = PLD_RHO * epsilon / sqrt(number of compositions)."""
MAX_STEPS = 10**12  # of a DP-SGD event: far beyond any run (the grid limit is 1e8), small enough to stay exact
_PLD_H_START = 1e-2
_PLD_H_MIN = 1e-10
_PLD_MAX_PASSES = 8


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> DpEvent:
    """DpEvent of DP-SGD with Poisson sampling (Abadi et al. 2016, "Deep Learning with DP").

    ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)``: each of the ``steps`` = T steps
    includes every example independently with probability ``sample_rate`` = q and adds Gaussian
    noise of standard deviation ``noise_multiplier`` x (clipping norm) to the summed clipped
    gradients.  Neighbouring relation: add/remove one example (the library default).  With
    q == 1 (full batch) the event is the plain Gaussian mechanism composed T times.
    """
    sigma = check.noise_multiplier("noise_multiplier", noise_multiplier)
    q = check.sample_rate("sample_rate", sample_rate)
    t = check.count("steps", steps, maximum=MAX_STEPS)
    gaussian = dp_event.GaussianDpEvent(sigma)
    if q == 1.0:
        return dp_event.SelfComposedDpEvent(gaussian, t)
    return dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, gaussian), t)


def _composition_count(event: DpEvent) -> int:
    """Number of elementary mechanisms composed in ``event`` (for the PLD discretisation)."""
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return int(event.count) * _composition_count(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return max(1, sum(_composition_count(e) for e in event.events))
    inner = getattr(event, "event", None)
    if isinstance(inner, dp_event.DpEvent):  # sampled events wrap one mechanism
        return _composition_count(inner)
    return 1


# --------------------------------------------------------------------------------------------
# Accountants
# --------------------------------------------------------------------------------------------


class _DropFracNonConvergence(logging.Filter):
    """Drops the library's "_compute_log_a_frac failed to converge" warnings.

    For large q and small alpha the library's series for a fractional order may not converge in
    1000 terms; it then *excludes that order* (RDP = inf), which can only make epsilon larger, so
    the bound stays valid.  Dozens of such lines per evaluation would flood the CLI output.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "_compute_log_a_frac failed to converge" not in record.getMessage()


_FRAC_FILTER = _DropFracNonConvergence()


@contextlib.contextmanager
def _quiet_rdp() -> Iterator[None]:
    logger = logging.getLogger("absl")
    logger.addFilter(_FRAC_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_FRAC_FILTER)


def rdp_epsilon_and_order(event: DpEvent, delta: float,
                          relation: NeighboringRelation | None = None) -> tuple[float, float]:
    """(ε, optimal order) of the RDP accountant under `relation` (default add-or-remove-one), over
    :data:`RDP_ORDERS` (larger orders walked only when the base grid's top order is optimal)."""
    relation = _relations.NeighboringRelation.ADD_OR_REMOVE_ONE if relation is None else relation
    with _quiet_rdp():
        return _rdp_epsilon_loud(event, delta, relation)


def dpsgd_rdp_epsilon(sigma: float, sample_rate: float, steps: int, delta: float) -> tuple[float, float]:
    """(ε, optimal order) of :func:`dpsgd_event` by the RDP accountant, without building the event: the library's
    numbers bit for bit (:mod:`dpsgd_cli.privacy.rdp`), ~50-100x faster and without importing dp-accounting."""
    return _rdp_native.dpsgd_epsilon_and_order(sigma, sample_rate, steps, delta, RDP_BASE_ORDERS, RDP_EXTENSION_ORDERS)


def _rdp_epsilon_loud(event: DpEvent, delta: float, relation: NeighboringRelation) -> tuple[float, float]:
    def epsilons(orders: np.ndarray) -> np.ndarray:  # the library's RDP of `event`, converted per order
        accountant = _rdp_lib.RdpAccountant(list(orders), relation)
        accountant.compose(event)
        return _rdp_native.epsilon_at_orders(orders, accountant.rdp, delta)

    return _rdp_native.min_over_orders(epsilons, RDP_BASE_ORDERS, RDP_EXTENSION_ORDERS)


# Beyond these the PLD's discretised support does not fit in memory or time (measured: σ = 0.01, q = 0.01,
# T = 100 takes 13 s; q = 1, T = 1e5 takes 29 s; σ = 1e-3 or T = 1e12 end in MemoryError); RDP has no such limit.
PLD_MIN_SIGMA = 0.05
PLD_MAX_COMPOSITIONS = 10**6


def _gaussian_sigmas(event: DpEvent) -> list[float]:
    if isinstance(event, dp_event.GaussianDpEvent):
        return [float(event.noise_multiplier)]
    inner = list(getattr(event, "events", [])) + [e for e in [getattr(event, "event", None)] if e is not None]
    return [s for e in inner if isinstance(e, dp_event.DpEvent) for s in _gaussian_sigmas(e)]


def check_pld_event(event: DpEvent) -> None:
    """UserError (one line, naming the limit) for an event the PLD accountant cannot represent in bounded memory."""
    count = _composition_count(event)
    if count > PLD_MAX_COMPOSITIONS:
        raise UserError(f"steps = {count:,} exceed the PLD accountant's limit of {PLD_MAX_COMPOSITIONS:,} "
                        f"compositions (its discretisation would not fit in memory); use accountant rdp")
    small = [s for s in _gaussian_sigmas(event) if s < PLD_MIN_SIGMA]
    if small:
        raise UserError(f"noise multiplier σ = {min(small):g} is below the PLD accountant's limit of {PLD_MIN_SIGMA:g} "
                        f"(its privacy loss range would not fit in memory); use accountant rdp")


Neighbours = Literal["add_remove", "replace_one"]
NEIGHBOURS: tuple[str, ...] = ("add_remove", "replace_one")
"""Neighbouring relations a privacy claim can be stated for: add or remove one record (the library's default,
Abadi et al.'s), or replace one record by another (Song et al., Bassily et al., Kang et al., Chourasia et al.)."""


def _relation(neighbours: str) -> NeighboringRelation:
    if neighbours not in NEIGHBOURS:
        raise UserError(f"neighbours must be one of 'add_remove', 'replace_one', got {neighbours!r}")
    return (_relations.NeighboringRelation.REPLACE_ONE if neighbours == "replace_one"
            else _relations.NeighboringRelation.ADD_OR_REMOVE_ONE)


def check_dpsgd_neighbours(accountant: str, neighbours: str) -> None:
    """UserError unless DP-SGD's Poisson-subsampled Gaussian can be accounted by `accountant` under `neighbours`:
    dp-accounting's RDP accountant has no replace-one bound for Poisson subsampling (only for sampling without
    replacement), the PLD accountant has both (Zhu, Dong & Wang 2022 dominating pairs)."""
    if neighbours not in NEIGHBOURS:  # without importing the library: a cached RDP σ never needs it
        raise UserError(f"neighbours must be one of 'add_remove', 'replace_one', got {neighbours!r}")
    if neighbours == "replace_one" and accountant == "rdp":
        raise UserError("accountant 'rdp' has no replace-one bound for DP-SGD's Poisson-subsampled Gaussian "
                        "(dp-accounting's RDP supports replace-one only for sampling without replacement); "
                        "use accountant: pld, or neighbours: add_remove")


def _pld_once(event: DpEvent, delta: float, h: float, neighbours: str = "add_remove") -> float:
    check_pld_event(event)
    check.pld_memory(event, h)  # estimated before the library allocates: refused in one line if it cannot fit
    accountant = _pld_lib.PLDAccountant(_relation(neighbours), value_discretization_interval=h)
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def _snap_down(h: float) -> float:
    """Largest 10**(-k/4) <= h."""
    snapped: float = 10.0 ** (math.floor(4.0 * math.log10(h)) / 4.0)
    return snapped


def _pld_epsilon(
    event: DpEvent, delta: float, value_discretization_interval: float | None = None,
    neighbours: str = "add_remove",
) -> tuple[float, float]:
    """(epsilon, discretisation interval used); see the module docstring for the h rule."""
    if value_discretization_interval is not None:
        h = check.positive("value_discretization_interval", value_discretization_interval)
        return _pld_once(event, delta, h, neighbours), h
    root_n = math.sqrt(_composition_count(event))
    h = _PLD_H_START
    eps = _pld_once(event, delta, h, neighbours)
    for _ in range(_PLD_MAX_PASSES):
        if not (math.isfinite(eps) and eps > 0):
            break
        h_new = max(_PLD_H_MIN, _snap_down(PLD_RHO * eps / root_n))
        if h_new >= h:
            break
        h = h_new
        eps = _pld_once(event, delta, h, neighbours)
    return eps, h


def _check_accountant(accountant: object) -> str:
    if accountant not in ACCOUNTANTS:
        raise UserError(f"accountant must be one of 'rdp', 'pld', got {accountant!r}")
    return str(accountant)


def epsilon_for(
    event: DpEvent, delta: float, accountant: AccountantName = "rdp", neighbours: Neighbours = "add_remove"
) -> float:
    """Epsilon such that ``event`` is (epsilon, delta)-DP under ``neighbours``, by the chosen accountant.

    ``"rdp"``: RdpAccountant over :data:`RDP_ORDERS`; ``"pld"``: PLDAccountant with the adaptive
    discretisation described in the module docstring.  Both are upper bounds; PLD is tighter.
    """
    d = check.open_unit("delta", delta)
    name = _check_accountant(accountant)
    if name == "rdp":
        return rdp_epsilon_and_order(event, d, _relation(neighbours))[0]
    return _pld_epsilon(event, d, neighbours=neighbours)[0]


@functools.lru_cache(maxsize=4096)
def dpsgd_epsilon(
    sigma: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: AccountantName = "rdp",
    neighbours: Neighbours = "add_remove",
) -> float:
    """Epsilon of DP-SGD (:func:`dpsgd_event`) after ``steps`` steps at the given ``delta``, under ``neighbours``."""
    check_dpsgd_neighbours(_check_accountant(accountant), neighbours)
    if accountant == "rdp":
        return dpsgd_rdp_epsilon(check.noise_multiplier("sigma", sigma), check.sample_rate("sample_rate", sample_rate),
                                 check.count("steps", steps, maximum=MAX_STEPS), check.open_unit("delta", delta))[0]
    return epsilon_for(dpsgd_event(sigma, sample_rate, steps), delta, accountant, neighbours)


def rdp_curve_to_epsilon(orders: Sequence[float] | np.ndarray, rdp: Sequence[float] | np.ndarray,
                         delta: float) -> float:
    """Epsilon at ``delta`` of a mechanism that is (alpha, rdp[i])-RDP for each alpha = orders[i].

    Thin wrapper of :func:`dp_accounting.rdp.compute_epsilon` (the improved conversion of Balle
    et al. 2020, Prop. 12, minimised over the given orders), for analytic RDP bounds.
    """
    d = check.open_unit("delta", delta)
    o = np.asarray(orders, dtype=float).ravel()
    r = np.asarray(rdp, dtype=float).ravel()
    if o.size == 0 or o.size != r.size:
        raise UserError(
            f"orders and rdp must be non-empty and of equal length, got {o.size} and {r.size}"
        )
    if np.any(~(o >= 1)) or np.any(~np.isfinite(o)):
        raise UserError(f"orders must all be finite and >= 1, got {list(o)}")
    if np.any(np.isnan(r)) or np.any(r < 0):
        raise UserError("rdp values must all be >= 0 (inf allowed), got NaN or negative values")
    return float(_rdp_lib.compute_epsilon(o, r, d)[0])


def rdp_epsilon_floor(delta: float) -> float:
    """Smallest epsilon the RDP conversion over :data:`RDP_ORDERS` can give at ``delta``.

    Limit of the library's conversion as every RDP value tends to 0+ (sigma -> infinity, but
    before the KL branch applies):
    ``min_alpha  log(1 - 1/alpha) - log(delta * alpha) / (alpha - 1)`` over orders > 1.01.
    Targets below it are unreachable with ``accountant="rdp"`` whatever the noise.
    """
    return _rdp_epsilon_floor(check.open_unit("delta", delta))


@functools.lru_cache(maxsize=64)
def _rdp_epsilon_floor(delta: float) -> float:
    log1p_inv, log_term = _rdp_native._conversion_terms(RDP_ORDERS, delta)  # the accountant's terms (cached)
    return float(max(0.0, np.min((log1p_inv - log_term)[np.array(RDP_ORDERS) > 1.01])))


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Calibration:
    """Noise multiplier calibrated by :func:`calibrate_sigma`, with everything to reproduce it."""

    sigma: float
    epsilon: float  # achieved: <= target_epsilon, and >= (1 - 1e-3) * target unless epsilon(sigma) steps over that
    target_epsilon: float
    delta: float
    sample_rate: float
    steps: int
    accountant: str
    library: str
    rdp_order: float | None = None  # RDP: optimal order at sigma
    value_discretization_interval: float | None = None  # PLD: h used at sigma
    neighbours: str = "add_remove"  # the relation epsilon is stated for


def _sigma_guess(target: float, delta: float, q: float, steps: int) -> float:
    """Large-sigma asymptote epsilon ~ q sqrt(2 T ln(1/delta)) / sigma (CLT / moments accountant)."""
    return max(0.5, q * math.sqrt(2.0 * steps * math.log(1.0 / delta)) / target)


LATTICE_STEP: float = 2.0**-12
"""Spacing in log sigma of the lattice every calibrated sigma lies on (ratio 1.00024 between neighbours: epsilon
moves < 0.1 % per step wherever |d log epsilon / d log sigma| < 4, measured <= 3 on DP-SGD)."""
# halvings (down to a relative 2.4e-7 in sigma) of a step that jumps over the window, before epsilon(sigma) counts
# as a step function
_LATTICE_LEVELS = 10


class EpsilonCurve:
    """ε(σ) of one mechanism by its accountant, evaluated on a fixed lattice in x = log σ (x = k·LATTICE_STEP),
    memoised and shared by every target of the process (an ε axis reads one curve).

    :meth:`calibrate` returns the smallest lattice σ whose ε meets the target — a function of the target alone,
    not of the order in which targets are asked or of the points already known: it brackets the target between
    adjacent lattice points (ε(k − 1) > target ≥ ε(k)) by steps from a guess, then narrows the bracket by
    interpolation in log ε, safeguarded by bisection (the steps only change how many points are evaluated); where
    ε(σ) jumps over the window [(1 − rel_tol)·target, target] (a discretised PLD is a step function of σ), the
    step (k − 1, k] is halved up to `_LATTICE_LEVELS` times. ε must be non-increasing in σ.
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
        self.max_evaluations = max_evaluations
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
            if self.evaluations >= self.max_evaluations:
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
        """Smallest lattice sigma with ``(1 - rel_tol) * target <= epsilon(sigma) <= target`` (see the class)."""
        target = check.positive("target_epsilon", target_epsilon)
        guess = math.log(check.positive("sigma_guess", sigma_guess)) / LATTICE_STEP
        start = self.evaluations
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
        known = sorted((round(x / LATTICE_STEP), e) for x, e in self.points.items()
                       if (x / LATTICE_STEP).is_integer())
        above = max((k for k, e in known if e > target), default=None)  # too little noise
        below = min((k for k, e in known if e <= target and (above is None or k > above)), default=None)
        k, step = first, 64  # outwards from the guess by doubling steps until the target is bracketed
        usable = [(k, math.log(e)) for k, e in known if 0 < e < math.inf]
        if len(usable) >= 2:  # from other targets' points: the secant through the closest one in log ε and the
            usable.sort(key=lambda p: abs(p[1] - math.log(target)))  # closest at least 64 steps from it
            k0, e0 = usable[0]
            k1, e1 = next((p for p in usable[1:] if abs(p[0] - k0) >= 64), usable[1])
            if e0 != e1 and k0 != k1:
                k, step = round(k0 + (math.log(target) - e0) * (k1 - k0) / (e1 - e0)), 16
        while above is None or below is None:
            if above is not None and k <= above:  # more noise than a point known to be too little
                k = above + step
            if below is not None and k >= below:  # less noise than a point known to be enough
                k = below - step
            k = min(self._k_max, max(self._k_min, k))
            if self._at(k) <= target:
                below = k if below is None else min(below, k)
                if k == self._k_min:
                    return None, k
                k -= step
            else:
                above = k if above is None else max(above, k)
                if k == self._k_max:
                    raise _unreachable(target, self.sigma_range[1], self._at(k), self.context)
                k += step
            step *= 2
        halvings = 0  # interpolation in log epsilon over k, bisection when it has not halved the bracket twice
        while below - above > 1:
            width = below - above
            lo, hi = self._at(above), self._at(below)
            if halvings < 2 and 0 < hi < lo < math.inf:
                k = above + round((math.log(lo) - math.log(target)) / (math.log(lo) - math.log(hi)) * width)
            else:
                k = (above + below) // 2
            k = min(below - 1, max(above + 1, k))
            if self._at(k) <= target:
                below = k
            else:
                above = k
            halvings = 0 if below - above <= width // 2 else halvings + 1
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


CALIBRATION_VERSION: str = "2"  # 2: sigma on the EpsilonCurve lattice (1: Brent's method per target)
"""Version of the calibration code (:class:`EpsilonCurve`, :func:`calibrate_sigma`, the order grid, the PLD rule):
part of the on-disk cache key, so bump it whenever a change could alter a calibrated sigma."""

_CACHE_RELATION = {"add_remove": "add_or_remove_one", "replace_one": "replace_one"}  # as the cache keys spell them


def calibration_cache_dir() -> Path | None:
    """Where calibrated sigmas are kept: $DPSGD_CACHE_DIR/calibration, else <DPSGD_DATA_DIR>/.cache/calibration;
    None (no disk cache) when DPSGD_CACHE_DIR is ``off``."""
    return diskcache.cache_folder("calibration")


def _cache_key(target: float, delta: float, q: float, steps: int, accountant: str,
               neighbours: str = "add_remove") -> dict[str, Any]:
    # floats as repr (shortest round-trip string): 1/30162**2 and its neighbours are distinct keys
    return {"target_epsilon": repr(target), "delta": repr(delta), "sample_rate": repr(q), "steps": steps,
            "accountant": accountant, "neighboring_relation": _CACHE_RELATION[neighbours], "library": LIBRARY,
            "calibration_version": CALIBRATION_VERSION}


def _cache_read(folder: Path | None, key: dict[str, Any]) -> Calibration | None:
    """The cached Calibration for `key`, or None when absent, unreadable, corrupt or for another key. Not yet
    checked against the accountant: see :func:`_verified`."""
    try:
        return Calibration(**diskcache.read_entry(folder, key, "calibration"))
    except (TypeError, ValueError, AttributeError):
        return None


def _verified(cal: Calibration, target: float, d: float, q: float, t: int, name: str,
              neighbours: str = "add_remove") -> Calibration:
    """A cached σ checked against what defines it, by the accountant at (q, T, δ): σ is exactly a point of the
    curve's lattice (so a changed bit is seen) and ε(σ) is in the calibration window [(1 − rel_tol)·target, target]
    (or, where ε(σ) steps over the
    window, the finest lattice point below σ exceeds the target). The Calibration returned records that
    evaluation's ε and RDP order / PLD interval, never the cached ones. Raises :class:`diskcache.Rejected`."""
    sigma = cal.sigma
    if not (isinstance(sigma, float) and math.isfinite(sigma) and sigma > 0):
        raise diskcache.Rejected(f"sigma = {sigma!r} is not a positive number")
    finest = LATTICE_STEP / 2**_LATTICE_LEVELS  # the search's points are exp(k · finest), x = k · finest exactly
    k = round(math.log(sigma) / finest)
    if math.exp(k * finest) != sigma:
        raise diskcache.Rejected(f"sigma = {sigma!r} is not a point of the calibration lattice")
    curve = dpsgd_curve(d, q, t, name, neighbours)
    e, extra = curve.evaluate(sigma)
    in_window = (1.0 - curve.rel_tol) * target <= e <= target
    if not (in_window or (e <= target and curve.evaluate(math.exp((k - 1) * finest))[0] > target)):
        raise diskcache.Rejected(f"sigma = {sigma!r} gives epsilon = {e:.6g} by the {name} accountant at "
                                 f"delta={d:g}, sample_rate={q:g}, steps={t}, not the target {target:g} "
                                 f"(within {curve.rel_tol:g} below)")
    return _calibration(sigma, e, extra, target, d, q, t, name, neighbours)


def _calibration(sigma: float, e: float, extra: object, target: float, d: float, q: float, t: int,
                 name: str, neighbours: str) -> Calibration:
    return Calibration(sigma=sigma, epsilon=e, target_epsilon=target, delta=d, sample_rate=q, steps=t,
                       accountant=name, library=LIBRARY, neighbours=neighbours,
                       rdp_order=extra if name == "rdp" else None,  # type: ignore[arg-type]
                       value_discretization_interval=extra if name == "pld" else None)  # type: ignore[arg-type]


def _cache_write(folder: Path | None, key: dict[str, Any], cal: Calibration) -> None:
    """Atomic; concurrent workers see an old entry, a new one or none. Best effort. The fields are flat (floats,
    str, int, None): a copy of them, not ``dataclasses.asdict``'s recursive deep copy (~20 µs a write)."""
    diskcache.write_entry(folder, key, "calibration", dict(vars(cal)))


_F = TypeVar("_F", bound=Callable[..., Any])


def _memoised(maxsize: int) -> Callable[[_F], _F]:
    """functools.lru_cache keyed by the arguments as bound to the signature, defaults applied: a call that spells
    out a default (``neighbours="add_remove"``) and one that leaves it out share one entry."""

    def wrap(fn: _F) -> _F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return cached(*bound.args)

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        call.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return cast(_F, call)

    return wrap


@_memoised(maxsize=1024)
def calibrate_sigma(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: AccountantName = "rdp",
    neighbours: Neighbours = "add_remove",
) -> Calibration:
    """Smallest DP-SGD noise multiplier with epsilon in [0.999 * target, target] under ``neighbours``.

    Uses :func:`calibrate` on ``sigma -> epsilon_for(dpsgd_event(sigma, q, T), delta,
    accountant)``.  Results are cached in the process (all arguments are hashable) and on disk
    (:func:`calibration_cache_dir`; keyed by the arguments, the neighbouring relation, the library's version
    and :data:`CALIBRATION_VERSION`; corrupt entries are ignored and recomputed); a cached sigma is the float
    the computation returned, bit for bit, and is used only after one accountant evaluation confirms it
    (:func:`_verified`): its epsilon is that evaluation's.  Raises :class:`UserError` for invalid inputs and for
    targets that
    no sigma in [1e-2, 1e6] reaches.
    """
    target = check.positive("target_epsilon", target_epsilon)
    d = check.open_unit("delta", delta)
    q = check.sample_rate("sample_rate", sample_rate)
    t = check.count("steps", steps)
    name = _check_accountant(accountant)
    check_dpsgd_neighbours(name, neighbours)
    folder, key = calibration_cache_dir(), _cache_key(target, d, q, t, name, neighbours)
    cached = _cache_read(folder, key)
    if cached is not None:
        try:
            return _verified(cached, target, d, q, t, name, neighbours)
        except diskcache.Rejected as exc:
            diskcache.discard(folder, key, str(exc))
    cal = _calibrate_sigma(target, d, q, t, name, neighbours)
    _cache_write(folder, key, cal)
    return cal


def _calibrate_sigma(target: float, d: float, q: float, t: int, name: str,
                     neighbours: str = "add_remove") -> Calibration:
    if name == "rdp":
        floor = rdp_epsilon_floor(d)
        if target <= floor:
            raise UserError(
                f"target_epsilon={target:g} is unreachable with accountant='rdp': with RDP orders "
                f"up to {RDP_MAX_ORDER} no sigma certifies epsilon below ~{floor:.3g} at "
                f"delta={d:g}; use accountant='pld' or a larger target_epsilon/delta"
            )
    curve = dpsgd_curve(d, q, t, name, neighbours)
    point = curve.calibrate(target, sigma_guess=_sigma_guess(target, d, q, t))
    return _calibration(point.sigma, point.epsilon, curve.info[point.sigma], target, d, q, t, name, neighbours)


@_memoised(maxsize=64)
def dpsgd_curve(delta: float, sample_rate: float, steps: int, accountant: str,
                neighbours: str = "add_remove") -> EpsilonCurve:
    """The accountant's epsilon(sigma) of DP-SGD at (delta, q, T) under `neighbours`: one curve per process for
    every target (an epsilon axis reads it in one pass); info at each point: the RDP order or the PLD interval."""
    check_dpsgd_neighbours(accountant, neighbours)
    context = (f" (delta={delta:g}, sample_rate={sample_rate:g}, steps={steps}, accountant={accountant!r}, "
               f"neighbours={neighbours})")
    if accountant == "rdp":
        return EpsilonCurve(lambda sigma: dpsgd_rdp_epsilon(sigma, sample_rate, steps, delta), context=context)
    return EpsilonCurve(lambda sigma: _pld_epsilon(dpsgd_event(sigma, sample_rate, steps), delta,
                                                   neighbours=neighbours), context=context)


def calibrate_sigmas(targets: Sequence[float], delta: float, sample_rate: float, steps: int,
                     accountant: AccountantName = "rdp", neighbours: Neighbours = "add_remove") -> list[Calibration]:
    """:func:`calibrate_sigma` for a whole epsilon axis on one accountant curve, the loosest target first (its
    points are the cheapest to evaluate); each sigma is what the target alone gives (see :class:`EpsilonCurve`)."""
    found = {e: calibrate_sigma(e, delta, sample_rate, steps, accountant, neighbours)
             for e in sorted(set(targets), reverse=True)}
    return [found[e] for e in targets]
