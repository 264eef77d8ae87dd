"""Audit a whole grid: every cell's rows into OUT/<grid>/audit.csv (rewritten after each cell), then the figure."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from dpsgd_cli.audit.engine import COLUMNS, audit_cell
from dpsgd_cli.config import AuditSpec, Grid, expand
from dpsgd_cli.errors import UserError

AUDIT_CSV = "audit.csv"


def audit_grid(grid: Grid, out_root: Path, trials: Optional[int] = None, confidence: Optional[float] = None,
               on_rows: Optional[Callable[[list[dict]], None]] = None) -> Path:
    """Audit every cell of `grid` (its `audit:` block, or the defaults); returns the CSV's path."""
    from dpsgd_cli.engine.checks import check_audit

    spec = grid.audit or AuditSpec()
    check_audit(grid, trials)  # the trials multiply every training: bounded before any
    if confidence is not None and not 0.5 < confidence < 1:
        raise UserError(f"--confidence {confidence:g}: must be in (0.5, 1), e.g. 0.95")
    folder = Path(out_root) / grid.name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / AUDIT_CSV
    rows: list[dict] = []
    for cell in expand(grid):
        new = audit_cell(cell, spec, trials, confidence)
        rows += new
        pd.DataFrame(rows, columns=COLUMNS).to_csv(path, index=False)
        if on_rows:
            on_rows(new)
    from dpsgd_cli.audit.plot import plot_audit

    plot_audit(pd.read_csv(path), folder / "figures")
    return path


def read_audit(folder: Path) -> Optional[pd.DataFrame]:
    path = Path(folder) / AUDIT_CSV
    return pd.read_csv(path) if path.exists() else None
