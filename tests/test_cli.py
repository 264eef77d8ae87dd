"""The CLI end to end on synthetic data: run → CSV → plot, resume, and one-line errors with exit code 2."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from dpsgd_cli.cli import app
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import execute, plan_grid

GRID = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 600}]
    algorithms: [erm, sgd, dp_sgd]
    epsilon: [0.5, 2]
    batch_size: [32]
    lr: [0.5]
    seeds: 2
    epochs: 2
"""


@pytest.fixture
def grid_file(write_grid):
    return write_grid(GRID)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_run_then_plot(grid_file, tmp_path):
    out = tmp_path / "results"
    result = invoke("run", grid_file, "--out", out)
    assert result.exit_code == 0, result.output
    runs = pd.read_csv(out / "tiny" / "runs.csv")
    assert len(runs) == (1 + 1 + 2) * 2 and set(runs["status"]) == {"ok"}
    assert runs["run_id"].is_unique
    dp = runs[runs["algorithm"] == "dp_sgd"]
    assert (dp["epsilon_achieved"] <= dp["epsilon"]).all() and (dp["epsilon_achieved"] >= 0.999 * dp["epsilon"]).all()
    assert (dp["sigma"] > 0).all() and set(dp["accountant"]) == {"rdp"}
    assert (runs["delta"] == 1 / runs["n_train"] ** 2).all()
    erm = runs[runs["algorithm"] == "erm"]
    assert erm["optimality_gap"].abs().max() < 1e-9 and (runs["optimality_gap"] > -1e-9).all()
    manifest = json.loads((out / "tiny" / "manifest.json").read_text())
    assert manifest["finished"] and manifest["libraries"]["dp-accounting"] != "not installed"
    assert "mean ± std" in result.output
    for metric in ("accuracy", "optimality_gap"):
        plotted = invoke("plot", out / "tiny", "--metric", metric)
        assert plotted.exit_code == 0, plotted.output
        figure = out / "tiny" / "figures" / f"{metric}.png"
        assert figure.exists() and figure.stat().st_size > 10_000


def test_dry_run_writes_nothing(grid_file, tmp_path):
    result = invoke("run", grid_file, "--out", tmp_path / "r", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "8 runs" in result.output and not (tmp_path / "r" / "tiny" / "runs.csv").exists()


def test_resume_runs_only_what_is_missing(grid_file, tmp_path):
    out = tmp_path / "results"
    grid = load_grid_file(grid_file).grids[0]
    plan = plan_grid(grid, out)
    plan.tasks = plan.tasks[:2]  # an interrupted run: only the first two tasks finished
    execute(plan)
    first = pd.read_csv(out / "tiny" / "runs.csv")
    resumed = plan_grid(grid, out)
    assert resumed.done_before == len(first) and resumed.pending_runs == 8 - len(first)
    execute(resumed)
    final = pd.read_csv(out / "tiny" / "runs.csv")
    assert len(final) == 8 and final["run_id"].is_unique
    pd.testing.assert_frame_equal(final.iloc[: len(first)].drop(columns="wall_time"),
                                  first.drop(columns="wall_time"), check_dtype=False)
    # nothing left: a third run does nothing
    assert plan_grid(grid, out).pending_runs == 0


def test_resumed_results_equal_an_uninterrupted_run(grid_file, tmp_path):
    grid = load_grid_file(grid_file).grids[0]
    execute(plan_grid(grid, tmp_path / "a"))
    plan = plan_grid(grid, tmp_path / "b")
    plan.tasks = plan.tasks[1:3]
    execute(plan)
    execute(plan_grid(grid, tmp_path / "b"))
    cols = ["run_id", "test_accuracy", "train_objective", "sigma"]
    a = pd.read_csv(tmp_path / "a" / "tiny" / "runs.csv")[cols].sort_values("run_id").reset_index(drop=True)
    b = pd.read_csv(tmp_path / "b" / "tiny" / "runs.csv")[cols].sort_values("run_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)


def test_parallel_jobs_give_the_same_results(grid_file, tmp_path):
    assert invoke("run", grid_file, "--out", tmp_path / "one").exit_code == 0
    result = invoke("run", grid_file, "--out", tmp_path / "two", "--jobs", "2")
    assert result.exit_code == 0, result.output
    cols = ["run_id", "test_accuracy", "train_objective"]
    one = pd.read_csv(tmp_path / "one" / "tiny" / "runs.csv")[cols].sort_values("run_id").reset_index(drop=True)
    two = pd.read_csv(tmp_path / "two" / "tiny" / "runs.csv")[cols].sort_values("run_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(one, two)


def test_with_jobs_the_driver_calibrates_rdp_sigma_before_the_workers_start(grid_file, tmp_path, monkeypatch):
    """`--jobs 2`: every RDP σ is in the driver's memory before the workers fork, so no worker calibrates."""
    from dpsgd_cli.engine import runner
    from dpsgd_cli.privacy import accounting

    monkeypatch.setenv(accounting.CACHE_DIR_ENV, "off")
    accounting.calibrate_sigma.cache_clear()
    accounting.dpsgd_curve.cache_clear()
    plan = plan_grid(load_grid_file(grid_file).grids[0], tmp_path)

    forked = []

    def in_process_workers(tasks, jobs):
        forked.append(len(tasks))
        assert accounting.calibrate_sigma.cache_info().currsize == 2  # dp_sgd at ε = 0.5 and 2, before any task

        def no_accounting(*args):
            raise AssertionError("a worker calibrated")

        monkeypatch.setattr(accounting, "_calibrate_sigma", no_accounting)
        yield from (runner.run_task(task) for task in tasks)

    monkeypatch.setattr(runner, "_forked_results", in_process_workers)
    monkeypatch.setattr(runner.sys, "platform", "linux")
    rows = [row for result in runner._results(plan.tasks, 2) for row in result.rows]
    assert forked and rows and all(row["status"] == "ok" for row in rows)


def test_an_epsilon_axis_is_calibrated_on_one_curve_ahead_of_training(grid_file, tmp_path, monkeypatch):
    """`calibrate_ahead` walks one accountant curve per (δ, q, T, accountant); the cells then calibrate nothing."""
    from dpsgd_cli.engine import runner
    from dpsgd_cli.privacy import accounting

    monkeypatch.setenv(accounting.CACHE_DIR_ENV, "off")
    accounting.calibrate_sigma.cache_clear()
    accounting.dpsgd_curve.cache_clear()
    plan = plan_grid(load_grid_file(grid_file).grids[0], tmp_path)
    for task in plan.tasks:
        runner.calibrate_ahead(task.cells, runner.dataset(task.cell.dataset, task.cell.validation))
    assert accounting.calibrate_sigma.cache_info().currsize == 2  # dp_sgd at ε = 0.5 and 2: one curve
    assert accounting.dpsgd_curve.cache_info().currsize == 1

    def no_accounting(*args):
        raise AssertionError("calibrated again in a task")

    monkeypatch.setattr(accounting, "_calibrate_sigma", no_accounting)
    rows = [row for task in plan.tasks for row in runner.run_task(task).rows]
    private = [row for row in rows if row["algorithm"] == "dp_sgd"]
    assert len(private) == 4 and all(row["status"] == "ok" for row in rows)
    assert len({row["sigma"] for row in private}) == 2
    assert all(0.999 * row["epsilon"] <= row["epsilon_achieved"] <= row["epsilon"] for row in private)


@pytest.mark.parametrize("args,expected", [
    (["run", "missing.yaml"], "no such file"),
    (["run", "GRID", "--only", "nope"], "--only nope: no such grid"),
    (["plot", "EMPTY"], "no runs.csv"),
    (["plot", "EMPTY", "--metric", "acuracy"], "did you mean 'accuracy'"),
    (["sigma", "--epsilon", "-1", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"], "epsilon"),
    (["epsilon", "--sigma", "1", "--sample-rate", "2", "--steps", "100", "--delta", "1e-5"], "sample"),
    (["datasets", "info", "adlt"], "adult"),
    (["run"], "Missing argument"),
    (["runn"], "No such command 'runn'"),
    (["run", "GRID", "--jobs", "0"], "--jobs"),
    (["plot", "EMPTY", "--format", "jpg"], "--format"),
    (["privacy-curve", "--alpha", "0.5"], "--alpha"),
])
def test_bad_input_is_one_line_with_exit_code_2(grid_file, tmp_path, args, expected):
    (tmp_path / "EMPTY").mkdir()
    args = [str(grid_file) if a == "GRID" else str(tmp_path / a) if a in ("missing.yaml", "EMPTY") else a
            for a in args]
    proc = subprocess.run([sys.executable, "-m", "dpsgd_cli", *args], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_batch_size_larger_than_n_is_an_error(grid_file, tmp_path):
    grid_file.write_text(grid_file.read_text().replace("batch_size: [32]", "batch_size: [100000]"))
    proc = subprocess.run([sys.executable, "-m", "dpsgd_cli", "run", str(grid_file), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "exceeds the n = 480 training records" in proc.stderr, proc.stderr


def test_sigma_for_an_epsilon_axis():
    one = invoke("sigma", "--epsilon", "2", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5")
    axis = invoke("sigma", "--epsilon", "0.5", "--epsilon", "2", "--sample-rate", "0.01", "--steps", "1000",
                  "--delta", "1e-5")
    assert axis.exit_code == 0, axis.output
    lines = [line for line in axis.output.splitlines() if line.startswith("σ = ")]
    assert len(lines) == 2 and "≤ 0.5," in lines[0] and lines[1].split()[2] == one.output.split()[2]


def test_privacy_calculators_agree():
    sig = invoke("sigma", "--epsilon", "1", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5")
    assert sig.exit_code == 0, sig.output
    sigma = float(sig.output.split("σ = ")[1].split()[0])
    eps = invoke("epsilon", "--sigma", sigma, "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5")
    value = float(eps.output.split("ε = ")[1].split()[0])
    assert 0.999 <= value <= 1.0


def test_traces_written_for_iterative_algorithms(run_grid):
    runs = run_grid(GRID.replace("epochs: 2", "epochs: 2\n    trace_every: 160"))
    traces = pd.read_csv(run_grid.folder / "traces.csv")
    iterative = runs[runs["algorithm"] != "erm"]
    assert set(traces["run_id"]) == set(iterative["run_id"])
    per_run = traces.groupby("run_id")["examples"].apply(list)
    # 480 training points × 2 epochs, a checkpoint every 160 examples (batch 32 divides 160)
    assert all(examples == [160, 320, 480, 640, 800, 960] for examples in per_run)
    assert (traces["optimality_gap"] > -1e-9).all()


def test_datasets_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path))
    listed = invoke("datasets", "list")
    assert listed.exit_code == 0 and "adult" in listed.output and "synthetic" in listed.output
    info = invoke("datasets", "info", "adult")
    assert info.exit_code == 0 and "5b00264637dbfec3" in info.output


def test_privacy_curve_command(tmp_path):
    result = invoke("privacy-curve", "--out", tmp_path, "--k-max", "400")
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "privacy_curve.csv")
    assert list(frame.columns[:4]) == ["K", "dynamics", "composition", "lower_bound"]
    # the talk's parameters: saturation α S_g² / (λ σ² n²) = 30·16 / (1·0.02²·5000²) = 0.048
    assert "0.048" in result.output and frame["dynamics"].max() < 0.048
    assert (tmp_path / "privacy_curve.png").stat().st_size > 10_000
    assert "note" not in result.output
    other = invoke("privacy-curve", "--out", tmp_path / "lam", "--k-max", "40", "--lam", "0.5")
    assert other.exit_code == 0 and "note: lower bound omitted" in other.output and "λ = β = 1" in other.output
    assert pd.read_csv(tmp_path / "lam" / "privacy_curve.csv")["lower_bound"].isna().all()


def test_ctrl_c_keeps_finished_runs_and_the_rerun_completes_them(grid_file, tmp_path):
    import os
    import signal
    import time

    epsilons = [0.2, 0.3, 0.4, 0.5, 0.7, 1, 1.5, 2, 2.5, 3, 4, 5]  # ~2 s of training: SIGINT lands mid-grid
    grid_file.write_text(grid_file.read_text().replace("epsilon: [0.5, 2]", f"epsilon: {epsilons}")
                         .replace("epochs: 2", "epochs: 60"))
    total = (2 + len(epsilons)) * 2  # (erm, sgd, dp_sgd at each ε) × 2 seeds
    out = tmp_path / "results"
    command = [sys.executable, "-m", "dpsgd_cli", "run", str(grid_file), "--out", str(out)]
    # a task per cell (no fusion): the longest tasks go first, so a fused grid's first rows can be its last ones
    env = {**os.environ, "DPSGD_DATA_DIR": str(tmp_path / "cache"), "DPSGD_FUSE": "0"}
    # SIGINT's default disposition in the child: a child inherits an ignored SIGINT (a shell without job control
    # ignores it in background jobs), and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    csv = out / "tiny" / "runs.csv"
    deadline = time.time() + 120
    while time.time() < deadline and (not csv.exists() or len(csv.read_text().splitlines()) < 2):
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)  # right after the first finished cell
    _, stderr = proc.communicate(timeout=120)
    saved = pd.read_csv(csv)
    assert proc.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert 0 < len(saved) < total and saved["run_id"].is_unique
    rerun = subprocess.run(command, capture_output=True, text=True, env=env)
    assert rerun.returncode == 0, rerun.stderr
    final = pd.read_csv(csv)
    assert len(final) == total and final["run_id"].is_unique
    assert set(saved["run_id"]) <= set(final["run_id"])


def test_float32_grid(run_grid):
    grid = GRID.replace("algorithms: [erm, sgd, dp_sgd]", "algorithms: [erm, dp_sgd]")
    wide = run_grid(grid)
    narrow = run_grid(grid.replace("epochs: 2", "epochs: 2\n    dtype: float32"),
                      out=run_grid.folder.parent.parent / "f32")
    assert set(narrow.loc[narrow["algorithm"] == "dp_sgd", "dtype"]) == {"float32"}  # erm stays float64
    assert set(wide["dtype"]) == {"float64"}
    dp = lambda f: f[f["algorithm"] == "dp_sgd"].sort_values(["epsilon", "seed"])["test_accuracy"].to_numpy()
    np.testing.assert_allclose(dp(narrow), dp(wide), atol=0.01)
    assert not set(narrow["run_id"]) & set(wide[wide["algorithm"] == "dp_sgd"]["run_id"])  # float32 is its own run


def test_float32_applies_only_where_supported(run_grid):
    grid = GRID.replace("algorithms: [erm, sgd, dp_sgd]", "algorithms: [erm, dp_sgd, {name: song2013, lr: [1.0]}]")
    runs = run_grid(grid.replace("epochs: 2", "epochs: 2\n    dtype: float32"))
    assert runs.groupby("algorithm")["dtype"].first().to_dict() == {
        "dp_sgd": "float32", "erm": "float64", "song2013": "float64"}


def test_runs_csv_of_an_older_version_gets_the_new_columns(tmp_path):
    from dpsgd_cli.engine.results import COLUMNS, ResultStore

    store = ResultStore(tmp_path)
    old = [c for c in COLUMNS if c not in ("dtype", "noiseless_fraction")]
    pd.DataFrame([{"run_id": "a", "status": "ok", "seed": 0}]).reindex(columns=old).to_csv(store.csv, index=False)
    store.append([{"run_id": "b", "status": "ok", "seed": 1, "dtype": "float32"}])
    frame = store.read()
    assert list(frame.columns) == COLUMNS and list(frame["run_id"]) == ["a", "b"]
    assert frame["dtype"].tolist()[1] == "float32" and frame["seed"].tolist() == [0, 1]


def test_report_command_prints_each_claim_and_report_md_its_source(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    claims = """\
    claims:
      - id: grows
        text: DP-SGD accuracy grows with epsilon
        quote: 'Somebody 2020, §4: "accuracy [grows] with ε"'
        check: monotone
        a: {algorithm: dp_sgd}
        tolerance: 1
      - id: mine
        text: a [/] bracket
        own: true
        check: within
        a: {algorithm: dp_sgd}
        b: {algorithm: sgd}
        over: null
        tolerance: 1
"""
    path = tmp_path / "grid.yaml"
    path.write_text(textwrap.dedent(GRID) + textwrap.indent(textwrap.dedent(claims), "    "))
    assert invoke("run", path, "--out", tmp_path / "r").exit_code == 0
    result = invoke("report", tmp_path / "r")
    assert result.exit_code == 0, result.output
    assert "a [/] bracket" in result.output and "(own)" in result.output  # markup escaped, one line a claim
    assert "findings: 1 PASS, 0 FAIL, 1 VACUOUS, 0 NO DATA" in result.output  # tolerance 1: no step can move
    report = (tmp_path / "r" / "report.md").read_text()
    assert "the project's own check" in report and "accuracy \\[grows\\] with ε" in report  # the quote, escaped


NEIGHBOURS_GRID = """
grids:
  - name: footing
    datasets: [{name: synthetic, n: 600}]
    algorithms: [erm, {name: dp_sgd, accountant: pld}, {name: song2013, batch_size: 5}]
    neighbours: replace_one
    epsilon: [1]
    batch_size: [32]
    lr: [0.5]
    seeds: 1
    epochs: 1
"""


def test_one_neighbouring_relation_for_every_algorithm_of_a_grid(write_grid, tmp_path):
    from dpsgd_cli.privacy.accounting import calibrate_sigma

    path = write_grid(NEIGHBOURS_GRID)
    assert invoke("run", path, "--out", tmp_path / "r").exit_code == 0
    runs = pd.read_csv(tmp_path / "r" / "footing" / "runs.csv").set_index("algorithm")
    assert runs.loc["dp_sgd", "neighbours"] == runs.loc["song2013", "neighbours"] == "replace_one"
    assert pd.isna(runs.loc["erm", "neighbours"])  # non-private: no relation
    row = runs.loc["dp_sgd"]
    cal = calibrate_sigma(1.0, row["delta"], row["sample_rate"], int(row["steps"]), "pld", "replace_one")
    assert row["sigma"] == cal.sigma and row["epsilon_achieved"] == cal.epsilon
    # the same grid under add/remove: dp_sgd gets another run id and less noise; song2013 cannot be calibrated
    plain = load_grid_file(write_grid(NEIGHBOURS_GRID.replace("neighbours: replace_one", "neighbours: add_remove")
                                      .replace(", {name: song2013, batch_size: 5}", ""))).grids[0]
    from dpsgd_cli.config import expand

    cells = {c.algorithm.name: c for c in expand(plain)}
    assert cells["dp_sgd"].cell_id != runs.loc["dp_sgd", "cell_id"]
    assert cells["erm"].cell_id == runs.loc["erm", "cell_id"]
    for text, message in ((NEIGHBOURS_GRID.replace("replace_one", "add_remove"), "analysed under replace-one"),
                          (NEIGHBOURS_GRID.replace("accountant: pld", "accountant: rdp"), "use accountant: pld")):
        proc = subprocess.run([sys.executable, "-m", "dpsgd_cli", "run", str(write_grid(text)), "--out",
                               str(tmp_path / "bad"), "--dry-run"], capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_naming_an_algorithms_own_relation_keeps_its_run_ids(write_grid):
    from dpsgd_cli.config import expand

    base = NEIGHBOURS_GRID.replace("    neighbours: replace_one\n", "").replace("accountant: pld", "accountant: rdp")
    plain = {c.algorithm.name: c.cell_id for c in expand(load_grid_file(write_grid(base)).grids[0])}
    named = base.replace("{name: song2013, batch_size: 5}", "{name: song2013, batch_size: 5, neighbours: replace_one}")
    assert {c.algorithm.name: c.cell_id for c in expand(load_grid_file(write_grid(named)).grids[0])} == plain
