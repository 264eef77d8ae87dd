"""`python -m benchmarks [--quick] [--cases 1,2,...] [--json PATH] [--opacus-python PY] [-k K]`.

Prints one table (case, what, ours, comparison, ratio, goal, met?) with the notes under it, and writes the
numbers with the machine's description to JSON (default benchmarks/results.json).
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
from typing import Any, Optional

from benchmarks.common import REPO, Opacus, Row, busy_note, machine

CASES = {
    "1": "case1_dpsgd",
    "2": "case2_floor",
    "3": "case3_single_example",
    "4": "case4_mlp",
    "5": "case5_grid",
    "6": "case6_accountant",
    "7": "case7_audit",
}


@dataclass
class Context:
    quick: bool
    k: int
    opacus: Opacus
    versions: dict[str, Any] = field(default_factory=dict)  # of the comparison tools (torch, opacus)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="about a minute: fewer repetitions and smaller cases")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case numbers (default: all)")
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results.json", help="output JSON")
    parser.add_argument("--opacus-python", default=os.environ.get("DPSGD_BENCH_OPACUS_PYTHON"),
                        help="an interpreter with torch and opacus, when opacus is not importable here "
                             "(or set DPSGD_BENCH_OPACUS_PYTHON)")
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

    out = Table("case", "what", "ours", "comparison", "ratio", "goal", "met?", title="dpsgd benchmark",
                caption="ratio: the comparison's time over ours (> 1: ours is faster); case 2: ours over the floor")
    for r in rows:
        ratio = f"{r.ratio:.3g}{r.ratio_label}" if r.ratio is not None else "–"
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "–"}[r.met]
        if r.note.startswith("skipped"):
            met = "skipped"
        out.add_row(r.case, r.what, r.ours, r.comparison, ratio, r.goal, met)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from rich.console import Console

    args = parse(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    info = machine()
    busy = busy_note(info)
    ctx = Context(quick=args.quick, k=args.k, opacus=Opacus(args.opacus_python))
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
    info_end = os.getloadavg() if hasattr(os, "getloadavg") else None
    footer = f"total {total:.0f} s ({', '.join(f'case {c}: {s:.0f} s' for c, s in durations.items())})"
    console.print(footer + (f"; {busy}" if busy else ""), highlight=False)
    result = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "k": args.k,
              "machine": {**info, "load_average_end": list(info_end) if info_end else None,
                          "comparison_versions": ctx.versions, "busy_note": busy},
              "durations_s": durations, "total_s": total, "rows": [r.json() for r in rows]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=float))
    console.print(f"wrote {args.json}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
