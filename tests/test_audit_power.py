"""`dpsgd audit` with proven power: the Dirac canary and its per-step likelihood ratio, the positive control,
ceilings, family-wise confidence, verdicts tied to what a claim covers, and the GDP estimate, each checked
against a closed form or an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats

from dpsgd_cli.audit import canaries, stats
from dpsgd_cli.audit.engine import _verdict, audit_cell
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


def test_audit_figure_draws_the_ceiling():
    import pandas as pd

    from dpsgd_cli.audit.plot import audit_figure

    frame = pd.DataFrame([{"status": "ok", "epsilon_lo": 0.2, "epsilon_claimed": 1.0, "ceiling": 3.84,
                           "threat_model": "white-box, all iterates", "algorithm": "dp_sgd", "verdict": "consistent"}])
    fig = audit_figure(frame)
    lines = [line for ax in fig.axes for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert any(np.allclose(line.get_ydata(), 3.84) for line in lines)
