"""Command-line interfaces: --set / --seeds overrides, export, report.html, plot --metric, Ctrl-C with --jobs,
help metavars and the one-line errors that come with them."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from test_validation import dpsgd, one_line_error

from dpsgd_cli.config import load_grid_file

GRID = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 300}]
    algorithms: [erm, dp_sgd]
    epsilon: [1]
    batch_size: [32]
    lr: [0.5]
    seeds: 1
    epochs: 2
"""


@pytest.fixture
def grid_file(write_grid, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # help text on one line per option
    return write_grid(GRID)


def test_set_and_seeds_override_the_file_and_run_ids_follow_the_resolved_grid(grid_file, tmp_path, capsys,
                                                                            monkeypatch):
    out = tmp_path / "results"
    code, stdout, err = dpsgd(capsys, monkeypatch, "run", grid_file, "--out", out, "--set", "epochs=1",
                              "--set", "datasets.0.n=200", "--set", "algorithms.1.accountant=pld", "--seeds", "2")
    assert code == 0, err
    runs = pd.read_csv(out / "tiny" / "runs.csv")
    assert len(runs) == 2 * 2 and set(runs["n_train"]) == {160} and set(runs["seed"]) == {0, 1}
    assert set(runs["epochs"].dropna()) == {1} and set(runs["accountant"].dropna()) == {"pld"}
    manifest = json.loads((out / "tiny" / "manifest.json").read_text())["grid"]
    assert manifest["seeds"] == 2 and manifest["epochs"] == [1.0]
    # the same grid written out in the file gives the same run ids
    (tmp_path / "resolved.yaml").write_text(GRID.replace("n: 300", "n: 200").replace("epochs: 2", "epochs: 1")
                                            .replace("seeds: 1", "seeds: 2")
                                            .replace("[erm, dp_sgd]", "[erm, {name: dp_sgd, accountant: pld}]"))
    from dpsgd_cli.config import expand

    resolved = load_grid_file(tmp_path / "resolved.yaml").grids[0]
    assert {c.run_id(s) for c in expand(resolved) for s in c.seeds} == set(runs["run_id"])
    code, stdout, _ = dpsgd(capsys, monkeypatch, "run", grid_file, "--out", out, "--set", "epochs=1", "--set",
                            "datasets.0.n=200", "--set", "algorithms.1.accountant=pld", "--seeds", "2", "--dry-run")
    assert code == 0 and "4 already done, 0 to run" in stdout


def test_set_applies_to_the_grids_run(write_grid, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    grid = write_grid(GRID + """
  - name: other
    datasets: [synthetic]
    algorithms: [erm]
""")
    override = ["--set", "algorithms.1.accountant=pld", "--out", tmp_path / "r", "--dry-run"]
    assert "algorithms.1: no such entry; the list has 1" in one_line_error(capsys, monkeypatch, "run", grid, *override)
    code, stdout, err = dpsgd(capsys, monkeypatch, "run", grid, "--only", "tiny", *override)
    assert code == 0 and "accountant=pld" in stdout and "other" not in stdout, err


@pytest.mark.parametrize("args, expected", [
    (["--set", "epochs"], "--set epochs: expected KEY=VALUE"),
    (["--set", "=1"], "expected KEY=VALUE"),
    (["--set", "epochs=0"], "--set epochs=0: grids[0].epochs: epochs = 0 must be > 0"),
    (["--set", "epoch=1"], "unknown key 'epoch' (did you mean 'epochs'?)"),
    (["--set", "lr=[1"], "--set lr=[1: the value is not valid YAML"),
    (["--set", "datasets.4.n=1"], "--set datasets.4.n: datasets.4: no such entry; the list has 1"),
    (["--set", "epochs.x=1"], "epochs holds a single value"),
    (["--set", "seeds=true"], "seeds"),
    (["--seeds", "0"], "seeds"),
])
def test_a_bad_override_is_one_line_with_exit_code_2(grid_file, capsys, monkeypatch, args, expected):
    assert expected in one_line_error(capsys, monkeypatch, "run", grid_file, "--dry-run", *args)


def test_unknown_names_suggest_what_is_meant(write_grid, capsys, monkeypatch):
    grid = write_grid(GRID.replace("seeds: 1", "seeds: 1\n    learning_rate: 0.1"))
    assert "unknown key 'learning_rate' (did you mean 'lr'?)" in one_line_error(capsys, monkeypatch, "run", grid)
    grid = write_grid(GRID.replace("[erm, dp_sgd]", "[{name: dp_sgd, learning_rate: 0.1}]"))
    assert "(did you mean 'lr'?)" in one_line_error(capsys, monkeypatch, "run", grid)
    grid = write_grid(GRID.replace("name: synthetic", "name: synthetc"))
    err = one_line_error(capsys, monkeypatch, "run", grid)
    assert "did you mean 'synthetic'?" in err and "synthetic, file" in err
    assert ", or file (a data file of your own" in one_line_error(capsys, monkeypatch, "datasets", "info", "nosuch")


def test_export_parquet_and_report_html(grid_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "results"
    assert dpsgd(capsys, monkeypatch, "run", grid_file, "--out", out)[0] == 0
    code, stdout, err = dpsgd(capsys, monkeypatch, "export", out, "--format", "parquet")
    assert code == 0 and str(out / "tiny" / "runs.parquet") in stdout, err
    pd.testing.assert_frame_equal(pd.read_parquet(out / "tiny" / "runs.parquet"),
                                  __import__("dpsgd_cli").read_results(out))
    code, stdout, err = dpsgd(capsys, monkeypatch, "plot", out)
    assert code == 0, err
    code, stdout, err = dpsgd(capsys, monkeypatch, "report", out)  # no claims: one line, no table
    assert code == 0 and stdout.count("\n") == 1 and stdout.startswith("nothing to check"), stdout
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and 'src="data:image/png;base64,' in html
    assert "<h2>tiny</h2>" in html and 'src="tiny/' not in html  # every figure embedded: one file
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # not installed
    assert "--format parquet needs pyarrow" in one_line_error(capsys, monkeypatch, "export", out)


def test_plot_metric_is_any_numeric_column(grid_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "results"
    assert dpsgd(capsys, monkeypatch, "run", grid_file, "--out", out)[0] == 0
    err = one_line_error(capsys, monkeypatch, "plot", out, "--metric", "val_acuracy")
    assert "not a numeric column of runs.csv (did you mean 'val_accuracy'?)" in err and "wall_time" in err
    assert "not a numeric column" in one_line_error(capsys, monkeypatch, "plot", out, "--metric", "status")


def test_every_option_and_argument_shows_a_metavar_not_a_type(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    for command in (["run"], ["audit"], ["plot"], ["export"], ["report"], ["select"], ["epsilon"], ["sigma"],
                    ["privacy-curve"], ["datasets", "info"], ["datasets", "fetch"]):
        code, stdout, _ = dpsgd(capsys, monkeypatch, *command, "--help")
        assert code == 0
        for shown in ("<path>", "<text>", "<str>", "<integer>", "<float>", "INTEGER", "FLOAT", "TEXT", "PATH"):
            assert shown not in stdout, (command, shown)
    assert "--set KEY=VALUE" in " ".join(dpsgd(capsys, monkeypatch, "run", "--help")[1].split())


def test_ctrl_c_with_jobs_exits_at_once_and_keeps_the_finished_runs(write_grid, tmp_path):
    """SIGINT to the process group, as Ctrl-C in a terminal sends it: out in < 2 s (the workers are stopped, not
    waited for), finished runs saved, no traceback; the rerun completes the grid."""
    grid = write_grid(GRID.replace("n: 300", "n: 20000").replace("epsilon: [1]", "epsilon: [0.5, 1, 2, 3, 4, 5]")
                      .replace("epochs: 2", "epochs: 300").replace("seeds: 1", "seeds: 2"))
    out = tmp_path / "results"
    command = [sys.executable, "-m", "dpsgd_cli", "run", str(grid), "--out", str(out), "--jobs", "2"]
    # a task per cell (no fusion): the longest tasks go first, so a fused grid's first rows can be its last ones
    # SIGINT's default disposition in the child (it may inherit an ignored one: see test_cli's Ctrl-C test)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "DPSGD_FUSE": "0"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    csv = out / "tiny" / "runs.csv"
    deadline = time.time() + 120
    while time.time() < deadline and (not csv.exists() or len(csv.read_text().splitlines()) < 2):
        time.sleep(0.02)
    time.sleep(0.5)  # the workers mid-task
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    took = time.time() - sent
    assert proc.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr
    assert "Process ForkProcess" not in stderr, stderr
    assert took < 2.0, f"{took:.1f} s after Ctrl-C"
    saved = pd.read_csv(csv)
    assert 0 < len(saved) < 2 * 7 and saved["run_id"].is_unique


CLAIMS_GRID = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 300}]
    algorithms: [erm, dp_sgd]
    epsilon: [1, 4]
    batch_size: [32]
    lr: [0.5]
    seeds: 2
    epochs: 1
    claims:
      - {id: a-rather-long-claim-identifier, own: true, check: monotone, a: {algorithm: dp_sgd}, tolerance: 0.5,
         text: "a claim whose text is much longer than what eighty columns can hold beside its verdict and its id"}
      - {id: second, own: true, check: monotone, a: {algorithm: dp_sgd}, tolerance: 0.5, text: short}
"""


def test_report_prints_one_line_a_claim_within_80_columns(write_grid, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "results"
    assert dpsgd(capsys, monkeypatch, "run", write_grid(CLAIMS_GRID), "--out", out)[0] == 0
    code, stdout, _ = dpsgd(capsys, monkeypatch, "report", out)
    assert code == 0
    lines = stdout.splitlines()
    long = [line for line in lines if len(line) > 80 and not line.startswith("wrote /")]  # a path is not broken
    assert long == []
    claims = [line for line in lines if line.startswith(("PASS", "FAIL", "VACUOUS", "NO DATA"))]
    assert len(claims) == 2
    assert "a-rather-long-claim-identifier" in claims[0] and claims[0].endswith("…")
    assert len(lines) <= 6, lines


def test_dataset_listings_fit_80_columns_without_reprs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, stdout, _ = dpsgd(capsys, monkeypatch, "datasets", "list")
    assert code == 0
    assert all(len(line) <= 80 for line in stdout.splitlines())
    assert "archive.ics.uci.edu " in stdout and "https://" not in stdout  # a host, never a URL cut in two
    path = tmp_path / "f.csv"
    path.write_text("a,b,label\n1,2,x\n3,4,y\n5,6,x\n")
    code, stdout, _ = dpsgd(capsys, monkeypatch, "datasets", "info", "--path", path, "--label", "label",
                            "--positive", "x")
    assert code == 0
    assert "rows_read: 3\n" in stdout
    assert not [line for line in stdout.splitlines() if "None" in line or "[" in line]


def test_a_first_compile_is_said_once(tmp_path, monkeypatch, capsys):
    import importlib.machinery

    from dpsgd_cli import compiled

    source = tmp_path / "_kernel_numba.py"
    source.write_text("")
    spec = importlib.machinery.ModuleSpec("dpsgd_cli._kernel_numba", None, origin=str(source))
    monkeypatch.setattr(compiled.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(compiled, "_NOTED", [])
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "_kernel_numba.step-1.py311.nbi").write_text("")
    compiled.note_first_compile("_kernel_numba")  # cached: nothing to say
    assert capsys.readouterr().err == ""
    (tmp_path / "__pycache__" / "_kernel_numba.step-1.py311.nbi").unlink()
    compiled.note_first_compile("_kernel_numba")
    compiled.note_first_compile("_kernel_numba")
    assert capsys.readouterr().err.count("compiling the numba kernels") == 1
