"""Errors that the CLI reports as one line with exit code 2 (no traceback)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

# control characters (but the tab) and bidirectional overrides: printed, received text could overwrite a verdict
_UNPRINTABLE = dict.fromkeys([c for c in (*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F),
                                          *range(0x2066, 0x206A)) if c != ord("\t")], "\ufffd")


def printable(text: str) -> str:
    """`text` with every character that acts on a terminal instead of showing (see `_UNPRINTABLE`) shown as �."""
    return text.translate(_UNPRINTABLE)


class UserError(Exception):
    """Bad input from the user: the message says what is wrong, where, and how to fix it, in one line (a line
    break in a value it quotes back, e.g. a grid's text or a path, becomes a space; a control character, �)."""

    def __init__(self, message: object = "") -> None:
        super().__init__(printable(" ".join(str(message).splitlines())))


class DataError(UserError):
    """A dataset could not be fetched, verified or parsed."""


class ArgumentTypeError(UserError, TypeError):
    """An argument of a Python API function of the wrong type (dpsgd_cli.arguments): also a TypeError."""


class ArgumentValueError(UserError, ValueError):
    """An argument of a Python API function out of its range (dpsgd_cli.arguments): also a ValueError."""


def link_refused(path: str | os.PathLike) -> UserError:
    """A symbolic link where a file or folder of the tool goes: following it could reach outside the folder."""
    return UserError(f"{path}: is a symbolic link; dpsgd neither reads nor writes through links in a results folder; "
                     f"put the file or folder itself in its place (or remove the link) and rerun")


def _file_in_the_way(path: Path) -> Path:
    """The part of `path` that exists but is not a folder (what made a write under it fail with ENOTDIR)."""
    return next((p for p in [*reversed(path.parents), path] if p.exists() and not p.is_dir()), path)


def file_error(exc: OSError) -> UserError:
    """An OSError of reading or writing a file as one line: the path, what is wrong with it, and how to fix it."""
    path = Path(os.fsdecode(exc.filename)) if exc.filename is not None else None
    where = f"{path}: " if path is not None else ""
    code = exc.errno
    if code == errno.ELOOP and path is not None:
        return link_refused(path)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"{where}no space left on the device (or over quota); free some space and rerun (nothing "
                         f"half-written was left)")
    if code == errno.EROFS:
        return UserError(f"{where}the filesystem is read-only; copy the results folder somewhere writable and rerun "
                         f"the command there")
    if code in (errno.EACCES, errno.EPERM):
        return UserError(f"{where}permission denied; make it readable and writable for you (chmod), or copy the "
                         f"results folder somewhere you may write and rerun there")
    if code == errno.EISDIR:
        return UserError(f"{where}is a folder where dpsgd expects a file; move it away and rerun")
    if code in (errno.ENOTDIR, errno.EEXIST) and path is not None:
        return UserError(f"{_file_in_the_way(path)}: is a file where dpsgd expects a folder; move it away and rerun")
    return UserError(f"{where}{exc.strerror or exc}; fix it and rerun")


@contextlib.contextmanager
def file_errors() -> Iterator[None]:
    """Around a whole command: a file it cannot read or write is one UserError line naming the path."""
    try:
        yield
    except OSError as exc:
        raise file_error(exc) from None
