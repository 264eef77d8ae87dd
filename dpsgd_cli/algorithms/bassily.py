"""`bassily2014`: noisy projected SGD, one example per step (Bassily, Smith & Thakurta, FOCS 2014, Algorithm 1, as
taught in Bellet's lecture); accountings, step sizes, radius, scale of σ: docs/algorithms.md (bassily2014)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dpsgd_cli.algorithms.base import ROW_NORM_TOLERANCE, Algorithm, Outcome, Setting, Tags
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.ops import Clip, Noise, ProjectBall, Schedule, Sgd, WeightDecay, inverse_sqrt, inverse_time
from dpsgd_cli.algorithms.sampling import uniform_examples
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.compiled import Backend
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Model
from dpsgd_cli.models.rows import cached_row_norms
from dpsgd_cli.privacy.accounting import LIBRARY
from dpsgd_cli.privacy.single_example_gaussian import (
    Accounting,
    Privacy,
    cached_rdp_epsilon,
    calibrate_bassily,
    rdp_event,
)

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

__all__ = ["Bassily2014", "BassilyParams", "calibrate_bassily"]


# --- The algorithm ------------------------------------------------------------------------------------------------


class BassilyParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    accounting: Accounting = Field(
        "closed_form", description="how σ is calibrated to (ε, δ)")
    formula: Literal["paper", "lecture"] = Field(
        "lecture", description="closed_form only: the lecture's σ = 16·l·√(T ln(2/δ) ln(2.5T/(δn)))/(nε) (the "
        "only σ in the sources, the default) or 'paper': √32·l·… recalled from Bassily et al., not verified "
        "against a source text")
    amplification: Literal["tight", "approx"] = Field(
        "tight", description="advanced_composition only: ln(1 + q(e^ε − 1)) or the lecture's 2qε")
    radius: float | None = Field(None, gt=0, description="radius R of the ball C (default l/λ, or 10 if λ = 0)")
    schedule: Literal["auto", "convex", "strongly_convex"] = Field(
        "auto", description="γ_t = 2R/(G√t) (convex) or 1/(λt) (strongly convex); auto: the latter if λ > 0")
    backend: Backend = Field(
        "auto", description="logreg, mlp: the numba kernel (auto: when numba is installed) or numpy; same result")

    @model_validator(mode="before")
    @classmethod
    def _formula_default(cls, raw: Any) -> Any:
        """`formula` acts only under closed_form; elsewhere an unset formula is pinned to 'paper', so that the
        run ids of the other accountings do not depend on the closed form's default."""
        if isinstance(raw, dict) and "formula" not in raw and raw.get("accounting", "closed_form") != "closed_form":
            return {**raw, "formula": "paper"}
        return raw


class Bassily2014(Algorithm):
    """Noisy projected SGD, one uniformly drawn example per step (Bassily, Smith & Thakurta, FOCS 2014, Alg. 1)."""

    name = "bassily2014"
    tags = Tags("DP-SGD (Bassily et al.)", private=True, batch="single_example", neighbours="replace_one")
    uses = frozenset({"epsilon", "epochs", "l2"})
    execution_params = frozenset({"backend"})
    acts_when = {"formula": ("accounting", "closed_form"), "amplification": ("accounting", "advanced_composition")}
    Params = BassilyParams
    source = "Bassily, Smith & Thakurta, Private Empirical Risk Minimization: Efficient Algorithms and Tight " \
             "Error Bounds, FOCS 2014"

    @staticmethod
    def steps(setting: Setting) -> int:
        """T = round(epochs · n) single-example steps."""
        return max(1, round(setting.required.epochs * setting.n))

    def radius(self, setting: Setting, lipschitz: float) -> float:
        if self.params.radius is not None:
            return float(self.params.radius)
        return lipschitz / setting.l2 if setting.l2 > 0 else 10.0

    def dp_event(self, setting: Setting, derived: dict[str, Any]) -> DpEvent:
        """T steps, each one uniformly drawn example's gradient (sensitivity 2l, replace-one) plus N(0, σ²I)."""
        return rdp_event(derived["sigma"] / derived["sensitivity"], setting.n, derived["steps"])

    def check(self, setting: Setting, model_name: str = "") -> None:
        if self.params.schedule == "strongly_convex" and not setting.l2 > 0:
            raise UserError("bassily2014: schedule strongly_convex needs l2 > 0 (F is λ-strongly convex); "
                            "use schedule: convex")

    def schedule(self, setting: Setting, sigma: float, lipschitz: float, radius: float,
                 n_params: int) -> tuple[Schedule, dict[str, Any]]:
        kind = self.params.schedule
        if kind == "auto":
            kind = "strongly_convex" if setting.l2 > 0 else "convex"
        if kind == "strongly_convex":
            if not setting.l2 > 0:
                raise UserError("bassily2014: schedule strongly_convex needs l2 > 0 (F is λ-strongly convex); "
                                "use schedule: convex")
            return inverse_time(1.0 / setting.l2), {"schedule": "1/(λt)", "step_c": 1.0 / setting.l2}
        G = math.sqrt(n_params * sigma**2 + (lipschitz + setting.l2 * radius) ** 2)  # E‖noisy gradient‖² bound
        c = 2.0 * radius / G
        return inverse_sqrt(c), {"schedule": "2R/(G√t)", "step_c": c, "G": G}

    def chain(self, setting: Setting, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams, model: Model,
              sigma: float, lipschitz: float,
              radius: float, schedule: Schedule) -> GradientChain:
        noise = [Noise(sigma, streams.normal("noise", (model.n_params,)))] if sigma > 0 else []
        return GradientChain(
            batches=uniform_examples(X, y, streams),
            ops=[Clip(lipschitz), *noise, WeightDecay(setting.l2), Sgd(schedule), ProjectBall(radius)],
            checkpoints=Checkpoints(setting.trace_every, X, y) if setting.trace_every else None,
            examples_per_step=1,
            backend=self.params.backend,
        )

    def privacy(self, setting: Setting, lipschitz: float) -> Privacy:
        p = self.params
        return calibrate_bassily(float(setting.required.epsilon), float(setting.delta), int(setting.n),
                                 self.steps(setting),
                                 float(lipschitz), p.accounting, p.formula, p.amplification)

    def fit(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams) -> Outcome:
        lipschitz = model.lipschitz(1.0)  # the public bound ‖x‖ ≤ 1, not the data's max norm
        l_used = lipschitz if lipschitz is not None else 1.0  # no bound: clip to 1 (guarantee says none)
        steps = self.steps(setting)
        priv = self.privacy(setting, l_used)
        radius = self.radius(setting, l_used)
        schedule, step_info = self.schedule(setting, priv.sigma, l_used, radius, model.n_params)
        init = model.init(streams.generators("init"))
        x_norm = cached_row_norms(X)  # the batches' and the kernel's too (once per read-only X)
        chain = self.chain(setting, X, y, streams, model, priv.sigma, l_used, radius, schedule)
        theta = chain.run(model, init, steps)
        trace = chain.checkpoints.rows if chain.checkpoints else []
        backend = chain.ran_on
        max_norm = float(x_norm.max()) if len(X) else 0.0  # = max_row_norm(X): √ is monotone, correctly rounded
        derived = {"steps": steps, "sample_rate": 1.0 / setting.n, "sigma": priv.sigma,
                   "epsilon_achieved": priv.epsilon, "accountant": priv.accountant, "accountant_library": LIBRARY,
                   "lipschitz": l_used, "sensitivity": 2.0 * l_used, "radius": radius, "max_row_norm": max_norm,
                   "backend": backend, **step_info, **priv.details}
        if priv.accountant != "rdp":
            # what the exact-scheme RDP accountant certifies for the σ used (for "what tighter accounting buys")
            derived["epsilon_rdp"] = cached_rdp_epsilon(priv.sigma / (2.0 * l_used), setting.n, steps,
                                                         setting.delta)
        return Outcome(theta, derived, guarantee=self.guarantee(model, lipschitz, max_norm, priv), trace=trace)

    @staticmethod
    def guarantee(model: Model, lipschitz: float | None, max_norm: float, priv: Privacy) -> str:
        if not model.convex:
            return "none: non-convex model"
        if max_norm > 1.0 + ROW_NORM_TOLERANCE:
            return f"none: rows outside the unit ball (max ‖x‖ = {max_norm:.4g} > 1)"
        if lipschitz is None:
            return "none: the model's loss has no Lipschitz bound"
        if not priv.proved:
            return f"none: {priv.reason}"
        return "proved"
