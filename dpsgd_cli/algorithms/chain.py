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


def inverse_sqrt(c: float) -> Schedule:
    """η_t = c/√t (Song et al. 2013 use c = 1 and 10; Bassily et al. 2014: R/(l√t))."""
    return lambda t: c / t**0.5


def inverse_time(c: float) -> Schedule:
    """η_t = c/t (for an s-strongly convex objective c = 1/s: Bassily et al. 2014; Song et al. 2013 1/(λt))."""
    return lambda t: c / t


def project_to_ball(radius: float) -> Callable[[np.ndarray], np.ndarray]:
    """Euclidean projection of each replica's θ onto {‖θ‖ ≤ radius}."""

    def project(theta: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(theta, axis=1, keepdims=True)
        return theta * np.minimum(1.0, radius / np.maximum(norm, 1e-300))

    return project


@dataclass
class Checkpoints:
    """Records the training objective every `every` examples processed (for the per-iteration figures)."""

    every: int
    X: np.ndarray
    y: np.ndarray
    rows: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)

    def maybe_record(self, model: Model, theta: np.ndarray, before: int, after: int) -> None:
        if after // self.every > before // self.every:
            with np.errstate(all="ignore"):
                self.rows.append((after, model.objective(theta, self.X, self.y),
                                  model.accuracy(theta, self.X, self.y)))


@dataclass
class GradientChain:
    batches: Iterator[Batch]
    clip: Optional[float]
    transforms: Sequence[Transform] = field(default_factory=list)
    schedule: Schedule = constant(0.1)
    project: Optional[Callable[[np.ndarray], np.ndarray]] = None
    checkpoints: Optional[Checkpoints] = None
    examples_per_step: float = 1.0  # (expected) batch size, to count examples processed for checkpoints

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
                if self.checkpoints is not None:
                    before, after = round((t - 1) * self.examples_per_step), round(t * self.examples_per_step)
                    self.checkpoints.maybe_record(model, theta, before, after)
        return theta
