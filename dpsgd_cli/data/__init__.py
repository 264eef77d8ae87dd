"""Datasets of `dpsgd`: registry, download cache (pooch, sha256-verified), parsers and preprocessing.

Public API::

    load_dataset(spec: DatasetSpec, *, cache: bool = True) -> Dataset
    resolve_spec(spec: DatasetSpec) -> DatasetSpec
    fetch(name: str) -> list[Path]
    fetch_file(dataset: str, filename: str) -> Path
    list_datasets() -> list[dict]
    dataset_info(name: str) -> dict
    cache_dir() -> Path
    make_synthetic(n=10_000, dim=5, seed=0, margin=1e-3) -> (X, y, w)
    FileDatasetSpec, file_spec(options) -> FileDatasetSpec, file_dataset_info(spec) -> dict
        a local CSV/TSV, Parquet, LIBSVM or .npz file as a dataset (`{name: file, path: ...}`), see `files`

Defaults per dataset (fields of DatasetSpec left at None), see `dataset_info(name)["defaults"]`:
adult split=official; bank split=random; kddcup99 split=random, no subsample; mnist
split=official, positive_digit=1, standardize=false; synthetic split=random, n=10000, dim=5. All others:
standardize=true. All: one_hot,
unit_ball=row, test_fraction=0.2, seed=0. Choices are documented in `dpsgd_cli.data.load`.

Environment: DPSGD_DATA_DIR (cache root, default ./datasets), DPSGD_DATA_MIRROR (base URL or
folder serving <dataset>/<file>, used instead of the canonical URLs).
"""

from dpsgd_cli.data.download import cache_dir, fetch, fetch_file
from dpsgd_cli.data.files import FileDatasetSpec, file_dataset_info, file_spec
from dpsgd_cli.data.info import dataset_info, list_datasets
from dpsgd_cli.data.load import PREPROCESSING_VERSION, load_dataset, processed_path, resolve_spec
from dpsgd_cli.data.readers import read_adult, read_bank, read_idx, read_kddcup99, read_mnist
from dpsgd_cli.data.registry import REGISTRY, dataset_names, get_entry
from dpsgd_cli.data.spec import Dataset, DatasetSpec, validation_split, with_validation
from dpsgd_cli.data.synthetic import make_synthetic

__all__ = [
    "PREPROCESSING_VERSION",
    "REGISTRY",
    "Dataset",
    "DatasetSpec",
    "FileDatasetSpec",
    "cache_dir",
    "dataset_info",
    "dataset_names",
    "fetch",
    "fetch_file",
    "file_dataset_info",
    "file_spec",
    "get_entry",
    "list_datasets",
    "load_dataset",
    "make_synthetic",
    "processed_path",
    "read_adult",
    "read_bank",
    "read_idx",
    "read_kddcup99",
    "read_mnist",
    "resolve_spec",
    "validation_split",
    "with_validation",
]
