"""Parsers of the raw files: the records as distributed, with explicit column names and dtypes (categorical
columns as pandas' `category`); no preprocessing."""

from __future__ import annotations

import gzip
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
from numpy.typing import DTypeLike

from dpsgd_cli.errors import DataError

ADULT_NUMERIC = ["age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"]
ADULT_CATEGORICAL = ["workclass", "education", "marital-status", "occupation", "relationship", "race", "sex",
                     "native-country"]
ADULT_COLUMNS = ["age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
                 "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country",
                 "income"]

BANK_MEMBER = "bank-additional/bank-additional-full.csv"
BANK_NUMERIC = ["age", "duration", "campaign", "pdays", "previous", "emp.var.rate", "cons.price.idx", "cons.conf.idx",
                "euribor3m", "nr.employed"]
BANK_CATEGORICAL = ["job", "marital", "education", "default", "housing", "loan", "contact", "month", "day_of_week",
                    "poutcome"]

KDD_CATEGORICAL = ["protocol_type", "service", "flag"]
KDD_COLUMNS = [
    "duration", "protocol_type", "service", "flag", "src_bytes", "dst_bytes", "land", "wrong_fragment", "urgent",
    "hot", "num_failed_logins", "logged_in", "num_compromised", "root_shell", "su_attempted", "num_root",
    "num_file_creations", "num_shells", "num_access_files", "num_outbound_cmds", "is_host_login", "is_guest_login",
    "count", "srv_count", "serror_rate", "srv_serror_rate", "rerror_rate", "srv_rerror_rate", "same_srv_rate",
    "diff_srv_rate", "srv_diff_host_rate", "dst_host_count", "dst_host_srv_count", "dst_host_same_srv_rate",
    "dst_host_diff_srv_rate", "dst_host_same_src_port_rate", "dst_host_srv_diff_host_rate", "dst_host_serror_rate",
    "dst_host_srv_serror_rate", "dst_host_rerror_rate", "dst_host_srv_rerror_rate", "label"]
KDD_NUMERIC = [c for c in KDD_COLUMNS if c not in KDD_CATEGORICAL and c != "label"]


def _dtypes(numeric: list[str], categorical: list[str]) -> dict[str, str]:
    """read_csv dtype map: float64 for numeric, category for the rest."""
    return {**{c: "float64" for c in numeric}, **{c: "category" for c in categorical}}


def _parse_error(path: Path | str, exc: Exception) -> DataError:
    """A DataError for a file that was verified but still failed to parse."""
    reason = " ".join(str(exc).split())[:200]
    return DataError(f"cannot parse {path}: {reason}; delete the file so that it is downloaded again")


def read_adult_file(path: Path | str, *, test: bool = False) -> pd.DataFrame:
    """One Adult file (adult.data, or adult.test with `test=True`: its first line is no record, its labels end
    in '.', stripped) with rows containing '?' dropped."""
    try:
        frame = pd.read_csv(path, header=None, names=ADULT_COLUMNS, sep=",", skipinitialspace=True, na_values="?",
                            keep_default_na=False, skiprows=1 if test else 0,
                            dtype=_dtypes(ADULT_NUMERIC, ADULT_CATEGORICAL + ["income"]))
    except (ValueError, pd.errors.ParserError) as exc:
        raise _parse_error(path, exc) from exc
    frame = frame.dropna().reset_index(drop=True)
    if test:
        frame["income"] = frame["income"].cat.rename_categories(lambda s: s.rstrip("."))
    return frame


def read_adult(data_path: Path | str, test_path: Path | str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, test) Adult frames without missing values: 30,162 and 15,060 records."""
    return read_adult_file(data_path), read_adult_file(test_path, test=True)


def read_bank(zip_path: Path | str) -> pd.DataFrame:
    """bank-additional-full.csv (41,188 records), read by member name from bank-additional.zip."""
    try:
        with zipfile.ZipFile(zip_path) as archive, archive.open(BANK_MEMBER) as fh:
            return pd.read_csv(fh, sep=";", dtype=_dtypes(BANK_NUMERIC, BANK_CATEGORICAL + ["y"]),
                               keep_default_na=False)
    except (KeyError, zipfile.BadZipFile, ValueError, pd.errors.ParserError) as exc:
        raise _parse_error(zip_path, exc) from exc


def read_kddcup99(path: Path | str) -> pd.DataFrame:
    """A KDD Cup 99 gzip file (42 fields, label like 'normal.' or 'smurf.'), no header."""
    try:
        return pd.read_csv(path, header=None, names=KDD_COLUMNS, compression="gzip",
                           dtype=_dtypes(KDD_NUMERIC, KDD_CATEGORICAL + ["label"]), keep_default_na=False)
    except (OSError, ValueError, pd.errors.ParserError) as exc:
        raise _parse_error(path, exc) from exc


_IDX_DTYPES: dict[int, DTypeLike] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path | str) -> np.ndarray:
    """A gzip IDX file (MNIST format: big-endian header, magic 0 0 <type> <ndim>) as an ndarray."""
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise _parse_error(path, exc) from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"cannot parse {path}: not an IDX file (bad magic); delete it so it is downloaded again")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"cannot parse {path}: {len(raw)} bytes but header {shape} needs {expected}; "
                        "delete it so it is downloaded again")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def read_mnist(images_path: Path | str, labels_path: Path | str) -> tuple[np.ndarray, np.ndarray]:
    """(images (n, 784) uint8, labels (n,) uint8) from a pair of MNIST IDX files."""
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"MNIST files disagree: {images_path} has {images.shape[0]} images but "
                        f"{labels_path} has {labels.shape[0]} labels; delete both so they are downloaded again")
    return images.reshape(images.shape[0], -1), labels
