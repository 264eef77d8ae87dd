"""DP-LSSGD: DP-SGD whose noisy gradient is smoothed by the inverse of I − σ_ls Δ (Wang et al. 2019/2020).

Wang, Gu, Boedihardjo, Barekat, Osher, "DP-LSSGD: A Stochastic Optimization Method to Lift the Utility in
Privacy-Preserving ERM", MSML 2020 (arXiv:1906.12056).
"""

from __future__ import annotations

from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Outcome, Setting
from dpsgd_cli.algorithms.chain import GradientChain, Transform
from dpsgd_cli.algorithms.sgd import DPSGD
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Model


# --- shared building block (belongs in chain.py) ------------------------------------------------------------------
def laplacian_eigenvalues(sigma_ls: float, P: int) -> np.ndarray:
    """Eigenvalues 1 + 2σ_ls(1 − cos(2πk/P)), k = 0..P−1, of A = I − σ_ls Δ, Δ the periodic 1-D Laplacian on R^P.

    Δv_i = v_{i−1} − 2v_i + v_{i+1} (indices mod P) is circulant, so the DFT diagonalises it. P = 1: Δ = 0
    (both neighbours are the entry itself); P = 2: Δ = [[−2, 2], [2, −2]] (both neighbours are the other entry).
    """
    k = np.arange(P)
    return 1.0 + 2.0 * sigma_ls * (1.0 - np.cos(2.0 * np.pi * k / P))


def laplacian_smoothing(sigma_ls: float, P: Optional[int] = None) -> Transform:
    """g ← (I − σ_ls Δ)⁻¹ g for each replica's gradient (R, P), by FFT (O(P log P)).

    Δ is the 1-D discrete Laplacian with periodic boundary on the flat parameter vector (Wang et al., DP-LSSGD;
    Osher et al., Laplacian smoothing gradient descent). σ_ls = 0 is the identity (returns g itself). With P
    None the length is taken from the gradient at the first call (a chain is built before the model is known).
    Data-independent post-processing: no privacy cost.
    """
    sigma_ls = float(sigma_ls)
    if not (np.isfinite(sigma_ls) and sigma_ls >= 0):
        raise UserError(f"smoothing must be a finite number ≥ 0, got {sigma_ls!r}")
    if sigma_ls == 0:
        return lambda g, theta: g
    cache: dict[int, np.ndarray] = {}
    if P is not None:
        cache[int(P)] = 1.0 / laplacian_eigenvalues(sigma_ls, int(P))[: int(P) // 2 + 1]

    def smooth(g: np.ndarray, theta: np.ndarray) -> np.ndarray:
        p = g.shape[-1]
        if P is not None and p != P:
            raise ValueError(f"laplacian_smoothing built for P = {P}, got a gradient of length {p}")
        inverse = cache.get(p)
        if inverse is None:
            inverse = cache[p] = 1.0 / laplacian_eigenvalues(sigma_ls, p)[: p // 2 + 1]
        return np.fft.irfft(np.fft.rfft(g, axis=-1) * inverse, n=p, axis=-1)

    return smooth


def smoothed_noise_variance_factor(sigma_ls: float, P: int) -> float:
    """Per-coordinate variance of (I − σ_ls Δ)⁻¹ z over that of z ~ N(0, I): (1/P) Σ_k (1 + 2σ_ls(1 − cos 2πk/P))⁻²."""
    return float(np.mean(laplacian_eigenvalues(sigma_ls, P) ** -2.0))


# --- the algorithm -------------------------------------------------------------------------------------------------
class DPLSSGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    smoothing: float = Field(1.0, ge=0, allow_inf_nan=False,
                             description="Laplacian smoothing constant σ_ls ≥ 0 (0: DP-SGD exactly)")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="dp-accounting accountant used to calibrate σ")


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
    Params = DPLSSGDParams
    source = ("Wang, Gu, Boedihardjo, Barekat, Osher, DP-LSSGD: A Stochastic Optimization Method to Lift the Utility "
              "in Privacy-Preserving ERM, MSML 2020 (arXiv:1906.12056)")

    def chain(self, setting: Setting, X, y, streams: ReplicaStreams, clip=None, noise=()) -> GradientChain:
        chain = super().chain(setting, X, y, streams, clip=clip, noise=noise)
        # after scale(1/B) and add_l2(λ): A⁻¹ acts on the whole noisy gradient of F (see the class docstring)
        chain.transforms = [*chain.transforms, laplacian_smoothing(self.params.smoothing)]
        return chain

    def fit(self, setting: Setting, model: Model, X, y, streams: ReplicaStreams) -> Outcome:
        outcome = super().fit(setting, model, X, y, streams)
        outcome.derived["smoothing"] = self.params.smoothing
        outcome.derived["smoothed_noise_variance_factor"] = smoothed_noise_variance_factor(
            self.params.smoothing, model.n_params)
        return outcome
