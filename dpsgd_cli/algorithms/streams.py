"""Random streams per replica and purpose, drawn in blocks.

Replica r's numbers come only from seed r (and the stream's purpose), so a run is a pure function of its
spec and seed, whatever other seeds train beside it; and `sgd` and `dp_sgd` with the same seed and batch
size see the same batches. Drawing K steps at a time keeps the Python loop over replicas out of the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import numpy as np

from dpsgd_cli.compiled import optional_compiled

STREAMS = {"init": 0, "sampling": 1, "noise": 2, "output": 3, "clip_count": 4}
BLOCK_STEPS = 64
FILL_STEPS = 8  # steps drawn at least, when a stream is read step by step (the numbers do not depend on it)


class ReplicaStreams:
    def __init__(self, seeds: Sequence[int]):
        self.seeds = tuple(int(s) for s in seeds)

    @property
    def replicas(self) -> int:
        return len(self.seeds)

    def generators(self, purpose: str) -> Generators:
        return Generators(self.seeds, STREAMS[purpose])

    def blocks(self, purpose: str, draw: Callable[[np.random.Generator, int], np.ndarray],
               block: int = BLOCK_STEPS) -> Iterator[np.ndarray]:
        """Yield (K, R, ...) blocks of K = `block` steps forever; `draw(g, K)` returns K steps (K, ...) from one
        replica's generator (a fixed K per call: a generator's buffering can depend on the call's size)."""
        gens = self.generators(purpose)
        while True:
            yield np.stack([draw(g, block) for g in gens], axis=1)

    def per_step(self, purpose: str, draw: Callable[[np.random.Generator, int], np.ndarray],
                 block: int = BLOCK_STEPS) -> NoiseStream:
        """The steps of `draw(g, K)` (K steps (K, ...) from one replica's generator), drawn `block` steps at a time
        (a draw whose numbers depend on K: song2013's Z_t): a `NoiseStream` of (R, ...) steps."""
        gens = self.generators(purpose)
        return NoiseStream(_Tape(lambda k: np.stack([draw(g, k) for g in gens], axis=1), block))

    def normal(self, purpose: str, shape: tuple[int, ...]) -> NoiseStream:
        """Each replica's standard normals, (R, *shape) per step (float64): its generator's `standard_normal`
        consumed in step order, so the numbers do not depend on how many steps are drawn at a time. With numba
        installed `_normals_numba` draws them (`fill_normals_pcg64` for PCG64): the same numbers (tested)."""
        return NoiseStream(_Tape(self._normals(purpose, tuple(shape)), None))

    def pcg64_states(self, purpose: str) -> np.ndarray | None:
        """(R, 4) uint64: the PCG64 states of `generators(purpose)` as `_normals_numba`'s draws take them (advanced
        in place by them: the caller owns them), from the seeds without building the generators where
        `seeded_states` can; None without numba, or where its draws would not be NumPy's numbers."""
        compiled = optional_compiled("algorithms._normals_numba")
        if compiled is None or not compiled.pcg64_matches():
            return None
        if all(0 <= seed < 2**32 for seed in self.seeds) and compiled.seeding_matches():
            states = np.empty((self.replicas, 4), dtype=np.uint64)
            compiled.seeded_states(np.array(self.seeds, dtype=np.int64), STREAMS[purpose], states)
            return states
        read = [compiled.pcg64_state(g) for g in self.generators(purpose)]
        return None if any(state is None for state in read) else np.array(read, dtype=np.uint64)

    def _normals(self, purpose: str, shape: tuple[int, ...]) -> Callable[[int], np.ndarray]:
        compiled = optional_compiled("algorithms._normals_numba")  # None: NumPy draws the same numbers
        if compiled is None:
            every = self.generators(purpose)
            return lambda k: np.stack([g.standard_normal((k, *shape)) for g in every], axis=1)
        size = math.prod(shape)
        # PCG64 (default_rng's) inlined in the ziggurat; other bit generators through numba's Generator
        states = self.pcg64_states(purpose)
        gens: Sequence[np.random.Generator] = self.generators(purpose) if states is None else []

        def draw(k: int) -> np.ndarray:
            block = np.empty((k, self.replicas, size))
            for r in range(self.replicas):
                if states is None:
                    compiled.fill_normals(gens[r], block, r)
                else:
                    compiled.fill_normals_pcg64(states[r], block, r)
            return block.reshape(k, self.replicas, *shape)

        return draw


class Generators(Sequence[np.random.Generator]):
    """Each replica's generator `default_rng([seed, purpose])`, built at its first use (tens of µs each; a model
    whose initial parameters are zeros never uses its own)."""

    def __init__(self, seeds: Sequence[int], purpose: int):
        self.seeds, self.purpose = seeds, purpose
        self._built: dict[int, np.random.Generator] = {}

    def __len__(self) -> int:
        return len(self.seeds)

    @overload
    def __getitem__(self, r: int) -> np.random.Generator: ...

    @overload
    def __getitem__(self, r: slice) -> list[np.random.Generator]: ...

    def __getitem__(self, r: int | slice) -> np.random.Generator | list[np.random.Generator]:
        if isinstance(r, slice):
            return [self[k] for k in range(len(self))[r]]
        r = range(len(self))[r]  # negative indices; IndexError past the end (which ends iteration)
        if r not in self._built:
            self._built[r] = np.random.default_rng([self.seeds[r], self.purpose])
        return self._built[r]


class _Tape:
    """The steps of one noise stream as drawn (`draw(k)`: the next k steps (k, R, ...); k = `block` when set, else
    any), kept until every reader has read them."""

    def __init__(self, draw: Callable[[int], np.ndarray], block: int | None):
        self.draw, self.block = draw, block
        self.chunks: list[np.ndarray] = []
        self.start = self.end = 0  # the steps the chunks hold: [start, end)
        self.readers: list[NoiseStream] = []

    def read(self, position: int, m: int) -> np.ndarray:
        while self.end < position + m:
            chunk = self.draw(self.block or max(position + m - self.end, FILL_STEPS))
            self.chunks.append(chunk)
            self.end += len(chunk)
        parts, at = [], self.start
        for chunk in self.chunks:
            lo, hi = max(position, at), min(position + m, at + len(chunk))
            if lo < hi:
                parts.append(chunk[lo - at:hi - at])
            at += len(chunk)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def forget(self) -> None:
        """Drop the chunks every reader has passed."""
        low = min(reader.position for reader in self.readers)
        while self.chunks and self.start + len(self.chunks[0]) <= low:
            self.start += len(self.chunks.pop(0))


class NoiseStream:
    """A chain's noise: one (R, ...) float64 array of the replicas' draws per step, in step order. Iteration hands
    one step, `take(m)` the next m (m, R, ...): both read the same sequence, so every backend, whatever its block
    size, gets the same numbers. Readers of one stream (`SharedStreams`: cells with the same seeds) read the same
    steps, drawn once."""

    def __init__(self, tape: _Tape):
        self.tape, self.position = tape, 0
        tape.readers.append(self)

    def __iter__(self) -> NoiseStream:
        return self

    def __next__(self) -> np.ndarray:
        step: np.ndarray = self.take(1)[0]
        return step

    def take(self, m: int) -> np.ndarray:
        out = self.tape.read(self.position, m)
        self.skip(m)
        return out

    def skip(self, m: int) -> None:
        """Pass m steps (another reader of the tape at the same position took them)."""
        self.position += m
        self.tape.forget()

    def derived(self, transform: Callable[[np.ndarray], np.ndarray]) -> NoiseStream:
        """A stream of its own whose steps are `transform` (k, R, ...) → (k, R, ...) of this one's, block by block
        in step order (the transform may keep state from block to block: the blocks are consecutive)."""
        return NoiseStream(_Tape(lambda k: transform(self.take(k)), None))


class SharedStreams(ReplicaStreams):
    """Streams for several algorithms training the same seeds together (`run_together`): every `normal` stream
    of a purpose and shape is drawn once and handed to each caller (the same numbers each would draw alone).

    Call `close()` once every caller has its stream: a step is kept until the last reader has read it.
    """

    def __init__(self, seeds: Sequence[int]):
        super().__init__(seeds)
        self._spares: dict[tuple[str, tuple[int, ...]], _Tape] = {}

    def normal(self, purpose: str, shape: tuple[int, ...]) -> NoiseStream:
        key = (purpose, tuple(shape))
        if key not in self._spares:
            self._spares[key] = _Tape(self._normals(purpose, tuple(shape)), None)
        return NoiseStream(self._spares[key])  # a reader at the start of the shared stream

    def close(self) -> None:
        self._spares.clear()
