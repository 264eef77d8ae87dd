"""dpsgd: reproduce and extend the experiments of differentially-private SGD papers.

The Python API (docs/python-api.md): `import dpsgd_cli as dpsgd`, then `dpsgd.run`, `dpsgd.read_results`,
`dpsgd.export`, `dpsgd.plot`, `dpsgd.report`, `dpsgd.select`, `dpsgd.audit`, `dpsgd.epsilon`, `dpsgd.sigma`,
`dpsgd.check_plugin` (dpsgd_cli.api); the commands call the same functions.
"""

import importlib
import sys
import types

from dpsgd_cli import api
from dpsgd_cli.api import check_plugin, epsilon, export, plot, read_results, run, select, sigma
from dpsgd_cli.errors import UserError

__version__ = "0.1.0"
NUMERICS = 5
"""The version of the numbers: a run is a pure function of its spec, its seed and this. Bumped on purpose whenever
a change moves a run's numbers (a generator, a summation order, a search, what a default resolves to), and checked
statistically against the previous version on every grid; runs.csv and the manifest record it, and `dpsgd run`
never resumes into runs of another version. 1: every run before the version was recorded; 2: `pidp_sgd`'s
`accountant: auto` calibrates by PLD; 3: every σ search on the lattice (bassily2014, noisy_gd and a calibrated
private selection's base ε move to their smallest lattice point), single-example runs on the MLP and rounds of any
length on the compiled step (typed ops on one plan); 4: adaptive clipping on the compiled kernels (its cells within
rtol 1e-12 of the NumPy chain's), L* computed only where a figure or claim reads the gap (other rows leave it empty),
the audit's default trials chosen per variant."""
__all__ = ["UserError", "audit", "check_plugin", "epsilon", "export", "plot", "read_results", "report", "run", "select",
           "sigma"]


class _CallableModule(types.ModuleType):
    """`dpsgd_cli.audit` and `dpsgd_cli.report` are both a module and an API function: the module (so that imports,
    `mock.patch("dpsgd_cli.report.x")` and the like find what they expect), callable as `api.audit` / `api.report`."""

    def __call__(self, *args, **kwargs):
        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


def _callable_module(name: str) -> types.ModuleType:
    module = importlib.import_module(f"{__name__}.{name}")  # on first use: `import dpsgd_cli` stays cheap
    module.__class__ = _CallableModule
    return module


class _Package(types.ModuleType):
    """Importing a submodule sets the package's attribute of its name to it, which would be a plain module: these
    properties return it callable instead (the import system's setattr lands in the no-op setter)."""

    audit = property(lambda self: _callable_module("audit"), lambda self, module: None)
    report = property(lambda self: _callable_module("report"), lambda self, module: None)


sys.modules[__name__].__class__ = _Package
