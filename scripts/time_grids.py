#!/usr/bin/env python
"""Time every grid of experiments.yaml end to end: `dpsgd run experiments.yaml --only GRID --jobs 2` for each grid
(the audit grids excepted), then `dpsgd plot` and `dpsgd report` over the results, and print a Markdown table of
each command's wall and CPU time with the total.

    python scripts/time_grids.py                      # every grid, the caches as they are
    python scripts/time_grids.py --fresh              # as from a fresh clone: σ/L*, numba and data caches empty
    python scripts/time_grids.py --grids smoke,kang_lr --cold sigma --compare results

`--cold sigma` (DPSGD_CACHE_DIR: calibrated σ, L*, bassily2014's calibrations), `--cold numba` (NUMBA_CACHE_DIR:
the compiled kernels) and `--cold data` (DPSGD_DATA_DIR: the downloads, from DPSGD_DATA_MIRROR if set, and the
processed arrays) start that cache empty, under the output folder, shared by the grids in turn. `--compare
ROOT` then checks that every grid's runs have the run ids and numbers of ROOT/<grid>/runs.csv (to 1e-12; the
run's wall_time excepted), exit 1 if not. The same measurement is case 11 of `python -m benchmarks`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `benchmarks` and `dpsgd_cli`

from benchmarks.case11_end_to_end import CACHES, compare, grid_names, markdown, run_grids  # noqa: E402
from benchmarks.common import machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grids", default="", help="comma-separated grid names (default: every grid but the audits)")
    parser.add_argument("--grid-file", type=Path, default=Path(__file__).resolve().parents[1] / "experiments.yaml")
    parser.add_argument("--jobs", type=int, default=2, help="dpsgd run --jobs (default 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results root (default: a temporary folder, removed at the end)")
    parser.add_argument("--cold", action="append", default=[], choices=CACHES,
                        help="start this cache empty (repeatable): sigma, numba, data")
    parser.add_argument("--fresh", action="store_true", help="every cache empty, as from a fresh clone")
    parser.add_argument("--no-plot", action="store_true", help="skip dpsgd plot and dpsgd report")
    parser.add_argument("--compare", type=Path, default=None, metavar="ROOT",
                        help="check every run's numbers against ROOT/<grid>/runs.csv (to 1e-12)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement as JSON")
    args = parser.parse_args(argv)
    grids = [g for g in args.grids.split(",") if g] or grid_names(args.grid_file)
    cold = list(CACHES) if args.fresh else sorted(set(args.cold))
    out = args.out or Path(tempfile.mkdtemp(prefix="dpsgd-time-grids-"))
    info = machine()
    print(f"{len(grids)} grid(s), --jobs {args.jobs}, cold: {', '.join(cold) or 'none'}; results in {out}; "
          f"load average {info['load_average'][0]:.1f} on {info['usable_cores']} cores at the start",
          file=sys.stderr)
    try:
        steps = run_grids(grids, out, jobs=args.jobs, cold=cold, plot_and_report=not args.no_plot,
                          grid_file=args.grid_file)
        load = info["load_average"][0]
        table = markdown(steps, note=f"load {load:.1f} at the start; cold: {', '.join(cold) or 'none'}")
        print(table)
        if args.markdown:
            args.markdown.write_text(table)
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "cold": cold, "jobs": args.jobs,
                                             "steps": [s.json() for s in steps]}, indent=2, default=str))
        failed = [s.name for s in steps if s.returncode not in (0, None) and s.name != "report"]
        problems = {}
        if args.compare:
            for grid in grids:
                found = compare(out / grid, args.compare / grid)
                if found:
                    problems[grid] = found
                print(f"{grid}: " + (f"{len(found)} difference(s), e.g. {found[0]}" if found else
                                     "every run's numbers equal the reference's (1e-12)"), file=sys.stderr)
        if failed:
            print(f"commands that failed: {', '.join(failed)} (logs in {out / '.logs'})", file=sys.stderr)
        return 1 if problems or failed else 0
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
