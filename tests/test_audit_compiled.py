"""The audit's gradient and Dirac canaries on the compiled steps: the canary rows' fixed gradients added and the
iterates' projections recorded by the mini-batch and full-batch kernels, the same scores as the NumPy chain."""

from __future__ import annotations

import numpy as np
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import backends
from dpsgd_cli.audit import engine
from dpsgd_cli.config import AuditSpec, GridFile, expand
from dpsgd_cli.engine.runner import dataset

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed (pip install 'dpsgd[numba]')")


def _cell(algorithm: dict, **grid):
    base = dict(name="t", datasets=[{"name": "synthetic", "n": 300, "dim": 5}], models=["logreg"], seeds=1,
                delta=1e-5, clip_norm=1.0, l2=1e-3, lr=0.5, epochs=2, batch_size=32, epsilon=[1.0])
    if grid.get("batch_size") == "n":  # the full batch: the training set's n records
        grid["batch_size"] = dataset(_cell(algorithm).dataset).n
    return expand(GridFile.model_validate({"grids": [{**base, **grid, "algorithms": [algorithm]}]}).grids[0])[0]


def _worlds(kind: str, algorithm: dict, backend: str, spec: AuditSpec, monkeypatch, **grid):
    """The canary's worlds with the algorithm's chains on `backend`, and the backends its chains took."""
    cell = _cell({**algorithm, "backend": backend}, **grid)
    taken = []
    choose = backends.choose

    def spy(plan, requested):
        taken.append(choose(plan, requested))
        return taken[-1]

    monkeypatch.setattr(backends, "choose", spy)
    make = {"gradient": engine.gradient_worlds, "dirac": engine.dirac_worlds}[kind]
    worlds = make(cell, spec, cell.make_algorithm(), spec.trials, dataset(cell.dataset, cell.validation))
    monkeypatch.undo()
    return worlds, taken


CASES = [  # (canary, algorithm, grid keys, the compiled backend it takes)
    ("dirac", {"name": "dp_sgd"}, {}, "mini_batch"),  # Poisson batches, add/remove: the null record
    ("dirac", {"name": "dp_sgd", "accountant": "pld"}, {"batch_size": "n", "epochs": 3}, "full_batch"),  # q = 1
    ("dirac", {"name": "noisy_gd", "accountant": "composition", "lr": [1.0], "epochs": [4]}, {}, "full_batch"),
    ("dirac", {"name": "song2013", "batch_size": [20], "lr": [1.0]}, {}, "mini_batch"),  # replace-one: the mirror
    ("gradient", {"name": "dp_sgd"}, {}, "mini_batch"),  # a dense direction, raw norm far above the clip
]


@needs_numba
@pytest.mark.parametrize("kind, algorithm, grid, expected", CASES,
                         ids=[f"{c[0]}-{c[1]['name']}-{c[3]}" for c in CASES])
def test_canary_worlds_on_the_compiled_step_equal_the_numpy_chain(kind, algorithm, grid, expected, monkeypatch):
    """Every threat model's in and out scores from the kernels within rtol 1e-9 of the NumPy chain's (the iterates
    within 1e-12; the all-iterates statistic divides their differences by the step's η and the canary's norm), and
    the kernels took the canary model's chains (the comparison is not NumPy against itself)."""
    spec = AuditSpec(canaries=[kind], trials=6, chunk=4)
    reference, on_numpy = _worlds(kind, algorithm, "numpy", spec, monkeypatch, **grid)
    fast, on_kernels = _worlds(kind, algorithm, "numba", spec, monkeypatch, **grid)
    assert {b.name for b in on_numpy} == {"numpy"}
    assert expected in {b.name for b in on_kernels}
    assert reference.scores.keys() == fast.scores.keys()
    for threat, (s_in, s_out) in reference.scores.items():
        scale = max(1.0, float(np.abs(np.r_[s_in, s_out]).max()))
        np.testing.assert_allclose(fast.scores[threat][0], s_in, rtol=1e-9, atol=1e-11 * scale, err_msg=threat)
        np.testing.assert_allclose(fast.scores[threat][1], s_out, rtol=1e-9, atol=1e-11 * scale, err_msg=threat)
        assert not np.allclose(s_in, s_out)  # the canary moved the worlds apart: the scores say something
