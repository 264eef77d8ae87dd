"""The results folder of a grid: runs.csv, traces.csv, manifest.json and the writer's lock; crash-safe appends
and verbatim rewrites (docs/results.md#robustness-of-the-results-folder)."""

from __future__ import annotations

import codecs
import contextlib
import csv
import fcntl
import functools
import io
import json
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpsgd_cli import NUMERICS
from dpsgd_cli.engine.folder import (
    append_bytes,
    check_folder,
    check_in_place,
    ends_with_newline,
    first_line,
    make_folder,
    open_file,
    read_bytes,
    read_text,
    write_text,
)
from dpsgd_cli.errors import UserError, file_error

COLUMNS = [
    "run_id", "cell_id", "grid", "dataset", "dataset_options", "n_train", "n_test", "d",
    "model", "model_options", "algorithm", "algorithm_params", "seed",
    "epsilon", "epsilon_achieved", "delta", "accountant", "accountant_library", "sigma",
    "batch_size", "lr", "epochs", "steps", "sample_rate", "l2", "clip_norm",
    "test_accuracy", "test_loss", "train_accuracy", "train_objective", "optimal_objective", "optimality_gap",
    "guarantee", "noiseless_fraction", "derived", "wall_time", "status", "message", "version", "dtype",
    "n_val", "val_accuracy", "val_objective", "epsilon_base", "tuning", "delta_certified", "neighbours", "numerics",
    "plugin", "plugin_sha256", "tpr_bound_fpr_1e-2", "tpr_bound_fpr_1e-3", "gdp_mu", "tpr_bound_from",
]
TRACE_COLUMNS = ["run_id", "cell_id", "seed", "examples", "train_objective", "optimality_gap", "train_accuracy"]
# the columns every version of the tool wrote: a file without them is not a results file
RUN_KEYS = ["run_id", "cell_id", "grid", "dataset", "model", "algorithm", "algorithm_params", "seed", "epsilon",
            "status", "message"]
TRACE_KEYS = ["run_id", "cell_id", "seed", "examples"]
NUMERIC = {
    "n_train", "n_test", "d", "seed", "epsilon", "epsilon_achieved", "delta", "sigma", "batch_size", "lr", "epochs",
    "steps", "sample_rate", "l2", "clip_norm", "test_accuracy", "test_loss", "train_accuracy", "train_objective",
    "optimal_objective", "optimality_gap", "noiseless_fraction", "wall_time", "examples", "delta_certified", "numerics",
    "n_val", "val_accuracy", "val_objective", "epsilon_base", "tpr_bound_fpr_1e-2", "tpr_bound_fpr_1e-3", "gdp_mu",
}
OPTION_COLUMNS = ["dataset_options", "model_options", "algorithm_params", "derived"]  # JSON objects in runs.csv
STATUSES = {"ok", "diverged", "failed"}
FINAL = ("ok", "diverged")  # final results; `failed` runs are tried again when the grid resumes
LIBRARIES = ["dpsgd", "numpy", "scipy", "pandas", "scikit-learn", "dp-accounting", "pydantic", "joblib"]
LOCK_NAME = "runs.lock"


def result_folders(path: str | Path) -> list[Path]:
    """`path` itself if it holds runs.csv, else its sub-folders that do (a results root), each checked."""
    path = Path(path)
    if os.path.lexists(path / "runs.csv"):
        return [check_folder(path)]
    folders = sorted(p.parent for p in path.glob("*/runs.csv"))
    if not folders:
        raise NoResults(f"{path}: no runs.csv here or in its sub-folders; run `dpsgd run GRID.yaml` first or pass "
                        f"a grid's results folder (e.g. results/smoke)")
    return [check_folder(folder) for folder in folders]


class NoResults(UserError):
    """No grid's results where some were expected (a folder with only an audit, or nothing)."""


class ResultsWriteError(UserError):
    """The results folder could not be written (disk full, read-only, ...): the message says what is saved."""


class FolderLocked(UserError):
    """Another process is writing the results folder."""


def note(message: str) -> None:
    """One line on stderr for something the user should know but that is not an error."""
    print(f"note: {message}", file=sys.stderr)


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


# --- reading a CSV line by line ----------------------------------------------------------------------------
@dataclass
class CsvScan:
    """A results CSV split into its header, valid rows (text and fields), malformed lines and a cut last line."""

    header: list[str] = field(default_factory=list)
    header_text: str = ""
    rows: list[list[str]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # raw text of each valid row, ending in "\n"
    bad: list[str] = field(default_factory=list)
    partial: bytes = b""

    def frame(self) -> pd.DataFrame:
        """The valid rows as pandas reads them (numbers parsed back exactly)."""
        if not self.header:
            return pd.DataFrame()
        text = self.header_text + "".join(self.lines)
        strings = {c: str for c in ("run_id", "cell_id", "grid", "status", "message") if c in self.header}
        return pd.read_csv(io.StringIO(text), dtype=strings)


def scan_csv(path: Path, keys: Iterable[str] = ("run_id",)) -> CsvScan:
    """Read a results CSV tolerantly (a missing file is an empty scan); a header without `keys` is a UserError."""
    path = Path(path)
    try:
        data = read_bytes(path)
    except FileNotFoundError:
        return CsvScan()
    data = data.removeprefix(codecs.BOM_UTF8)
    cut = data.rfind(b"\n") + 1
    scan = CsvScan(partial=data[cut:])
    records, raws = _records([p + "\n" for p in data[:cut].decode("utf-8", errors="surrogateescape").split("\n")[:-1]])
    if not records:
        return scan
    scan.header, scan.header_text = records[0], raws[0]
    missing = [c for c in keys if c not in scan.header]
    problem = ("bytes that are not UTF-8" if any("\udc80" <= ch <= "\udcff" for ch in scan.header_text) else
               f"no column {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}" if missing else
               "a column twice" if len(set(scan.header)) < len(scan.header) else "")
    if problem:
        raise UserError(f"{path}: the first line is not a results header ({problem}); move the file away and rerun")
    valid = _valid(records[1:], raws[1:], scan.header)
    scan.rows = [r for r, ok in zip(records[1:], valid) if ok]
    scan.lines = [r for r, ok in zip(raws[1:], valid) if ok]
    scan.bad = [r for r, ok in zip(raws[1:], valid) if not ok]
    return scan


def _records(pieces: list[str]) -> tuple[list[list[str]], list[str]]:
    """The CSV records of the lines and the raw text of each (a quoted field may span lines)."""
    try:
        records = list(csv.reader(pieces))
        if len(records) == len(pieces):  # one record per line: the common case
            return records, pieces
    except csv.Error:
        pass
    records, raws, used = [], [], 0
    while used < len(pieces):
        reader, start = csv.reader(iter(pieces[used:])), used
        try:
            for fields in reader:
                records.append(fields)
                raws.append("".join(pieces[used:start + reader.line_num]))
                used = start + reader.line_num
        except csv.Error:
            # one bad record, the lines the reader took for it: a field beyond csv's size limit (a received file
            # may hold anything) is its own line, the next lines are read again; an unbalanced quote took them all
            end = max(start + reader.line_num, used + 1)
            records.append([])
            raws.append("".join(pieces[used:end]))
            used = end
    return records, raws


def _valid(records: list[list[str]], raws: list[str], header: list[str]) -> np.ndarray:
    """Per record, whether it is a valid row (column-wise: traces.csv can have 10⁵ rows)."""
    valid = np.fromiter((len(r) == len(header) for r in records), bool, len(records))
    complete = [r for r, ok in zip(records, valid) if ok]
    if complete:
        columns = dict(zip(header, map(np.array, zip(*complete))))
        ok = columns["run_id"] != ""
        if "status" in columns:
            ok &= np.isin(columns["status"], sorted(STATUSES))
        for column in NUMERIC.intersection(header):
            ok &= _numbers(columns[column])
        for column in set(OPTION_COLUMNS).intersection(header):
            ok &= [json_object(cell) is not None for cell in columns[column]]
        valid[np.flatnonzero(valid)] = ok
    if not all(map(str.isascii, raws)):  # bytes that were not UTF-8 were decoded to lone surrogates
        valid &= [not any("\udc80" <= ch <= "\udcff" for ch in raw) for raw in raws]
    return valid


def _numbers(cells: np.ndarray) -> np.ndarray:
    """Whether each cell is empty or a number as Python's float() reads it ("nan" and "inf" included)."""
    try:
        np.where(cells == "", "nan", cells).astype(float)
        return np.ones(len(cells), bool)
    except ValueError:
        return np.array([cell == "" or _is_float(cell) for cell in cells], dtype=bool)


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# --- writing ------------------------------------------------------------------------------------------------
def _text(value: Any) -> str:
    """A cell: numbers with repr precision (they read back bit-identical), NaN/None empty, one line."""
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return "" if number != number else repr(number)
    return " ".join(str(value).splitlines())  # a row is one line: a newline only ever ends a row


def _csv_lines(rows: Iterable[list[str]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


def _set_aside(path: Path, lines: list[str], partial: bytes) -> Path:
    side = path.with_name(path.name + ".rejected")
    data = "".join(lines).encode("utf-8", errors="surrogateescape") + (partial + b"\n" if partial else b"")
    append_bytes(side, data)
    return side


_FRAMES: dict[tuple[Any, ...], pd.DataFrame] = {}


class CsvFile:
    """An append-only results CSV (runs.csv or traces.csv) with crash recovery."""

    def __init__(self, path: Path, columns: list[str], keys: list[str]):
        self.path = Path(path)
        self.columns = columns
        self.keys = keys  # the columns without which it is not a results file

    def read(self) -> pd.DataFrame:
        """The valid rows (cached while the file is unchanged: figures and claims read it many times)."""
        stamp = _stamp(self.path)
        if stamp[0] is None:
            return pd.DataFrame(columns=self.columns)
        key = (str(self.path.resolve()), *stamp)
        if key not in _FRAMES:
            frame = scan_csv(self.path, self.keys).frame()
            _FRAMES.clear()  # one file at a time is enough
            _FRAMES[key] = frame if len(frame.columns) else pd.DataFrame(columns=self.columns)
        return _FRAMES[key].copy()

    def recover(self, keep: Callable[[dict[str, str]], bool] | None = None) -> list[dict[str, str]]:
        """Writers only (under the lock): set aside cut and malformed lines, add missing columns, drop the rows
        `keep` rejects; rewrite only if something changed. Returns the kept rows (as text)."""
        scan = scan_csv(self.path, self.keys)
        if not scan.header_text:  # missing, empty, or only a cut header
            if scan.partial or scan.bad:
                side = _set_aside(self.path, scan.bad, scan.partial)
                self.path.unlink()
                note(f"{self.path}: had no complete header (cut mid-write); moved its content to {side}")
            return []
        missing = [c for c in self.columns if c not in scan.header]  # written by an older version
        header = self.columns + [c for c in scan.header if c not in self.columns] if missing else scan.header
        records = [dict(zip(scan.header, row)) for row in scan.rows]
        kept = [i for i, r in enumerate(records) if keep is None or keep(r)]
        if not scan.partial and not scan.bad and header == scan.header and len(kept) == len(records):
            return records
        if scan.partial or scan.bad:
            side = _set_aside(self.path, scan.bad, scan.partial)
            what = [f"{len(scan.bad)} malformed row(s)"] if scan.bad else []
            what += [f"an incomplete last row ({len(scan.partial)} bytes, cut mid-write)"] if scan.partial else []
            note(f"{self.path}: moved {' and '.join(what)} to {side}; those runs will be redone")
        if header == scan.header:
            body = "".join(scan.lines[i] for i in kept)  # verbatim
        else:
            body = _csv_lines([records[i].get(c, "") for c in header] for i in kept)
        write_text(self.path, _csv_lines([header]) + body)
        return [records[i] for i in kept]

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        rows = list(rows)
        if not rows:
            return
        header = self._header()
        if header is None or not set(self.columns) <= set(header) or not ends_with_newline(self.path):
            self.recover()
            header = self._header()
        text = "" if header else _csv_lines([self.columns])
        header = header or self.columns
        text += _csv_lines([_text(row.get(c)) for c in header] for row in rows)
        append_bytes(self.path, text.encode("utf-8", errors="surrogateescape"))

    def _header(self) -> list[str] | None:
        first = first_line(self.path)
        return next(csv.reader([first])) if first and first.endswith("\n") else None


# --- the lock -----------------------------------------------------------------------------------------------
_HELD: dict[str, int] = {}  # folder → fd of its lock file, for the folders this process writes


def acquire_lock(folder: Path) -> None:
    """Take the folder's writer lock (an flock on `runs.lock`: never stale); FolderLocked naming another holder."""
    key = os.path.realpath(folder)
    if key in _HELD:
        return
    # not through a link, and a regular file with no other hard link: the holder's line truncates it
    fd = open_file(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, in_place=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()
                  or "a process (details not yet written)")
        os.close(fd)
        raise FolderLocked(f"{folder}: another dpsgd process is writing this results folder: {holder}; wait for "
                           f"it to finish (or stop it), or use another --out") from None
    except OSError:
        os.close(fd)
        raise
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    command = " ".join(["dpsgd", *sys.argv[1:]])[:300]
    info = f"pid {os.getpid()} on host {socket.gethostname()} since {started} ({command})\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    _HELD[key] = fd


def release_lock(folder: Path) -> None:
    fd = _HELD.pop(os.path.realpath(folder), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor releases the flock


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """The folder's writer lock for a block (kept if this process held it already)."""
    held = os.path.realpath(folder) in _HELD
    acquire_lock(folder)
    try:
        yield
    finally:
        if not held:
            release_lock(folder)


# --- the store ----------------------------------------------------------------------------------------------
class ResultStore:
    """Append-only CSV of finished runs; `failed` runs are dropped when a grid resumes, so they are tried again."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.csv = self.folder / "runs.csv"
        self.traces_csv = self.folder / "traces.csv"
        self.runs_file = CsvFile(self.csv, COLUMNS, RUN_KEYS)
        self.traces_file = CsvFile(self.traces_csv, TRACE_COLUMNS, TRACE_KEYS)

    def read(self) -> pd.DataFrame:
        """The valid rows of runs.csv, every status."""
        return self.runs_file.read()

    def read_traces(self) -> pd.DataFrame:
        return self.traces_file.read()

    def start(self, resume: bool, plugins: dict[str, str | None] | None = None) -> set[str]:
        """Take the folder's lock, recover the files from any crash; the run ids already final. `plugins`: see
        `check_plugins`."""
        try:
            make_folder(check_folder(self.folder))
            acquire_lock(self.folder)
            for path in (self.csv, self.traces_csv):  # appended to after each task: refused before the first
                check_in_place(path)
            if not resume:
                stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
                for path in (self.csv, self.traces_csv):
                    if path.exists():
                        os.replace(path, path.with_name(f"{path.stem}.{stamp}.csv.bak"))
            seen: set[str] = set()

            def first_final(row: dict[str, str]) -> bool:  # a run id counts once (the first final row)
                if row.get("status") not in FINAL or row["run_id"] in seen:
                    return False
                seen.add(row["run_id"])
                return True

            final = self.runs_file.recover(keep=first_final)
            check_numerics(self.csv, final)
            check_plugins(self.csv, final, plugins or {})
            done = {row["run_id"] for row in final}
            # checkpoints of runs that never finished go, so that a run in runs.csv has exactly its traces
            self.traces_file.recover(keep=lambda row: row["run_id"] in done)
        except OSError as exc:
            release_lock(self.folder)
            raise ResultsWriteError(f"{file_error(exc)} (nothing was run and the files there are unchanged; or use "
                                    f"another --out)") from None
        except UserError:
            release_lock(self.folder)
            raise
        return done

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        self.runs_file.append(rows)

    def done(self, plugins: dict[str, str | None] | None = None) -> set[str]:
        """The run ids already final, as `start` finds them, without taking the lock or writing (a dry run)."""
        final = self.read().query("status in ['ok', 'diverged']")
        check_numerics(self.csv, final.to_dict("records"))
        check_plugins(self.csv, final.to_dict("records"), plugins or {})
        return set(final["run_id"].astype(str))

    def append_traces(self, rows: Iterable[dict[str, Any]]) -> None:
        self.traces_file.append(rows)

    def write_manifest(self, grid: dict[str, Any], grid_hash: str, started: float, finished: float | None,
                       **extra: Any) -> None:
        manifest = {"grid": grid, "grid_hash": grid_hash, "numerics": NUMERICS, "started": _iso(started),
                    "finished": _iso(finished) if finished else None, "libraries": dict(library_versions()),
                    "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
                    **extra}
        write_text(self.folder / "manifest.json", json.dumps(manifest, indent=2, default=str))


def check_numerics(csv: Path, final: Iterable[dict[str, Any]]) -> None:
    """A UserError if runs.csv holds final runs of another numerics version (one grid, one version)."""
    other = sorted({_version_text(row.get("numerics")) for row in final} - {str(NUMERICS)})
    if other:
        raise UserError(f"{csv}: holds runs of numerics version {', '.join(other)}, this dpsgd computes version "
                        f"{NUMERICS}; rerun with --no-resume (the old file is kept as a .bak) or use another --out")


def check_plugins(csv: Path, final: Iterable[dict[str, Any]], plugins: dict[str, str | None]) -> None:
    """A UserError if runs.csv holds final runs of an algorithm of `plugins` (name → the SHA-256 of the file that
    defines it now, None for a built-in) made by another version of its file: their run ids are the same, so
    resuming would skip runs this code would compute differently, and mix the two in one grid."""
    for row in final:
        name, sha = row.get("algorithm"), row.get("plugin_sha256")
        sha = sha if isinstance(sha, str) and sha else None  # empty or NaN: a built-in's row
        if name in plugins and sha != plugins[name]:
            then, now = (f"plugin file of SHA-256 {s[:12]}…" if s else "built-in" for s in (sha, plugins[name]))
            raise UserError(f"{csv}: holds runs of {name} made by its {then}, but this {name} is the {now}; rerun "
                            f"with --no-resume (the old file is kept as a .bak) or use another --out")


def _version_text(value: Any) -> str:
    """The numerics version a row records: '1' for rows written before the version was recorded."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or str(value).strip() == "":
        return "1"
    return str(int(float(value))) if _is_float(str(value)) else str(value)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, None if there is none; a corrupt one is a one-line UserError."""
    path = Path(folder) / "manifest.json"
    try:
        manifest = json.loads(read_text(path))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"{path}: corrupt manifest ({exc}); rerun `dpsgd run` on its grid to rewrite it, or "
                        f"delete it (every row of runs.csv then counts)") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("grid", {}), dict):
        raise UserError(f"{path}: corrupt manifest (not an object with a `grid` object); rerun `dpsgd run` on "
                        f"its grid to rewrite it, or delete it")
    problem = _grid_shape(manifest.get("grid", {}))
    if problem:
        raise UserError(f"{path}: corrupt manifest ({problem}); rerun `dpsgd run` on its grid to rewrite it, or "
                        f"delete it")
    return manifest


def _grid_shape(grid: dict[str, Any]) -> str:
    """What is wrong with the parts of a manifest's grid the readers build objects from ('' if nothing)."""
    from pydantic import ValidationError

    from dpsgd_cli.config import ClaimSpec, FigureSpec, SelectSpec

    for key, model in (("figures", FigureSpec), ("claims", ClaimSpec), ("select", SelectSpec)):
        entries = grid.get(key, [])
        if not isinstance(entries, list):
            return f"grid.{key} is a {type(entries).__name__}, not a list"
        for i, entry in enumerate(entries):
            try:
                model(**entry)  # as the readers do
            except TypeError:
                return f"grid.{key}[{i}] is a {type(entry).__name__}, not an object"
            except (ValidationError, UserError, ValueError) as exc:
                errors = exc.errors() if isinstance(exc, ValidationError) else None
                text = (".".join(map(str, errors[0]["loc"])) + ": " + errors[0]["msg"]) if errors else str(exc)
                return f"grid.{key}[{i}]: {' '.join(text.split())}"
    for key, kind in (("seeds", int), ("description", str), ("name", str)):
        if key in grid and not isinstance(grid[key], kind):
            return f"grid.{key} is a {type(grid[key]).__name__}, not a {kind.__name__}"
    return ""


def _iso(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat(timespec="seconds")


def now() -> float:
    return time.time()


# --- the readers: what summary, selection, plots and report take from a results folder ----------------------
def grid_of(folder: Path) -> dict[str, Any]:
    """The grid as recorded in the folder's manifest (its figures, claims and selections included)."""
    manifest = read_manifest(folder)
    return manifest.get("grid", {}) if manifest else {}


def parse_options(options: pd.Series) -> pd.Series:
    """A JSON column of options as dicts ({} for a cell without a JSON object, which a valid row never has)."""
    return options.map(lambda text: json_object(text) or {})


def varying_label(names: pd.Series, options: pd.Series) -> pd.Series:
    """`dp_sgd`, or `dp_sgd accountant=pld`: each name with the options that differ between its rows."""
    parsed = parse_options(options)
    label = names.astype(str).copy()
    for name, rows in parsed.groupby(names, sort=False):
        keys = sorted({k for p in rows for k in p})
        varying = [k for k in keys if len({json.dumps(p.get(k)) for p in rows}) > 1]
        label[rows.index] = str(name) + rows.map(lambda p: "".join(f" {k}={option_text(p.get(k))}" for k in varying))  # noqa: B023
    return label


def option_text(value: Any) -> str:
    """An option's value as a label shows it: `1000`, not `1000.0`; `1e+09`, not `1000000000.0`; unset `—`."""
    if value is None:
        return "—"
    return f"{value:g}" if isinstance(value, float) else str(value)


def with_params(frame: pd.DataFrame) -> pd.DataFrame:
    """The runs with each algorithm parameter as a column of its own (an existing column keeps its values)."""
    params = parse_options(frame["algorithm_params"])
    keys = sorted({k for p in params for k in p} - set(frame.columns))
    return frame.assign(**{k: params.map(lambda p, k=k: p.get(k)) for k in keys}) if keys else frame


def typed_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """The runs as the Python API and `dpsgd export` give them: each JSON column flattened into `<column>.<key>`
    columns of one kind each (for Parquet), and `private` (docs/python-api.md)."""
    from dpsgd_cli.algorithms import ALGORITHMS  # every algorithm module: only when asked for

    known = frame["algorithm"].map(lambda name: ALGORITHMS[name].tags.private if name in ALGORITHMS else None)
    private = known.where(known.notna(), frame["epsilon"].notna()).astype(bool)
    parts = []
    for column in frame.columns:
        if column not in OPTION_COLUMNS:
            parts.append(frame[[column]])
            continue
        objects = frame[column].map(json_object)
        if not objects.map(lambda o: o is not None).all():
            note(f"{column}: {int(objects.isna().sum())} row(s) hold no JSON object; their {column} columns are "
                 f"left empty")
        keys = sorted({key for o in objects if o for key in o})
        parts.append(pd.DataFrame({f"{column}.{key}": _one_kind([(o or {}).get(key) for o in objects], frame.index)
                                   for key in keys}, index=frame.index))
    return pd.concat([*parts, private.rename("private")], axis=1)


def json_object(text: Any) -> dict[str, Any] | None:
    """A JSON column's cell as a dict ({} when empty), None when it is not a JSON object (too deep included)."""
    if not isinstance(text, str) or not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _one_kind(values: list[Any], index: pd.Index) -> pd.Series:
    """Values of one key as one column kind: Int64, float64, boolean, or text (nested values as JSON text)."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pd.Series(values, index=index, dtype="boolean")
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return pd.Series(values, index=index, dtype="Int64")
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pd.Series([np.nan if v is None else float(v) for v in values], index=index, dtype="float64")
    return pd.Series([v if v is None or isinstance(v, str) else json.dumps(v, sort_keys=True) for v in values],
                     index=index)


HYPER = ["batch_size", "lr", "epochs", "l2", "clip_norm"]


def line_labels(frame: pd.DataFrame) -> pd.Series:
    """Algorithm label, plus the hyperparameters that vary among that algorithm's runs."""
    labels = varying_label(frame["algorithm"], frame["algorithm_params"])
    extra = pd.Series("", index=frame.index)
    for col in HYPER:
        varying = frame.groupby(labels)[col].transform(lambda s: s.nunique(dropna=True) > 1)
        extra += frame[col].map(lambda v, c=col: f" {c}={v:g}" if v == v else "").where(varying, "")
    return labels + extra


_COMPARISONS = {">=": "ge", "<=": "le", "!=": "ne", ">": "gt", "<": "lt", "==": "eq"}


def comparison(wanted: object) -> tuple[str, float] | None:
    """(operator, number) of a selection value such as ">=1", None for a plain value; ValueError for ">=one"."""
    if not isinstance(wanted, str):
        return None
    op = next((op for op in _COMPARISONS if wanted.startswith(op)), None)
    if op is None:
        return None
    try:
        return op, float(wanted[len(op):])
    except ValueError:
        raise ValueError(f"{wanted!r} compares with {wanted[len(op):].strip()!r}, which is not a number; "
                         f"write e.g. '{op}1'") from None


def select(frame: pd.DataFrame, selection: dict[str, Any]) -> pd.DataFrame:
    """Rows matching every `column: value` of the selection: a value, a list of values, or a comparison (">=1")."""
    mask = pd.Series(True, index=frame.index)
    for column, wanted in selection.items():
        if column not in frame.columns:
            raise KeyError(f"no column {column!r} in the results (columns: {', '.join(frame.columns)})")
        values = frame[column]
        compare = comparison(wanted)
        if isinstance(wanted, list):
            mask &= values.isin(wanted)
        elif compare is not None:
            mask &= getattr(pd.to_numeric(values, errors="coerce"), _COMPARISONS[compare[0]])(compare[1])
        else:
            mask &= values == wanted
    return frame[mask]


@functools.lru_cache(maxsize=16)
def _grid_run_ids(grid_json: str) -> frozenset[str]:
    from dpsgd_cli.config import Grid, expand  # every algorithm module: only when a manifest is read

    grid = Grid.model_validate(json.loads(grid_json))
    return frozenset(cell.run_id(seed) for cell in expand(grid) for seed in cell.seeds)


def current_run_ids(folder: Path, fallback: pd.Series) -> set[str]:
    """Run ids of the grid as last run (its manifest); without a usable manifest, every row counts."""
    manifest = read_manifest(folder)
    if manifest is None or "grid" not in manifest:
        return set(fallback.astype(str))
    try:
        return set(_grid_run_ids(json.dumps(manifest["grid"], sort_keys=True)))
    except Exception as exc:  # a grid this version no longer accepts: show every row, and say so
        hint = "; its grid names plugin algorithms: load their files with --plugin" if "plugins" in manifest else ""
        note(f"{Path(folder) / 'manifest.json'}: its grid no longer validates ({str(exc).splitlines()[0]}); "
             f"showing every row of runs.csv{hint}")
        return set(fallback.astype(str))


@dataclass
class Reading:
    """What a reader (summary, plot, report) takes from a results folder, and what it left out."""

    folder: Path
    runs: pd.DataFrame  # valid rows of the grid as last run, one per run id (every status)
    rows: int = 0  # complete data lines in runs.csv
    malformed: int = 0
    incomplete: bool = False
    duplicates: int = 0
    foreign: int = 0

    @property
    def ok(self) -> pd.DataFrame:
        return self.runs[self.runs["status"] == "ok"]

    def notes(self) -> list[str]:
        csv = self.folder / "runs.csv"
        notes = []
        if self.malformed:
            notes.append(f"{csv}: skipped {self.malformed} malformed row(s) (wrong number of fields, or a "
                         f"non-number where a number belongs; `dpsgd run` sets them aside and redoes those runs)")
        if self.incomplete:
            notes.append(f"{csv}: ignored its incomplete last row (cut mid-write; `dpsgd run` sets it aside and "
                         f"redoes that run)")
        if self.duplicates:
            notes.append(f"{csv}: {self.duplicates} duplicate row(s) of a run id counted once")
        if self.foreign:
            notes.append(f"{csv}: ignored {self.foreign} row(s) not in the grid as last run (another grid's, or "
                         f"an earlier version of this grid's)")
        return notes

    def why_empty(self) -> str:
        """Why there is no ok run to show ('' if there is one)."""
        if len(self.ok):
            return ""
        if not self.rows:
            return "runs.csv has no rows (header only): no run has finished yet; run `dpsgd run` on the grid"
        if self.rows == self.malformed:
            return f"all {self.rows} row(s) of runs.csv are malformed"
        if self.runs.empty:
            return f"none of the {self.rows} row(s) of runs.csv belongs to the grid as last run"
        counts = self.runs["status"].value_counts().to_dict()
        failed = self.runs[self.runs["status"] == "failed"]["message"].dropna()
        first = f"; first message: {failed.iloc[0]}" if len(failed) else ""
        return ("every run failed or diverged (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"){first}")


_READINGS: dict[tuple[Any, ...], Reading] = {}


def read_results(folder: Path) -> Reading:
    """The valid rows of the grid as last run, each run id once (final rows first); counts of what was left out."""
    folder = Path(folder)
    key = (str(folder.resolve()), *(_stamp(folder / name) for name in ("runs.csv", "manifest.json")))
    if key in _READINGS:
        return _READINGS[key]
    scan = scan_csv(folder / "runs.csv", RUN_KEYS)
    if not scan.header and os.path.lexists(folder / "runs.csv"):
        raise UserError(f"{folder / 'runs.csv'}: no header line (an empty file, or one cut mid-write); it records "
                        f"no run: rerun `dpsgd run` on its grid (it starts the file again), or move it away")
    frame = scan.frame()
    frame = frame.reindex(columns=[*COLUMNS, *(c for c in frame.columns if c not in COLUMNS)])  # older files too
    current = frame[frame["run_id"].isin(current_run_ids(folder, frame["run_id"]))]
    order = current["status"].isin(FINAL).map({True: 0, False: 1}).sort_values(kind="stable").index
    unique = current.loc[order].drop_duplicates("run_id", keep="first").sort_index()
    reading = Reading(folder, unique.reset_index(drop=True), rows=len(scan.rows) + len(scan.bad),
                      malformed=len(scan.bad), incomplete=bool(scan.partial),
                      duplicates=len(current) - len(unique), foreign=len(frame) - len(current))
    _READINGS[key] = reading
    return reading


def results_size(folder: Path) -> int:
    """Bytes of the folder's runs.csv and traces.csv: what reading and drawing it costs, roughly (to order work)."""
    return sum(_stamp(Path(folder) / name)[1] or 0 for name in ("runs.csv", "traces.csv"))


def _stamp(path: Path) -> tuple[int, int] | tuple[None, None]:
    try:
        stat = path.stat()
        return stat.st_mtime_ns, stat.st_size
    except OSError:
        return None, None
