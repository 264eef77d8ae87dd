"""From attack scores to a statistical lower bound ε_lo on the ε of (ε, δ)-DP.

Scores: one per trial, higher = "the canary was in". A threshold t turns them into guesses; for every t the
false-positive rate FPR(t) (out-trials scoring ≥ t) and false-negative rate FNR(t) of the test bound ε: an
(ε, δ)-DP mechanism has TPR ≤ e^ε FPR + δ for every test (Kairouz, Oh, Viswanath 2015; the audit of Jagielski,
Ullman, Oprea 2020 and Nasr et al. 2021), so with Clopper–Pearson bounds holding with probability 1 − α,
ε ≥ ln((TPR_lo − δ) / FPR_hi). The same numbers as JAX Privacy's `CanaryScoreAuditor` (`jax_privacy.auditing`),
against which `tests/test_audit.py` checks them; no JAX needed here.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import numpy as np
import scipy.optimize
import scipy.stats

ThresholdRule = Union[Literal["bonferroni", "split", "order"], float]
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
                            threshold: ThresholdRule = "bonferroni", seed: int = 0) -> float:
    """ε_lo holding with probability `confidence` over the trials.

    threshold: a number (fixed in advance: one test); "bonferroni" — the best of all k thresholds, each bound at
    α/k (valid whatever threshold wins); "split" — the threshold that is best on half of the trials (a seeded
    permutation), the bound computed on the other half at α; "order" — thresholds at pre-registered ranks j of the
    out-scores (`order_ranks`: just above the j-th largest), each bound at α/#ranks. The last is exact for any
    score distribution: the FPR of "score > j-th largest of N" is Beta(j, N − j + 1) for continuous scores (and
    stochastically smaller with ties), whose upper α-quantile is Clopper–Pearson's for j − 1 of N; the in-scores
    are independent of the threshold, so their bound holds given it.
    """
    s_in, s_out = _scores(scores_in, scores_out)
    alpha = _alpha(confidence)
    _check_delta(delta)
    if threshold == "bonferroni":
        t = thresholds(s_in, s_out)
        eps = epsilon_from_counts(positives(s_in, t), positives(s_out, t), s_in.size, s_out.size, alpha / t.size,
                                  delta)
        return float(eps.max())
    if threshold == "order":
        ranks = order_ranks(s_out.size)
        top = np.sort(s_out)[::-1]
        t = np.nextafter(top[ranks - 1], np.inf)  # "score > the j-th largest out-score"
        eps = epsilon_from_counts(positives(s_in, t), ranks - 1, s_in.size, s_out.size, alpha / ranks.size, delta)
        return float(eps.max())
    if threshold == "split":
        rng = np.random.default_rng(seed)
        (fit_in, test_in), (fit_out, test_out) = _halves(s_in, rng), _halves(s_out, rng)
        t = thresholds(fit_in, fit_out)
        eps = epsilon_from_counts(positives(fit_in, t), positives(fit_out, t), fit_in.size, fit_out.size, alpha,
                                  delta)
        return epsilon_clopper_pearson(test_in, test_out, confidence, delta, float(t[int(np.argmax(eps))]))
    if isinstance(threshold, str):
        raise ValueError(f"threshold = {threshold!r}: use 'bonferroni', 'split' or a number")
    t = np.array([float(threshold)])
    return float(epsilon_from_counts(positives(s_in, t), positives(s_out, t), s_in.size, s_out.size, alpha,
                                     delta)[0])


def order_ranks(n_out: int) -> np.ndarray:
    """The ranks j fixed before any score is seen for the rule "order": 1, 2, 5, 10, ... up to n_out/2."""
    ranks = np.array([j for j in ORDER_RANKS if j <= max(n_out // 2, 1)])
    return ranks


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
    P[W ≥ v] ≤ f(v) + 2mδ · max_{i=1..v} (f(v − i) − f(v))/i.
    """
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
    """The numbers k₊ of top-scoring canaries guessed "in", fixed before looking at the scores: 1, 2, 5 × 10^j up
    to m/2 (Bonferroni over these few; Steinke et al. choose k₊ in advance as well)."""
    counts, base = [], 1
    while base <= m // 2:
        counts += [k for k in (base, 2 * base, 5 * base) if k <= m // 2]
        base *= 10
    return counts or [1]


def epsilon_one_run(scores_in, scores_out, confidence: float = 0.95, delta: float = 0.0) -> float:
    """ε_lo of the one-run audit of Steinke, Nasr, Jagielski 2023: guess "in" for the k₊ top-scoring canaries (abstain
    on the rest) for each k₊ of `guess_counts(m)`, Bonferroni over them. `scores_in` / `scores_out`: the canaries
    that were / were not included (m in all). Ties at the cut are broken against the attacker (out first)."""
    s_in, s_out = _scores(scores_in, scores_out)
    alpha, m = _alpha(confidence), s_in.size + s_out.size
    _check_delta(delta)
    ranked = np.lexsort((np.r_[np.ones(s_in.size), np.zeros(s_out.size)], -np.r_[s_in, s_out]))
    is_in = ranked < s_in.size
    ks = guess_counts(m)
    return max(epsilon_one_run_counts(m, k, int(is_in[:k].sum()), alpha / len(ks), delta) for k in ks)


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

def ceiling(n_in: int, n_out: int, confidence: float = 0.95, delta: float = 0.0,
            threshold: ThresholdRule = "bonferroni") -> float:
    """The largest ε_lo the rule can give with these trials: perfect separation (every in-trial above every
    out-trial). Bonferroni divides α by the n_in + n_out + 1 thresholds that distinct scores give; split bounds
    on the held-out halves at α; a fixed threshold at α."""
    alpha = _alpha(confidence)
    _check_delta(delta)
    if threshold == "split":
        n_in, n_out = n_in - n_in // 2, n_out - n_out // 2  # the test halves
    elif threshold == "order":
        alpha = alpha / order_ranks(n_out).size
    elif threshold == "bonferroni":
        alpha = alpha / (n_in + n_out + 1)
    return float(epsilon_from_counts(np.array([n_in]), np.array([0]), n_in, n_out, alpha, delta)[0])


def trials_needed(epsilon: float, confidence: float = 0.95, delta: float = 0.0,
                  threshold: ThresholdRule = "bonferroni", limit: int = 10**9) -> Optional[int]:
    """The fewest trials N per world whose ceiling exceeds `epsilon` (None beyond `limit`)."""
    if ceiling(limit, limit, confidence, delta, threshold) <= epsilon:
        return None
    lo, hi = 1, 2
    while ceiling(hi, hi, confidence, delta, threshold) <= epsilon:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the ceiling grows with N: bisect on the integers
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ceiling(mid, mid, confidence, delta, threshold) <= epsilon else (lo, mid)
    return hi


def family_confidence(confidence: float, rows: int) -> float:
    """The confidence of each of `rows` bounds whose union holds with probability `confidence` (Bonferroni)."""
    return 1.0 - _alpha(confidence) / max(int(rows), 1)


# --- assumption-laden estimate: the Gaussian trade-off curve ------------------------------------------------------

def gdp_mu(scores_in, scores_out) -> float:
    """μ of the Gaussian trade-off curve (μ-GDP, Dong, Roth, Su 2022) fitted to the scores, ASSUMING both worlds'
    scores are Gaussian with one variance (Nasr et al. 2023 use the same estimate): μ = (m_in − m_out)/s, s the
    pooled standard deviation. A point estimate, not a bound: never a verdict."""
    s_in, s_out = _scores(scores_in, scores_out)
    pooled = np.sqrt(((s_in.size - 1) * s_in.var(ddof=1) + (s_out.size - 1) * s_out.var(ddof=1))
                     / max(s_in.size + s_out.size - 2, 1))
    if pooled == 0:
        return float("inf") if s_in.mean() > s_out.mean() else 0.0
    return float(max(s_in.mean() - s_out.mean(), 0.0) / pooled)


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
