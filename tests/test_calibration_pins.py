"""Every calibration the tests and experiments.yaml make meets its definition and agrees with the σ (and ε) recorded
in tests/data/calibration_pins.json: σ is the smallest point of the calibration lattice whose ε meets the target,
for DP-SGD (RDP and PLD, both relations), the single-example Gaussian's accountings (bassily2014, pidp_sgd's noisy
steps: on the noise multiplier σ/(2l) for RDP and PLD), noisy GD's Rényi bounds and a private selection's base ε
(on 1/ε_base); the accountants' ε is dp-accounting's where the mechanism is one of its events. A closed form is its
formula. An error recorded for a setting (an unreachable target) must be raised again. No comparison is by bits: the
accountants' vectorised exp and log differ by an ulp between CPUs."""

import json
import math
from pathlib import Path

import dp_accounting
import pytest
from calibration_checks import assert_lattice_point, curve_of

from dpsgd_cli.engine import selection
from dpsgd_cli.privacy import accounting, dynamics, single_example_gaussian
from dpsgd_cli.privacy.calibration import _LATTICE_LEVELS, LATTICE_STEP
from dpsgd_cli.privacy.single_example_gaussian import chain_bound, pld_epsilon, pld_event, rdp_epsilon, rdp_event

PINS = json.loads((Path(__file__).parent / "data" / "calibration_pins.json").read_text())


def _raises_recorded(call, expected, setting) -> bool:
    """True (having checked it) where the recorded outcome is an error."""
    if not isinstance(expected, dict):
        return False
    with pytest.raises(Exception) as caught:
        call()
    assert type(caught.value).__name__ == expected["error"], setting
    return True


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv(accounting.CACHE_DIR_ENV, "off")


@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_dpsgd_sigma_is_pinned(accountant):
    rows = [row for row in PINS["dpsgd"] if row[4] == accountant]
    assert len(PINS["dpsgd"]) >= 186 and rows
    for *args, expected in rows:
        call = lambda: accounting.calibrate_sigma.__wrapped__(*args)  # noqa: B023
        if not _raises_recorded(call, expected, args):
            cal = call()
            assert_lattice_point(cal.sigma, cal.epsilon, args[0], accounting.dpsgd_curve(*args[1:]), expected[0], args)


def _library_epsilon(accounting_name: str, multiplier: float, n: int, steps: int, delta: float, h: float) -> float:
    """ε of the single-example Gaussian's event by dp-accounting's own accountant, replace-one."""
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    if accounting_name == "rdp":
        library = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS), relation)
        return float(library.compose(rdp_event(multiplier, n, steps)).get_epsilon(delta))
    library = dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=h)
    return float(library.compose(pld_event(multiplier, n, steps)).get_epsilon(delta))


@pytest.mark.slow
def test_single_example_gaussian_sigma_is_pinned():
    for *args, expected in PINS["single_example_gaussian"]:
        call = lambda: single_example_gaussian._calibrate_bassily(*args)  # noqa: B023
        if _raises_recorded(call, expected, args):
            continue
        got = call()
        epsilon, delta, n, steps, lipschitz, accounting_name, _, amplification = args
        if accounting_name == "closed_form":
            assert math.isclose(got.sigma, expected[0], rel_tol=1e-12) and got.epsilon == epsilon, args
        elif accounting_name == "advanced_composition":
            gaussian = "analytic" if amplification == "tight" else "classical"
            curve = curve_of(lambda s: chain_bound(s, delta, n, steps, lipschitz, amplification, gaussian).epsilon)
            assert_lattice_point(got.sigma, got.epsilon, epsilon, curve, expected[0], args)
        else:  # the lattice is on the noise multiplier z = σ / (2l)
            z, h = got.details["noise_multiplier"], got.details.get("value_discretization_interval")
            assert got.sigma == 2.0 * lipschitz * z, args
            func = rdp_epsilon if accounting_name == "rdp" else pld_epsilon
            curve = curve_of(lambda m: func(m, n, steps, delta)[0])  # noqa: B023
            assert_lattice_point(z, got.epsilon, epsilon, curve, expected[0] / (2.0 * lipschitz), args)
            assert math.isclose(got.epsilon, _library_epsilon(accounting_name, z, n, steps, delta, h),
                                rel_tol=1e-9), args


def test_noisy_gd_sigma_is_pinned():
    for *args, expected in PINS["noisy_gd"]:
        call = lambda: dynamics.calibrate_noisy_gd(*args)  # noqa: B023
        if not _raises_recorded(call, expected, args):
            got = call()
            target, delta, K, eta, lam, n, sensitivity, accountant = args
            curve = curve_of(lambda s: dynamics.noisy_gd_epsilon(s, delta, K, eta, lam, n, sensitivity, accountant),
                             sigma_min=1e-9)
            assert_lattice_point(got.sigma, got.epsilon, target, curve, expected[0], args)


def test_selection_base_epsilon_is_pinned():
    assert PINS["selection"]
    for *args, expected in PINS["selection"]:
        call = lambda: selection._base_epsilon.__wrapped__(*args)  # noqa: B023
        if _raises_recorded(call, expected, args):
            continue
        tuning_json, target, n, delta = args
        total = selection.total_epsilon(json.loads(tuning_json), n, delta)
        base = call()
        finest = LATTICE_STEP / 2**_LATTICE_LEVELS  # the lattice is on x = 1 / ε_base; 1 / ε_base rounds it
        x = math.exp(round(math.log(1.0 / base) / finest) * finest)
        assert math.isclose(1.0 / x, base, rel_tol=1e-15), args
        assert_lattice_point(x, total(x), target, curve_of(total, sigma_min=1.0 / target), 1.0 / expected[0], args)
