"""dpsgd_cli.privacy.rdp computes dp-accounting's RDP of the Poisson-subsampled Gaussian and its RDP -> (ε, δ)
conversion term for term: every number here must equal the library's bit for bit (==, not approx)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from calibration_checks import assert_lattice_point
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp import rdp_privacy_accountant as lib

from dpsgd_cli.privacy import accounting as acc
from dpsgd_cli.privacy import rdp

ADULT_Q, ADULT_T, ADULT_DELTA = 256 / 30162, 589, 1 / 30162**2
# fractional, small and large integer orders (every 4th order above 64: the library takes ~2 µs a term)
ORDERS = np.array(acc.RDP_BASE_ORDERS + tuple(a for a in acc.RDP_EXTENSION_ORDERS[::4] if a <= 4096) + (4096.0,))


def _same(a, b) -> bool:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("q", [1e-5, ADULT_Q, 0.05, 0.5, 0.9, 0.999, 1.0])
def test_rdp_per_order_equals_library_bit_for_bit(q):
    for sigma in [0.3, 0.8, 1.0, 2.5, 30.0, 700.0]:
        ours = rdp.subsampled_gaussian_rdp(q, sigma, ORDERS)
        theirs = lib._compute_rdp_poisson_subsampled_gaussian(q, sigma, ORDERS)
        assert _same(ours, theirs), (q, sigma, ORDERS[np.flatnonzero(ours != theirs)][:5])


def test_rdp_fractional_order_that_does_not_converge_is_inf_as_in_library():
    # q = 0.9, σ = 1, α = 1.35: the library's series has not converged after 1000 terms and drops the order
    assert lib._compute_log_a_frac(0.9, 1.0, 1.35) == np.inf
    assert rdp.subsampled_gaussian_rdp(0.9, 1.0, [1.35, 2.0])[0] == np.inf
    assert np.isfinite(rdp.subsampled_gaussian_rdp(0.9, 1.0, [1.35, 2.0])[1])


def test_conversion_equals_library_per_order_in_every_branch():
    orders = np.array([1.005, 1.01, 1.02, 1.5, 2.0, 7.0, 64.0, 1500.0])
    for delta in [1e-12, 1e-5, 0.3, 0.7]:
        for r in [-1e-3, 0.0, 1e-30, 0.5 * delta**2, 3 * delta**2, 5 * delta**2, 1e-9, 0.02, 1.5, 40.0, np.inf]:
            values = np.full(orders.shape, r)
            ours = rdp.epsilon_at_orders(orders, values, delta)
            theirs = [lib.compute_epsilon([a], [r], delta)[0] for a in orders]  # max(0, .) of one order
            assert _same(np.maximum(0.0, ours), theirs), (delta, r, ours, theirs)


CASES = list(itertools.product([0.45, 0.9, 3.0, 40.0], [1e-4, ADULT_Q, 0.2, 1.0], [1, 589, 20000], [1e-5, ADULT_DELTA]))


def library_walk(event, delta):
    """(ε, order) by dp-accounting alone: its accountant over the base grid, then one accountant per larger order
    while ε decreases, stopping after two orders that do not improve it."""
    accountant = RdpAccountant(list(acc.RDP_BASE_ORDERS))
    accountant.compose(event)
    eps, order = (float(v) for v in accountant.get_epsilon_and_optimal_order(delta))
    if order != acc.RDP_BASE_ORDERS[-1] or not np.isfinite(eps):
        return eps, order
    worse = 0
    for alpha in acc.RDP_EXTENSION_ORDERS:
        single = RdpAccountant([alpha])
        single.compose(event)
        e = float(single.get_epsilon(delta))
        if e < eps:
            eps, order, worse = e, alpha, 0
        else:
            worse += 1
            if worse >= 2:
                break
    return eps, order


@pytest.mark.parametrize("sigma,q,steps,delta", CASES[::3] + [(100.0, ADULT_Q, ADULT_T, ADULT_DELTA)])
def test_dpsgd_epsilon_and_order_equals_library_walk_bit_for_bit(sigma, q, steps, delta):
    """The same (ε, order) as the library accountant over the base grid and the order-by-order walk above it
    (`library_walk`, dp-accounting alone), including walks to α ~ 2,500; and the same through the accounting
    path for any event (the library's RDP, converted and walked here)."""
    event = acc.dpsgd_event(sigma, q, steps)
    theirs = library_walk(event, delta)
    assert acc.rdp_epsilon_and_order(event, delta) == theirs
    ours = acc.dpsgd_rdp_epsilon(sigma, q, steps, delta)
    assert ours == theirs
    for block in (1, 3):  # the walk reads its blocks order by order: where it stops does not depend on the block
        assert rdp.dpsgd_epsilon_and_order(sigma, q, steps, delta, acc.RDP_BASE_ORDERS, acc.RDP_EXTENSION_ORDERS,
                                           block=block) == ours


@pytest.mark.parametrize("q", [1e-4, ADULT_Q, 0.05, 0.3])
def test_integer_sum_cut_where_later_terms_add_nothing_is_exact(q):
    """`_last_counted_term` drops the tail of the binomial sum; the sum must equal the full left-to-right sum bit for
    bit, and the cut must happen (else the test proves nothing): large orders at large σ, the extension walk."""
    orders = np.array([2, 7, 64, 67, 300, 1024, 2485, 5000, 32768], dtype=np.int64)
    cut_somewhere = False
    for sigma in [0.6, 3.0, 12.0, 30.0, 100.0, 700.0]:
        cut = rdp._last_counted_term(q, sigma, orders)
        assert np.all((cut >= 0) & (cut <= orders))
        cut_somewhere |= bool(np.any(cut < orders))
        for a, j in zip(orders, cut):
            i = np.arange(a + 1)
            terms = rdp._int_terms(q, sigma, np.full(i.shape, a), i)
            full = np.logaddexp.accumulate(terms)
            assert full[j] == full[-1], (q, sigma, a, j)  # nothing after the cut moved the sum
            if j < a:
                assert terms[j + 1:].max() < full[j] - 745.2  # each dropped term underflows against the sum
        assert np.array_equal(rdp._log_a_int(q, sigma, orders.astype(float)),
                              [np.logaddexp.reduce(rdp._int_terms(q, sigma, np.full(a + 1, a), np.arange(a + 1)))
                               for a in orders])
    assert cut_somewhere


def test_integer_sum_cut_where_later_terms_are_below_half_an_ulp_is_exact(monkeypatch):
    """`_log_a_int` sums up to a term far enough below the running sum s > 0 that every later term adds under half
    an ulp of s: bit for bit the full sum. Tried at terms only 5 below the largest (so the ulp test decides, not
    the margin of the default 60), on random settings; with a margin 25 nats short of the proof, sums differ."""
    rng = np.random.default_rng(11)
    settings = [(float(10 ** rng.uniform(-5, -0.3)), float(10 ** rng.uniform(0.5, 2.5))) for _ in range(150)]
    orders = np.array([128, 129, 300, 1024, 2485, 5000], dtype=np.int64)

    def mismatches() -> tuple[int, int]:
        bad = shortened = 0
        for q, sigma in settings:
            shortened += int(np.sum(rdp._last_counted_term(q, sigma, orders, rdp._ULP_TRY) < orders))
            got = rdp._log_a_int(q, sigma, orders.astype(float))
            full = [np.logaddexp.reduce(rdp._int_terms(q, sigma, np.full(a + 1, a), np.arange(a + 1))) for a in orders]
            bad += int(np.sum(got != np.array(full)))
        return bad, shortened

    monkeypatch.setattr(rdp, "_ULP_TRY", 5.0)
    bad, shortened = mismatches()
    assert bad == 0 and shortened > 300, (bad, shortened)
    monkeypatch.setattr(rdp, "_ULP_NATS", rdp._ULP_NATS - 25.0)
    assert mismatches()[0] > 0  # the check above can fail


def test_integer_sum_cut_is_not_applied_where_terms_need_not_be_concave():
    # α + 2 > 4σ²: the terms may rise again after a dip, so nothing is dropped
    assert np.array_equal(rdp._last_counted_term(ADULT_Q, 3.0, np.array([40, 500, 2485])), [40, 500, 2485])


@pytest.mark.parametrize("delta", [1e-5, ADULT_DELTA, 0.3, 0.7])
def test_fractional_orders_skipped_by_the_bound_never_hold_the_minimum(delta):
    """`_dpsgd_epsilons` leaves out fractional orders whose lower bound (RDP of the order below + conversion) exceeds
    the minimum: the minimum and its order must be those of every order computed, and orders must be skipped."""
    orders = np.array(acc.RDP_BASE_ORDERS)
    skipped = 0
    for q, sigma, steps in itertools.product([1e-3, ADULT_Q, 0.1, 0.9], [0.4, 0.7, 1.0, 2.0, 8.0, 60.0],
                                             [1, ADULT_T, 20000]):
        every = rdp.epsilon_at_orders(orders, steps * rdp.subsampled_gaussian_rdp(q, sigma, orders), delta)
        some = rdp._dpsgd_epsilons(q, sigma, steps, delta, orders)
        assert rdp._best(orders, some) == rdp._best(orders, every), (q, sigma, steps)
        kept = np.isfinite(some)
        assert np.array_equal(some[kept], every[kept])
        skipped += int((~kept & np.isfinite(every)).sum())
    assert skipped > 1000 if delta <= 0.5 else skipped == 0  # above 1/2 every order may be clamped to 0: none skipped
    shuffled = np.random.default_rng(0).permutation(orders)  # "the order below" needs ascending orders: none skipped
    assert np.array_equal(rdp._dpsgd_epsilons(ADULT_Q, 1.0, ADULT_T, delta, shuffled),
                          rdp.epsilon_at_orders(shuffled, ADULT_T * rdp.subsampled_gaussian_rdp(ADULT_Q, 1.0, shuffled),
                                                delta))


def test_walk_stops_after_two_orders_that_do_not_improve(monkeypatch):
    """A curve with a bump: the walk stops at the first two non-improving orders, as the library walk does."""
    def fake_rdp(q, sigma, orders):
        a = np.asarray(orders, dtype=float)
        # decreasing epsilon over the base grid (optimum at its top), then a bump at 70-80 and a deeper dip later
        bump = np.where((a > 66) & (a < 80), 1.0, 0.0) - np.where(a > 1000, 5.0, 0.0)
        return 10.0 / a + bump

    base, ext = (2.0, 64.0), tuple(float(x) for x in (67, 70, 75, 85, 2000))
    monkeypatch.setattr(rdp, "subsampled_gaussian_rdp", fake_rdp)
    eps, order = rdp.dpsgd_epsilon_and_order(1.0, 0.5, 1, 0.1, base, ext, block=8)
    assert order == 64.0  # 67 and 70 sit on the bump: two non-improvements end the walk before 2000
    assert eps == pytest.approx(max(0.0, 10.0 / 64 + np.log1p(-1 / 64) - np.log(0.1 * 64) / 63))


def test_rdp_calibration_does_not_import_dp_accounting():
    """The ~1 s import of dp-accounting is paid only by PLD and other events, not by an RDP calibration."""
    code = ("import sys; from dpsgd_cli.privacy.accounting import calibrate_sigma, dpsgd_epsilon; "
            f"c = calibrate_sigma(1.0, {ADULT_DELTA!r}, {ADULT_Q!r}, {ADULT_T}); dpsgd_epsilon(c.sigma, {ADULT_Q!r}, "
            f"{ADULT_T}, {ADULT_DELTA!r}); assert 'dp_accounting' not in sys.modules, 'imported'; print(c.sigma)")
    env = dict(os.environ, DPSGD_CACHE_DIR="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout) == acc.calibrate_sigma(1.0, ADULT_DELTA, ADULT_Q, ADULT_T).sigma


def _random_settings(n: int, seed: int):
    """(q, T, δ, σ) across DP-SGD's range, large q and small σ included (where fractional orders misbehave)."""
    rng = np.random.default_rng(seed)
    return [(10 ** rng.uniform(-4, -0.3), int(10 ** rng.uniform(0, 5)), 10 ** rng.uniform(-12, -3),
             10 ** rng.uniform(-0.4, 2.5)) for _ in range(n)]


def _exact_log_a(q: float, sigma: float, alpha: float) -> float:
    """log A_α by quadrature of E_{z ~ N(0, σ²)}[((1 - q) + q e^((2z - 1)/(2σ²)))^α] (Mironov et al. 2019, §3.3),
    independent of both series."""
    from scipy import integrate

    def integrand(z):  # in logs: the ratio's power overflows where the density underflows
        log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
        return math.exp(-z * z / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi)) + alpha * log_ratio)

    z0 = sigma**2 * math.log(1 / q - 1) + 0.5  # where the two parts of the mixture cross
    cuts = sorted({-40 * sigma, min(z0, alpha), max(z0, alpha), max(z0, alpha) + 40 * sigma})  # α: the shifted mode
    parts = [integrate.quad(integrand, lo, hi, epsabs=0, epsrel=1e-13, limit=400)[0] for lo, hi in zip(cuts, cuts[1:])]
    return math.log(sum(parts))


def test_fractional_series_bounds_the_exact_a_alpha_from_above():
    """The library's fractional series adds |C(α, i)|·(...): never below the exact A_α (by quadrature), so the
    RDP it gives is an upper bound; and strictly above it where the negative coefficients matter."""
    checked = 0
    for q, sigma, alpha in itertools.product([1e-3, ADULT_Q, 0.1, 0.5], [0.5, 0.96, 2.0, 8.0], [1.05, 1.5, 3.25, 8.3]):
        log_a, _ = rdp._log_a_frac(q, sigma, np.array([alpha]))
        if not np.isfinite(log_a[0]):
            continue
        assert math.exp(log_a[0]) >= math.exp(_exact_log_a(q, sigma, alpha)) * (1 - 1e-9), (q, sigma, alpha)
        checked += 1
    assert checked > 50
    log_a, _ = rdp._log_a_frac(0.5, 0.5, np.array([1.5]))  # q = 0.5, σ = 0.5, α = 1.5
    assert math.exp(log_a[0]) > math.exp(_exact_log_a(0.5, 0.5, 1.5)) * (1 + 1e-6)


def test_fractional_series_do_not_depend_on_their_chunk():
    """The terms are computed a chunk at a time; the sums are the same bit for bit whatever the first chunk."""
    alphas = np.array(acc.RDP_BASE_ORDERS[:200:7])
    for q, sigma in itertools.product([1e-4, ADULT_Q, 0.3], [0.5, 0.96, 3.0]):
        results = [rdp._log_a_frac(q, sigma, alphas, chunk) for chunk in (3, 16, 64, 1000)]
        for log_a, used in results[1:]:
            assert _same(log_a, results[0][0]) and used == results[0][1]
        assert 0 < results[0][1] < 1000


def test_conversion_terms_are_libms_order_by_order():
    """`_conversion_terms` (NumPy arithmetic, logs by math) equals the library's per-order expressions bit for bit."""
    rng = np.random.default_rng(9)
    for delta in (1e-12, ADULT_DELTA, 1e-5, 0.4):
        orders = tuple(np.concatenate(([0.5, 1.0, 1.005, 1.01], rng.uniform(1.0, 5000.0, 300), acc.RDP_ORDERS)))
        log1p_inv, log_term = rdp._conversion_terms(orders, delta)
        assert _same(log1p_inv, [math.log1p(-1 / a) if a > 1.01 else 0.0 for a in orders])
        assert _same(log_term, [math.log(delta * a) / (a - 1) if a > 1.01 else 0.0 for a in orders])


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibrated_sigma_is_the_reference_lattice_point(accountant, monkeypatch):
    """502 targets (480 RDP over q, T, δ, ε; 22 PLD under both relations), their σ recorded by an independent
    estimate-and-proof search: the plain lattice search over the exact accountant returns the smallest lattice point
    meeting each target, the recorded one (or its neighbour, where ε sits within an ulp of the target)."""
    monkeypatch.setenv(acc.CACHE_DIR_ENV, "off")
    rows = json.loads((Path(__file__).parent / "data" / "sigma_lattice_reference.json").read_text())
    rows = [r for r in rows if r[4] == accountant]
    assert len(rows) >= (480 if accountant == "rdp" else 22)
    for target, delta, q, steps, name, neighbours, sigma, _ in rows:
        setting = (target, delta, q, steps, name, neighbours)
        cal = acc.calibrate_sigma.__wrapped__(*setting)
        assert_lattice_point(cal.sigma, cal.epsilon, target, acc.dpsgd_curve(*setting[1:]), sigma, setting)
