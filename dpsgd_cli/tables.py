"""The tables the commands print (rich renderables, for a terminal or a notebook): one builder, `compact_table`,
that fits 80 columns by saying once, in the title, what every row shares; the cell, plan and summary tables on it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.protocol import is_renderable
from rich.table import Column, Table
from rich.text import Text

from dpsgd_cli.errors import printable
from dpsgd_cli.lazy import LazyModule

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = LazyModule("pandas")

# `dpsgd --help` imports this module: the engine (pandas, pydantic) waits until a table of results is built
summary = LazyModule("dpsgd_cli.engine.summary")


def plan_table(plan) -> Any:
    """The dry run's table: a row per cell, what sets it apart, and its runs still to do."""
    frame = cells_frame(plan.cells)
    pending = {c.cell_id: len(t.seeds) for t in plan.tasks for c in t.cells}
    return settings_table(frame, plan.grid.name, plan.grid.select, {
        "to run": [f"{pending.get(c.cell_id, 0)}/{len(c.seeds)}" for c in plan.cells]})


def cells_frame(cells: Sequence) -> pd.DataFrame:
    """Cells (config.Cell) as rows in runs.csv's columns, labelled as the runs will be."""
    return pd.DataFrame([{
        "cell_id": c.cell_id, "dataset": getattr(c.dataset, "id", None) or c.dataset.name,
        "dataset_options": c.dataset.model_dump_json(exclude={"name"}), "model": c.model.name,
        "model_options": json.dumps(c.model.options, sort_keys=True), "algorithm": c.algorithm.name,
        "algorithm_params": json.dumps(c.algorithm.params, sort_keys=True),
        "tuning": c.tuning["tag"] if c.tuning else None, **{axis: getattr(c, axis) for axis in summary.AXES}}
        for c in cells])


SETTINGS = {"dataset": "dataset", "model": "model", "algorithm": "label", "tuned for": "tuning", "ε": "epsilon",
            "B": "batch_size", "lr": "lr", "epochs": "epochs", "λ": "l2", "C": "clip_norm", "dtype": "dtype"}
SPARSE = ("ε", "B", "lr", "epochs", "λ", "C")  # missing where the algorithm has no such setting (erm has no lr)
DEFAULTS = {"dtype": "float64"}  # not worth a word when every row has it


def settings_table(frame: pd.DataFrame, title: str, select: Sequence = (), numbers: dict | None = None,
                   keep: Sequence[str] = (), notes: Sequence[str] = (), caption: str | None = None) -> Any:
    """A row per cell of `frame` (runs.csv's columns): its labels and axes, then the columns of `numbers`; what
    every row shares (but the `keep` columns) goes in the title or a line above the table."""
    if "label" not in frame or "tuning" not in frame:
        frame = frame.assign(**summary.cell_labels(frame, select))
    rows = [{h: fmt(r[c]) or MISSING for h, c in SETTINGS.items()} for _, r in frame.iterrows()]
    for header, values in (numbers or {}).items():
        for row, value in zip(rows, values):
            row[header] = value
    fixed = summary.fixed_options(frame) if "algorithm_params" in frame else frame.attrs.get("options", [])
    above = [*notes, *([f"options: {'; '.join(fixed)}"] if fixed else [])]
    return compact_table(rows, title, keep=keep, notes=above, caption=caption)


def compact_table(rows: list[dict[str, Any]], title: str, keep: Sequence[str] = (), notes: Sequence[str] = (),
                  caption: str | None = None, lines: bool = False, sparse: Sequence[str] = SPARSE) -> Any:
    """`rows` (header → text, or a rich renderable) as a table that reads in 80 columns: a column with one value
    in every row (in `sparse` columns: wherever it has one) is said once in the title line (`λ=0.0001`), but the
    `keep` columns; `notes` above the table, `caption` below, `lines` rules between rows; a long cell wraps."""
    headers = list(rows[0]) if rows else []

    def values(header: str) -> set[str]:
        found = {str(r[header]) for r in rows}
        return found - {MISSING} if header in sparse else found

    fixed = [h for h in headers if h not in keep and len(values(h)) <= 1]  # (one row: all of it in the title)
    if headers and len(fixed) == len(headers):  # a table keeps one column
        fixed.pop()
    said = [f"{h}={v}" if " " not in h else f"{h}: {v}" for h in fixed for v in values(h)
            if v not in (MISSING, "", DEFAULTS.get(h))]
    def longest_word(header: str) -> int:  # a column narrower than this would break a name, not wrap a text
        return min(24, max(len(word) for r in rows for word in [header, *str(r[header]).split()]))

    # columns two spaces apart, a rule under the header: a boxed table spends three characters a column
    table = Table(*(Column(h, overflow="fold", min_width=longest_word(h)) for h in headers if h not in fixed),
                  show_lines=lines, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    def cell(value: Any) -> Any:  # text escaped (a `[` is not markup, an escape sequence no command), a number as text
        if isinstance(value, str) or not is_renderable(value):
            return escape(printable(str(value)))
        return value

    for r in rows:
        table.add_row(*(cell(r[h]) for h in headers if h not in fixed))
    # the title above the table, not in it: rich wraps a title to the table's width, a narrow table's to a column
    heading = Text(printable(title), style="bold") + (printable(f" ({', '.join(said)})") if said else "")
    return Group(heading, *(Text(printable(line)) for line in notes), table,
                 *([Text(printable(caption))] if caption else []))


def summary_table(frame: pd.DataFrame, name: str) -> Any:
    """A row per cell, mean ± std over its seeds of the metrics summary_frame chose (no ± 0; missing: '—')."""
    numbers = {"runs": [f"{ok}/{n}" for ok, n in zip(frame["ok"], frame["runs"])]}
    for m in frame.attrs.get("metrics", []):
        numbers[m.replace("_", " ")] = [spread(mean, std) for mean, std in
                                        zip(frame[f"{summary.prefix(m)}_mean"], frame[f"{summary.prefix(m)}_std"])]
    single = any(v != MISSING and "±" not in v for values in list(numbers.values())[1:] for v in values)
    return settings_table(frame, f"{name}: mean ± std over seeds", numbers=numbers, keep=list(numbers)[1:],
                          caption="no ±: every seed gave the same result, or one run" if single else None,
                          notes=frame.attrs.get("missing", []))


def spread(mean: float, std: float) -> str:
    """`0.9833 ± 0.012`; the mean alone when there is no spread (one run, or every seed the same)."""
    if mean != mean:
        return MISSING
    return f"{mean:.4g}" if std != std or std == 0 else f"{mean:.4g} ± {std:.2g}"


MISSING = "—"


def fmt(value: Any, digits: int = 6) -> str:
    if value is None or value != value:  # None or NaN
        return MISSING
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)
