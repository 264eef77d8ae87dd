"""Attack risk beside ε: the accountant's bound on the power of any membership test (Kairouz, Oh & Viswanath 2015;
Dong, Roth & Su 2022, Prop. 2.12 and Cor. 2.13); the bounds and their sources: docs/accounting.md#attack-risk."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy.special import log_ndtr, ndtr

from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.privacy.accounting import (
    RDP_BASE_ORDERS,
    _relation,
    dp_event,
    pld_accountant,
    pld_interval,
    quiet_rdp,
)
from dpsgd_cli.privacy.accounting import _rdp_lib as rdp_lib

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

_library = LazyModule("dp_accounting.privacy_accountant")

__all__ = ["BOUND_COLUMNS", "COLUMNS", "EPSILON_GRID", "attack_risk", "gaussian_delta", "gdp_mu", "privacy_profile",
           "tpr_bound"]

BOUND_COLUMNS: dict[float, str] = {1e-2: "tpr_bound_fpr_1e-2", 1e-3: "tpr_bound_fpr_1e-3"}
"""The column of each false-positive rate's bound."""
COLUMNS: tuple[str, ...] = (*BOUND_COLUMNS.values(), "gdp_mu", "tpr_bound_from")
"""The columns of runs.csv :func:`attack_risk` fills (audit.csv takes the bounds)."""

EPSILON_GRID: np.ndarray = np.round(np.arange(0.0, 16.0 + 1e-9, 0.01), 2)
"""Where the profile is read: ε ∈ [0, 16] in steps of 0.01. Any ε gives a valid bound (a coarser grid is looser,
never wrong); above 16, e^ε α > 8·10³ at α = 10⁻³ and 1 − e^{−ε} > 1 − 10⁻⁶, so no larger ε lowers a bound at
the rates of :data:`BOUND_COLUMNS`."""


def tpr_bound(fpr: float, epsilon: Any, delta: Any) -> float:
    """The largest TPR at false-positive rate `fpr` of any test against a mechanism that is (ε, δ)-DP for each pair
    of `epsilon` and `delta` (scalars or arrays of equal shape): the minimum of the region's bound over them."""
    e, d = np.asarray(epsilon, dtype=float), np.asarray(delta, dtype=float)
    with np.errstate(over="ignore"):
        bound = np.minimum(np.exp(e) * fpr + d, 1.0 - np.exp(-e) * (1.0 - d - fpr))
    return float(min(1.0, float(np.min(bound))))


def gaussian_delta(mu: float, epsilon: float) -> float:
    """δ_μ(ε) of μ-GDP (the Gaussian mechanism of sensitivity μ and unit noise)."""
    a, b = -epsilon / mu + mu / 2, -epsilon / mu - mu / 2
    return float(ndtr(a) - math.exp(epsilon + float(log_ndtr(b))))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The μ whose μ-GDP profile passes through (ε, δ): δ_μ(ε) = δ (δ_μ(ε) increases with μ); NaN for δ ≤ 0 (pure
    ε-DP is no Gaussian's) or δ ≥ 1."""
    if not (math.isfinite(epsilon) and epsilon >= 0 and 0 < delta < 1):
        return math.nan
    lo, hi = 0.0, 1.0
    while gaussian_delta(hi, epsilon) < delta:
        lo, hi = hi, 2 * hi
    for _ in range(200):  # bisection until [lo, hi] is one float wide (~60 passes)
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        lo, hi = (mid, hi) if gaussian_delta(mid, epsilon) < delta else (lo, mid)
    return hi


def _gaussian_only(event: DpEvent) -> bool:
    """Whether `event` is built of Gaussian mechanisms alone (composed, Poisson-sampled): the rows whose μ is read."""
    if isinstance(event, dp_event.GaussianDpEvent):
        return True
    if isinstance(event, dp_event.ComposedDpEvent):
        return all(_gaussian_only(e) for e in event.events)
    if isinstance(event, (dp_event.SelfComposedDpEvent, dp_event.PoissonSampledDpEvent,
                          dp_event.SampledWithoutReplacementDpEvent)):
        return _gaussian_only(event.event)
    return False


def privacy_profile(event: DpEvent, neighbours: str, epsilon: float) -> tuple[np.ndarray, str]:
    """δ(ε) of `event` on :data:`EPSILON_GRID` under `neighbours`, and the accountant that gave it: "pld" (the PLD at
    the discretisation interval the accounting uses for an ε of `epsilon`), else "rdp", or both ("pld+rdp", their
    minimum at each ε) under replace-one, where the PLD reads a Gaussian's sensitivity as doubled (dp_event's
    docstring in algorithms/base.py); "" where neither takes it. Kept per (event, neighbours, ε) in the process (by
    the event's repr: a composed event holds a list, which does not hash)."""
    return _privacy_profile(repr(event), event, neighbours, epsilon)


_PROFILES: dict[tuple[str, str, float], tuple[np.ndarray, str]] = {}


def _privacy_profile(key: str, event: DpEvent, neighbours: str, epsilon: float) -> tuple[np.ndarray, str]:
    if (key, neighbours, epsilon) in _PROFILES:
        return _PROFILES[(key, neighbours, epsilon)]
    if len(_PROFILES) >= 256:
        _PROFILES.pop(next(iter(_PROFILES)))
    found = _PROFILES[(key, neighbours, epsilon)] = _compute_profile(event, neighbours, epsilon)
    return found


def _compute_profile(event: DpEvent, neighbours: str, epsilon: float) -> tuple[np.ndarray, str]:
    profiles: dict[str, np.ndarray] = {}
    try:
        pld = pld_accountant(event, min(1e-2, pld_interval(event, epsilon)), neighbours)
        # the PLD itself reads every ε at once (the accountant's get_delta takes one)
        profiles["pld"] = np.asarray(pld._pld.get_delta_for_epsilon(EPSILON_GRID), dtype=float)
    except (UserError, _library.UnsupportedEventError):  # beyond its limits, or an event it has no PLD for
        pass
    if neighbours == "replace_one" or not profiles:
        # the orders up to 64: those above give δ(ε) far below what moves a bound at an FPR ≥ 10⁻³, and cost seconds
        accountant = rdp_lib.RdpAccountant(list(RDP_BASE_ORDERS), _relation(neighbours))
        if accountant.supports(event):
            with quiet_rdp():
                accountant.compose(event)
                profiles["rdp"] = np.array([accountant.get_delta(e) for e in EPSILON_GRID], dtype=float)
    if not profiles:
        return np.ones_like(EPSILON_GRID), ""
    return np.minimum.reduce(list(profiles.values())), "+".join(profiles)


def attack_risk(event: DpEvent | None, neighbours: str, epsilon: float | None, delta: float) -> dict[str, Any]:
    """A private row's :data:`COLUMNS` from its dp_event (None: its own analysis) and its claimed (`epsilon`, `delta`)
    (`epsilon` None: no proved claim). Each bound is the minimum of the profile's and the claim's; `tpr_bound_from`
    says which profile ("pld", "rdp", "pld+rdp") or "epsilon_delta" (the claim alone); μ from the claim, for an event
    of Gaussian mechanisms only (exact without subsampling, the CLT reading with it); NaN where a number is not
    known (no event and no claim, or not a Gaussian)."""
    claimed = epsilon if epsilon is not None and math.isfinite(epsilon) else None
    if event is None or isinstance(event, dp_event.NonPrivateDpEvent):
        profile, source = np.ones_like(EPSILON_GRID), ""
    else:
        # any interval gives an upper bound; that of an ε ≥ 1 keeps the cost within the event's size (a claimed
        # ε of 0.01 would make it 100 times finer: tens of seconds)
        profile, source = privacy_profile(event, neighbours, max(1.0, claimed or 0.0))
    bounds = {}
    for fpr, column in BOUND_COLUMNS.items():
        found = [tpr_bound(fpr, EPSILON_GRID, profile)] if source else []
        if claimed is not None:
            found.append(tpr_bound(fpr, claimed, delta))
        bounds[column] = min(found) if found else math.nan
    mu = math.nan
    if claimed is not None and event is not None and _gaussian_only(event):
        mu = gdp_mu(claimed, delta)
    return {**bounds, "gdp_mu": mu,
            "tpr_bound_from": source or ("epsilon_delta" if claimed is not None else None)}
