"""The results folder of a grid: `runs.csv` (one row per run, appended as runs finish) and `manifest.json`."""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

COLUMNS = [
    "run_id", "cell_id", "grid", "dataset", "dataset_options", "n_train", "n_test", "d",
    "model", "model_options", "algorithm", "algorithm_params", "seed",
    "epsilon", "epsilon_achieved", "delta", "accountant", "accountant_library", "sigma",
    "batch_size", "lr", "epochs", "steps", "sample_rate", "l2", "clip_norm",
    "test_accuracy", "test_loss", "train_accuracy", "train_objective", "optimal_objective", "optimality_gap",
    "guarantee", "noiseless_fraction", "delta_certified", "derived", "wall_time", "status", "message", "version", "dtype",
]
TRACE_COLUMNS = ["run_id", "cell_id", "seed", "examples", "train_objective", "optimality_gap", "train_accuracy"]
LIBRARIES = ["dpsgd", "numpy", "scipy", "pandas", "scikit-learn", "dp-accounting", "pydantic", "joblib"]


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


class ResultStore:
    """Append-only CSV of finished runs. Runs with status `ok` or `diverged` are final (diverging is a
    deterministic result); `failed` runs are dropped when a grid resumes, so they are tried again."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.csv = self.folder / "runs.csv"
        self.traces_csv = self.folder / "traces.csv"

    def read(self) -> pd.DataFrame:
        if not self.csv.exists() or self.csv.stat().st_size == 0:
            return pd.DataFrame(columns=COLUMNS)
        return pd.read_csv(self.csv, dtype={"run_id": str, "cell_id": str})

    def start(self, resume: bool) -> set[str]:
        """Prepare the folder; return the run ids already final. Without resume, the old CSV is kept as a backup."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not resume:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            for path in (self.csv, self.traces_csv):
                if path.exists():
                    shutil.move(path, path.with_name(f"{path.stem}.{stamp}.csv.bak"))
        frame = self.read()
        final = frame[frame["status"].isin(["ok", "diverged"])]
        if len(final) < len(frame):  # rewrite without the failed rows, atomically
            self._write(final.drop_duplicates("run_id", keep="last"))
        done = set(final["run_id"].astype(str))
        traces = self.read_traces()
        if len(traces) and not traces["run_id"].isin(done).all():  # checkpoints of runs that never finished
            _write_csv(self.traces_csv, traces[traces["run_id"].isin(done)], TRACE_COLUMNS)
        return done

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        _append_csv(self.csv, rows, COLUMNS)

    def append_traces(self, rows: Iterable[dict[str, Any]]) -> None:
        _append_csv(self.traces_csv, rows, TRACE_COLUMNS)

    def read_traces(self) -> pd.DataFrame:
        if not self.traces_csv.exists():
            return pd.DataFrame(columns=TRACE_COLUMNS)
        return pd.read_csv(self.traces_csv, dtype={"run_id": str, "cell_id": str})

    def _write(self, frame: pd.DataFrame) -> None:
        _write_csv(self.csv, frame, COLUMNS)

    def write_manifest(self, grid: dict[str, Any], grid_hash: str, started: float, finished: float | None,
                       **extra: Any) -> None:
        manifest = {
            "grid": grid,
            "grid_hash": grid_hash,
            "started": _iso(started),
            "finished": _iso(finished) if finished else None,
            "libraries": library_versions(),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
            **extra,
        }
        tmp = self.folder / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, default=str))
        os.replace(tmp, self.folder / "manifest.json")


def _append_csv(path: Path, rows: Iterable[dict[str, Any]], columns: list[str]) -> None:
    rows = list(rows)
    if not rows:
        return
    if path.exists() and path.stat().st_size:
        with open(path) as fh:
            existing = fh.readline().rstrip("\r\n").split(",")
        if existing != columns:  # written by an older version with other columns: rewrite it once
            _write_csv(path, pd.read_csv(path, dtype={"run_id": str, "cell_id": str}), columns)
    header = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as fh:
        pd.DataFrame(rows).reindex(columns=columns).to_csv(fh, header=header, index=False)
        fh.flush()
        os.fsync(fh.fileno())


def _write_csv(path: Path, frame: pd.DataFrame, columns: list[str]) -> None:
    """Replace `path` atomically (a crash leaves the old or the new file, never half of one)."""
    tmp = path.with_suffix(".csv.tmp")
    frame.reindex(columns=columns).to_csv(tmp, index=False)
    os.replace(tmp, path)


def _iso(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat(timespec="seconds")


def now() -> float:
    return time.time()
