"""The contract every registered algorithm keeps, checked the same way for each (as scikit-learn's common
estimator checks do): adding an algorithm file adds it here without a line of test code.

On a small synthetic logistic problem (rows in the unit ball), with 2 seeds: θ has shape (R, P) and is finite;
the same seed gives the same θ bit for bit; each seed trains independently of the others (replica 1 trained
beside replica 0 equals it trained alone, to 1e-12); the `guarantee` label is one of the documented forms
(docs/algorithms.md, "Guarantee labels"); `check()` accepts a valid setting; the native neighbouring relation is
add_remove or replace_one; `Params` is a frozen pydantic model that refuses unknown keys; the claimed ε holds,
by dp-accounting's own accountants, for the mechanism as run (`dp_event`), or the algorithm names its own analysis.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pydantic
import pytest

from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.engine import runner
from dpsgd_cli.models import make_model

N, D = 400, 5
SETTING = Setting(n=N, d=D, delta=1e-5, l2=1e-2, epsilon=1.0, batch_size=40, lr=0.5, epochs=2, clip_norm=1.0)
# what an algorithm's check() requires of the shared setting (pidp_sgd's paper sampling: one example per step)
OVERRIDES: dict[str, dict[str, float]] = {"pidp_sgd": {"batch_size": 1, "epochs": 1}}
SEEDS = [0, 1]


def _setting(name: str) -> Setting:
    return dataclasses.replace(SETTING, **OVERRIDES.get(name, {}))


@pytest.fixture(scope="module")
def problem(make_logistic_data):
    X, y = make_logistic_data(3, N, [1.0, -2.0, 0.5, 0.0, 1.0], 0.1)
    return X, y, make_model("logreg", D, SETTING.l2)


@pytest.fixture(scope="module")
def trained(problem):
    """name → (θ with seeds 0 and 1, θ again with the same seeds, θ with seed 1 alone, the Outcome)."""
    X, y, model = problem
    cache = {}

    def train(name: str):
        if name not in cache:
            algo, setting = ALGORITHMS[name](), _setting(name)
            first = algo.fit(setting, model, X, y, ReplicaStreams(SEEDS))
            again = algo.fit(setting, model, X, y, ReplicaStreams(SEEDS)).theta
            alone = algo.fit(setting, model, X, y, ReplicaStreams(SEEDS[1:])).theta
            cache[name] = first.theta, again, alone, first
        return cache[name]

    return train


NAMES = sorted(ALGORITHMS)
# whose σ calibration takes > 10 s on a fresh cache: their training checks are marked slow
SLOW = {"bassily2014", "pidp_sgd"}
TRAINED = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in NAMES]


def test_every_algorithm_is_registered_under_its_name():
    assert NAMES and all(ALGORITHMS[name].name == name for name in NAMES)


@pytest.mark.parametrize("name", TRAINED)
def test_theta_has_one_finite_row_per_seed(trained, problem, name):
    theta = trained(name)[0]
    assert theta.shape == (len(SEEDS), problem[2].n_params)
    assert np.all(np.isfinite(theta))


@pytest.mark.parametrize("name", TRAINED)
def test_the_same_seed_gives_the_same_theta(trained, name):
    first, again, _, _ = trained(name)
    np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("name", TRAINED)
def test_seeds_train_independently(trained, name):
    together, _, alone, _ = trained(name)
    np.testing.assert_allclose(together[1], alone[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", TRAINED)
def test_guarantee_is_a_documented_label(trained, name):
    guarantee = trained(name)[3].guarantee
    assert isinstance(guarantee, str)
    if not ALGORITHMS[name].private:
        assert guarantee == "non-private"
    else:
        assert guarantee == "proved" or guarantee.startswith(("none: ", "tv-bound: ")), guarantee


@pytest.mark.parametrize("name", TRAINED)
def test_derived_values_set_only_the_columns_a_run_reports(trained, name):
    """A row's other columns come from the cell, the metrics or the runner; a private algorithm's σ, achieved ε and
    accountant are what its verified calibration gave. A collision would fail the run (`reported_columns`)."""
    outcome = trained(name)[3]
    reported = runner.reported_columns(outcome.derived, len(SEEDS), ALGORITHMS[name].private)
    assert "epsilon_achieved" in reported or not ALGORITHMS[name].private


@pytest.mark.parametrize("name", NAMES)
def test_check_accepts_a_valid_setting(name):
    algo = ALGORITHMS[name]()
    assert callable(algo.check)
    algo.check(_setting(name), "logreg")


@pytest.mark.parametrize("name", NAMES)
def test_native_neighbours_is_a_known_relation(name):
    assert ALGORITHMS[name]().native_neighbours() in {"add_remove", "replace_one", "zero_out"}


@pytest.mark.parametrize("name", NAMES)
def test_params_are_frozen_and_refuse_unknown_keys(name):
    params_cls = ALGORITHMS[name].Params
    assert issubclass(params_cls, pydantic.BaseModel)
    assert params_cls.model_config.get("frozen") is True
    assert params_cls.model_config.get("extra") == "forbid"
    with pytest.raises(pydantic.ValidationError):
        params_cls(not_a_parameter=1)
    params = ALGORITHMS[name]().params
    for field in type(params).model_fields:
        with pytest.raises(pydantic.ValidationError):
            setattr(params, field, getattr(params, field))


# integer orders (sampling without replacement has its RDP bound there), fractional ones below 64 and large ones
RDP_ORDERS = sorted({*range(2, 300), *np.linspace(1.05, 64.0, 200).tolist(), *np.geomspace(300.0, 1e4, 60).tolist()})


def _library_epsilon(event, delta: float, neighbours: str) -> float:
    """The smallest ε that dp-accounting's own accountants (RDP on a dense order grid; PLD, pessimistic) give for
    the event, independently of the project's accounting code."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    relation = {"add_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                "replace_one": dp_accounting.NeighboringRelation.REPLACE_ONE,
                "zero_out": dp_accounting.NeighboringRelation.REPLACE_SPECIAL}[neighbours]
    found = []
    for accountant in (RdpAccountant(RDP_ORDERS, relation), PLDAccountant(relation, 1e-4)):
        if accountant.supports(event):
            found.append(accountant.compose(event).get_epsilon(delta))
    assert found, f"no dp-accounting accountant supports {event}"
    return min(found)


@pytest.mark.parametrize("name", TRAINED)
def test_the_claim_holds_for_the_mechanism_as_run_or_names_its_analysis(trained, problem, name):
    """A private algorithm states the mechanism it ran (with the noise it added) as a dp-accounting event, and the
    library's accountants give that event an ε within the claimed one (at the setting's δ, under the claim's
    relation); or, where the library has no event for it, it names the analysis its claim rests on."""
    import dp_accounting

    algo, setting = ALGORITHMS[name](), _setting(name)
    outcome = trained(name)[3]
    event = algo.dp_event(setting, outcome.derived)
    if not algo.private:
        assert isinstance(event, dp_accounting.NonPrivateDpEvent)
        return
    if event is None:
        assert algo.own_analysis, f"{name}: no dp-accounting event and no own analysis named"
        return
    if outcome.guarantee != "proved":  # e.g. the classic Gaussian formula proves nothing at ε ≥ 1: check at ε = 0.5
        setting = dataclasses.replace(setting, epsilon=0.5)
        outcome = algo.fit(setting, problem[2], problem[0], problem[1], ReplicaStreams(SEEDS))
        event = algo.dp_event(setting, outcome.derived)
    claimed = outcome.derived["epsilon_achieved"]
    assert outcome.guarantee == "proved" and claimed <= setting.epsilon
    assert _library_epsilon(event, setting.delta, algo.neighbouring()) <= claimed * (1 + 1e-3)


def test_the_check_of_the_claim_catches_too_little_noise(trained):
    """The check above can fail: dp_sgd's event with half the noise it calibrated exceeds its claim."""
    algo, setting = ALGORITHMS["dp_sgd"](), _setting("dp_sgd")
    derived = dict(trained("dp_sgd")[3].derived)
    derived["sigma"] /= 2
    assert _library_epsilon(algo.dp_event(setting, derived), setting.delta, "add_remove") > 1.5 * setting.epsilon
