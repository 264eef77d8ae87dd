"""Random streams per replica and purpose, drawn in blocks.

Replica r's numbers come only from seed r (and the stream's purpose), so a run is a pure function of its
spec and seed, whatever other seeds train beside it; and `sgd` and `dp_sgd` with the same seed and batch
size see the same batches. Drawing K steps at a time keeps the Python loop over replicas out of the step.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

STREAMS = {"init": 0, "sampling": 1, "noise": 2, "output": 3}
BLOCK_STEPS = 64


class ReplicaStreams:
    def __init__(self, seeds: Sequence[int]):
        self.seeds = tuple(int(s) for s in seeds)

    @property
    def replicas(self) -> int:
        return len(self.seeds)

    def generators(self, purpose: str) -> list[np.random.Generator]:
        return [np.random.default_rng([seed, STREAMS[purpose]]) for seed in self.seeds]

    def per_step(self, purpose: str, draw: Callable[[np.random.Generator, int], np.ndarray],
                 block: int = BLOCK_STEPS) -> Iterator[np.ndarray]:
        """Yield (R, ...) arrays forever; `draw(g, K)` returns K steps (K, ...) from one replica's generator."""
        gens = self.generators(purpose)
        while True:
            stacked = np.stack([draw(g, block) for g in gens], axis=1)  # (K, R, ...)
            yield from stacked

    def normal(self, purpose: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        """Standard normal draws of shape (R, *shape), one array per step."""
        return self.per_step(purpose, lambda g, k: g.standard_normal((k, *shape)))
