"""What every model offers the algorithms. Parameters are flat, with a leading replica axis: θ has shape (R, P)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Batch:
    """One mini-batch per replica, padded to a common size M.

    X: (R, M, d) features; y: (R, M) labels in {-1, +1}; weight: (R, M), 0 on padding;
    x_norm: (R, M) row norms ‖x‖ (lets a linear model clip without per-example gradients).
    """

    X: np.ndarray
    y: np.ndarray
    weight: np.ndarray
    x_norm: np.ndarray


class Model:
    """Objective F(θ) = (1/n) Σ ℓ(θ; x_i, y_i) + (λ/2)‖θ‖², evaluated for R replicas at once."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions
    convex: ClassVar[bool] = False  # is ℓ(·; x, y) convex in θ (the private ERM proofs need it)?

    def __init__(self, d: int, l2: float):
        self.d = d
        self.l2 = l2

    @property
    def n_params(self) -> int:
        raise NotImplementedError

    def init(self, generators: list[np.random.Generator]) -> np.ndarray:
        """Initial parameters (R, P), one generator per replica (independent of the data)."""
        raise NotImplementedError

    def data_loss(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mean loss (1/n) Σ ℓ for each replica: shape (R,)."""
        raise NotImplementedError

    def data_gradient(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient of the mean loss: (R, P)."""
        raise NotImplementedError

    def clipped_grad_sum(self, theta: np.ndarray, batch: Batch, clip: Optional[float]) -> np.ndarray:
        """Σ_i weight_i · min(1, C/‖∇ℓ_i‖) ∇ℓ_i over the batch, without the regulariser: (R, P)."""
        raise NotImplementedError

    def per_example_grad_norms(self, theta: np.ndarray, batch: Batch) -> np.ndarray:
        """‖∇ℓ(θ; x_i, y_i)‖ for every batch entry: (R, M)."""
        raise NotImplementedError

    def decision(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Scores whose sign is the predicted label: (R, n)."""
        raise NotImplementedError

    def lipschitz(self, x_max: float) -> float | None:
        """A bound on ‖∇ℓ(θ; x, y)‖ over all θ when ‖x‖ ≤ x_max, or None if there is none."""
        return None

    def smoothness(self, x_max: float) -> float | None:
        """A bound β on the Hessian of ℓ when ‖x‖ ≤ x_max (ℓ is β-smooth), or None."""
        return None

    # Shared by all models -------------------------------------------------------------------------
    def objective(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return self.data_loss(theta, X, y) + 0.5 * self.l2 * np.einsum("rp,rp->r", theta, theta)

    def gradient(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return self.data_gradient(theta, X, y) + self.l2 * theta

    def accuracy(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.mean(np.where(self.decision(theta, X) >= 0, 1.0, -1.0) == y, axis=-1)
