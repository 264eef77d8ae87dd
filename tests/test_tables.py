"""The tables the commands print read at 80 columns: a row shows what sets it apart (what all rows share is
said once above the table), and nothing that tells rows apart is cut."""

import json

import pytest
from rich.console import Console
from test_validation import dpsgd

from dpsgd_cli.engine.summary import summary_frame

WIDTH = 80
ALGORITHMS = """
grids:
  - name: wide
    datasets: [{name: synthetic, n: 400, dim: 3}]
    algorithms:
      - erm
      - {name: noisy_gd, accountant: dynamics, lr: [3.99], epochs: [50]}
      - {name: noisy_gd, accountant: composition, lr: [3.99], epochs: [50]}
      - {name: pidp_sgd, radius: 1.0e+3, batch_size: [1], lr: [0.05]}
      - {name: pidp_sgd, radius: 1.0e+9, batch_size: [1], lr: [0.05]}
      - {name: bolt_on, case: convex, calibration: analytic}
      - {name: song2013_nonprivate, schedule: inv_t}
      - {name: song2013_nonprivate, schedule: inv_sqrt}
      - dp_sgd
    epsilon: [0.5, 1]
    batch_size: [64]
    lr: [0.5]
    epochs: 2
    l2: 1.0e-3
    clip_norm: 1.0
    seeds: 2
    audit: {canaries: [input], trials: 10}
  - name: tuned
    datasets: [{name: synthetic, n: 400, dim: 3}]
    algorithms: [sgd, dp_sgd]
    epsilon: [0.3, 1]
    batch_size: [50]
    lr: [0.5, 2]
    epochs: 1
    seeds: 2
    validation: 0.1
    select:
      - {name: on_validation, candidates: [lr], score: val_accuracy}
      - {name: private_search, candidates: [lr], score: val_accuracy, privacy: papernot_steinke,
         distribution: poisson, mean: 10}
"""
TELLS_APART = ["accountant=dynamics", "accountant=composition", "radius=1000", "radius=1e+09", "schedule=inv_t",
               "schedule=inv_sqrt", "output_perturbation", "song2013_nonprivate"]


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))


def fits(text: str) -> str:
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, "\n".join(wide)
    return text


def test_dry_run_rows_fit_80_columns_and_name_what_sets_them_apart(write_grid, narrow, capsys, monkeypatch):
    grid = write_grid(ALGORITHMS)
    code, stdout, err = dpsgd(capsys, monkeypatch, "run", grid, "--only", "wide", "--dry-run")
    assert code == 0, err
    for value in TELLS_APART[:-2]:
        assert value in fits(stdout), value
    assert "bolt_on(calibration=analytic, case=convex)" in stdout  # shared by its rows: said once, above
    assert "λ=0.001" in stdout and "0.001 " not in stdout.split("─")[-1]  # and so is λ, not in a column

    code, stdout, err = dpsgd(capsys, monkeypatch, "run", grid, "--only", "tuned", "--dry-run")
    assert code == 0, err
    rows = [line for line in fits(stdout).splitlines() if line.startswith("dp_sgd")]
    assert len(rows) == 8 and sum("private_search" in row for row in rows) == 4  # calibrated candidates


def test_audit_dry_run_shows_the_cells_to_audit(write_grid, narrow, capsys, monkeypatch):
    private = "".join(line for line in ALGORITHMS.splitlines(keepends=True)  # an audit lists private algorithms only
                      if line.strip() not in ("- erm", "- {name: song2013_nonprivate, schedule: inv_t}",
                                              "- {name: song2013_nonprivate, schedule: inv_sqrt}"))
    code, stdout, err = dpsgd(capsys, monkeypatch, "audit", write_grid(private), "--only", "wide", "--dry-run")
    assert code == 0, err
    assert "wide: 12 cells to audit" in fits(stdout) and "canaries=input" in stdout
    for value in TELLS_APART[:4]:
        assert value in stdout, value


def test_audit_table_fits_80_columns():
    from dpsgd_cli.cli import audit_table

    rows = [{"grid": "g", "dataset": "synthetic", "model": "logreg", "algorithm": algorithm,
             "algorithm_params": json.dumps(params), "canary": canary, "threat_model": threat, "epsilon_claimed": eps,
             "delta": 1e-5, "epsilon_lo": 0.1234, "auc": 0.5, "verdict": "refuted" if eps == 4 else "consistent",
             "status": "ok", "message": ""}
            for algorithm, params in (("output_perturbation", {"calibration": "analytic"}),
                                      ("pidp_sgd", {"radius": 1e3}), ("pidp_sgd", {"radius": 1e9}))
            for eps in (0.5, 4)
            for canary, threat in (("input", "black-box, last iterate"), ("dirac", "white-box, all iterates"))]
    rows[-1].update(status="failed", message="ValueError: the canary could not be placed", verdict=None)
    console = Console(width=WIDTH, record=True)
    console.print(audit_table(rows, "g: audit"))
    text = fits(console.export_text())
    assert all(value in text for value in ("output_perturbation", "radius=1000", "radius=1e+09", "refuted"))
    assert "δ = 1e-05" in text and "failed: ValueError" in text


NO_TEST_SPLIT = """
grids:
  - name: nosplit
    datasets: [{name: synthetic, n: 400, dim: 3, split: none}]
    algorithms: [erm, {name: song2013, schedule: inv_t}, {name: song2013, schedule: inv_sqrt}]
    epsilon: [1]
    batch_size: [5]
    lr: [1.0]
    epochs: 1
    seeds: 3
    figures:
      - {name: objective, x: epsilon, metric: train_objective}
"""


def test_summary_without_a_test_split_shows_the_spread_of_the_metric_it_summarises(write_grid, narrow, capsys,
                                                                                      monkeypatch, tmp_path):
    code, stdout, err = dpsgd(capsys, monkeypatch, "run", write_grid(NO_TEST_SPLIT), "--out", tmp_path / "r")
    assert code == 0, err
    assert "nan" not in fits(stdout) and "no test accuracy: the data have no test split" in stdout
    rows = {line.split("  ")[0]: line for line in stdout.splitlines() if line.startswith(("erm", "song2013"))}
    assert "±" not in rows["erm"]  # the same objective every seed
    assert "±" in rows["song2013 schedule=inv_t"] and "±" in rows["song2013 schedule=inv_sqrt"]
    frame = summary_frame(tmp_path / "r" / "nosplit")
    assert frame.attrs["metrics"] == ["train_objective"]
    assert list(frame["identical"]) == [True, False, False]
