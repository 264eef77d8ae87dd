"""scripts/compare_numerics.py, the check behind a numerics version change: a cell whose mean moved by many of its
seeds' standard errors is flagged, one that moved within them is not, and a deterministic cell (σ) is held to the
calibration's window."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_numerics", ROOT / "scripts" / "compare_numerics.py")
assert _spec is not None and _spec.loader is not None
compare_numerics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_numerics)


def _runs(shift: dict[str, float], sigma: dict[str, float], seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = [{"grid": "g", "cell_id": cell, "status": "ok", "seed": s,
             "test_accuracy": 0.8 + shift.get(cell, 0.0) + 0.01 * rng.standard_normal(), "sigma": sigma.get(cell, 1.0)}
            for cell in ("a", "b", "c") for s in range(10)]
    return pd.DataFrame(rows)


def test_a_cell_moved_beyond_its_seed_noise_is_flagged_and_the_others_are_not():
    old, new = _runs({}, {}, 0), _runs({"b": 0.05}, {}, 1)  # b moves by ~11 standard errors, a and c by noise only
    table, tested = compare_numerics.compare_metric(old, new, "test_accuracy", alpha=0.05)
    assert tested == 3
    assert dict(zip(table["cell_id"], table["within"])) == {"a": True, "b": False, "c": True}


def test_a_deterministic_cell_is_held_to_the_calibration_window():
    old, new = _runs({}, {}, 0), _runs({}, {"a": 1.001, "b": 1.01}, 0)  # 0.1% within 2e-3, 1% outside
    table, tested = compare_numerics.compare_metric(old, new, "sigma", alpha=0.05)
    assert tested == 0
    assert dict(zip(table["cell_id"], table["within"])) == {"a": True, "b": False, "c": True}
