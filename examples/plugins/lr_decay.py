"""An algorithm defined outside dpsgd (docs/algorithms.md, "Your own algorithm"): DP-SGD whose learning rate
decays, η_t = η / (1 + decay · (t − 1) / T) at step t of T.

    dpsgd check examples/plugins/lr_decay.py
    dpsgd run grid.yaml --plugin examples/plugins/lr_decay.py     # the grid names `dp_sgd_lr_decay`

The schedule only changes how the released noisy gradients are used (post-processing), so the sampling, clip,
noise, σ calibration and `dp_event` of `dp_sgd` hold unchanged: they are inherited.
"""

import dataclasses

from pydantic import Field

from dpsgd_cli.algorithms.chain import GradientChain
from dpsgd_cli.algorithms.ops import Sgd
from dpsgd_cli.algorithms.sgd import DPSGD, DPSGDParams


class LrDecayParams(DPSGDParams):  # dp_sgd's parameters (accountant, backend), frozen and strict as theirs
    decay: float = Field(1.0, ge=0, allow_inf_nan=False, description="η_T = η / (1 + decay·(T−1)/T); 0: dp_sgd")


class DPSGDLrDecay(DPSGD):
    """DP-SGD (Abadi et al. 2016) with the learning rate η / (1 + decay · (t − 1) / T)."""

    name = "dp_sgd_lr_decay"
    tags = dataclasses.replace(DPSGD.tags, display_name="DP-SGD, decaying learning rate")
    Params = LrDecayParams
    source = "dp_sgd with a decaying learning rate (an example plugin)"

    def chain(self, setting, X, y, streams, private=(), smoothing=()) -> GradientChain:
        chain = super().chain(setting, X, y, streams, private, smoothing)
        lr, decay, steps = setting.required.lr, self.params.decay, setting.steps
        decaying = Sgd(lambda t: lr / (1 + decay * (t - 1) / steps))  # the update op, its schedule replaced
        return dataclasses.replace(chain, ops=[decaying if isinstance(op, Sgd) else op for op in chain.ops])
