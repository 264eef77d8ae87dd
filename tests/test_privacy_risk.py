"""The accountant's bound on a membership test's power (privacy/risk.py) against closed forms: one Gaussian
mechanism's exact trade-off Φ(Φ⁻¹(α) + μ), pure ε-DP's e^ε α, μ-GDP's privacy profile."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from dp_accounting import dp_event
from scipy.stats import norm

from dpsgd_cli.audit.engine import COLUMNS as AUDIT_COLUMNS
from dpsgd_cli.engine import runner
from dpsgd_cli.engine.results import COLUMNS, NUMERIC
from dpsgd_cli.privacy import accounting, risk

FPRS = {1e-2: "tpr_bound_fpr_1e-2", 1e-3: "tpr_bound_fpr_1e-3"}


def gaussian_delta(mu, epsilon):
    """δ_μ(ε) of μ-GDP (Dong, Roth & Su 2022, Corollary 2.13), written out here with scipy.stats."""
    return norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2)


@pytest.mark.parametrize("sigma, count", [(0.5, 1), (1.0, 1), (2.0, 1), (4.0, 1), (18.0, 20), (2.85, 20)])
def test_gaussian_mechanisms_are_bounded_just_above_their_exact_trade_off(sigma, count):
    """T Gaussian mechanisms of noise σ (sensitivity 1) are exactly √T/σ-GDP: TPR = Φ(Φ⁻¹(α) + √T/σ)."""
    exact = {fpr: norm.cdf(norm.ppf(fpr) + math.sqrt(count) / sigma) for fpr in FPRS}
    event = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), count)
    columns = risk.attack_risk(event, "add_remove", None, 1e-5)
    assert columns["tpr_bound_from"] == "pld"
    for fpr, column in FPRS.items():
        bound = columns[column]
        assert exact[fpr] <= bound <= exact[fpr] * 1.01, (sigma, fpr, bound, exact[fpr])


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 3.0])
def test_pure_epsilon_dp_without_an_event_is_bounded_by_e_to_the_epsilon_alpha(epsilon):
    columns = risk.attack_risk(None, "replace_one", epsilon, 0.0)
    for fpr, column in FPRS.items():
        assert columns[column] == pytest.approx(math.exp(epsilon) * fpr, rel=1e-12)
    assert columns["tpr_bound_from"] == "epsilon_delta" and math.isnan(columns["gdp_mu"])


def test_no_event_and_no_proved_claim_bounds_nothing():
    columns = risk.attack_risk(None, "add_remove", None, 1e-5)
    assert all(math.isnan(columns[c]) for c in (*FPRS.values(), "gdp_mu")) and columns["tpr_bound_from"] is None


def test_the_region_of_one_pair_is_kairouz_et_al():
    # below the crossing the e^ε α + δ side binds, above it the complement's side
    assert risk.tpr_bound(1e-3, 1.0, 1e-5) == pytest.approx(math.e * 1e-3 + 1e-5, rel=1e-12)
    assert risk.tpr_bound(0.6, 1.0, 1e-5) == pytest.approx(1 - math.exp(-1) * (1 - 1e-5 - 0.6), rel=1e-12)
    assert risk.tpr_bound(0.5, 10.0, 0.0) == pytest.approx(1 - math.exp(-10) * 0.5, rel=1e-12)
    assert risk.tpr_bound(1e-3, 1.0, 1.0) == 1.0


def dpsgd(epsilon, q=0.02, steps=150, delta=1e-5):
    cal = accounting.calibrate_sigma(epsilon, delta, q, steps, "rdp")
    return accounting.dpsgd_event(cal.sigma, q, steps), cal.epsilon


def test_the_bound_grows_with_epsilon():
    rows = [risk.attack_risk(*(lambda e: (e[0], "add_remove", e[1], 1e-5))(dpsgd(eps))) for eps in (0.5, 1, 2, 4)]
    for column in (*FPRS.values(), "gdp_mu"):
        values = [r[column] for r in rows]
        assert values == sorted(values) and len(set(values)) == len(values), (column, values)
    singles = [risk.tpr_bound(1e-3, eps, 1e-5) for eps in np.linspace(0, 8, 81)]
    assert singles == sorted(singles)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 4.0])
def test_dp_sgd_s_whole_profile_bounds_below_its_single_claim(epsilon):
    event, claimed = dpsgd(epsilon)
    pld = accounting.epsilon_for(event, 1e-5, "pld")  # the profile's own ε at δ: the tightest single pair
    profile = risk.attack_risk(event, "add_remove", None, 1e-5)
    for fpr, column in FPRS.items():
        single = risk.tpr_bound(fpr, pld, 1e-5)
        assert profile[column] < single <= risk.tpr_bound(fpr, claimed, 1e-5), (fpr, profile[column], single)


def test_a_claim_tighter_than_the_profile_is_kept():
    event, _ = dpsgd(1.0)
    loose = risk.attack_risk(event, "add_remove", 5.0, 1e-5)  # the profile is tighter than ε = 5
    tight = risk.attack_risk(event, "add_remove", 0.01, 1e-5)  # a (false) claim tighter than the profile
    assert tight["tpr_bound_fpr_1e-3"] == pytest.approx(math.exp(0.01) * 1e-3 + 1e-5, rel=1e-12)
    assert tight["tpr_bound_fpr_1e-3"] < loose["tpr_bound_fpr_1e-3"] < risk.tpr_bound(1e-3, 5.0, 1e-5)


@pytest.mark.parametrize("mu, epsilon", [(0.25, 1.0), (1.0, 1.0), (1.0, 0.0), (3.0, 2.5), (0.05, 0.2)])
def test_gdp_mu_is_the_root_of_the_gaussian_profile(mu, epsilon):
    assert risk.gdp_mu(epsilon, gaussian_delta(mu, epsilon)) == pytest.approx(mu, rel=1e-9)
    assert risk.gaussian_delta(mu, epsilon) == pytest.approx(gaussian_delta(mu, epsilon), rel=1e-12)


def test_gdp_mu_of_one_gaussian_mechanism_is_its_sensitivity_over_sigma():
    sigma = 2.0
    epsilon = accounting.epsilon_for(dp_event.GaussianDpEvent(sigma), 1e-5, "pld")
    mu = risk.attack_risk(dp_event.GaussianDpEvent(sigma), "add_remove", epsilon, 1e-5)["gdp_mu"]
    assert mu == pytest.approx(1 / sigma, rel=1e-3) and mu >= 1 / sigma  # the PLD's ε is an upper bound


def test_gdp_mu_is_not_read_for_pure_dp_or_a_non_gaussian_event():
    assert math.isnan(risk.gdp_mu(1.0, 0.0))
    columns = risk.attack_risk(dp_event.LaplaceDpEvent(1.0), "add_remove", 1.0, 0.0)
    assert math.isnan(columns["gdp_mu"]) and columns["tpr_bound_fpr_1e-2"] <= math.e * 1e-2 * (1 + 1e-12)


def test_an_event_the_pld_does_not_take_is_bounded_by_the_rdp_profile():
    # sampling without replacement under replace-one (bassily2014's event): no PLD, an RDP profile
    event = dp_event.SelfComposedDpEvent(dp_event.SampledWithoutReplacementDpEvent(
        100, 1, dp_event.GaussianDpEvent(1.0)), 100)
    columns = risk.attack_risk(event, "replace_one", None, 1e-5)
    assert columns["tpr_bound_from"] == "rdp" and math.isnan(columns["gdp_mu"])
    epsilon = accounting.epsilon_for(event, 1e-5, "rdp", "replace_one")
    for fpr, column in FPRS.items():
        assert fpr < columns[column] <= risk.tpr_bound(fpr, epsilon, 1e-5) * (1 + 1e-9)
    assert risk.attack_risk(event, "replace_one", epsilon, 1e-5)["gdp_mu"] > 0


class OwnAnalysis:
    """A private algorithm whose claim rests on its own analysis (no dp_event), as pidp_sgd or song2013."""

    def dp_event(self, setting, derived):
        return None

    def neighbouring(self):
        return "add_remove"


@pytest.mark.parametrize("guarantee, derived, delta", [
    ("proved", {}, 1e-5), ("proved", {"delta_achieved": 0.0}, 0.0),
    ("tv-bound: (1, 0.0003)-DP [...]", {"delta_certified": 3e-4}, 3e-4),  # pidp_sgd: (ε, δ′), δ′ certified
    ("none: the assumption failed", {"delta_certified": float("nan")}, None)])
def test_a_row_without_an_event_is_bounded_by_the_claim_it_proves(guarantee, derived, delta):
    columns = runner.risk_columns(OwnAnalysis(), SimpleNamespace(delta=1e-5), guarantee, derived, 1.0)
    if delta is None:  # nothing proved: nothing bounded
        assert all(math.isnan(columns[c]) for c in FPRS.values()) and columns["tpr_bound_from"] is None
        return
    for fpr, column in FPRS.items():
        assert columns[column] == pytest.approx(min(1, math.e * fpr + delta), rel=1e-12)
    assert columns["tpr_bound_from"] == "epsilon_delta" and math.isnan(columns["gdp_mu"])


def test_the_columns_are_runs_csv_s_and_the_audit_s():
    assert set(risk.COLUMNS) <= set(COLUMNS) and set(risk.BOUND_COLUMNS.values()) <= set(AUDIT_COLUMNS)
    assert {c for c in risk.COLUMNS if c in NUMERIC} == {*risk.BOUND_COLUMNS.values(), "gdp_mu"}
