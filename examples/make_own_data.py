"""Write the small synthetic files of docs/datasets.md, "Your own data" (nothing real): data/credit.csv,
data/a9a.libsvm + data/a9a.t.libsvm, data/records.parquet (needs pyarrow: pip install -e '.[parquet]').

    python examples/make_own_data.py [FOLDER]     # default: examples/data

Each file holds a noisy linear rule, so logistic regression learns something; a few values are missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import dump_svmlight_file


def credit(rng: np.random.Generator, n: int = 600) -> pd.DataFrame:
    """A credit table: numeric and text columns, label default in {yes, no}, 2% of incomes missing."""
    age = rng.integers(19, 75, n)
    income = np.round(rng.lognormal(10.3, 0.5, n), 2)
    housing = rng.choice(["own", "rent", "free"], n, p=[0.5, 0.4, 0.1])
    purpose = rng.choice(["car", "education", "furniture", "business"], n)
    score = -0.04 * (age - 45) - 0.8 * (np.log(income) - 10.3) + 0.9 * (housing == "rent") + rng.normal(0, 1, n)
    frame = pd.DataFrame({"age": age, "income": income, "housing": housing, "purpose": purpose,
                          "default": np.where(score > 0.6, "yes", "no")})
    frame.loc[rng.choice(n, n // 50, replace=False), "income"] = np.nan
    return frame


def a9a_like(rng: np.random.Generator, n: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sparse binary features (as a9a's 123 indicator columns), labels -1/+1 from a linear rule."""
    X = (rng.random((n, w.size)) < 0.1).astype(np.float64)
    return X, np.where(X @ w + rng.normal(0, 0.5, n) > 0, 1, -1)


def records(rng: np.random.Generator, n: int = 500) -> pd.DataFrame:
    """A records table with an identifier column to drop and a 0/1 label y."""
    age = rng.normal(50, 15, n).round(1)
    bmi = rng.normal(27, 4, n).round(1)
    smoker = rng.random(n) < 0.25
    region = rng.choice(["north", "south", "east", "west"], n)
    y = (0.05 * (age - 50) + 0.15 * (bmi - 27) + 1.2 * smoker + rng.normal(0, 1, n) > 0.3).astype(int)
    return pd.DataFrame({"patient_id": [f"P{i:05d}" for i in range(n)], "age": age, "bmi": bmi,
                         "smoker": smoker, "region": region, "y": y})


def main(folder: Path) -> None:
    rng = np.random.default_rng(2024)
    folder.mkdir(parents=True, exist_ok=True)
    credit(rng).to_csv(folder / "credit.csv", index=False)
    w = rng.normal(0, 1, 123)
    for name, n in (("a9a.libsvm", 800), ("a9a.t.libsvm", 200)):
        X, y = a9a_like(rng, n, w)
        dump_svmlight_file(X, y, str(folder / name), zero_based=False)  # LIBSVM's 1-based indices
    try:
        records(rng).to_parquet(folder / "records.parquet", index=False)
    except ImportError:
        sys.exit("records.parquet needs pyarrow: pip install -e '.[parquet]'")
    print(f"wrote {', '.join(sorted(p.name for p in folder.iterdir()))} in {folder}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data")
