"""Audit a whole grid: every cell's rows into OUT/<grid>/audit.csv (rewritten after each cell), its raw scores into
OUT/<grid>/audit_scores/<cell_id>.npz (so that anyone can recompute every bound), then the figure."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd

from dpsgd_cli.audit.engine import COLUMNS, ONE_RUN_REFUSAL, audit_cell
from dpsgd_cli.config import AuditSpec, Grid, expand
from dpsgd_cli.errors import UserError

AUDIT_CSV = "audit.csv"
SCORES_FOLDER = "audit_scores"


def audit_grid(grid: Grid, out_root: Path, trials: Optional[int] = None, confidence: Optional[float] = None,
               on_rows: Optional[Callable[[list[dict]], None]] = None) -> Path:
    """Audit every cell of `grid` (its `audit:` block, or the defaults); returns the CSV's path."""
    from dpsgd_cli.engine.checks import check_audit

    # no audit block: the defaults, with thresholds at ranks fixed from the claim (the most powerful rule here)
    spec = grid.audit or AuditSpec()
    if spec.statistic == "one_run" and set(spec.canaries) != {"dirac"}:
        raise UserError(f"grid {grid.name!r}: audit.{ONE_RUN_REFUSAL}")
    check_audit(grid, trials)  # the trials multiply every training: bounded before any
    if confidence is not None and not 0.5 < confidence < 1:
        raise UserError(f"--confidence {confidence:g}: must be in (0.5, 1), e.g. 0.95")
    folder = Path(out_root) / grid.name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / AUDIT_CSV
    rows: list[dict] = []
    scores_folder = folder / SCORES_FOLDER
    scores_folder.mkdir(exist_ok=True)
    cells = expand(grid)
    with _progress(len(cells), grid.name) as advance:
        for cell in cells:
            scores: dict = {}
            new = audit_cell(cell, spec, trials, confidence, scores=scores)
            if scores:
                target = scores_folder / f"{cell.cell_id}.npz"
                np.savez_compressed(target, **scores)
                for row in new:
                    row["scores_file"] = target.relative_to(folder).as_posix()
            rows += new
            advance(f"{cell.algorithm.name} ε = {cell.epsilon}")
            _write(rows, path, on_rows, new)
    from dpsgd_cli.audit.plot import plot_audit

    plot_audit(pd.read_csv(path), folder / "figures")
    return path


def _write(rows: list[dict], path: Path, on_rows, new: list[dict]) -> None:
    pd.DataFrame(rows, columns=COLUMNS).to_csv(path, index=False)
    if on_rows:
        on_rows(new)


@contextlib.contextmanager
def _progress(total: int, name: str):
    """A progress bar over the cells on stderr (a terminal only: logs and pipes stay clean)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda what: None
        return
    with Progress(TextColumn(f"auditing {name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=True) as bar:
        task = bar.add_task("", total=total)
        yield lambda what: bar.update(task, advance=1, description=what)


def read_audit(folder: Path) -> Optional[pd.DataFrame]:
    path = Path(folder) / AUDIT_CSV
    return pd.read_csv(path) if path.exists() else None
