"""The contract every registered algorithm keeps (`dpsgd_cli.contract`, the checks `dpsgd check` runs on a
plugin), checked the same way for each (as scikit-learn's common estimator checks do): adding an algorithm file
adds it here without a line of test code."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from dpsgd_cli import compiled, contract
from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.algorithms.ops import Noise, Sgd, constant


def _with(cls, **fixed):
    """`cls` with parameters that default to `fixed`: a variant of a built-in that runs other ops."""

    class Variant(cls):  # type: ignore[misc,valid-type]
        def __init__(self, params=None, neighbours=None):
            super().__init__({**fixed, **(params or {})}, neighbours)

    return Variant


# built-ins whose parameters change the chain (adaptive clipping: its own op, compiled and fused on the mini-batch
# kernel), each under the contract as its own subject
VARIANTS = {f"{name}-adaptive": _with(ALGORITHMS[name], clip_quantile=0.5) for name in ("dp_sgd", "dp_adam")}
NAMES = sorted(ALGORITHMS) + sorted(VARIANTS)
# whose σ calibration takes > 10 s on a fresh cache: their training checks are marked slow
SLOW = {"bassily2014", "pidp_sgd"}
# the checks that train (the others read the class, or call check())
TRAINING = {"theta", "deterministic", "independent", "guarantee", "columns", "claim", "compiled", "fused", "refusals"}
SUBJECTS: dict[str, contract.Subject] = {}


def _cases():
    for name in NAMES:
        for check in contract.CHECKS:
            slow = name in SLOW and check in TRAINING
            yield pytest.param(name, check, id=f"{name}-{check}", marks=[pytest.mark.slow] if slow else [])


def test_every_algorithm_is_registered_under_its_name():
    assert ALGORITHMS and all(ALGORITHMS[name].name == name for name in ALGORITHMS)


@pytest.mark.parametrize("name, check", list(_cases()))
def test_the_algorithm_keeps_the_contract(name, check):
    subject = SUBJECTS.setdefault(name, contract.Subject(ALGORITHMS.get(name) or VARIANTS[name]))
    try:
        contract.CHECKS[check](subject)
    except contract.NotApplicable as reason:
        pytest.skip(str(reason))


def test_the_check_of_the_claim_catches_too_little_noise():
    """The claim check can fail: dp_sgd's event with half the noise it calibrated exceeds its claim."""
    subject = contract.Subject(ALGORITHMS["dp_sgd"])
    derived = dict(subject.trained[0].derived)
    derived["sigma"] /= 2
    event = ALGORITHMS["dp_sgd"]().dp_event(subject.setting, derived)
    assert contract.library_epsilon(event, subject.setting.delta, "add_remove") > 1.5 * subject.setting.epsilon


def test_params_that_take_any_key_break_the_contract():
    """The params check can fail: a Params model without extra="forbid" is reported."""

    class Lax(ALGORITHMS["sgd"]):  # type: ignore[misc,valid-type]
        Params = dataclasses.make_dataclass("P", [])  # not a pydantic model

    with pytest.raises(contract.Broken, match="not a pydantic model"):
        contract.check_params(contract.Subject(Lax))


class _ByBackend(ALGORITHMS["dp_sgd"]):  # type: ignore[misc,valid-type]
    """Trains another learning rate on the compiled step than on NumPy."""

    def chain(self, setting, X, y, streams, private=(), smoothing=()):
        chain = super().chain(setting, X, y, streams, private, smoothing)
        if self.params.backend == "numpy":
            return chain
        faster = Sgd(constant(setting.lr * 1.01))
        return dataclasses.replace(chain, ops=[faster if isinstance(op, Sgd) else op for op in chain.ops])


class _SharedGenerator(ALGORITHMS["sgd"]):  # type: ignore[misc,valid-type]
    """Draws noise from one generator every training shares, not from its seeds' streams."""

    generator = np.random.default_rng(0)

    def prepare(self, setting, model, X, y, streams):
        prepared = super().prepare(setting, model, X, y, streams)
        draws = (self.generator.normal(size=prepared.theta.shape) for _ in itertools.count())
        prepared.chain = dataclasses.replace(prepared.chain, ops=[Noise(0.1, draws), *prepared.chain.ops])
        return prepared


@pytest.mark.parametrize("cls, check, message", [
    (_ByBackend, "compiled", "the compiled θ differs from NumPy's"),
    (_SharedGenerator, "deterministic", "training twice with the same seeds gives another θ"),
    (_SharedGenerator, "fused", "θ trained beside other chains differs from θ trained alone"),
])
def test_the_compiled_and_fused_checks_can_fail(cls, check, message):
    if check == "compiled" and not compiled.HAVE_NUMBA:
        pytest.skip("numba not installed")
    with pytest.raises(contract.Broken, match=message):
        contract.CHECKS[check](contract.Subject(cls))
