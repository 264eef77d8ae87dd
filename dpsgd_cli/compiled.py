"""The optional compiled backend (numba): whether it is installed, and how its modules are loaded.

Every compiled module of the package is a backend of NumPy code that computes the same numbers; it is imported on
first use (numba compiles, or reads its on-disk cache), and the NumPy path runs where numba is missing or broken.
`HAVE_NUMBA` is looked up at each call, so tests can switch the compiled paths off.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from dpsgd_cli.errors import UserError

Backend = Literal["auto", "numpy", "numba"]
NUMBA_HINT = "pip install 'dpsgd[numba]'"


def _numba_installed() -> bool:
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):
        return False


HAVE_NUMBA: bool = _numba_installed()  # numba itself is imported lazily, by the first compiled module


def numba_version() -> str | None:
    """The installed numba's version, without importing it (None when absent)."""
    if not HAVE_NUMBA:
        return None
    try:
        return importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:  # importable but not installed as a distribution
        return "(version unknown)"


def backend_description() -> str:
    """One line for the CLI: which backend the compiled steps use."""
    version = numba_version()
    if version:
        return f"backend: numba {version} (single-example loops; logreg mini-batch steps)"  # fits 80 columns
    return f"backend: numpy ({NUMBA_HINT} for the single-example kernels)"


def check_backend(requested: str) -> None:
    """UserError for a backend that is not auto, numpy or numba, or for numba asked for but not installed."""
    if requested not in ("auto", "numpy", "numba"):
        raise UserError(f"backend = {requested!r}: use auto, numpy or numba")
    if requested == "numba" and not HAVE_NUMBA:
        raise UserError(f"backend: numba, but numba is not installed: {NUMBA_HINT}, or use backend: auto")


_NOTED: list[bool] = []  # the first-compile note is said once a process


def note_first_compile(module: str) -> None:
    """One line on stderr when numba has no on-disk cache yet for `dpsgd_cli.<module>`: the first run compiles the
    kernels (tens of seconds, once; later runs load them)."""
    if _NOTED or os.environ.get("NUMBA_CACHE_DIR") or sys.modules.get(f"dpsgd_cli.{module}"):
        return
    spec = importlib.util.find_spec(f"dpsgd_cli.{module}")
    if spec is None or spec.origin is None:
        return
    source = Path(spec.origin)
    if not any((source.parent / "__pycache__").glob(f"{source.stem}.*.nbi")):
        _NOTED.append(True)
        print("compiling the numba kernels (first run only: tens of seconds, then cached)", file=sys.stderr)


def import_compiled(module: str, note: bool = True) -> ModuleType:
    """Import the numba module `dpsgd_cli.<module>` (compiling its kernels or loading them from numba's on-disk
    cache); a broken numba install is a UserError (one line, how to fix). `note`: say so when it has no cache yet
    (off for a module imported ahead of its use, which a run may never call)."""
    if note:
        note_first_compile(module)
    try:
        return importlib.import_module(f"dpsgd_cli.{module}")
    except Exception as exc:  # installed but broken (e.g. a NumPy it does not support)
        raise UserError(f"numba could not be imported ({type(exc).__name__}: {exc}); reinstall it "
                        f"({NUMBA_HINT}) or use backend: numpy") from exc


def optional_compiled(module: str) -> ModuleType | None:
    """The numba module `dpsgd_cli.<module>`, or None without numba or with a broken one (the callers then compute
    the same numbers with NumPy)."""
    if not HAVE_NUMBA:
        return None
    note_first_compile(module)
    try:
        return importlib.import_module(f"dpsgd_cli.{module}")
    except Exception:  # installed but broken (e.g. a NumPy it does not support)
        return None


def load_cached_kernels(module: ModuleType) -> int:
    """Load into this process every overload of `module`'s kernels that numba's on-disk cache holds for this numba
    and machine, compiling nothing; how many it loaded. numba otherwise loads a kernel's machine code at its first
    call in each process (~0.3 s the first, a few ms each next one): workers forked after this inherit it."""
    loaded = 0
    for kernel in vars(module).values():
        cache: Any = getattr(kernel, "_cache", None)
        if getattr(kernel, "__module__", None) != module.__name__ or not hasattr(cache, "_cache_file"):
            continue  # not a cached kernel of this module (imported, inlined, or not a dispatcher)
        try:
            codegen = kernel.targetctx.codegen()
            for key in cache._cache_file._load_index():  # an index stale for this source is read as empty
                if key == cache._index_key(key[0], codegen):  # this numba's and machine's: compile() loads it
                    before = len(kernel.overloads)
                    kernel.compile(key[0])
                    loaded += len(kernel.overloads) - before
        except Exception:  # noqa: BLE001 - numba's cache internals differ: the kernel loads at its first call
            continue
    return loaded


def loads(load: Callable[[], object], wanted: bool) -> bool:
    """Whether the compiled module `load` imports; its UserError is raised when the kernel was asked for
    (backend: numba), else the NumPy path runs."""
    try:
        load()
    except UserError:
        if wanted:
            raise
        return False
    return True
