"""Every calibration the tests and experiments.yaml make returns the σ (and ε) recorded in
tests/data/calibration_pins.json, as floats, bit for bit: DP-SGD's lattice σ (RDP and PLD, both relations),
the single-example Gaussian's accountings (bassily2014, pidp_sgd's noisy steps), noisy GD's Rényi bounds and a
private selection's base ε. An error recorded for a setting (an unreachable target) must be raised again."""

import json
from pathlib import Path

import pytest

from dpsgd_cli.engine import selection
from dpsgd_cli.privacy import accounting, dynamics, single_example_gaussian

PINS = json.loads((Path(__file__).parent / "data" / "calibration_pins.json").read_text())


def _same(call, expected, setting):
    if isinstance(expected, dict):
        with pytest.raises(Exception) as caught:
            call()
        assert type(caught.value).__name__ == expected["error"], setting
        return
    got = call()
    got = [got.hex()] if isinstance(got, float) else [got.sigma.hex(), got.epsilon.hex()]
    assert got == expected, setting


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv(accounting.CACHE_DIR_ENV, "off")


@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_dpsgd_sigma_is_pinned(accountant):
    rows = [row for row in PINS["dpsgd"] if row[4] == accountant]
    assert len(PINS["dpsgd"]) >= 186 and rows
    for *args, expected in rows:
        _same(lambda: accounting.calibrate_sigma.__wrapped__(*args), expected, args)


@pytest.mark.slow
def test_single_example_gaussian_sigma_is_pinned():
    for *args, expected in PINS["single_example_gaussian"]:
        _same(lambda: single_example_gaussian._calibrate_bassily(*args), expected, args)


def test_noisy_gd_sigma_is_pinned():
    for *args, expected in PINS["noisy_gd"]:
        _same(lambda: dynamics.calibrate_noisy_gd(*args), expected, args)


def test_selection_base_epsilon_is_pinned():
    assert PINS["selection"]
    for *args, expected in PINS["selection"]:
        _same(lambda: selection._base_epsilon.__wrapped__(*args), expected, args)
