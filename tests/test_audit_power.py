"""`dpsgd audit` with proven power: the Dirac canary and its per-step likelihood ratio, the positive control,
ceilings, family-wise confidence, verdicts tied to what a claim covers, and the GDP estimate, each checked
against a closed form or an independent computation."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import scipy.optimize
import scipy.special
import scipy.stats

from dpsgd_cli.audit import canaries, stats
from dpsgd_cli.audit.engine import Worlds, _statistics, _verdict, audit_cell
from dpsgd_cli.config import AuditSpec, GridFile, expand


def _cells(**grid):
    base = dict(name="t", datasets=[{"name": "synthetic", "n": 400, "dim": 5}], models=["logreg"], seeds=1,
                delta=1e-5, clip_norm=1.0, l2=1e-3, lr=0.5, epochs=2, batch_size=32)
    return expand(GridFile.model_validate({"grids": [{**base, **grid}]}).grids[0])


# --- statistics against closed forms -----------------------------------------------------------------------------

def test_ceiling_is_perfect_separation_in_closed_form():
    """All in-trials above all out-trials: TPR_lo = a^(1/N), FPR_hi = 1 − a^(1/N) with a = α/(2k), k = 2N + 1
    thresholds under Bonferroni (one under a fixed threshold); the split rule tests on the held-out halves."""
    for n, confidence in ((200, 0.95), (500, 0.95), (5000, 0.99)):
        alpha = 1 - confidence
        a = alpha / (2 * (2 * n + 1))
        closed = np.log(a ** (1 / n) / (1 - a ** (1 / n)))
        assert stats.ceiling(n, n, confidence) == pytest.approx(closed, rel=1e-9)
        a = alpha / 2
        assert stats.ceiling(n, n, confidence, threshold=0.0) == pytest.approx(
            np.log(a ** (1 / n) / (1 - a ** (1 / n))))
        h = n - n // 2
        assert stats.ceiling(n, n, confidence, threshold="split") == pytest.approx(
            np.log(a ** (1 / h) / (1 - a ** (1 / h))))
    # and it is what the bound gives on perfectly separated scores with distinct values
    s_in, s_out = np.arange(300) + 1000.0, np.arange(300) * 1.0
    assert stats.epsilon_clopper_pearson(s_in, s_out, 0.95) == pytest.approx(stats.ceiling(300, 300, 0.95))


def test_trials_needed_is_the_first_n_whose_ceiling_clears_the_claim():
    for eps, confidence, delta in ((4.0, 0.95, 1e-5), (4.0, 1 - 0.05 / 3, 1e-5), (1.0, 0.95, 0.0), (6.0, 0.95, 0.0)):
        n = stats.trials_needed(eps, confidence, delta)
        assert stats.ceiling(n, n, confidence, delta) > eps >= stats.ceiling(n - 1, n - 1, confidence, delta)
    assert stats.trials_needed(4.0, 0.95, 1e-5) == 594  # the audit grid's ε = 4 needs more than its old 500


def test_family_confidence_is_bonferroni():
    assert stats.family_confidence(0.95, 3) == pytest.approx(1 - 0.05 / 3)
    assert stats.family_confidence(0.95, 0) == pytest.approx(0.95)


def test_gdp_epsilon_matches_the_gaussian_mechanism_by_dp_accounting():
    """μ-GDP is the Gaussian mechanism of sensitivity 1 and σ = 1/μ, whose exact ε dp_accounting computes by its
    own formula."""
    from dp_accounting import get_epsilon_gaussian

    for mu in (0.3, 1.0, 2.5):
        for delta in (1e-5, 1e-2):
            assert stats.gdp_epsilon(mu, delta) == pytest.approx(get_epsilon_gaussian(1 / mu, delta), abs=1e-6)


def test_gdp_mu_estimates_the_shift_of_unit_gaussians():
    rng = np.random.default_rng(1)
    mu = stats.gdp_mu(rng.standard_normal(20000) + 1.5, rng.standard_normal(20000))
    assert mu == pytest.approx(1.5, abs=0.05)


def test_step_likelihood_ratio_is_the_mixture_likelihood_ratio():
    """Σ_t log[((1 − q)φ(x/σ) + qφ((x − 1)/σ)) / φ(x/σ)] computed with scipy's normal density; against the mirror
    the denominator is the mixture with mean −1; q = 1: Σ x_t (a monotone transform of the ratio)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 5)) * 0.8 + (rng.random((7, 5)) < 0.3)
    q, sigma = 0.3, 0.8
    pdf = lambda m: scipy.stats.norm.pdf(x, loc=m, scale=sigma)
    direct = np.log(((1 - q) * pdf(0) + q * pdf(1)) / pdf(0)).sum(axis=0)
    np.testing.assert_allclose(canaries.step_likelihood_ratio(x, sigma, q), direct, rtol=1e-10)
    mirror = np.log(((1 - q) * pdf(0) + q * pdf(1)) / ((1 - q) * pdf(0) + q * pdf(-1))).sum(axis=0)
    np.testing.assert_allclose(canaries.step_likelihood_ratio(x, sigma, q, mirror=True), mirror, rtol=1e-10)
    np.testing.assert_allclose(canaries.step_likelihood_ratio(x, sigma, 1.0), x.sum(axis=0))
    # no noise: the floor keeps the ratio finite and still orders "in" above "out"
    noiseless = canaries.step_likelihood_ratio(np.array([[0.0, 1.0], [0.0, 0.0]]), 0.0, 0.1)
    assert np.isfinite(noiseless).all() and noiseless[1] > noiseless[0]


def test_false_refutations_of_exactly_tight_mechanisms_stay_below_alpha():
    """2,000 simulated cells, each of three rows auditing an exactly tight (ε, δ) mechanism: randomized response,
    score 1 with probability p₁ = e^ε p₀ + δ in the world with the canary and p₀ without, so that the one test
    "score ≥ 1" meets TPR = e^ε FPR + δ with equality. A cell is falsely refuted when any row's ε_lo exceeds ε.
    At a stated family confidence of 95% the rate stays ≤ 5%. The same rows judged by the point estimate
    ln((TPR − δ)/FPR) refute far more often than 5%: the check can fail."""
    rng = np.random.default_rng(7)
    cells, rows, n = 2000, 3, 500
    for eps, delta, p0 in ((1.0, 0.0, 0.2), (0.5, 1e-2, 0.3)):
        p1 = np.exp(eps) * p0 + delta
        row_confidence = stats.family_confidence(0.95, rows)
        tp, fp = rng.binomial(n, p1, (cells, rows)), rng.binomial(n, p0, (cells, rows))
        # a row's scores: tp ones among the in-trials, fp among the out-trials (the counts are all that matter)
        lo = np.array([[stats.epsilon_clopper_pearson(np.r_[np.ones(a), np.zeros(n - a)],
                                                      np.r_[np.ones(b), np.zeros(n - b)],
                                                      row_confidence, delta, 0.5) for a, b in zip(ra, rb)]
                       for ra, rb in zip(tp, fp)])
        assert (lo > eps).any(axis=1).mean() <= 0.05
        with np.errstate(divide="ignore"):
            point = np.log(np.maximum(tp / n - delta, 1e-300)) - np.log(fp / n)
        assert (point > eps).any(axis=1).mean() > 0.05


# --- verdicts ------------------------------------------------------------------------------------------------------

def _row(**kw):
    row = {"status": "ok", "epsilon_claimed": 1.0, "epsilon_lo": 0.2, "ceiling": 3.8, "trials": 500,
           "algorithm": "dp_sgd", "control": 0.1, "control_epsilon": 50.0, "control_epsilon_lo": 2.0}
    return {**row, **kw}


def test_verdicts():
    every, last = "white-box, all iterates", "white-box, last iterate"
    assert _verdict(_row(), "every iterate", every)["verdict"] == "consistent"
    assert _verdict(_row(epsilon_lo=1.5), "every iterate", every)["verdict"] == "refuted"
    # a final-output claim is never refuted by an adversary who sees every iterate
    v = _verdict(_row(epsilon_lo=3.0), "final output", every)
    assert v["verdict"] == "not covered" and "final output" in v["reason"]
    assert _verdict(_row(epsilon_lo=3.0), "final output", last)["verdict"] == "refuted"
    # the twin not refuted, not broken, absent, or the claim above the ceiling: uninformative, with the reason
    assert _verdict(_row(control_epsilon_lo=0.5), "every iterate", every)["verdict"] == "uninformative"
    v = _verdict(_row(control_epsilon=0.9), "every iterate", every)
    assert v["verdict"] == "uninformative" and "not broken" in v["reason"]
    row = _row()
    del row["control"]
    assert _verdict(row, "every iterate", every)["verdict"] == "uninformative"
    v = _verdict(_row(epsilon_claimed=4.0, trials_needed=594), "every iterate", every)
    assert v["verdict"] == "uninformative" and "594" in v["reason"]


# --- the Dirac canary on DP-SGD ------------------------------------------------------------------------------------

def test_dirac_step_statistics_read_the_inclusions_off_noiseless_iterates():
    """With the noise removed, x_t = b_t exactly: 1 at the steps whose Poisson batch held the canary, 0 else, at
    rate q (so the chain's η, 1/B and λ are read right); a wrong λ or scale would leave other values."""
    from dpsgd_cli.algorithms.streams import ReplicaStreams
    from dpsgd_cli.audit.engine import dirac_setup
    from dpsgd_cli.engine.runner import dataset

    cell = _cells(algorithms=["dp_sgd"], epsilon=[1.0], l2=0.05, epochs=4)[0]
    model, setting, U, Xw, yw = dirac_setup(cell, dataset(cell.dataset))
    wrapped = canaries.with_gradient_canaries(model, U, np.ones((64, 1)), 1.0)
    algo = cell.make_algorithm().with_noise_scale(0.0)
    prepared = algo.prepare(setting, wrapped, Xw, yw, ReplicaStreams(range(64)))
    theta = prepared.train(wrapped).theta
    a = canaries.iterate_projections(wrapped, theta)
    x = canaries.step_statistics(a, canaries.step_model(prepared.chain, 1.0, setting.sample_rate))
    assert np.all(np.isclose(x, 0, atol=1e-9) | np.isclose(x, 1, atol=1e-9))
    rate = x.round().mean()
    assert abs(rate - setting.sample_rate) < 4 * np.sqrt(setting.sample_rate / x.size), (rate, setting.sample_rate)


def test_dirac_step_statistics_follow_their_exact_law_on_a_noisy_chain():
    """x_t = b_t + σz_t with b_t ~ Bernoulli(q) with the canary, 0 without: the law from which the full-training
    bound draws fresh scores (docs/audit.md); a 10% error in σ would be caught."""
    from dpsgd_cli.algorithms.streams import ReplicaStreams
    from dpsgd_cli.audit.engine import dirac_setup
    from dpsgd_cli.engine.runner import dataset

    cell = _cells(algorithms=["dp_sgd"], epsilon=[1.0], l2=0.05, epochs=4)[0]
    model, setting, U, Xw, yw = dirac_setup(cell, dataset(cell.dataset))
    included = np.r_[np.ones(512), np.zeros(512)][:, None]
    wrapped = canaries.with_gradient_canaries(model, U, included, 1.0)
    prepared = cell.make_algorithm().prepare(setting, wrapped, Xw, yw, ReplicaStreams(range(1024)))
    theta = prepared.train(wrapped).theta
    steps = canaries.step_model(prepared.chain, 1.0, setting.sample_rate)
    x = canaries.step_statistics(canaries.iterate_projections(wrapped, theta), steps)
    sigma, q = steps.sigma, steps.q
    x_in, x_out = x[:, :512].ravel(), x[:, 512:].ravel()

    def mixture(scale: float):
        return lambda v: (1 - q) * scipy.stats.norm.cdf(v / scale) + q * scipy.stats.norm.cdf((v - 1) / scale)

    assert scipy.stats.kstest(x_out, scipy.stats.norm(scale=sigma).cdf).pvalue > 1e-3
    assert scipy.stats.kstest(x_in, mixture(sigma)).pvalue > 1e-3
    assert scipy.stats.kstest(x_out, scipy.stats.norm(scale=1.1 * sigma).cdf).pvalue < 1e-6
    assert scipy.stats.kstest(x_in, mixture(1.1 * sigma)).pvalue < 1e-6


def test_dirac_audit_catches_the_noiseless_twin_and_not_the_sound_mechanism():
    cell = _cells(algorithms=["dp_sgd"], epsilon=[1.0])[0]
    spec = AuditSpec(canaries=["dirac"], trials=200, chunk=400)
    rows = audit_cell(cell, spec)
    assert [r["threat_model"] for r in rows] == ["white-box, last iterate", "white-box, all iterates"]
    for r in rows:
        assert r["epsilon_lo"] <= 1.0 and r["family_size"] == 2 and r["row_confidence"] == pytest.approx(0.975)
        assert r["control_epsilon"] > 1.0
    every = rows[1]
    assert every["control_epsilon_lo"] > 1.0 and every["verdict"] == "consistent", every
    noiseless = audit_cell(cell, AuditSpec(canaries=["dirac"], trials=200, chunk=400, control=None),
                           algorithm=cell.make_algorithm().with_noise_scale(0.0))
    assert noiseless[1]["epsilon_lo"] > 1.0 and noiseless[1]["verdict"] == "refuted", noiseless[1]


def test_bolt_on_all_iterates_row_is_not_covered():
    """bolt_on's iterates carry no noise: what an adversary who sees them learns says nothing of its claim about
    the released model, so that row has no verdict on the claim and is left out of the family."""
    cell = _cells(algorithms=[{"name": "bolt_on", "case": "convex", "calibration": "analytic"}], epsilon=[1.0],
                  lr=0.5)[0]
    rows = audit_cell(cell, AuditSpec(canaries=["dirac"], trials=100, chunk=200))
    by = {r["threat_model"]: r for r in rows}
    every = by["white-box, all iterates"]
    assert every["status"] == "ok", every
    assert every["covers"] == "final output" and every["verdict"] == "not covered", every
    assert by["white-box, last iterate"]["family_size"] == 1
    assert by["white-box, last iterate"]["verdict"] != "refuted"


def test_order_rule_bound_on_the_false_positive_rate_is_exact():
    """Out-scores uniform on (0, 1): the true FPR of "score > j-th largest" is 1 − that score. Its Clopper–Pearson
    bound for j − 1 of N at level a fails with probability a exactly (Beta(j, N − j + 1) against the binomial
    tail): over 4,000 draws the failure rate is a within sampling error, neither above nor far below."""
    rng = np.random.default_rng(11)
    n, a, draws = 200, 0.1, 4000
    top = -np.sort(-rng.random((draws, n)), axis=1)
    for j in (1, 5, 20):
        true_fpr = 1 - top[:, j - 1]
        failed = (true_fpr > stats.clopper_pearson_upper(j - 1, n, a)).mean()
        assert abs(failed - a) < 4 * np.sqrt(a * (1 - a) / draws), (j, failed)


def test_order_rule_on_separated_scores_reaches_its_ceiling_and_ignores_identical_worlds():
    s_in, s_out = np.arange(400) + 1000.0, np.arange(400) * 1.0
    assert stats.epsilon_clopper_pearson(s_in, s_out, 0.95, 1e-5, "order") == pytest.approx(
        stats.ceiling(400, 400, 0.95, 1e-5, "order"))
    same = np.random.default_rng(3).standard_normal(400)
    assert stats.epsilon_clopper_pearson(same, same, 0.95, 1e-5, "order") == 0.0


def test_report_takes_the_cell_verdict_from_covered_rows_only():
    """A not-covered row with ε_lo above the claim does not refute it; the cell is as good as its best covered
    row (consistent > uninformative), and the report's numbers carry the family's confidence and the reason."""
    import pandas as pd

    from dpsgd_cli.report import audit_verdicts

    base = {"grid": "g", "dataset": "d", "model": "logreg", "algorithm": "bolt_on", "algorithm_params": "{}",
            "epsilon_claimed": 1.0, "delta": 1e-5, "trials": 500, "confidence": 0.95, "family_size": 2, "status": "ok"}
    rows = [dict(base, canary="dirac", threat_model="white-box, all iterates", epsilon_lo=3.0, verdict="not covered",
                 reason="covers the final output only"),
            dict(base, canary="dirac", threat_model="white-box, last iterate", epsilon_lo=0.1, verdict="uninformative",
                 reason="twin not refuted"),
            dict(base, canary="input", threat_model="black-box, last iterate", epsilon_lo=0.0, verdict="uninformative",
                 reason="twin not refuted")]
    [v] = audit_verdicts(pd.DataFrame(rows))
    assert v["verdict"] == "uninformative" and "family of 2" in v["numbers"] and "twin not refuted" in v["numbers"]
    rows[2]["verdict"] = "consistent"
    assert audit_verdicts(pd.DataFrame(rows))[0]["verdict"] == "consistent"
    [v] = audit_verdicts(pd.DataFrame(rows[:1]))
    assert v["verdict"] == "not covered"


def test_one_run_rows_name_the_statistic_that_decides_in_the_report_and_the_console():
    """A one-run row is one training of m canaries judged by the f-DP test with the (ε, δ) curve: the report says
    so instead of "N + N trials", and the console's notes say what audit.csv has beside it."""
    import pandas as pd
    from rich.console import Console

    from dpsgd_cli.cli import audit_table
    from dpsgd_cli.report import audit_verdicts

    row = {"grid": "g", "dataset": "d", "model": "logreg", "algorithm": "dp_sgd", "algorithm_params": "{}",
           "epsilon_claimed": 4.0, "delta": 1e-5, "trials": 1, "confidence": 0.95, "family_size": 2, "status": "ok",
           "statistic": "one_run", "canary": "dirac", "threat_model": "white-box, all iterates", "epsilon_lo": 0.43,
           "verdict": "consistent", "reason": "", "message": ""}
    [v] = audit_verdicts(pd.DataFrame([row]))
    assert "one run: 1 training(s), the f-DP test with the (ε, δ) curve" in v["numbers"], v["numbers"]
    assert "1 + 1 trials" not in v["numbers"]
    console = Console(width=300, record=True)
    console.print(audit_table([row], "g: audit"))
    assert "Steinke et al.'s bound and the μ-GDP curve's (valid for a Gaussian mechanism only)" in " ".join(
        console.export_text().split())


def test_audit_figure_draws_the_ceiling():
    import pandas as pd

    from dpsgd_cli.audit.plot import audit_figure

    frame = pd.DataFrame([{"status": "ok", "epsilon_lo": 0.2, "epsilon_claimed": 1.0, "ceiling": 3.84,
                           "threat_model": "white-box, all iterates", "algorithm": "dp_sgd", "verdict": "consistent"}])
    fig = audit_figure(frame)
    lines = [line for ax in fig.axes for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert any(np.allclose(line.get_xdata(), 3.84) for line in lines)


# --- the rule "order": an exact test at ranks fixed from the claim -------------------------------------------------

def test_order_p_value_brackets_the_integral():
    """p = ∫ P[Bin(n_in, min(1, e^ε x + δ)) ≥ k] dBeta(x; j, n_out − j + 1), computed here by adaptive quadrature
    (scipy.integrate.quad on the Beta's bulk, its tail mass added as the integrand's bound 1): the lower and upper
    sums bracket it, and a p-value computed at level α decides on the right side of α."""
    import scipy.integrate

    for k, n_in, j, n_out, eps, delta in ((600, 5000, 177, 5000, 0.8, 1e-2), (500, 500, 1, 500, 4.2, 1e-5),
                                          (60, 500, 13, 500, 1.0, 1e-5), (20, 500, 1, 500, 2.0, 1e-5)):
        beta = scipy.stats.beta(j, n_out - j + 1)
        lo, hi = beta.ppf(1e-13), beta.isf(1e-13)
        f = lambda x: scipy.stats.binom.sf(k - 1, n_in, min(1.0, np.exp(eps) * x + delta)) * beta.pdf(x)
        exact = scipy.integrate.quad(f, lo, hi, points=[j / n_out], limit=500, epsabs=1e-16, epsrel=1e-10)[0]
        lower, upper = stats.order_p_value(k, n_in, j, n_out, eps, delta)
        assert lower <= exact * (1 + 1e-6) and exact <= upper + 2e-13, (k, j, lower, exact, upper)
        assert upper - lower <= 1e-2 * upper
        lower, upper = stats.order_p_value(k, n_in, j, n_out, eps, delta, alpha=2 * exact)
        assert upper <= 2 * exact


def _tight_scores(rng, cells: int, n: int, eps: float, delta: float):
    """Out-scores uniform on (0, 1); in-scores with P[in > t] = min(1, e^ε P[out > t] + δ) at every t (an atom of
    mass δ at 2, the rest uniform on (1 − (1 − δ)/e^ε, 1) at density e^ε): an (ε, δ)-DP mechanism, tight for every
    threshold test at once."""
    out, u = rng.random((cells, n)), rng.random((cells, n))
    return np.where(u < delta, 2.0, 1.0 - (u - delta) / np.exp(eps)), out


def test_order_rule_false_refutations_of_exactly_tight_mechanisms_stay_below_alpha():
    """1,000 simulated cells of an exactly tight mechanism, judged by the rule "order" at ranks fixed from the
    claim, each rank's exact test at α/#ranks. Counted: a rank whose p-value's lower bound at the true ε is ≤ its
    level — every refutation (ε_lo > ε) is among them, as ε_lo's own p-value is certified ≤ the level and grows
    with ε. At most α of the cells are refuted, and each rank alone rejects close to its level: the tests are
    exact, not vacuous (a loose test would reject almost never)."""
    rng = np.random.default_rng(4)
    cells, n, confidence = 1000, 500, 0.95
    for eps, delta in ((1.0, 1e-5), (0.5, 1e-2)):
        ranks = stats.order_ranks(n, n, eps, delta, 1 - confidence)
        level = (1 - confidence) / ranks.size
        inn, out = _tight_scores(rng, cells, n, eps, delta)
        top = -np.sort(-out, axis=1)
        rejected = np.array([[stats.order_p_value(int((inn[c] > top[c, j - 1]).sum()), n, int(j), n, eps, delta,
                                                  level)[0] <= level for j in ranks] for c in range(cells)])
        assert rejected.any(axis=1).mean() <= 1 - confidence, (eps, rejected.mean(axis=0))
        assert (rejected.mean(axis=0) >= level / 3).all(), (eps, ranks, rejected.mean(axis=0), level)
        for c in range(30):  # the bound itself: above ε only where a rank rejected
            lo = stats.epsilon_clopper_pearson(inn[c], out[c], confidence, delta, "order", claim=eps)
            assert lo <= eps or rejected[c].any(), (c, lo)


def test_claim_ranks_reach_the_one_step_goal_on_gaussian_scores():
    """Scores of one full-batch Gaussian step exactly as private as claimed (μ-GDP with ε(μ, δ) = ε, δ = 10⁻²,
    2 × 5,000 trials): the rule "order" with ranks from the claim bounds ε at ≥ 0.65·ε on average over 8 draws,
    where the pair of Clopper–Pearson bounds at the ladder's ranks (the former rule) stays lower."""
    rng = np.random.default_rng(12)
    n, delta = 5000, 1e-2
    for eps in (1.0, 2.0):
        mu = stats.gdp_mu_of_epsilon(eps, delta)
        ours, former = [], []
        for _ in range(8):
            s_in, s_out = rng.standard_normal(n) + mu, rng.standard_normal(n)
            ours.append(stats.epsilon_clopper_pearson(s_in, s_out, 0.95, delta, "order", claim=eps))
            ladder = stats.order_ranks(n)
            t = np.nextafter(np.sort(s_out)[::-1][ladder - 1], np.inf)
            former.append(stats.epsilon_from_counts(stats.positives(s_in, t), ladder - 1, n, n, 0.05 / ladder.size,
                                                    delta).max())
        assert np.mean(ours) >= 0.65 * eps and np.mean(ours) > np.mean(former), (eps, ours, former)
        assert max(ours) <= eps


def test_gdp_mu_of_epsilon_inverts_gdp_epsilon():
    for eps, delta in ((0.5, 1e-5), (1.0, 1e-2), (4.0, 1e-5)):
        assert stats.gdp_epsilon(stats.gdp_mu_of_epsilon(eps, delta), delta) == pytest.approx(eps, abs=1e-8)


def test_identically_ordered_rows_are_one_test_of_the_family():
    """One full-batch step (T = 1, q = 1, θ₀ = 0): the all-iterates ratio is an increasing function of the last
    iterate's projection, so the two white-box rows are one test and the family is 1 (each row at 95%)."""
    from dpsgd_cli.engine.runner import dataset

    n = dataset(_cells(algorithms=["dp_sgd"], epsilon=[1.0])[0].dataset).n  # the training set: a full batch
    cells = _cells(algorithms=[{"name": "dp_sgd", "accountant": "pld", "batch_size": [n], "epochs": [1],
                                "lr": [1.0]}], epsilon=[1.0], delta=1e-2)
    rows = audit_cell(cells[0], AuditSpec(canaries=["dirac"], trials=200, chunk=400, threshold="order"))
    assert [r["family_size"] for r in rows] == [1, 1] and rows[0]["row_confidence"] == pytest.approx(0.95)
    assert rows[0]["epsilon_lo"] == rows[1]["epsilon_lo"]
    multi = audit_cell(_cells(algorithms=["dp_sgd"], epsilon=[1.0])[0],
                       AuditSpec(canaries=["dirac"], trials=100, chunk=200))
    assert [r["family_size"] for r in multi] == [2, 2]


# --- dp_lssgd: the Dirac canary read along the smoothed direction ---------------------------------------------------

def test_dirac_statistics_undo_dp_lssgd_smoothing():
    """dp_lssgd moves θ by A⁻¹ applied to the noisy gradient. The engine reads Mᵀ = A⁻¹ off the chain's last
    transform, and projecting the update on w = A e (Mᵀw = e) gives back the canary's inclusions exactly when the
    noise is removed (0 or 1 at every step, as for dp_sgd), although A⁻¹ spreads the canary's gradient over every
    coordinate and mixes the data's into e's."""
    from dpsgd_cli.algorithms.ops import laplacian_eigenvalues
    from dpsgd_cli.algorithms.streams import ReplicaStreams
    from dpsgd_cli.audit.engine import _post_processing, _step_statistics, dirac_setup
    from dpsgd_cli.engine.runner import dataset

    cell = _cells(algorithms=[{"name": "dp_lssgd", "smoothing": 1.0}], epsilon=[1.0], l2=0.05, epochs=3)[0]
    data = dataset(cell.dataset)
    algo = cell.make_algorithm().with_noise_scale(0.0)
    model, setting, U, Xw, yw = dirac_setup(cell, data)
    Mt = _post_processing(algo, setting, model, Xw, yw)
    P = model.n_params
    eig = laplacian_eigenvalues(1.0, P)
    F = np.fft.fft(np.eye(P), axis=1)
    np.testing.assert_allclose(Mt, np.real(np.fft.ifft(F / eig, axis=1)), atol=1e-12)
    plain = _cells(algorithms=["dp_sgd"], epsilon=[1.0], l2=0.05, epochs=3)[0].make_algorithm()
    assert _post_processing(plain, setting, model, Xw, yw) is None  # nothing after the noise, scale and l2
    model, setting, U, Xw, yw = dirac_setup(cell, data, watch=1)
    w = np.linalg.solve(Mt, U[0])
    U[1] = w / np.linalg.norm(w)
    wrapped = canaries.with_gradient_canaries(model, U, np.c_[np.ones(64), np.zeros(64)], 1.0)
    prepared = algo.prepare(setting, wrapped, Xw, yw, ReplicaStreams(range(64)))
    theta = prepared.train(wrapped).theta
    proj = np.stack([*wrapped.projections, theta @ U.T])  # (T + 1, R, 2)
    x = _step_statistics(proj[:, :, 0], proj[:, :, 1] * np.linalg.norm(w),
                         canaries.step_model(prepared.chain, 1.0, setting.sample_rate))
    assert np.all(np.isclose(x, 0, atol=1e-8) | np.isclose(x, 1, atol=1e-8))
    rate = x.round().mean()
    assert abs(rate - setting.sample_rate) < 4 * np.sqrt(setting.sample_rate / x.size), (rate, setting.sample_rate)
    raw = canaries.step_statistics(proj[:, :, 0], canaries.step_model(prepared.chain, 1.0, setting.sample_rate))
    assert not np.all(np.isclose(raw, 0, atol=1e-3) | np.isclose(raw, 1, atol=1e-3))  # e alone does not


def test_dirac_audit_of_dp_lssgd_catches_its_twin():
    cell = _cells(algorithms=[{"name": "dp_lssgd", "smoothing": 1.0}], epsilon=[1.0])[0]
    rows = audit_cell(cell, AuditSpec(canaries=["dirac"], trials=200, chunk=400, threshold="order"))
    for r in rows:
        assert r["epsilon_lo"] <= 1.0, r
    assert rows[1]["control_epsilon_lo"] > 1.0 and rows[1]["verdict"] == "consistent", rows[1]


# --- one run (Steinke, Nasr, Jagielski 2023) with Dirac canaries -----------------------------------------------------

def test_one_run_dirac_audit_refutes_the_twin_and_not_the_mechanism():
    """100 Dirac canaries per training, each on its own unused coordinate and in with probability 1/2, pooled
    over 10 trainings (1,000 canaries): the sound DP-SGD stays below its claim, its twin (noise × 0.1) is refuted
    on both white-box rows, and DP-SGD without noise is refuted."""
    cell = _cells(algorithms=["dp_sgd"], epsilon=[1.0])[0]
    spec = AuditSpec(canaries=["dirac"], statistic="one_run", m_canaries=100, trials=10, chunk=10)
    rows = audit_cell(cell, spec)
    for r in rows:
        assert r["status"] == "ok" and r["epsilon_lo"] <= 1.0, r
        assert r["control_epsilon_lo"] > 1.0 and r["verdict"] == "consistent", r
    for r in rows:  # Steinke et al.'s bound beside the verdict's: below the claim, and the twin's above it
        assert 0 <= r["epsilon_lo_steinke"] <= 1.0 and r["control_epsilon_lo_steinke"] > 1.0, r
    noiseless = audit_cell(cell, spec.model_copy(update={"control": None}),
                           algorithm=cell.make_algorithm().with_noise_scale(0.0))
    assert max(r["epsilon_lo"] for r in noiseless) > 1.0 and noiseless[1]["verdict"] == "refuted", noiseless
    # the other canaries are refused, not run: their canaries interfere
    [row] = audit_cell(cell, spec.model_copy(update={"canaries": ["input"]}))
    assert row["status"] == "not applicable" and "dirac" in row["message"]


def test_one_training_of_a_gaussian_step_bounds_by_every_one_run_statistic():
    """One full-batch DP-SGD step (exactly μ-GDP on each Dirac canary) with 4,000 canaries in a single training
    (trials = 1): ε_lo, the f-DP test with the (ε, δ) curve, is the one-run audit's number (recomputed from the
    scores), above Steinke et al.'s on the same scores and below the μ-GDP curve's (a stronger hypothesis, valid
    here), both below the claim; the twin (noise × 0.1) is refuted by every one from its own single training."""
    cell = _cells(algorithms=[{"name": "dp_sgd", "accountant": "pld", "batch_size": [320], "epochs": [1],
                               "lr": [1.0]}], epsilon=[4.0])[0]
    spec = AuditSpec(canaries=["dirac"], statistic="one_run", m_canaries=4000, trials=1, chunk=1, ladder=[])
    scores: dict = {}
    for r in audit_cell(cell, spec, scores=scores):
        assert r["status"] == "ok" and r["steps"] == 1, r
        s_in, s_out = (scores[f"dirac.{r['threat_model'].replace(', ', '_').replace(' ', '_')}.{w}"]
                       for w in ("in", "out"))
        assert r["epsilon_lo"] == stats.epsilon_one_run_fdp(s_in, s_out, r["row_confidence"], r["delta"], "dp")
        assert 0 < r["epsilon_lo_steinke"] < r["epsilon_lo"] <= r["epsilon_lo_gdp"] <= r["epsilon_claimed"], r
        assert min(r["control_epsilon_lo"], r["control_epsilon_lo_steinke"], r["control_epsilon_lo_gdp"]) > 4, r
        assert r["verdict"] == "consistent", r


def test_a_single_training_is_a_one_run_audit_only():
    assert AuditSpec(statistic="one_run", canaries=["dirac"], trials=1).trials == 1
    with pytest.raises(pydantic.ValidationError, match="one_run"):
        AuditSpec(trials=1)


# --- one run, f-DP (Mahloujifar, Melis, Chaudhuri 2024) ------------------------------------------------------------

def _least_mass(m: int, guesses: int, correct: int, alpha: float, epsilon: float, delta: float) -> float:
    """An independent computation of the f-DP one-run test for (ε, δ)-DP, whose blow-up is piecewise linear: the
    least total probability of any distribution p_0..p_k of the number of right guesses with P[≥ correct] ≥ α
    and r_i ≤ f̄(h_{i−1}) for every i (r_i = Σ_{t≥i} t p_t/m, h_i = Σ_{t≥i} (k − t) p_t/m), a linear program;
    above 1 means no mechanism (ε, δ)-DP gives P[≥ correct] ≥ α."""
    t = np.arange(guesses + 1)
    tail = t[None, :] >= t[:, None]  # [i, t]: t ≥ i
    r, h = tail * t / m, tail * (guesses - t) / m
    e = np.exp(epsilon)
    A = np.vstack([r[1:] - e * h[:-1], r[1:] - h[:-1] / e, -(t >= correct)[None, :].astype(float)])
    b = np.r_[np.full(guesses, delta), np.full(guesses, 1 - (1 - delta) / e), -alpha]
    result = scipy.optimize.linprog(np.ones(guesses + 1), A_ub=A, b_ub=b, bounds=(0, None), method="highs")
    return result.fun if result.status == 0 else np.inf


def test_fdp_one_run_recursion_is_the_linear_program():
    """The recursion (the tail's mass at `correct`, each h_{i−1} the least allowed) decides as the linear
    program over every distribution does, for (ε, δ)-DP curves, at every count and ε tried."""
    cases = 0
    for m, guesses, alpha, delta in ((50, 20, 0.05, 0.0), (50, 20, 0.1, 1e-3), (200, 40, 0.05, 1e-5),
                                     (30, 30, 0.05, 0.0)):
        for correct in range(guesses // 2, guesses + 1, 2):
            for epsilon in np.linspace(0.0, 3.0, 7):
                least = _least_mass(m, guesses, correct, alpha, epsilon, delta)
                inverse = stats.dp_blow_up_inverse(epsilon, delta)
                rejects = stats.one_run_fdp_rejects(m, guesses, correct, alpha, inverse)
                assert rejects == (least > 1), (m, guesses, correct, epsilon, delta, least)
                cases += rejects
    assert cases > 20  # both answers occur


def test_fdp_one_run_false_refutations_of_exactly_tight_mechanisms_stay_below_alpha():
    """Randomized response canaries (each exactly ε-DP): the (ε, 0) curve is refuted at close to α (exact, not
    vacuous), as Steinke et al.'s binomial test; μ-GDP canaries scored by their shift (each exactly μ-GDP): μ-GDP
    is never refuted in 1,000 draws, while half of μ is refuted in nearly all of them."""
    rng = np.random.default_rng(5)
    m, alpha = 1000, 0.05
    for epsilon, guesses in ((1.0, 200), (2.0, 100)):
        right = rng.binomial(guesses, scipy.special.expit(epsilon), 4000)
        inverse = stats.dp_blow_up_inverse(epsilon, 0.0)
        decided = {c: stats.one_run_fdp_rejects(m, guesses, int(c), alpha, inverse) for c in np.unique(right)}
        rate = np.mean([decided[c] for c in right])
        assert 0.02 < rate <= alpha, (epsilon, rate)
    mu, k = 1.0, 100
    refuted = {mu: 0, mu / 2: 0}
    for _ in range(1000):
        included = rng.random(m) < 0.5
        ranked = included[np.argsort(rng.standard_normal(m) + mu * included)]
        right = int(ranked[m - k:].sum() + (~ranked[:k]).sum())
        for hypothesis in refuted:
            refuted[hypothesis] += stats.one_run_fdp_rejects(m, 2 * k, right, alpha,
                                                             stats.gdp_blow_up_inverse(hypothesis))
    assert refuted[mu] <= alpha * 1000 and refuted[mu / 2] > 900, refuted


def _tight_dp_canaries(rng: np.random.Generator, m: int, epsilon: float, delta: float):
    """m canaries, each in with probability 1/2, scored by a mechanism exactly (ε, δ)-DP (its trade-off curve is
    f_{ε,δ} itself, Kairouz, Oh, Viswanath 2015): with probability δ it reveals the bit (score ±2), else randomized
    response (±1, truthful with probability e^ε/(1 + e^ε)). Scores of the canaries in, and out."""
    included = rng.random(m) < 0.5
    sign = np.where(included, 1.0, -1.0)
    truthful = rng.random(m) < scipy.special.expit(epsilon)
    score = np.where(rng.random(m) < delta, 2 * sign, np.where(truthful, sign, -sign))
    return score[included], score[~included]


@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_one_run_verdict_false_refutations_of_tight_dp_mechanisms_stay_below_alpha(delta):
    """The one-run verdict's statistic (the f-DP test with the (ε, δ) curve, both guess families, Bonferroni) on
    400 draws of 1,000 canaries of a mechanism exactly (ε, δ)-DP, ε = 1: the claim is refuted in at most α of
    them — at δ = 1e-3 too, where 2mδ = 2 leaves Steinke et al.'s bound nothing (the δ mass reveals a canary in
    most draws)."""
    rng = np.random.default_rng([7, round(delta * 1e6)])
    epsilon, m, draws = 1.0, 1000, 400
    bounds = np.array([stats.epsilon_one_run_fdp(*_tight_dp_canaries(rng, m, epsilon, delta), 0.95, delta)
                       for _ in range(draws)])
    assert (bounds > epsilon).mean() <= 0.05, np.sort(bounds)[-25:]
    assert np.median(bounds) > 0.2 * epsilon  # not vacuous: the test sees the mechanism


def test_one_run_verdict_refutes_a_subsampled_twin_that_steinke_et_al_cannot():
    """Scores like the `audit` grid's dp_sgd twin at ε = 4 (noise × 0.1; q = 0.0053, T = 362; 10⁴ canaries in one
    training, δ = 1e-5): the 87% of in-canaries drawn at least once score above every out-canary, the rest as the
    out-canaries. Steinke et al.'s δ term (2mδ = 0.2) caps their bound below 4; the one-run row's ε_lo, the f-DP
    test with the (ε, δ) curve, refutes the claim; the μ-GDP curve's (not valid here) is higher still."""
    rng = np.random.default_rng(11)
    m, delta = 10_000, 1e-5
    included = rng.random(m) < 0.5
    s = rng.standard_normal(m) + 50.0 * (included & (rng.random(m) < 0.87))
    spec = AuditSpec(canaries=["dirac"], statistic="one_run", trials=1)
    row = _statistics(s[included], s[~included], spec, 0.95, Worlds({}, {"_delta_audit": delta}, ""), 4.0)
    assert row["epsilon_lo_steinke"] < 4 < row["epsilon_lo"] <= row["epsilon_lo_gdp"], row


def test_one_run_dp_curve_against_steinke_et_al_count_by_count():
    """At the same level on the same guesses, the f-DP test with the (ε, δ) curve is at most 0.008 below Steinke
    et al.'s (where m·δ ≤ 0.01: their binomial test is exact for pure DP), never below it where m·δ ≥ 0.1 (up to
    the bisection's 1e-4), and the subsampled twin's 2,000 of 2,000 right (m = 10⁴, δ = 1e-5) refute ε = 4 by it
    and not by Steinke et al.'s."""
    for m in (1000, 10_000):
        level = 0.05 / len(stats.guess_counts(m))
        for delta in (0.0, 1e-6, 1e-5, 1e-4):
            for k in (k for k in stats.guess_counts(m) if k >= 5):
                for correct in {round(f * k) for f in (0.6, 0.7, 0.8, 0.9, 1.0)}:
                    steinke = stats.epsilon_one_run_counts(m, k, correct, level, delta)
                    dp = stats.epsilon_one_run_fdp_counts(m, k, correct, level, delta, "dp")
                    assert dp >= steinke - (0.008 if m * delta <= 0.01 else 1e-4), (m, delta, k, correct)
    level = 0.05 / (2 * len(stats.guess_counts(10_000)))  # the verdict's family: both guess kinds
    assert (stats.epsilon_one_run_counts(10_000, 2000, 2000, level, 1e-5) < 4
            < stats.epsilon_one_run_fdp_counts(10_000, 2000, 2000, level, 1e-5, "dp"))


def _expected_two_sided_counts(mu: float, m: int, k: int) -> int:
    """Right guesses expected from guessing "in" for the k top and "out" for the k lowest of m canaries scored
    N(μ·in, 1): the mixture's quantiles t± at k/m from either end, m/2·(Φ(μ − t₊)^c + Φ(t₋))."""
    mixture = lambda t: (scipy.stats.norm.cdf(t) + scipy.stats.norm.cdf(t - mu)) / 2  # noqa: E731
    top = scipy.optimize.brentq(lambda t: 1 - mixture(t) - k / m, -20, 20)
    bottom = scipy.optimize.brentq(lambda t: mixture(t) - k / m, -20, 20)
    return int(m / 2 * (scipy.stats.norm.sf(top - mu) + scipy.stats.norm.cdf(bottom)))


def test_fdp_one_run_on_ideal_gaussian_canaries():
    """μ-GDP canaries at ε = 4, δ = 1e-5: the guesses' right count is the closed form's on average; at the
    expected counts the f-DP bound rises with m towards ε and stays below it, grows with the count, and is above
    Steinke et al.'s on the same counts (their (ε, δ) test; the paper's claim), more so with m·δ large."""
    delta = 1e-5
    mu = stats.gdp_mu_of_epsilon(4.0, delta)
    rng = np.random.default_rng(3)
    m, k = 10_000, 1000
    right = []
    for _ in range(40):
        included = rng.random(m) < 0.5
        s = rng.standard_normal(m) + mu * included
        right.append(dict(stats.one_run_guesses(s[included], s[~included])["both"])[2 * k])
    expected = _expected_two_sided_counts(mu, m, k)
    assert abs(np.mean(right) - expected) < 4 * np.std(right) / np.sqrt(40) + 1, (np.mean(right), expected)
    bounds = []
    for m in (10**3, 10**4, 10**5):
        k = m // 10
        c = _expected_two_sided_counts(mu, m, k)
        fdp = stats.epsilon_one_run_fdp_counts(m, 2 * k, c, 0.05, delta, "gdp")
        assert fdp >= stats.epsilon_one_run_fdp_counts(m, 2 * k, c - 5, 0.05, delta, "gdp")
        assert fdp >= stats.epsilon_one_run_fdp_counts(m, 2 * k, c, 0.05, delta, "dp")  # μ-GDP ⊂ (ε, δ)-DP
        assert fdp > stats.epsilon_one_run_counts(m, 2 * k, c, 0.05, delta)
        bounds.append(fdp)
    assert bounds == sorted(bounds) and 0.45 * 4 < bounds[-1] < 4, bounds
    # the (ε, δ) curve itself beats Steinke et al.'s δ term where m·δ is large
    m, guesses = 10_000, 1000
    assert (stats.epsilon_one_run_fdp_counts(m, guesses, 900, 0.05, 1e-3, "dp")
            > stats.epsilon_one_run_counts(m, guesses, 900, 0.05, 1e-3) + 1)


def test_cli_refuses_one_run_without_dirac_canaries_in_one_line(tmp_path):
    import subprocess
    import sys

    grid = tmp_path / "grid.yaml"
    grid.write_text("grids:\n  - {name: g, datasets: [{name: synthetic, n: 100, dim: 3}], algorithms: [dp_sgd], "
                    "epsilon: [1], seeds: 1, audit: {canaries: [input, dirac], statistic: one_run}}\n")
    proc = subprocess.run([sys.executable, "-m", "dpsgd_cli", "audit", str(grid), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "one_run needs canaries: [dirac]" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
