"""The rows of a dataset as the models read them: row norms, row-sparse layouts, batches cut by index, and the
per-array caches that let every fit on a read-only dataset share them."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from dpsgd_cli.compiled import optional_compiled
from dpsgd_cli.models.base import Batch


def row_norms(X: np.ndarray) -> np.ndarray:
    """‖x_i‖ for every row (einsum: a third of the time of np.linalg.norm on adult)."""
    return np.sqrt(np.einsum("ij,ij->i", X, X))


def cached_row_norms(X: np.ndarray) -> np.ndarray:
    """`row_norms(X)`, computed once per read-only X (`per_array`): every fit on a dataset reuses them."""
    return per_array(X, "row_norms", row_norms)


def cached_nonzeros(X: np.ndarray) -> RowNonzeros | None:
    """`RowNonzeros.of(X)` (None: too dense), computed once per read-only X (`per_array`)."""
    return per_array(X, "RowNonzeros", RowNonzeros.of)


def cached_astype(X: np.ndarray, dtype) -> np.ndarray:
    """X in `dtype` (X itself when it has it), read-only, made once per read-only X (`per_array`): a float32 task
    reuses the copy and its row norms and nonzeros (~5 ms on adult each)."""
    dtype = np.dtype(dtype)
    if X.dtype == dtype:
        return X

    def build(X: np.ndarray) -> np.ndarray:
        out = X.astype(dtype)
        out.flags.writeable = False
        return out

    return per_array(X, f"astype {dtype}", build)


T = TypeVar("T")
_PER_ARRAY: dict[tuple[int, str], tuple[weakref.ref, object]] = {}


def per_array(X: np.ndarray, what: str, build: Callable[[np.ndarray], T]) -> T:
    """`build(X)`, kept while X lives when X is read-only (the datasets the engine loads); built each time for a
    writeable X."""
    if X.flags.writeable:
        return build(X)
    key = (id(X), what)
    hit = _PER_ARRAY.get(key)
    if hit is not None and hit[0]() is X:
        return hit[1]  # type: ignore[return-value]  # stored by `build` under this key

    def forget(ref: weakref.ref, table: dict = _PER_ARRAY) -> None:  # bound now: module globals may be gone at exit
        if table.get(key, (None,))[0] is ref:
            del table[key]

    value = build(X)
    _PER_ARRAY[key] = (weakref.ref(X, forget), value)
    return value


def gather(X: np.ndarray, y: np.ndarray, x_norm: np.ndarray, idx: np.ndarray,
           nonzeros: Callable[[], RowNonzeros | None] | None = None) -> IndexedBatch:
    """Batch of rows `idx` (R, M), −1 marking padding after each replica's rows (it reads row 0, with weight 0)."""
    valid = idx >= 0
    safe = np.where(valid, idx, 0)
    return IndexedBatch(X, safe, y=np.take(y, safe), weight=valid.astype(X.dtype),
                        x_norm=np.take(x_norm, safe) * valid, nonzeros=nonzeros)


class IndexedBatch(Batch):
    """A `Batch` of the rows `rows` (R, M) of `data` (padding: row 0, weight 0), X gathered at its first use (a
    compiled step that reads the rows where they are never copies them)."""

    data: np.ndarray
    rows: np.ndarray
    nonzeros: Callable[[], RowNonzeros | None]

    def __init__(self, data: np.ndarray, rows: np.ndarray, y: np.ndarray, weight: np.ndarray, x_norm: np.ndarray,
                 nonzeros: Callable[[], RowNonzeros | None] | None = None):
        for name, value in dict(data=data, rows=rows, y=y, weight=weight, x_norm=x_norm,
                                nonzeros=nonzeros or (lambda: None)).items():
            object.__setattr__(self, name, value)  # Batch is frozen

    @functools.cached_property
    def X(self) -> np.ndarray:
        return np.take(self.data, self.rows, axis=0)

    @functools.cached_property
    def _plain(self) -> IndexedBatch:
        return IndexedBatch(self.data, self.rows, self.y, self.weight, self.x_norm)

    def plain(self) -> IndexedBatch:
        """The same batch without its rows' nonzeros, for a step that must not take the compiled rows path."""
        return self._plain

    @functools.cached_property
    def per_replica(self) -> list[Batch] | None:
        """Each replica's batch alone (views of its rows) where the replicas keep different numbers of rows, else
        None: the batch it gets when its seed runs alone (`Model._clipped_grad_sum_per_replica`)."""
        if self.weight.shape[0] < 2:
            return None
        kept = np.count_nonzero(self.weight, axis=1)
        if (kept == kept[0]).all():
            return None
        X = self.X
        return [Batch(X=X[r:r + 1, :m], y=self.y[r:r + 1, :m], weight=self.weight[r:r + 1, :m],
                      x_norm=self.x_norm[r:r + 1, :m]) for r, m in enumerate(np.maximum(kept, 1).tolist())]


@dataclass(frozen=True)
class RowNonzeros:
    """The nonzeros of every row of X, in column order, padded with zeros to a multiple of `GROUP` per row:
    row i's are cols[i, :nnz[i]], vals[i, :nnz[i]] (nnz[i] a multiple of GROUP). Stored as one row of unsigned
    integers of X's item size per example, [cols (K) | the bits of vals (K) | nnz], so that a batch's are one
    gather (`take`): one cache miss fewer per random row than three arrays."""

    packed: np.ndarray  # (n, 2K + 1), uint32 for float32 data, uint64 for float64
    dtype: np.dtype  # X's

    GROUP = 8  # the MLP's kernel sums a row's nonzeros 8 at a time (models/_mlp_numba.py)
    # Above this mean share of (padded) nonzeros per row, BLAS on the dense rows is faster (the MLP on adult,
    # 16 of 104: the kernels ~2× faster; bank (24 of 63) and kddcup99 (40 of 118) 0.8–1.3×)
    MAX_DENSITY = 0.25

    @property
    def K(self) -> int:
        return (self.packed.shape[-1] - 1) // 2

    def split(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cols, vals, nnz) views of rows of `packed` (..., 2K + 1)."""
        K = self.K
        return packed[..., :K], packed[..., K:2 * K].view(self.dtype), packed[..., 2 * K]

    @property
    def cols(self) -> np.ndarray:
        return self.split(self.packed)[0]

    @property
    def vals(self) -> np.ndarray:
        return self.split(self.packed)[1]

    @property
    def nnz(self) -> np.ndarray:
        return self.split(self.packed)[2]

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cols, vals, nnz) of the examples `rows` (any shape, valid indices): one gather."""
        return self.split(np.take(self.packed, rows, axis=0))

    @classmethod
    def of(cls, X: np.ndarray, max_density: float | None = None) -> RowNonzeros | None:
        """X's nonzeros, or None when their (padded) mean count per row exceeds max_density · d."""
        n, d = X.shape
        X = np.ascontiguousarray(X)
        compiled = optional_compiled("models._rows_numba")  # None: NumPy builds the same arrays
        counts = compiled.count_nonzeros(X) if compiled else np.count_nonzero(X, axis=1)
        padded = -(-counts // cls.GROUP) * cls.GROUP
        if n == 0 or padded.mean() > (cls.MAX_DENSITY if max_density is None else max_density) * d:
            return None
        K = max(int(padded.max()), cls.GROUP)
        out = cls(np.zeros((n, 2 * K + 1), dtype=f"u{X.dtype.itemsize}"), X.dtype)
        cols, vals, nnz = out.split(out.packed)
        nnz[:] = padded
        if compiled:
            compiled.fill_nonzeros(X, cols, vals)
        else:
            r, c = np.nonzero(X)  # row-major: each row's nonzeros in column order
            slot = np.arange(r.size) - np.repeat(np.cumsum(counts) - counts, counts)  # place in its row
            cols[r, slot], vals[r, slot] = c, X[r, c]
        return out
