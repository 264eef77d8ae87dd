"""From attack scores to a statistical lower bound ε_lo on the ε of (ε, δ)-DP.

Scores: one per trial, higher = "the canary was in". A threshold t turns them into guesses; for every t the
false-positive rate FPR(t) (out-trials scoring ≥ t) and false-negative rate FNR(t) of the test bound ε: an
(ε, δ)-DP mechanism has TPR ≤ e^ε FPR + δ for every test (Kairouz, Oh, Viswanath 2015; the audit of Jagielski,
Ullman, Oprea 2020 and Nasr et al. 2021), so with Clopper–Pearson bounds holding with probability 1 − α,
ε ≥ ln((TPR_lo − δ) / FPR_hi). The same numbers as JAX Privacy's `CanaryScoreAuditor` (`jax_privacy.auditing`),
against which `tests/test_audit.py` checks them; no JAX needed here.
"""

from __future__ import annotations

from typing import Literal, Union

import numpy as np
import scipy.optimize
import scipy.stats

ThresholdRule = Union[Literal["bonferroni", "split"], float]


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
    permutation), the bound computed on the other half at α.
    """
    s_in, s_out = _scores(scores_in, scores_out)
    alpha = _alpha(confidence)
    _check_delta(delta)
    if threshold == "bonferroni":
        t = thresholds(s_in, s_out)
        eps = epsilon_from_counts(positives(s_in, t), positives(s_out, t), s_in.size, s_out.size, alpha / t.size,
                                  delta)
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
