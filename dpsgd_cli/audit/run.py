"""Audit a whole grid under the folder's lock: audit.csv (rewritten after each cell), the raw scores
(audit_scores/<cell_id>.npz: anyone can recompute every bound), then the figure."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dpsgd_cli.audit.engine import COLUMNS, ONE_RUN_REFUSAL, audit_cell
from dpsgd_cli.config import AuditSpec, Grid
from dpsgd_cli.engine.checks import audited_cells, check_audit
from dpsgd_cli.engine.folder import check_folder, make_folder, read_table, write_bytes, write_csv
from dpsgd_cli.engine.results import folder_lock, json_object
from dpsgd_cli.errors import UserError
from dpsgd_cli.lazy import LazyModule

audit_plot = LazyModule("dpsgd_cli.audit.plot")  # matplotlib: imported when the figure is drawn

AUDIT_CSV = "audit.csv"
SCORES_FOLDER = "audit_scores"
# what the readers (report, figure) take from audit.csv; a row that is ok with a bound needs numbers in NEEDED
READ_COLUMNS = ["grid", "dataset", "model", "algorithm", "epsilon_claimed", "delta", "epsilon_lo", "canary",
                "threat_model", "trials", "confidence", "status"]
NUMERIC = ["epsilon_claimed", "delta", "epsilon_lo", "trials", "confidence", "ceiling", "family_size"]
NEEDED = ["epsilon_claimed", "delta", "trials", "confidence"]


def audit_grid(grid: Grid, out_root: Path, trials: int | None = None, confidence: float | None = None,
               on_rows: Callable[[list[dict]], None] | None = None, cells: Collection[str] | None = None) -> Path:
    """Audit every cell of `grid` (its `audit:` block, or the defaults), or those whose id is in `cells`; returns
    the CSV's path."""
    # no audit block: the defaults, with thresholds at ranks fixed from the claim (the most powerful rule here)
    spec = grid.audit or AuditSpec()
    if spec.statistic == "one_run" and set(spec.canaries) != {"dirac"}:
        raise UserError(f"grid {grid.name!r}: audit.{ONE_RUN_REFUSAL}")
    check_audit(grid, trials, cells)  # the trials multiply every training: bounded before any
    folder = make_folder(check_folder(Path(out_root) / grid.name))
    with folder_lock(folder):  # before any training: a second audit of the folder is refused at once
        path = folder / AUDIT_CSV
        rows: list[dict] = []
        scores_folder = make_folder(folder / SCORES_FOLDER)
        figures = make_folder(folder / "figures")  # before the training: an unusable one is refused at once
        audited = audited_cells(grid, cells)
        with _progress(len(audited), grid.name) as advance:
            for cell in audited:
                scores: dict = {}
                new = audit_cell(cell, spec, trials, confidence, scores=scores)
                if scores:
                    target = scores_folder / f"{cell.cell_id}.npz"
                    buffer = io.BytesIO()
                    np.savez_compressed(buffer, **scores)
                    write_bytes(target, buffer.getvalue())
                    for row in new:
                        row["scores_file"] = target.relative_to(folder).as_posix()
                rows += new
                advance(f"{cell.algorithm.name} ε = {cell.epsilon}")
                write_csv(pd.DataFrame(rows, columns=COLUMNS), path)
                if on_rows:
                    on_rows(new)
        audit_plot.plot_audit(read_audit_csv(path), figures)
    return path


@contextlib.contextmanager
def _progress(total: int, name: str):
    """A progress bar over the cells on stderr (a terminal only: logs and pipes stay clean)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda what: None
        return
    with Progress(TextColumn(f"auditing {name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=True) as bar:
        task = bar.add_task("", total=total)
        yield lambda what: bar.update(task, advance=1, description=what)


def read_audit_csv(path: Path) -> pd.DataFrame:
    """An audit.csv as the report and the figure read it; a one-line UserError when they cannot."""
    remedy = "rerun `dpsgd audit` on its grid to rewrite it, or move it away"
    frame = read_table(path, READ_COLUMNS, NUMERIC, remedy)
    params = frame["algorithm_params"] if "algorithm_params" in frame else pd.Series(dtype=object)
    garbled = params.index[params.map(lambda v: json_object(v) is None if isinstance(v, str) else not pd.isna(v))]
    if len(garbled):
        raise UserError(f"{path}: line {garbled[0] + 2} has algorithm parameters that are not a JSON object; {remedy}")
    bounded = frame["status"].eq("ok") & frame["epsilon_lo"].notna()
    lacking = frame.index[bounded & frame[NEEDED].isna().any(axis=1)]
    if len(lacking):
        raise UserError(f"{path}: line {lacking[0] + 2} is an ok row without all of {', '.join(NEEDED)}; {remedy}")
    return frame

