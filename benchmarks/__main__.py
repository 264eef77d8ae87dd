"""`python -m benchmarks [--quick] [--cases 1,2,...] [--json PATH] [--opacus-python PY] [--jax-python PY]
[--figure-set scaled|full|none] [--end-to-end all|GRID,...] [-k K]`.

Prints one table (case, what, ours, comparison, ratio, goal, met?, load) with the notes under it, then the
performance goals (each with its measured ratio, target, met/missed and the load average), and writes the
numbers with the machine's description to JSON (default benchmarks/results.json); `--markdown PATH` writes
the goals and the table as Markdown (docs/performance.md's tables).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, Opacus, Row, busy_note, machine

CASES = {
    "1": "case1_dpsgd",
    "2": "case2_floor",
    "3": "case3_single_example",
    "4": "case4_mlp",
    "5": "case5_grid",
    "6": "case6_accountant",
    "7": "case7_audit",
    "8": "case8_peers",
    "9": "case9_fused_grid",
    "10": "case10_calibration_share",
    "11": "case11_end_to_end",
}

# the performance goals: (id, text, target); a row with that goal_id carries the measurement
GOALS = [
    ("kang_lr", "`kang_lr` end to end vs baseline commit eb434a3", "≥ 5×"),
    ("figures", "figure set (`kang`, `song_fig*`, `chourasia`, `bellet`) end to end vs baseline commit eb434a3",
     "≥ 3×"),
    ("fused_opacus", "fused `dp_sgd` (3 seeds × 8 ε, 3 batch streams) vs Opacus, per replica-step", "≥ 100×"),
    ("fused_jax", "fused `dp_sgd` (same work) vs the best JAX peer, per replica-step", "≥ 3×"),
    ("r1_jax", "`dp_sgd` R = 1 vs the best JAX peer (float64), per replica-step", "≥ 1×"),
    ("mlp_opacus", "MLP `dp_sgd` R = 10 vs Opacus (best of hooks, ew), per replica-step", "≥ 20×"),
    ("floor", "R = 1 epoch vs the memory floor", "≤ 3× floor"),
    ("bassily_numba", "`bassily2014` numba vs NumPy", "≥ 20×"),
    ("calibration_cell", "σ calibration (not cached) over a one-seed run's `wall_time`: one `dp_sgd` cell, adult, "
                         "ε = 3", "≤ 10%"),
    ("calibration_kang", "σ calibration (not cached) over a one-seed run's `wall_time`: `kang_lr` on adult "
                         "(fused task)", "≤ 10%"),
    ("end_to_end", "every grid (`dpsgd run --jobs 2`), `dpsgd plot` and `dpsgd report`, caches cold, wall time",
     "≤ 10 min"),
]


@dataclass
class Context:
    quick: bool
    k: int
    opacus: Opacus
    jax_python: str | None = None  # interpreter of the JAX side (None: this one)
    figure_set: str = "scaled"  # case 9b: scaled, full or none
    end_to_end: str = "all"  # case 11: every grid, or a comma-separated list of grids
    versions: dict[str, Any] = field(default_factory=dict)  # of the comparison tools (torch, opacus)
    shared: dict[str, Any] = field(default_factory=dict)  # measurements a later part of a case reuses


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="about a minute: fewer repetitions and smaller cases")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case numbers (default: all)")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results.json", help="output JSON")
    parser.add_argument("--opacus-python", default=os.environ.get("DPSGD_BENCH_OPACUS_PYTHON"),
                        help="an interpreter with torch and opacus, when opacus is not importable here "
                             "(or set DPSGD_BENCH_OPACUS_PYTHON)")
    parser.add_argument("--jax-python", default=os.environ.get("DPSGD_BENCH_JAX_PYTHON"),
                        help="an interpreter with jax, when jax is not installed here (case 8)")
    parser.add_argument("--figure-set", choices=["scaled", "full", "none"], default="scaled",
                        help="case 9b: the figure set scaled down (default), as in experiments.yaml (~20 min per "
                             "side), or skipped")
    parser.add_argument("--end-to-end", default="all", metavar="all|GRID,...",
                        help="case 11: every grid of experiments.yaml but the audits (default; ~10-35 min), or "
                             "these grids")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the goals and the table as Markdown (docs/performance.md's tables)")
    parser.add_argument("-k", type=int, default=3, help="repetitions per timing, best of k (≥ 3; default 3)")
    args = parser.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if args.k < 3:
        parser.error("-k must be at least 3 (best of k)")
    return args


def table(rows: list[Row]):
    from rich.table import Table

    out = Table("case", "what", "ours", "comparison", "ratio", "goal", "met?", "load", title="dpsgd benchmark",
                caption="ratio: the comparison's time over ours (> 1: ours is faster); case 2: ours over the floor; "
                        "load: mean 1-minute load average during the measurements")
    for r in rows:
        out.add_row(*_cells(r, rich=True))
    return out


def _cells(r: Row, rich: bool = False) -> list[str]:
    ratio = f"{r.ratio:.3g}{r.ratio_label}" if r.ratio is not None else "–"
    met = {True: "yes", False: "**no**", None: "–"}[r.met]
    if rich:
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "–"}[r.met]
    if r.note.startswith("skipped"):
        met = "skipped"
    load = f"{r.load:.1f}" if r.load is not None else "–"
    return [r.case, r.what, r.ours, r.comparison, ratio, r.goal, met, load]


def goals(rows: list[Row]) -> list[dict[str, Any]]:
    """Every performance goal with the row that measures it (or why it was not measured)."""
    out = []
    for gid, text, target in GOALS:
        row = next((r for r in rows if r.goal_id == gid), None)
        if row is None or row.ratio is None:
            why = row.note[:120] if row is not None else "not measured in this run (case not selected or failed)"
            out.append({"id": gid, "goal": text, "target": target, "measured": None, "met": None, "load": None,
                        "case": row.case if row else "–", "note": why})
            continue
        out.append({"id": gid, "goal": text, "target": target, "measured": f"{row.ratio:.3g}{row.ratio_label}",
                    "met": row.met, "load": row.load, "case": row.case, "note": ""})
    return out


def goals_table(items: list[dict[str, Any]]):
    from rich.table import Table

    out = Table("goal", "case", "measured", "target", "met?", "load", title="goals")
    for g in items:
        met = {True: "[green]met[/]", False: "[red]missed[/]", None: "–"}[g["met"]]
        out.add_row(g["goal"], g["case"], g["measured"] or f"– ({g['note']})", g["target"], met,
                    f"{g['load']:.1f}" if g["load"] is not None else "–")
    return out


def markdown(rows: list[Row], items: list[dict[str, Any]]) -> str:
    lines = ["| goal | case | measured | target | met? | load |", "|---|---|---|---|---|---|"]
    for g in items:
        met = {True: "met", False: "**missed**", None: "–"}[g["met"]]
        load = f"{g['load']:.1f}" if g["load"] is not None else "–"
        lines.append(f"| {g['goal']} | {g['case']} | {g['measured'] or '– (' + g['note'] + ')'} | {g['target']} "
                     f"| {met} | {load} |")
    lines += ["", "| case | what | ours | comparison | ratio | goal | met? | load |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    info = machine()
    busy = busy_note(info)
    ctx = Context(quick=args.quick, k=args.k, opacus=Opacus(args.opacus_python), jax_python=args.jax_python,
                  figure_set=args.figure_set, end_to_end=args.end_to_end)
    console.print(f"[bold]machine[/]: {info['cpu_model']}, {info['usable_cores']} cores, "
                  f"L3 {info['caches'].get('L3 Unified', '?')}, "
                  f"BLAS {', '.join(str(b.get('internal_api')) + ' ' + str(b.get('version')) for b in info['blas'])}; "
                  f"numpy {info['versions']['numpy']}, numba {info['versions']['numba'] or 'absent'}; "
                  f"Opacus {ctx.opacus.describe()}; data {info['data']['DPSGD_DATA_DIR']}")
    if busy:
        console.print(f"[yellow]{busy}[/]")
    rows: list[Row] = []
    durations = {}
    start = time.perf_counter()
    for case in args.cases:
        module = importlib.import_module(f"benchmarks.{CASES[case]}")
        console.print(f"case {case}: {(module.__doc__ or '').splitlines()[0].split(': ', 1)[-1]}", highlight=False)
        t0 = time.perf_counter()
        try:
            new = module.run(ctx)
        except Exception as exc:  # a broken case is reported, the others still run
            new = [Row(case, CASES[case], note=f"error: {type(exc).__name__}: {exc}")]
            traceback.print_exc(file=sys.stderr)
        durations[case] = time.perf_counter() - t0
        rows.extend(new)
    total = time.perf_counter() - start
    console.print(table(rows))
    for r in rows:
        if r.note:
            console.print(f"[bold]{r.case}[/] {r.note}", highlight=False)
    items = goals(rows)
    console.print(goals_table(items))
    info_end = os.getloadavg() if hasattr(os, "getloadavg") else None
    footer = f"total {total:.0f} s ({', '.join(f'case {c}: {s:.0f} s' for c, s in durations.items())})"
    console.print(footer + (f"; {busy}" if busy else ""), highlight=False)
    result = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "k": args.k,
              "machine": {**info, "load_average_end": list(info_end) if info_end else None,
                          "comparison_versions": ctx.versions, "busy_note": busy},
              "durations_s": durations, "total_s": total, "rows": [r.json() for r in rows], "goals": items}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=float))
    console.print(f"wrote {args.json}", highlight=False)
    if args.markdown:
        args.markdown.write_text(markdown(rows, items))
        console.print(f"wrote {args.markdown}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
