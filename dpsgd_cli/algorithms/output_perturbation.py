"""Output perturbation: the exact regularised minimiser plus Gaussian noise (`output_perturbation`,
Chaudhuri–Monteleoni–Sarwate 2011) and permutation-based SGD plus Gaussian noise (`bolt_on`, Wu et al. 2017);
σ classic (Dwork & Roth 2014, Thm A.1) or analytic (Balle & Wang, ICML 2018, Thm 8): docs/algorithms.md."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Prepared, Setting, Tags, unit_ball_violation
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.erm import reference_minimum
from dpsgd_cli.algorithms.ops import Clip, Scale, Schedule, Sgd, WeightDecay, constant, min_inverse_time
from dpsgd_cli.algorithms.sampling import shuffled_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule
from dpsgd_cli.models import Batch, Model
from dpsgd_cli.privacy.accounting import dp_event
from dpsgd_cli.privacy.mechanisms import analytic_gaussian_sigma, gaussian_sigma, gaussian_sigma_valid

dp_accounting = LazyModule("dp_accounting")  # imported when this algorithm runs

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

Calibration = Literal["classic", "analytic"]
# output_perturbation releases an L-BFGS iterate θ̂, not the exact θ*: ‖θ̂ − θ*‖ ≤ ‖∇F(θ̂)‖/λ by λ-strong convexity.
# The mechanism solves to ‖∇F(θ̂)‖/λ ≤ ARGMIN_TOLERANCE·Δ on every dataset, so ‖θ̂(D) − θ̂(D′)‖ ≤ (1 + 2·tol)·Δ:
# the noise is calibrated to that sensitivity (a run whose solve misses the tolerance is labelled "none").
ARGMIN_TOLERANCE = 1e-3
# What the proofs assume when the model has no bound of its own (a non-convex `mlp`): the logistic loss's constants
# on unit-ball rows, L = 1 (per-example gradients are clipped to it) and β_ℓ = 1/4. The guarantee then says "none".
ASSUMED_LIPSCHITZ = 1.0
ASSUMED_SMOOTHNESS = 0.25


# --- The shared Gaussian output noise -----------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputNoise:
    """σ of θ + N(0, σ²I) for L2-sensitivity Δ at (ε, δ); `epsilon_achieved` is the ε the chosen calibration proves
    (None when it proves nothing: classic with ε ≥ 1), `epsilon_exact` the exact ε of the same noise (Balle–Wang)."""

    sensitivity: float
    sigma: float
    calibration: str
    epsilon_achieved: float | None
    epsilon_exact: float
    failure: str | None  # why the calibration proves nothing, else None

    def derived(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "sensitivity": self.sensitivity, "epsilon_achieved": self.epsilon_achieved,
                "epsilon_exact": self.epsilon_exact, "accountant": f"gaussian_{self.calibration}"}


def calibrate_output_noise(sensitivity: float, epsilon: float, delta: float, calibration: Calibration) -> OutputNoise:
    """σ of the Gaussian mechanism: classic Dwork–Roth formula (valid for ε < 1) or analytic (Balle–Wang, any ε)."""
    if calibration == "classic":
        sigma = gaussian_sigma(sensitivity, epsilon, delta, strict=False)
        valid = gaussian_sigma_valid(epsilon)
        failure = (None if valid else
                   f"none: epsilon = {epsilon:g} ≥ 1 (classic Gaussian mechanism formula valid for ε < 1)")
        achieved = float(epsilon) if valid else None
    elif calibration == "analytic":
        sigma = analytic_gaussian_sigma(sensitivity, epsilon, delta)
        failure, achieved = None, None
    else:
        raise UserError(f"calibration must be 'classic' or 'analytic', got {calibration!r}")
    exact = float(dp_accounting.get_epsilon_gaussian(sigma / sensitivity, delta))
    if calibration == "analytic":
        achieved = exact
    return OutputNoise(float(sensitivity), float(sigma), calibration, achieved, exact, failure)


def scaled_noise(algorithm: Algorithm, noise: OutputNoise, delta: float) -> tuple[float, dict[str, Any]]:
    """(σ added, derived values) with the audit's noise scale (`Algorithm.with_noise_scale`): its true ε is the
    Gaussian mechanism's at σ·scale (∞ without noise)."""
    if algorithm.noise_scale == 1.0:
        return noise.sigma, {}
    sigma = noise.sigma * algorithm.noise_scale
    true = float(dp_accounting.get_epsilon_gaussian(sigma / noise.sensitivity, delta)) if sigma > 0 else float("inf")
    return sigma, {"noise_scale": algorithm.noise_scale, "sigma_used": sigma, "epsilon_noise_scaled": true}


def add_output_noise(theta: np.ndarray, sigma: float, streams: ReplicaStreams) -> np.ndarray:
    """θ + σ z, z ~ N(0, I) drawn from each replica's own "output" stream: (R, P)."""
    z = np.stack([g.standard_normal(theta.shape[1]) for g in streams.generators("output")])
    return theta + sigma * z


def _assumption_failure(model: Model, X: np.ndarray) -> str | None:
    """First failed assumption shared by both proofs (convex loss, rows in the unit ball), else None."""
    if not model.convex:
        return "none: non-convex model"
    if model.lipschitz(1.0) is None:
        return f"none: model {model.name!r} has no Lipschitz bound (L = {ASSUMED_LIPSCHITZ:g} assumed)"
    return unit_ball_violation(X)


def _lipschitz(model: Model, algorithm: str) -> float:
    """The model's Lipschitz bound for ‖x‖ ≤ 1, or ASSUMED_LIPSCHITZ when it has none (guarantee: none)."""
    L = model.lipschitz(1.0)
    return float(L) if L is not None else ASSUMED_LIPSCHITZ


class OutputNoiseParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    calibration: Calibration = Field(
        "classic", description="classic: σ = Δ√(2 ln(1.25/δ))/ε (ε < 1); analytic: Balle–Wang 2018, exact for every ε")


# --- output_perturbation ------------------------------------------------------------------------------------------


class OutputPerturbation(Algorithm):
    """DP-ERM by output perturbation (Chaudhuri, Monteleoni & Sarwate, JMLR 2011; Gaussian version of Bellet's lecture).

    Δ = 2L/(nλ) (Chaudhuri et al. 2011, Cor. 8) for an L-Lipschitz convex loss and λ > 0; θ* by L-BFGS, exact to
    ‖∇F(θ̂)‖/λ ≤ 10⁻³ Δ (else the guarantee is "none"), so the noise is calibrated to Δ(1 + 2·10⁻³)."""

    name = "output_perturbation"
    tags = Tags("output perturbation", private=True, batch="none", neighbours="replace_one", covers="final output",
                noise_scalable=True)
    uses = frozenset({"epsilon", "l2"})
    Params = OutputNoiseParams
    source = "Chaudhuri, Monteleoni & Sarwate, Differentially Private Empirical Risk Minimization, JMLR 2011"

    def dp_event(self, setting: Setting, derived: dict[str, Any]) -> DpEvent:
        """The Gaussian mechanism on θ̂: std σ (as added) over its L2-sensitivity."""
        return dp_event.GaussianDpEvent(derived.get("sigma_used", derived["sigma"]) / derived["sensitivity"])

    def check(self, setting: Setting, model_name: str = "") -> None:
        if not setting.l2 > 0:
            raise UserError(f"output_perturbation needs l2 > 0 (λ-strongly convex objective), got l2 = {setting.l2:g}; "
                            "set l2 (e.g. 1e-3) for this algorithm")

    def fit(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams) -> Outcome:
        self.check(setting)
        L = _lipschitz(model, self.name)
        sensitivity = 2 * L / (setting.n * setting.l2)  # of the exact minimiser θ*
        noise = calibrate_output_noise(sensitivity * (1 + 2 * ARGMIN_TOLERANCE), setting.required.epsilon,
                                       setting.delta, self.params.calibration)
        # the exact minimiser (convex); for a non-convex model the best of several L-BFGS starts, the same θ for
        # every replica whatever seeds train together
        theta_star, _, info = reference_minimum(model, X, y)
        argmin_error = info["grad_norm"] / setting.l2
        guarantee = (_assumption_failure(model, X)
                     or (f"none: inexact minimiser (‖θ̂ − θ*‖ ≤ ‖∇F‖/λ = {argmin_error:.3g} > 1e-3 Δ)"
                         if argmin_error > ARGMIN_TOLERANCE * sensitivity else None)
                     or noise.failure or "proved")
        sigma, scaled = scaled_noise(self, noise, setting.delta)
        theta = add_output_noise(np.tile(theta_star, (streams.replicas, 1)), sigma, streams)
        derived = {**noise.derived(), "lipschitz": L, "argmin_error_bound": argmin_error,
                   "sensitivity_exact_minimiser": sensitivity, **info, **scaled}
        return Outcome(theta, derived, guarantee=guarantee)


# --- bolt_on ------------------------------------------------------------------------------------------------------


def convex_psgd_sensitivity(lipschitz: float, lr: float, passes: int, batch_size: int) -> float:
    """Δ = 2kLη/b: k passes of PSGD with constant step η ≤ 2/β, convex β-smooth L-Lipschitz loss (Wu et al. 2017)."""
    return 2 * passes * lipschitz * lr / batch_size


def strongly_convex_psgd_sensitivity(lipschitz: float, gamma: float, batch_size: int, batches_per_pass: int) -> float:
    """Δ = 2L/(γ b M), M = ⌊n/b⌋ batches per pass, for steps η_t = min(1/β, 1/(γt)) (Wu et al. 2017, Thm 2 with
    mini-batches; the growth recursion: docs/algorithms.md (bolt_on))."""
    return 2 * lipschitz / (gamma * batch_size * batches_per_pass)


@dataclass(frozen=True)
class PSGDPlan:
    """Everything bolt_on derives before training."""

    case: str  # "convex" | "strongly_convex"
    lipschitz: float
    beta: float  # smoothness of the batch objective (1/b) Σ ℓ + (λ/2)‖θ‖²: β_ℓ + λ
    gamma: float  # strong convexity: λ (0 in the convex case)
    batch_size: int
    passes: int
    batches_per_pass: int
    schedule: Schedule
    step_rule: str
    sensitivity: float
    failure: str | None  # a failed step-size condition, else None
    schedule_key: tuple[Any, ...] = ()  # the schedule's exact parameters (step_rule rounds them for display)

    @property
    def steps(self) -> int:
        return self.passes * self.batches_per_pass

    def derived(self) -> dict[str, Any]:
        return {"case": self.case, "steps": self.steps, "passes": self.passes,
                "batches_per_pass": self.batches_per_pass,
                "step_rule": self.step_rule, "lipschitz": self.lipschitz, "beta": self.beta, "gamma": self.gamma,
                "sensitivity": self.sensitivity}


class BoltOnParams(OutputNoiseParams):
    case: Literal["auto", "convex", "strongly_convex"] = Field(
        "auto", description="sensitivity analysis: convex (constant step lr ≤ 2/β) or strongly_convex "
                            "(step min(1/β, 1/(λt)), needs l2 > 0); auto: strongly_convex when l2 > 0")


class BoltOn(Algorithm):
    """Bolt-on private PSGD (Wu, Li, Kumar, Chaudhuri, Jha & Naughton, SIGMOD 2017, Thms 1-2): k passes of mini-batch
    SGD over one permutation, no noise during training, then θ + N(0, σ²I) (docs/algorithms.md, bolt_on)."""

    name = "bolt_on"
    # the iterates carry no noise: only the released θ is private
    tags = Tags("bolt-on (output perturbation of SGD)", private=True, neighbours="replace_one", covers="final output",
                noise_scalable=True)
    uses = frozenset({"epsilon", "batch_size", "lr", "epochs", "l2"})
    Params = BoltOnParams
    source = ("Wu, Li, Kumar, Chaudhuri, Jha & Naughton, Bolt-on Differential Privacy for Scalable Stochastic "
              "Gradient Descent-based Analytics, SIGMOD 2017")

    def dp_event(self, setting: Setting, derived: dict[str, Any]) -> DpEvent:
        """The Gaussian mechanism on θ̂: std σ (as added) over its L2-sensitivity."""
        return dp_event.GaussianDpEvent(derived.get("sigma_used", derived["sigma"]) / derived["sensitivity"])

    def check(self, setting: Setting, model_name: str = "") -> None:
        if self.params.case == "strongly_convex" and not setting.l2 > 0:
            raise UserError("bolt_on case strongly_convex needs l2 > 0 (γ = λ); set l2 > 0 or case: convex")
        passes = setting.required.epochs
        if passes != int(passes) or passes < 1:
            raise UserError(f"bolt_on: epochs is the number k of passes and must be a whole number ≥ 1, got {passes:g}")
        b = int(setting.required.batch_size)
        if not 1 <= b <= setting.n:
            raise UserError(f"bolt_on: batch_size must be in [1, n = {setting.n}], got {b}")

    def plan(self, setting: Setting, model: Model) -> PSGDPlan:
        self.check(setting)
        case = self.params.case
        if case == "auto":
            case = "strongly_convex" if setting.l2 > 0 else "convex"
        passes, b = setting.required.epochs, int(setting.required.batch_size)
        L = _lipschitz(model, self.name)
        smooth = model.smoothness(1.0)
        beta = float(smooth if smooth is not None else ASSUMED_SMOOTHNESS) + setting.l2
        per_pass = setting.n // b
        failure = None
        if case == "convex":
            eta = float(setting.required.lr)
            sensitivity = convex_psgd_sensitivity(L, eta, int(passes), b)
            if eta > 2 / beta:
                failure = f"none: lr = {eta:g} > 2/β = {2 / beta:.4g} (convex case needs η ≤ 2/β)"
            return PSGDPlan(case, L, beta, 0.0, b, int(passes), per_pass, constant(eta), f"constant {eta:g}",
                            sensitivity, failure, ("constant", eta))
        gamma = float(setting.l2)
        sensitivity = strongly_convex_psgd_sensitivity(L, gamma, b, per_pass)
        return PSGDPlan(case, L, beta, gamma, b, int(passes), per_pass, min_inverse_time(beta, gamma),
                        f"min(1/beta, 1/(gamma t)), beta = {beta:g}, gamma = {gamma:g}", sensitivity, failure,
                        ("min_inverse_time", beta, gamma))

    def chain(self, plan: PSGDPlan, l2: float, batches: Iterator[Batch],
              checkpoints: Checkpoints | None = None) -> GradientChain:
        """The non-private PSGD: clip each example's gradient to L, average over the batch, add λθ, step.

        The iterates do not depend on ε (only the output noise does) and a shorter run is a prefix of a longer one
        (same permutation, schedule in t): `same_iterates` lets the cells of an ε × epochs axis train once."""
        return GradientChain(batches=batches,
                             ops=[Clip(plan.lipschitz), Scale(1.0 / plan.batch_size), WeightDecay(l2),
                                  Sgd(plan.schedule)],
                             checkpoints=checkpoints, examples_per_step=plan.batch_size,
                             stream=("shuffle_once", plan.batch_size),
                             same_iterates=("bolt_on", plan.lipschitz, l2, plan.schedule_key),
                             backend="numpy")  # the cells of an ε × epochs axis then train once (`same_iterates`)

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared:
        plan = self.plan(setting, model)
        noise = calibrate_output_noise(plan.sensitivity, setting.required.epsilon, setting.delta,
                                       self.params.calibration)
        checkpoints = Checkpoints(setting.trace_every, X, y) if setting.trace_every else None
        chain = self.chain(plan, setting.l2, shuffled_batches(X, y, plan.batch_size, streams, reshuffle=False),
                           checkpoints)
        guarantee = _assumption_failure(model, X) or plan.failure or noise.failure or "proved"
        if guarantee == "proved" and setting.trace_every:  # the checkpoints release noiseless iterates
            guarantee = ("none: intermediate θ recorded (trace_every); bolt_on's proof covers the final noised "
                         "output only")
        sigma, scaled = scaled_noise(self, noise, setting.delta)
        derived = {**plan.derived(), **noise.derived(),
                   "examples_unused_per_pass": setting.n - plan.batches_per_pass * plan.batch_size, **scaled}

        def finish(theta: np.ndarray) -> Outcome:
            return Outcome(add_output_noise(theta, sigma, streams), derived, guarantee=guarantee,
                           trace=checkpoints.rows if checkpoints else [])

        return Prepared(chain, model.init(streams.generators("init")), plan.steps, finish)


__all__ = ["BoltOn", "OutputPerturbation", "OutputNoise", "PSGDPlan", "add_output_noise", "calibrate_output_noise",
           "convex_psgd_sensitivity",
           "strongly_convex_psgd_sensitivity"]
