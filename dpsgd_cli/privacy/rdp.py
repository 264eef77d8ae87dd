"""Rényi DP of DP-SGD's mechanism, the Poisson-subsampled Gaussian, vectorised over orders and terms.

The formulas are Mironov, Talwar & Zhang 2019 ("Rényi Differential Privacy of the Sampled Gaussian Mechanism",
§3.3: A_α as a binomial sum for integer α, as two erfc series for fractional α; RDP = log A_α / (α - 1)) and the
RDP -> (ε, δ) conversion of Balle et al. 2020, Prop. 12, computed as ``dp-accounting`` computes them
(``rdp_privacy_accountant``: ``_compute_log_a_int``, ``_compute_log_a_frac``, ``compute_epsilon``): the same terms
in the same order, summed left to right (``np.logaddexp`` accumulates as the library's ``_log_add`` loop does), so
the results are the library's bit for bit (tests/test_rdp.py compares them for equality).

Why not call the library: it sums the terms in a Python loop (~2.3 µs a term; ε = 0.01 at δ = 1e-9 needs orders up
to ~2,500, 0.24 s an evaluation) and importing it costs ~1 s a process; here an evaluation takes 0.2-2 ms.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import numpy as np

from dpsgd_cli.lazy import LazyModule

special = LazyModule("scipy.special")

__all__ = ["subsampled_gaussian_rdp", "epsilon_at_orders", "min_over_orders", "dpsgd_epsilon_and_order",
           "DpsgdRdpCurve"]

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
    return _int_terms_without_sigma(q, a, i) + (i * i - i) / (2 * (sigma**2))


def _int_terms_without_sigma(q: float, a: np.ndarray, i: np.ndarray) -> np.ndarray:
    """log C(α, i) + i log q + (α - i) log(1 - q): :func:`_int_terms` before its σ term, summed in its order."""
    log_fact = _log_factorial_table(int(a.max()))
    return (log_fact[a] - log_fact[i] - log_fact[a - i]) + i * math.log(q) + (a - i) * math.log1p(-q)


_ABSORBED = 747.0  # a term this far below the running sum adds exactly 0 to it: exp(-745.2) is 0.0 in float64
# a term t below a running sum s > 0 with t - s < log(s) - 54 log 2 - 1 (ln 2^54 = 37.43) adds less than half an
# ulp of s (> s 2^-54), so s + log1p(exp(t - s)) rounds to s; tried first with terms 60 below the largest
_ULP_NATS, _ULP_TRY = 54 * math.log(2.0) + 1.0, 60.0


@functools.lru_cache(maxsize=None)
def _cut_steps(bits: int) -> np.ndarray:
    return np.array(sorted({round(2.0 ** (m / 2)) for m in range(2 * bits + 2)}), dtype=np.int64)  # 1, 2, 3, 4, 6, ...


def _last_counted_term(q: float, sigma: float, a_int: np.ndarray, below: float = _ABSORBED) -> np.ndarray:
    """Per integer order α, the first index j past which the binomial sum's terms decrease and term j is ``below``
    a term at or before j (α where none is found). Candidates j = ⌊αq⌋ + round(2^(m/2)). For α + 2 <= 4σ² the
    terms are concave in i (their difference f(i) = log((α - i)/(i + 1)) + log(q/(1 - q)) + i/σ² falls by at
    least 4/(α + 2) - 1/σ² a step), so once f(j) < 0 they decrease: with ``below`` = 747 every later term is 747
    below the running sum, where exp underflows to 0.0 and log1p(0) + s == s, so summing up to j gives the same
    result bit for bit (:func:`_log_a_int` checks other cuts)."""
    cut = a_int.copy()
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


def _log_a_frac(q: float, sigma: float, alphas: np.ndarray, excess: bool = False,
                chunk: int = _FRAC_FIRST_CHUNK) -> tuple[np.ndarray, np.ndarray, int]:
    """(log A_α, log excess) for fractional orders. log A_α: the two series of §3.3 (integrals below and above
    z0), summed term by term until both terms decrease and are e^-30 below the total; inf where that takes more
    than 1,000 terms. The series add |C(α, i)|·(...), as the library does, whereas the integrals' binomial series
    have C(α, i) < 0 at i = ⌊α⌋ + 2, ⌊α⌋ + 4, ...: the sum exceeds the exact A_α by twice those terms. With
    ``excess``, the second array bounds that from above (those terms summed over every term computed), else it
    is inf. Then the number of terms the slowest converged order took. The terms are computed ``chunk`` at a time,
    then 4 times as many a pass (the sums do not depend on it)."""
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log1mq, scale, var2 = math.log(q), math.log1p(-q), math.sqrt(2) * sigma, 2 * (sigma**2)
    out, over = np.full(alphas.shape, np.inf), np.full(alphas.shape, np.inf)
    rows = np.arange(alphas.size)
    alpha = alphas[:, None]
    log_fact_alpha = special.gammaln(alpha + 1)
    start, width, used = 0, chunk, 0
    a0 = a1 = last0 = last1 = extra = np.full((alphas.size, 1), -np.inf)
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
        if excess:
            k = i - np.floor(alpha)
            negative = (k >= 2) & (k % 2 == 0)  # C(α, i) < 0
            extra = np.logaddexp(extra, np.logaddexp.reduce(np.where(negative, np.logaddexp(s0, s1), -np.inf),
                                                            axis=1, keepdims=True))
        hit = done.any(axis=1)
        first = done.argmax(axis=1)
        out[rows[hit]] = total[hit, first[hit]]
        if excess:
            over[rows[hit]] = math.log(2) + extra[hit, 0]
        if hit.any():
            used = start + int(first[hit].max()) + 1
        if hit.all():  # the usual case: every order converged in this pass
            break
        keep = ~hit
        rows, alpha, log_fact_alpha, extra = rows[keep], alpha[keep], log_fact_alpha[keep], extra[keep]
        a0, a1, last0, last1 = a0[keep, -1:], a1[keep, -1:], s0[keep, -1:], s1[keep, -1:]
        start, width = i[0, -1] + 1, 4 * width
    return out, over, used


def subsampled_gaussian_rdp(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of one step of the Poisson(q)-subsampled Gaussian mechanism with noise multiplier ``sigma``, at each
    order (add-or-remove-one neighbours; Mironov et al. 2019, Thm. 11 and §3.3)."""
    return _rdp_and_shortfall(q, sigma, np.asarray(orders, dtype=float))[0]


def _rdp_and_shortfall(q: float, sigma: float, orders: np.ndarray, shortfall: bool = False,
                       chunk: int = _FRAC_FIRST_CHUNK) -> tuple[np.ndarray, np.ndarray, int]:
    """(RDP as :func:`subsampled_gaussian_rdp`, shortfall >= 0): the Rényi divergence itself is at least RDP -
    shortfall (up to the series' truncation). 0 at integer orders and for q = 1 (exact); at fractional ones, from
    the series' excess over A_α (:func:`_log_a_frac`): -log(1 - excess/A)/(α - 1); inf where that is not below
    A or without ``shortfall``. Then the terms the fractional series took (:func:`_log_a_frac`, ``chunk``)."""
    short, used = np.zeros(orders.shape), 0
    if q == 1.0:  # the Gaussian mechanism: α / (2σ²)
        return orders / (2 * sigma**2), short, used
    integer = orders == np.floor(orders)
    log_a = np.empty(orders.shape)
    if integer.any():
        log_a[integer] = _log_a_int(q, sigma, orders[integer])
    if (~integer).any():
        frac, excess, used = _log_a_frac(q, sigma, orders[~integer], shortfall, chunk)
        log_a[~integer] = frac
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            below = -np.log1p(-np.exp(excess - frac)) / (orders[~integer] - 1)
        short[~integer] = np.where(excess < frac, below, np.inf)
    return log_a / (orders - 1), short, used


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
    decreases, stopping after two orders in a row that do not improve it (see ``accounting``'s docstring).
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


def _nanargmin(values: np.ndarray) -> int:
    """``np.nanargmin`` of values not all NaN, without its first call's ~0.1 ms."""
    return int(np.where(np.isnan(values), np.inf, values).argmin())


def _stacked(top: tuple[np.ndarray, ...], bottom: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Two blocks of :meth:`DpsgdRdpCurve._rough_rows` as one: the narrower block's terms padded with -inf (not
    counted: no column past a row's head + 16 is) and its i² - i with 0."""
    rows, width = top[0].shape[0], max(top[0].shape[1], bottom[0].shape[1])
    terms = np.full((rows + bottom[0].shape[0], width), -np.inf)
    squares = np.zeros(terms.shape, dtype=top[1].dtype)
    for block, at in ((top, slice(0, rows)), (bottom, slice(rows, None))):
        terms[at, :block[0].shape[1]], squares[at, :block[1].shape[1]] = block[0], block[1]
    return (terms, squares, *(np.concatenate([t, b]) for t, b in zip(top[2:], bottom[2:])))


class DpsgdRdpCurve:
    """ε(σ) of T = ``steps`` subsampled Gaussians (Poisson rate ``q``) at ``delta`` by the RDP accountant over the
    ascending order grid ``base_orders + extension_orders``: exact (:meth:`epsilon_and_order`, the accountant's
    walk), and two cheap views for a calibration's search, computed at a few orders near the optimum
    (:meth:`estimate`, and :meth:`exceeds`, a proof that ε > a target). Each σ's search starts from the optimal
    order found at the nearest σ, and its per-order values are kept for the proof.

    The proof bounds the orders it does not compute: T·log A_α is convex in α (a log moment-generating function)
    and 0 at α = 1, so outside each pair of adjacent computed integer orders it lies above their secant; RDP is
    nondecreasing in α and at least KL >= 2 TV² (Pinsker), TV = q·erf(1/(2√2 σ)); and the divergence is
    nonincreasing in σ, so the values an evaluation found at a larger σ' bound those at σ (:meth:`_divergence_floor`).
    Integer orders enter exactly (their binomial sums are exact); the fractional orders' series add |terms| (an
    upper bound on A_α, far above it where q is large), so they enter less their excess (:func:`_log_a_frac`).
    Both series stop at e^-30, which a margin (as :func:`_dpsgd_epsilons`'s) covers.
    """

    def __init__(self, q: float, steps: int, delta: float, base_orders: Sequence[float],
                 extension_orders: Sequence[float]):
        self.q, self.steps, self.delta = q, steps, delta
        self.base_orders, self.extension_orders = tuple(base_orders), tuple(extension_orders)
        self.grid = np.asarray(self.base_orders + self.extension_orders, dtype=float)
        self._integer = np.flatnonzero(self.grid == np.floor(self.grid))
        self._log1p_inv, self._log_term = _conversion_terms(self.base_orders + self.extension_orders, delta)
        self._optimal: dict[float, float] = {}  # σ -> the optimal order found there
        self._hinted: dict[float, float] = {}  # σ -> the integer orders' optimum there (:meth:`guess`)
        # σ -> (T·RDP, ε, T·shortfall (:func:`_rdp_and_shortfall`)) per order; NaN: not computed
        self._partial: dict[float, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._chunk = _FRAC_FIRST_CHUNK  # the fractional series' first pass: the terms the last one took, + 25 %
        self._rough_span, self._rough_table = (0, 0), ()  # :meth:`_rough_parts`: positions covered, values

    def epsilon_and_order(self, sigma: float) -> tuple[float, float]:
        """(ε, optimal order): the accountant's, bit for bit (:func:`dpsgd_epsilon_and_order`)."""
        e, order = dpsgd_epsilon_and_order(sigma, self.q, self.steps, self.delta, self.base_orders,
                                           self.extension_orders, expected_order=self._nearest_optimum(sigma),
                                           compute=lambda orders: self._values(sigma, np.searchsorted(self.grid, orders)),
                                           conversion=self._conversion_at)
        self._optimal[sigma] = order
        return e, order

    def _conversion_at(self, orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The conversion's terms at grid ``orders``: the curve's, not a second table for the base orders."""
        idx = np.searchsorted(self.grid, orders)
        return self._log1p_inv[idx], self._log_term[idx]

    def estimate(self, sigma: float) -> float:
        """ε at the local minimum over the grid reached from the nearest σ's optimal order (else the large-σ
        optimum 1 + σ sqrt(log(1/δ)/T)/q): first over the integer orders, then over the orders between that
        minimum's integer neighbours. The accountant's ε wherever its walk ends at the same minimum."""
        start = self._nearest_optimum(sigma)
        if start is None:
            start = self._large_sigma_order(sigma)
        else:  # first the 3 orders each side of it, then of the lowest of them: the minimum is usually among them
            i = min(int(np.searchsorted(self.grid, start)), self.grid.size - 1)
            for _ in range(2):
                self._compute(sigma, np.arange(max(0, i - 3), min(self.grid.size, i + 4)))
                best = self._best(sigma)
                if (max(0, i - 3) < best < min(self.grid.size - 1, i + 3)
                        and math.isfinite(self._partial[sigma][1][best])):
                    return self._estimate_at(sigma, best)
                i = best
        ints = self._integer
        p = self._local_minimum(sigma, ints, self._integer_position(start), 2)
        around = np.arange(ints[max(0, p - 1)], ints[min(ints.size - 1, p + 1)] + 1)
        if around.size > 3:  # fractional orders: from the nearest σ's optimum where it lies among them
            near = int(np.searchsorted(self.grid[around], start))
            self._local_minimum(sigma, around, near if 0 < near < around.size else int(ints[p] - around[0]), 4)
        return self._estimate_at(sigma, self._best(sigma))

    def guess(self, target: float, sigma: float) -> tuple[float, float]:
        """(σ, d log ε / d log σ there): where the integer orders' ε (approximated: :meth:`_rough`) crosses
        ``target``, to a step under 4e-5 in log σ, by steps in log ε over log σ from ``sigma`` (Newton's, then the
        secant's): a start for the lattice search, at or above the σ sought (ε <= the integer orders' ε), by up to
        ~2 % where the optimal order is fractional, and the slope to step from its first point (the last step's: of
        the integer orders' ε; fewer probes than its secant over the 1 % below, measured). Steps are at most a
        factor e and stay inside the bracket found so far; each step's orders are centred where the previous
        optimum moves under :meth:`_large_sigma_order`. ``sigma`` and NaN where ε vanishes or the steps do not
        settle, and for q = 1 (no subsampling: the search's secant steps suffice). Leaves the integer optimum at
        the σ returned as a start for :meth:`estimate` near it."""
        if self.q >= 1.0:
            return sigma, math.nan
        start, low, high, last = sigma, 0.0, math.inf, None  # last: (log σ, log ε) of the previous step
        near = self._nearest_optimum(sigma)
        centre = self._integer_position(self._large_sigma_order(sigma) if near is None else near)
        for _ in range(64):
            e, slope, centre = self._rough_minimum(sigma, centre)
            if not 0.0 < e < math.inf:
                return start, math.nan
            here = (math.log(sigma), math.log(e))
            if last is not None and last[0] != here[0]:
                # the secant: the optimal order moves with σ, often along the edge where the sum's last term takes
                # over, so ε's slope is not the optimal order's (Newton's steps crawl there)
                secant = (here[1] - last[1]) / (here[0] - last[0])
                slope = secant if secant < 0 else slope
            last = here
            gap = math.log(e / target)
            low, high = (max(low, sigma), high) if gap > 0 else (low, min(high, sigma))
            step = min(1.0, max(-1.0, -gap / slope)) if slope < 0 else math.copysign(1.0, gap)
            if abs(step) < 4e-5:  # a sixth of a lattice step: the step is taken, not checked
                self._hinted[sigma] = float(self.grid[self._integer[centre]])
                return sigma * math.exp(step), slope
            moved = sigma * math.exp(step) if low < sigma * math.exp(step) < high else math.sqrt(low * high)
            order = float(self.grid[self._integer[centre]])
            centre = self._integer_position(order * self._large_sigma_order(moved) / self._large_sigma_order(sigma))
            sigma = moved
        return start, math.nan

    def _integer_position(self, order: float) -> int:
        """Position among the integer grid orders of the first one >= ``order`` (the last if none)."""
        return min(int(np.searchsorted(self.grid[self._integer], order)), self._integer.size - 1)

    def _rough_minimum(self, sigma: float, centre: int) -> tuple[float, float, int]:
        """(ε, d log ε / d log σ, position) at the minimum of :meth:`_rough` over the integer orders, reached from
        position ``centre`` by windows of 3 positions each side that double while it sits at their edge (up to all
        of them)."""
        ints, half = self._integer, 3
        while True:
            window = np.arange(max(0, centre - half), min(ints.size, centre + half + 1))
            eps, slope = self._rough(sigma, int(window[0]), int(window[-1]) + 1)
            best = int(np.argmin(eps))
            centre = int(window[best])
            if 0 < best < window.size - 1 or centre in (0, ints.size - 1) or window.size == ints.size:
                return float(eps[best]), float(slope[best]) / float(eps[best]), centre
            half *= 2

    def _rough(self, sigma: float, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """ε and dε/dlog σ at the integer grid orders of positions ``lo`` to ``hi`` - 1, from the binomial sum's terms up
        to 10 standard deviations + 60 past its mean αq and its last 16 (which dominate where the terms are not
        concave, α + 2 > 4σ²: the others lie below them or the first ones): a guess's accuracy, ~25 µs a call."""
        first, (fixed, quad, scale, log1p_inv, log_term, head) = self._rough_parts(lo, hi)
        rows = slice(lo - first, hi - first)
        width = int(head[hi - 1 - first]) + 16  # the widest row's (the head grows with α), as if computed alone
        terms = fixed[rows, :width] + quad[rows, :width] / (2 * (sigma**2))  # _int_terms's sum, in its order
        top = terms.max(axis=1, keepdims=True)
        weights = np.exp(terms - top)
        total = weights.sum(axis=1)
        log_a = top[:, 0] + np.log(total)
        d_log_a = (weights * (-quad[rows, :width] / sigma**2)).sum(axis=1) / total  # d log A / d log σ
        return (scale[rows] * log_a + log1p_inv[rows]) - log_term[rows], scale[rows] * d_log_a

    def _rough_parts(self, lo: int, hi: int) -> tuple[int, tuple[np.ndarray, ...]]:
        """What :meth:`_rough` needs that does not depend on σ, per integer order (a row) from the first position
        returned, covering ``lo`` to ``hi`` - 1: the terms' σ-free part (-inf where not counted), i² - i (i within
        0..α, as every counted term's), T/(α - 1), the conversion's two terms and the head's length. Kept per
        curve; a window it misses adds the rows missing up to 8 positions past it (each row is computed once: its
        values do not depend on the rows beside it)."""
        first, last = self._rough_span
        lower, upper = max(0, lo - 8), min(self._integer.size, hi + 8)
        if first >= last:
            first, last, self._rough_table = lower, upper, self._rough_rows(lower, upper)
        if lo < first:
            first, self._rough_table = lower, _stacked(self._rough_rows(lower, first), self._rough_table)
        if hi > last:
            last, self._rough_table = upper, _stacked(self._rough_table, self._rough_rows(last, upper))
        self._rough_span = (first, last)
        return first, self._rough_table

    def _rough_rows(self, first: int, last: int) -> tuple[np.ndarray, ...]:
        """:meth:`_rough_parts`' rows for the integer orders of positions ``first`` to ``last`` - 1."""
        idx = self._integer[first:last]
        orders = self.grid[idx]
        q, a = self.q, orders.astype(np.int64)[:, None]
        mean = a * q
        head = np.minimum(a + 1, np.ceil(mean + 10 * np.sqrt(mean + 1) + 61)).astype(np.int64)
        column = np.arange(int(head.max()) + 16)[None, :]
        i = np.where(column < head, column, a - (column - head))  # the head, then the tail counted down from α
        counted = (column < head) | (i >= np.maximum(head, a - 15))
        within = np.minimum(np.maximum(i, 0), a)
        return (np.where(counted, _int_terms_without_sigma(q, a, within), -np.inf), within * within - within,
                self.steps / (orders - 1.0), self._log1p_inv[idx], self._log_term[idx], head[:, 0])

    def _large_sigma_order(self, sigma: float) -> float:
        """A start for the optimal order at σ: 1 + σ sqrt(log(1/δ)/T)/q, its large-σ asymptote (RDP ~ q²α/σ²),
        at most 1 + 2σ² log(1/q), past which the binomial sum's last term q^α exp(α(α - 1)/(2σ²)) takes over."""
        return min(1.0 + sigma * math.sqrt(math.log(1.0 / self.delta) / self.steps) / self.q,
                   max(2.0, 1.0 + 2 * sigma**2 * math.log(1.0 / self.q)))

    def _best(self, sigma: float) -> int:
        return _nanargmin(self._partial[sigma][1])

    def _estimate_at(self, sigma: float, best: int) -> float:
        self._optimal[sigma] = float(self.grid[best])
        return max(0.0, float(self._partial[sigma][1][best]))

    def exceeds(self, sigma: float, target: float) -> bool:
        """Whether ε(σ) > ``target`` is proven from the orders :meth:`estimate` computed, two integer orders each
        side of its minimum, the integer orders 2, 4, 8, ... below them, and the bounds (see the class) on the
        rest, computing the orders whose bound is not above the target. False: not proven (the accountant
        decides)."""
        if sigma not in self._partial:
            self.estimate(sigma)
        total, eps, _ = self._partial[sigma]
        ints = self._integer
        p = self._integer_position(self.grid[self._best(sigma)])  # integer orders around the minimum
        self._compute(sigma, ints[max(0, p - 2):p + 3])
        lowest = float(self.grid[ints[np.isfinite(total[ints])]].min(initial=np.inf))
        whole = self.grid[ints].astype(np.int64)
        powers = ints[(self.grid[ints] < lowest) & ((whole & (whole - 1)) == 0)]
        self._compute(sigma, powers)
        self._compute(sigma, np.flatnonzero(np.isnan(eps) & ~(self._bounds(sigma) > target)))
        return bool(np.nanmin(eps) > target)  # every order not computed is bounded above the target

    def _nearest_optimum(self, sigma: float) -> float | None:
        """The optimal order found at the nearest σ; an integer orders' optimum (:meth:`guess`) only where it is
        nearer and no optimum was found within 5 % of σ (the hint is off by up to an order; measured on 50 settings:
        392 series calls vs 409 with 1 %, the same estimates)."""
        found = [(abs(math.log(s / sigma)), order) for s, order in self._optimal.items()]
        hinted = [(abs(math.log(s / sigma)), order) for s, order in self._hinted.items()]
        nearest = min(found, default=None)
        if nearest is None or nearest[0] > 0.05:
            nearest = min(found + hinted, default=None)
        return None if nearest is None else nearest[1]

    def _compute(self, sigma: float, idx: np.ndarray, shortfall: bool = False) -> None:
        """T·RDP, ε and T·shortfall (inf unless ``shortfall``) at the grid orders ``idx`` (each once per σ)."""
        if sigma not in self._partial:
            self._partial[sigma] = tuple(np.full(self.grid.size, np.nan) for _ in range(3))
        total, eps, short = self._partial[sigma]
        idx = idx[np.isnan(eps[idx])]
        if idx.size:
            rdp, below, used = _rdp_and_shortfall(self.q, sigma, self.grid[idx], shortfall, self._chunk)
            if used:  # nearby σ and orders take about as many terms
                self._chunk = max(8, used + used // 4)
            total[idx], short[idx] = self.steps * rdp, self.steps * below
            eps[idx] = _epsilon(self.grid[idx], total[idx], self.delta, self._log1p_inv[idx], self._log_term[idx])

    def _values(self, sigma: float, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(T·RDP, ε) at the grid orders ``idx``, computed where not yet, with their shortfall: an evaluation's
        orders bound those of the proof at the σ below (:meth:`_divergence_floor`)."""
        self._compute(sigma, idx, shortfall=True)
        total, eps, _ = self._partial[sigma]
        return total[idx], eps[idx]

    def _local_minimum(self, sigma: float, positions: np.ndarray, start: int, h: int) -> int:
        """Position in ``positions`` (ascending grid indices) of a local minimum of ε, reached from ``start`` by
        windows that double while the minimum sits at their edge, with ``h`` positions computed each side."""
        m, width = min(max(start, 0), positions.size - 1), h
        self._compute(sigma, positions[max(0, m - h):m + h + 1])
        eps = self._partial[sigma][1]
        while True:
            values = eps[positions]
            m = _nanargmin(values)
            lo, hi = max(0, m - h), min(positions.size - 1, m + h)
            if not np.isnan(values[lo:hi + 1]).any() or not math.isfinite(values[m]):
                return m
            width *= 2  # all of [lo, hi], and farther the way the minimum leans
            left = m - width if np.isnan(values[lo]) else lo
            right = m + width if np.isnan(values[hi]) else hi
            self._compute(sigma, positions[max(0, left):right + 1])

    def _divergence_floor(self, sigma: float) -> np.ndarray:
        """Per order, a lower bound on T times the Rényi divergence at σ (0 where none is known): the values found
        at any larger σ' minus their shortfall, as the divergence is nonincreasing in σ (N(0, σ'²) is N(0, σ²) plus
        independent N(0, σ'² - σ²) noise on both distributions: data processing)."""
        floor = np.zeros(self.grid.size)
        for other, (total, _, shortfall) in self._partial.items():
            if other > sigma:
                with np.errstate(invalid="ignore"):
                    lower = total - shortfall
                floor = np.maximum(floor, np.where(np.isfinite(lower), lower, 0.0))
        return floor

    def _bounds(self, sigma: float) -> np.ndarray:
        """Per order, a lower bound on ε (minus the margin) from the integer orders computed at σ (see the class);
        inf where α <= 1.01 (the conversion's ε)."""
        total = self._partial[sigma][0]
        grid, steps, delta = self.grid, self.steps, self.delta
        exact = np.zeros(grid.size, dtype=bool)
        exact[self._integer] = np.isfinite(total[self._integer])
        a = np.concatenate(([1.0], grid[exact]))
        f = np.concatenate(([0.0], total[exact] * (grid[exact] - 1)))  # T·log A_α
        slope = np.diff(f) / np.diff(a)
        x = grid[:, None]
        outside = (x <= a[:-1]) | (x >= a[1:])  # secant j bounds T·log A_α at α outside [a_j, a_j+1]
        log_a = np.max(np.where(outside, f[:-1] + slope * (x - a[:-1]), -np.inf), axis=1, initial=0.0)
        known = np.maximum(np.where(exact, total, 0.0), self._divergence_floor(sigma))
        below = np.maximum.accumulate(known)  # RDP nondecreasing: T·RDP of an order below
        with np.errstate(divide="ignore", invalid="ignore"):
            bound = np.maximum(np.maximum(log_a / (grid - 1), below), steps * _kl_floor(self.q, sigma))
            # ε is clamped to 0 where T·RDP <= ~δ² (else it may be below 0: the conversion's terms are negative)
            eps = (bound + self._log1p_inv) - self._log_term
            eps = np.where(bound > 8 * delta**2, eps, np.minimum(eps, 0.0))
        eps -= 1e-6 * np.maximum(1.0, np.abs(eps)) + 1e-9 * steps
        return np.where(grid > 1.01, eps, np.inf)
