"""Datasets of `dpsgd`: registry, download cache (pooch, sha256-verified), parsers and preprocessing
(docs/datasets.md)."""

from dpsgd_cli.data.download import cache_dir, fetch, fetch_file
from dpsgd_cli.data.files import FileDatasetSpec, file_dataset_info, file_spec
from dpsgd_cli.data.info import dataset_info, list_datasets
from dpsgd_cli.data.load import PREPROCESSING_VERSION, load_dataset, processed_path, resolve_spec
from dpsgd_cli.data.readers import read_adult, read_bank, read_idx, read_kddcup99, read_mnist
from dpsgd_cli.data.registry import REGISTRY, dataset_names, get_entry
from dpsgd_cli.data.spec import Dataset, DatasetSpec, validation_split, with_validation
from dpsgd_cli.data.synthetic import make_synthetic

__all__ = [
    "PREPROCESSING_VERSION", "REGISTRY", "Dataset", "DatasetSpec", "FileDatasetSpec", "cache_dir", "dataset_info",
    "dataset_names", "fetch", "fetch_file", "file_dataset_info", "file_spec", "get_entry", "list_datasets",
    "load_dataset", "make_synthetic", "processed_path", "read_adult", "read_bank", "read_idx", "read_kddcup99",
    "read_mnist", "resolve_spec", "validation_split", "with_validation",
]
