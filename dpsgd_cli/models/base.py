"""What every model offers the algorithms. Parameters are flat, with a leading replica axis: θ has shape (R, P)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

BLOCK_ELEMENTS = 1 << 21  # numbers per (R, k, P) temporary of `hessian`
ClipNorm = float | np.ndarray | None  # a clip norm: one for every replica, one per replica (R, 1), or none


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Batch:
    """One mini-batch per replica, padded to a common size M: X (R, M, d), y (R, M) in {-1, +1}, weight (R, M)
    0 on padding, x_norm (R, M) row norms (a linear model clips without per-example gradients)."""

    X: np.ndarray
    y: np.ndarray
    weight: np.ndarray
    x_norm: np.ndarray


@dataclass(frozen=True)
class FixedGradients:
    """Rows of the training data whose per-example gradient is a fixed vector whatever θ, added per replica with a
    weight: the audit's gradient and Dirac canaries (audit/canaries.py), as data a compiled step reads. For each
    such row in a replica's batch the clipped sum gains weight[r, j] · c · u_j, c = min(raw_norm, C_r) under a
    clip (raw_norm without), u_j = Σ_k val[j, k] e_idx[j, k]; before every step the replica's ⟨θ, u_j⟩ are handed
    to `record` ((steps, R, m) blocks, in step order)."""

    row: np.ndarray  # (n,) int64: the fixed gradient j of each row of X, −1 for a data row
    idx: np.ndarray  # (m, K) int64: u_j's nonzero coordinates (padding: value 0)
    val: np.ndarray  # (m, K) float64
    weight: np.ndarray  # (R, m): 1 in, 0 the null record, −1 the replace-one mirror
    raw_norm: float
    record: Callable[[np.ndarray], None]


class Model:
    """Objective F(θ) = (1/n) Σ ℓ(θ; x_i, y_i) + (λ/2)‖θ‖², evaluated for R replicas at once."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions
    convex: ClassVar[bool] = False  # is ℓ(·; x, y) convex in θ (the private ERM proofs need it)?
    # does `data_loss_and_accuracy` on float64 data give each θ of a stack the numbers it gets alone, bit for bit
    # (so the engine may compute a fused task's metrics in one call)? BLAS products may not: their order of
    # summation can depend on the shape of the call.
    stacked_metrics: ClassVar[bool] = False

    def __init__(self, d: int, l2: float):
        self.d = d
        self.l2 = l2

    @property
    def n_params(self) -> int:
        raise NotImplementedError

    def init(self, generators: Sequence[np.random.Generator]) -> np.ndarray:
        """Initial parameters (R, P), one generator per replica (independent of the data)."""
        raise NotImplementedError

    def data_loss(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mean loss (1/n) Σ ℓ for each replica: shape (R,)."""
        raise NotImplementedError

    def data_gradient(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient of the mean loss: (R, P)."""
        raise NotImplementedError

    def reads_rows_compiled(self, batch: Batch, theta: np.ndarray) -> bool:
        """Whether `clipped_grad_sum` reads this batch's rows in compiled kernels (a chain's backend "numba-rows")."""
        return False

    def fixed_gradients(self, y: np.ndarray, x_norm: np.ndarray) -> FixedGradients | None:
        """The rows (labels y, norms x_norm) whose gradient this model fixes, where it fixes some (the audit's canary
        models); `clipped_grad_sum` is then the model's own plus theirs. None: every row is a data row."""
        return None

    def clipped_grad_sum(self, theta: np.ndarray, batch: Batch, clip: ClipNorm) -> np.ndarray:
        """Σ_i weight_i · min(1, C/‖∇ℓ_i‖) ∇ℓ_i over the batch, without the regulariser: (R, P). C: a number, one
        per replica (R, 1), or None (no clip)."""
        raise NotImplementedError

    def _clipped_grad_sum_per_replica(self, theta: np.ndarray, batch: Batch,
                                      clip: ClipNorm) -> np.ndarray | None:
        """`clipped_grad_sum` replica by replica, each on its own rows, where the replicas keep different numbers of
        rows (Poisson sampling), else None: a BLAS product rounds differently with M (docs/design.md)."""
        parts = getattr(batch, "per_replica", None)
        if parts is None:
            return None
        return np.concatenate([self.clipped_grad_sum(theta[r:r + 1], part,
                                                     clip[r:r + 1] if isinstance(clip, np.ndarray) else clip)
                               for r, part in enumerate(parts)])

    def per_example_grad_norms(self, theta: np.ndarray, batch: Batch) -> np.ndarray:
        """‖∇ℓ(θ; x_i, y_i)‖ for every batch entry: (R, M)."""
        raise NotImplementedError

    def unclipped_count(self, theta: np.ndarray, batch: Batch, clip: float | np.ndarray) -> np.ndarray:
        """Σ_i weight_i · 1[‖∇ℓ_i‖ ≤ C] over the batch: (R,), the examples the clip leaves as they are (adaptive
        clipping's count). C: a number or one per replica (R, 1). Replica by replica on its own rows where the
        replicas keep different numbers of rows, as `_clipped_grad_sum_per_replica` and for the same reason."""
        parts = getattr(batch, "per_replica", None)
        if parts is not None:
            return np.concatenate([self.unclipped_count(theta[r:r + 1], part,
                                                        clip[r:r + 1] if isinstance(clip, np.ndarray) else clip)
                                   for r, part in enumerate(parts)])
        norms = self.per_example_grad_norms(theta, batch)
        return np.sum(np.where(norms <= clip, batch.weight, 0.0), axis=1)

    def decision(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Scores whose sign is the predicted label: (R, n)."""
        raise NotImplementedError

    def hvp(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Exact Hessian–vector product ∇²F(θ) v of the full objective (λv included), per replica: (R, P)."""
        raise NotImplementedError(f"model {self.name!r} has no Hessian–vector product")

    def lipschitz(self, x_max: float) -> float | None:
        """A bound on ‖∇ℓ(θ; x, y)‖ over all θ when ‖x‖ ≤ x_max, or None if there is none."""
        return None

    def smoothness(self, x_max: float) -> float | None:
        """A bound β on the Hessian of ℓ when ‖x‖ ≤ x_max (ℓ is β-smooth), or None."""
        return None

    # Shared by all models -------------------------------------------------------------------------
    def objective(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return self.data_loss(theta, X, y) + self.penalty(theta)

    def penalty(self, theta: np.ndarray) -> np.ndarray:
        """(λ/2)‖θ‖² per replica: F = data_loss + penalty."""
        return 0.5 * self.l2 * np.einsum("rp,rp->r", theta, theta)

    def gradient(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return self.data_gradient(theta, X, y) + self.l2 * theta

    def data_loss_and_gradient(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(data_loss (R,), data_gradient (R, P)); a model may share one forward pass between them."""
        return self.data_loss(theta, X, y), self.data_gradient(theta, X, y)

    def full_batch_rows(self, X: np.ndarray) -> Any:
        """X in the form `objective_and_gradient` reads fastest when it is called many times on the same rows
        (full-batch L-BFGS), built once: X itself unless a model knows better."""
        return X

    def objective_and_gradient(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(F(θ) (R,), ∇F(θ) (R, P)) in one call (what L-BFGS asks for)."""
        loss, grad = self.data_loss_and_gradient(theta, X, y)
        return loss + self.penalty(theta), grad + self.l2 * theta

    def accuracy(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return accuracy_of(self.decision(theta, X), y)

    def data_loss_and_accuracy(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(data_loss (R,), accuracy (R,)) from one forward pass, for a data_loss that is `logistic_loss` of the
        decision (override otherwise)."""
        decision = self.decision(theta, X)
        return logistic_loss(decision, y), accuracy_of(decision, y)

    def hessian(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """∇²F(θ) (R, P, P) from P exact Hessian–vector products `hvp(θ, X, y, e_j)`, k columns per call (the replica
        axis carries replicas × columns), symmetrised (H e_j is column j; rounding makes H ≠ Hᵀ by ~1e-16)."""
        R, P = theta.shape
        k = max(1, min(P, BLOCK_ELEMENTS // max(1, R * P)))
        H = np.empty((R, P, P))
        for j0 in range(0, P, k):
            kk = min(k, P - j0)
            V = np.zeros((R, kk, P))
            V[:, np.arange(kk), j0 + np.arange(kk)] = 1.0
            H[:, j0:j0 + kk, :] = self.hvp(np.repeat(theta, kk, axis=0), X, y, V.reshape(R * kk, P)).reshape(R, kk, P)
        return 0.5 * (H + np.swapaxes(H, 1, 2))

    def per_example_clipped_gradients(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray, x_norm: np.ndarray,
                                      clip: float) -> np.ndarray:
        """clip_C(∇ℓ(θ_r; x_i, y_i)) for every replica and row of X (m, d): (R, m, P), by `clipped_grad_sum` with one
        example per (replica, example) pair (so the clip is exactly the one of the steps)."""
        R, P = theta.shape
        m, d = X.shape
        batch = Batch(X=np.broadcast_to(X, (R, m, d)).reshape(R * m, 1, d),
                      y=np.broadcast_to(y, (R, m)).reshape(R * m, 1), weight=np.ones((R * m, 1)),
                      x_norm=np.broadcast_to(x_norm, (R, m)).reshape(R * m, 1))
        return self.clipped_grad_sum(np.repeat(theta, m, axis=0), batch, clip).reshape(R, m, P)

    def inverse_hvp(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray, v: np.ndarray, damping: float = 0.0,
                    tol: float = 1e-10, max_iter: int | None = None,
                    return_info: bool = False) -> np.ndarray | tuple[np.ndarray, dict]:
        """x ≈ (∇²F(θ) + ζI)⁻¹ v for every replica by conjugate gradients on Hessian–vector products (Koh & Liang 2017).
        Each replica runs its own CG to ‖v − (H + ζI)x‖ ≤ tol·‖v‖ (max_iter default P), sharing one `hvp` call per
        iteration; one that meets pᵀ(H + ζI)p ≤ 0 (an indefinite Hessian: raise ζ) stops there. With return_info,
        also {"iterations", "residual" (recomputed), "converged", "negative_curvature"}, each (R,)."""
        v = np.asarray(v, dtype=float)
        R, P = v.shape
        max_iter = P if max_iter is None else int(max_iter)

        def apply(p: np.ndarray) -> np.ndarray:
            return self.hvp(theta, X, y, p) + damping * p

        x = np.zeros_like(v)
        r = v.copy()
        p = r.copy()
        rr = np.einsum("rp,rp->r", r, r)
        target = tol**2 * rr
        active = rr > target
        negative = np.zeros(R, dtype=bool)
        iterations = np.zeros(R, dtype=int)
        for _ in range(max_iter):
            if not active.any():
                break
            Ap = apply(p)
            curvature = np.einsum("rp,rp->r", p, Ap)
            bad = active & ~(curvature > 0)
            negative |= bad
            active &= ~bad
            alpha = np.where(active, rr / np.where(active, curvature, 1.0), 0.0)
            x += alpha[:, None] * p
            r -= alpha[:, None] * Ap
            rr_new = np.einsum("rp,rp->r", r, r)
            iterations += active
            beta = np.where(active, rr_new / np.where(rr > 0, rr, 1.0), 0.0)
            p = np.where(active[:, None], r + beta[:, None] * p, p)
            rr = np.where(active, rr_new, rr)
            active &= rr > target
        if not return_info:
            return x
        norm_v = np.sqrt(np.einsum("rp,rp->r", v, v))
        residual = np.linalg.norm(v - apply(x), axis=1) / np.where(norm_v > 0, norm_v, 1.0)
        info = {"iterations": iterations, "residual": residual, "converged": (rr <= target) & ~negative,
                "negative_curvature": negative}
        return x, info


def logistic_loss(decision: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mean log(1 + exp(−y·f(x))) over the examples (last axis), per replica."""
    return np.mean(np.logaddexp(0.0, -y * decision), axis=-1)


def accuracy_of(decision: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fraction of examples with sign(f(x)) = y (f(x) = 0 counts as +1), per replica."""
    return np.mean(np.where(decision >= 0, 1.0, -1.0) == y, axis=-1)
