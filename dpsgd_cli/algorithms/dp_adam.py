"""DP-Adam: Adam on DP-SGD's privatized gradient (post-processing: DP-SGD's privacy)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Setting
from dpsgd_cli.algorithms.ops import Adam, Update, constant
from dpsgd_cli.algorithms.sgd import BACKEND_HELP, DPSGD, DPSGDParams
from dpsgd_cli.compiled import Backend


class DPAdamParams(DPSGDParams):
    model_config = ConfigDict(extra="forbid", frozen=True)
    beta1: float = Field(0.9, ge=0, lt=1, allow_inf_nan=False, description="Adam's first-moment decay β₁")
    beta2: float = Field(0.999, ge=0, lt=1, allow_inf_nan=False, description="Adam's second-moment decay β₂")
    eps_adam: float = Field(1e-8, gt=0, allow_inf_nan=False, description="Adam's ε in m̂/(√v̂ + ε)")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="dp-accounting accountant used to calibrate σ")
    backend: Backend = Field("auto", description=BACKEND_HELP)


class DPAdam(DPSGD):
    """DP-Adam: DP-SGD's noisy gradient, then Adam's step (Kingma & Ba 2015, bias-corrected).

    Per step t, everything of `dp_sgd` unchanged (Poisson sampling at rate q = B/n, clip to C — or adaptive
    clipping with `clip_quantile` —, σ calibrated by the same accountant for T = epochs·n/B steps, the same batch
    stream and noise, so it fuses with `dp_sgd` cells):

        g_t = (1/B) (Σ_{i∈B_t} clip_C(∇ℓ(θ_t; x_i, y_i)) + N(0, σ²C² I)) + λθ_t
        m_t = β₁ m_{t−1} + (1 − β₁) g_t,   v_t = β₂ v_{t−1} + (1 − β₂) g_t²
        θ_{t+1} = θ_t − η m_t/(1 − β₁ᵗ) / (√(v_t/(1 − β₂ᵗ)) + ε_adam)

    Privacy: DP-SGD's, since Adam reads only the released noisy gradients and θ (post-processing); guarantee
    "proved", the dp_event DP-SGD's.
    """

    name = "dp_adam"
    tags = dataclasses.replace(DPSGD.tags, display_name="DP-Adam")
    Params: ClassVar[type[BaseModel]] = DPAdamParams
    source = ("Adam (Kingma & Ba, ICLR 2015) on the DP-SGD gradient (Abadi et al., CCS 2016): post-processing of "
              "DP-SGD's releases")

    def step_rule(self, setting: Setting) -> Update:
        """Adam at the constant rate η = lr."""
        return Adam(constant(setting.required.lr), self.params.beta1, self.params.beta2, self.params.eps_adam)
