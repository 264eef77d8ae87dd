#!/usr/bin/env python
"""Write the numbers of docs/papers/*.md from a results folder, or check that they are what it gives.

A page keeps every number a run produced in a generated block: its template in the opening comment, the text
the template gives below it, up to the closing marker:

    <!-- numbers: grid=song_fig1
    KDD {{ mean("train_objective", algorithm="song2013", batch_size=1, dataset="kddcup99") | .3g }}:
    {{ verdict("song1-b1-far-from-nonprivate") }}
    -->
    KDD 0.651:
    PASS
    <!-- /numbers -->

    python scripts/paper_numbers.py RESULTS_DIR            # rewrite each block whose grid RESULTS_DIR/GRID holds
    python scripts/paper_numbers.py RESULTS_DIR --check    # exit 1 if a block differs from what the runs give
                                                           # (or is not filled: --partial allows that)

`{{ expression | format }}` is a Python expression over the functions below, bound to the block's grid (the
runs as `dpsgd report` reads them: the grid's first selection where it has `select:`; keyword arguments select
rows as a claim's `where` does), then formatted (`.3g`, `.1%`; without a format a float prints as `.4g`):

    mean(metric, **where), std(metric, **where)   mean and std over the matching rows (std over seeds, ddof 1)
    lo(metric, **where), hi(metric, **where)      the smallest and largest value of the matching rows
    derived(key, **where)                         the values of runs.csv's derived.KEY on the matching rows
    spread(metric, a, b)                          (s_a/s_b, its one-sided 95% lower bound, upper bound) of two
                                                  selections (dicts), as the `spread` check computes them
    runs(**where)                                 how many rows match
    unselected.mean(...), .std, .lo, .hi, .runs   the same on every run, before the grid's selection chose
    table(figure, column, **where)                the value of `column` in the one matching row of an analytic
                                                  figure's table; analytic(figure) the whole table (a DataFrame)
    verdict(id), held(id), numbers(id)            a claim's PASS/FAIL/..., its "k of n" groups, its numbers
    verdicts(width=400)                           the verdict table (claims and formula checks), cells cut
    summary()                                     the grid's verdict counts, as the report prints them

`grid=*` binds `summary()` and `verdicts()` to every grid of experiments.yaml with claims; such a block is
written only when RESULTS_DIR holds all of them. A block whose grid has no finished run in RESULTS_DIR (its
manifest records when the run finished) is left as it is and listed. Text outside the blocks is the paper's or
an input: tests/test_paper_numbers.py checks that no result-looking number stands outside a block unless
marked (`<!-- given: paper -->…<!-- /given -->`, or `input`, `timing`, `test`, `previous`: the paper's own numbers,
an input parameter, a machine's wall time, a number a named test recomputes, a number of the run before a numerics
change, kept beside the rerun's).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dpsgd_cli

from dpsgd_cli.config import ClaimSpec, FigureSpec, load_grid_file  # noqa: E402
from dpsgd_cli.engine.analytic import analytic_table  # noqa: E402
from dpsgd_cli.engine.results import grid_of, read_manifest, select  # noqa: E402
from dpsgd_cli.engine.selection import results_frame  # noqa: E402
from dpsgd_cli.errors import UserError  # noqa: E402
from dpsgd_cli.report import Verdict, _table, evaluate, spread_ratio_bounds, summary_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "papers"
BLOCK = re.compile(r"<!-- numbers: (?P<attrs>[^\n]*)\n(?P<template>.*?)\n-->\n(?P<body>.*?)<!-- /numbers -->",
                   re.DOTALL)
PLACEHOLDER = re.compile(r"\{\{(.+?)\}\}", re.DOTALL)


class Runs:
    """The numbers of one grid's results folder that templates call (see the module docstring)."""

    def __init__(self, folder: Path, selected: bool = True):
        self.folder = folder
        self.frame = results_frame(folder) if selected else results_frame(folder, select=False)
        if selected and "selection" in self.frame and self.frame["selection"].nunique() > 1:
            self.frame = self.frame[self.frame["selection"] == self.frame["selection"].iloc[0]]
        self._verdicts: list[Verdict] | None = None

    def rows(self, metric: str | None, where: dict) -> pd.Series:
        rows = select(self.frame, where)
        if rows.empty:
            raise LookupError(f"no run of {self.folder.name} matches {where}")
        return rows[metric] if metric else rows.iloc[:, 0]

    def mean(self, metric: str, **where: Any) -> float:
        return float(self.rows(metric, where).mean())

    def std(self, metric: str, **where: Any) -> float:
        return float(self.rows(metric, where).std())

    def lo(self, metric: str, **where: Any) -> float:
        return float(self.rows(metric, where).min())

    def hi(self, metric: str, **where: Any) -> float:
        return float(self.rows(metric, where).max())

    def runs(self, **where: Any) -> int:
        return len(self.rows(None, where))

    def derived(self, key: str, **where: Any) -> list[float]:
        values = [json.loads(d).get(key) for d in self.rows("derived", where) if isinstance(d, str) and d]
        found = [float(v) for v in values if isinstance(v, (int, float))]
        if not found:
            raise LookupError(f"no run of {self.folder.name} matching {where} records derived.{key}")
        return found

    def spread(self, metric: str, a: dict, b: dict, confidence: float = 0.95) -> tuple[float, float, float]:
        sa, sb = self.rows(metric, a), self.rows(metric, b)
        return spread_ratio_bounds(float(sa.std()), len(sa), float(sb.std()), len(sb), confidence)

    def analytic(self, figure: str) -> pd.DataFrame:
        spec = next((FigureSpec(**f) for f in grid_of(self.folder).get("figures", []) if f["name"] == figure), None)
        if spec is None:
            raise LookupError(f"no figure {figure!r} in {self.folder.name}")
        return analytic_table(self.folder, spec)

    def table(self, figure: str, column: str, **where: Any) -> float:
        rows = select(self.analytic(figure), where)
        if len(rows) != 1:
            raise LookupError(f"{len(rows)} rows of {figure} match {where} (need 1)")
        return float(rows[column].iloc[0])

    def verdicts(self) -> list[Verdict]:
        if self._verdicts is None:
            grid = grid_of(self.folder)
            figures = [FigureSpec(**f) for f in grid.get("figures", [])]
            self._verdicts = [evaluate(self.folder, ClaimSpec(**c), figures) for c in grid.get("claims", [])]
        return self._verdicts

    def verdict_of(self, claim_id: str) -> Verdict:
        found = next((v for v in self.verdicts() if v.claim.id == claim_id), None)
        if found is None:
            raise LookupError(f"no claim {claim_id!r} in {self.folder.name}")
        return found


def namespace(grids: list[Runs]) -> dict[str, Callable[..., Any]]:
    """The functions a template calls: over the block's one grid, or (grid=*) verdicts and counts of all."""
    verdicts = [v for runs in grids for v in runs.verdicts()]
    names: dict[str, Callable[..., Any]] = {
        "summary": lambda: summary_line(verdicts),
        "verdicts": lambda width=400: "\n".join(_table([_cut(v, width) for v in verdicts],
                                                      grid_column=len(grids) > 1)),
        "abs": abs, "min": min, "max": max, "round": round, "len": len, "sqrt": math.sqrt,
    }
    if len(grids) == 1:
        (runs,) = grids
        unselected = Runs(runs.folder, selected=False)
        names.update(mean=runs.mean, std=runs.std, lo=runs.lo, hi=runs.hi, runs=runs.runs, table=runs.table,
                     derived=runs.derived, spread=runs.spread,
                     analytic=runs.analytic, verdict=lambda i: runs.verdict_of(i).status,
                     numbers=lambda i: runs.verdict_of(i).numbers,
                     held=lambda i: _held(runs.verdict_of(i)),
                     unselected=argparse.Namespace(mean=unselected.mean, std=unselected.std, lo=unselected.lo,
                                                   hi=unselected.hi, runs=unselected.runs))
    return names


def _cut(verdict: Verdict, width: int) -> Verdict:
    """A verdict whose numbers are cut to `width` characters (…) for a page's table."""
    text = verdict.numbers if len(verdict.numbers) <= width else verdict.numbers[:width].rstrip() + " …"
    return Verdict(verdict.grid, verdict.claim, verdict.status, text)


def _held(verdict: Verdict) -> str:
    """"k of n": the groups where the claim holds, of those decided ("0 of 0" when none is)."""
    if not verdict.claim.group_by:
        raise LookupError(f"claim {verdict.claim.id} has no groups (no group_by)")
    found = re.match(r"(\d+ of \d+) groups hold", verdict.numbers)
    return found.group(1) if found else "0 of 0"


def render(template: str, names: dict[str, Any]) -> str:
    """The template with each {{ expression | format }} replaced by its value."""
    def value(match: re.Match) -> str:
        expression, _, spec = match.group(1).rpartition("|") if "|" in match.group(1) else (match.group(1), "", "")
        try:
            result = eval(expression.strip(), {"__builtins__": {}, **names})  # the repository's own pages
        except Exception as exc:
            raise UserError(f"{{{{{match.group(1).strip()}}}}}: {type(exc).__name__}: {exc}") from None
        spec = spec.strip()
        if not spec and isinstance(result, float):
            spec = ".4g"
        return format(result, spec)

    return PLACEHOLDER.sub(value, template)


def claim_grids() -> list[str]:
    """The grids of experiments.yaml that state claims (what grid=* covers)."""
    return [g.name for g in load_grid_file(ROOT / "experiments.yaml").grids if g.claims]


def fill(page: str, results: Path) -> tuple[str, list[str]]:
    """(the page with each block whose grids `results` holds rewritten, the blocks left as they are)."""
    left: list[str] = []
    cache: dict[str, Runs] = {}

    def runs_of(name: str) -> Runs:
        if name not in cache:
            cache[name] = Runs(results / name)
        return cache[name]

    def block(match: re.Match) -> str:
        attrs = dict(part.split("=", 1) for part in match.group("attrs").split())
        grid = attrs.get("grid", "")
        wanted = claim_grids() if grid == "*" else [grid]
        missing = [g for g in wanted if not (read_manifest(results / g) or {}).get("finished")]
        if missing:
            left.append(f"grid={grid} (no finished run of {', '.join(missing)} in {results})")
            return match.group(0)
        try:
            text = render(match.group("template"), namespace([runs_of(g) for g in wanted]))
        except UserError as exc:
            raise UserError(f"block grid={grid}: {exc}") from None
        return f"<!-- numbers: {match.group('attrs')}\n{match.group('template')}\n-->\n{text}\n<!-- /numbers -->"

    return BLOCK.sub(block, page), left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="results root: one folder per grid (RESULTS/<grid>/runs.csv)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a block is stale, or not filled (its grid has no finished run)")
    parser.add_argument("--partial", action="store_true",
                        help="with --check: blocks whose grid RESULTS does not hold are listed, not failed")
    parser.add_argument("--pages", type=Path, default=PAGES, help="the folder of pages (default docs/papers)")
    args = parser.parse_args(argv)
    try:
        if not args.results.is_dir():
            raise UserError(f"{args.results}: no such results folder; give the --out of `dpsgd run`")
        stale, unfilled = [], []
        for path in sorted(args.pages.glob("*.md")):
            page = path.read_text()
            new, left = fill(page, args.results)
            for item in left:
                print(f"{path.name}: not filled: {item}")
            unfilled += [path.name] * bool(left)
            if new != page:
                stale.append(path.name)
                if not args.check:
                    path.write_text(new)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check and stale:
        print(f"stale numbers in {', '.join(stale)}: run python scripts/paper_numbers.py {args.results}",
              file=sys.stderr)
        return 1
    if args.check and unfilled and not args.partial:
        print(f"blocks not filled in {', '.join(sorted(set(unfilled)))}: {args.results} lacks their grids (run them, "
              f"or --partial to check only the grids it holds)", file=sys.stderr)
        return 1
    print(("stale: " if args.check else "rewritten: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
