"""From attack scores (one per trial, higher = "the canary was in") to a lower bound ε_lo on the ε of (ε, δ)-DP
(docs/audit.md#statistics-dpsgd_cliauditstatspy-numpyscipy-only): TPR ≤ e^ε FPR + δ for every test (Kairouz,
Oh, Viswanath 2015; the audit of Jagielski, Ullman, Oprea 2020 and Nasr et al. 2021)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

ThresholdRule = Literal["bonferroni", "split", "order"] | float
ORDER_RANKS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def clopper_pearson_upper(k: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided upper bound p on a binomial rate from k successes in n trials: P_p[X ≤ k] = α (1 if k = n)."""
    k = np.asarray(k)
    return np.where(k < n, scipy.stats.beta.ppf(1.0 - alpha, k + 1, np.maximum(n - k, 1)), 1.0)


def _scores(scores_in, scores_out) -> tuple[np.ndarray, np.ndarray]:
    s_in, s_out = np.asarray(scores_in, dtype=float).ravel(), np.asarray(scores_out, dtype=float).ravel()
    if s_in.size == 0 or s_out.size == 0:
        raise ValueError("both score arrays must be non-empty")
    if not (np.isfinite(s_in).all() and np.isfinite(s_out).all()):
        raise ValueError("scores must be finite (a diverged replica scores NaN: drop it or fix the run)")
    return s_in, s_out


def thresholds(scores_in, scores_out) -> np.ndarray:
    """Every distinct score, and +∞ (guess "in" for nobody): the tests a threshold rule can pick from."""
    return np.append(np.union1d(scores_in, scores_out), np.inf)


def positives(scores: np.ndarray, t: np.ndarray) -> np.ndarray:
    """#{scores ≥ t} for every threshold t."""
    return scores.size - np.searchsorted(np.sort(scores), t, side="left")


def epsilon_from_counts(tp: np.ndarray, fp: np.ndarray, n_in: int, n_out: int, alpha: float,
                        delta: float) -> np.ndarray:
    """ε_lo = ln(TPR_lo − δ) − ln(FPR_hi) per threshold (0 where TPR_lo ≤ δ or the bound is negative); α split
    equally between the two Clopper–Pearson bounds (a union bound)."""
    tpr_lo = 1.0 - clopper_pearson_upper(n_in - np.asarray(tp), n_in, alpha / 2)
    fpr_hi = clopper_pearson_upper(fp, n_out, alpha / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.where(tpr_lo > delta, np.log(np.maximum(tpr_lo - delta, 1e-300)) - np.log(fpr_hi), 0.0)
    return np.maximum(eps, 0.0)


def epsilon_clopper_pearson(scores_in, scores_out, confidence: float = 0.95, delta: float = 0.0,
                            threshold: ThresholdRule = "bonferroni", seed: int = 0,
                            claim: float | None = None) -> float:
    """ε_lo holding with probability `confidence` over the trials; threshold: a number (one test fixed in advance),
    "bonferroni", "split" or "order" (docs/audit.md)."""
    s_in, s_out = _scores(scores_in, scores_out)
    alpha = _alpha(confidence)
    _check_delta(delta)
    if threshold == "bonferroni":
        t = thresholds(s_in, s_out)
        eps = epsilon_from_counts(positives(s_in, t), positives(s_out, t), s_in.size, s_out.size, alpha / t.size,
                                  delta)
        return float(eps.max())
    if threshold == "order":
        ranks = order_ranks(s_out.size, s_in.size, claim, delta, alpha)
        top = np.sort(s_out)[::-1]
        t = np.nextafter(top[ranks - 1], np.inf)  # "score > the j-th largest out-score"
        return max(epsilon_order(int(k), s_in.size, int(j), s_out.size, alpha / ranks.size, delta)
                   for k, j in zip(positives(s_in, t), ranks))
    if threshold == "split":
        rng = np.random.default_rng(seed)
        (fit_in, test_in), (fit_out, test_out) = _halves(s_in, rng), _halves(s_out, rng)
        t = thresholds(fit_in, fit_out)
        eps = epsilon_from_counts(positives(fit_in, t), positives(fit_out, t), fit_in.size, fit_out.size, alpha,
                                  delta)
        return epsilon_clopper_pearson(test_in, test_out, confidence, delta, float(t[int(np.argmax(eps))]))
    if isinstance(threshold, str):
        raise ValueError(f"threshold = {threshold!r}: use 'bonferroni', 'split', 'order' or a number")
    t = np.array([float(threshold)])
    return float(epsilon_from_counts(positives(s_in, t), positives(s_out, t), s_in.size, s_out.size, alpha,
                                     delta)[0])


def order_ranks(n_out: int, n_in: int | None = None, claim: float | None = None, delta: float = 0.0,
                alpha: float = 0.05) -> np.ndarray:
    """The ranks j of the rule "order": `claim_ranks` of a finite claim > 0, else 1, 2, 5, 10, ... ≤ n_out/2."""
    if claim is not None and np.isfinite(claim) and claim > 0:
        return claim_ranks(n_in or n_out, n_out, float(claim), delta, alpha)
    return np.array([j for j in ORDER_RANKS if j <= max(n_out // 2, 1)])


CLAIM_MULTIPLES = (1.0, 2.0, 4.0)


def claim_ranks(n_in: int, n_out: int, epsilon: float, delta: float, alpha: float) -> np.ndarray:
    """Ranks from the claim alone: for ε' = ε, 2ε, 4ε, the rank at which a Gaussian mechanism exactly ε'-DP at δ
    (μ-GDP, Dong, Roth, Su 2022, Cor. 2.13) gives the largest bound at its expected counts (pure DP: δ = 10⁻⁵)."""
    return np.array(_claim_ranks(int(n_in), int(n_out), float(epsilon), float(delta), float(alpha)))


@functools.lru_cache(maxsize=1024)
def _claim_ranks(n_in: int, n_out: int, epsilon: float, delta: float, alpha: float) -> tuple[int, ...]:
    curve_delta = delta if delta > 0 else 1e-5
    j = np.unique(np.round(np.geomspace(1, max(n_out // 2, 1), 200)).astype(int))
    t = -scipy.stats.norm.ppf(j / (n_out + 1))  # the out-scores' j-th largest, in units of their spread
    ranks = set()
    for multiple in CLAIM_MULTIPLES:
        mu = gdp_mu_of_epsilon(multiple * epsilon, curve_delta)
        tp = np.floor(scipy.stats.norm.sf(t - mu) * n_in)
        bound = epsilon_from_counts(tp, j - 1, n_in, n_out, alpha / len(CLAIM_MULTIPLES), delta)
        ranks.add(int(j[int(np.argmax(bound))]))  # all 0 (too few trials for this ε'): rank 1
    return tuple(sorted(ranks))


def order_p_value(k: int, n_in: int, j: int, n_out: int, epsilon: float, delta: float,
                  alpha: float | None = None, rtol: float = 1e-2) -> tuple[float, float]:
    """Bounds (lower, upper) on the p-value of k of n_in in-scores above t, the j-th largest of n_out out-scores,
    if the mechanism is (ε, δ)-DP: p = ∫ P[Bin(n_in, min(1, e^ε x + δ)) ≥ k] dBeta(x; j, n_out − j + 1), by
    Riemann–Stieltjes sums refined until they fall on one side of `alpha` or agree to `rtol` (docs/audit.md)."""
    if k <= 0:
        return 1.0, 1.0
    c = float(np.exp(epsilon))
    a, b = j, n_out - j + 1  # F ~ Beta(a, b); P[Bin(n_in, p) ≥ k] = I_p(k, n_in − k + 1)
    x = np.unique(np.clip(np.r_[0.0, 1.0, _quantiles(a, b), (_quantiles(k, n_in - k + 1) - delta) / c], 0.0, 1.0))
    lower = upper = 1.0
    for _ in range(12):
        G = scipy.special.betainc(a, b, x)
        f = scipy.special.betainc(k, n_in - k + 1, np.minimum(1.0, c * x + delta))
        dG = np.diff(G)
        lower, upper = float(dG @ f[:-1]), float(dG @ f[1:])
        if (alpha is not None and (upper <= alpha or lower > alpha)) or upper - lower <= rtol * upper:
            break
        gap = dG * np.diff(f)  # each interval's share of upper − lower: subdivide the large ones
        wide = np.nonzero(gap > (upper - lower) / gap.size)[0]
        x = np.unique(np.r_[x, (x[wide, None] + np.diff(x)[wide, None] * np.arange(1, 8) / 8).ravel()])
    return lower, upper


@functools.lru_cache(maxsize=256)
def _quantiles(a: float, b: float) -> np.ndarray:
    """Quantiles of Beta(a, b) at 255 even levels and towards both ends (10⁻³ … 10⁻¹⁵)."""
    edges = 10.0 ** -np.arange(3, 16)
    levels = np.r_[np.linspace(0.0, 1.0, 257)[1:-1], edges, 1.0 - edges]
    return scipy.special.betaincinv(a, b, levels)


def epsilon_order(k: int, n_in: int, j: int, n_out: int, alpha: float, delta: float, tol: float = 1e-3) -> float:
    """The largest ε (to `tol`, rounded down) whose p-value by `order_p_value` is certified ≤ α."""
    def rejects(eps: float) -> bool:
        return order_p_value(k, n_in, j, n_out, eps, delta, alpha)[1] <= alpha

    if not rejects(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejects(hi):  # p → 1 as ε → ∞ (every x > 0 gives TPR 1): the loop ends
        lo, hi = hi, 2 * hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejects(mid) else (lo, mid)
    return lo


def _halves(scores: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if scores.size < 2:
        raise ValueError("threshold: split needs at least 2 trials on each side")
    perm = rng.permutation(scores.size)
    return scores[perm[: scores.size // 2]], scores[perm[scores.size // 2:]]


def _alpha(confidence: float) -> float:
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence = {confidence!r} must be in (0.5, 1)")
    return 1.0 - confidence


def _check_delta(delta: float) -> None:
    if not 0 <= delta < 1:
        raise ValueError(f"delta = {delta!r} must be in [0, 1)")


# --- Steinke, Nasr, Jagielski 2023: one training run ------------------------------------------------------------

def one_run_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P-value of `correct` right guesses out of `guesses` on m canaries each included w.p. 1/2, under (ε, δ)-DP.
    Steinke, Nasr, Jagielski 2023, Theorem 5.2: with f(v) = P[Binomial(r, e^ε/(1 + e^ε)) ≥ v],
    P[W ≥ v] ≤ f(v) + 2mδ · max_{i=1..v} (f(v − i) − f(v))/i."""
    q = scipy.special.expit(epsilon)
    f_v = scipy.stats.binom.sf(correct - 1, guesses, q)
    if delta == 0 or correct == 0:
        return float(f_v)
    i = np.arange(1, correct + 1)
    slack = np.max((scipy.stats.binom.sf(correct - i - 1, guesses, q) - f_v) / i)
    return float(min(1.0, f_v + 2 * m * delta * slack))


def epsilon_one_run_counts(m: int, guesses: int, correct: int, alpha: float, delta: float) -> float:
    """The largest ε whose p-value is ≤ α (0 if even ε = 0 is not rejected)."""
    if guesses == 0 or one_run_p_value(m, guesses, correct, 0.0, delta) > alpha:
        return 0.0
    hi = 1.0
    while one_run_p_value(m, guesses, correct, hi, delta) <= alpha:
        hi *= 2
        if hi > 1e3:
            return float("inf")
    return float(scipy.optimize.brentq(lambda e: one_run_p_value(m, guesses, correct, e, delta) - alpha,
                                       0.0, hi, xtol=1e-7))


def guess_counts(m: int) -> list[int]:
    """The numbers k₊ of top-scoring canaries guessed "in", fixed in advance: 1, 2, 5 × 10^j up to m/2."""
    counts, base = [], 1
    while base <= m // 2:
        counts += [k for k in (base, 2 * base, 5 * base) if k <= m // 2]
        base *= 10
    return counts or [1]


def epsilon_one_run(scores_in, scores_out, confidence: float = 0.95, delta: float = 0.0) -> float:
    """ε_lo of the one-run audit of Steinke, Nasr, Jagielski 2023; ties at the cut against the attacker."""
    s_in, s_out = _scores(scores_in, scores_out)
    alpha, m = _alpha(confidence), s_in.size + s_out.size
    _check_delta(delta)
    ranked = np.lexsort((np.r_[np.ones(s_in.size), np.zeros(s_out.size)], -np.r_[s_in, s_out]))
    is_in = ranked < s_in.size
    ks = guess_counts(m)
    return max(epsilon_one_run_counts(m, k, int(is_in[:k].sum()), alpha / len(ks), delta) for k in ks)


# --- Mahloujifar, Melis, Chaudhuri 2024: one training run, f-DP --------------------------------------------------

def one_run_fdp_rejects(m: int, guesses: int, correct: int, alpha: float,
                        blow_up_inverse: Callable[[float], float]) -> bool:
    """Whether `correct` right guesses out of `guesses` on m canaries (each included w.p. 1/2, the rest abstained on)
    reject at level α that the mechanism is f-DP (symmetric f), given the inverse of its blow-up f̄ = 1 − f
    (f̄⁻¹(y) = the least x with f̄(x) ≥ y). Mahloujifar, Melis, Chaudhuri 2024 (arXiv 2410.22235), their one-run
    test `audit_rh_with_cap` with k = 2 options per canary (membership). Why it holds: with p_t = P[t right
    guesses], r_i = Σ_{t≥i} t·p_t/m and h_i = Σ_{t≥i} (guesses − t)·p_t/m, each canary's f-DP (given the others,
    on the event "at least i − 1 of the others right") and the concavity of f̄ give r_i ≤ f̄(h_{i−1}), while
    r_0 + h_0 = guesses/m. If P[≥ correct right] ≥ α, the least r_0 + h_0 these constraints allow (from
    r_c = α·c/m, h_c = α·(guesses − c)/m, each h_{i−1} the least allowed, p_i = m·(h_i − h_{i+1})/(guesses − i))
    exceeds guesses/m: a contradiction, so reject."""
    if correct <= 0:
        return False
    total = guesses / m
    r, h = alpha * correct / m, alpha * (guesses - correct) / m
    for i in range(correct - 1, -1, -1):
        h_next = max(h, blow_up_inverse(r))
        if h_next == h:  # no mass at i: nothing below i changes either
            break
        r, h = r + i / (guesses - i) * (h_next - h), h_next
        if r + h > total:  # r and h only grow as i falls
            return True
    return r + h > total


def gdp_blow_up_inverse(mu: float) -> Callable[[float], float]:
    """f̄⁻¹ of μ-GDP (Dong, Roth, Su 2022): f̄(x) = Φ(Φ⁻¹(x) + μ), so f̄⁻¹(y) = Φ(Φ⁻¹(y) − μ)."""
    return lambda y: float(scipy.special.ndtr(scipy.special.ndtri(min(y, 1.0)) - mu))


def dp_blow_up_inverse(epsilon: float, delta: float) -> Callable[[float], float]:
    """f̄⁻¹ of (ε, δ)-DP: f̄(x) = min(1, e^ε x + δ, 1 − e^{−ε}(1 − δ − x)) (Kairouz, Oh, Viswanath 2015). A mechanism
    is (ε, δ)-DP exactly when it is f-DP for f(x) = max(0, 1 − δ − e^ε x, e^{−ε}(1 − δ − x)) (Dong, Roth, Su 2022,
    Prop. 2.5), so the f-DP test with this curve holds against every mechanism that claims (ε, δ)-DP."""
    c = float(np.exp(epsilon))
    return lambda y: max(0.0, (y - delta) / c, 1.0 - delta - c * (1.0 - y))


FdpCurve = Literal["gdp", "dp"]


@functools.lru_cache(maxsize=4096)  # counts repeat: the two white-box rows of one step, a simulation's draws
def epsilon_one_run_fdp_counts(m: int, guesses: int, correct: int, alpha: float, delta: float,
                               curve: FdpCurve = "dp", tol: float = 1e-4) -> float:
    """ε_lo of the f-DP one-run test on counts: `dp`, the largest ε whose (ε, δ)-DP they reject (valid against any
    (ε, δ) claim); `gdp`, ε at δ (`gdp_epsilon`) of the largest μ whose μ-GDP they reject (valid only against a
    mechanism whose (ε, δ) comes from a μ-GDP curve: a Gaussian one). 0 if none; to `tol`, rounded down."""
    def rejects(x: float) -> bool:
        inverse = gdp_blow_up_inverse(x) if curve == "gdp" else dp_blow_up_inverse(x, delta)
        return one_run_fdp_rejects(m, guesses, correct, alpha, inverse)

    if not rejects(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejects(hi):  # f̄⁻¹ → 0 as μ or ε → ∞: nothing grows, no rejection; the loop ends
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return float("inf")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejects(mid) else (lo, mid)
    return gdp_epsilon(lo, delta) if curve == "gdp" else lo


def one_run_guesses(scores_in, scores_out, seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    """(guesses, right guesses) for each k ∈ `guess_counts(m)`: `top`, "in" for the k top-scoring canaries;
    `both`, also "out" for the k lowest (2k guesses). Ties broken by a seeded permutation, independent of who is
    in. Both kinds: scores that tell only one side (a subsampled chain's out-canaries tie with the in-canaries
    never drawn) lose nothing on the other."""
    s_in, s_out = _scores(scores_in, scores_out)
    m = s_in.size + s_out.size
    is_in = np.r_[np.ones(s_in.size, dtype=bool), np.zeros(s_out.size, dtype=bool)]
    ranked = is_in[np.lexsort((np.random.default_rng(seed).permutation(m), np.r_[s_in, s_out]))]  # ascending
    top = [(k, int(ranked[m - k:].sum())) for k in guess_counts(m)]
    return {"top": top, "both": [(2 * k, right + int((~ranked[:k]).sum())) for k, right in top]}


def epsilon_one_run_fdp(scores_in, scores_out, confidence: float = 0.95, delta: float = 0.0,
                        curve: FdpCurve = "dp") -> float:
    """ε_lo of the f-DP one-run audit (Mahloujifar, Melis, Chaudhuri 2024) on m = #in + #out canaries of one
    training: Bonferroni over the guesses fixed in advance (`one_run_guesses`, both kinds). `dp`: the (ε, δ)-DP
    curve itself, valid against any (ε, δ) claim (the one-run verdict's statistic); `gdp`: the μ-GDP curve (their
    choice; exact for a Gaussian mechanism, an assumption for any other)."""
    alpha = _alpha(confidence)
    _check_delta(delta)
    if curve == "gdp" and delta == 0:
        raise ValueError("no μ-GDP curve with μ > 0 is pure DP (δ = 0): use curve='dp'")
    counts = [count for kind in one_run_guesses(scores_in, scores_out).values() for count in kind]
    m = np.size(scores_in) + np.size(scores_out)
    return max(epsilon_one_run_fdp_counts(m, k, c, alpha / len(counts), delta, curve) for k, c in counts)


# --- descriptive numbers of the attack ---------------------------------------------------------------------------

def auc(scores_in, scores_out) -> float:
    """Area under the ROC curve: P[score_in > score_out] + ½ P[tie] (Mann–Whitney)."""
    s_in, s_out = _scores(scores_in, scores_out)
    ranks = scipy.stats.rankdata(np.concatenate([s_in, s_out]))
    return float((ranks[: s_in.size].sum() - s_in.size * (s_in.size + 1) / 2) / (s_in.size * s_out.size))


def tpr_at_fpr(scores_in, scores_out, fpr: float) -> float:
    """The largest empirical TPR among thresholds with empirical FPR ≤ fpr (no interpolation)."""
    s_in, s_out = _scores(scores_in, scores_out)
    t = thresholds(s_in, s_out)
    ok = positives(s_out, t) <= fpr * s_out.size
    return float(positives(s_in, t)[ok].max() / s_in.size)


# --- what an audit of N trials can show at all -------------------------------------------------------------------

@functools.lru_cache(maxsize=1024)  # the rows of a cell and its twin share it; trials_needed bisects over it
def ceiling(n_in: int, n_out: int, confidence: float = 0.95, delta: float = 0.0,
            threshold: ThresholdRule = "bonferroni", claim: float | None = None) -> float:
    """The largest ε_lo the rule can give with these trials: every in-trial above every out-trial."""
    alpha = _alpha(confidence)
    _check_delta(delta)
    if threshold == "order":
        ranks = order_ranks(n_out, n_in, claim, delta, alpha)
        return float(max(epsilon_order(n_in, n_in, int(j), n_out, alpha / ranks.size, delta) for j in ranks))
    if threshold == "split":
        n_in, n_out = n_in - n_in // 2, n_out - n_out // 2  # the test halves
    elif threshold == "bonferroni":
        alpha = alpha / (n_in + n_out + 1)
    return float(epsilon_from_counts(np.array([n_in]), np.array([0]), n_in, n_out, alpha, delta)[0])


def trials_needed(epsilon: float, confidence: float = 0.95, delta: float = 0.0,
                  threshold: ThresholdRule = "bonferroni", limit: int = 10**9) -> int | None:
    """The fewest trials N per world whose ceiling exceeds `epsilon` (None beyond `limit`)."""
    claim = epsilon if threshold == "order" else None
    if ceiling(limit, limit, confidence, delta, threshold, claim) <= epsilon:
        return None
    lo, hi = 1, 2
    while ceiling(hi, hi, confidence, delta, threshold, claim) <= epsilon:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the ceiling grows with N: bisect on the integers
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ceiling(mid, mid, confidence, delta, threshold, claim) <= epsilon else (lo, mid)
    return hi


def refutes_expected(trials: int, power: Callable[[float], float], claim: float, confidence: float = 0.95,
                     delta: float = 0.0) -> bool:
    """Whether the rule "order" (ranks from `claim`) with `trials` per world refutes `claim` at the expected counts of
    an attack whose TPR at each FPR is `power(FPR)`: the out-scores' j-th largest at FPR j/(N + 1), ⌊TPR·N⌋
    in-scores above it, the exact test's p-value at ε = claim ≤ α/#ranks at some rank."""
    alpha = _alpha(confidence)
    ranks = order_ranks(trials, trials, claim, delta, alpha)
    level = alpha / ranks.size
    return any(order_p_value(int(np.floor(power(j / (trials + 1)) * trials)), trials, int(j), trials, claim, delta,
                             level)[1] <= level for j in ranks)


def trials_to_refute(power: Callable[[float], float], claim: float, confidence: float = 0.95, delta: float = 0.0,
                     limit: int = 10**6) -> int | None:
    """The fewest trials N per world (to 1%) at which an attack of that `power` refutes `claim` at its expected
    counts (`refutes_expected`): what it needs to refute the claim in a typical draw (None beyond `limit`)."""
    if not refutes_expected(limit, power, claim, confidence, delta):
        return None
    lo, hi = 1, 2
    while not refutes_expected(hi, power, claim, confidence, delta):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 100):  # refuting gets easier with N (up to the counts' rounding): bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not refutes_expected(mid, power, claim, confidence, delta) else (lo, mid)
    return hi


def family_confidence(confidence: float, rows: int) -> float:
    """The confidence of each of `rows` bounds whose union holds with probability `confidence` (Bonferroni)."""
    return 1.0 - _alpha(confidence) / max(int(rows), 1)


# --- assumption-laden estimate: the Gaussian trade-off curve ------------------------------------------------------

def gdp_mu(scores_in, scores_out) -> float:
    """μ of the Gaussian trade-off curve (μ-GDP, Dong, Roth, Su 2022) fitted to the scores, ASSUMING Gaussian
    scores of one variance (as Nasr et al. 2023): a point estimate, never a verdict."""
    s_in, s_out = _scores(scores_in, scores_out)
    pooled = np.sqrt(((s_in.size - 1) * s_in.var(ddof=1) + (s_out.size - 1) * s_out.var(ddof=1))
                     / max(s_in.size + s_out.size - 2, 1))
    if pooled == 0:
        return float("inf") if s_in.mean() > s_out.mean() else 0.0
    return float(max(s_in.mean() - s_out.mean(), 0.0) / pooled)


@functools.lru_cache(maxsize=1024)  # the claim's ranks ask for the same few (ε, δ) at every N
def gdp_mu_of_epsilon(epsilon: float, delta: float) -> float:
    """The μ whose μ-GDP curve has ε(μ, δ) = `epsilon` (`gdp_epsilon` inverted; it grows with μ)."""
    if delta <= 0:
        raise ValueError("no μ-GDP curve with μ > 0 is pure DP (δ = 0)")
    if epsilon <= 0:
        return 0.0
    hi = 1.0
    while gdp_epsilon(hi, delta) < epsilon:
        hi *= 2
    return float(scipy.optimize.brentq(lambda m: gdp_epsilon(m, delta) - epsilon, 1e-9, hi, xtol=1e-10))


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε of μ-GDP at δ (Dong, Roth, Su 2022, Cor. 2.13): δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), solved for ε."""
    if mu <= 0:
        return 0.0
    if not np.isfinite(mu):
        return float("inf")
    # e^ε Φ(·) in log space: no overflow at large ε
    f = lambda e: (scipy.stats.norm.cdf(-e / mu + mu / 2)
                   - np.exp(min(e + scipy.stats.norm.logcdf(-e / mu - mu / 2), 0.0)) - delta)
    if f(0.0) <= 0:
        return 0.0
    hi = 1.0
    while f(hi) > 0:
        hi *= 2
        if hi > 1e6:
            return float("inf")
    return float(scipy.optimize.brentq(f, 0.0, hi, xtol=1e-10))
