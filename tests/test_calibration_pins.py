"""Every calibration the tests and experiments.yaml make meets its definition and agrees with the σ (and ε) recorded
in tests/data/calibration_pins.json: DP-SGD's σ is the smallest lattice point whose ε meets the target (RDP and PLD,
both relations); the single-example Gaussian's accountings (bassily2014, pidp_sgd's noisy steps), noisy GD's Rényi
bounds and a private selection's base ε stop in the target's window, where the recorded search stopped up to its
width. An error recorded for a setting (an unreachable target) must be raised again. No comparison is by bits: the
accountants' vectorised exp and log differ by an ulp between CPUs."""

import json
import math
from pathlib import Path

import pytest
from calibration_checks import BRENT_SIGMA_RTOL, assert_in_window, assert_lattice_point

from dpsgd_cli.engine import selection
from dpsgd_cli.privacy import accounting, dynamics, single_example_gaussian

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


@pytest.mark.slow
def test_single_example_gaussian_sigma_is_pinned():
    for *args, expected in PINS["single_example_gaussian"]:
        call = lambda: single_example_gaussian._calibrate_bassily(*args)  # noqa: B023
        if not _raises_recorded(call, expected, args):
            got = call()
            assert_in_window(got.sigma, got.epsilon, args[0], expected, args)


def test_noisy_gd_sigma_is_pinned():
    for *args, expected in PINS["noisy_gd"]:
        call = lambda: dynamics.calibrate_noisy_gd(*args)  # noqa: B023
        if not _raises_recorded(call, expected, args):
            got = call()
            assert_in_window(got.sigma, got.epsilon, args[0], expected, args)


def test_selection_base_epsilon_is_pinned():
    assert PINS["selection"]
    for *args, expected in PINS["selection"]:
        call = lambda: selection._base_epsilon.__wrapped__(*args)  # noqa: B023
        if not _raises_recorded(call, expected, args):
            assert math.isclose(call(), expected[0], rel_tol=BRENT_SIGMA_RTOL), args
