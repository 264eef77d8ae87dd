"""Mini-batch SGD with α-DP updates (Song, Chaudhuri & Sarwate, GlobalSIP 2013) and its non-private twin, as one
`GradientChain`; the parameters and the data's effect on the clip: docs/algorithms.md (song2013)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Prepared, Setting, Tags, max_row_norm
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.ops import (
    Clip,
    Noise,
    Op,
    ProjectBall,
    Scale,
    Schedule,
    Sgd,
    WeightDecay,
    constant,
    inverse_sqrt,
    inverse_time,
)
from dpsgd_cli.algorithms.sampling import shuffled_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.compiled import Backend
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Batch, Model
from dpsgd_cli.privacy import validate as check
from dpsgd_cli.privacy.mechanisms import advanced_composition_epsilon_per_step, gamma_norm_draws

GRADIENT_BOUND = 1.0  # the paper's ‖∇ℓ‖ ≤ 1, enforced by clipping each example's gradient to norm 1
SENSITIVITY = 2.0 * GRADIENT_BOUND  # L2 sensitivity of Σ_{i∈B_t} ∇ℓ_i when one example is replaced


class Song2013Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schedule: Literal["inv_sqrt", "inv_t", "constant"] = Field(
        "inv_sqrt", description="η_t = lr/√t (inv_sqrt), 1/(λt) (inv_t: lr unused), or lr (constant)")
    radius: float | None = Field(None, gt=0, description="projection radius (default 1/λ, which holds w*)")
    backend: Backend = Field(
        "auto", description="the numba kernels (b = 1, logreg or mlp: single-example; b > 1, logreg: the compiled "
                            "mini-batch step; auto: when numba is installed) or numpy; same random numbers, same "
                            "result")


NoiseDraw = Callable[[np.random.Generator, int], np.ndarray]  # (generator, K steps) → (K, d) draws of Z_t


def clip_binding(model: Model, theta: np.ndarray, X: np.ndarray, y: np.ndarray, clip: float) -> dict[str, Any]:
    """How often the clip at ‖∇ℓ‖ ≤ 1 can bind: the share of rows with ‖x‖ > 1 (for logistic regression
    ‖∇ℓ‖ = |r|·‖x‖ < ‖x‖, so only those rows can be clipped, e.g. after `order: ball_then_project`), and the
    share of examples whose gradient at the final θ exceeds the clip (mean over replicas): a proxy for the
    binding rate along the pass, which the single-example kernel does not count."""
    norms = np.sqrt(np.einsum("ij,ij->i", X, X))
    outside = norms > clip * (1 + 1e-9)
    out = {"rows_outside_unit_ball": float(outside.mean()), "max_row_norm": float(norms.max(initial=0.0))}
    if outside.any():
        rows = np.flatnonzero(outside)
        batch = Batch(X=np.broadcast_to(X[rows], (theta.shape[0], *X[rows].shape)),
                      y=np.broadcast_to(y[rows], (theta.shape[0], rows.size)),
                      weight=np.ones((theta.shape[0], rows.size)),
                      x_norm=np.broadcast_to(norms[rows], (theta.shape[0], rows.size)))
        clipped = model.per_example_grad_norms(theta, batch) > clip
        out["clip_binds_at_final"] = float(clipped.sum(axis=1).mean() / X.shape[0])
    else:
        out["clip_binds_at_final"] = 0.0
    return out


class Song2013PrivateParams(Song2013Params):
    composition: Literal["basic", "advanced"] = Field(
        "basic", description="over k passes: basic (α = ε/k, pure ε-DP) or advanced (the larger of ε/k and the "
                             "per-pass α of advanced composition with δ' = δ: (ε, δ)-DP)")


class Song2013NonPrivate(Algorithm):
    """Non-private SGD of Song et al. 2013 ("non-private" curves): the chain of `song2013` without noise or clip.

    Same seed and batch size as a `song2013` run → the same permutation and batches, schedule and projection.
    Steps: T = round(epochs · ⌊n/b⌋) (one epoch = one pass of ⌊n/b⌋ disjoint batches; n mod b examples left out).
    """

    name = "song2013_nonprivate"
    tags = Tags("non-private SGD (Song et al.)", private=False)
    uses = frozenset({"batch_size", "lr", "epochs", "l2"})
    execution_params = frozenset({"backend"})
    Params = Song2013Params
    source = ("Song, Chaudhuri & Sarwate, Stochastic gradient descent with differentially private updates, "
              "GlobalSIP 2013")

    # The chain shared by both algorithms ------------------------------------------------------------
    def check(self, setting: Setting, model_name: str = "") -> None:
        if setting.l2 is None or not setting.l2 > 0:
            raise UserError(f"{self.name}: l2 = {setting.l2}, but Song et al. 2013 need a λ-strongly convex "
                            f"objective (radius 1/λ, step 1/(λt)); set l2 > 0 in the grid (e.g. 1e-4)")
        if not 1 <= setting.required.batch_size <= setting.n:
            raise UserError(f"{self.name}: batch_size = {setting.batch_size} must be in [1, n = {setting.n}]")
        if self.params.schedule != "inv_t" and not (setting.lr or 0) > 0:
            raise UserError(f"{self.name}: schedule {self.params.schedule} needs lr > 0 in the grid, "
                            f"got {setting.lr}; or use schedule: inv_t")

    def steps(self, setting: Setting) -> tuple[int, int, int]:
        """(per pass ⌊n/b⌋, steps T = round(epochs · ⌊n/b⌋) ≥ 1, passes touched k = ⌈T / ⌊n/b⌋⌉)."""
        self.check(setting)
        per_pass = setting.n // setting.required.batch_size
        steps = max(1, round(setting.required.epochs * per_pass))
        return per_pass, steps, math.ceil(steps / per_pass)

    def radius(self, setting: Setting) -> float:
        return self.params.radius if self.params.radius is not None else 1.0 / setting.l2

    def schedule(self, setting: Setting) -> Schedule:
        if self.params.schedule == "inv_sqrt":
            return inverse_sqrt(setting.required.lr)
        if self.params.schedule == "inv_t":
            return inverse_time(1.0 / setting.l2)
        return constant(setting.required.lr)

    def chain(self, setting: Setting, X: np.ndarray, y: np.ndarray, streams: ReplicaStreams,
              private: tuple[Op, ...] = ()) -> GradientChain:
        """Σ (clipped) ∇ℓ over the batch → [+ Z_t] → ·1/b → + λw → w − η_t · → Π onto the ball."""
        b = setting.required.batch_size
        return GradientChain(
            batches=shuffled_batches(X, y, b, streams),
            ops=[*private, Scale(1.0 / b), WeightDecay(setting.l2), Sgd(self.schedule(setting)),
                 ProjectBall(self.radius(setting))],
            checkpoints=Checkpoints(setting.trace_every, X, y) if setting.trace_every else None,
            examples_per_step=b,
            stream=("shuffled", b),  # reshuffled every pass
            backend=self.params.backend,
        )

    def noise_draw(self, setting: Setting, model: Model, X: np.ndarray,
                   passes: int) -> tuple[NoiseDraw | None, dict[str, Any], str]:
        """(draw of Z_t for K steps from one replica's generator, or None; derived values; guarantee): no noise
        for the non-private version."""
        return None, {}, "non-private"

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared:
        per_pass, steps, passes = self.steps(setting)
        draw, derived, guarantee = self.noise_draw(setting, model, X, passes)
        clip = GRADIENT_BOUND if draw is not None else None
        private = (Clip(GRADIENT_BOUND), Noise(self.noise_scale, streams.per_step("noise", draw))) if draw else ()
        chain = self.chain(setting, X, y, streams, private)
        finish = lambda theta: self._outcome(setting, model, X, y, theta, chain.schedule, chain.ran_on or "numpy",
                                             derived, clip,
                                             guarantee, chain.checkpoints.rows if chain.checkpoints else [])
        return Prepared(chain, model.init(streams.generators("init")), steps, finish)

    def _outcome(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray, theta: np.ndarray, eta: Schedule,
                 backend: str, derived: dict[str, Any], clip: float | None, guarantee: str,
                 trace: list[tuple[int, np.ndarray, np.ndarray]]) -> Outcome:
        per_pass, steps, passes = self.steps(setting)
        derived = {"steps": steps, "sample_rate": setting.required.batch_size / setting.n, "steps_per_pass": per_pass,
                   "passes": passes, "schedule": self.params.schedule, "step_size_first": eta(1),
                   "step_size_last": eta(steps), "radius": self.radius(setting), "backend": backend, **derived}
        if clip is not None:
            derived.update(clip_binding(model, theta, X, y, clip))
        return Outcome(theta, derived, guarantee=guarantee, trace=trace)


class Song2013(Song2013NonPrivate):
    """α-DP mini-batch SGD of Song, Chaudhuri & Sarwate, GlobalSIP 2013 (their mini-batch update and its privacy).

    Gradients clipped to norm 1, so a replaced example moves its batch sum by ≤ 2 and each pass is α-DP; k passes:
    α = ε/k (basic composition), or with `composition: advanced` the larger of ε/k and k-fold advanced composition's."""

    name = "song2013"
    tags = Tags("private SGD (Song et al.)", private=True, neighbours="replace_one", noise_scalable=True,
                own_analysis="Song et al. 2013: noise of density ∝ exp(−(α/2)‖z‖) on a batch sum of sensitivity 2 is "
                             "α-DP per pass, composed over the passes (basic or advanced composition)",
                selection=frozenset({"liu_talwar"}), selection_requires=("composition", "basic"))
    uses = frozenset({"epsilon", "batch_size", "lr", "epochs", "l2"})
    Params = Song2013PrivateParams

    def noise_draw(self, setting: Setting, model: Model, X: np.ndarray,
                   passes: int) -> tuple[NoiseDraw | None, dict[str, Any], str]:
        epsilon = setting.required.epsilon
        alpha, delta_used = epsilon / passes, 0.0
        composition = "pure" if passes == 1 else "basic"
        if self.params.composition == "advanced" and passes > 1:
            advanced, _ = advanced_composition_epsilon_per_step(epsilon, setting.delta, passes,
                                                                delta_prime=setting.delta)
            if advanced > alpha:
                alpha, delta_used, composition = advanced, setting.delta, "advanced"
        d = model.n_params
        x_max = max_row_norm(X)
        bound = model.lipschitz(x_max)
        derived = {
            "epsilon_achieved": epsilon,  # k · (ε/k) = ε, or the advanced-composition total ε (≤ target)
            "delta_achieved": delta_used, "accountant": composition, "alpha_per_pass": alpha,
            "sensitivity": SENSITIVITY, "noise_norm_scale": 2.0 / alpha, "noise_norm_mean": 2.0 * d / alpha,
            "gradient_bound_without_clip": bound, "clip_active": bound is None or bound > GRADIENT_BOUND,
        }
        # Z_t (K steps at a time, in blocks of 64) goes on the batch SUM, i.e. Z_t/b on the mean after scale(1/b)
        # checked once (as gamma_norm_noise checks them), then every block drawn unchecked: the same numbers
        if self.noise_scale != 1.0:  # the audit's broken twin: density ∝ exp(−(α/2)‖z‖/s) is (α/s)-DP per pass
            derived.update(noise_scale=self.noise_scale, epsilon_noise_scaled=float("inf") if self.noise_scale <= 0
                           else epsilon / self.noise_scale)
        scale_, dim = 2.0 / check.positive("alpha", alpha), check.count("d", d)
        return (lambda g, k: gamma_norm_draws(g, scale_, dim, (k,))), derived, "proved"
