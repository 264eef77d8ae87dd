"""Your own data: `{name: file, path: data/credit.csv, label: default, positive: "yes"}` in a grid; formats,
pipeline, run ids and errors: docs/datasets.md#your-own-data. Statistics of the whole training set
(standardisation, max-norm scaling, the category vocabulary, imputation means) are outside what the accountant
covers: each run records which were used and `dpsgd run` prints the caveat once."""

from __future__ import annotations

import difflib
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from dpsgd_cli.data import preprocess as pp
from dpsgd_cli.data.download import sha256_of
from dpsgd_cli.data.spec import Dataset
from dpsgd_cli.errors import DataError
from dpsgd_cli.lazy import LazyModule, installed

sklearn_datasets = LazyModule("sklearn.datasets")  # heavy, and read for LIBSVM files only

FORMATS = ("csv", "tsv", "parquet", "libsvm", "npz")
TABULAR = ("csv", "tsv", "parquet")
SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet",
            ".libsvm": "libsvm", ".svm": "libsvm", ".svmlight": "libsvm", ".npz": "npz"}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zip")
ARRAY_LABEL = "y"  # the label of libsvm / npz records
MAX_DENSE_BYTES = 4 * 2**30  # features are trained dense
MAX_FILE_BYTES = MAX_DENSE_BYTES  # a larger file (8 bytes a dense value; text takes ≥ 2 a value) would not fit either
CAVEAT = ("privacy: {used} computed on the whole training set (not covered by the accountant); "
          "unit_ball: row and gradient clipping are the private choices")


def _stem(path: Path) -> tuple[str, str]:
    """(name without compression and format suffixes, format suffix) of a path."""
    name = path.name
    for ending in COMPRESSION:
        name = name.removesuffix(ending)
    suffix = Path(name).suffix.lower()
    return (name[: -len(suffix)] if suffix in SUFFIXES else name), suffix


class FileDatasetSpec(BaseModel):
    """A local file as a dataset, with the preprocessing options of the built-in sets; `sha256` / `test_sha256`
    are filled from the file(s) (written in a grid, they pin it; a manifest's spec is trusted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["file"]
    path: str = Field(description="the file; relative to the grid file's folder")
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$",
                           description="the dataset's name in results (default: the file name)")
    format: Literal["csv", "tsv", "parquet", "libsvm", "npz"] | None = Field(
        None, description="default: from the extension (.csv .tsv .parquet .libsvm/.svm .npz, optionally .gz)")
    sep: str | None = Field(None, description="csv/tsv column separator (default ',' or tab)")
    label: str | None = Field(None, description="label column (csv, tsv, parquet; libsvm/npz use y)")
    positive: bool | int | float | str | None = Field(
        None, description="label value of class +1, others -1 (default: the larger of exactly two values)")
    drop: tuple[str, ...] = Field((), description="columns not used")
    categorical: tuple[str, ...] | None = Field(
        None, description="columns one-hot encoded (default: the non-numeric columns)")
    missing: Literal["drop", "impute"] = Field(
        "drop", description="rows with a missing feature: drop, or impute (training mean; categorical: no category)")
    test_path: str | None = Field(None, description="test file (default: a seeded random split)")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="test share of the random split")
    seed: int = Field(0, ge=0, description="seed of subsampling, random split and projection")
    subsample: int | None = Field(None, gt=0, description="keep this many training-pool records (seeded)")
    one_hot: bool = Field(True, description="one-hot encode categorical columns (else integer codes)")
    standardize: bool = Field(True, description="standardise numeric columns with training statistics")
    projection: int | None = Field(None, gt=0, description="Gaussian random projection to k dimensions")
    unit_ball: Literal["row", "max", "none"] = Field("row", description="as for the built-in datasets")
    sha256: str | None = Field(None, description="of `path` (filled in; written, it is checked)")
    test_sha256: str | None = Field(None, description="of `test_path` (filled in; written, it is checked)")

    @model_validator(mode="before")
    @classmethod
    def _locate(cls, raw: Any, info: ValidationInfo) -> Any:
        """Resolve the paths (grid folder), hash the files, default `format` and `id`."""
        if not (isinstance(raw, dict) and isinstance(raw.get("path"), str)
                and isinstance(raw.get("test_path"), (str, type(None)))):
            return raw  # no path, or one that is not text: the field's own check says so in one line
        raw = dict(raw)
        grid_dir = (info.context or {}).get("grid_dir")
        for key, sha_key in (("path", "sha256"), ("test_path", "test_sha256")):
            if raw.get(key) is None:
                continue
            written = Path(str(raw[key])).expanduser()
            path = written if written.is_absolute() else Path(grid_dir or Path.cwd()) / written
            raw[key] = str(path.resolve())
            if raw.get(sha_key) and grid_dir is None:
                continue  # a manifest's spec: its hash is the record, the file may be gone
            where = "the grid file's folder" if grid_dir is not None else "the working directory"
            hint = f" (a relative path is relative to {where})" if not written.is_absolute() else ""
            problem = file_problem(path)
            if problem:
                raise ValueError(f"{key} {path}: {problem}{hint if problem.startswith('no such') else ''}")
            digest = sha256_of(path)
            if raw.get(sha_key) and raw[sha_key] != digest:
                raise ValueError(f"{key} {path} has sha256 {digest}, not the {sha_key} the grid pins "
                                 f"({raw[sha_key]}): the file changed; update or remove {sha_key}")
            raw[sha_key] = digest
        stem, suffix = _stem(Path(raw["path"]))
        if raw.get("format") is None:
            if suffix not in SUFFIXES:
                raise ValueError(f"cannot tell the format of {Path(raw['path']).name} from its extension; "
                                 f"add format: one of {', '.join(FORMATS)}")
            raw["format"] = SUFFIXES[suffix]
        if raw.get("id") is None:
            raw["id"] = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "file"
        if raw["format"] not in TABULAR:
            given = [k for k in ("label", "drop", "categorical", "sep") if raw.get(k) not in (None, (), [])]
            if given:
                raise ValueError(f"{', '.join(given)}: only for csv, tsv and parquet files; {raw['format']} "
                                 f"files have unnamed features and their label in y")
        return raw

    @field_validator("drop", "categorical", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:  # a tuple even under strict validation (YAML gives lists)
        return (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value

    def identity(self) -> dict[str, Any]:
        """What enters the run id: every option and the files' sha256, not where the files are."""
        return self.model_dump(mode="json", exclude={"path", "test_path"})


def file_problem(path: Path) -> str:
    """Why `path` cannot be read as a data file ('' if it can), checked before it is hashed (a FIFO would block)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    if stat.S_ISDIR(info.st_mode):
        return "is a folder, not a file; give the path of the data file in it"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a FIFO, socket or device); save the data to a file and give its path"
    if info.st_size > MAX_FILE_BYTES:
        return (f"{info.st_size / 2**30:.1f} GiB is more than the {MAX_FILE_BYTES / 2**30:.0f} GiB a data file may "
                f"have (its features are trained dense, in memory); subsample the file, or drop columns, first")
    return ""


def file_spec(options: dict[str, Any]) -> FileDatasetSpec:
    """A FileDatasetSpec from options (paths relative to the working directory); DataError if invalid."""
    try:
        return FileDatasetSpec.model_validate({"name": "file", **options})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            match = difflib.get_close_matches(loc, FileDatasetSpec.model_fields, n=1, cutoff=0.5)
            raise DataError(f"unknown option '{loc}'" + (f" (did you mean '{match[0]}'?)" if match else "")) from None
        raise DataError(f"{loc + ': ' if loc else ''}{err['msg'].removeprefix('Value error, ')}") from None


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
    return text[:200]


def _read_tabular(path: Path, spec: FileDatasetSpec) -> pd.DataFrame:
    if spec.format == "parquet":
        if not installed("pyarrow"):
            raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'dpsgd[parquet]'")
        return pd.read_parquet(path)
    sep = spec.sep or ("," if spec.format == "csv" else "\t")
    return pd.read_csv(path, sep=sep, skipinitialspace=True)


def _array_frame(X: Any, y: np.ndarray, path: Path) -> pd.DataFrame:
    """Features x0..x{d-1} and label y of an array file, as a frame."""
    if getattr(X, "ndim", 0) != 2 or np.ndim(y) != 1 or X.shape[0] != len(y):
        raise DataError(f"{path}: expected X of shape (n, d) and y of shape (n,), got "
                        f"{getattr(X, 'shape', '?')} and {np.shape(y)}")
    if X.shape[0] * X.shape[1] * 8 > MAX_DENSE_BYTES:
        raise DataError(f"{path}: {X.shape[0]} x {X.shape[1]} features need more than "
                        f"{MAX_DENSE_BYTES / 2**30:.0f} GB dense; reduce the file (dpsgd trains on dense arrays)")
    dense = X.toarray() if hasattr(X, "toarray") else np.asarray(X, dtype=np.float64)
    frame = pd.DataFrame(dense.astype(np.float64, copy=False), columns=[f"x{j}" for j in range(X.shape[1])])
    frame[ARRAY_LABEL] = np.asarray(y)
    return frame


def _read_npz(path: Path) -> pd.DataFrame:
    with np.load(path, allow_pickle=False) as npz:
        missing = [k for k in ("X", "y") if k not in npz.files]
        if missing:
            raise DataError(f"{path}: an .npz dataset needs arrays X and y; it has {', '.join(npz.files) or 'none'}")
        return _array_frame(npz["X"], npz["y"], path)


def read_frames(spec: FileDatasetSpec) -> list[pd.DataFrame]:
    """[train file] or [train file, test file] as frames (array formats: columns x0.., label y)."""
    paths = [Path(spec.path)] + ([Path(spec.test_path)] if spec.test_path else [])
    for path, sha in zip(paths, (spec.sha256, spec.test_sha256)):
        problem = file_problem(path)
        if problem:
            raise DataError(f"{path}: {problem} (the grid's dataset {spec.id} reads it)")
        if sha and sha256_of(path) != sha:  # edited after the grid was read: its runs would be mislabelled
            raise DataError(f"{path}: the file changed since the grid was read (sha256 {sha[:12]}...); run again")
    try:
        if spec.format == "libsvm":  # read together: the same number of features in train and test
            arrays = sklearn_datasets.load_svmlight_files([str(p) for p in paths], dtype=np.float64)
            return [_array_frame(arrays[2 * i], arrays[2 * i + 1], p) for i, p in enumerate(paths)]
        if spec.format == "npz":
            return [_read_npz(p) for p in paths]
        return [_read_tabular(p, spec) for p in paths]
    except DataError:
        raise
    except Exception as exc:  # parsers raise many types; each is one line for the user
        raise DataError(f"{' / '.join(map(str, paths))}: cannot read as {spec.format}: {_one_line(exc)}; "
                        f"check the file or set format: ({', '.join(FORMATS)})") from None


def _closest(word: str, names: Iterable[str]) -> str:
    names = [str(n) for n in names]
    match = difflib.get_close_matches(word, names, n=1, cutoff=0.5) or [n for n in names if n.lower() == word.lower()]
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return (f"did you mean '{match[0]}'? " if match else "") + f"columns: {shown}"


def _require_columns(frame: pd.DataFrame, names: Iterable[str], key: str, where: str) -> None:
    for name in names:
        if name not in frame.columns:
            raise DataError(f"{where}: {key} column '{name}' is not in the file; {_closest(name, frame.columns)}")


def _feature_columns(frame: pd.DataFrame, spec: FileDatasetSpec, label: str, where: str) -> tuple[list, list]:
    """(numeric, categorical) feature columns: categorical as given, else the non-numeric ones."""
    features = [c for c in frame.columns if c != label and c not in spec.drop]
    if spec.categorical is None:  # text-like columns; dates are not guessed (they fail the numeric check)
        categorical = [c for c in features if not pd.api.types.is_numeric_dtype(frame[c])
                       and not pd.api.types.is_datetime64_any_dtype(frame[c])]
        for c in categorical:
            if len(frame) > 20 and frame[c].nunique() == len(frame):
                raise DataError(f"{where}: column '{c}' has a different value in every row (an identifier?); "
                                f"add it to drop, or list the categorical columns to one-hot it anyway")
    else:
        _require_columns(frame, spec.categorical, "categorical", where)
        categorical = [c for c in features if c in spec.categorical]
    numeric = [c for c in features if c not in categorical]
    _check_numeric(frame, numeric, where)
    return numeric, categorical


def _check_numeric(frame: pd.DataFrame, numeric: list[str], where: str) -> None:
    """DataError naming the first of `numeric` whose values are not numbers."""
    for c in numeric:
        if not pd.api.types.is_numeric_dtype(frame[c]):
            value = frame[c].dropna().iloc[0] if frame[c].notna().any() else ""
            raise DataError(f"{where}: column '{c}' is not numeric (e.g. {value!r}); list it under categorical "
                            f"(one-hot) or under drop")


def _check_finite(frame: pd.DataFrame, numeric: list[str], where: str) -> None:
    """DataError naming the first numeric column with an infinite value or values whose squares overflow."""
    with np.errstate(over="ignore", invalid="ignore"):
        for c in numeric:
            values = frame[c].to_numpy(dtype=np.float64, na_value=np.nan)
            if np.isinf(values).any():
                raise DataError(f"{where}: column '{c}' holds infinite values (or numbers beyond float64); fix the "
                                f"file or drop the column")
            if not np.isfinite(np.nansum(np.square(values))):
                raise DataError(f"{where}: column '{c}' holds values too large to compute with (|x| up to "
                                f"{np.nanmax(np.abs(values)):.3g}: their squares overflow float64); rescale the "
                                f"column or drop it")


def _matches(labels: pd.Series, positive: Any) -> np.ndarray:
    """Which labels equal `positive` (numbers compared as numbers, anything else as text)."""
    if pd.api.types.is_numeric_dtype(labels):
        try:
            return labels.to_numpy(dtype=np.float64) == float(positive)
        except (TypeError, ValueError):
            return np.zeros(len(labels), dtype=bool)
    return (labels.astype(str).str.strip() == str(positive).strip()).to_numpy()


def _positive_value(labels: pd.Series, spec: FileDatasetSpec, where: str) -> Any:
    """The label value of class +1: `positive`, else the larger of exactly two values."""
    values = sorted(labels.unique().tolist(), key=lambda v: (isinstance(v, str), v))
    shown = ", ".join(repr(v) for v in values[:10]) + (", ..." if len(values) > 10 else "")
    if spec.positive is not None:
        if not _matches(labels, spec.positive).any():
            hint = " (YAML reads yes/no/true/false as booleans: quote it)" if isinstance(spec.positive, bool) else ""
            raise DataError(f"{where}: positive: {spec.positive!r} does not occur in the label; its values are "
                            f"{shown}{hint}")
        return spec.positive
    if len(values) == 2:
        return values[1]
    if len(values) < 2:
        raise DataError(f"{where}: the label has a single class ({shown}); a classifier needs two")
    raise DataError(f"{where}: the label has {len(values)} values ({shown}); give positive: VALUE "
                    f"(that value is class +1, all others -1)")


def _to_category(column: pd.Series) -> pd.Series:
    """Text categories (missing stays missing), so train and test files share values."""
    return column.where(column.isna(), column.astype(str)).astype("category")


def _train_vocabulary(train: pp.Table, test: pp.Table) -> tuple[pp.Table, pp.Table, int]:
    """Categories restricted to the training part's (others: code -1), and how many test values had another."""
    tr, te, unseen = train.codes.copy(), test.codes.copy(), 0
    names_seen: list[tuple[str, ...]] = []
    for j, names in enumerate(train.vocab):
        seen = np.unique(train.codes[:, j][train.codes[:, j] >= 0])
        lookup = np.full(len(names) + 1, -1, dtype=np.int32)  # index -1 (missing) -> the last slot, -1
        lookup[seen] = np.arange(len(seen), dtype=np.int32)
        tr[:, j], te[:, j] = lookup[train.codes[:, j]], lookup[test.codes[:, j]]
        unseen += int(((te[:, j] < 0) & (test.codes[:, j] >= 0)).sum())
        names_seen.append(tuple(names[k] for k in seen))
    vocab = tuple(names_seen)
    return pp.Table(train.numeric, tr, vocab, train.y), pp.Table(test.numeric, te, vocab, test.y), unseen


def _impute(train: pp.Table, test: pp.Table) -> int:
    """Missing numeric values := the training column mean (0 if all missing), in place; the training count."""
    missing = np.isnan(train.numeric)
    if not missing.any() and not np.isnan(test.numeric).any():
        return 0
    counts = (~missing).sum(axis=0)
    means = np.where(counts > 0, np.nansum(train.numeric, axis=0) / np.maximum(counts, 1), 0.0)
    for X in (train.numeric, test.numeric):
        rows, cols = np.nonzero(np.isnan(X))
        X[rows, cols] = means[cols]
    return int(missing.sum())


def build_file_dataset(spec: FileDatasetSpec) -> tuple[Dataset, dict[str, Any]]:
    """The preprocessed dataset of a file spec, and what loading did (rows, drops, columns, balance)."""
    where = f"dataset {spec.id} ({Path(spec.path).name})"
    frames = read_frames(spec)
    label = spec.label if spec.format in TABULAR else ARRAY_LABEL
    if label is None:
        raise DataError(f"{where}: give label: (the label column); {_closest('', frames[0].columns)}")
    for frame, name in zip(frames, (where, f"{where}, test_path")):
        _require_columns(frame, [label], "label", name)
        _require_columns(frame, spec.drop, "drop", name)
    numeric, categorical = _feature_columns(frames[0], spec, label, where)
    if not numeric + categorical:
        raise DataError(f"{where}: no feature column (the file has {', '.join(map(str, frames[0].columns))}; "
                        f"label {label!r}" + (f", drop {', '.join(spec.drop)}" if spec.drop else "") +
                        "); a classifier needs at least one feature")
    info: dict[str, Any] = {"id": spec.id, "path": spec.path, "format": spec.format, "sha256": spec.sha256,
                            "test_path": spec.test_path, "test_sha256": spec.test_sha256, "label": label,
                            "rows_read": [len(f) for f in frames], "rows_dropped": [], "rows_missing_label": [],
                            "rows_missing_values": [], "values_missing": [], "missing": spec.missing}
    kept = []
    for i, frame in enumerate(frames):
        if i:
            _require_columns(frame, numeric + categorical, "feature", f"{where}, test_path")
            _check_numeric(frame, numeric, f"{where}, test_path")
        frame = frame[numeric + categorical + [label]]
        _check_finite(frame, numeric, where if not i else f"{where}, test_path")
        has_label = frame[label].notna().to_numpy()
        frame = frame[has_label]
        incomplete = frame[numeric + categorical].isna().any(axis=1).to_numpy()
        if spec.missing == "drop" and len(frame) and incomplete.all():
            counts = frame[numeric + categorical].isna().sum()
            worst = counts.idxmax()
            raise DataError(f"{where if not i else where + ', test_path'}: every row has a missing value (column "
                            f"'{worst}' is missing in {counts[worst]} of {len(frame)} rows); drop that column, or "
                            f"use missing: impute")
        info["rows_missing_label"].append(int((~has_label).sum()))
        info["rows_missing_values"].append(int(incomplete.sum()))
        info["values_missing"].append(int(frame[numeric + categorical].isna().to_numpy().sum()))
        if spec.missing == "drop":
            frame = frame[~incomplete]
        info["rows_dropped"].append(info["rows_read"][i] - len(frame))
        kept.append(frame.assign(**{c: frame[c].astype("float64") for c in numeric},
                                 **{c: _to_category(frame[c]) for c in categorical}))
    positive = _positive_value(kept[0][label], spec, where)
    labels = [np.where(_matches(f[label], positive), 1.0, -1.0) for f in kept]
    tables = pp.frames_to_tables(kept, numeric, categorical, labels)
    split = "official" if spec.test_path is not None else "random"
    train, test = pp.train_test(tables, split=split, size=spec.subsample, test_fraction=spec.test_fraction,
                                seed=spec.seed, where=where)
    if len(np.unique(train.y)) < 2:
        raise DataError(f"{where}: every training record has label {'+1' if train.y[0] > 0 else '-1'} "
                        f"(positive: {positive!r}) — a single class; check label and positive")
    train, test, unseen = _train_vocabulary(train, test)
    imputed = _impute(train, test) if spec.missing == "impute" else 0
    X_train, X_test = pp.features(train, test, one_hot=spec.one_hot, standardize=spec.standardize,
                                  projection=spec.projection, unit_ball=spec.unit_ball, seed=spec.seed)
    if X_train.shape[1] == 0:
        raise DataError(f"{where}: no feature left after encoding; a classifier needs at least one feature")
    if not (np.isfinite(X_train).all() and np.isfinite(X_test).all()):
        raise DataError(f"{where}: the features are not finite after preprocessing (values too large or too "
                        f"spread for float64); rescale the file's columns")
    used = [name for name, on in (
        ("standardisation", spec.standardize and (numeric or (categorical and not spec.one_hot))),
        ("category vocabulary", bool(categorical)), ("imputation means", imputed > 0),
        ("max-norm scaling", spec.unit_ball == "max")) if on]
    info.update(positive=positive, training_values_imputed=imputed, numeric_columns=numeric,
                categorical_columns={c: len(v) for c, v in zip(categorical, train.vocab)},
                test_values_of_unseen_categories=unseen, n_train=X_train.shape[0], n_test=X_test.shape[0],
                features=X_train.shape[1], positive_fraction_train=float(np.mean(train.y > 0)),
                positive_fraction_test=float(np.mean(test.y > 0)) if len(test.y) else float("nan"),
                train_statistics=used, caveat=CAVEAT.format(used=", ".join(used)) if used else "")
    dataset = Dataset(spec, X_train, train.y, X_test, test.y, train_statistics=tuple(used), summary=_summary(info))
    return dataset, info


def _summary(info: dict[str, Any]) -> str:
    """One line: what was read, dropped and produced."""
    no_label, incomplete = sum(info["rows_missing_label"]), sum(info["rows_missing_values"])
    if info["missing"] == "drop":
        rows = f"{sum(info['rows_dropped'])} dropped ({incomplete} with missing values, {no_label} without a label)"
    else:
        rows = (f"{no_label} dropped (no label), {incomplete} with missing values kept "
                f"({info['training_values_imputed']} training values imputed)")
    return (f"{info['id']}: {Path(info['path']).name} ({info['format']}, sha256 {info['sha256'][:12]}), "
            f"{sum(info['rows_read'])} rows read, {rows}; {info['n_train']} train / "
            f"{info['n_test']} test, {info['features']} features ({len(info['numeric_columns'])} numeric, "
            f"{len(info['categorical_columns'])} categorical columns); class +1 = {info['label']} == "
            f"{info['positive']!r} ({info['positive_fraction_train']:.1%} of train)")


def load_file_dataset(spec: FileDatasetSpec) -> Dataset:
    """The preprocessed dataset of a file spec (features float64, labels -1/+1 float64)."""
    return build_file_dataset(spec)[0]


def file_dataset_info(spec: FileDatasetSpec) -> dict[str, Any]:
    """What the loader produces from the file: rows read / dropped, columns, features, label balance."""
    return build_file_dataset(spec)[1]


def run_notes(datasets: Iterable[Dataset]) -> list[str]:
    """The lines `dpsgd run` prints once: each file dataset's summary, then the privacy caveat."""
    datasets = list(datasets)
    used = sorted({s for d in datasets for s in d.train_statistics})
    return [d.summary for d in datasets if d.summary] + ([CAVEAT.format(used=", ".join(used))] if used else [])
