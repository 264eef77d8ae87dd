"""Mini-batch samplers yielding one padded `Batch` per step for all replicas."""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Literal

import numpy as np

from dpsgd_cli.algorithms.streams import BLOCK_STEPS, ReplicaStreams
from dpsgd_cli.compiled import optional_compiled
from dpsgd_cli.models import Batch
from dpsgd_cli.models.rows import RowNonzeros, cached_nonzeros, cached_row_norms, gather


def poisson_indices(g: np.random.Generator, n: int, q: float, steps: int, width: int) -> np.ndarray:
    """Poisson subsampling (each example kept with probability q) for `steps` steps: (steps, M) indices, −1 = none.

    The gaps between kept indices of a Bernoulli(q) sequence are Geometric(q), so drawing `width` gaps and
    keeping the indices below n samples exactly; a row that has not passed n yet is extended with more gaps.
    """
    idx = np.cumsum(_geometric(g, q, (steps, width)), axis=1)
    idx -= 1
    short = np.flatnonzero(idx[:, -1] < n)
    if short.size:  # rare: more than `width` examples drawn; continue those gap sequences exactly
        rows = [list(idx[k]) for k in range(steps)]
        for k in short:
            while rows[k][-1] < n:
                rows[k].append(rows[k][-1] + int(g.geometric(q)))
        width = max(len(r) for r in rows)
        idx = np.array([r + [n] * (width - len(r)) for r in rows])
    idx[idx >= n] = -1
    return idx


def _geometric(g: np.random.Generator, q: float, shape: tuple[int, int]) -> np.ndarray:
    """`g.geometric(q, shape)`, the same numbers and generator state, faster where NumPy draws them by
    inversion (q < 1/3): ⌈−E / log1p(−q)⌉ with E standard exponential (numpy/random/src/distributions/
    distributions.c, random_geometric_inversion), vectorised; checked against `g.geometric` once per process
    (`_inversion_matches`), else `g.geometric` itself."""
    if not (_INVERSION_MIN_Q <= q < 1 / 3 and _inversion_matches()):
        return g.geometric(q, size=shape)
    draws = g.standard_exponential(size=shape)
    draws /= -math.log1p(-q)  # = −E / log1p(−q): negation is exact
    return np.ceil(draws, out=draws).astype(np.int64)


_INVERSION_MIN_Q = 1e-12  # below, a draw may pass 2⁶³ (NumPy clamps it to INT64_MAX; a cast would not)


@functools.lru_cache(maxsize=1)
def _inversion_matches() -> bool:
    """Whether this NumPy's Generator.geometric is the inversion `_geometric` computes, draw for draw."""
    for q in (0.3, 0.0085, 1e-6):
        want = np.random.default_rng(20240917).geometric(q, size=4096)
        g = np.random.default_rng(20240917)
        draws = g.standard_exponential(size=4096)
        if not np.array_equal(np.ceil(draws / -math.log1p(-q)).astype(np.int64), want):
            return False
    return True


def poisson_batches(X: np.ndarray, y: np.ndarray, q: float, streams: ReplicaStreams,
                    width: int | None = None) -> IndexedBatches:
    """Poisson-sampled batches (Abadi et al. 2016) of expected size qn, forever (the chain stops after T steps)."""
    n = X.shape[0]
    if q >= 1:  # every example at every step: the full batch (the gap sampler would walk every row in Python)
        return full_batches(X, y, streams.replicas)
    if width is None:  # a width the Binomial(n, q) batch size exceeds with probability < 1e-20
        mean = n * q
        width = min(n, math.ceil(mean + 10 * math.sqrt(mean * (1 - q)) + 10))
    return IndexedBatches(X, y, _poisson_blocks(n, q, streams, width), streams.replicas, trim=True)


def _poisson_blocks(n: int, q: float, streams: ReplicaStreams, width: int) -> Iterator[np.ndarray]:
    """(BLOCK_STEPS, R, M) indices, −1 = none (kept indices first in each row)."""
    compiled = optional_compiled("algorithms._normals_numba")  # None: NumPy draws the same numbers
    states = _compiled_states(compiled, streams, q)
    if compiled is None or states is None:
        gens = streams.generators("sampling")
        while True:
            yield _stacked([poisson_indices(g, n, q, BLOCK_STEPS, width)[:, None] for g in gens], axis=1)
    scale = -math.log1p(-q)
    while True:
        block = np.empty((BLOCK_STEPS, streams.replicas, width), dtype=np.int64)
        short = compiled.poisson_block_pcg64(states, n, scale, block)
        yield _continued(compiled, states, n, scale, block, short) if short.any() else block


def _compiled_states(compiled: ModuleType | None, streams: ReplicaStreams, q: float) -> np.ndarray | None:
    """The sampling generators' PCG64 states (R, 4) for `poisson_block_pcg64`, which draws `poisson_indices`'
    numbers from them (its gaps by inversion, as `_geometric`'s fast path), or None: NumPy draws them."""
    if compiled is None or not (_INVERSION_MIN_Q <= q < 1 / 3 and _inversion_matches()
                                and compiled.exponentials_match()):
        return None
    return streams.pcg64_states("sampling")


def _continued(compiled: ModuleType, states: np.ndarray, n: int, scale: float, block: np.ndarray,
               short: np.ndarray) -> np.ndarray:
    """The block with its short rows (`short[k, r]`: still below n after M gaps) continued, as `poisson_indices`
    does: replica by replica, step by step, more gaps from the replica's state until a row passes n; each replica
    as wide as its longest row (the passing index counted), the block as its widest replica."""
    K, R, M = block.shape
    rows: dict[tuple[int, int], list[int]] = {}
    widths = [M] * R
    gap = np.empty(1)
    for r in np.flatnonzero(short.any(axis=0)):
        for k in np.flatnonzero(short[:, r]):
            row = [int(block[k, r, -1])]
            while row[-1] < n:
                compiled.fill_exponentials_pcg64(states[r], gap)
                row.append(row[-1] + int(np.ceil(gap[0] / scale)))
            rows[int(k), int(r)] = row[1:-1]  # the indices past the block's, below n
            widths[r] = max(widths[r], M + len(row) - 1)
    out = np.full((K, R, max(widths)), -1, dtype=np.int64)
    out[:, :, :M] = block
    for (step, replica), row in rows.items():
        out[step, replica, M:M + len(row)] = row
    return out


def _stacked(parts: list[np.ndarray], axis: int) -> np.ndarray:
    """Index arrays (..., M_p) concatenated along `axis` (0 or 1), each padded with −1 to the widest M (one
    allocation)."""
    width = max(p.shape[-1] for p in parts)
    shape = list(parts[0].shape)
    shape[axis], shape[-1] = sum(p.shape[axis] for p in parts), width
    out = np.full(shape, -1, dtype=parts[0].dtype)
    at = 0
    for p in parts:
        where = (slice(at, at + p.shape[0]),) if axis == 0 else (slice(None), slice(at, at + p.shape[1]))
        out[where + (Ellipsis, slice(0, p.shape[-1]))] = p
        at += p.shape[axis]
    return out


class IndexedBatches:
    """The batches of a sampler, one `Batch` per step for all replicas, from blocks of example indices.

    blocks: (K, R, M) index blocks (−1 marks padding, kept indices first), or None for the full batch (every
    row at every step). Besides iteration (the NumPy chain), `take(m)` hands the next m steps' indices
    (m, R, M) to a compiled step (backends.py) that reads the rows itself: the same indices in the same
    order, whichever way the steps are consumed. plain: the blocks have no padding, and a step's batch is a plain
    `Batch` of its rows (no padding weights, per-replica split or row nonzeros to look up).
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, blocks: Iterator[np.ndarray] | None, replicas: int,
                 trim: bool = False, plain: bool = False):
        self.X, self.y, self.replicas = X, y, replicas
        self.full, self._plain = blocks is None, plain
        self._blocks: Iterator[np.ndarray] = iter(()) if blocks is None else blocks
        self._block: np.ndarray = np.empty((0, replicas, 0), dtype=np.int64)  # the current block, read from _pos
        self._pos, self._trim = 0, trim
        self._x_norm: np.ndarray | None = None
        self._full: Batch | None = None
        self._nonzeros: RowNonzeros | None | Literal[False] = False  # False: not looked up yet
        self.taps: list[deque[np.ndarray]] = []  # queues that receive a copy of every `take` (see `replay`)

    @property
    def padded(self) -> bool:
        """Whether a step's row of indices may hold padding (−1): a varying batch size (Poisson)."""
        return self._trim

    @property
    def x_norm(self) -> np.ndarray:
        """‖x_i‖ of every row, computed at the first batch (the compiled step never needs all of them)."""
        if self._x_norm is None:
            self._x_norm = cached_row_norms(self.X)
        return self._x_norm

    def nonzeros(self) -> RowNonzeros | None:
        """`RowNonzeros.of(X)`, computed at the first call (None: X too dense for row-sparse products to pay)."""
        if self._nonzeros is False:
            self._nonzeros = cached_nonzeros(self.X)
        return self._nonzeros

    def __iter__(self) -> IndexedBatches:
        return self

    def __next__(self) -> Batch:
        if self.full:
            if self._full is None:  # without copying X: the replica axis is a zero-stride broadcast view
                n, R = self.X.shape[0], self.replicas
                self._full = Batch(X=np.broadcast_to(self.X, (R, *self.X.shape)), y=np.broadcast_to(self.y, (R, n)),
                                   weight=np.ones((R, n), dtype=self.X.dtype),
                                   x_norm=np.broadcast_to(self.x_norm, (R, n)))
            return self._full
        if self._pos == len(self._block):
            self._block, self._pos = next(self._blocks), 0
        idx = self._block[self._pos]  # (R, M)
        self._pos += 1
        if self._plain:
            return Batch(X=self.X[idx], y=self.y[idx], weight=np.ones(idx.shape, dtype=self.X.dtype),
                         x_norm=self.x_norm[idx])
        if self._trim:  # kept indices come first in each row, so trim the common padding
            idx = idx[:, : max(1, int((idx >= 0).sum(axis=1).max()))]
        return gather(self.X, self.y, self.x_norm, idx, self.nonzeros)

    def take(self, m: int) -> np.ndarray:
        """The next m steps' indices (m, R, M), −1 padded (not for the full batch, which has none)."""
        if self.full:
            raise ValueError("the full batch has no indices to take")
        parts, have = [], 0
        while have < m:
            if self._pos == len(self._block):
                self._block, self._pos = next(self._blocks), 0
            part = self._block[self._pos:self._pos + m - have]
            self._pos += len(part)
            parts.append(part)
            have += len(part)
        out = _stacked(parts, axis=0) if len(parts) > 1 else np.ascontiguousarray(parts[0])
        for tap in self.taps:
            tap.append(out)
        return out

    def replay(self, advance: Callable[[], bool]) -> IndexedBatches:
        """Batches equal to these for a second consumer while a first one `take`s: the steps it took are
        replayed; when none is left, `advance()` makes it take more (False once it is done; then the steps
        come from these batches directly). The full batch is shared as is."""
        if self.full:
            return self
        queue: deque[np.ndarray] = deque()
        self.taps.append(queue)

        def blocks() -> Iterator[np.ndarray]:
            while True:
                if queue:
                    yield queue.popleft()
                elif not advance():
                    if queue in self.taps:
                        self.taps.remove(queue)
                    if not queue:
                        yield self.take(BLOCK_STEPS)
        return IndexedBatches(self.X, self.y, blocks(), self.replicas, trim=self._trim)


def uniform_examples(X: np.ndarray, y: np.ndarray, streams: ReplicaStreams, batch_size: int = 1) -> IndexedBatches:
    """`batch_size` examples drawn uniformly with replacement per step (Bassily et al. 2014 and Kang et al. use
    one), BLOCK_STEPS steps per `integers` call (its buffering depends on the call's size)."""
    n = X.shape[0]
    blocks = streams.blocks("sampling", lambda g, k: g.integers(0, n, size=(k, batch_size)))  # (K, R, b)
    return IndexedBatches(X, y, blocks, streams.replicas)


def fixed_batches(X: np.ndarray, y: np.ndarray, idx: np.ndarray, padded: bool = False) -> IndexedBatches:
    """The T batches of the example indices idx (T, R, M): for a run that reads its steps' indices before it takes
    them (pidp_sgd's noise decisions). padded: −1 marks padding (kept indices first), each step cut to its widest
    replica and gathered as `poisson_batches`' are; else every index is a row, and the batches are plain."""
    return IndexedBatches(X, y, iter([idx]), idx.shape[1], trim=padded, plain=not padded)


def shuffled_batches(X: np.ndarray, y: np.ndarray, batch_size: int, streams: ReplicaStreams,
                     reshuffle: bool = True) -> IndexedBatches:
    """Disjoint batches of a random permutation, ⌊n/b⌋ per pass; the last n − b⌊n/b⌋ examples of it are unused.

    reshuffle: a fresh permutation every pass (Song et al. 2013); False: one permutation drawn once and walked
    in the same order every pass (Wu et al. 2017's PSGD, Bismarck's shuffle-once).
    """
    n = X.shape[0]
    per_pass = n // batch_size

    def passes() -> Iterator[np.ndarray]:  # (⌊n/b⌋, R, b) per pass
        gens = streams.generators("sampling")
        perms = None
        while True:
            if reshuffle or perms is None:
                perms = np.stack([g.permutation(n)[: per_pass * batch_size] for g in gens])  # (R, n')
                perms = perms.reshape(len(gens), per_pass, batch_size).transpose(1, 0, 2)
            yield perms

    return IndexedBatches(X, y, passes(), streams.replicas)


def full_batches(X: np.ndarray, y: np.ndarray, replicas: int) -> IndexedBatches:
    """The whole training set as every step's batch for every replica (full-batch GD), without copying X."""
    return IndexedBatches(X, y, None, replicas)
