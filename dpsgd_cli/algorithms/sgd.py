"""Mini-batch SGD with Poisson sampling: non-private `sgd` and `dp_sgd` (Abadi et al., CCS 2016)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.adaptive_clipping import (
    AdaptiveClipParams,
    adaptive_clip,
    adaptive_event,
    count_std,
    gradient_noise_multiplier,
)
from dpsgd_cli.algorithms.base import Algorithm, Outcome, Prepared, Setting, Tags
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.ops import Clip, Noise, Op, Scale, Sgd, Update, WeightDecay, constant
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

    def chain(self, setting: Setting, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams,
              private: tuple[Op, ...] = (), smoothing: tuple[Op, ...] = ()) -> GradientChain:
        """[clip, noise] → ·1/B → + λθ → [smoothing] → −η ·."""
        return GradientChain(
            batches=poisson_batches(X, y, setting.sample_rate, streams),
            ops=[*private, Scale(1.0 / setting.required.batch_size), WeightDecay(setting.l2), *smoothing,
                 self.step_rule(setting)],
            checkpoints=Checkpoints(setting.trace_every, X, y) if setting.trace_every else None,
            examples_per_step=setting.required.batch_size,
            stream=("poisson", setting.sample_rate),
            backend=getattr(self.params, "backend", "auto"),
        )

    def step_rule(self, setting: Setting) -> Update:
        """The chain's `Update` op: −η g."""
        return Sgd(constant(setting.required.lr))

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared:
        chain = self.chain(setting, X, y, streams)
        return self._prepared(setting, model, X, streams, chain, {}, "non-private")

    @staticmethod
    def _prepared(setting: Setting, model: Model, X: np.ndarray, streams: ReplicaStreams, chain: GradientChain,
                  derived: dict[str, Any],
                  guarantee: str) -> Prepared:
        derived = {"steps": setting.steps, "sample_rate": setting.sample_rate, **derived}
        finish = lambda theta: Outcome(theta, derived, guarantee=guarantee,
                                       trace=chain.checkpoints.rows if chain.checkpoints else [])
        return Prepared(chain, model.init(streams.generators("init")).astype(X.dtype, copy=False), setting.steps,
                        finish)


class DPSGDParams(AdaptiveClipParams):
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
        """Both relations, through the accountant (RDP: add/remove only, see `check_dpsgd_neighbours`); adaptive
        clipping add/remove only (dp-accounting's PLD accountant has no event for its two releases of one sample)."""
        if self.adaptive and neighbours != "add_remove":
            return f"{self.name}: adaptive clipping (clip_quantile) is accounted under add/remove neighbours only"
        try:
            check_dpsgd_neighbours(self.params.accountant, neighbours)
        except UserError as exc:
            return f"{self.name}: {exc}"
        return None

    @property
    def adaptive(self) -> bool:
        """Whether the clip norm adapts (`clip_quantile`; an algorithm whose Params lack it clips at C)."""
        return getattr(self.params, "clip_quantile", None) is not None

    def check(self, setting: Setting, model_name: str = "") -> None:
        """Adaptive clipping: the count's noise must leave the clipped sum a finite noise multiplier."""
        if self.adaptive:
            batch_size = setting.required.batch_size
            gradient_noise_multiplier(calibrate_sigma(*self.sigma_calibration(setting)).sigma,
                                      count_std(self.params, batch_size), batch_size, self.name)

    def dp_event(self, setting: Setting, derived: dict[str, Any]) -> DpEvent:
        """Poisson-sampled Gaussian at the noise multiplier added, composed T times (Abadi et al. 2016); with
        adaptive clipping the two Gaussian releases of each sample (`adaptive_clipping.adaptive_event`)."""
        if "clip_count_std" in derived:
            scale = derived.get("noise_scale", 1.0)
            return adaptive_event(derived["sigma_gradient"] * scale, derived["clip_count_std"] * scale,
                                  setting.sample_rate, setting.steps)
        return dpsgd_event(float(derived.get("sigma_used", derived["sigma"])), setting.sample_rate, setting.steps)

    def sigma_calibration(self, setting: Setting) -> tuple[float, float, float, int, AccountantName, Neighbours]:
        return (setting.required.epsilon, setting.delta, setting.sample_rate, setting.steps, self.params.accountant,
                self.neighbouring())

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared:
        args = self.sigma_calibration(setting)
        cal = calibrate_sigma(*args)
        derived = {"sigma": cal.sigma, "epsilon_achieved": cal.epsilon, "accountant": cal.accountant,
                   "accountant_library": cal.library}
        chain = self.chain(setting, X, y, streams, self.private_ops(setting, model, streams, cal.sigma, derived))
        if self.noise_scale != 1.0:  # the audit's broken twin: what the accountant gives for the noise it adds
            derived.update(noise_scale=self.noise_scale, sigma_used=cal.sigma * self.noise_scale,
                           epsilon_noise_scaled=_scaled_epsilon(cal.sigma * self.noise_scale, setting, *args[4:]))
        prepared = self._prepared(setting, model, X, streams, chain, derived, "proved")
        if self.adaptive:  # each seed's row records where its clip norm ended
            finish = prepared.finish

            def finish_adaptive(theta: np.ndarray) -> Outcome:
                outcome = finish(theta)
                norms = chain.clip_norms(theta)
                outcome.derived["clip_norm_final"] = [] if norms is None else norms.tolist()
                return outcome

            prepared.finish = finish_adaptive
        return prepared

    def private_ops(self, setting: Setting, model: Model, streams: ReplicaStreams, sigma: float,
                    derived: dict[str, Any]) -> tuple[Op, ...]:
        """Clip at C and the sum's noise σC; with `clip_quantile`, one `AdaptiveClip` (its noises recorded in
        `derived`: σ_Δ as sigma_gradient, σ_b as clip_count_std)."""
        draws = streams.normal("noise", (model.n_params,))
        clip, batch_size = setting.required.clip_norm, setting.required.batch_size
        if not self.adaptive:
            return Clip(clip), Noise(sigma * clip * self.noise_scale, draws)
        sigma_b = count_std(self.params, batch_size)
        sigma_delta = gradient_noise_multiplier(sigma, sigma_b, batch_size, self.name)
        derived.update(sigma_gradient=sigma_delta, clip_count_std=sigma_b)
        return (adaptive_clip(self.params, clip, batch_size, sigma_delta * self.noise_scale, sigma_b * self.noise_scale,
                              draws, streams.normal("clip_count", ())),)


def _scaled_epsilon(sigma: float, setting: Setting, accountant: str, neighbours: str) -> float:
    """ε at the setting's δ of DP-SGD with noise multiplier `sigma` (∞ without noise)."""
    if sigma <= 0:
        return float("inf")
    return float(dpsgd_epsilon(sigma, setting.sample_rate, setting.steps, setting.delta, accountant, neighbours))
