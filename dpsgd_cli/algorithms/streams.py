"""Random streams per replica and purpose, drawn in blocks.

Replica r's numbers come only from seed r (and the stream's purpose), so a run is a pure function of its
spec and seed, whatever other seeds train beside it; and `sgd` and `dp_sgd` with the same seed and batch
size see the same batches. Drawing K steps at a time keeps the Python loop over replicas out of the step.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dpsgd_cli import compiled

STREAMS = {"init": 0, "sampling": 1, "noise": 2, "output": 3}
BLOCK_STEPS = 64
FILL_STEPS = 8  # steps of normals per block when numba fills it (`_filled`: the numbers do not depend on it)


class ReplicaStreams:
    def __init__(self, seeds: Sequence[int]):
        self.seeds = tuple(int(s) for s in seeds)

    @property
    def replicas(self) -> int:
        return len(self.seeds)

    def generators(self, purpose: str) -> list[np.random.Generator]:
        return [np.random.default_rng([seed, STREAMS[purpose]]) for seed in self.seeds]

    def blocks(self, purpose: str, draw: Callable[[np.random.Generator, int], np.ndarray],
               block: int = BLOCK_STEPS) -> Iterator[np.ndarray]:
        """Yield (K, R, ...) blocks of K = `block` steps forever; `draw(g, K)` returns K steps (K, ...) from one
        replica's generator (a fixed K per call: a generator's buffering can depend on the call's size)."""
        gens = self.generators(purpose)
        while True:
            yield np.stack([draw(g, block) for g in gens], axis=1)

    def per_step(self, purpose: str, draw: Callable[[np.random.Generator, int], np.ndarray],
                 block: int = BLOCK_STEPS) -> Iterator[np.ndarray]:
        """Yield (R, ...) arrays forever, one a step: the steps of `blocks`."""
        for stacked in self.blocks(purpose, draw, block):
            yield from stacked

    def normal(self, purpose: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        """Standard normal draws of shape (R, *shape), one array per step (float64). With numba installed the
        blocks are filled by `_normals_numba` (`fill_normals_pcg64` for PCG64): the same numbers as `per_step`'s
        (tested bit for bit)."""
        compiled = _numba_normals()
        if compiled is None:
            return self.per_step(purpose, lambda g, k: g.standard_normal((k, *shape)))
        return self._filled(compiled, purpose, tuple(shape))

    def _filled(self, compiled, purpose: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        gens = self.generators(purpose)
        # PCG64 (default_rng's) inlined in the ziggurat, from each generator's state read once here: the stream
        # owns its generators and never draws from them again; other bit generators through numba's Generator
        states = [compiled.pcg64_state(g) for g in gens]
        size = math.prod(shape)
        block, unreferenced = None, 0
        while True:
            # refill the last block when no step of it is referenced any more (its views hold it: a caller may
            # keep a draw), else a fresh one (a fresh block costs its page faults). The
            # count of a block nobody else holds is read here, just after allocating it, not assumed: it depends on
            # the interpreter (CPython 3.14 borrows references that 3.11 counts)
            if block is None or sys.getrefcount(block) > unreferenced:
                block = np.empty((FILL_STEPS, len(gens), size))
                unreferenced = sys.getrefcount(block)
            for r, (g, state) in enumerate(zip(gens, states)):
                if state is None:
                    compiled.fill_normals(g, block, r)
                else:
                    compiled.fill_normals_pcg64(state, block, r)
            yield from block.reshape(FILL_STEPS, len(gens), *shape)


def _numba_normals():
    """The module `_normals_numba`, or None without numba."""
    return compiled.optional_compiled("algorithms._normals_numba")  # broken numba: NumPy draws the same numbers


class SharedStreams(ReplicaStreams):
    """Streams for several algorithms training the same seeds together (`run_together`): every `normal` stream
    of a purpose and shape is drawn once and handed to each caller (the same numbers each would draw alone).

    Callers must consume in lockstep (one draw per step each, as chains do); call `close()` once every caller
    has its iterator, so that a draw is freed when the last caller has read it.
    """

    def __init__(self, seeds: Sequence[int]):
        super().__init__(seeds)
        self._spares: dict[tuple, Iterator[np.ndarray]] = {}

    def normal(self, purpose: str, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
        key = (purpose, tuple(shape))
        if key not in self._spares:
            self._spares[key] = itertools.tee(super().normal(purpose, shape), 1)[0]
        return copy.copy(self._spares[key])  # a tee at the start of the shared stream

    def close(self) -> None:
        self._spares.clear()
