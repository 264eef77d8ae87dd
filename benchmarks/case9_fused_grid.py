"""Case 9: grids end to end with the batch-stream fusion and without it (`DPSGD_FUSE=0`), interleaved.

Each measurement is the whole command `dpsgd run GRID.yaml --only … --out <empty folder> --jobs 1` (a fresh
process: imports, data from the processed cache, ERM optima, calibration from the on-disk cache, training,
rows) under `taskset -c 0`, one BLAS thread; the two sides alternate (A B A B, two rounds), best of the rounds each.
The on-disk σ cache is warmed by a first, untimed run (both sides then read it alike).

(a) `kang_lr` as in experiments.yaml (150 runs). (b) the figure set (`kang`, `song_fig1`, `song_fig2`,
`song_fig3`, `chourasia`, `bellet`): `--figure-set full` runs it as in experiments.yaml (about 20 minutes per
side on this machine, one round); the default is a scaled-down copy (SCALED below: one dataset per grid,
fewer epochs for the long noisy-GD and single-example grids, and without kang's `pidp_sgd`, whose
one-example-per-step kernel (72 runs of ~9 s on adult) the fusion does not touch: it would add the same ~10
minutes to both sides, so the full set's ratio is lower than the scaled one's; the seeds and ε axes are kept,
since they are what the fusion shares), one round. `--quick`: kang_lr on adult only, one round, no figure set.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import REPO, Row, fmt_time
from benchmarks.pinned import Command, interleave, load_text, mean_load

GOAL_KANG, GOAL_FIGURES = 5.0, 3.0
FIGURE_SET = ["kang", "song_fig1", "song_fig2", "song_fig3", "chourasia", "bellet"]
# the scaled-down figure set: per grid, the dataset kept (by name) and overrides
SCALED: dict[str, dict[str, Any]] = {
    "kang": {"dataset": "adult", "drop": ["pidp_sgd"]},  # its b = 1 kernel: 72 runs × ~9 s, fusion-independent
    "song_fig1": {"dataset": "kddcup99"},
    "song_fig2": {"dataset": "kddcup99"},
    "song_fig3": {},
    "chourasia": {"epochs": 60},
    "bellet": {"epochs": 1},
}


def _dpsgd() -> str:
    exe = Path(sys.executable).with_name("dpsgd")
    return str(exe) if exe.exists() else "dpsgd"


def scaled_yaml(names: list[str], overrides: dict[str, dict[str, Any]], path: Path) -> None:
    """A copy of experiments.yaml's grids `names` with one dataset kept and fields overridden; figures and
    claims dropped (they name datasets and columns of the full grid; `dpsgd run` does not plot)."""
    grids = {g["name"]: g for g in yaml.safe_load((REPO / "experiments.yaml").read_text())["grids"]}
    out = []
    for name in names:
        g = dict(grids[name])
        g.pop("figures", None)
        g.pop("claims", None)
        o = dict(overrides.get(name, {}))
        keep = o.pop("dataset", None)
        drop = o.pop("drop", [])
        g["algorithms"] = [a for a in g["algorithms"] if (a if isinstance(a, str) else a["name"]) not in drop]
        if keep:
            g["datasets"] = [d for d in g["datasets"] if (d if isinstance(d, str) else d["name"]) == keep]
        g.update(o)
        out.append(g)
    path.write_text(yaml.safe_dump({"grids": out}, sort_keys=False))


def _pair(grid_file: Path, names: list[str], rounds: int) -> dict:
    argv = [_dpsgd(), "run", str(grid_file), *sum((["--only", n] for n in names), []), "--out", "{out}",
            "--jobs", "1"]
    sides = {"fused": Command(argv, env={"DPSGD_FUSE": None}), "DPSGD_FUSE=0": Command(argv, env={"DPSGD_FUSE": "0"})}
    sides["DPSGD_FUSE=0"]()  # warms the on-disk σ cache and the processed data for both sides (not timed)
    return interleave(sides, rounds)


def run(ctx) -> list[Row]:
    rows: list[Row] = []
    rounds = 1 if ctx.quick else 2  # ~30 s a run: 2 rounds keep the default benchmark near 15 minutes
    with tempfile.TemporaryDirectory(prefix="dpsgd-bench-fusedgrid-") as tmp:
        grid_file = REPO / "experiments.yaml"
        what = "kang_lr end to end (dpsgd run, --jobs 1, one core)"
        if ctx.quick:
            grid_file = Path(tmp) / "kang_lr_adult.yaml"
            scaled_yaml(["kang_lr"], {"kang_lr": {"dataset": "adult"}}, grid_file)
            what = "kang_lr, adult only (quick), end to end"
        rows.append(_row("9a", what, _pair(grid_file, ["kang_lr"], rounds), GOAL_KANG, "kang_lr"))
        if ctx.quick or ctx.figure_set == "none":
            return rows
        if ctx.figure_set == "full":
            names, label, grid_file = FIGURE_SET, "full, as in experiments.yaml", REPO / "experiments.yaml"
        else:
            grid_file = Path(tmp) / "figures_scaled.yaml"
            scaled_yaml(FIGURE_SET, SCALED, grid_file)
            names, label = FIGURE_SET, "scaled down: " + "; ".join(
                f"{k} {', '.join(f'{a}={b}' for a, b in v.items()) or 'as is'}" for k, v in SCALED.items())
        rows.append(_row("9b", f"figure set ({', '.join(names)}) end to end, one round",
                         _pair(grid_file, names, 1), GOAL_FIGURES, "figures", label))
    return rows


def _row(case: str, what: str, measured: dict, goal: float, goal_id: str, label: str = "") -> Row:
    fused, base = measured["fused"], measured["DPSGD_FUSE=0"]
    ratio = base.best / fused.best
    return Row(case, what, ours=f"{fmt_time(fused.best)} fused", comparison=f"{fmt_time(base.best)} DPSGD_FUSE=0",
               ratio=ratio, goal=f"≥ {goal:g}×", met=ratio >= goal, goal_id=goal_id, load=mean_load(fused, base),
               note=(f"{load_text(fused, base)}; best of {len(fused.times)} interleaved round(s); medians "
                     f"{fmt_time(fused.median)} vs {fmt_time(base.median)}" + (f"; {label}" if label else "")),
               data={"fused": fused.json(), "unfused": base.json()})
