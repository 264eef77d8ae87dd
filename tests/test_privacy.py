"""Tests of dpsgd_cli.privacy: accounting (against dp-accounting built independently here and
against closed forms) and the classical mechanisms (closed forms by hand, samplers by KS tests
that are also shown to reject a wrong distribution)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, stats

from dpsgd_cli import diskcache
from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy import accounting as acc
from dpsgd_cli.privacy import mechanisms as mech

ADULT_Q = 256 / 30162
ADULT_T = 590
ADULT_DELTA = 1 / 30162**2


# ------------------------------------------------------------------------------------------
# Independent references
# ------------------------------------------------------------------------------------------


def lib_event(sigma, q, steps):
    """DP-SGD event built directly with dp_accounting (not through dpsgd_event)."""
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier=sigma)
    if q == 1.0:
        return dp_accounting.SelfComposedDpEvent(event=gaussian, count=steps)
    sampled = dp_accounting.PoissonSampledDpEvent(sampling_probability=q, event=gaussian)
    return dp_accounting.SelfComposedDpEvent(event=sampled, count=steps)


def lib_rdp(sigma, q, steps, delta, max_order=1024.0):
    """(epsilon, optimal order) from a fresh RdpAccountant over our documented grid <= max_order."""
    accountant = RdpAccountant(orders=[a for a in acc.RDP_ORDERS if a <= max_order])
    accountant.compose(lib_event(sigma, q, steps))
    eps, order = accountant.get_epsilon_and_optimal_order(delta)
    assert order < max_order, "reference grid truncated too early for this case"
    return eps, order


def lib_pld(sigma, q, steps, delta, h):
    accountant = PLDAccountant(value_discretization_interval=h)
    accountant.compose(lib_event(sigma, q, steps))
    return accountant.get_epsilon(delta)


def exact_gaussian_epsilon(mu, delta):
    """Exact epsilon(delta) of a Gaussian mechanism with sensitivity/sigma = mu (Balle & Wang
    2018, Thm 8): delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""

    def excess(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta

    return optimize.brentq(excess, 0.0, 500.0, xtol=1e-14, rtol=1e-14)


def classic_rdp_gaussian_epsilon(sigma, steps, delta):
    """min over real alpha > 1 of T alpha / (2 sigma^2) + ln(1/delta) / (alpha - 1)
    (Mironov 2017, Prop. 3): with a = T/(2 sigma^2), L = ln(1/delta) the minimum is
    a + 2 sqrt(a L), at alpha = 1 + sqrt(L / a)."""
    a = steps / (2 * sigma**2)
    big_l = math.log(1 / delta)
    return a + 2 * math.sqrt(a * big_l)


# ------------------------------------------------------------------------------------------
# The RDP order grid
# ------------------------------------------------------------------------------------------


def test_rdp_order_grid_is_rich_and_contains_library_defaults():
    orders = np.array(acc.RDP_ORDERS)
    assert np.all(np.diff(orders) > 0)
    assert set(DEFAULT_RDP_ORDERS) <= set(acc.RDP_ORDERS)  # so we are never looser than defaults
    small = orders[orders <= 11]
    assert small[0] == pytest.approx(1.05) and small[-1] == 11
    assert np.allclose(np.diff(small), 0.05)
    large = orders[orders >= 64]
    assert np.max(large[1:] / large[:-1]) <= 1.05 + 1e-2  # <= 5 % apart (+ integer rounding)
    assert orders[-1] == acc.RDP_MAX_ORDER == 32768


def test_rdp_epsilon_floor_matches_library_conversion_at_tiny_rdp():
    delta = ADULT_DELTA
    floor = acc.rdp_epsilon_floor(delta)
    # The library conversion with rdp -> 0+ (but above the KL branch threshold delta^2).
    rdp = np.full(len(acc.RDP_ORDERS), 1e-14)
    lib = dp_accounting.rdp.compute_epsilon(list(acc.RDP_ORDERS), list(rdp), delta)[0]
    assert floor == pytest.approx(lib, abs=1e-12)
    assert 2e-4 < floor < 4e-4  # ~ln(1/delta)/32768: epsilon ~ 1e-3 is still reachable


# ------------------------------------------------------------------------------------------
# dpsgd_epsilon against dp-accounting and closed forms
# ------------------------------------------------------------------------------------------

RDP_CASES = [
    (1.1, 0.01, 1000, 1e-5),
    (0.7, ADULT_Q, ADULT_T, ADULT_DELTA),
    (4.0, 0.004, 5000, 1e-6),
    (10.0, ADULT_Q, ADULT_T, ADULT_DELTA),  # optimal order ~260: exercises the lazy walk
    (2.0, 1.0, 10, 1e-5),
]


@pytest.mark.parametrize("sigma,q,steps,delta", RDP_CASES)
def test_rdp_epsilon_equals_fresh_library_accountant(sigma, q, steps, delta):
    ours = acc.dpsgd_epsilon(sigma, q, steps, delta, "rdp")
    reference, _ = lib_rdp(sigma, q, steps, delta)
    assert ours == pytest.approx(reference, rel=1e-12)
    # The library's default orders can only be looser (our grid contains them).
    default = RdpAccountant()
    default.compose(lib_event(sigma, q, steps))
    assert ours <= default.get_epsilon(delta) * (1 + 1e-12)


def test_rdp_tiny_epsilon_uses_large_orders():
    """epsilon ~ 0.01 at delta ~ 1e-9 needs orders ~ 2500: orders <= 1024 floor at ~0.0124."""
    sigma = 100.0
    ours = acc.dpsgd_epsilon(sigma, ADULT_Q, ADULT_T, ADULT_DELTA, "rdp")
    reference, order = lib_rdp(sigma, ADULT_Q, ADULT_T, ADULT_DELTA, max_order=8192)
    assert order > 1024
    assert ours == pytest.approx(reference, rel=1e-12)
    default = RdpAccountant()  # orders up to 1024
    default.compose(lib_event(sigma, ADULT_Q, ADULT_T))
    assert default.get_epsilon(ADULT_DELTA) > 1.3 * ours
    assert ours < 0.0105


PLD_CASES = [
    (1.1, 0.01, 1000, 1e-5),
    (0.7, ADULT_Q, ADULT_T, ADULT_DELTA),
    (100.0, ADULT_Q, ADULT_T, ADULT_DELTA),  # epsilon ~ 0.0094
    (3.0, 0.05, 200, 1e-6),
]


@pytest.mark.parametrize("sigma,q,steps,delta", PLD_CASES)
def test_pld_epsilon_is_an_accurate_upper_bound_vs_fresh_library_accountant(sigma, q, steps, delta):
    ours = acc.dpsgd_epsilon(sigma, q, steps, delta, "pld")
    # The documented rule: h <= PLD_RHO * epsilon / sqrt(T); compare with a 4x finer grid.
    _, h = acc._pld_epsilon(acc.dpsgd_event(sigma, q, steps), delta)
    assert h <= acc.PLD_RHO * ours / math.sqrt(steps)
    reference = lib_pld(sigma, q, steps, delta, h / 4)
    assert reference * (1 - 1e-9) <= ours <= reference * (1 + 2e-4)
    assert lib_pld(sigma, q, steps, delta, h) == ours  # same h: the very same computation


@pytest.mark.parametrize(
    "sigma,q,steps,delta",
    [(1.1, 0.01, 1000, 1e-5), (0.7, ADULT_Q, ADULT_T, ADULT_DELTA), (3.0, 0.05, 200, 1e-6),
     (100.0, ADULT_Q, ADULT_T, ADULT_DELTA)],
)
def test_rdp_is_not_tighter_than_pld(sigma, q, steps, delta):
    rdp = acc.dpsgd_epsilon(sigma, q, steps, delta, "rdp")
    pld = acc.dpsgd_epsilon(sigma, q, steps, delta, "pld")
    assert rdp >= pld * (1 - 1e-3)
    assert rdp <= 1.3 * pld  # and RDP is not absurdly loose either


@pytest.mark.parametrize(
    "sigma,steps,delta", [(1.0, 1, 1e-5), (2.0, 10, 1e-5), (5.0, 100, 1e-6), (50.0, 100, 1e-6)]
)
def test_full_batch_is_the_gaussian_mechanism(sigma, steps, delta):
    """q = 1: T compositions of Gaussian(sigma) = one Gaussian with sigma/sqrt(T)."""
    exact = exact_gaussian_epsilon(math.sqrt(steps) / sigma, delta)
    classic = classic_rdp_gaussian_epsilon(sigma, steps, delta)
    rdp = acc.dpsgd_epsilon(sigma, 1.0, steps, delta, "rdp")
    pld = acc.dpsgd_epsilon(sigma, 1.0, steps, delta, "pld")
    # Library RDP uses the improved conversion: below the classical bound, within a modest factor.
    assert exact <= rdp <= classic
    assert rdp >= 0.75 * classic
    # PLD is essentially exact for the Gaussian, and an upper bound.
    assert exact * (1 - 1e-9) <= pld <= exact * (1 + 1e-4)
    # Our RDP equals the closed-form Gaussian RDP curve T alpha/(2 sigma^2) through the wrapper.
    orders = np.array(acc.RDP_ORDERS)
    assert rdp == pytest.approx(
        acc.rdp_curve_to_epsilon(orders, steps * orders / (2 * sigma**2), delta), rel=1e-12
    )


def test_dpsgd_event_structure():
    event = acc.dpsgd_event(1.5, 0.01, 7)
    assert event == lib_event(1.5, 0.01, 7)
    assert acc.dpsgd_event(1.5, 1.0, 7) == lib_event(1.5, 1.0, 7)
    assert isinstance(acc.dpsgd_event(1.5, 1, 7).event, dp_accounting.GaussianDpEvent)


def test_epsilon_grows_with_steps_and_shrinks_with_sigma():
    for name in acc.ACCOUNTANTS:
        e = [acc.dpsgd_epsilon(1.0, 0.01, t, 1e-5, name) for t in (100, 200, 400)]
        assert e[0] < e[1] < e[2]
        e = [acc.dpsgd_epsilon(s, 0.01, 400, 1e-5, name) for s in (0.8, 1.0, 1.5)]
        assert e[0] > e[1] > e[2]


def test_rdp_curve_to_epsilon_is_at_most_the_classic_conversion():
    orders = np.array([1.5, 2.0, 4.0, 8.0, 16.0, 32.0])
    rdp = 0.3 * orders  # a zCDP-like curve
    delta = 1e-6
    classic = np.min(rdp + math.log(1 / delta) / (orders - 1))
    ours = acc.rdp_curve_to_epsilon(orders, rdp, delta)
    assert ours < classic
    # Hand check of the improved conversion (Balle et al. 2020, Prop. 12) at alpha = 8:
    a = 8.0
    at_8 = 0.3 * a + math.log1p(-1 / a) - math.log(delta * a) / (a - 1)
    assert ours <= at_8 + 1e-12
    with pytest.raises(UserError, match="orders"):
        acc.rdp_curve_to_epsilon([2.0, 3.0], [0.1], delta)
    with pytest.raises(UserError, match="orders"):
        acc.rdp_curve_to_epsilon([0.5], [0.1], delta)
    with pytest.raises(UserError, match="delta"):
        acc.rdp_curve_to_epsilon([2.0], [0.1], 0.0)


# ------------------------------------------------------------------------------------------
# Calibration
# ------------------------------------------------------------------------------------------

TARGETS = (0.01, 0.1, 1.0, 3.0)


@pytest.mark.parametrize("accountant", acc.ACCOUNTANTS)
def test_calibrate_sigma_hits_the_window_checked_by_fresh_accountant(accountant):
    sigmas = []
    for target in TARGETS:
        cal = acc.calibrate_sigma(target, ADULT_DELTA, ADULT_Q, ADULT_T, accountant)
        assert 0.999 * target <= cal.epsilon <= target
        if accountant == "rdp":
            eps, order = lib_rdp(cal.sigma, ADULT_Q, ADULT_T, ADULT_DELTA,
                                 max_order=8192 if target < 0.05 else 1024)
            assert eps == pytest.approx(cal.epsilon, rel=1e-12)
            assert order == cal.rdp_order
        else:
            h = cal.value_discretization_interval
            assert lib_pld(cal.sigma, ADULT_Q, ADULT_T, ADULT_DELTA, h) == cal.epsilon
            finer = lib_pld(cal.sigma, ADULT_Q, ADULT_T, ADULT_DELTA, h / 4)
            eps = finer
            assert 0.998 * target <= finer <= target
        assert 0.998 * target <= eps <= target
        # Minimal: 1 % less noise already breaks the target.
        assert acc.dpsgd_epsilon(0.99 * cal.sigma, ADULT_Q, ADULT_T, ADULT_DELTA, accountant) > target
        sigmas.append(cal.sigma)
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))  # larger target -> less noise


def test_calibration_disk_cache_is_bit_identical_shared_and_robust(tmp_path, monkeypatch):
    monkeypatch.setenv(acc.CACHE_DIR_ENV, str(tmp_path))
    args = (0.7, 1e-5, 0.02, 50, "rdp")
    cold = acc.calibrate_sigma.__wrapped__(*args)  # computed, then written
    files = list((tmp_path / "calibration").glob("*.json"))
    assert len(files) == 1 and not list((tmp_path / "calibration").glob("*.tmp"))
    warm = acc.calibrate_sigma.__wrapped__(*args)  # read back
    assert warm == cold and warm.sigma.hex() == cold.sigma.hex()
    assert acc._calibrate_sigma(0.7, 1e-5, 0.02, 50, "rdp") == cold  # the cache returns what is computed
    # Another key (delta) is another entry; a stale/foreign entry under our file name is not used.
    other = acc.calibrate_sigma.__wrapped__(0.7, 2e-5, 0.02, 50, "rdp")
    assert other.sigma != cold.sigma and len(list((tmp_path / "calibration").glob("*.json"))) == 2
    for corrupt in ("{not json", '{"key": 1}', files[0].read_text().replace(repr(cold.sigma), "-1.0")):
        files[0].write_text(corrupt)
        again = acc.calibrate_sigma.__wrapped__(*args)  # ignored, recomputed, rewritten
        stored = diskcache.read_entry(tmp_path / "calibration", acc._cache_key(*args[:4], "rdp"), "calibration")
        assert again == cold and acc.Calibration(**stored) == cold
    monkeypatch.setenv(acc.CACHE_DIR_ENV, "off")
    assert acc.calibration_cache_dir() is None and acc.calibrate_sigma.__wrapped__(*args) == cold


def test_pld_calibration_needs_less_noise_than_rdp():
    for target in (0.1, 1.0):
        rdp = acc.calibrate_sigma(target, 1e-5, 0.01, 1000, "rdp")
        pld = acc.calibrate_sigma(target, 1e-5, 0.01, 1000, "pld")
        assert pld.sigma < rdp.sigma


def test_calibration_record_and_cache():
    acc.calibrate_sigma.cache_clear()  # speed is measured by the benchmark, not here
    cal = acc.calibrate_sigma(1.0, ADULT_DELTA, ADULT_Q, ADULT_T)
    assert acc.calibrate_sigma(1.0, ADULT_DELTA, ADULT_Q, ADULT_T) is cal
    assert acc.calibrate_sigma.cache_info().hits == 1
    assert cal.accountant == "rdp" and cal.steps == ADULT_T and cal.sample_rate == ADULT_Q
    assert cal.target_epsilon == 1.0 and cal.delta == ADULT_DELTA
    assert cal.library == f"dp-accounting {importlib.metadata.version('dp-accounting')}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cal.sigma = 2.0  # type: ignore[misc]


def test_calibrate_sigma_unreachable_targets():
    with pytest.raises(UserError, match="unreachable.*pld"):
        acc.calibrate_sigma(1e-4, ADULT_DELTA, ADULT_Q, ADULT_T, "rdp")
    # PLD can go lower than the RDP floor.
    cal = acc.calibrate_sigma(1e-3, ADULT_DELTA, ADULT_Q, ADULT_T, "pld")
    assert 0.999e-3 <= cal.epsilon <= 1e-3


def _looks(curve: acc.EpsilonCurve) -> int:
    """Accountant evaluations of a curve."""
    return curve.evaluations


def _fresh_curves():
    acc.calibrate_sigma.cache_clear()
    acc.dpsgd_curve.cache_clear()


@pytest.mark.parametrize("accountant", acc.ACCOUNTANTS)
def test_sigma_of_a_target_does_not_depend_on_the_other_targets(accountant, monkeypatch):
    """One accountant curve for an ε axis, yet each σ is what its target gives alone: calibrated alone, in
    either order along the axis, or after unrelated targets, the Calibration is identical, and σ is the smallest
    point of the log σ lattice that meets the target (one lattice step less noise breaks it, by a fresh
    accountant)."""
    monkeypatch.setenv(acc.CACHE_DIR_ENV, "off")
    q, steps, delta = ADULT_Q, ADULT_T, ADULT_DELTA
    axis = [0.5, 1.0, 2.0, 3.0]
    alone, cost_alone, evaluations_alone = {}, 0, 0
    for target in axis:
        _fresh_curves()
        alone[target] = acc.calibrate_sigma(target, delta, q, steps, accountant)
        evaluations_alone += acc.dpsgd_curve(delta, q, steps, accountant).evaluations
        cost_alone += _looks(acc.dpsgd_curve(delta, q, steps, accountant))
    for order in (axis, axis[::-1], [0.5, 4.0, *axis[1::2], *axis[::2]]):
        _fresh_curves()
        got = {t: acc.calibrate_sigma(t, delta, q, steps, accountant) for t in order}
        assert all(got[t] == alone[t] and got[t].sigma.hex() == alone[t].sigma.hex() for t in axis)
    _fresh_curves()
    assert acc.calibrate_sigmas(axis[::-1], delta, q, steps, accountant) == [alone[t] for t in axis[::-1]]
    shared = _looks(acc.dpsgd_curve(delta, q, steps, accountant))
    print(f"{accountant}: {cost_alone} evaluations one target at a time, {shared} on one curve")
    assert shared <= cost_alone  # each target's search is its own; points two targets share are evaluated once
    for target, cal in alone.items():
        k = math.log(cal.sigma) / acc.LATTICE_STEP
        assert abs(k - round(k)) < 1e-6 and 0.999 * target <= cal.epsilon <= target
        less_noise = math.exp((round(k) - 1) * acc.LATTICE_STEP)
        assert acc.dpsgd_epsilon(less_noise, q, steps, delta, accountant) > target


def test_epsilon_curve_on_known_functions():
    h = acc.LATTICE_STEP
    # epsilon = 3 / sigma: the smallest lattice sigma with 3 / sigma <= t is exp(ceil(ln(3 / t) / h) h)
    for target in (0.05, 0.5, 2.0, 7.0):
        curve = acc.EpsilonCurve(lambda s: (3.0 / s, None))
        point = curve.calibrate(target)
        assert point.sigma == math.exp(math.ceil(math.log(3.0 / target) / h) * h) and point.in_window
        # doubling steps out from σ = 1 to the bracket, then bisection down to adjacent lattice points
        assert point.evaluations == curve.evaluations <= 2 * math.log2(abs(math.log(point.sigma)) / h / 64 + 1) + 10
    # on a shared curve a second target reads the points it shares with the first, and is what it is alone
    curve = acc.EpsilonCurve(lambda s: (3.0 / s, None))
    curve.calibrate(0.5)
    alone = acc.EpsilonCurve(lambda s: (3.0 / s, None)).calibrate(0.6)
    assert curve.calibrate(0.6)._replace(evaluations=0) == alone._replace(evaluations=0)
    assert curve.calibrate(0.6).evaluations == 0
    # steep (epsilon ~ sigma^-40: one lattice step moves epsilon 1 %): halved steps land in the window
    steep = acc.EpsilonCurve(lambda s: (s**-40.0, None)).calibrate(0.5)
    assert 0.999 * 0.5 <= steep.epsilon <= 0.5 and steep.in_window
    assert not (math.log(steep.sigma) / h).is_integer()
    # a step function: the closest private point within 2^-10 of a lattice step, flagged
    jump = acc.EpsilonCurve(lambda s: (2.0 if s < 1.0 else 0.5, None)).calibrate(1.0)
    assert jump.epsilon == 0.5 and 1.0 <= jump.sigma <= math.exp(h / 2**9) and not jump.in_window
    with pytest.raises(UserError, match="unreachable"):
        acc.EpsilonCurve(lambda s: (1.0 + 1.0 / s, None)).calibrate(0.5)
    with pytest.raises(UserError, match="too loose"):
        acc.EpsilonCurve(lambda s: (1.0 / s, None)).calibrate(1e6)
    with pytest.raises(RuntimeError, match="NaN"):
        acc.EpsilonCurve(lambda s: (math.nan, None)).calibrate(1.0)
    with pytest.raises(RuntimeError, match="converge in 3"):
        acc.EpsilonCurve(lambda s: (3.0 / s, None), max_evaluations=3).calibrate(0.5)
    # the evaluation budget is per target: a curve serves any number of targets (an ε axis, a selection's search)
    shared = acc.EpsilonCurve(lambda s: (3.0 / s, None), max_evaluations=40)
    targets = np.geomspace(0.05, 7.0, 25)
    assert [shared.calibrate(t).sigma for t in targets] == [
        acc.EpsilonCurve(lambda s: (3.0 / s, None)).calibrate(t).sigma for t in targets]
    assert shared.evaluations > 40
    with pytest.raises(UserError, match="sigma_min"):
        acc.EpsilonCurve(lambda s: (1.0 / s, None), sigma_min=2.0, sigma_max=1.0)


def test_calibrate_is_the_lattice_search_on_a_curve_of_its_own():
    """`calibrate` (every mechanism but DP-SGD's shared curves) answers what `EpsilonCurve` answers: the smallest
    lattice σ whose ε meets the target, whatever the start."""
    h = acc.LATTICE_STEP
    for target in (0.05, 0.5, 2.0):
        calls = []

        def eps(sigma):
            calls.append(sigma)
            return 3.0 / sigma

        point = acc.calibrate(eps, target)
        assert point.sigma == math.exp(math.ceil(math.log(3.0 / target) / h) * h) and point.epsilon == 3.0 / point.sigma
        assert point.evaluations == len(calls) and point.in_window
        for guess in (1e-2, 3.0 / target, 1e5):
            assert acc.calibrate(eps, target, sigma_guess=guess).sigma == point.sigma


def test_calibrate_errors():
    with pytest.raises(UserError, match="unreachable"):
        acc.calibrate(lambda s: 1.0 + 1.0 / s, 0.5)  # epsilon never below 1
    with pytest.raises(UserError, match="too loose"):
        acc.calibrate(lambda s: 1.0 / s, 1e6)  # sigma < 1e-2 would do
    # a step function jumps over the window: the closest private point, flagged
    step = acc.calibrate(lambda s: 2.0 if s < 1.0 else 0.5, 1.0)
    assert step.epsilon == 0.5 and 1.0 <= step.sigma <= 1.0 + 1e-5 and not step.in_window
    with pytest.raises(UserError, match="target_epsilon"):
        acc.calibrate(lambda s: 1.0 / s, -1.0)


# ------------------------------------------------------------------------------------------
# Input validation: UserError, one line, naming parameter, value and range
# ------------------------------------------------------------------------------------------

INVALID_CALLS = [
    (lambda: acc.calibrate_sigma(0.0, 1e-5, 0.01, 100), "target_epsilon", "0.0"),
    (lambda: acc.calibrate_sigma(-1.0, 1e-5, 0.01, 100), "target_epsilon", "-1.0"),
    (lambda: acc.calibrate_sigma(float("nan"), 1e-5, 0.01, 100), "target_epsilon", "nan"),
    (lambda: acc.calibrate_sigma(1.0, 0.0, 0.01, 100), "delta", "(0, 1)"),
    (lambda: acc.calibrate_sigma(1.0, 1.0, 0.01, 100), "delta", "1.0"),
    (lambda: acc.calibrate_sigma(1.0, 1e-5, 0.0, 100), "sample_rate", "(0, 1]"),
    (lambda: acc.calibrate_sigma(1.0, 1e-5, 1.5, 100), "sample_rate", "1.5"),
    (lambda: acc.calibrate_sigma(1.0, 1e-5, 0.01, 0), "steps", ">= 1"),
    (lambda: acc.calibrate_sigma(1.0, 1e-5, 0.01, 2.5), "steps", "2.5"),
    (lambda: acc.calibrate_sigma(1.0, 1e-5, 0.01, 100, "moments"), "accountant", "moments"),
    (lambda: acc.dpsgd_epsilon(0.0, 0.01, 100, 1e-5), "sigma", "[0.001, 1e+06]"),
    (lambda: acc.dpsgd_epsilon(1.0, 0.01, 100, 2.0), "delta", "2.0"),
    (lambda: acc.dpsgd_event(-1.0, 0.01, 100), "noise_multiplier", "-1.0"),
    (lambda: acc.epsilon_for(acc.dpsgd_event(1.0, 0.1, 1), 1e-5, "gdp"), "accountant", "gdp"),
    (lambda: mech.laplace_scale(1.0, 0.0), "epsilon", "(0, inf)"),
    (lambda: mech.laplace_scale(-1.0, 1.0), "sensitivity", "-1.0"),
    (lambda: mech.gaussian_sigma(1.0, 0.5, 0.0), "delta", "(0, 1)"),
    (lambda: mech.gaussian_sigma(1.0, 1.5, 1e-5), "epsilon", "(0, 1)"),
    (lambda: mech.amplify_by_subsampling(1.0, 0.0), "q", "(0, 1]"),
    (lambda: mech.amplify_by_subsampling(-1.0, 0.5), "epsilon", "-1.0"),
    (lambda: mech.amplify_by_subsampling(2.0, 0.5, tight=False), "epsilon", "(0, 1]"),
    (lambda: mech.basic_composition(1.0, 0.0, 0), "k", ">= 1"),
    (lambda: mech.advanced_composition(1.0, 0.0, 10, 0.0), "delta_prime", "(0, 1)"),
    (lambda: mech.advanced_composition_epsilon_per_step(1.0, 1e-5, 10, 1e-4), "delta_prime", "1e-05"),
    (lambda: mech.gamma_norm_noise(np.random.default_rng(0), 0.0, 3), "alpha", "(0, inf)"),
    (lambda: mech.gamma_norm_noise(np.random.default_rng(0), 1.0, 0), "d", ">= 1"),
    (lambda: mech.laplace_noise(np.random.default_rng(0), -2.0), "scale", "-2.0"),
    (lambda: mech.gaussian_noise(np.random.default_rng(0), 0.0), "sigma", "(0, inf)"),
]


@pytest.mark.parametrize("call,name,fragment", INVALID_CALLS)
def test_invalid_inputs_raise_user_error_naming_the_parameter(call, name, fragment):
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert message.startswith(name + " ") or f"{name}=" in message
    assert fragment in message
    assert "\n" not in message


# ------------------------------------------------------------------------------------------
# Closed forms
# ------------------------------------------------------------------------------------------


def test_laplace_scale_by_hand():
    assert mech.laplace_scale(2.0, 0.5) == 4.0
    assert mech.laplace_scale(1.0, 0.1) == pytest.approx(10.0)


def test_gaussian_sigma_by_hand():
    # Delta = 1, eps = 0.5, delta = 1e-5: ln(1.25e5) = ln 1.25 + 5 ln 10 = 11.7360690;
    # sqrt(2 * 11.7360690) = 4.8448053; / 0.5 = 9.6896105.
    assert mech.gaussian_sigma(1.0, 0.5, 1e-5) == pytest.approx(9.6896105, rel=1e-7)
    assert mech.gaussian_sigma(2.0, 0.5, 1e-5) == pytest.approx(2 * 9.6896105, rel=1e-7)
    assert mech.gaussian_sigma_valid(0.99) and not mech.gaussian_sigma_valid(1.0)
    assert not mech.gaussian_sigma_valid(0.0)
    # Outside the theorem only on explicit request, and unclamped.
    assert mech.gaussian_sigma(1.0, 2.0, 1e-5, strict=False) == pytest.approx(4.8448053 / 2, rel=1e-7)


@pytest.mark.parametrize("epsilon,delta", [(0.1, 1e-5), (0.5, 1e-6), (0.9, 1e-3), (3.0, 1e-5)])
def test_analytic_gaussian_sigma_is_exact_and_tighter(epsilon, delta):
    sigma = mech.analytic_gaussian_sigma(1.0, epsilon, delta)
    # Balle & Wang 2018 Thm 8: delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s).
    achieved = stats.norm.cdf(0.5 / sigma - epsilon * sigma) - math.exp(epsilon) * stats.norm.cdf(
        -0.5 / sigma - epsilon * sigma
    )
    assert achieved == pytest.approx(delta, rel=1e-6)
    if mech.gaussian_sigma_valid(epsilon):
        assert sigma < mech.gaussian_sigma(1.0, epsilon, delta)
    assert mech.analytic_gaussian_sigma(3.0, epsilon, delta) == pytest.approx(3 * sigma)


def test_amplification_by_hand():
    # ln(1 + 0.01 (e - 1)) = ln(1.0171828) = 0.0170369
    eps, delta = mech.amplify_by_subsampling(1.0, 0.01, 1e-5)
    assert eps == pytest.approx(0.0170369, rel=1e-5)
    assert delta == pytest.approx(1e-7)
    assert mech.amplify_by_subsampling(1.0, 0.01, 1e-5, tight=False) == pytest.approx((0.02, 1e-7))
    assert mech.amplify_by_subsampling(0.7, 1.0) == pytest.approx((0.7, 0.0))  # q = 1: no change
    # Why 2 q eps is restricted to eps <= 1: it is not an upper bound for larger eps.
    assert mech.amplify_by_subsampling(3.0, 0.1)[0] > 2 * 0.1 * 3.0


@settings(max_examples=300, deadline=None)
@given(
    epsilon=st.floats(min_value=1e-6, max_value=1.0),
    q=st.floats(min_value=1e-6, max_value=1.0),
)
def test_tight_amplification_below_2q_eps_and_tends_to_q_eps(epsilon, q):
    tight, _ = mech.amplify_by_subsampling(epsilon, q)
    approx, _ = mech.amplify_by_subsampling(epsilon, q, tight=False)
    assert tight <= approx
    assert tight <= epsilon * (1 + 1e-12)  # amplification never hurts
    # tight = q eps (1 + O(eps)): ln(1 + q(e^eps - 1)) / (q eps) is in [1 - q eps/2, 1 + eps].
    ratio = tight / (q * epsilon)
    assert 1 - q * epsilon / 2 - 1e-12 <= ratio <= 1 + epsilon


def test_amplification_limit_small_epsilon():
    for q in (0.5, 0.01):
        assert mech.amplify_by_subsampling(1e-8, q)[0] / (q * 1e-8) == pytest.approx(1.0, abs=1e-7)


def test_basic_composition():
    assert mech.basic_composition(0.1, 1e-6, 10) == pytest.approx((1.0, 1e-5))
    assert mech.basic_composition(0.5, 0.0, 1) == (0.5, 0.0)


def test_advanced_composition_by_hand():
    # eps = 0.1, delta = 1e-6, k = 100, delta' = 1e-5:
    # 0.1 sqrt(200 ln 1e5) = 0.1 sqrt(2302.585093) = 4.7985259; 100 * 0.1 * (e^0.1 - 1) = 1.0517092.
    eps, delta = mech.advanced_composition(0.1, 1e-6, 100, 1e-5)
    assert eps == pytest.approx(4.7985259 + 1.0517092, rel=1e-7)
    assert delta == pytest.approx(1.1e-4)
    # For large k it beats basic composition (10.0 here).
    assert eps < mech.basic_composition(0.1, 1e-6, 100)[0]


@settings(max_examples=200, deadline=None)
@given(
    total_epsilon=st.floats(min_value=1e-3, max_value=50.0),
    total_delta=st.floats(min_value=1e-12, max_value=0.1),
    k=st.integers(min_value=1, max_value=100_000),
    split=st.floats(min_value=0.01, max_value=1.0),
)
def test_advanced_composition_inverse_round_trips(total_epsilon, total_delta, k, split):
    delta_prime = split * total_delta
    eps, delta = mech.advanced_composition_epsilon_per_step(total_epsilon, total_delta, k, delta_prime)
    assert eps > 0 and delta >= 0
    back_eps, back_delta = mech.advanced_composition(eps, delta, k, delta_prime)
    assert back_eps == pytest.approx(total_epsilon, rel=1e-10)
    assert back_delta == pytest.approx(total_delta, rel=1e-10)


def test_advanced_composition_inverse_defaults_and_monotone():
    eps, delta = mech.advanced_composition_epsilon_per_step(1.0, 1e-5, 100)
    assert delta == pytest.approx(5e-8)  # delta' = 1e-5 / 2 by default; (1e-5 - 5e-6) / 100
    assert mech.advanced_composition(eps, delta, 100, 5e-6) == pytest.approx((1.0, 1e-5))
    per_step = [mech.advanced_composition_epsilon_per_step(e, 1e-5, 100)[0] for e in (0.5, 1, 2)]
    assert per_step[0] < per_step[1] < per_step[2]


# ------------------------------------------------------------------------------------------
# Samplers (fixed seeds; each test also shows that a wrong distribution is rejected)
# ------------------------------------------------------------------------------------------

N = 200_000


def test_laplace_noise_distribution():
    rng = np.random.default_rng(20240601)
    scale = mech.laplace_scale(1.0, 0.5)
    x = mech.laplace_noise(rng, scale, N)
    assert x.shape == (N,)
    assert stats.kstest(x, stats.laplace(scale=scale).cdf).pvalue > 1e-3
    assert stats.kstest(x, stats.laplace(scale=1.1 * scale).cdf).pvalue < 1e-6
    assert mech.laplace_noise(rng, 1.0, (3, 4)).shape == (3, 4)


def test_gaussian_noise_distribution():
    rng = np.random.default_rng(20240602)
    sigma = 2.5
    x = mech.gaussian_noise(rng, sigma, N)
    assert stats.kstest(x, stats.norm(scale=sigma).cdf).pvalue > 1e-3
    assert stats.kstest(x, stats.norm(scale=1.1 * sigma).cdf).pvalue < 1e-6
    assert mech.gaussian_noise(rng, 1.0, (2, 5)).shape == (2, 5)


@pytest.mark.parametrize("alpha,d", [(2.0, 5), (0.5, 20)])
def test_gamma_norm_noise_distribution(alpha, d):
    rng = np.random.default_rng(20240603 + d)
    z = mech.gamma_norm_noise(rng, alpha, d, N)
    assert z.shape == (N, d)
    norms = np.linalg.norm(z, axis=1)
    # Norm ~ Gamma(d, 2/alpha): mean 2d/alpha, sd sqrt(d) 2/alpha.
    standard_error = math.sqrt(d) * (2 / alpha) / math.sqrt(N)
    assert abs(norms.mean() - 2 * d / alpha) < 4 * standard_error
    assert stats.kstest(norms, stats.gamma(a=d, scale=2 / alpha).cdf).pvalue > 1e-3
    assert stats.kstest(norms, stats.gamma(a=d, scale=2.2 / alpha).cdf).pvalue < 1e-6
    assert stats.kstest(norms, stats.gamma(a=d + 1, scale=2 / alpha).cdf).pvalue < 1e-6
    # Direction uniform on the sphere: mean 0, covariance I/d, one coordinate's marginal is
    # (u + 1)/2 ~ Beta((d-1)/2, (d-1)/2).
    u = z / norms[:, None]
    assert np.all(np.abs(u.mean(axis=0)) < 4 * math.sqrt(1 / d / N))
    assert np.allclose(np.cov(u, rowvar=False), np.eye(d) / d, atol=0.01 / d * 5)
    half = (d - 1) / 2
    assert stats.kstest((u[:, 0] + 1) / 2, stats.beta(half, half).cdf).pvalue > 1e-3
    assert stats.kstest((u[:, 0] + 1) / 2, stats.beta(half + 1, half + 1).cdf).pvalue < 1e-6
    # Norm and direction independent.
    assert abs(np.corrcoef(norms, np.abs(u[:, 0]))[0, 1]) < 4 / math.sqrt(N)


def test_gamma_norm_noise_in_one_dimension_is_laplace():
    """Density exp(-(alpha/2)|z|) on R is Laplace with scale 2/alpha."""
    rng = np.random.default_rng(20240604)
    z = mech.gamma_norm_noise(rng, 4.0, 1, N)[:, 0]
    assert stats.kstest(z, stats.laplace(scale=0.5).cdf).pvalue > 1e-3
    assert stats.kstest(z, stats.laplace(scale=0.55).cdf).pvalue < 1e-6


def test_gamma_norm_noise_shapes():
    rng = np.random.default_rng(0)
    assert mech.gamma_norm_noise(rng, 1.0, 3).shape == (3,)
    assert mech.gamma_norm_noise(rng, 1.0, 3, 7).shape == (7, 3)
    assert mech.gamma_norm_noise(rng, 1.0, 3, (2, 4)).shape == (2, 4, 3)


@pytest.mark.parametrize("d", [1, 9, 104])
def test_gamma_norm_noise_draws_the_numbers_of_its_definition(d):
    """Norm ~ Gamma(d, 2/α) times a normalised Gaussian direction, drawn in that order, ‖·‖ as np.linalg.norm:
    the same bits as written out here (song2013's runs must not change with the sampler's speed-ups)."""
    got = mech.gamma_norm_noise(np.random.default_rng(7), 0.37, d, (5, 64))
    rng = np.random.default_rng(7)
    norms = rng.gamma(shape=float(d), scale=2.0 / 0.37, size=(5, 64))
    directions = rng.standard_normal((5, 64, d))
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
    np.testing.assert_array_equal(got, norms[..., None] * directions)
    np.testing.assert_array_equal(mech.gamma_norm_draws(np.random.default_rng(7), 2.0 / 0.37, d, (5, 64)), got)


def _library_pld_epsilon(sigma, q, steps, delta, relation, h=1e-4):
    """ε of DP-SGD by a fresh dp-accounting PLD accountant at a fixed fine discretisation (pessimistic)."""
    accountant = PLDAccountant(relation, value_discretization_interval=h)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("target", [0.5, 1.0, 3.0])
def test_dpsgd_calibrated_under_replace_one_meets_the_target_by_the_library(target, monkeypatch):
    monkeypatch.setenv(acc.CACHE_DIR_ENV, "off")
    q, steps, delta = ADULT_Q, 589, ADULT_DELTA
    cal = acc.calibrate_sigma(target, delta, q, steps, "pld", "replace_one")
    assert cal.neighbours == "replace_one" and 0.999 * target <= cal.epsilon <= target
    replace = dp_accounting.NeighboringRelation.REPLACE_ONE
    assert _library_pld_epsilon(cal.sigma, q, steps, delta, replace) == pytest.approx(cal.epsilon, rel=2e-3)
    # the same σ is tighter under add/remove, and the add/remove σ is not private enough under replace-one
    add_remove = acc.calibrate_sigma(target, delta, q, steps, "pld")
    assert add_remove.sigma < cal.sigma
    assert acc.dpsgd_epsilon(add_remove.sigma, q, steps, delta, "pld", "replace_one") > 1.05 * target


def test_the_add_remove_calibration_read_under_replace_one(monkeypatch):
    """Reference numbers (adult, B = 256, 5 epochs, δ = 1/n², PLD): σ calibrated to ε = 1 / 3 under add/remove is
    ε = 1.66 / 3.52 under replace-one."""
    monkeypatch.setenv(acc.CACHE_DIR_ENV, "off")
    q, steps, delta = ADULT_Q, 589, ADULT_DELTA
    for target, replace_one in ((1.0, 1.66), (3.0, 3.52)):
        sigma = acc.calibrate_sigma(target, delta, q, steps, "pld").sigma
        assert acc.dpsgd_epsilon(sigma, q, steps, delta, "pld", "replace_one") == pytest.approx(replace_one, abs=0.01)


def test_rdp_refuses_replace_one_for_poisson_subsampling():
    with pytest.raises(UserError, match="use accountant: pld"):
        acc.calibrate_sigma(1.0, 1e-5, 0.01, 100, "rdp", "replace_one")
    with pytest.raises(UserError, match="use accountant: pld"):
        acc.dpsgd_epsilon(1.0, 0.01, 100, 1e-5, "rdp", "replace_one")
    with pytest.raises(UserError, match="neighbours must be one of"):
        acc.calibrate_sigma(1.0, 1e-5, 0.01, 100, "pld", "swap")
