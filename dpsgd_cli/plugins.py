"""Algorithms defined outside the package: a Python file the user loads (`--plugin FILE`, `plugins=[...]`) or an
installed package's entry point in the group `dpsgd.algorithms` (docs/algorithms.md, "Your own algorithm").

A grid file alone never makes the tool import code (grids travel between people): a file is imported only when
named on the command line or in the API, an entry point only when the grid names an algorithm nothing defines."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
import sys
import traceback
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dpsgd_cli.algorithms import ALGORITHMS, AXES, Algorithm, Tags
from dpsgd_cli.errors import UserError

GROUP = "dpsgd.algorithms"
HOW_TO_LOAD = (f"an algorithm defined outside dpsgd is loaded with --plugin FILE.py (the API's plugins=[...]) or by "
               f"installing a package that declares it in the entry-point group {GROUP}")


@dataclass(frozen=True)
class Plugin:
    """Where a loaded algorithm came from: `source` (the file's resolved path, or "<distribution> <version>") and
    the SHA-256 of the file that defines it."""

    source: str
    sha256: str | None
    names: tuple[str, ...]


LOADED: dict[str, Plugin] = {}  # algorithm name → its plugin (built-ins are absent)


def provenance(name: str) -> dict[str, str | None]:
    """The row columns saying where algorithm `name` came from (None for a built-in)."""
    plugin = LOADED.get(name)
    return {"plugin": plugin.source if plugin else None, "plugin_sha256": plugin.sha256 if plugin else None}


def load(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Load each plugin file (a file already loaded with the same content is not imported again; with new content
    it replaces its algorithms); the names of the algorithms they define."""
    return [name for path in paths for name in load_file(Path(path))]


def load_file(path: Path) -> tuple[str, ...]:
    where = f"plugin {path}"
    try:
        real = path.resolve(strict=True)
        text = real.read_bytes()
    except OSError as exc:
        raise UserError(f"{where}: cannot be read ({exc.strerror or exc}); give the path of a Python file") from None
    if real.suffix != ".py":
        raise UserError(f"{where}: not a Python file (.py); give the file that defines the Algorithm subclasses")
    sha256 = hashlib.sha256(text).hexdigest()
    previous = next((p for p in LOADED.values() if p.source == str(real)), None)
    if previous is not None and previous.sha256 == sha256:
        return previous.names
    module_name = f"dpsgd_plugin_{hashlib.sha256(str(real).encode()).hexdigest()[:12]}_{real.stem}"
    module = types.ModuleType(module_name)
    module.__file__ = str(real)
    sys.modules[module_name] = module  # classes defined in it pickle and resolve their module
    try:  # the bytes hashed are the bytes run
        exec(compile(text, str(real), "exec"), module.__dict__)
    except Exception as exc:
        del sys.modules[module_name]
        lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == str(real)]
        at = f" at line {lines[-1]}" if lines else ""
        raise UserError(f"{where}: importing it raised {type(exc).__name__}: {exc}{at}") from None
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Algorithm)
               and c.__module__ == module_name and "name" in c.__dict__]
    if not classes:
        raise UserError(f"{where}: defines no Algorithm subclass with a name (class Mine(Algorithm): name = \"mine\")")
    replaced = previous.names if previous else ()
    plugin = Plugin(str(real), sha256, tuple(c.name for c in classes))
    _register(classes, plugin, where, replaced)
    return plugin.names


def from_entry_point(name: str) -> bool:
    """Register the installed entry point `name` of the group `dpsgd.algorithms`, if there is one."""
    points = importlib.metadata.entry_points(group=GROUP, name=name)
    if not points:
        return False
    point = next(iter(points))
    dist = getattr(point, "dist", None)
    where = f"entry point {name} = {point.value}" + (f" of {dist.name} {dist.version}" if dist else "")
    try:
        cls = point.load()
    except Exception as exc:
        raise UserError(f"{where}: loading it raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise UserError(f"{where}: is not an Algorithm subclass; point it at the class (module:Class)")
    if cls.__dict__.get("name") != name:
        raise UserError(f"{where}: the class's name is {cls.__dict__.get('name')!r}; name the entry point as the "
                        f"algorithm ({GROUP}: {cls.__dict__.get('name')} = {point.value})")
    try:
        sha256: str | None = hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()
    except (OSError, TypeError):
        sha256 = None
    _register([cls], Plugin(f"{dist.name} {dist.version}" if dist else point.value, sha256, (name,)), where, ())
    return True


def _register(classes: list[type[Algorithm]], plugin: Plugin, where: str, replaced: tuple[str, ...]) -> None:
    """Check every class, then register them all (or none)."""
    for cls in classes:
        name = cls.__dict__.get("name")
        label = f"{where}: class {cls.__name__}"
        if not (isinstance(name, str) and name.isidentifier()):
            raise UserError(f"{label}: name = {name!r} is not a name a grid can use (letters, digits, _)")
        if not isinstance(getattr(cls, "tags", None), Tags):
            raise UserError(f"{label}: set tags = Tags(display_name=..., private=True or False, ...) (what the "
                            f"algorithm is: dpsgd_cli.algorithms.Tags)")
        uses = getattr(cls, "uses", None)
        if not (isinstance(uses, frozenset) and uses <= set(AXES)):
            raise UserError(f"{label}: set uses = frozenset({{...}}), the grid axes it reads, among {', '.join(AXES)}")
        if name in ALGORITHMS and name not in replaced:
            owner = LOADED[name].source if name in LOADED else "dpsgd (built in)"
            raise UserError(f"{label}: the algorithm {name!r} is already defined by {owner}; give it another name")
    if len({c.name for c in classes}) < len(classes):
        raise UserError(f"{where}: two classes have the same name; give each algorithm its own")
    for name in replaced:
        ALGORITHMS.pop(name, None)
        LOADED.pop(name, None)
    for cls in classes:
        ALGORITHMS[cls.name] = cls
        LOADED[cls.name] = plugin
