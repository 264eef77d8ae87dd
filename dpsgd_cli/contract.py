"""The contract every algorithm keeps, built in or a plugin (`CHECKS`, each function's docstring saying what it
checks): `dpsgd check FILE.py` runs it on a plugin's algorithms, tests/test_algorithm_contract.py on every built-in
one. On a small logistic problem (rows in the unit ball), 2 seeds, the first of `SETTINGS` that `check()` accepts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import dp_accounting
import numpy as np
import pydantic
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Algorithm, Outcome, Setting
from dpsgd_cli.algorithms.chain import train_together
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.engine.runner import reported_columns
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy.accounting import quiet_rdp

N, D, SEEDS = 400, 5, (0, 1)
SETTING = Setting(n=N, d=D, delta=1e-5, l2=1e-2, epsilon=1.0, batch_size=40, lr=0.5, epochs=2, clip_norm=1.0)
# the contract's settings, the first that `check()` accepts is used: mini-batches, then one example per step
# (pidp_sgd's paper sampling)
SETTINGS = (SETTING, dataclasses.replace(SETTING, batch_size=1, epochs=1))
# settings a `check()` either refuses or trains: a batch of one, the full batch, no regulariser and half a pass
PROBES = ({"batch_size": 1}, {"batch_size": N}, {"l2": 0.0, "epochs": 0.5})
COMPILED_RTOL = 1e-12  # NumPy and compiled steps differ by summation order only
CLAIM_RTOL = 1e-3  # dp-accounting's ε may exceed the claim by this much (the accountants' own discretisation)
# integer orders (sampling without replacement has its RDP bound there), fractional ones below 64 and large ones
RDP_ORDERS = sorted({*range(2, 300), *np.linspace(1.05, 64.0, 200).tolist(), *np.geomspace(300.0, 1e4, 60).tolist()})


class Broken(AssertionError):
    """The algorithm breaks a check; the message says how."""


class NotApplicable(Exception):
    """The check does not apply to the algorithm (e.g. it is not one gradient chain)."""


def problem() -> tuple[np.ndarray, np.ndarray]:
    """Gaussian rows scaled into the unit ball, labels sign(X·w + 0.1·N(0, 1)) in {−1, +1}."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(N, D))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    return X, np.where(X @ np.array([1.0, -2.0, 0.5, 0.0, 1.0]) + 0.1 * rng.normal(size=N) > 0, 1.0, -1.0)


class Subject:
    """One algorithm under the contract, its trainings made once."""

    def __init__(self, cls: type[Algorithm]):
        self.cls = cls
        self.X, self.y = problem()
        self.model = make_model("logreg", D, SETTING.l2)

    @functools.cached_property
    def setting(self) -> Setting:
        refusals = []
        for setting in SETTINGS:
            try:
                self.cls().check(setting, "logreg")
                return setting
            except UserError as exc:
                refusals.append(str(exc))
        raise Broken(f"check() refuses every contract setting: {' / '.join(refusals)}")

    def fit(self, setting: Setting | None = None, seeds: tuple[int, ...] = SEEDS) -> Outcome:
        return self.cls().fit(setting or self.setting, self.model, self.X, self.y, ReplicaStreams(seeds))

    @functools.cached_property
    def trained(self) -> tuple[Outcome, np.ndarray, np.ndarray]:
        """(the Outcome of seeds 0 and 1, θ again with the same seeds, θ of seed 1 alone)."""
        return self.fit(), self.fit().theta, self.fit(seeds=SEEDS[1:]).theta


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise Broken(message)


def check_setting(s: Subject) -> None:
    """check() accepts a contract setting"""
    _require(isinstance(s.setting, Setting), "no setting")


def check_theta(s: Subject) -> None:
    """θ has one finite row per seed"""
    theta = s.trained[0].theta
    _require(theta.shape == (len(SEEDS), s.model.n_params), f"θ has shape {theta.shape}, not (seeds, parameters) = "
             f"{(len(SEEDS), s.model.n_params)}")
    _require(bool(np.all(np.isfinite(theta))), "θ is not finite")


def check_deterministic(s: Subject) -> None:
    """the same seed gives the same θ bit for bit"""
    _require(np.array_equal(s.trained[0].theta, s.trained[1]), "training twice with the same seeds gives another θ")


def check_independent(s: Subject) -> None:
    """each seed trains independently of the others"""
    first, _, alone = s.trained
    _require(np.allclose(first.theta[1], alone[0], rtol=1e-12, atol=0),
             f"seed {SEEDS[1]} trained beside seed {SEEDS[0]} differs from it trained alone")


def check_guarantee(s: Subject) -> None:
    """guarantee is a documented label"""
    guarantee = s.trained[0].guarantee
    if not s.cls.tags.private:
        _require(guarantee == "non-private", f"a non-private algorithm's guarantee is {guarantee!r}, not 'non-private'")
    else:
        documented = isinstance(guarantee, str) and (guarantee == "proved"
                                                     or guarantee.startswith(("none: ", "tv-bound: ")))
        _require(documented, f"guarantee {guarantee!r} is not 'proved', 'none: …' or 'tv-bound: …'")


def check_columns(s: Subject) -> None:
    """derived values set only the columns a run reports"""
    try:
        reported = reported_columns(s.trained[0].derived, len(SEEDS), s.cls.tags.private)
    except ValueError as exc:
        raise Broken(str(exc)) from None
    _require("epsilon_achieved" in reported or not s.cls.tags.private,
             "a private algorithm derives no epsilon_achieved")


def check_neighbours(s: Subject) -> None:
    """the native neighbouring relation is add_remove, replace_one or zero_out"""
    native = s.cls().native_neighbours()
    _require(native in ("add_remove", "replace_one", "zero_out"), f"native_neighbours() is {native!r}")


def check_params(s: Subject) -> None:
    """Params is a frozen pydantic model that refuses unknown keys"""
    params_cls = s.cls.Params
    _require(issubclass(params_cls, pydantic.BaseModel), "Params is not a pydantic model")
    _require(params_cls.model_config.get("frozen") is True and params_cls.model_config.get("extra") == "forbid",
             "Params lacks model_config = ConfigDict(extra=\"forbid\", frozen=True)")


def library_epsilon(event: Any, delta: float, neighbours: str) -> float:
    """The smallest ε that dp-accounting's own accountants (RDP on a dense order grid; PLD, pessimistic) give for
    the event, independently of the project's accounting code."""
    relation = {"add_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                "replace_one": dp_accounting.NeighboringRelation.REPLACE_ONE,
                "zero_out": dp_accounting.NeighboringRelation.REPLACE_SPECIAL}[neighbours]
    with quiet_rdp():
        found = [accountant.compose(event).get_epsilon(delta)
                 for accountant in (RdpAccountant(RDP_ORDERS, relation), PLDAccountant(relation, 1e-4))
                 if accountant.supports(event)]
    if not found:
        raise Broken(f"no dp-accounting accountant supports its dp_event {event}")
    return min(found)


def check_claim(s: Subject) -> None:
    """the claimed ε holds for the mechanism as run (dp_event), or it names its own analysis"""
    algo, setting, outcome = s.cls(), s.setting, s.trained[0]
    event = algo.dp_event(setting, outcome.derived)
    if not algo.tags.private:
        _require(isinstance(event, dp_accounting.NonPrivateDpEvent), "a non-private algorithm's event is not "
                 "NonPrivateDpEvent")
        return
    if event is None:
        _require(bool(algo.tags.own_analysis), "no dp-accounting event (dp_event) and no own_analysis named")
        return
    if outcome.guarantee != "proved":  # e.g. the classic Gaussian formula proves nothing at ε ≥ 1: check at ε = 0.5
        setting = dataclasses.replace(setting, epsilon=0.5)
        outcome = s.fit(setting)
        event = algo.dp_event(setting, outcome.derived)
    claimed = outcome.derived["epsilon_achieved"]
    _require(outcome.guarantee == "proved" and claimed <= setting.required.epsilon,
             f"claims ε = {claimed} ({outcome.guarantee}) for the target ε = {setting.epsilon}")
    library = library_epsilon(event, setting.delta, algo.neighbouring())
    _require(library <= claimed * (1 + CLAIM_RTOL), f"claims ε = {claimed:.4g}, but dp-accounting gives its "
             f"dp_event ε = {library:.4g} (δ = {setting.delta:g}, {algo.neighbouring()})")


def check_compiled(s: Subject) -> None:
    """NumPy = compiled where both apply"""
    if "backend" not in s.cls.Params.model_fields or not compiled.HAVE_NUMBA:
        raise NotApplicable("no backend parameter" if compiled.HAVE_NUMBA else "numba is not installed")
    runs = {}
    for backend in ("numpy", "auto"):
        prepared = s.cls({"backend": backend}).prepare(s.setting, s.model, s.X, s.y, ReplicaStreams(SEEDS))
        if prepared is None:
            raise NotApplicable("not one gradient chain (prepare gives None)")
        runs[backend] = prepared.train(s.model).theta, prepared.chain.ran_on
    if runs["auto"][1] == "numpy":
        raise NotApplicable("the compiled steps do not take its chain: NumPy only")
    numpy_theta, compiled_theta = runs["numpy"][0], runs["auto"][0]
    atol = 1e-13 * max(1.0, float(np.abs(numpy_theta).max()))
    _require(np.allclose(compiled_theta, numpy_theta, rtol=COMPILED_RTOL, atol=atol),
             f"the compiled θ differs from NumPy's by {np.abs(compiled_theta - numpy_theta).max():.3g} "
             f"(beyond rtol {COMPILED_RTOL:g})")


def check_fused(s: Subject) -> None:
    """trained beside other chains (fused) = alone, bit for bit"""
    streams = SharedStreams(SEEDS)
    half_lr = dataclasses.replace(s.setting, lr=s.setting.required.lr / 2)
    cells = [(s.cls(), s.setting), (s.cls(), half_lr), (ALGORITHMS["sgd"](), s.setting)]
    prepared = [algo.prepare(setting, s.model, s.X, s.y, streams) for algo, setting in cells]
    streams.close()
    if prepared[0] is None:
        raise NotApplicable("not one gradient chain (prepare gives None): trains alone")
    fused = train_together(s.model, [p for p in prepared if p is not None])
    _require(np.array_equal(fused[0].theta, s.trained[0].theta), "θ trained beside other chains differs from θ "
             "trained alone")


def check_refusals(s: Subject) -> None:
    """a setting check() accepts trains (refusals before work)"""
    for change in PROBES:
        setting = dataclasses.replace(s.setting, **change)
        try:
            s.cls().check(setting, "logreg")
        except UserError:
            continue
        try:
            s.fit(setting)
        except Exception as exc:
            shown = ", ".join(f"{k} = {v}" for k, v in change.items())
            raise Broken(f"check() accepts {shown} but training fails: {type(exc).__name__}: {exc}") from None


CHECKS: dict[str, Callable[[Subject], None]] = {
    "setting": check_setting, "theta": check_theta, "deterministic": check_deterministic,
    "independent": check_independent, "guarantee": check_guarantee, "columns": check_columns,
    "neighbours": check_neighbours, "params": check_params, "claim": check_claim, "compiled": check_compiled,
    "fused": check_fused, "refusals": check_refusals,
}


def run_checks(cls: type[Algorithm]) -> list[dict[str, str]]:
    """Each check on `cls`: {algorithm, check, status ("ok", "FAIL", "n/a"), message}."""
    subject, out = Subject(cls), []
    for name, check in CHECKS.items():
        try:
            check(subject)
            status, message = "ok", str(check.__doc__)
        except NotApplicable as exc:
            status, message = "n/a", str(exc)
        except Broken as exc:
            status, message = "FAIL", str(exc)
        except Exception as exc:  # the algorithm's own code raised: a failure of this check, the others still run
            status, message = "FAIL", f"{type(exc).__name__}: {exc}"
        out.append({"algorithm": cls.name, "check": name, "status": status, "message": " ".join(message.split())})
    return out
