"""Training algorithms, by the name a grid uses.

Every module of this package that defines an `Algorithm` subclass with a `name` registers it: adding an
algorithm is adding a file. Iterative algorithms are gradient chains (see `chain.py`).
"""

import importlib
import pkgutil

# The grid axes an algorithm may use (or override); defined before the algorithm modules import it.
AXES = ("epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm")

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Setting, Tags  # noqa: E402


def _discover() -> dict[str, type[Algorithm]]:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    found: dict[str, type[Algorithm]] = {}
    stack = list(Algorithm.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "name" in cls.__dict__:
            found[cls.name] = cls
    return dict(sorted(found.items()))


ALGORITHMS: dict[str, type[Algorithm]] = _discover()

__all__ = ["AXES", "ALGORITHMS", "Algorithm", "Outcome", "Setting", "Tags"]
