"""Case 9: grids end to end: this code, the same code with `DPSGD_FUSE=0`, and the baseline commit, interleaved.

Each measurement is the whole command `python -P -m dpsgd_cli run GRID.yaml --out <empty folder> --jobs 1` (a
fresh process: imports, data from the processed cache, L*, σ, training, rows) under `taskset -c 0`, one BLAS
thread; the sides alternate (A B C A B C, two rounds), best of the rounds each. Every side first runs once,
untimed: ours then find σ, L* and bassily2014's calibrations in their on-disk caches, as any later run on a
machine does. The baseline commit (BEFORE, unpacked by `git archive` into a temporary folder and
imported from there: `PYTHONPATH=<it>` with `python -P`, checked by importing it) had no such caches: it
recomputes them in every run, which is its honest cost. It gets one later fix it needs to run the figure set at all
(FIXES: the
processed-data checksum of an empty test split, which crashed `split: none` grids). All sides run the same grid
file, the grids copied from this experiments.yaml (the old code accepts them: same cells and runs).

(a) `kang_lr` as in experiments.yaml (150 runs). (b) the figure set (`kang`, `song_fig1`, `song_fig2`,
`song_fig3`, `chourasia`, `bellet`): `--figure-set full` runs it as in experiments.yaml (about 20 minutes per
side on this machine, one round); the default is a scaled-down copy (SCALED below: one dataset per grid,
fewer epochs for the long noisy-GD and single-example grids, and without kang's `pidp_sgd`, whose
one-example-per-step kernel (72 runs of ~9 s on adult) the fusion does not touch: it would add the same ~10
minutes to both sides, so the full set's ratio is lower than the scaled one's; the seeds and ε axes are kept,
since they are what the fusion shares), one round. `--quick`: kang_lr on adult only, one round, no figure set.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import REPO, Row, Skip, fmt_time
from benchmarks.pinned import Command, interleave, load_text, mean_load, side_env

BEFORE = "eb434a3"  # the baseline: the merge before the fused-grid work (git log --first-parent: ea0765d follows it)
FIXES = [("5e75697", "dpsgd_cli/data/load.py")]  # later fixes the old code needs to run these grids

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


def before_checkout(folder: Path) -> Path:
    """The package as of BEFORE (with FIXES) in `folder`; Skip when git cannot produce it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", BEFORE, "dpsgd_cli"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
        for rev, path in FIXES:
            diff = subprocess.run(["git", "diff", f"{rev}^", rev, "--", path], cwd=REPO, capture_output=True,
                                  check=True).stdout
            subprocess.run(["patch", "-s", "-p1", "-d", str(folder)], input=diff, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise Skip(f"cannot unpack commit {BEFORE} of this repository ({exc}); run from a git checkout") from exc
    return folder


def _imported_from(env: dict[str, Any]) -> str:
    """Where `dpsgd_cli` is imported from under `env` (checks that a side runs the code it claims to)."""
    out = subprocess.run([sys.executable, "-P", "-c", "import dpsgd_cli; print(dpsgd_cli.__file__)"], cwd=REPO,
                         env=side_env(env), capture_output=True, text=True, check=True)
    return str(Path(out.stdout.strip()).parent)


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


def _sides(grid_file: Path, rounds: int, before: Path) -> dict:
    """ours, ours with DPSGD_FUSE=0 and the baseline commit, each warmed up once, then interleaved."""
    argv = [sys.executable, "-P", "-m", "dpsgd_cli", "run", str(grid_file), "--out", "{out}", "--jobs", "1"]
    envs = {"ours": {"DPSGD_FUSE": None}, "DPSGD_FUSE=0": {"DPSGD_FUSE": "0"},
            "before": {"DPSGD_FUSE": None, "PYTHONPATH": str(before)}}
    where = {name: _imported_from(env) for name, env in envs.items()}
    if where["before"] != str(before / "dpsgd_cli") or where["ours"] != str(REPO / "dpsgd_cli"):
        raise RuntimeError(f"case 9: the sides import the wrong code: {where}")
    sides = {name: Command(argv, env=env) for name, env in envs.items()}
    for side in sides.values():
        side()  # untimed: the processed data, and for ours the on-disk σ and L* caches
    return interleave(sides, rounds)


def run(ctx) -> list[Row]:
    rows: list[Row] = []
    rounds = 1 if ctx.quick else 2  # ~5-30 s a run: 2 rounds keep the default benchmark near 15 minutes
    with tempfile.TemporaryDirectory(prefix="dpsgd-bench-fusedgrid-") as tmp:
        before = before_checkout(Path(tmp) / "before")
        grid_file = Path(tmp) / "kang_lr.yaml"
        what = "kang_lr end to end (dpsgd run, --jobs 1, one core)"
        if ctx.quick:
            scaled_yaml(["kang_lr"], {"kang_lr": {"dataset": "adult"}}, grid_file)
            what = "kang_lr, adult only (quick), end to end"
        else:
            scaled_yaml(["kang_lr"], {}, grid_file)
        rows += _rows("9a", what, _sides(grid_file, rounds, before), GOAL_KANG, "kang_lr")
        if ctx.quick or ctx.figure_set == "none":
            return rows
        grid_file = Path(tmp) / "figures.yaml"
        if ctx.figure_set == "full":
            scaled_yaml(FIGURE_SET, {}, grid_file)
            label = "full, as in experiments.yaml"
        else:
            scaled_yaml(FIGURE_SET, SCALED, grid_file)
            label = "scaled down: " + "; ".join(
                f"{k} {', '.join(f'{a}={b}' for a, b in v.items()) or 'as is'}" for k, v in SCALED.items())
        rows += _rows("9b", f"figure set ({', '.join(FIGURE_SET)}) end to end, one round",
                      _sides(grid_file, 1, before), GOAL_FIGURES, "figures", label)
    return rows


def _rows(case: str, what: str, measured: dict, goal: float, goal_id: str, label: str = "") -> list[Row]:
    """Two rows: ours vs DPSGD_FUSE=0 (the fusion alone) and ours vs the baseline commit (the goal)."""
    ours = measured["ours"]
    rows = []
    for name, text, gid in (("DPSGD_FUSE=0", "DPSGD_FUSE=0 (same code)", ""),
                            ("before", f"baseline commit {BEFORE} (no σ/L* cache)", goal_id)):
        base = measured[name]
        ratio = base.best / ours.best
        rows.append(Row(
            case, f"{what}: ours vs {text}", ours=f"{fmt_time(ours.best)}", comparison=f"{fmt_time(base.best)}",
            ratio=ratio, goal=f"≥ {goal:g}×" if gid else "–", met=(ratio >= goal) if gid else None, goal_id=gid,
            load=mean_load(ours, base),
            note=(f"{load_text(ours, base)}; best of {len(ours.times)} interleaved round(s) after one untimed run "
                  f"each; medians {fmt_time(ours.median)} vs {fmt_time(base.median)}; CPU time (best) "
                  f"{fmt_time(min(ours.cpu))} vs {fmt_time(min(base.cpu))}: {min(base.cpu) / min(ours.cpu):.3g}×"
                  + (f"; {label}" if label else "")),
            data={"ours": ours.json(), name: base.json()}))
    return rows
