"""Preprocessing steps shared by all datasets (their order: docs/datasets.md#dataset-options). Every random step
draws from its own seeded stream (`rng(seed, STREAM_*)`): changing `subsample` does not change the projection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dpsgd_cli.errors import DataError

STREAM_SUBSAMPLE = 1
STREAM_SPLIT = 2
STREAM_PROJECTION = 3
STREAM_SYNTHETIC = 4


def rng(seed: int, stream: int) -> np.random.Generator:
    """The generator of one random step (`stream`) for a given spec seed."""
    return np.random.default_rng([seed, stream])


@dataclass(frozen=True)
class Table:
    """Records before encoding: numeric block, categorical codes (indexing `vocab[j]`) and labels in {-1, +1}."""

    numeric: np.ndarray  # (n, p) float64
    codes: np.ndarray  # (n, c) int32
    vocab: tuple[tuple[str, ...], ...]
    y: np.ndarray  # (n,) float64 in {-1, +1}

    def __len__(self) -> int:
        return self.y.shape[0]

    def take(self, idx: np.ndarray) -> Table:
        return Table(self.numeric[idx], self.codes[idx], self.vocab, self.y[idx])


def _observed(column: pd.Series) -> set[str]:
    """Distinct values that occur in a categorical column (unused categories dropped)."""
    return set(column.cat.remove_unused_categories().cat.categories)


def _recode(column: pd.Series, vocab: tuple[str, ...]) -> np.ndarray:
    """Codes of a categorical column in `vocab` (-1 for missing or unknown values)."""
    position = {name: i for i, name in enumerate(vocab)}
    lookup = np.array([position.get(c, -1) for c in column.cat.categories] + [-1], dtype=np.int32)
    return lookup[column.cat.codes.to_numpy()]  # code -1 (missing) picks the trailing -1


def frames_to_tables(frames: Sequence[pd.DataFrame], numeric: Sequence[str], categorical: Sequence[str],
                     labels: Sequence[np.ndarray]) -> list[Table]:
    """Tables of several frames of one dataset with a common vocabulary: the sorted distinct values over all
    frames (a schema: the one-hot width does not depend on the seed, subsample or split)."""
    vocab = tuple(tuple(sorted(set().union(*(_observed(f[c]) for f in frames)))) for c in categorical)
    tables = []
    for frame, y in zip(frames, labels):
        num = frame[list(numeric)].to_numpy(dtype=np.float64, copy=True)
        codes = np.empty((len(frame), len(categorical)), dtype=np.int32)
        for j, col in enumerate(categorical):
            codes[:, j] = _recode(frame[col], vocab[j])
        tables.append(Table(num, codes, vocab, np.asarray(y, dtype=np.float64)))
    return tables


def array_table(X: np.ndarray, y: np.ndarray) -> Table:
    """A Table of purely numeric features (MNIST, synthetic)."""
    no_codes = np.empty((len(y), 0), dtype=np.int32)
    return Table(np.asarray(X, dtype=np.float64), no_codes, (), np.asarray(y, dtype=np.float64))


def subsample(table: Table, size: int | None, seed: int, where: str) -> Table:
    """`size` records drawn without replacement (seeded), kept in file order; None keeps all."""
    if size is None:
        return table
    if size > len(table):
        raise DataError(f"{where}: subsample={size} exceeds the {len(table)} available records; "
                        f"use subsample <= {len(table)} or remove it")
    idx = np.sort(rng(seed, STREAM_SUBSAMPLE).choice(len(table), size=size, replace=False))
    return table.take(idx)


def random_split(table: Table, test_fraction: float, seed: int, where: str) -> tuple[Table, Table]:
    """Seeded random (train, test) split, test of round(n * test_fraction) records, file order kept."""
    n = len(table)
    if n < 2:
        raise DataError(f"{where}: {n} record(s) cannot be split into train and test; increase subsample or n")
    n_test = min(max(int(round(n * test_fraction)), 1), n - 1)
    is_test = np.zeros(n, dtype=bool)
    is_test[rng(seed, STREAM_SPLIT).permutation(n)[:n_test]] = True
    return table.take(~is_test), table.take(is_test)


def train_test(tables: Sequence[Table], *, split: str, size: int | None, test_fraction: float, seed: int,
               where: str) -> tuple[Table, Table]:
    """(train, test) by `split` (docs/datasets.md); none: an empty test set (Song et al. 2013 plot the training
    objective of the whole sample)."""
    if split in ("official", "none"):
        train = subsample(tables[0], size, seed, where)
        return train, (tables[1] if split == "official" else train.take(np.arange(0)))
    if len(tables) == 1:
        pool = tables[0]
    else:  # the official test records after the training ones (same vocabulary)
        a, b = tables
        pool = Table(np.vstack([a.numeric, b.numeric]), np.vstack([a.codes, b.codes]), a.vocab,
                     np.concatenate([a.y, b.y]))
    return random_split(subsample(pool, size, seed, where), test_fraction, seed, where)


def one_hot(codes: np.ndarray, vocab: tuple[tuple[str, ...], ...]) -> np.ndarray:
    """0/1 float64 indicator columns, vocab[0] first; a code of -1 gives an all-zero block."""
    widths = [len(v) for v in vocab]
    out = np.zeros((codes.shape[0], sum(widths)), dtype=np.float64)
    offset = 0
    rows = np.arange(codes.shape[0])
    for j, width in enumerate(widths):
        ok = codes[:, j] >= 0
        out[rows[ok], offset + codes[ok, j]] = 1.0
        offset += width
    return out


def column_stats(X: np.ndarray, chunk: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Column means and (population) standard deviations, two passes over row chunks (no full-size temporaries)."""
    n = X.shape[0]
    mean = np.zeros(X.shape[1])
    for start in range(0, n, chunk):
        mean += X[start : start + chunk].sum(axis=0)
    mean /= max(n, 1)
    sq = np.zeros(X.shape[1])
    for start in range(0, n, chunk):
        centred = X[start : start + chunk] - mean
        sq += np.einsum("ij,ij->j", centred, centred)
    return mean, np.sqrt(sq / max(n, 1))


def standardize(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x - mean) / std with train statistics, in place; columns constant in train are left as is."""
    if train.shape[1] == 0:
        return train, test
    mean, std = column_stats(train)
    constant = (train.max(axis=0) == train.min(axis=0)) | ~(std > 0)  # exact test, no rounding noise
    mean[constant], std[constant] = 0.0, 1.0
    for X in (train, test):
        X -= mean
        X /= std
    return train, test


def encode(train: Table, test: Table, *, use_one_hot: bool, use_standardize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Feature matrices [numeric | categorical]: categorical one-hot (not standardised) or integer codes treated
    as numeric; standardises the tables' numeric arrays in place (pass tables not used afterwards)."""
    if use_one_hot:
        num_tr, num_te = train.numeric, test.numeric
    else:
        num_tr = np.hstack([train.numeric, train.codes.astype(np.float64)])
        num_te = np.hstack([test.numeric, test.codes.astype(np.float64)])
    if use_standardize:
        num_tr, num_te = standardize(num_tr, num_te)
    if not use_one_hot or not train.vocab:
        return num_tr, num_te
    return np.hstack([num_tr, one_hot(train.codes, train.vocab)]), np.hstack([num_te, one_hot(test.codes, test.vocab)])


def projection_matrix(d: int, k: int, seed: int) -> np.ndarray:
    """(d, k) Gaussian matrix with N(0, 1/k) entries (Johnson-Lindenstrauss), seeded."""
    return rng(seed, STREAM_PROJECTION).normal(0.0, 1.0 / np.sqrt(k), size=(d, k))


def project(train: np.ndarray, test: np.ndarray, k: int | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian random projection of train and test to `k` columns (None: unchanged)."""
    if k is None:
        return train, test
    if k > train.shape[1]:  # a projection reduces the dimension; a larger k only adds correlated copies
        raise DataError(f"projection = {k} is larger than the d = {train.shape[1]} features of the data; "
                        f"use projection ≤ {train.shape[1]} or leave it out")
    matrix = projection_matrix(train.shape[1], k, seed)
    return train @ matrix, test @ matrix


def features(train: Table, test: Table, *, one_hot: bool, standardize: bool, projection: int | None, unit_ball: str,
             seed: int, order: str = "project_then_ball") -> tuple[np.ndarray, np.ndarray]:
    """The pipeline after the split: encode (one-hot, standardise), then projection and unit ball in `order`
    (`ball_then_project` is Song et al. §IV-A's: normalise, rows to the unit ball, then project)."""
    X_train, X_test = encode(train, test, use_one_hot=one_hot, use_standardize=standardize)
    if order == "ball_then_project":
        X_train, X_test = to_unit_ball(X_train, X_test, unit_ball)
        return project(X_train, X_test, projection, seed)
    X_train, X_test = project(X_train, X_test, projection, seed)
    return to_unit_ball(X_train, X_test, unit_ball)


def _clip_rows(X: np.ndarray) -> np.ndarray:
    """x / max(1, ||x||) for every row, in place."""
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1))[:, None]
    return X


def to_unit_ball(train: np.ndarray, test: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Bring rows into the unit L2 ball, in place (Chaudhuri, Monteleoni & Sarwate, JMLR 2011): row: x / max(1,
    ||x||) per row; max: divide by the largest train row norm, then clip test rows; none: unchanged."""
    if mode == "row":
        return _clip_rows(train), _clip_rows(test)
    if mode == "max":
        largest = float(np.linalg.norm(train, axis=1).max(initial=0.0))
        if largest > 0:
            train /= largest
            test /= largest
        return _clip_rows(train), _clip_rows(test)
    if mode == "none":
        return train, test
    raise DataError(f"unit_ball: unknown mode '{mode}'; use row, max or none")
