"""The files of a results folder, read and written without following links, replaced atomically: a received
folder may hold a link where a file of the tool goes (docs/results.md, what a results folder may hold)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from dpsgd_cli.errors import UserError, link_refused

SUBFOLDERS = ("figures", "audit_scores")  # folders of the tool inside a grid's folder


def refuse_link(path: Path) -> Path:
    if os.path.islink(path):
        raise link_refused(path)
    return path


def check_folder(folder: Path) -> Path:
    """A grid's results folder: refused if it is a link or holds one (at its top or in the tool's sub-folders)."""
    folder = refuse_link(Path(folder))
    for inside in (folder, *(folder / name for name in SUBFOLDERS)):
        try:
            entries = list(os.scandir(inside))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_symlink():
                raise link_refused(entry.path)
    return folder


def make_folder(path: Path) -> Path:
    """A folder of the tool, created if missing, refused if it is a link (a file in its place: FileExistsError)."""
    path = refuse_link(Path(path))
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_file(path: Path, flags: int, mode: int = 0o644, in_place: bool = False) -> int:
    """os.open of a regular file without following a link; `in_place`: refused with other hard links too."""
    path = refuse_link(Path(path))
    # O_NONBLOCK: a FIFO planted in the folder must not hang the open; it is refused below
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: not a regular file (a device, FIFO or socket); move it away and rerun")
        if in_place and info.st_nlink > 1:
            raise UserError(f"{path}: has {info.st_nlink - 1} other hard link(s), which writing it would change too; "
                            f"replace it by a copy of its own (cp FILE FILE.copy && mv FILE.copy FILE) and rerun")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_in_place(path: Path) -> None:
    """Refuse before any work a file that will be appended to but cannot be; a missing file is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.close(open_file(path, os.O_RDONLY, in_place=True))


def read_bytes(path: Path) -> bytes:
    with os.fdopen(open_file(path, os.O_RDONLY), "rb") as fh:
        return fh.read()


def read_text(path: Path) -> str:
    """A UTF-8 text file of the tool (a leading byte-order mark, as spreadsheets write, is not part of the text)."""
    return read_bytes(path).decode("utf-8-sig")


def first_line(path: Path) -> str | None:
    """The first line of a text file (with its line end, byte-order mark dropped); None if the file is missing."""
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with open(fd, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
        return fh.readline()


def ends_with_newline(path: Path) -> bool:
    """Whether the file is empty or its last byte is a newline (else its last line was cut mid-write)."""
    fd = open_file(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return size == 0 or os.pread(fd, 1, size - 1) == b"\n"
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> Path:
    """Replace `path` by `data` atomically (a temporary file created exclusively beside it, renamed over)."""
    path = refuse_link(Path(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        exc.filename = str(path)
        raise
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is for secrets; results are shared
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            exc.filename = str(path)  # the file the user knows, not the temporary one
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8", errors="surrogateescape"))


# what makes a spreadsheet read a cell as a formula (`=HYPERLINK(...)`): such text gets a leading apostrophe
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def inert_cell(value: Any) -> Any:
    """A text cell a spreadsheet opens as text, never as a formula; numbers (`-0.5` too) unchanged."""
    if not (isinstance(value, str) and value.startswith(FORMULA_STARTS)):
        return value
    try:
        float(value)
        return value
    except ValueError:
        return "'" + value


def write_csv(frame: pd.DataFrame, path: Path) -> Path:
    """A table the tool exports, its text cells inert in a spreadsheet."""
    text = frame.select_dtypes(include=["object", "string"]).columns
    return write_text(path, frame.assign(**{c: frame[c].map(inert_cell) for c in text}).to_csv(index=False))


def save_figure(fig: Any, path: Path, **options: Any) -> Path:
    """A matplotlib figure saved atomically into a folder of the tool, in the format of `path`'s suffix."""
    make_folder(Path(path).parent)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip("."), **options)
    return write_bytes(path, buffer.getvalue())


def append_bytes(path: Path, data: bytes) -> None:
    """One write of whole rows at the end of `path`, then fsync; on failure the file is cut back (no half row)."""
    fd = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, in_place=True)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def read_table(path: Path, columns: Iterable[str], numeric: Iterable[str], remedy: str) -> pd.DataFrame:
    """A CSV table the tool wrote (audit.csv, an analytic table); a one-line UserError saying `remedy` if unusable."""
    try:
        frame = pd.read_csv(io.StringIO(read_text(path)))
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); {remedy}") from None
    except (pd.errors.EmptyDataError, pd.errors.ParserError) as exc:
        raise UserError(f"{path}: not a table ({' '.join(str(exc).split())}); {remedy}") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"{path}: no column {', '.join(missing)}; {remedy}")
    wrong = [c for c in numeric if c in frame.columns and not pd.api.types.is_numeric_dtype(frame[c])]
    if wrong:
        raise UserError(f"{path}: column {wrong[0]} holds a value that is not a number; {remedy}")
    return frame
