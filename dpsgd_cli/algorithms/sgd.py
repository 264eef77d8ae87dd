"""Mini-batch SGD with Poisson sampling: non-private `sgd` and `dp_sgd` (Abadi et al., CCS 2016)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Prepared, Setting, Tags
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.ops import Clip, Noise, Op, Scale, Sgd, WeightDecay, constant
from dpsgd_cli.algorithms.sampling import poisson_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.compiled import Backend
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Model
from dpsgd_cli.privacy.accounting import (
    AccountantName,
    Neighbours,
    calibrate_sigma,
    check_dpsgd_neighbours,
    dpsgd_epsilon,
    dpsgd_event,
)

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent


BACKEND_HELP = ("logistic regression: the compiled mini-batch or full-batch step (auto: when numba is "
                "installed) or numpy; same random numbers, same result up to summation order")


class SGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    backend: Backend = Field("auto", description=BACKEND_HELP)


class SGD(Algorithm):
    """Non-private reference with the sampling and schedule of `dp_sgd`: no clipping, no noise.

    Same seed and batch size as a `dp_sgd` run → the same batches, so the two differ only by clip and noise.
    """

    name = "sgd"
    tags = Tags("SGD (non-private)", private=False, float32=True)
    uses = frozenset({"batch_size", "lr", "epochs", "l2"})
    source = "non-private mini-batch SGD"
    Params: ClassVar[type[BaseModel]] = SGDParams  # typed as the base declares it: subclasses bring their own
    execution_params = frozenset({"backend"})

    def chain(self, setting: Setting, X, y, streams: ReplicaStreams, private: tuple[Op, ...] = (),
              smoothing: tuple[Op, ...] = ()) -> GradientChain:
        """[clip, noise] → ·1/B → + λθ → [smoothing] → −η ·."""
        return GradientChain(
            batches=poisson_batches(X, y, setting.sample_rate, streams),
            ops=[*private, Scale(1.0 / setting.required.batch_size), WeightDecay(setting.l2), *smoothing,
                 Sgd(constant(setting.required.lr))],
            checkpoints=Checkpoints(setting.trace_every, X, y) if setting.trace_every else None,
            examples_per_step=setting.required.batch_size,
            stream=("poisson", setting.sample_rate),
            backend=getattr(self.params, "backend", "auto"),
        )

    def prepare(self, setting: Setting, model: Model, X, y, streams: ReplicaStreams) -> Prepared:
        chain = self.chain(setting, X, y, streams)
        return self._prepared(setting, model, X, streams, chain, {}, "non-private")

    @staticmethod
    def _prepared(setting: Setting, model: Model, X, streams: ReplicaStreams, chain: GradientChain, derived: dict,
                  guarantee: str) -> Prepared:
        derived = {"steps": setting.steps, "sample_rate": setting.sample_rate, **derived}
        finish = lambda theta: Outcome(theta, derived, guarantee=guarantee,
                                       trace=chain.checkpoints.rows if chain.checkpoints else [])
        return Prepared(chain, model.init(streams.generators("init")).astype(X.dtype, copy=False), setting.steps,
                        finish)


class DPSGDParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    accountant: AccountantName = Field("rdp", description="dp-accounting accountant used to calibrate σ")
    backend: Backend = Field("auto", description=BACKEND_HELP)


class DPSGD(SGD):
    """DP-SGD: Poisson sampling (rate q = B/n), clip each example's gradient to C, add N(0, σ²C²I) to the sum,
    divide by the expected batch size B; σ is the smallest noise multiplier for which the accountant
    gives ε ≤ target after T = epochs·n/B steps (Abadi et al. 2016, Algorithm 1)."""

    name = "dp_sgd"
    tags = Tags("DP-SGD", private=True, float32=True, noise_scalable=True, selection=frozenset({"papernot_steinke"}))
    uses = frozenset({"epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm"})
    Params: ClassVar[type[BaseModel]] = DPSGDParams
    source = "Abadi et al., Deep Learning with Differential Privacy, CCS 2016"

    def refuses_neighbours(self, neighbours: str) -> str | None:
        """Both relations, through the accountant (RDP: add/remove only, see `check_dpsgd_neighbours`)."""
        try:
            check_dpsgd_neighbours(self.params.accountant, neighbours)
        except UserError as exc:
            return f"{self.name}: {exc}"
        return None

    def dp_event(self, setting: Setting, derived: dict) -> DpEvent:
        """Poisson-sampled Gaussian at the noise multiplier added, composed T times (Abadi et al. 2016)."""
        return dpsgd_event(derived.get("sigma_used", derived["sigma"]), setting.sample_rate, setting.steps)

    def sigma_calibration(self, setting: Setting) -> tuple[float, float, float, int, AccountantName, Neighbours]:
        return (setting.required.epsilon, setting.delta, setting.sample_rate, setting.steps, self.params.accountant,
                self.neighbouring())

    def prepare(self, setting: Setting, model: Model, X, y, streams: ReplicaStreams) -> Prepared:
        args = self.sigma_calibration(setting)
        cal = calibrate_sigma(*args)
        draws = streams.normal("noise", (model.n_params,))
        std = cal.sigma * setting.required.clip_norm * self.noise_scale
        chain = self.chain(setting, X, y, streams, (Clip(setting.required.clip_norm), Noise(std, draws)))
        derived = {"sigma": cal.sigma, "epsilon_achieved": cal.epsilon, "accountant": cal.accountant,
                   "accountant_library": cal.library}
        if self.noise_scale != 1.0:  # the audit's broken twin: what the accountant gives for the noise it adds
            derived.update(noise_scale=self.noise_scale, sigma_used=cal.sigma * self.noise_scale,
                           epsilon_noise_scaled=_scaled_epsilon(cal.sigma * self.noise_scale, setting, *args[4:]))
        return self._prepared(setting, model, X, streams, chain, derived, "proved")


def _scaled_epsilon(sigma: float, setting: Setting, accountant: str, neighbours: str) -> float:
    """ε at the setting's δ of DP-SGD with noise multiplier `sigma` (∞ without noise)."""
    if sigma <= 0:
        return float("inf")
    return float(dpsgd_epsilon(sigma, setting.sample_rate, setting.steps, setting.delta, accountant, neighbours))
