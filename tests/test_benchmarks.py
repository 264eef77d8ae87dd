"""The benchmark's cases import, and the hooks they time exist (a refactor must not silently break them)."""

import importlib
import pkgutil

import numpy as np

import benchmarks
from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms import pidp_sgd as pidp_module
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model


def test_every_case_module_imports_and_has_run():
    names = [m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("case")]
    assert len(names) == 11
    for name in names:
        assert callable(importlib.import_module(f"benchmarks.{name}").run)


def test_case3_times_the_influence_test_that_pidp_calls(monkeypatch):
    calls = []
    real = pidp_module.round_influence
    assert callable(pidp_module.round_eligible)  # case 3 times both
    monkeypatch.setattr(pidp_module, "round_influence", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 4))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    y = np.where(X[:, 0] > 0, 1.0, -1.0)
    setting = Setting(n=200, d=4, delta=1e-5, l2=1e-3, epsilon=1.0, batch_size=20, lr=0.5, epochs=2, clip_norm=1.0)
    ALGORITHMS["pidp_sgd"]({"sampling": "poisson"}).fit(setting, make_model("logreg", 4, 1e-3), X, y,
                                                        ReplicaStreams([0]))
    assert len(calls) == 2  # once per round


def test_side_modules_import_without_the_peers_libraries():
    """The driver and the worker import neither jax nor torch at module level (they are optional)."""
    import subprocess
    import sys

    code = ("import sys, benchmarks.pinned, benchmarks.sides, benchmarks.jax_peer, benchmarks.opacus_worker, "
            "benchmarks.__main__; bad = {'jax', 'torch', 'opacus'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_goal_of_issue_16_is_measured_by_a_case():
    """Each goal id of the goals table is set by some case module (a renamed id would silently read 'not
    measured')."""
    import inspect

    from benchmarks.__main__ import CASES, GOALS

    sources = "".join(inspect.getsource(importlib.import_module(f"benchmarks.{m}")) for m in CASES.values())
    ids = [g[0] for g in GOALS]
    assert len(set(ids)) == len(ids) == 11
    for gid in ids:
        assert f'"{gid}"' in sources, gid


def test_scaled_figure_set_is_a_valid_grid_file(tmp_path):
    from benchmarks.case9_fused_grid import FIGURE_SET, SCALED, scaled_yaml
    from dpsgd_cli.config import load_grid_file, select

    path = tmp_path / "scaled.yaml"
    scaled_yaml(FIGURE_SET, SCALED, path)
    grids = select(load_grid_file(path), FIGURE_SET)
    assert [g.name for g in grids] == FIGURE_SET
    kang = grids[0]
    assert len(kang.datasets) == 1 and kang.datasets[0].name == "adult"


def test_goals_table_reports_missing_measurements():
    from benchmarks.__main__ import goals, markdown
    from benchmarks.common import Row

    rows = [Row("9a", "kang_lr", ratio=6.0, goal="≥ 5×", met=True, goal_id="kang_lr", load=1.5)]
    items = goals(rows)
    assert items[0]["met"] is True and items[0]["load"] == 1.5 and items[0]["measured"] == "6×"
    assert all(g["measured"] is None for g in items[1:])
    assert "| 9a | kang_lr |" in markdown(rows, items)


def test_case9_unpacks_the_code_before_issue_16_with_its_fix(tmp_path):
    from benchmarks.case9_fused_grid import BEFORE, before_checkout

    folder = before_checkout(tmp_path / "before")
    assert not (folder / "dpsgd_cli" / "diskcache.py").exists()  # the old package, not this one
    assert "if array.size:" in (folder / "dpsgd_cli" / "data" / "load.py").read_text()  # FIXES applied
    assert len(BEFORE) >= 7


def test_case10_worker_times_the_calibration_a_run_does(tmp_path):
    """Case 10's child process sees every σ the run calibrates (cold cache) and none when they are cached: its
    timers wrap the functions `calibrate_sigma` calls."""
    import json
    import subprocess
    import sys

    from benchmarks.pinned import MARK, side_env

    grid = tmp_path / "grid.yaml"
    grid.write_text("grids:\n  - name: g\n    datasets: [synthetic]\n    models: [logreg]\n    algorithms: [dp_sgd]\n"
                    "    epsilon: [0.5, 2]\n    batch_size: [50]\n    lr: [0.5]\n    epochs: 1\n    l2: 1.0e-3\n"
                    "    clip_norm: 1.0\n    seeds: 1\n    delta: 1.0e-5\n")

    def answer(out: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.case10_calibration_share", str(grid),
                               str(tmp_path / out)], capture_output=True, text=True, check=True,
                              env=side_env({"DPSGD_CACHE_DIR": str(tmp_path / "cache"),
                                            "DPSGD_DATA_DIR": str(tmp_path / "data")}))
        return json.loads([line for line in proc.stdout.splitlines() if line.startswith(MARK)][-1][len(MARK):])

    cold, warm = answer("cold"), answer("warm")
    assert (cold["calibrations"], warm["calibrations"]) == (2, 0)
    assert cold["runs"] == warm["runs"] == 2 and cold["not_ok"] == 0
    assert 0 < cold["calibration_s"] < cold["wall_time_s"] and warm["calibration_s"] > 0  # warm: the cache reads


def _runs_csv(folder, rows):
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / "runs.csv", index=False)
    return folder


def test_case11_compare_finds_every_kind_of_difference(tmp_path):
    """Run ids, statuses, numbers (relative 1e-12 above 1), numbers inside `derived`; never wall_time."""
    import json

    from benchmarks.case11_end_to_end import compare

    base = {"run_id": "a1", "status": "ok", "test_accuracy": 0.8125, "optimal_objective": 123.456,
            "derived": json.dumps({"grad_norm": 1e-9, "start_results": {"0": {"objective": 0.5}}}), "wall_time": 1.0}
    ref = _runs_csv(tmp_path / "ref", [base, {**base, "run_id": "b2"}])
    same = _runs_csv(tmp_path / "same", [{**base, "run_id": "b2", "wall_time": 9.0},
                                         {**base, "optimal_objective": 123.456 * (1 + 1e-14)}])
    assert compare(same, ref) == []
    changes = {"number": {"test_accuracy": 0.8125 + 1e-11},
               "large number": {"optimal_objective": 123.456 * (1 + 1e-11)},
               "status": {"status": "failed"},
               "derived": {"derived": json.dumps({"grad_norm": 1e-9, "start_results": {"0": {"objective": 0.6}}})}}
    for what, change in changes.items():
        other = _runs_csv(tmp_path / what.replace(" ", "_"), [{**base, **change}, {**base, "run_id": "b2"}])
        found = compare(other, ref)
        assert len(found) == 1 and found[0].startswith("a1"), (what, found)
    fewer = _runs_csv(tmp_path / "fewer", [base])
    assert compare(fewer, ref)[0].startswith("run ids differ: 1 missing")


def test_case11_caches_start_empty_where_asked(tmp_path, monkeypatch):
    from benchmarks.case11_end_to_end import environment

    monkeypatch.delenv("DPSGD_CACHE_DIR", raising=False)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "data"))
    env = environment(tmp_path / "c", ["sigma"])
    assert env["DPSGD_CACHE_DIR"] == str(tmp_path / "c" / "cache") and "NUMBA_CACHE_DIR" not in env
    env = environment(tmp_path / "c", ["sigma", "numba"])
    assert env["NUMBA_CACHE_DIR"] == str(tmp_path / "c" / "numba")
    env = environment(tmp_path / "c", ["data"])  # the σ cache stays where it was, under the old data folder
    assert env["DPSGD_DATA_DIR"] == str(tmp_path / "c" / "data")
    assert env["DPSGD_CACHE_DIR"] == str(tmp_path / "data" / ".cache")


def test_time_grids_script_times_a_grid_and_checks_its_numbers(tmp_path):
    """scripts/time_grids.py end to end on a tiny grid: the table, then the same grid again compared run by run."""
    import subprocess
    import sys

    grid = tmp_path / "grids.yaml"
    grid.write_text("grids:\n  - name: g\n    datasets: [{name: synthetic, n: 200, dim: 3}]\n    models: [logreg]\n"
                    "    algorithms: [erm, dp_sgd]\n    epsilon: [1]\n    batch_size: [20]\n    lr: [0.5]\n"
                    "    epochs: 1\n    seeds: 2\n    delta: 1.0e-5\n")
    script = [sys.executable, "scripts/time_grids.py", "--grid-file", str(grid), "--no-plot", "--cold", "sigma"]
    first = subprocess.run(script + ["--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "| g |" in first.stdout and "**total**" in first.stdout and "| 4 |" in first.stdout
    second = subprocess.run(script + ["--out", str(tmp_path / "b"), "--compare", str(tmp_path / "a")],
                            capture_output=True, text=True)
    assert second.returncode == 0 and "every run's numbers equal the reference's" in second.stderr, second.stderr


def test_case11_times_every_grid_but_the_audits():
    from benchmarks.case11_end_to_end import grid_names

    names = grid_names()
    assert "smoke" in names and "mlp_all" in names and not [n for n in names if n.startswith("audit")]
