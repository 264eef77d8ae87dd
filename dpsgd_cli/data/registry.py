"""What `dpsgd` knows about each dataset: files, checksums, sources, licences, record counts."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from dpsgd_cli.errors import DataError

UCI_ML = "https://archive.ics.uci.edu/ml/machine-learning-databases"
UCI_KDD = "http://kdd.ics.uci.edu/databases/kddcup99"
MNIST_S3 = "https://ossci-datasets.s3.amazonaws.com/mnist"


@dataclass(frozen=True)
class RemoteFile:
    """One raw file: its canonical URL, published sha256, size in bytes and raw record count."""

    name: str
    url: str
    sha256: str
    size: int
    records: int
    description: str


class SpecDefaults(TypedDict, total=False):
    """What a dataset's `DatasetSpec` fields left at None resolve to (fields of the same name and type)."""

    split: Literal["official", "random", "none"]
    standardize: bool
    subsample: int | None
    positive_digit: int
    n: int
    dim: int


@dataclass(frozen=True)
class DatasetEntry:
    """A dataset of the registry; `records` counts usable records after cleaning (Adult: rows with '?' removed)."""

    name: str
    description: str
    source: str
    licence: str
    files: tuple[RemoteFile, ...]
    records: dict[str, int]
    official_split: bool
    defaults: SpecDefaults
    notes: str = ""
    reference: str = ""
    # columns after encoding with one-hot (the most any option gives), before projection: sizes memory estimates
    features: int = 0
    # files read by the default (and official) split; see `files_for_split`
    official_only: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_records(self) -> int:
        """Usable records in the default configuration (train + test)."""
        return self.records["total"]

    def file(self, name: str) -> RemoteFile:
        """The registry file called `name` (DataError naming the valid ones otherwise)."""
        for f in self.files:
            if f.name == name:
                return f
        valid = ", ".join(f.name for f in self.files) or "none"
        raise DataError(f"dataset '{self.name}' has no file '{name}'; its files are: {valid}")


ADULT = DatasetEntry(
    name="adult", licence="CC BY 4.0",
    description="UCI Adult / Census Income: predict income >50K from 14 census attributes",
    source="https://archive.ics.uci.edu/dataset/2/adult",
    files=(
        RemoteFile("adult.data", f"{UCI_ML}/adult/adult.data",
                   "5b00264637dbfec36bdeaab5676b0b309ff9eb788d63554ca0a249491c86603d", 3974305, 32561,
                   "training records (official train split)"),
        RemoteFile("adult.test", f"{UCI_ML}/adult/adult.test",
                   "a2a9044bc167a35b2361efbabec64e89d69ce82d9790d2980119aac5fd7e9c05", 2003153, 16281,
                   "test records (official test split); first line is not a record, labels end with '.'"),
    ),
    records={"train": 30162, "test": 15060, "total": 45222}, features=104, official_split=True,
    defaults={"split": "official", "standardize": True},
    notes=("rows with any missing value ('?') dropped; label +1 for '>50K'; all 14 attributes kept "
           "(fnlwgt included); 8 categorical attributes one-hot, 6 numeric standardised"),
    reference="Chaudhuri, Monteleoni & Sarwate, Differentially private empirical risk minimization, JMLR 2011",
)

BANK = DatasetEntry(
    name="bank", licence="CC BY 4.0",
    description="UCI Bank Marketing (bank-additional-full): predict term-deposit subscription",
    source="https://archive.ics.uci.edu/dataset/222/bank+marketing",
    files=(
        RemoteFile("bank-additional.zip", f"{UCI_ML}/00222/bank-additional.zip",
                   "a607b5edab6c6c75ce09c39142a77702c38123bd5aa7ae89a63503bbe17d65cd", 444572, 41188,
                   "archive; member bank-additional/bank-additional-full.csv is read"),
    ),
    records={"total": 41188}, features=63, official_split=False,
    defaults={"split": "random", "standardize": True},
    notes=("label +1 for y='yes'; 'unknown' kept as a category; 10 categorical columns one-hot, "
           "10 numeric standardised; `duration` is kept although it leaks the label (known after the call)"),
)

KDDCUP99 = DatasetEntry(
    name="kddcup99", licence="public / CC BY 4.0",
    description="KDD Cup 1999 intrusion detection (10% training set): attack vs normal connection",
    source="http://kdd.ics.uci.edu/databases/kddcup99/kddcup99.html",
    files=(
        RemoteFile("kddcup.data_10_percent.gz", f"{UCI_KDD}/kddcup.data_10_percent.gz",
                   "8045aca0d84e70e622d1148d7df782496f6333bf6eb979a1b0837c42a9fd9561", 2144903, 494021,
                   "10% training set (the pool of the default random split)"),
        RemoteFile("corrected.gz", f"{UCI_KDD}/corrected.gz",
                   "abd8165508378859b07e38537271f0ebf8a4d7319f643188cd7361e939a05c43", 1409035, 311029,
                   "labelled test set, used only with split: official"),
    ),
    records={"total": 494021, "official_test": 311029}, features=119, official_split=True,
    defaults={"split": "random", "subsample": None, "standardize": True},
    notes=("label +1 for any attack, -1 for 'normal.'; protocol_type, service, flag one-hot, 38 numeric "
           "standardised; papers use subsamples such as 70,000 or 50,000 records (subsample: N); "
           "licence: public data of the UCI KDD Archive, CC BY 4.0 on its UCI ML Repository page (dataset 130)"),
    reference="Song, Chaudhuri & Sarwate, SGD with differentially private updates, GlobalSIP 2013",
    official_only=("corrected.gz",),
)

MNIST = DatasetEntry(
    name="mnist", licence="CC BY-SA 3.0",
    description="MNIST handwritten digits, one-vs-all binary task (positive_digit vs rest)",
    source="http://yann.lecun.com/exdb/mnist/",
    files=(
        RemoteFile("train-images-idx3-ubyte.gz", f"{MNIST_S3}/train-images-idx3-ubyte.gz",
                   "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609", 9912422, 60000,
                   "training images, 28x28 uint8"),
        RemoteFile("train-labels-idx1-ubyte.gz", f"{MNIST_S3}/train-labels-idx1-ubyte.gz",
                   "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c", 28881, 60000, "training labels"),
        RemoteFile("t10k-images-idx3-ubyte.gz", f"{MNIST_S3}/t10k-images-idx3-ubyte.gz",
                   "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6", 1648877, 10000,
                   "test images, 28x28 uint8"),
        RemoteFile("t10k-labels-idx1-ubyte.gz", f"{MNIST_S3}/t10k-labels-idx1-ubyte.gz",
                   "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6", 4542, 10000, "test labels"),
    ),
    records={"train": 60000, "test": 10000, "total": 70000}, features=784, official_split=True,
    defaults={"split": "official", "positive_digit": 1, "standardize": False},
    notes=("pixels / 255 (784 features); label +1 for positive_digit; standardize is off by default (it would "
           "blow up nearly blank pixels); standardize: true rescales the pixels that are not constant in train"),
)

SYNTHETIC = DatasetEntry(
    name="synthetic", licence="n/a",
    description="points uniform on the unit sphere labelled by a random hyperplane through the origin",
    source="generated locally (no download)",
    files=(),
    records={"total": 10000}, features=5, official_split=False,
    defaults={"split": "random", "n": 10000, "dim": 5, "standardize": False},
    notes="points with margin |w.x| < 0.001 are redrawn; standardize is ignored (rows already unit norm)",
    reference="Song, Chaudhuri & Sarwate, SGD with differentially private updates, GlobalSIP 2013",
)

REGISTRY: dict[str, DatasetEntry] = {e.name: e for e in (ADULT, BANK, KDDCUP99, MNIST, SYNTHETIC)}


def dataset_names() -> list[str]:
    """Names of all registered datasets, in registry order."""
    return list(REGISTRY)


def get_entry(name: str) -> DatasetEntry:
    """The registry entry of `name`; an unknown name raises DataError with the closest valid one."""
    try:
        return REGISTRY[name]
    except KeyError:
        pass
    close = difflib.get_close_matches(str(name).lower(), REGISTRY, n=1, cutoff=0.4)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise DataError(f"unknown dataset '{name}': {hint}valid names are {', '.join(REGISTRY)}, "
                    f"or file (a data file of your own: {{name: file, path: ...}} in a grid, `dpsgd datasets info "
                    f"--path FILE` to preview it)")


def files_for_split(entry: DatasetEntry, split: str | None) -> tuple[RemoteFile, ...]:
    """The files a load with `split` reads (kddcup99 reads corrected.gz only for split 'official')."""
    if split == "official":
        return entry.files
    return tuple(f for f in entry.files if f.name not in entry.official_only)
