"""Modules imported on first use, so `dpsgd run` with warm caches skips imports it does not need."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for the module `name` and imports it on the first attribute access (then a dict lookup)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr == "_module":  # the first access: import once (importlib's lookup is too slow for hot loops)
            self._module: ModuleType = importlib.import_module(self._name)
            return self._module
        return getattr(self._module, attr)

    def import_now(self) -> ModuleType:
        """The module, imported now if it was not yet (before forking workers that will all use it)."""
        return self._module

    def __repr__(self) -> str:
        return f"LazyModule({self._name!r})"


def installed(name: str) -> bool:
    """Whether the optional module `name` imports: a command that needs it says which extra to install instead."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
