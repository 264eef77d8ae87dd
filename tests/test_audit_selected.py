"""`dpsgd audit RESULTS --selected`: the audit trains exactly the private configurations a grid's `select:` chose,
with the grid as it was run (its validation split, so the same n and δ), and writes audit.csv beside runs.csv."""

from __future__ import annotations

import pandas as pd
import pytest
from test_validation import dpsgd, one_line_error

from dpsgd_cli import api
from dpsgd_cli.engine.selection import chosen_cells

GRID = {
    "name": "tuned",
    "datasets": [{"name": "synthetic", "n": 400}],
    "models": [{"name": "logreg"}],
    "algorithms": [{"name": "sgd"}, {"name": "dp_sgd"}],
    "epsilon": [2.0],
    "batch_size": [32],
    "lr": [0.01, 1.0],
    "epochs": 1,
    "seeds": 2,
    "validation": 0.25,
    "select": [{"name": "lr_by_validation", "candidates": ["lr"], "score": "val_accuracy"}],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("selected") / "results"
    runs = api.run(GRID, out=out, quiet=True)
    return out, runs


def test_the_audit_trains_the_chosen_private_cells_as_run(results) -> None:
    out, runs = results
    chosen = chosen_cells(out / "tuned")
    private = runs[runs["algorithm"] == "dp_sgd"]
    assert chosen & set(private["cell_id"]), "the selection chose a dp_sgd cell"
    frame = api.audit(out, selected=True, trials=4)
    assert set(frame["cell_id"]) == chosen & set(private["cell_id"])  # one lr of two, and no sgd
    assert (out / "tuned" / "audit.csv").exists()
    row = private[private["cell_id"] == frame["cell_id"].iloc[0]].iloc[0]
    assert frame["delta"].eq(row["delta"]).all()  # the δ of the run: the split's n, not the whole data's
    assert frame["lr"].eq(row["lr"]).all()
    other_lr = set(private["lr"]) - {row["lr"]}
    assert other_lr and not frame["lr"].isin(other_lr).any()


def test_dry_run_lists_only_the_chosen_cells(results) -> None:
    out, runs = results
    cells = api.audit(out, selected=True, trials=4, dry_run=True)
    assert len(cells) == len(chosen_cells(out / "tuned") & set(runs.loc[runs["algorithm"] == "dp_sgd", "cell_id"]))


def test_refusals_are_one_line(results, tmp_path, capsys, monkeypatch) -> None:
    out, _ = results
    assert "do not apply" in one_line_error(capsys, monkeypatch, "audit", out, "--selected", "--set", "epochs=2")
    plain = dict(GRID, name="plain")
    plain.pop("select")
    plain.pop("validation")
    api.run(plain, out=tmp_path / "r", quiet=True)
    assert "no grid here chose" in one_line_error(capsys, monkeypatch, "audit", tmp_path / "r", "--selected")


def test_the_command_prints_the_audit_and_where_it_wrote(results, capsys, monkeypatch) -> None:
    out, _ = results
    code, stdout, _ = dpsgd(capsys, monkeypatch, "audit", out, "--selected", "--trials", "4")
    assert code == 0
    assert "audit.csv" in stdout and "tuned" in stdout
    assert not pd.read_csv(out / "tuned" / "audit.csv").empty
