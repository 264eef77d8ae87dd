"""DP-LSSGD: DP-SGD whose noisy gradient is smoothed by the inverse of I − σ_ls Δ (Wang et al. 2019/2020).

Wang, Gu, Boedihardjo, Barekat, Osher, "DP-LSSGD: A Stochastic Optimization Method to Lift the Utility in
Privacy-Preserving ERM", MSML 2020 (arXiv:1906.12056).
"""

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

    Update, per step t (everything of `dp_sgd` unchanged: Poisson sampling at rate q = B/n, clip to C, σ
    calibrated by the same accountant for T = epochs·n/B steps):

        g_t = (1/B) (Σ_{i∈B_t} clip_C(∇ℓ(θ_t; x_i, y_i)) + N(0, σ²C² I)) + λθ_t
        θ_{t+1} = θ_t − η A⁻¹ g_t,   A = I − σ_ls Δ,

    Δ the 1-D discrete Laplacian with periodic boundary on the P parameters; A⁻¹ is applied by FFT (A is
    circulant with eigenvalues 1 + 2σ_ls(1 − cos(2πk/P))). The paper's rule is w ← w − η A⁻¹(∇f_i(w) + n) with
    f_i the per-example term of the objective F = (1/n) Σ f_i, so the regulariser's gradient λθ (part of every
    f_i) is smoothed too; the authors' logistic-regression code adds weight decay after smoothing instead (the
    paper is followed). Privacy: identical to DP-SGD, since A⁻¹ is data-independent post-processing of the noisy
    gradient; no assumption beyond clipping (guarantee "proved"). σ_ls = 0 is `dp_sgd` exactly (same seed, same
    iterates).
    """

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
