"""Small JSON entries kept on disk and shared by processes (the calibrations, the reference optimum L*): one file
per key (named by its sha256, holding the key, the value and a checksum of both), written atomically, floats by
`repr` (read back bit for bit); best effort: an unreadable entry is a miss (docs/accounting.md#the-σ-cache)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "DPSGD_CACHE_DIR"


def cache_folder(name: str) -> Path | None:
    """$DPSGD_CACHE_DIR/<name>, else <DPSGD_DATA_DIR>/.cache/<name>; None when DPSGD_CACHE_DIR is ``off``."""
    root = os.environ.get(CACHE_DIR_ENV, "").strip()
    if root.lower() == "off":
        return None
    if root:
        return Path(root).expanduser().absolute() / name
    from dpsgd_cli.data.download import cache_dir  # the data layer's root (DPSGD_DATA_DIR)

    return cache_dir() / ".cache" / name


ENTRY_FORMAT = 2  # an entry of another format has another file name (a miss)


def entry_path(folder: Path, key: dict) -> Path:
    named = {"entry_format": ENTRY_FORMAT, **key}
    digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{digest}.json"


class Rejected(ValueError):
    """A cache entry that reads well but fails the check of what defines its value: discarded and recomputed."""


def _checksum(key: dict, field: str, value: Any) -> str:
    return hashlib.sha256(json.dumps({"key": key, field: value}, sort_keys=True).encode()).hexdigest()


def discard(folder: Path | None, key: dict, reason: str) -> None:
    """Remove the entry for `key` and say so in one line (the caller recomputes the value)."""
    if folder is None:
        return
    path = entry_path(folder, key)
    reason = " ".join(reason.split())  # one line, whatever an entry's values put in it
    print(f"note: discarded the cache entry {path}: {reason}; recomputing it", file=sys.stderr)
    with contextlib.suppress(OSError):
        path.unlink()


def read_entry(folder: Path | None, key: dict, field: str) -> Any:
    """The stored `field` of the entry for `key`; None when absent, unreadable, for another key or corrupt (then
    discarded with one line)."""
    if folder is None:
        return None
    for held_folder, held_key, held_field, value in getattr(_held, "writes", None) or ():
        if (held_folder, held_key, held_field) == (folder, key, field):
            return value
    try:
        text = entry_path(folder, key).read_text()
    except (OSError, ValueError):
        return None
    try:
        entry = json.loads(text)
        if entry["key"] != key:
            return None
        value = entry[field]
        if entry["sha256"] == _checksum(key, field, value):
            exact_fields(entry, ("key", field, "sha256"), "entry")
            return value
    except Rejected as exc:
        discard(folder, key, str(exc))
        return None
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep to parse
        pass
    discard(folder, key, "it is corrupt (unreadable, or its checksum does not match its content)")
    return None


def exact_fields(value: Any, fields: Iterable[str], what: str) -> dict:
    """`value` if it is a dict with exactly `fields`, else :class:`Rejected` naming the extra and missing ones: an
    added field must never reach a result, and anyone can recompute a checksum."""
    if not isinstance(value, dict):
        raise Rejected(f"its {what} is not a mapping of fields")
    fields = list(fields)
    extra = [k for k in value if k not in fields]
    missing = [k for k in fields if k not in value]
    if extra or missing:
        said = ([f"the unexpected field{'s' * (len(extra) > 1)} {', '.join(map(repr, extra))}"] if extra else []) + \
               ([f"no {', '.join(map(repr, missing))}"] if missing else [])
        raise Rejected(f"its {what} has {' and '.join(said)}")
    return value


_tmp_counter = itertools.count()


@functools.cache
def _process_token() -> str:
    """Random per process (pids repeat across containers sharing a folder); a fork gets its own pid."""
    return os.urandom(4).hex()


_held = threading.local()  # .writes: the writes held by this thread's deferred_writes block (None outside it)


@contextlib.contextmanager
def deferred_writes():
    """Hold this thread's :func:`write_entry` calls until the (outermost) block ends; its reads see them."""
    if getattr(_held, "writes", None) is not None:
        yield
        return
    _held.writes = []
    try:
        yield
    finally:
        writes, _held.writes = _held.writes, None
        for args in writes:
            _write_now(*args)


def write_entry(folder: Path | None, key: dict, field: str, value: Any) -> None:
    """Store {key, field: value} atomically; best effort (a read-only folder only loses the cache)."""
    if folder is None:
        return
    held = getattr(_held, "writes", None)
    if held is not None:
        held.append((folder, key, field, value))
        return
    _write_now(folder, key, field, value)


def _write_now(folder: Path, key: dict, field: str, value: Any) -> None:
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # floats: repr, an exact round trip; dicts keep their order (a run's `derived` JSON is written as read)
        text = json.dumps({"key": key, field: value, "sha256": _checksum(key, field, value)})
        path = entry_path(folder, key)
        # a name no other live writer uses (pid, a random token per process, a counter), created exclusively;
        # cheaper than tempfile's first call, which seeds a random name generator
        name = path.with_name(f"{path.stem}.{os.getpid()}.{_process_token()}.{next(_tmp_counter)}.tmp")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        tmp = name
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
        tmp = None
    except (OSError, TypeError, ValueError) as exc:
        logging.getLogger(__name__).debug("disk cache entry not written in %s: %s", folder, exc)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
