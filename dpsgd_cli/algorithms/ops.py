"""The ops of a gradient chain: small typed gradient transformations with state (in the spirit of optax).

One step of a chain, for every replica at once (θ (R, P)):

    g ← Σ_i clip(∇ℓ(θ; x_i))          (the model's per-example sum, at the `Clip` op's per-replica norm)
    g, s_k ← op_k.update(g, s_k, θ)    for the gradient ops in order (noise, scale, weight decay, smoothing, ...)
    θ ← θ + g                          (the last gradient op is an `Update`: g is then −η_t times the gradient)
    θ ← op.project(θ)                  for the `Projection`s after it

Each op is a frozen dataclass: what it computes is its class and its named fields, and its NumPy definition is its
`update` (or `project`). Backends read the classes and the fields (`backends.py`); nothing is matched by name or
position. State (`init(θ) → state`) is what changes from step to step: the clip norms, the step count of the
schedule and of a noise mask, the smoothing's eigenvalues.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpsgd_cli.algorithms.streams import NoiseStream
from dpsgd_cli.errors import UserError

Schedule = Callable[[int], float]  # step t = 1, 2, ... → learning rate


class Op:
    """A gradient transformation: `init(θ) → state`, `update(g, state, θ) → (g, state)` on (R, P) arrays."""

    def init(self, params: np.ndarray) -> Any:
        return None

    def update(self, grad: np.ndarray, state: Any, params: np.ndarray) -> tuple[np.ndarray, Any]:
        raise NotImplementedError


class Update(Op):
    """The op that turns the gradient into the step added to θ (the last gradient op of a chain)."""


class Projection(Op):
    """θ ← project(θ) after the update (projections come after the chain's `Update`)."""

    def update(self, grad: np.ndarray, state: Any, params: np.ndarray) -> tuple[np.ndarray, Any]:
        return grad, state

    def project(self, params: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class Clip(Op):
    """Each example's gradient clipped to the replica's norm C_r before the sum (the model computes the clipped sum,
    reading the norms from this op's state). State: the per-replica norms (R,), constant here; an adaptive clip is
    another op class whose `update` moves them."""

    norm: float

    def init(self, params: np.ndarray) -> np.ndarray:
        return np.full(params.shape[0], float(self.norm))

    def update(self, grad: np.ndarray, state: np.ndarray, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return grad, state


@dataclass(frozen=True, eq=False)
class Noise(Op):
    """g + std · z, z the next step of `draws`: one (R, P) float64 array per step from the replicas' noise streams
    (standard normals, `ReplicaStreams.normal`, for the Gaussian mechanism; song2013's Z_t of density ∝ e^{−‖z‖}),
    cast to the gradient's dtype (a seed gives the same noise whatever the training precision). Every backend takes
    the steps from this one iterator, in step order."""

    std: float
    draws: Iterator[np.ndarray]

    def update(self, grad: np.ndarray, state: Any, params: np.ndarray) -> tuple[np.ndarray, Any]:
        return grad + (self.std * next(self.draws)).astype(grad.dtype, copy=False), state


@dataclass(frozen=True, eq=False)
class MaskedNoise(Op):
    """g + std · z on the replicas whose step is noisy (noisy (T, R) bool, row t − 1 at step t): z is drawn at every
    step, noisy or not, so the noise stream does not depend on the decisions (pidp_sgd). State: the step count."""

    std: float
    draws: Iterator[np.ndarray]
    noisy: np.ndarray

    def init(self, params: np.ndarray) -> int:
        return 0

    def update(self, grad: np.ndarray, state: int, params: np.ndarray) -> tuple[np.ndarray, int]:
        return grad + np.where(self.noisy[state], self.std, 0.0)[:, None] * next(self.draws), state + 1


@dataclass(frozen=True)
class Scale(Op):
    factor: float

    def update(self, grad: np.ndarray, state: Any, params: np.ndarray) -> tuple[np.ndarray, Any]:
        return grad * self.factor, state


@dataclass(frozen=True)
class WeightDecay(Op):
    """Add the regulariser's gradient λθ (data-independent: no privacy cost); λ = 0 leaves g as it is."""

    l2: float

    def update(self, grad: np.ndarray, state: Any, params: np.ndarray) -> tuple[np.ndarray, Any]:
        return (grad + self.l2 * params if self.l2 else grad), state


@dataclass(frozen=True)
class LaplacianSmoothing(Op):
    """g ← (I − σ_ls Δ)⁻¹ g for each replica's gradient, by FFT (O(P log P)); Δ the 1-D discrete Laplacian with
    periodic boundary on the flat parameter vector (Wang et al., DP-LSSGD). State: the inverse eigenvalues for P.
    Data-independent post-processing: no privacy cost."""

    sigma_ls: float

    def __post_init__(self) -> None:
        if not (np.isfinite(self.sigma_ls) and self.sigma_ls >= 0):
            raise UserError(f"smoothing must be a finite number ≥ 0, got {self.sigma_ls!r}")

    def init(self, params: np.ndarray) -> np.ndarray:
        P = params.shape[-1]
        return 1.0 / laplacian_eigenvalues(self.sigma_ls, P)[: P // 2 + 1]

    def update(self, grad: np.ndarray, state: np.ndarray, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.sigma_ls == 0:
            return grad, state
        P = grad.shape[-1]
        return np.fft.irfft(np.fft.rfft(grad, axis=-1) * state, n=P, axis=-1), state


@dataclass(frozen=True)
class Sgd(Update):
    """The step −η_t g (t = 1, 2, ...: the state counts the steps)."""

    schedule: Schedule

    def init(self, params: np.ndarray) -> int:
        return 0

    def update(self, grad: np.ndarray, state: int, params: np.ndarray) -> tuple[np.ndarray, int]:
        return -(self.schedule(state + 1) * grad), state + 1


@dataclass(frozen=True)
class ProjectBall(Projection):
    """Euclidean projection of each replica's θ onto {‖θ‖ ≤ radius}."""

    radius: float

    def project(self, params: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(params, axis=1, keepdims=True)
        return np.asarray(params * np.minimum(1.0, self.radius / np.maximum(norm, 1e-300)))


@dataclass(frozen=True)
class ProjectBox(Projection):
    """Projection of each replica's θ onto the box [−radius, radius]^P (coordinate-wise clipping)."""

    radius: float

    def project(self, params: np.ndarray) -> np.ndarray:
        return np.asarray(np.clip(params, -self.radius, self.radius))


# --- schedules ------------------------------------------------------------------------------------------------------


def constant(lr: float) -> Schedule:
    return lambda t: lr


def inverse_sqrt(c: float) -> Schedule:
    """η_t = c/√t (Song et al. 2013 use c = 1 and 10; Bassily et al. 2014: R/(l√t))."""
    return lambda t: c / t**0.5


def inverse_time(c: float) -> Schedule:
    """η_t = c/t (for an s-strongly convex objective c = 1/s: Bassily et al. 2014; Song et al. 2013 1/(λt))."""
    return lambda t: c / t


def min_inverse_time(beta: float, gamma: float) -> Schedule:
    """η_t = min(1/β, 1/(γt)) (Wu et al. 2017, strongly convex case)."""
    return lambda t: min(1.0 / beta, 1.0 / (gamma * t))


def laplacian_eigenvalues(sigma_ls: float, P: int) -> np.ndarray:
    """Eigenvalues 1 + 2σ_ls(1 − cos(2πk/P)), k = 0..P−1, of A = I − σ_ls Δ, Δ the periodic 1-D Laplacian on R^P.

    Δv_i = v_{i−1} − 2v_i + v_{i+1} (indices mod P) is circulant, so the DFT diagonalises it. P = 1: Δ = 0
    (both neighbours are the entry itself); P = 2: Δ = [[−2, 2], [2, −2]] (both neighbours are the other entry).
    """
    k = np.arange(P)
    return 1.0 + 2.0 * sigma_ls * (1.0 - np.cos(2.0 * np.pi * k / P))


def smoothed_noise_variance_factor(sigma_ls: float, P: int) -> float:
    """Per-coordinate variance of (I − σ_ls Δ)⁻¹ z over that of z ~ N(0, I): (1/P) Σ_k (1 + 2σ_ls(1 − cos 2πk/P))⁻²."""
    return float(np.mean(laplacian_eigenvalues(sigma_ls, P) ** -2.0))


# --- the step, once, in NumPy ---------------------------------------------------------------------------------------


@dataclass
class OpStates:
    """The ops of a chain and their states (made by `init` at the chain's first step)."""

    ops: tuple[Op, ...]
    states: list[Any] = field(default_factory=list)

    def clip_norms(self, params: np.ndarray) -> np.ndarray | None:
        """The per-replica clip norms of the chain's `Clip` op (None: no clip)."""
        self._ready(params)
        for op, state in zip(self.ops, self.states):
            if isinstance(op, Clip):
                return np.asarray(state)
        return None

    def set_clip_norms(self, norms: np.ndarray, params: np.ndarray) -> None:
        """Put the `Clip` op's per-replica norms where a compiled backend's steps left them (an `AdaptiveClip`'s
        moved norms: what `clip_norms` then reads)."""
        self._ready(params)
        k = next(k for k, op in enumerate(self.ops) if isinstance(op, Clip))
        self.states[k] = np.array(norms, dtype=np.float64)

    def clipped_sum(self, model: Any, params: np.ndarray, batch: Any) -> np.ndarray:
        """The batch's sum of clipped per-example gradients at the `Clip` op's norms (none: unclipped); an
        `AdaptiveClip` releases it (its noise added) and moves its norms."""
        self._ready(params)
        for k, op in enumerate(self.ops):
            if isinstance(op, AdaptiveClip):
                grad, self.states[k] = op.release(model, params, batch, self.states[k])
                return grad
        return np.asarray(model.clipped_grad_sum(params, batch, clip_argument(self.clip_norms(params))))

    def step(self, grad: np.ndarray, params: np.ndarray) -> np.ndarray:
        """θ after one step from the clipped sum `grad`: the gradient ops, θ + update, the projections."""
        self._ready(params)
        for k, op in enumerate(self.ops):
            if isinstance(op, Projection):
                params = op.project(params)
                continue
            grad, self.states[k] = op.update(grad, self.states[k], params)
            if isinstance(op, Update):
                params += grad
        return params

    def _ready(self, params: np.ndarray) -> None:
        if not self.states:
            self.states = [op.init(params) for op in self.ops]


def clip_argument(norms: np.ndarray | None) -> float | np.ndarray | None:
    """The models' `clip` argument for per-replica norms: a number when every replica has the same, else (R, 1)."""
    if norms is None:
        return None
    return float(norms[0]) if np.all(norms == norms[0]) else norms[:, None]


# --- tree aggregation (DP-FTRL) -------------------------------------------------------------------------------------


class TreeNoise:
    """The tree's noise, step by step: the nodes of the current tree as their standard-normal draws, and the noise of
    each step's increment of the released prefix sums (in units of the node's std).

    At step t of a tree (1, 2, ..., restarted every `steps_per_tree` steps) the node of the dyadic interval
    (t − 2^v, t] completes, 2^v the lowest set bit of t, noised by the step's draw z_t; it covers the last v nodes of
    t − 1's dyadic decomposition. The released prefix sum s_t is the sum of the noisy nodes of t's decomposition
    (exact sum + noise, each node noised once: the honest tree, without the efficient estimator's shortcuts), so
    s_t − s_{t−1} = g_t + std · (z_t − the draws of the v covered nodes), whose noise depends on the draws alone."""

    def __init__(self, steps_per_tree: int):
        self.steps_per_tree = steps_per_tree
        self.t = 0
        self.nodes: list[np.ndarray] = []  # the current decomposition's draws, oldest (longest node) first

    def block(self, draws: np.ndarray) -> np.ndarray:
        """The increments' noise (k, R, ...) of the next k steps from their draws (k, R, ...)."""
        out = np.empty_like(draws)
        for k, z in enumerate(draws):
            if self.t == self.steps_per_tree:  # the tree restarts: no node of the previous one is released again
                self.t, self.nodes = 0, []
            self.t += 1
            covered = (self.t & -self.t).bit_length() - 1
            out[k] = z
            for node in self.nodes[len(self.nodes) - covered:]:
                out[k] -= node
            del self.nodes[len(self.nodes) - covered:]
            self.nodes.append(z.copy())  # not a view: the block it came from can go
        return out


@dataclass(frozen=True, eq=False)
class TreeAggregation(Noise):
    """The prefix sums of the gradients released by binary-tree aggregation with N(0, std²) per node and coordinate
    (Dwork, Naor, Pitassi & Rothblum 2010; Chan, Shi & Song 2011; Kairouz et al. 2021's DP-FTRL), the tree restarted
    every `steps_per_tree` steps: g + std · d_t, the increment s_t − s_{t−1} of the released sums (s_0 = 0 at each
    restart), d_t the tree's noise (`TreeNoise`) of the replicas' standard normals `normals` (`ReplicaStreams.normal`),
    one per step. As a `Noise` whose draws are d_t, every backend reads it as it reads DP-SGD's noise. An example's
    gradient is in at most ⌈log₂(K + 1)⌉ released nodes of a tree of K steps (dp-accounting's
    `SingleEpochTreeAggregationDpEvent`)."""

    draws: Iterator[np.ndarray] = field(init=False, repr=False)
    normals: NoiseStream
    steps_per_tree: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "draws", self.normals.derived(TreeNoise(self.steps_per_tree).block))


# --- adaptive optimisers and clipping --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Adam(Sgd):
    """Adam's step (Kingma & Ba, ICLR 2015, bias-corrected) on the gradient g, at the schedule's η_t:

        m ← β₁ m + (1 − β₁) g,   v ← β₂ v + (1 − β₂) g²,   θ ← θ − η_t m̂ / (√v̂ + ε),
        m̂ = m / (1 − β₁ᵗ),   v̂ = v / (1 − β₂ᵗ).

    State: (t, m, v), m and v (R, P) per replica. An `Sgd` for what reads a chain's schedule (the audit's step
    model, the compiled backends' η_t); the tail tells them apart by exact class."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def init(self, params: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:  # type: ignore[override]
        return 0, np.zeros_like(params), np.zeros_like(params)

    def update(self, grad: np.ndarray, state: tuple[int, np.ndarray, np.ndarray],  # type: ignore[override]
               params: np.ndarray) -> tuple[np.ndarray, tuple[int, np.ndarray, np.ndarray]]:
        t, m, v = state
        t += 1
        m = self.beta1 * m + (1.0 - self.beta1) * grad
        v = self.beta2 * v + (1.0 - self.beta2) * (grad * grad)
        m_hat = m / (1.0 - self.beta1**t)
        v_hat = v / (1.0 - self.beta2**t)
        return -(self.schedule(t) * m_hat / (np.sqrt(v_hat) + self.eps)), (t, m, v)


@dataclass(frozen=True, eq=False)
class AdaptiveClip(Clip):
    """Quantile-based adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
    Adaptive Clipping", NeurIPS 2021): the clip, the sum's Gaussian release and the count's, one step each.

        g = Σ_i clip_{C_t}(∇ℓ_i) + σ_Δ C_t z,                          z ~ N(0, I)  (R, P)
        b̄ = (Σ_i (1[‖∇ℓ_i‖ ≤ C_t] − 1/2) + σ_b z_b) / B + 1/2,      z_b ~ N(0, 1) (R,)
        C_{t+1} = C_t · exp(−η_C (b̄ − γ))

    The count is of the centred indicators (each example moves it by 1/2), B the expected batch size. The sum's noise
    is relative to the norm the step clipped at, so it is added here, not by a `Noise` op. `norm` is C_0; state: the
    per-replica norms (R,), what the model's clipped sum reads (`OpStates.clipped_sum`)."""

    quantile: float  # γ
    lr: float  # η_C
    noise_multiplier: float  # σ_Δ
    draws: Iterator[np.ndarray]  # (R, P) standard normals a step
    count_std: float  # σ_b
    count_draws: Iterator[np.ndarray]  # (R,) standard normals a step
    expected_batch: float  # B

    def release(self, model: Any, params: np.ndarray, batch: Any,
                norms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the noisy clipped sum at the norms C_t, the norms C_{t+1})."""
        clip = clip_argument(norms)
        grad = model.clipped_grad_sum(params, batch, clip)
        grad = grad + ((self.noise_multiplier * norms)[:, None] * next(self.draws)).astype(grad.dtype, copy=False)
        centred = model.unclipped_count(params, batch, clip) - 0.5 * np.sum(batch.weight, axis=1)
        fraction = (centred + self.count_std * next(self.count_draws)) / self.expected_batch + 0.5
        return grad, norms * np.exp(-self.lr * (fraction - self.quantile))
