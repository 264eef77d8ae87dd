"""Iterative training as a chain of small gradient transformations (in the spirit of optax).

One step: sample a batch per replica → sum of (clipped) per-example gradients → transforms (add noise,
scale, add the regulariser's gradient, ...) → θ ← θ − η_t g → optional projection. Private algorithms of
the papers differ only in their sampler, clip and transforms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from dpsgd_cli.models import Batch, Model

Transform = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (gradient (R, P), θ (R, P)) → gradient
Schedule = Callable[[int], float]  # step t = 1, 2, ... → learning rate


def add_noise(std: float, draws: Iterator[np.ndarray]) -> Transform:
    """g + std · z with z from `draws` (one (R, P) standard-normal array per step)."""
    return lambda g, theta: g + std * next(draws)


def scale(factor: float) -> Transform:
    return lambda g, theta: g * factor


def add_l2(l2: float) -> Transform:
    """Add the regulariser's gradient λθ (data-independent: no privacy cost)."""
    return lambda g, theta: g + l2 * theta if l2 else g


def constant(lr: float) -> Schedule:
    return lambda t: lr


@dataclass
class GradientChain:
    batches: Iterator[Batch]
    clip: Optional[float]
    transforms: Sequence[Transform] = field(default_factory=list)
    schedule: Schedule = constant(0.1)
    project: Optional[Callable[[np.ndarray], np.ndarray]] = None

    def run(self, model: Model, theta: np.ndarray, steps: int) -> np.ndarray:
        """Apply `steps` updates to θ (R, P); a replica that diverges ends as NaN without stopping the others."""
        theta = theta.copy()
        with np.errstate(over="ignore", invalid="ignore"):
            for t in range(1, steps + 1):
                g = model.clipped_grad_sum(theta, next(self.batches), self.clip)
                for transform in self.transforms:
                    g = transform(g, theta)
                theta -= self.schedule(t) * g
                if self.project is not None:
                    theta = self.project(theta)
        return theta
