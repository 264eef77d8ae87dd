"""Noisy full-batch gradient descent with the privacy dynamics accountant of Chourasia, Ye & Shokri (NeurIPS 2021)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Prepared, Setting, Tags, unit_ball_violation
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.ops import Clip, Noise, ProjectBall, Scale, Sgd, WeightDecay, constant
from dpsgd_cli.algorithms.sampling import full_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.compiled import Backend
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Model
from dpsgd_cli.privacy.accounting import dp_event
from dpsgd_cli.privacy.dynamics import SATURATION_ROOT, calibrate_noisy_gd, noisy_gd_epsilon

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent


def composition_is_smaller(K: int, eta: float, lam: float) -> bool:
    """Whether the composition bound is ≤ the dynamics bound at every order: ληK/2 ≤ x* (both linear in α,
    1 − e^{−x} ≥ x/2 exactly on [0, x*])."""
    return lam * eta * K / 2.0 <= SATURATION_ROOT



class NoisyGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    accountant: Literal["dynamics", "composition", "minimum"] = Field(
        "dynamics", description="dynamics: Chourasia et al. RDP bound; composition: K-fold RDP of the Gaussian step; "
                                "minimum: the smaller of the two at each Rényi order")
    radius: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="project onto the L2 ball of this radius (None: no projection)")
    backend: Backend = Field(
        "auto", description="logreg: the compiled full-batch step (auto: when numba is installed) "
                            "or numpy; same random numbers, same result up to summation order")


class NoisyGD(Algorithm):
    """Noisy full-batch GD with per-example clipping at C (Chourasia, Ye & Shokri, NeurIPS 2021, "Noisy GD"),
    sensitivity S_g = 2C (replace-one); accountants: docs/algorithms.md (noisy_gd), privacy/dynamics.py."""

    name = "noisy_gd"
    tags = Tags("noisy GD", private=True, batch="full_batch", neighbours="replace_one", noise_scalable=True,
                own_analysis="the privacy dynamics bound (Chourasia et al. 2021, Theorem 2): the last iterate only")
    uses = frozenset({"epsilon", "lr", "epochs", "l2", "clip_norm"})
    Params = NoisyGDParams
    execution_params = frozenset({"backend"})
    source = ("Chourasia, Ye, Shokri, Differential Privacy Dynamics of Langevin Diffusion and Noisy Gradient "
              "Descent, NeurIPS 2021")

    def dp_event(self, setting: Setting, derived: dict[str, Any]) -> DpEvent | None:
        """Under the composition bound, K Gaussian mechanisms on θ: sensitivity η·S_g/n, std √(2η)σ (as added).
        The dynamics bound is a claim about the last iterate that no library event states: None."""
        if derived["bound_used"] != "composition":
            return None
        eta = setting.required.lr
        std = (2.0 * eta) ** 0.5 * derived.get("sigma_used", derived["sigma"])
        step = dp_event.GaussianDpEvent(std * setting.n / (eta * derived["sensitivity"]))
        return dp_event.SelfComposedDpEvent(step, derived["steps"])

    def check(self, setting: Setting, model_name: str = "") -> None:
        self.steps(setting)
        if self.params.accountant != "composition" and not setting.l2 > 0:
            raise UserError(f"noisy_gd with accountant {self.params.accountant!r} needs l2 > 0 (λ-strong convexity), "
                            f"got l2 = {setting.l2}; set l2 > 0 or use accountant: composition")

    @staticmethod
    def steps(setting: Setting) -> int:
        K = round(setting.required.epochs)
        if K < 1:
            raise UserError(f"noisy_gd: epochs = {setting.epochs} gives K = {K} full-batch steps; use epochs ≥ 1 "
                            f"(K = round(epochs))")
        return K

    def covered(self, derived: dict[str, Any]) -> str:
        """Composition of the K Gaussian steps covers every iterate; the dynamics bound assumes hidden
        intermediate models, so it covers the final output only."""
        return "every iterate" if derived.get("bound_used") == "composition" else "final output"

    def dynamics_guarantee(self, setting: Setting, model: Model, X: np.ndarray) -> tuple[str, float | None]:
        """("proved" or the first failed assumption of the dynamics bound, the smoothness β of the regularised loss)."""
        lam, C, eta = setting.l2, setting.required.clip_norm, setting.required.lr
        smooth = model.smoothness(1.0)
        beta = None if smooth is None else smooth + lam
        lipschitz = model.lipschitz(1.0)
        if not lam > 0:
            return "none: l2 = 0 (the dynamics bound needs a λ-strongly convex loss, λ > 0)", beta
        if not model.convex:
            return "none: non-convex model", beta
        violation = unit_ball_violation(X)
        if violation:
            return violation, beta
        if lipschitz is None:
            return "none: the model has no Lipschitz bound", beta
        if lipschitz > C:
            return (f"none: clipping active (C = {C:g} < L = {lipschitz:g}): the update is not the gradient of the "
                    f"strongly convex loss"), beta
        if beta is None:
            return "none: the model has no smoothness bound", beta
        if eta > 1.0 / beta:
            return f"none: step size η = {eta:g} > 1/β = {1.0 / beta:.4g} (β = smoothness + λ)", beta
        return "proved", beta

    def chain(self, setting: Setting, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams, noise_std: float,
              n_params: int | None = None) -> GradientChain:
        """Full-batch chain; the noise is added to the gradient with std √(2σ²/η), i.e. √(2ησ²) on θ.
        n_params: the model's P (default d, logistic regression's)."""
        P = n_params if n_params is not None else X.shape[1]
        noise = [Noise(noise_std, streams.normal("noise", (P,)))] if noise_std > 0 else []
        radius = self.params.radius
        return GradientChain(
            batches=full_batches(X, y, streams.replicas),
            ops=[Clip(setting.required.clip_norm), Scale(1.0 / setting.n), WeightDecay(setting.l2), *noise,
                 Sgd(constant(setting.required.lr)), *([ProjectBall(radius)] if radius is not None else [])],
            checkpoints=Checkpoints(setting.trace_every, X, y) if setting.trace_every else None,
            examples_per_step=setting.n,
            stream=("full",),
            backend=self.params.backend,
        )

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared:
        """One full-batch chain (so the cells of a grid train together: `run_together` runs them in one call of
        the compiled full-batch step, X read once a step for every cell and seed)."""
        K, eta, n, lam = self.steps(setting), setting.required.lr, setting.n, setting.l2
        sensitivity = 2.0 * setting.required.clip_norm  # replace-one: ‖clip(∇ℓ(θ; x)) − clip(∇ℓ(θ; x'))‖ ≤ 2C
        accountant = self.params.accountant
        guarantee, beta = self.dynamics_guarantee(setting, model, X)
        if guarantee == "proved" and setting.trace_every:
            guarantee = ("none: intermediate θ recorded (trace_every); the dynamics bound assumes hidden "
                         "intermediate models")
        self.check(setting)
        cal = calibrate_noisy_gd(setting.required.epsilon, setting.delta, K, eta, lam, n, sensitivity, accountant)
        if accountant == "composition" or (accountant == "minimum" and composition_is_smaller(K, eta, lam)):
            guarantee = "proved"
        noise_std = np.sqrt(2.0 * cal.sigma**2 / eta) * self.noise_scale  # on the gradient; × η: √(2ησ²) on θ
        chain = self.chain(setting, X, y, streams, noise_std, model.n_params)
        derived = {
            "sigma": cal.sigma, "epsilon_achieved": cal.epsilon, "accountant": accountant, "steps": K,
            "sample_rate": 1.0, "sensitivity": sensitivity, "step_noise_std": float(np.sqrt(2.0 * eta) * cal.sigma),
            "beta": beta, "radius": self.params.radius,
            "bound_used": (("composition" if composition_is_smaller(K, eta, lam) else "dynamics")
                           if accountant == "minimum" else accountant),
            "epsilon_dynamics": noisy_gd_epsilon(cal.sigma, setting.delta, K, eta, lam, n, sensitivity, "dynamics")
            if lam > 0 else None,
            "epsilon_composition": noisy_gd_epsilon(cal.sigma, setting.delta, K, eta, lam, n, sensitivity,
                                                    "composition"),
        }
        if self.noise_scale != 1.0:  # the audit's broken twin: the same accountant at the σ it adds
            used = cal.sigma * self.noise_scale
            derived.update(noise_scale=self.noise_scale, sigma_used=used,
                           epsilon_noise_scaled=float("inf") if used <= 0
                           else noisy_gd_epsilon(used, setting.delta, K, eta, lam, n, sensitivity,
                                                 derived["bound_used"]))
        finish = lambda theta: Outcome(theta, {**derived, "backend": chain.ran_on or "numpy"}, guarantee=guarantee,
                                       trace=chain.checkpoints.rows if chain.checkpoints else [])
        return Prepared(chain, model.init(streams.generators("init")), K, finish)
