"""DP-FTRL: passes over the data in a fixed order, the gradients' prefix sums released by tree aggregation.

Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep) Learning without Sampling or
Shuffling", ICML 2021 (arXiv:2103.00039).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Prepared, Setting, Tags
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain
from dpsgd_cli.algorithms.ops import Clip, Scale, Sgd, TreeAggregation, WeightDecay, constant
from dpsgd_cli.algorithms.sampling import shuffled_batches
from dpsgd_cli.algorithms.sgd import BACKEND_HELP
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.compiled import Backend
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import Model
from dpsgd_cli.privacy.accounting import LIBRARY, dp_event, epsilon_for
from dpsgd_cli.privacy.calibration import CalibrationPoint, EpsilonCurve

if TYPE_CHECKING:
    from dp_accounting.dp_event import DpEvent


class DPFTRLParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    backend: Backend = Field("auto", description=BACKEND_HELP)


def tree_steps(setting: Setting) -> tuple[int, int]:
    """(T, K): the run's steps, T = round(epochs · K) (at least 1), and the steps of a pass, K = ⌊n/B⌋ (a tree's)."""
    per_pass = setting.n // setting.required.batch_size
    return max(1, round(setting.required.epochs * per_pass)), per_pass


def tree_event(sigma: float, steps: int, per_tree: int) -> DpEvent:
    """⌊T/K⌋ trees of K steps and one of T mod K: each example is in every tree at most once, so the trees compose
    (dp-accounting's `SingleEpochTreeAggregationDpEvent` per tree, its docstring's multi-epoch form)."""
    full, rest = divmod(steps, per_tree)
    trees = []
    if full:
        trees.append(dp_event.SelfComposedDpEvent(dp_event.SingleEpochTreeAggregationDpEvent(sigma, per_tree), full))
    if rest:
        trees.append(dp_event.SingleEpochTreeAggregationDpEvent(sigma, rest))
    return trees[0] if len(trees) == 1 else dp_event.ComposedDpEvent(trees)


@functools.lru_cache(maxsize=64)
def tree_curve(delta: float, steps: int, per_tree: int) -> EpsilonCurve:
    """ε(σ) of the trees by dp-accounting's RDP accountant under zero-out neighbours (the one accountant and relation
    that support the event): one curve per (δ, T, K), read by every target of an ε axis."""
    context = f" (delta={delta:g}, steps={steps}, steps per tree={per_tree}, accountant='rdp', neighbours=zero_out)"
    return EpsilonCurve(lambda sigma: (epsilon_for(tree_event(sigma, steps, per_tree), delta, "rdp", "zero_out"), None),
                        context=context)


class DPFTRL(Algorithm):
    """DP-FTRL (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, ICML 2021, arXiv:2103.00039), Algorithm 1 without
    momentum, with unconstrained θ.

    Data order: one permutation per replica, drawn once from its seed (`shuffled_batches(reshuffle=False)`), walked
    in the same order every pass in K = ⌊n/B⌋ batches of B consecutive examples (the last n − KB unused). Nothing
    is sampled: the privacy analysis holds for every order fixed independently of the data, and is not amplified
    by this one; it is drawn rather than taken from the data file so that a file sorted by label or source does not
    decide the result (the order is public).

    Step t: g_t = Σ_{i∈B_t} clip_C(∇ℓ(θ_t; x_i)); the prefix sums s_t = Σ_{τ≤t} g_τ are released by binary-tree
    aggregation with N(0, σ²C²I) per node (`ops.TreeAggregation`: the honest tree, each node noised once), the tree
    restarted every pass. The update is Algorithm 1's θ_{t+1} = argmin_θ ⟨s_t, θ⟩ + (λ_F/2)‖θ − θ_0‖² =
    θ_0 − s_t/λ_F with λ_F = B/η, taken as increments: θ_{t+1} = θ_t − η((s_t − s_{t−1})/B + λθ_t), the
    regulariser's gradient λθ_t (data-independent) linearised into the losses as the data's are; after a restart
    the earlier trees' last released sums stay in θ. The increment's noise depends on the draws alone
    (`ops.TreeNoise`), so the compiled mini-batch backend runs the chain as it runs DP-SGD's (logistic regression;
    `backend` as `dp_sgd`'s).

    Privacy: each example's clipped gradient (norm ≤ C) enters a tree once, so at most ⌈log₂(K + 1)⌉ of its released
    nodes: (ε, δ) by dp-accounting's RDP accountant for `SingleEpochTreeAggregationDpEvent` per tree, composed over
    the trees. The library supports the event under REPLACE_SPECIAL only (a record replaced by a null record whose
    gradient is zero: the paper's relation, here `zero_out`), so that is the relation of the claim; add/remove
    (removing an example shifts every later batch of the fixed order) and replace-one are refused. DP-SGD's ε under
    add/remove is also its zero-out ε (dp-accounting gives the Poisson-sampled Gaussian the same bound under both),
    so the two compare on one ε axis under zero-out. σ: the smallest point of the calibration lattice
    (`EpsilonCurve`) whose ε meets the target.
    """

    name = "dp_ftrl"
    tags = Tags(display_name="DP-FTRL", private=True, batch="mini_batch", neighbours="zero_out", noise_scalable=True,
                selection=frozenset({"papernot_steinke"}), selection_by_event=True)
    uses = frozenset({"epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm"})
    Params: ClassVar[type[BaseModel]] = DPFTRLParams
    source = ("Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, Practical and Private (Deep) Learning without Sampling "
              "or Shuffling, ICML 2021 (arXiv:2103.00039)")
    execution_params = frozenset({"backend"})

    def refuses_neighbours(self, neighbours: str) -> str | None:
        if neighbours == "zero_out":
            return None
        return (f"{self.name} is accounted under zero-out neighbours only (dp-accounting's tree-aggregation bound is "
                f"stated for a record replaced by a null record; removing one would shift every later batch of its "
                f"fixed order); use neighbours: zero_out for it")

    def check(self, setting: Setting, model_name: str = "") -> None:
        if setting.required.batch_size > setting.n:
            raise UserError(f"{self.name}: batch_size {setting.required.batch_size} exceeds the {setting.n} training "
                            f"records (a pass is ⌊n/B⌋ batches of B consecutive records); use batch_size ≤ n")

    def dp_event(self, setting: Setting, derived: dict[str, Any]) -> DpEvent:
        """The trees at the noise multiplier added (σ times the audit twin's noise scale)."""
        steps, per_tree = tree_steps(setting)
        return tree_event(derived.get("sigma_used", derived["sigma"]), steps, per_tree)

    def calibrated_sigma(self, setting: Setting) -> float:
        return _calibration(setting).sigma

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared:
        self.check(setting)
        steps, per_tree = tree_steps(setting)
        point = _calibration(setting)
        batch, clip = setting.required.batch_size, setting.required.clip_norm
        tree = TreeAggregation(point.sigma * clip * self.noise_scale, streams.normal("noise", (model.n_params,)),
                               per_tree)
        chain = GradientChain(
            batches=shuffled_batches(X, y, batch, streams, reshuffle=False),
            ops=[Clip(clip), tree, Scale(1.0 / batch), WeightDecay(setting.l2), Sgd(constant(setting.required.lr))],
            checkpoints=Checkpoints(setting.trace_every, X, y) if setting.trace_every else None,
            examples_per_step=batch,
            stream=("shuffle_once", batch),
            backend=self.params.backend,
        )
        derived: dict[str, Any] = {"steps": steps, "sigma": point.sigma, "epsilon_achieved": point.epsilon,
                                   "accountant": "rdp", "accountant_library": LIBRARY, "steps_per_tree": per_tree,
                                   "tree_depth": math.ceil(math.log2(per_tree + 1))}
        if self.noise_scale != 1.0:  # the audit's broken twin: what the accountant gives for the noise it adds
            scaled = point.sigma * self.noise_scale
            derived.update(noise_scale=self.noise_scale, sigma_used=scaled, epsilon_noise_scaled=float("inf")
                           if scaled <= 0 else epsilon_for(tree_event(scaled, steps, per_tree), setting.delta, "rdp",
                                                           "zero_out"))

        def finish(theta: np.ndarray) -> Outcome:
            return Outcome(theta, dict(derived), guarantee="proved",
                           trace=chain.checkpoints.rows if chain.checkpoints else [])

        theta0 = model.init(streams.generators("init")).astype(X.dtype, copy=False)
        return Prepared(chain, theta0, steps, finish)


def _calibration(setting: Setting) -> CalibrationPoint:
    """The smallest lattice σ whose trees meet the setting's ε, with that ε."""
    steps, per_tree = tree_steps(setting)
    return tree_curve(setting.delta, steps, per_tree).calibrate(setting.required.epsilon,
                                                                sigma_guess=_sigma_guess(setting, steps, per_tree))


def _sigma_guess(setting: Setting, steps: int, per_tree: int) -> float:
    """Where the lattice search starts (σ does not depend on it): the Gaussian mechanism's σ for sensitivity
    √(trees · depth), ε ≈ √(2 ln(1/δ) · trees · depth)/σ."""
    trees = math.ceil(steps / per_tree)
    depth = math.ceil(math.log2(min(steps, per_tree) + 1))
    return max(0.5, math.sqrt(2.0 * math.log(1.0 / setting.delta) * trees * depth) / setting.required.epsilon)
