"""Rényi DP of the Poisson-subsampled Gaussian (Mironov, Talwar & Zhang 2019, §3.3) and its (ε, δ) conversion (Balle
et al. 2020, Prop. 12), dp-accounting's terms summed in its order, so bit for bit its numbers (docs/accounting.md)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from dpsgd_cli.lazy import LazyModule

special = LazyModule("scipy.special")

__all__ = ["subsampled_gaussian_rdp", "epsilon_at_orders", "min_over_orders", "dpsgd_epsilon_and_order"]

_FRAC_MAX_TERMS = 1000  # the library's _MAX_STEPS_LOG_A_FRAC: a fractional order not converged by then gets RDP = inf
# terms of the first pass over the fractional orders (at q ~ 0.01, σ < 1 needs 20-60, σ >= 3 6-8)
_FRAC_FIRST_CHUNK = 64


_log_factorials = np.zeros(0)  # log k! = gammaln(k + 1) for k = 0, 1, ...: the values gammaln gives term by term


def _log_factorial_table(n: int) -> np.ndarray:
    global _log_factorials
    if _log_factorials.size <= n:
        _log_factorials = special.gammaln(np.arange(max(n + 1, 2 * _log_factorials.size), dtype=float) + 1)
    return _log_factorials


def _int_terms(q: float, sigma: float, a: np.ndarray, i: np.ndarray) -> np.ndarray:
    """Term i of log A_α's binomial sum (α = a): log C(α, i) + i log q + (α - i) log(1 - q) + (i² - i) / (2σ²)."""
    terms: np.ndarray = _binomial_terms(q, a, i) + (i * i - i) / (2 * (sigma**2))
    return terms


def _binomial_terms(q: float, a: np.ndarray, i: np.ndarray) -> np.ndarray:
    """log C(α, i) + i log q + (α - i) log(1 - q): :func:`_int_terms` before its σ term."""
    log_fact = _log_factorial_table(int(a.max()))
    terms: np.ndarray = (log_fact[a] - log_fact[i] - log_fact[a - i]) + i * math.log(q) + (a - i) * math.log1p(-q)
    return terms


_ABSORBED = 747.0  # a term this far below the running sum adds exactly 0 to it: exp(-745.2) is 0.0 in float64
# a term t below a running sum s > 0 with t - s < log(s) - 54 log 2 - 1 (ln 2^54 = 37.43) adds less than half an
# ulp of s (> s 2^-54), so s + log1p(exp(t - s)) rounds to s; tried first with terms 60 below the largest
_ULP_NATS, _ULP_TRY = 54 * math.log(2.0) + 1.0, 60.0


@functools.cache
def _cut_steps(bits: int) -> np.ndarray:
    return np.array(sorted({round(2.0 ** (m / 2)) for m in range(2 * bits + 2)}), dtype=np.int64)  # 1, 2, 3, 4, 6, ...


def _last_counted_term(q: float, sigma: float, a_int: np.ndarray, below: float = _ABSORBED) -> np.ndarray:
    """Per integer order α, the first index j past which the binomial sum's terms decrease and term j is ``below``
    a term at or before j (α where none is found). Candidates j = ⌊αq⌋ + round(2^(m/2)). For α + 2 <= 4σ² the
    terms are concave in i (their difference f(i) = log((α - i)/(i + 1)) + log(q/(1 - q)) + i/σ² falls by at
    least 4/(α + 2) - 1/σ² a step), so once f(j) < 0 they decrease: with ``below`` = 747 every later term is 747
    below the running sum, where exp underflows to 0.0 and log1p(0) + s == s, so summing up to j gives the same
    result bit for bit (:func:`_log_a_int` checks other cuts)."""
    cut: np.ndarray = a_int.copy()
    # one unit of margin for the rounding of 4σ²; below 128 terms the search costs more than it saves
    concave = (a_int + 3 <= 4 * sigma**2) & (a_int >= 128)
    if not concave.any():
        return cut
    a = a_int[concave][:, None]
    j = np.minimum(a, np.floor(a * q).astype(np.int64) + _cut_steps(int(a.max()).bit_length()))
    terms = _int_terms(q, sigma, a, j)
    running_max = np.maximum.accumulate(np.maximum(terms, _int_terms(q, sigma, a, np.zeros_like(a))), axis=1)
    with np.errstate(divide="ignore"):
        slope = np.log((a - j) / (j + 1.0)) + (math.log(q) - math.log1p(-q)) + j / sigma**2
    ok = (terms < running_max - below) & (slope < -1e-9)
    found = ok.any(axis=1)
    cut[np.flatnonzero(concave)[found]] = j[found, ok[found].argmax(axis=1)]
    return cut


def _summed(q: float, sigma: float, a_int: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per order, the left-to-right log-sum of the binomial sum's terms 0..``last`` and term ``last``."""
    counts = last + 1
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    i = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    terms = _int_terms(q, sigma, np.repeat(a_int, counts), i)
    return np.logaddexp.reduceat(terms, starts), terms[starts + last]


def _log_a_int(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_α for integer orders: log Σ_i C(α, i) q^i (1 - q)^(α - i) exp((i² - i) / (2σ²)), summed left to right
    over the terms that can change the sum: up to a term 60 below the largest where the sum s there is > 0 and
    that term (above every later one, :func:`_last_counted_term`) is more than 54 log 2 + 1 - log s below s, so
    each later term adds under half an ulp; else up to a term 747 below, past which they add exactly 0.0."""
    a_int = alphas.astype(np.int64)
    short = _last_counted_term(q, sigma, a_int, _ULP_TRY)
    log_a, last = _summed(q, sigma, a_int, short)
    with np.errstate(divide="ignore", invalid="ignore"):
        absorbed = (short == a_int) | ((log_a > 0) & (last - log_a < np.log(log_a) - _ULP_NATS))
    if not absorbed.all():
        redo = a_int[~absorbed]
        log_a[~absorbed] = _summed(q, sigma, redo, _last_counted_term(q, sigma, redo))[0]
    return log_a


def _log_a_frac(q: float, sigma: float, alphas: np.ndarray,
                chunk: int = _FRAC_FIRST_CHUNK) -> tuple[np.ndarray, int]:
    """log A_α for fractional orders: the two series of §3.3 (integrals below and above z0), summed term by term
    until both terms decrease and are e^-30 below the total; inf where that takes more than 1,000 terms (the
    series add |C(α, i)|·(...), as the library does). Then the number of terms the slowest converged order took.
    The terms are computed ``chunk`` at a time, then 4 times as many a pass (the sums do not depend on it)."""
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log1mq, scale, var2 = math.log(q), math.log1p(-q), math.sqrt(2) * sigma, 2 * (sigma**2)
    out = np.full(alphas.shape, np.inf)
    rows = np.arange(alphas.size)
    alpha = alphas[:, None]
    log_fact_alpha = special.gammaln(alpha + 1)
    start, width, used = 0, chunk, 0
    a0 = a1 = last0 = last1 = np.full((alphas.size, 1), -np.inf)
    while rows.size and start < _FRAC_MAX_TERMS:
        i = np.arange(start, min(start + width, _FRAC_MAX_TERMS))[None, :]
        j = alpha - i
        log_coef = log_fact_alpha - _log_factorial_table(int(i[0, -1]))[i] - special.gammaln(j + 1)  # log |C(α, i)|
        e0 = math.log(0.5) + (math.log(2) + special.log_ndtr(-((i - z0) / scale) * 2**0.5))
        e1 = math.log(0.5) + (math.log(2) + special.log_ndtr(-((z0 - j) / scale) * 2**0.5))
        s0 = log_coef + i * log_q + j * log1mq + (i * i - i) / var2 + e0
        s1 = log_coef + j * log_q + i * log1mq + (j * j - j) / var2 + e1
        a0 = np.logaddexp.accumulate(np.concatenate([a0, s0], axis=1), axis=1)[:, 1:]
        a1 = np.logaddexp.accumulate(np.concatenate([a1, s1], axis=1), axis=1)[:, 1:]
        total = np.logaddexp(a0, a1)
        done = ((s0 < np.concatenate([last0, s0[:, :-1]], axis=1)) & (s1 < np.concatenate([last1, s1[:, :-1]], axis=1))
                & (np.maximum(s0, s1) < total - 30))
        hit = done.any(axis=1)
        first = done.argmax(axis=1)
        out[rows[hit]] = total[hit, first[hit]]
        if hit.any():
            used = start + int(first[hit].max()) + 1
        if hit.all():  # the usual case: every order converged in this pass
            break
        keep = ~hit
        rows, alpha, log_fact_alpha = rows[keep], alpha[keep], log_fact_alpha[keep]
        a0, a1, last0, last1 = a0[keep, -1:], a1[keep, -1:], s0[keep, -1:], s1[keep, -1:]
        start, width = i[0, -1] + 1, 4 * width
    return out, used


def subsampled_gaussian_rdp(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of one step of the Poisson(q)-subsampled Gaussian mechanism with noise multiplier ``sigma``, at each
    order (add-or-remove-one neighbours; Mironov et al. 2019, Thm. 11 and §3.3)."""
    alpha: np.ndarray = np.asarray(orders, dtype=float)
    if q == 1.0:  # the Gaussian mechanism: α / (2σ²)
        gaussian: np.ndarray = alpha / (2 * sigma**2)
        return gaussian
    integer = alpha == np.floor(alpha)
    log_a = np.empty(alpha.shape)
    if integer.any():
        log_a[integer] = _log_a_int(q, sigma, alpha[integer])
    if (~integer).any():
        log_a[~integer] = _log_a_frac(q, sigma, alpha[~integer])[0]
    rdp: np.ndarray = log_a / (alpha - 1)
    return rdp


@functools.lru_cache(maxsize=1024)
def _conversion_terms(orders: tuple[float, ...], delta: float) -> tuple[np.ndarray, np.ndarray]:
    """log(1 - 1/α) and log(δα)/(α - 1) per order, computed by ``math`` as the library does (NumPy's SIMD
    log1p/log differ from libm in the last bit)."""
    a = np.array(orders, dtype=float)
    usable = a > 1.01
    log1p_inv, log_term = np.zeros(a.shape), np.zeros(a.shape)
    # IEEE arithmetic is NumPy's as Python's; only the logs go through libm, by map (cheaper than a comprehension)
    log1p_inv[usable] = np.fromiter(map(math.log1p, (-1 / a[usable]).tolist()), float)
    log_term[usable] = np.fromiter(map(math.log, (delta * a[usable]).tolist()), float) / (a[usable] - 1)
    return log1p_inv, log_term


def epsilon_at_orders(orders: np.ndarray, rdp: np.ndarray, delta: float) -> np.ndarray:
    """ε at ``delta`` for each order of an (α, rdp)-RDP mechanism (Balle et al. 2020, Prop. 12):
    rdp + log(1 - 1/α) - log(δα)/(α - 1); 0 where rdp < 0 or the KL bound δ <= sqrt(1 - e^-rdp) already holds; inf
    for α <= 1.01 (the bound is unstable there). As ``dp_accounting.rdp.compute_epsilon`` per order, before its
    minimum and max(0, .)."""
    return _epsilon(orders, rdp, delta, *_conversion_terms_at(orders, delta))


def _conversion_terms_at(orders: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_conversion_terms` of an array of orders (cached per tuple of orders and δ)."""
    return _conversion_terms(tuple(orders.tolist()), delta)


def _epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float, log1p_inv: np.ndarray,
             log_term: np.ndarray) -> np.ndarray:
    """:func:`epsilon_at_orders` with the order's conversion terms given."""
    eps = np.where(orders > 1.01, (rdp + log1p_inv) - log_term, np.inf)
    # δ² + expm1(-r) > 0 needs r < ~δ² (expm1(-r) <= -r/2 for 0 <= r <= 1): only those rdp values are checked, by
    # math.expm1 as the library does
    maybe = np.flatnonzero(~(rdp > 4 * delta**2)) if delta <= 0.5 else np.arange(orders.size)
    for k in maybe:
        r = float(rdp[k])
        if r < 0 or delta**2 + math.expm1(-r) > 0:
            eps[k] = 0.0
    return eps


def _best(orders: np.ndarray, eps: np.ndarray) -> tuple[float, float]:
    k = int(np.argmin(eps))
    return max(0.0, float(eps[k])), float(orders[k])


def min_over_orders(epsilons: Callable[[np.ndarray], np.ndarray], base_orders: Sequence[float],
                    extension_orders: Sequence[float], block: int = 8) -> tuple[float, float]:
    """(ε, optimal order): the minimum of ``epsilons(orders)`` (ε per order, as :func:`epsilon_at_orders`) over
    ``base_orders``; when that sits at the last base order, ``extension_orders`` are walked upwards while ε
    decreases, stopping after two orders in a row that do not improve it (docs/accounting.md).
    The walk evaluates ``block`` orders at a time and reads them in order, so it stops where an order-by-order
    walk stops."""
    base = np.asarray(base_orders, dtype=float)
    eps, order = _best(base, epsilons(base))
    if order != base[-1] or not math.isfinite(eps):
        return eps, order
    ext = np.asarray(extension_orders, dtype=float)
    worse = 0
    for lo in range(0, ext.size, block):
        chunk = ext[lo:lo + block]
        for alpha, e in zip(chunk, np.maximum(0.0, epsilons(chunk))):
            if e < eps:
                eps, order, worse = float(e), float(alpha), 0
            else:
                worse += 1
                if worse >= 2:
                    return eps, order
    return eps, order


def _kl_floor(q: float, sigma: float) -> float:
    """A lower bound on one step's RDP at every order > 1: RDP is nondecreasing in α and at least KL >= 2 TV²
    (Pinsker), TV = q·erf(1/(2√2 σ)) (TV of the Gaussian pair, scaled by the subsampling)."""
    return 2.0 * (q * math.erf(1.0 / (2.0 * math.sqrt(2.0) * sigma))) ** 2


def _dpsgd_epsilons(q: float, sigma: float, steps: int, delta: float, orders: np.ndarray,
                    compute: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
                    conversion: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
    """ε per order of T = ``steps`` subsampled Gaussians, as :func:`epsilon_at_orders`, except inf at
    fractional orders proven not to be the minimum, which are not computed (their erfc series are most of an
    evaluation's cost). Integer orders are computed; their binomial sums are exact, and RDP is nondecreasing in
    α and at least :func:`_kl_floor`, so a fractional α's ε is at least max(T·RDP of the integer orders below it,
    T·KL floor) + its conversion term, and where that bound exceeds the computed minimum (with a margin for
    rounding and the series' truncation) α cannot be the argmin. Not applied where ε could be clamped to 0
    (T·RDP <= ~δ²). ``compute``: (T·RDP, ε) at some of ``orders`` (default: computed here); ``conversion``: the
    conversion's terms at ``orders`` (default: :func:`_conversion_terms`)."""
    log1p_inv, log_term = conversion(orders) if conversion is not None else _conversion_terms_at(orders, delta)
    total, out = np.full(orders.shape, np.nan), np.full(orders.shape, np.inf)

    def evaluate(mask: np.ndarray) -> None:
        if compute is not None:
            total[mask], out[mask] = compute(orders[mask])
            return
        total[mask] = steps * subsampled_gaussian_rdp(q, sigma, orders[mask])
        out[mask] = _epsilon(orders[mask], total[mask], delta, log1p_inv[mask], log_term[mask])

    integer = orders == np.floor(orders)
    if integer.any():
        evaluate(integer)
    rest = ~integer
    if rest.any() and delta <= 0.5 and bool(np.all(np.diff(orders) > 0)):  # orders below: ascending orders
        exact = np.where(integer & np.isfinite(total), total, 0.0)
        anchor = np.maximum(np.maximum.accumulate(exact), steps * _kl_floor(q, sigma))
        best = float(out[integer].min(initial=np.inf))
        bound = (anchor + log1p_inv) - log_term
        margin = 1e-6 * max(1.0, abs(best)) + 1e-9 * steps
        rest &= ~((anchor > 8 * delta**2) & (bound > best + margin))
    if rest.any():
        evaluate(rest)
    return out


def dpsgd_epsilon_and_order(sigma: float, q: float, steps: int, delta: float, base_orders: Sequence[float],
                            extension_orders: Sequence[float], block: int = 16,
                            expected_order: float | None = None,
                            compute: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
                            conversion: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
                            ) -> tuple[float, float]:
    """(ε, optimal order) of T = ``steps`` compositions of the subsampled Gaussian, by :func:`min_over_orders`:
    16 orders a block (fewer calls than 8, for ~2 orders evaluated past the stop), or one block reaching 3 orders
    past ``expected_order`` when that is larger (a block's size never changes the result). ``compute``: (T·RDP,
    ε) at given orders (default: computed here); ``conversion``: the conversion's terms at given orders."""
    if expected_order is not None:
        block = max(block, int(np.searchsorted(extension_orders, expected_order)) + 3)
    return min_over_orders(lambda orders: _dpsgd_epsilons(q, sigma, steps, delta, orders, compute, conversion),
                           base_orders, extension_orders, block)
