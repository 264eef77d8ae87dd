"""DP-LSSGD: DP-SGD whose noisy gradient is smoothed by the inverse of I − σ_ls Δ (Wang, Gu, Boedihardjo, Barekat &
Osher, MSML 2020, arXiv:1906.12056)."""

from __future__ import annotations

import dataclasses

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Outcome, Prepared, Setting
from dpsgd_cli.algorithms.chain import GradientChain
from dpsgd_cli.algorithms.ops import LaplacianSmoothing, Op, smoothed_noise_variance_factor
from dpsgd_cli.algorithms.sgd import DPSGD
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import Model
from dpsgd_cli.privacy import AccountantName


class DPLSSGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    smoothing: float = Field(1.0, ge=0, allow_inf_nan=False,
                             description="Laplacian smoothing constant σ_ls ≥ 0 (0: DP-SGD exactly)")
    accountant: AccountantName = Field("rdp", description="dp-accounting accountant used to calibrate σ")


class DPLSSGD(DPSGD):
    """DP-LSSGD (Wang, Gu, Boedihardjo, Barekat, Osher, MSML 2020, arXiv:1906.12056): DP-SGD, then smoothing.

        θ_{t+1} = θ_t − η A⁻¹ g_t,   A = I − σ_ls Δ  (g_t: dp_sgd's noisy gradient, λθ_t included)

    A⁻¹ (by FFT) is data-independent post-processing: the privacy of dp_sgd (docs/algorithms.md, dp_lssgd)."""

    name = "dp_lssgd"
    tags = dataclasses.replace(DPSGD.tags, display_name="DP-LSSGD")
    Params = DPLSSGDParams
    source = ("Wang, Gu, Boedihardjo, Barekat, Osher, DP-LSSGD: A Stochastic Optimization Method to Lift the Utility "
              "in Privacy-Preserving ERM, MSML 2020 (arXiv:1906.12056)")

    def chain(self, setting: Setting, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams,
              private: tuple[Op, ...] = (),
              smoothing: tuple[Op, ...] = ()) -> GradientChain:
        # after Scale(1/B) and WeightDecay(λ): A⁻¹ acts on the whole noisy gradient of F (see the class docstring)
        return super().chain(setting, X, y, streams, private, (LaplacianSmoothing(self.params.smoothing),))

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared:
        prepared = super().prepare(setting, model, X, y, streams)
        finish = prepared.finish

        def finish_smoothed(theta: np.ndarray) -> Outcome:
            outcome = finish(theta)
            outcome.derived["smoothing"] = self.params.smoothing
            outcome.derived["smoothed_noise_variance_factor"] = smoothed_noise_variance_factor(
                self.params.smoothing, model.n_params)
            return outcome

        prepared.finish = finish_smoothed
        return prepared
