"""`load_dataset(spec)`: raw files -> preprocessed `Dataset`, with an on-disk cache of the arrays; the steps, their
order and the choices behind them: docs/datasets.md#dataset-options."""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from dpsgd_cli.data import preprocess as pp
from dpsgd_cli.data import readers
from dpsgd_cli.data.download import cache_dir, fetch_file, make_readable
from dpsgd_cli.data.files import load_file_dataset
from dpsgd_cli.data.registry import files_for_split, get_entry
from dpsgd_cli.data.spec import Dataset, DatasetSpec
from dpsgd_cli.data.synthetic import make_synthetic
from dpsgd_cli.errors import DataError

# bumped with any change to the arrays a spec yields: part of the processed-cache key
PREPROCESSING_VERSION = "2"

ARRAYS = ("X_train", "y_train", "X_test", "y_test")
# a zip member's local file header: its fixed part, then the name and extra field (PKWARE APPNOTE.TXT §4.3.7)
ZIP_LOCAL_HEADER_SIZE = 30
ZIP_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


def _where(spec: DatasetSpec) -> str:
    return f"dataset {spec.name}"


def resolve_spec(spec: DatasetSpec) -> DatasetSpec:
    """`spec` with None fields replaced by the dataset's defaults, after checking the combination."""
    entry = get_entry(spec.name)
    where = _where(spec)
    if spec.split == "official" and not entry.official_split:
        raise DataError(f"{where}: there is no official train/test split for {spec.name}; "
                        "use split: random (with test_fraction) or leave split unset")
    if spec.positive_digit is not None and spec.name != "mnist":
        raise DataError(f"{where}: positive_digit applies only to mnist; remove it from this dataset")
    for key in ("n", "dim"):
        if getattr(spec, key) is not None and spec.name != "synthetic":
            raise DataError(f"{where}: {key} applies only to synthetic; for fewer records use subsample")
    update = {k: v for k, v in entry.defaults.items() if getattr(spec, k) is None and v is not None}
    return spec.model_copy(update=update)


def _resolved(spec: DatasetSpec, key: str) -> Any:
    """A field of a `resolve_spec` result that its dataset's defaults always set (None only in an unresolved spec)."""
    value = getattr(spec, key)
    if value is None:
        raise ValueError(f"{_where(spec)}: {key} is unset; pass the spec through resolve_spec first")
    return value


def _paths(spec: DatasetSpec) -> dict[str, Path]:
    """Verified local paths of the files this (resolved) spec reads, downloading if needed."""
    entry = get_entry(spec.name)
    return {f.name: fetch_file(spec.name, f.name) for f in files_for_split(entry, spec.split)}


def _adult_tables(spec: DatasetSpec) -> list[pp.Table]:
    """[train, test] from adult.data / adult.test, label +1 for '>50K'."""
    paths = _paths(spec)
    frames = readers.read_adult(paths["adult.data"], paths["adult.test"])
    labels = [np.where(f["income"] == ">50K", 1.0, -1.0) for f in frames]
    return pp.frames_to_tables(frames, readers.ADULT_NUMERIC, readers.ADULT_CATEGORICAL, labels)


def _bank_tables(spec: DatasetSpec) -> list[pp.Table]:
    """[all records] of bank-additional-full.csv, label +1 for y == 'yes'."""
    frame = readers.read_bank(_paths(spec)["bank-additional.zip"])
    labels = [np.where(frame["y"] == "yes", 1.0, -1.0)]
    return pp.frames_to_tables([frame], readers.BANK_NUMERIC, readers.BANK_CATEGORICAL, labels)


def _kddcup99_tables(spec: DatasetSpec) -> list[pp.Table]:
    """[10% file] or, for split official, [10% file, corrected]; label +1 for any attack."""
    paths = _paths(spec)
    names = ["kddcup.data_10_percent.gz"] + (["corrected.gz"] if spec.split == "official" else [])
    frames = [readers.read_kddcup99(paths[name]) for name in names]
    labels = [np.where(f["label"] == "normal.", -1.0, 1.0) for f in frames]
    return pp.frames_to_tables(frames, readers.KDD_NUMERIC, readers.KDD_CATEGORICAL, labels)


def _mnist_tables(spec: DatasetSpec) -> list[pp.Table]:
    """[train, test]: pixels / 255, label +1 for `positive_digit`, -1 for the other digits."""
    paths = _paths(spec)
    tables = []
    for part in ("train", "t10k"):
        images, digits = readers.read_mnist(paths[f"{part}-images-idx3-ubyte.gz"],
                                            paths[f"{part}-labels-idx1-ubyte.gz"])
        X = images.astype(np.float64)
        X /= 255.0
        tables.append(pp.array_table(X, np.where(digits == spec.positive_digit, 1.0, -1.0)))
    return tables


def _synthetic_tables(spec: DatasetSpec) -> list[pp.Table]:
    """[all points] of the Song-Chaudhuri-Sarwate synthetic set."""
    X, y, _ = make_synthetic(n=_resolved(spec, "n"), dim=_resolved(spec, "dim"), seed=spec.seed)
    return [pp.array_table(X, y)]


_TABLES = {"adult": _adult_tables, "bank": _bank_tables, "kddcup99": _kddcup99_tables, "mnist": _mnist_tables,
           "synthetic": _synthetic_tables}


def build_dataset(spec: DatasetSpec) -> Dataset:
    """Preprocess from the raw files, without the processed cache. `spec` must be resolved."""
    where = _where(spec)
    tables = _TABLES[spec.name](spec)
    train, test = pp.train_test(tables, split=_resolved(spec, "split"), size=spec.subsample,
                                test_fraction=spec.test_fraction, seed=spec.seed, where=where)
    use_standardize = _resolved(spec, "standardize") and spec.name != "synthetic"
    X_train, X_test = pp.features(train, test, one_hot=spec.one_hot, standardize=use_standardize,
                                  projection=spec.projection, unit_ball=spec.unit_ball, seed=spec.seed,
                                  order=spec.order)
    return Dataset(spec, X_train, train.y, X_test, test.y)


def _cache_text(spec: DatasetSpec) -> str:
    """What identifies processed arrays: PREPROCESSING_VERSION, file checksums, resolved spec JSON."""
    resolved = resolve_spec(spec)
    shas = ",".join(f.sha256 for f in get_entry(spec.name).files)
    return f"v{PREPROCESSING_VERSION}|{shas}|{resolved.model_dump_json()}"


def cache_key(spec: DatasetSpec) -> str:
    """16 hex digits of the sha256 of `_cache_text(spec)`."""
    return hashlib.sha256(_cache_text(spec).encode()).hexdigest()[:16]


def processed_path(spec: DatasetSpec) -> Path:
    """<cache>/processed/<name>-<key>.npz, the processed-array cache file of `spec`."""
    return cache_dir() / "processed" / f"{spec.name}-{cache_key(spec)}.npz"


def arrays_sha256(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over the dtype, shape and bytes of each array (in ARRAYS order): what the cache file must hold."""
    digest = hashlib.sha256()
    for name in ARRAYS:
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        if array.size:  # an empty array (split: none has no test rows) has no bytes, and memoryview refuses it
            digest.update(array.data.cast("B"))
    return digest.hexdigest()


def _read_stored_arrays(fh) -> dict[str, np.ndarray]:
    """ARRAYS of an uncompressed .npz open as `fh`, each read straight into its array: no bytes copy, no zip CRC
    pass (the sha256 vouches for the bytes); ValueError if a member is compressed or malformed."""
    arrays = {}
    with zipfile.ZipFile(fh) as archive:
        for name in ARRAYS:
            info = archive.getinfo(f"{name}.npy")
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{name} is compressed")
            fh.seek(info.header_offset)
            local = fh.read(ZIP_LOCAL_HEADER_SIZE)
            if len(local) != ZIP_LOCAL_HEADER_SIZE or local[:4] != ZIP_LOCAL_HEADER_SIGNATURE:
                raise ValueError(f"{name}: bad local header")
            name_length, extra_length = struct.unpack("<HH", local[26:30])
            fh.seek(info.header_offset + ZIP_LOCAL_HEADER_SIZE + name_length + extra_length)
            version = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(fh)
            if dtype.hasobject:
                raise ValueError(f"{name} holds objects")
            count = math.prod(shape)
            array = np.fromfile(fh, dtype=dtype, count=count)
            if array.size != count:
                raise ValueError(f"{name} is truncated")
            arrays[name] = array.reshape(shape, order="F" if fortran else "C")
    return arrays


def _read_processed(path: Path, key: str, spec: DatasetSpec) -> tuple[dict[str, np.ndarray] | None, str]:
    """(arrays, "") of a processed cache file; (None, why) if it is unusable (docs/datasets.md#caches). The
    checksum is recomputed on every read: a stat-based stamp would miss a bit flipped in place."""
    try:
        # one open: a file replaced meanwhile cannot pair one file's key with another's arrays
        with open(path, "rb") as fh:
            with np.load(fh, allow_pickle=False) as npz:
                if str(npz["key"]) != key:
                    return None, "written for another spec"
                stored = str(npz["sha256"]) if "sha256" in npz.files else ""
                members = set(npz.files)
            arrays = _read_stored_arrays(fh)
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        return None, "unreadable"
    if not stored:
        return None, "has no checksum (written by an older version)"
    if arrays_sha256(arrays) != stored:
        return None, "does not match its checksum (modified or corrupt)"
    extra = sorted(members - {"key", "sha256", *ARRAYS})
    why = f"holds arrays it should not ({', '.join(extra)})" if extra else _not_processed(arrays, spec)
    return (None, why) if why else (arrays, "")


def _not_processed(arrays: dict[str, np.ndarray], spec: DatasetSpec) -> str:
    """Why `arrays` cannot be what preprocessing `spec` gives ('' if they can): a privacy guarantee rests on these
    (a row outside the ball breaks a sensitivity bound)."""
    X_train, y_train, X_test, y_test = (arrays[name] for name in ARRAYS)
    shapes_ok = (X_train.ndim == X_test.ndim == 2 and y_train.ndim == y_test.ndim == 1
                 and X_train.shape[1] == X_test.shape[1] and len(X_train) == len(y_train) > 0
                 and len(X_test) == len(y_test))
    if not shapes_ok or any(a.dtype != np.float64 for a in arrays.values()):
        return "holds arrays of the wrong shapes or types"
    if not all(np.isfinite(a).all() for a in arrays.values()):
        return "holds values that are not finite"
    if not (np.isin(y_train, (-1.0, 1.0)).all() and np.isin(y_test, (-1.0, 1.0)).all()):
        return "holds labels other than -1 and +1"
    in_ball = spec.unit_ball != "none" and spec.order == "project_then_ball"
    if in_ball and max(np.linalg.norm(X, axis=1).max(initial=0.0) for X in (X_train, X_test)) > 1.0 + 1e-9:
        return "holds rows outside the unit ball"
    return ""


def _write_processed(path: Path, key: str, dataset: Dataset) -> None:
    """Write the arrays and their sha256 atomically (temp file in the same folder + os.replace); best effort."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    except OSError:
        return  # read-only cache: work without it
    arrays = {name: getattr(dataset, name) for name in ARRAYS}
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, key=np.array(key), sha256=np.array(arrays_sha256(arrays)), **arrays)
        make_readable(Path(tmp))
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if not isinstance(exc, OSError):  # a full disk, a folder in the file's place: work without the cache
            raise


def load_dataset(spec: DatasetSpec, *, cache: bool = True) -> Dataset:
    """The preprocessed dataset of `spec` (its `spec` as given), through the processed cache with `cache`."""
    if spec.name == "file":  # a local file: no processed cache (its run id carries the file's sha256)
        return load_file_dataset(spec)
    resolved = resolve_spec(spec)
    path = processed_path(spec) if cache else None
    key = _cache_text(spec)
    if path is not None and path.exists():
        arrays, why = _read_processed(path, key, resolved)
        if arrays is not None:
            return Dataset(spec, arrays["X_train"], arrays["y_train"], arrays["X_test"], arrays["y_test"])
        print(f"dataset {spec.name}: the processed cache {path} {why}; rebuilding it from the raw files",
              file=sys.stderr)
    built = build_dataset(resolved)
    dataset = Dataset(spec, built.X_train, built.y_train, built.X_test, built.y_test)
    if path is not None:
        _write_processed(path, key, dataset)
    return dataset
