"""DP-SGD's privacy accounting on ``dp-accounting``: its event (:func:`dpsgd_event`), the RDP and PLD accountants
(:func:`epsilon_for`) and σ calibration (:func:`calibrate_sigma`); measurements and choices: docs/accounting.md."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from dpsgd_cli.diskcache import CACHE_DIR_ENV
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy import ACCOUNTANT_LABELS, ACCOUNTANTS, AccountantName, Neighbours
from dpsgd_cli.privacy import rdp as _rdp_native
from dpsgd_cli.privacy import validate as check
from dpsgd_cli.privacy.calibration import LATTICE_STEP, CalibrationPoint, EpsilonCurve, cache_folder, cached, calibrate

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent
    from dp_accounting.privacy_accountant import NeighboringRelation


# dp-accounting (with scipy.stats and scipy.signal, slow to import) only when an accountant runs: a run whose
# σ all come from the disk cache never imports it
dp_event = LazyModule("dp_accounting.dp_event")
_rdp_lib = LazyModule("dp_accounting.rdp.rdp_privacy_accountant")
_pld_lib = LazyModule("dp_accounting.pld.pld_privacy_accountant")
_relations = LazyModule("dp_accounting.privacy_accountant")


def load_accountants() -> None:
    """Import the accountant library now (its modules load on first use): a process about to fork workers that
    will all account does it once for them."""
    for library in (_rdp_lib, _pld_lib, _relations, dp_event):
        library.import_now()

__all__ = [
    "ACCOUNTANTS",
    "ACCOUNTANT_LABELS",
    "CACHE_DIR_ENV",  # re-exported from dpsgd_cli.diskcache for callers that set the cache folder
    "CALIBRATION_VERSION",
    "LATTICE_STEP",
    "LIBRARY",
    "NEIGHBOURS",
    "AccountantName",
    "Neighbours",
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

LIBRARY: str = f"dp-accounting {importlib.metadata.version('dp-accounting')}"
"""Name and version of the accounting library, recorded in every :class:`Calibration`."""

# --- RDP order grid -----------------------------------------------------------------------------------------------

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
"""Integer orders in (64, 32768], ~5 % apart, evaluated lazily (docs/accounting.md)."""

RDP_ORDERS: tuple[float, ...] = RDP_BASE_ORDERS + RDP_EXTENSION_ORDERS
"""The full order grid: :func:`epsilon_for` returns the minimum of the conversion over it."""

# --- PLD discretisation -------------------------------------------------------------------------------------------

PLD_RHO: float = 0.005
"""PLD discretisation interval h = PLD_RHO * epsilon / sqrt(number of compositions)."""
MAX_STEPS = 10**12  # of a DP-SGD event: far beyond any run (the grid limit is 1e8), small enough to stay exact
_PLD_H_START = 1e-2
_PLD_H_MIN = 1e-10
_PLD_MAX_PASSES = 8


# --- Events -------------------------------------------------------------------------------------------------------


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> DpEvent:
    """DpEvent of DP-SGD (Abadi et al. 2016): SelfComposed(PoissonSampled(q, Gaussian(noise_multiplier)), steps); with
    q == 1 (full batch) the plain Gaussian mechanism composed T times."""
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


# --- Accountants --------------------------------------------------------------------------------------------------


class _DropFracNonConvergence(logging.Filter):
    """Drops the library's "_compute_log_a_frac failed to converge" warnings: it then excludes that order (RDP = inf),
    which only makes ε larger, so the bound stays valid; dozens of such lines would flood the output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_compute_log_a_frac failed to converge" not in record.getMessage()


_FRAC_FILTER = _DropFracNonConvergence()


@contextlib.contextmanager
def quiet_rdp() -> Iterator[None]:
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
    with quiet_rdp():
        return _rdp_epsilon_loud(event, delta, relation)


def dpsgd_rdp_epsilon(sigma: float, sample_rate: float, steps: int, delta: float) -> tuple[float, float]:
    """(ε, optimal order) of :func:`dpsgd_event` by the RDP accountant, without building the event: the library's
    numbers bit for bit (:mod:`dpsgd_cli.privacy.rdp`), without importing dp-accounting."""
    return _rdp_native.dpsgd_epsilon_and_order(sigma, sample_rate, steps, delta, RDP_BASE_ORDERS, RDP_EXTENSION_ORDERS)


def _rdp_epsilon_loud(event: DpEvent, delta: float, relation: NeighboringRelation) -> tuple[float, float]:
    def epsilons(orders: np.ndarray) -> np.ndarray:  # the library's RDP of `event`, converted per order
        accountant = _rdp_lib.RdpAccountant(list(orders), relation)
        accountant.compose(event)
        return _rdp_native.epsilon_at_orders(orders, accountant.rdp, delta)

    return _rdp_native.min_over_orders(epsilons, RDP_BASE_ORDERS, RDP_EXTENSION_ORDERS)


# Beyond these the PLD's discretised support does not fit in memory or time; RDP has no such limit.
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


NEIGHBOURS: tuple[str, ...] = ("add_remove", "replace_one", "zero_out")
_RELATION_NAMES = {"add_remove": "ADD_OR_REMOVE_ONE", "replace_one": "REPLACE_ONE", "zero_out": "REPLACE_SPECIAL"}


def _relation(neighbours: str) -> NeighboringRelation:
    if neighbours not in NEIGHBOURS:
        raise UserError(f"neighbours must be one of {', '.join(map(repr, NEIGHBOURS))}, got {neighbours!r}")
    return getattr(_relations.NeighboringRelation, _RELATION_NAMES[neighbours])


def check_dpsgd_neighbours(accountant: str, neighbours: str) -> None:
    """UserError unless DP-SGD's Poisson-subsampled Gaussian can be accounted by `accountant` under `neighbours`:
    dp-accounting's RDP accountant has no replace-one bound for Poisson subsampling (only for sampling without
    replacement), the PLD accountant has both (Zhu, Dong & Wang 2022 dominating pairs). Zero-out is add/remove's
    bound in both (the null record adds nothing to the sum, whose divisor is the expected batch size: the same pair
    of output distributions as the record removed)."""
    if neighbours not in NEIGHBOURS:  # without importing the library: a cached RDP σ never needs it
        raise UserError(f"neighbours must be one of {', '.join(map(repr, NEIGHBOURS))}, got {neighbours!r}")
    if neighbours == "replace_one" and accountant == "rdp":
        raise UserError("accountant 'rdp' has no replace-one bound for DP-SGD's Poisson-subsampled Gaussian "
                        "(dp-accounting's RDP supports replace-one only for sampling without replacement); "
                        "use accountant: pld, or neighbours: add_remove")


def pld_accountant(event: DpEvent, h: float, neighbours: str = "add_remove") -> Any:
    """dp-accounting's PLDAccountant with `event` composed at discretisation interval h; UserError (one line) for
    an event it cannot represent or whose PLD would not fit in memory (checked before the library allocates)."""
    check_pld_event(event)
    check.pld_memory(event, h)
    accountant = _pld_lib.PLDAccountant(_relation(neighbours), value_discretization_interval=h)
    accountant.compose(event)
    return accountant


def _pld_once(event: DpEvent, delta: float, h: float, neighbours: str = "add_remove") -> float:
    return float(pld_accountant(event, h, neighbours).get_epsilon(delta))


def snap_down(h: float) -> float:
    """Largest 10**(-k/4) <= h."""
    snapped: float = 10.0 ** (math.floor(4.0 * math.log10(h)) / 4.0)
    return snapped


def pld_interval(event: DpEvent, epsilon: float) -> float:
    """The discretisation interval for an ε of `event`: PLD_RHO·ε/√(compositions), snapped down to 10^(−k/4)."""
    return max(_PLD_H_MIN, snap_down(PLD_RHO * epsilon / math.sqrt(_composition_count(event))))


def _pld_epsilon(
    event: DpEvent, delta: float, value_discretization_interval: float | None = None,
    neighbours: str = "add_remove",
) -> tuple[float, float]:
    """(epsilon, discretisation interval used); the h rule: docs/accounting.md."""
    if value_discretization_interval is not None:
        h = check.positive("value_discretization_interval", value_discretization_interval)
        return _pld_once(event, delta, h, neighbours), h
    h = _PLD_H_START
    eps = _pld_once(event, delta, h, neighbours)
    for _ in range(_PLD_MAX_PASSES):
        if not (math.isfinite(eps) and eps > 0):
            break
        h_new = pld_interval(event, eps)
        if h_new >= h:
            break
        h = h_new
        eps = _pld_once(event, delta, h, neighbours)
    return eps, h


def _check_accountant(accountant: object) -> str:
    if accountant not in ACCOUNTANTS:
        raise UserError(f"accountant must be one of {', '.join(map(repr, ACCOUNTANTS))}, got {accountant!r}")
    return str(accountant)


def epsilon_for(
    event: DpEvent, delta: float, accountant: AccountantName = "rdp", neighbours: Neighbours = "add_remove"
) -> float:
    """ε such that ``event`` is (ε, delta)-DP under ``neighbours`` by the accountant (upper bounds; PLD tighter)."""
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
    """ε at ``delta`` of an (orders[i], rdp[i])-RDP mechanism by dp-accounting (Balle et al. 2020, Prop. 12)."""
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
    """Smallest ε the RDP conversion over :data:`RDP_ORDERS` can give at ``delta`` (its limit as every RDP value tends
    to 0+: min over α > 1.01 of log(1 − 1/α) − log(δα)/(α − 1)); targets below it are unreachable with RDP."""
    return _rdp_epsilon_floor(check.open_unit("delta", delta))


@functools.lru_cache(maxsize=64)
def _rdp_epsilon_floor(delta: float) -> float:
    log1p_inv, log_term = _rdp_native._conversion_terms(RDP_ORDERS, delta)  # the accountant's terms (cached)
    return float(max(0.0, np.min((log1p_inv - log_term)[np.array(RDP_ORDERS) > 1.01])))


# --- Calibration --------------------------------------------------------------------------------------------------


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
    """Where the search starts: the large-sigma asymptote epsilon ~ q sqrt(2 T ln(1/delta)) / sigma (CLT / moments
    accountant); it keeps the accountant near the answer (PLD refuses or crawls far below it)."""
    return max(0.5, q * math.sqrt(2.0 * steps * math.log(1.0 / delta)) / target)


CALIBRATION_VERSION: str = "2"
"""Version of the calibration code (the lattice, :func:`calibrate_sigma`, the order grid, the PLD rule): part of
every on-disk calibration key, so bump it whenever a change could alter a calibrated sigma."""

# as the cache keys spell them
_CACHE_RELATION = {"add_remove": "add_or_remove_one", "replace_one": "replace_one", "zero_out": "replace_special"}


def calibration_cache_dir() -> Path | None:
    """Where calibrations are kept (:func:`dpsgd_cli.privacy.calibration.cache_folder`)."""
    return cache_folder()


def _cache_key(target: float, delta: float, q: float, steps: int, accountant: str,
               neighbours: str = "add_remove") -> dict[str, Any]:
    # floats as repr (shortest round-trip string): 1/30162**2 and its neighbours are distinct keys
    return {"target_epsilon": repr(target), "delta": repr(delta), "sample_rate": repr(q), "steps": steps,
            "accountant": accountant, "neighboring_relation": _CACHE_RELATION[neighbours], "library": LIBRARY,
            "calibration_version": CALIBRATION_VERSION}


def _verified(cal: Calibration, target: float, d: float, q: float, t: int, name: str,
              neighbours: str = "add_remove") -> Calibration:
    """A cached Calibration checked by one evaluation of the accountant at (q, T, δ) (:meth:`EpsilonCurve.verify`:
    σ exactly a lattice point, ε(σ) in the window); returned with that evaluation's ε and RDP order / PLD interval,
    never the cached ones. Raises :class:`diskcache.Rejected`."""
    e, extra = dpsgd_curve(d, q, t, name, neighbours).verify(cal.sigma, target)
    return _calibration(cal.sigma, e, extra, target, d, q, t, name, neighbours)


def _calibration(sigma: float, e: float, extra: object, target: float, d: float, q: float, t: int,
                 name: str, neighbours: str) -> Calibration:
    return Calibration(sigma=sigma, epsilon=e, target_epsilon=target, delta=d, sample_rate=q, steps=t,
                       accountant=name, library=LIBRARY, neighbours=neighbours,
                       rdp_order=extra if name == "rdp" else None,  # type: ignore[arg-type]
                       value_discretization_interval=extra if name == "pld" else None)  # type: ignore[arg-type]


_F = TypeVar("_F", bound=Callable[..., Any])


def memoised(maxsize: int) -> Callable[[_F], _F]:
    """functools.lru_cache keyed by the arguments as bound to the signature, defaults applied: a call that spells
    out a default (``neighbours="add_remove"``) and one that leaves it out share one entry."""

    def wrap(fn: _F) -> _F:
        memo = functools.lru_cache(maxsize=maxsize)(fn)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return memo(*bound.args)

        call.cache_clear = memo.cache_clear  # type: ignore[attr-defined]
        call.cache_info = memo.cache_info  # type: ignore[attr-defined]
        return cast(_F, call)

    return wrap


@memoised(maxsize=1024)
def calibrate_sigma(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: AccountantName = "rdp",
    neighbours: Neighbours = "add_remove",
) -> Calibration:
    """Smallest DP-SGD noise multiplier on the lattice of :func:`dpsgd_curve` with ε in [0.999·target, target] under
    ``neighbours``, kept in the process and the calibration disk cache (checked on reading: :func:`_verified`);
    UserError for invalid inputs and targets no σ in [1e-2, 1e6] reaches."""
    target = check.positive("target_epsilon", target_epsilon)
    d = check.open_unit("delta", delta)
    q = check.sample_rate("sample_rate", sample_rate)
    t = check.count("steps", steps)
    name = _check_accountant(accountant)
    check_dpsgd_neighbours(name, neighbours)
    return cached(_cache_key(target, d, q, t, name, neighbours), [f.name for f in fields(Calibration)],
                  lambda: _calibrate_sigma(target, d, q, t, name, neighbours),
                  lambda stored: _verified(Calibration(**stored), target, d, q, t, name, neighbours),
                  # the fields are flat: a copy of them, not dataclasses.asdict's deep copy
                  lambda cal: dict(vars(cal)))


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


@memoised(maxsize=64)
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
