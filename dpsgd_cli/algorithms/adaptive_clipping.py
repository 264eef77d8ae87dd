"""Adaptive clipping for DP-SGD's family (Andrew, Thakkar, McMahan & Ramaswamy, NeurIPS 2021, Theorem 1): grid
parameters, the gradient's noise multiplier σ_Δ, and the mechanism as a dp-accounting event; the op is
`ops.AdaptiveClip`. Why σ is DP-SGD's: docs/algorithms.md (adaptive clipping)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from dpsgd_cli.algorithms.ops import AdaptiveClip
from dpsgd_cli.errors import UserError
from dpsgd_cli.privacy.accounting import dp_event

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent

ADAPTIVE_KEYS = ("clip_quantile", "clip_lr", "clip_count_noise")


class AdaptiveClipParams(BaseModel):
    """The adaptive-clipping parameters of an algorithm's `Params` (a fixed clip when `clip_quantile` is none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    clip_quantile: float | None = Field(
        None, gt=0, lt=1, allow_inf_nan=False,
        description="adaptive clipping (Andrew et al. 2021): the quantile γ of the per-example gradient norms the "
        "clip norm follows from the grid's clip_norm (none: the clip norm stays clip_norm)")
    clip_lr: float = Field(0.2, gt=0, allow_inf_nan=False,
                           description="adaptive clipping's step η_C: C ← C·exp(−η_C (b̄ − γ)) (the paper's 0.2)")
    clip_count_noise: float = Field(
        0.05, gt=0, allow_inf_nan=False,
        description="adaptive clipping's count noise σ_b over the expected batch size B (the paper's B/20: 0.05)")

    @model_validator(mode="after")
    def _acts_with_a_quantile(self) -> AdaptiveClipParams:
        given = sorted({"clip_lr", "clip_count_noise"} & self.model_fields_set)
        if self.clip_quantile is None and given:
            raise ValueError(f"{', '.join(given)} acts only with clip_quantile (adaptive clipping): give "
                             "clip_quantile too, or leave them out")
        return self

    @model_serializer(mode="wrap")
    def _defaults_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The adaptive keys at their defaults are left out (as a cell's keys at their defaults are): a fixed-clip
        cell's run ids are those it had before the keys existed, and labels name only what a grid set."""
        data: dict[str, Any] = handler(self)
        for key in ADAPTIVE_KEYS:
            if data.get(key) == type(self).model_fields[key].default:
                data.pop(key, None)
        return data


def count_std(params: Any, batch_size: float) -> float:
    """σ_b: the count's noise, `clip_count_noise` times the expected batch size."""
    return float(params.clip_count_noise) * float(batch_size)


def gradient_noise_multiplier(sigma: float, count_noise: float, batch_size: float,
                              who: str = "adaptive clipping") -> float:
    """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2): the clipped sum's noise multiplier that, with the count's release at σ_b,
    costs what noise multiplier σ alone does. UserError where 2σ_b ≤ σ (the count alone would cost more)."""
    if not 2.0 * count_noise > sigma:
        raise UserError(f"{who}: the count's noise σ_b = {count_noise:.4g} is too small for the calibrated noise "
                        f"multiplier σ = {sigma:.4g} (adaptive clipping needs 2σ_b > σ); raise clip_count_noise "
                        f"above σ/(2B) = {sigma / (2.0 * batch_size):.4g}, or ε")
    return float((sigma**-2.0 - (2.0 * count_noise) ** -2.0) ** -0.5)


def adaptive_clip(params: Any, clip_norm: float, batch_size: float, sigma_gradient: float, count_noise: float,
                  draws: Iterator[np.ndarray], count_draws: Iterator[np.ndarray]) -> AdaptiveClip:
    """The op from the grid's parameters and the two noises (σ_Δ, σ_b)."""
    return AdaptiveClip(norm=clip_norm, quantile=float(params.clip_quantile), lr=float(params.clip_lr),
                        noise_multiplier=sigma_gradient, draws=draws, count_std=count_noise, count_draws=count_draws,
                        expected_batch=float(batch_size))


def adaptive_event(sigma_gradient: float, count_noise: float, sample_rate: float, steps: int) -> DpEvent:
    """One step: the two Gaussian releases on one Poisson sample (the sum at σ_Δ per unit of C, the count at σ_b per
    unit of its sensitivity 1/2, i.e. 2σ_b), composed T times. dp-accounting's RDP accountant reads the pair as the
    single Gaussian 1/σ² = σ_Δ⁻² + (2σ_b)⁻² (its Gaussians of one sample compose so)."""
    pair = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(sigma_gradient),
                                     dp_event.GaussianDpEvent(2.0 * count_noise)])
    step = pair if sample_rate == 1.0 else dp_event.PoissonSampledDpEvent(sample_rate, pair)
    return dp_event.SelfComposedDpEvent(step, steps)
