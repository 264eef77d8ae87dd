"""L2-regularised logistic regression: ℓ(θ; x, y) = log(1 + exp(−y θ·x))."""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.special import expit

from dpsgd_cli.models.base import Batch, Model, logistic_loss


class LogisticRegression(Model):
    """Linear model; ∇ℓ = −y σ(−y θ·x) x, so ‖∇ℓ‖ = |residual|·‖x‖ and clipping needs no per-example gradients."""

    name = "logreg"
    convex = True

    def lipschitz(self, x_max: float) -> float:
        return x_max  # |σ(·)| ≤ 1

    def smoothness(self, x_max: float) -> float:
        return x_max**2 / 4  # σ' ≤ 1/4

    @property
    def n_params(self) -> int:
        return self.d

    def init(self, generators: list[np.random.Generator]) -> np.ndarray:
        return np.zeros((len(generators), self.d))

    def decision(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return theta @ X.T

    def data_loss(self, theta, X, y):
        return logistic_loss(self.decision(theta, X), y)

    def data_gradient(self, theta, X, y):
        residual = -y * expit(-y * self.decision(theta, X))  # (R, n): dℓ/d(θ·x)
        return residual @ X / X.shape[0]

    def _residual(self, theta: np.ndarray, batch: Batch) -> np.ndarray:
        margin = batch.y * np.matmul(batch.X, theta[:, :, None])[..., 0]
        return -batch.y * expit(-margin)

    def per_example_grad_norms(self, theta, batch):
        return np.abs(self._residual(theta, batch)) * batch.x_norm

    def clipped_grad_sum(self, theta, batch, clip: Optional[float]):
        residual = self._residual(theta, batch)
        scale = batch.weight * residual
        if clip is not None:
            norm = np.abs(residual) * batch.x_norm
            scale = scale * clip / np.maximum(norm, clip)  # = min(1, C/‖g‖), safe at ‖g‖ = 0
        return np.matmul(scale[:, None, :], batch.X)[:, 0]

    def hvp(self, theta, X, y, v):
        """∇²F(θ) v = (1/n) Σ σ'(m_i) (x_i·v) x_i + λv, m_i = θ·x_i, σ'(m) = σ(m)σ(−m) (y² = 1): (R, P)."""
        margin = self.decision(theta, X)  # (R, n)
        weight = expit(margin) * expit(-margin)
        return (weight * (v @ X.T)) @ X / X.shape[0] + self.l2 * v
