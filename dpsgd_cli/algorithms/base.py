"""The algorithm interface: a resolved setting in, trained parameters for every replica out."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

import numpy as np
from pydantic import BaseModel, ConfigDict

from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import Model
from dpsgd_cli.privacy.accounting import Neighbours, dp_event

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

    from dpsgd_cli.algorithms.chain import GradientChain


ROW_NORM_TOLERANCE = 1e-9  # preprocessed rows have ‖x‖ = 1 up to rounding (adult: 1.0000000000000002)


def max_row_norm(X: np.ndarray) -> float:
    return float(np.sqrt(np.einsum("ij,ij->i", X, X).max())) if len(X) else 0.0


def unit_ball_violation(X: np.ndarray) -> str | None:
    """The `guarantee` text when a row lies outside the unit ball (the proofs' Lipschitz bounds need ‖x‖ ≤ 1)."""
    top = max_row_norm(X)
    return f"none: rows outside the unit ball (max ‖x‖ = {top:.4g} > 1)" if top > 1 + ROW_NORM_TOLERANCE else None


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Setting:
    """The resolved values of one grid cell (None where the algorithm does not use an axis)."""

    n: int
    d: int
    delta: float
    l2: float
    epsilon: float | None = None
    batch_size: int | None = None
    lr: float | None = None
    epochs: float | None = None
    clip_norm: float | None = None
    trace_every: int | None = None

    @property
    def required(self) -> RequiredAxes:
        """The axes as an algorithm that uses them reads them: `setting.required.lr` is a float, never None."""
        return RequiredAxes(self)

    @property
    def sample_rate(self) -> float:
        return self.required.batch_size / self.n

    @property
    def steps(self) -> int:
        """T = epochs · n / B, at least one step."""
        return max(1, round(self.required.epochs * self.n / self.required.batch_size))


class RequiredAxes:
    """A Setting's optional axes, typed without None. `expand` gives every axis in an algorithm's `uses` a value,
    so an algorithm reads the axes it uses here; a None (a Setting built by hand without it) is reported by name
    instead of failing later inside a formula."""

    __slots__ = ("_setting",)

    def __init__(self, setting: Setting):
        self._setting = setting

    def _value(self, axis: str) -> Any:
        value = getattr(self._setting, axis)
        if value is None:
            raise ValueError(f"the setting has no {axis}, which this algorithm reads (Setting({axis}=...))")
        return value

    @property
    def epsilon(self) -> float:
        return cast(float, self._value("epsilon"))

    @property
    def batch_size(self) -> int:
        return cast(int, self._value("batch_size"))

    @property
    def lr(self) -> float:
        return cast(float, self._value("lr"))

    @property
    def epochs(self) -> float:
        return cast(float, self._value("epochs"))

    @property
    def clip_norm(self) -> float:
        return cast(float, self._value("clip_norm"))


@dataclass
class Outcome:
    """Trained parameters (R, P), the values the algorithm derived (σ, achieved ε, ...), its guarantee, and
    optional checkpoints (examples processed, train objective (R,), train accuracy (R,))."""

    theta: np.ndarray
    derived: dict[str, Any] = field(default_factory=dict)
    guarantee: str = "proved"
    trace: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)


@dataclass
class Prepared:
    """An iterative algorithm ready to train: its chain, initial θ (R, P), number of steps, and what turns the
    trained θ into the Outcome. `fit` runs it alone; the engine may run several in lockstep (`run_together`)."""

    chain: GradientChain
    theta: np.ndarray
    steps: int
    finish: Callable[[np.ndarray], Outcome]

    def train(self, model: Model) -> Outcome:
        """Run the chain alone and finish."""
        return self.finish(self.chain.run(model, self.theta, self.steps))


BatchRegime = Literal["mini_batch", "full_batch", "single_example", "none"]
SelectionMethod = Literal["papernot_steinke", "liu_talwar"]


@dataclass(frozen=True)
class Tags:
    """What an algorithm is, for the code around it (as scikit-learn's estimator tags): the engine, the grid's
    checks, the audit and the figures read these, so that no fact of an algorithm is keyed by its name elsewhere.
    `tests/test_algorithm_tags.py` checks every registered algorithm's tags against its `uses` and methods."""

    display_name: str  # what figures and legends call it (mathtext)
    private: bool
    # How a step reads the data: a (sampled) batch of `batch_size` examples, all n examples (`epochs` steps), one
    # example (epochs · n steps), or "none": no steps at all (a minimiser).
    batch: BatchRegime = "mini_batch"
    # the neighbouring relation its analysis is stated for; the audit's "out" world is the worst-case neighbour
    neighbours: Neighbours = "add_remove"
    # What the privacy claim is a claim about: "final output" (only the released model: intermediate iterates
    # are not covered) or "every iterate" (an adversary who sees each update). `dpsgd audit` never refutes a claim
    # with an attack on what it does not cover.
    covers: Literal["final output", "every iterate"] = "every iterate"
    # Where `dp_event` is None for a private algorithm: the analysis its claim rests on (its docstring has the proof)
    own_analysis: str = ""
    # Whether `with_noise_scale` applies: the configuration multiplies every noise it adds by `noise_scale`.
    noise_scalable: bool = False
    float32: bool = False  # trains correctly on float32 data (grid key dtype)
    # The private selections (`select: privacy:`) that can account the tuning of its runs, and the parameter value
    # they need, if any (parameter, value): song2013's pure ε-DP holds with basic composition only.
    selection: frozenset[SelectionMethod] = frozenset()
    selection_requires: tuple[str, str] | None = None
    # How papernot_steinke prices a run: as DP-SGD's Poisson-sampled Gaussian from its σ, q and T (False), or by the
    # RDP of its own `dp_event` under its relation, its candidates calibrated by `calibrated_sigma` (True)
    selection_by_event: bool = False


class Algorithm:
    """Base class. `uses` names the grid axes the algorithm reads; the others are left out of its cells; `tags`
    says what it is (see `Tags`)."""

    name: ClassVar[str]
    tags: ClassVar[Tags]
    uses: ClassVar[frozenset[str]]
    Params: ClassVar[type[BaseModel]] = NoParams
    source: ClassVar[str] = ""
    # parameters that choose how, not what, is computed (e.g. backend): left out of the run id
    execution_params: ClassVar[frozenset[str]] = frozenset()
    # A parameter that acts only when another has one value (name → (other, value)), e.g. a closed form's
    # `formula`: a legend leaves it out of the lines where the other has a different value.
    acts_when: ClassVar[dict[str, tuple[str, str]]] = {}

    def __init__(self, params: dict[str, Any] | None = None, neighbours: Neighbours | None = None):
        """`neighbours`: the relation the grid asks its ε to hold under (None: the algorithm's own)."""
        # an instance of the subclass's own `Params` (Any: each subclass reads its own fields)
        self.params: Any = self.Params(**(params or {}))
        self._asked_neighbours = neighbours
        self.noise_scale = 1.0

    def with_noise_scale(self, factor: float) -> Algorithm:
        """A copy whose noise is multiplied by `factor` while its calibration (and so its claimed ε) is unchanged:
        the broken twin `dpsgd audit` runs as a positive control. Its true ε is `derived["epsilon_noise_scaled"]`
        (what the accountant gives for the scaled noise). Never reachable from a grid's algorithm entry."""
        if not self.tags.noise_scalable:
            raise NotImplementedError(f"{self.name} has no noise-scale hook")
        if not (np.isfinite(factor) and factor >= 0):
            raise ValueError(f"noise scale must be a finite number ≥ 0, got {factor!r}")
        twin = copy.copy(self)
        twin.noise_scale = float(factor)
        return twin

    def covered(self, derived: dict[str, Any]) -> str:
        """What this configuration's claim covers, given what its run derived (see `Tags.covers`)."""
        return self.tags.covers

    def selectable(self, privacy: str) -> bool:
        """Whether the private selection `privacy` can account the tuning of this configuration's runs."""
        required = self.tags.selection_requires
        return privacy in self.tags.selection and (required is None or getattr(self.params, required[0]) == required[1])

    def calibrated_sigma(self, setting: Setting) -> float:
        """The noise multiplier this configuration adds at the setting's ε, without training (a calibrated private
        selection prices its candidates by it where `tags.selection_by_event`)."""
        raise NotImplementedError(f"{self.name} does not state its calibrated σ")

    def native_neighbours(self) -> Neighbours:
        """The relation this configuration's analysis is stated for when the grid asks for none."""
        return self.tags.neighbours

    def neighbouring(self) -> Neighbours:
        """The neighbouring relation this configuration's privacy claim (its calibrated ε) holds under."""
        return self._asked_neighbours or self.native_neighbours()

    def refuses_neighbours(self, neighbours: str) -> str | None:
        """Why this configuration cannot be calibrated under `neighbours` (None: it can)."""
        native = self.native_neighbours()
        if neighbours == native or not self.tags.private:
            return None
        spelled = {"add_remove": "add/remove", "replace_one": "replace-one", "zero_out": "zero-out"}[native]
        return (f"{self.name} is analysed under {spelled} neighbours only (its sensitivity and accounting are "
                f"stated for that relation); use neighbours: {native} for it")

    def check(self, setting: Setting, model_name: str = "") -> None:
        """UserError for a setting this configuration cannot run (constraints across axes and parameters, e.g.
        a batch size its sampling does not allow). Called before any work by `dpsgd run` for every cell, and
        again where the algorithm trains."""

    def dp_event(self, setting: Setting, derived: dict[str, Any]) -> DpEvent | None:
        """The mechanism as run, with the noise its run derived, as a dp-accounting event (under `neighbouring()`),
        so that an independent accountant can check the claimed ε; None where the library has no event for it and
        the claim rests on the algorithm's own analysis (`tags.own_analysis` says which). A non-private algorithm is
        `NonPrivateDpEvent`. Under replace-one a Gaussian's noise multiplier is relative to the replace-one
        sensitivity (dp-accounting's RDP reading; its PLD reading doubles that sensitivity, which can only
        over-state ε), a Poisson-sampled Gaussian's to the per-example bound (both accountants' reading)."""
        return None if self.tags.private else dp_event.NonPrivateDpEvent()

    def sigma_calibration(self, setting: Setting) -> tuple[float, float, float, int, str, str] | None:
        """The (ε, δ, q, T, accountant, neighbours) this configuration calibrates DP-SGD's σ for
        (`calibrate_sigma`), if any: a fused task calibrates its cells' σ beforehand, one accountant curve per
        (δ, q, T, accountant, neighbours)."""
        return None

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared | None:
        """The training as one gradient chain, or None where it is not one (then only `fit` trains)."""
        return None

    def fit(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
            streams: ReplicaStreams) -> Outcome:
        prepared = self.prepare(setting, model, X, y, streams)
        if prepared is None:
            raise NotImplementedError
        return prepared.train(model)
