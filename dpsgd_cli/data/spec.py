"""What a grid says about a dataset (`DatasetSpec`) and what loading it yields (`Dataset`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_serializer

from dpsgd_cli.errors import DataError

DatasetName = Literal["adult", "bank", "kddcup99", "mnist", "synthetic"]


class DatasetSpec(BaseModel):
    """A dataset and its preprocessing, as written in a grid (`{name: kddcup99, subsample: 70000}`); fields left
    at None take the dataset's own default (`dpsgd datasets info NAME`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: DatasetName
    subsample: int | None = Field(None, gt=0, description="keep this many records (seeded) before splitting")
    positive_digit: int | None = Field(None, ge=0, le=9, description="MNIST one-vs-all: the positive class")
    one_hot: bool = Field(True, description="one-hot encode categorical columns")
    standardize: bool | None = Field(
        None, description="standardise numeric columns with train statistics (default: yes, but not MNIST pixels)")
    projection: int | None = Field(None, gt=0, description="Gaussian random projection to k dimensions")
    unit_ball: Literal["row", "max", "none"] = Field(
        "row", description="row: x/max(1,|x|) per row; max: divide by the largest train row norm; none")
    split: Literal["official", "random", "none"] | None = Field(
        None, description="official train/test files where they exist, else a seeded random split; none: train on "
                          "every record of the pool or training file (after subsample), empty test set "
                          "(test metrics NaN)")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="test share of a random split")
    seed: int = Field(0, ge=0, description="seed of subsampling, random split, projection and synthetic data")
    n: int | None = Field(None, gt=0, description="synthetic: number of points (default 10,000)")
    dim: int | None = Field(None, gt=0, description="synthetic: dimension (default 5)")
    order: Literal["project_then_ball", "ball_then_project"] = Field(
        "project_then_ball", description="project_then_ball: standardise -> projection -> unit ball (rows end in "
        "the ball); ball_then_project: standardise -> unit ball -> projection, Song et al. 2013 §IV-A's order "
        "(projected rows may leave the unit ball)")

    @model_serializer(mode="wrap")
    def _omit_default_order(self, handler):
        """`order` at its default is left out of dumps: run ids and cache keys of specs that leave it there stay."""
        data = handler(self)
        if isinstance(data, dict) and self.order == "project_then_ball":
            data.pop("order", None)
        return data


@dataclass(frozen=True)
class Dataset:
    """Preprocessed arrays: features float64 (n, d), labels in {-1, +1} float64 (n,)."""

    spec: Any  # DatasetSpec or data.files.FileDatasetSpec
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    # preprocessing that used statistics of the training set (not covered by the accountant); file datasets
    train_statistics: tuple[str, ...] = ()
    summary: str = ""  # what loading did, in one line (file datasets: rows read, dropped, features)
    X_val: np.ndarray | None = None  # held out of the training set by `with_validation` (never the test set)
    y_val: np.ndarray | None = None

    @property
    def name(self) -> str:
        """The name in results: the registry name, or a file dataset's `id`."""
        return getattr(self.spec, "id", None) or self.spec.name

    @property
    def n(self) -> int:
        return self.X_train.shape[0]

    @property
    def d(self) -> int:
        return self.X_train.shape[1]


VALIDATION_STREAM = 0x5A11D  # a seed stream of its own: the split does not depend on any other draw


def validation_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit, validation) sorted row indices of a training set of n rows: row i is held out iff the i-th uniform
    draw of a seeded stream is below `fraction`, so each row's assignment is its own (privacy/tuning.py relies
    on it)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation = {fraction:g} must be in (0, 1)")
    held = np.random.default_rng([seed, VALIDATION_STREAM]).random(n) < fraction
    if held.all() or not held.any():
        raise DataError(f"validation = {fraction:g} leaves no row for {'fitting' if held.all() else 'validation'} "
                        f"in a training set of n = {n}; use a larger dataset or another fraction")
    return np.flatnonzero(~held), np.flatnonzero(held)


def with_validation(data: Dataset, fraction: float | None) -> Dataset:
    """`data` with its training set split into fitting rows (X_train) and a validation set (X_val)."""
    if not fraction:
        return data
    try:
        fit, held = validation_split(data.n, fraction, getattr(data.spec, "seed", 0))
    except DataError as exc:
        raise DataError(f"dataset {getattr(data.spec, 'id', None) or data.spec.name}: {exc}") from None
    return dataclasses.replace(data, X_train=data.X_train[fit], y_train=data.y_train[fit],
                               X_val=data.X_train[held], y_val=data.y_train[held])
