"""What an adversary or a clumsy user hands the tool: forged cache entries whose checksums are recomputed,
received results folders with garbage where JSON, numbers or text go, text that a spreadsheet or a terminal would
run, and the first-day mistakes. Each gives one line and exit 2, or the honest result: never a traceback, a forged
number or a cell that runs."""

from __future__ import annotations

import csv
import json
import sys
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from test_robustness import AUDIT_ROW, copy, received, refused  # noqa: F401 (fixtures)
from test_robustness import dpsgd as command

import dpsgd_cli as dpsgd
from dpsgd_cli import diskcache
from dpsgd_cli.cli import main
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.data import load as load_module
from dpsgd_cli.data.spec import DatasetSpec
from dpsgd_cli.engine.folder import FORMULA_STARTS, inert_cell
from dpsgd_cli.engine.results import read_results
from dpsgd_cli.errors import UserError

READERS = ["plot", "report", "select", "export"]


def one_line_or_done(code, stderr):
    """Exit 0 or 1 (what the command found), or 2 with one line: never a traceback."""
    assert "Traceback" not in stderr and code in (0, 1, 2), (code, stderr)
    if code == 2:
        refused(code, stderr)


def rewrite_runs(folder, column, value, rows=slice(None)):
    frame = pd.read_csv(folder / "runs.csv", dtype=str, keep_default_na=False)
    frame.loc[frame.index[rows], column] = value
    frame.to_csv(folder / "runs.csv", index=False)


# --- the processed-data cache: arrays a forger wrote, with the checksum recomputed ------------------------------
def _more_rows(arrays):
    return {**arrays, "X_train": np.vstack([arrays["X_train"]] * 2), "y_train": np.concatenate([arrays["y_train"]] * 2)}


FORGED_ARRAYS = {
    "rows outside the unit ball": lambda a: {**a, "X_train": a["X_train"] * 100},
    "labels other than ±1": lambda a: {**a, "y_train": a["y_train"] * 5},
    "a non-finite feature": lambda a: {**a, "X_test": np.where(np.arange(a["X_test"].size).reshape(a["X_test"].shape)
                                                                 == 0, np.nan, a["X_test"])},
    "test rows of another width": lambda a: {**a, "X_test": a["X_test"][:, :2]},
    "fewer labels than rows": lambda a: {**a, "y_train": a["y_train"][:5]},
    "float32 features": lambda a: {**a, "X_train": a["X_train"].astype(np.float32)},
    "no training rows": lambda a: {**a, "X_train": a["X_train"][:0], "y_train": a["y_train"][:0]},
    "an extra array": lambda a: {**a, "epsilon": np.array(0.01)},
}


@pytest.mark.parametrize("case", list(FORGED_ARRAYS))
def test_a_forged_processed_dataset_cache_is_rebuilt_not_trained_on(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path))
    spec = DatasetSpec(name="synthetic", n=60, dim=4)
    honest = load_module.load_dataset(spec)
    path = load_module.processed_path(spec)
    with np.load(path, allow_pickle=False) as npz:
        key = str(npz["key"])
        arrays = {name: npz[name] for name in load_module.ARRAYS}
    forged = FORGED_ARRAYS[case](arrays)
    stored = {name: forged[name] for name in load_module.ARRAYS}
    with open(path, "wb") as fh:  # the documented checksum, recomputed over what the forger stored
        np.savez(fh, key=np.array(key), sha256=np.array(load_module.arrays_sha256(stored)), **forged)
    capsys.readouterr()
    again = load_module.load_dataset(spec)
    for name in load_module.ARRAYS:
        np.testing.assert_array_equal(getattr(again, name), getattr(honest, name))
    assert "rebuilding it" in capsys.readouterr().err


def test_a_processed_cache_of_rows_beyond_the_ball_is_kept_when_the_spec_leaves_them_there(tmp_path, monkeypatch):
    """The ball is checked only where preprocessing brings rows into it last (not `unit_ball: none`)."""
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path))
    spec = DatasetSpec(name="synthetic", n=60, dim=4, unit_ball="none")
    key = load_module._cache_text(load_module.resolve_spec(spec))
    arrays = {"X_train": np.full((4, 3), 5.0), "y_train": np.array([1.0, -1.0, 1.0, -1.0]),
              "X_test": np.full((2, 3), 5.0), "y_test": np.array([1.0, -1.0])}
    path = tmp_path / "a.npz"
    np.savez(path, key=np.array(key), sha256=np.array(load_module.arrays_sha256(arrays)), **arrays)
    got, why = load_module._read_processed(path, key, load_module.resolve_spec(spec))
    assert why == "" and np.array_equal(got["X_train"], arrays["X_train"])


# --- JSON where a received file holds anything ------------------------------------------------------------------
DEEP = "[" * 60_000 + "]" * 60_000  # deeper than the JSON parser's recursion, shorter than csv's field limit
NOT_AN_OBJECT = ["{not json", "[1, 2]", "5", DEEP]


@pytest.mark.parametrize("text", NOT_AN_OBJECT, ids=["not-json", "list", "number", "deep"])
@pytest.mark.parametrize("column", ["algorithm_params", "dataset_options", "derived"])
def test_a_runs_csv_json_column_without_an_object_is_a_malformed_row(copy, capsys, column, text):  # noqa: F811
    grid_file, folder = copy
    rewrite_runs(folder, column, text, rows=slice(0, 1))
    reading = read_results(folder)
    assert reading.malformed == 1
    for name in READERS:
        one_line_or_done(*command(capsys, name, grid_file, folder))


def test_a_field_beyond_the_csv_size_limit_spoils_its_row_only(copy, capsys):  # noqa: F811
    grid_file, folder = copy
    before = len(read_results(folder).runs)
    rewrite_runs(folder, "message", "x" * 200_000, rows=slice(0, 1))
    reading = read_results(folder)
    assert (reading.malformed, len(reading.runs)) == (1, before - 1)
    for name in READERS:
        one_line_or_done(*command(capsys, name, grid_file, folder))


@pytest.mark.parametrize("text", NOT_AN_OBJECT, ids=["not-json", "list", "number", "deep"])
def test_audit_csv_parameters_without_an_object_are_one_line(copy, capsys, text):  # noqa: F811
    grid_file, folder = copy
    pd.DataFrame([{**AUDIT_ROW, "algorithm_params": text}]).to_csv(folder / "audit.csv", index=False)
    refused(*command(capsys, "report", grid_file, folder), "audit.csv", "JSON object")


@pytest.mark.parametrize("command_name", READERS)
def test_a_manifest_nested_too_deep_is_a_corrupt_manifest(copy, capsys, command_name):  # noqa: F811
    grid_file, folder = copy
    (folder / "manifest.json").write_text(DEEP)
    refused(*command(capsys, command_name, grid_file, folder), "corrupt manifest")


def test_a_cache_entry_nested_too_deep_is_discarded(tmp_path, capsys):
    key = {"what": "x"}
    diskcache.write_entry(tmp_path, key, "value", {"sigma": 1.0})
    diskcache.entry_path(tmp_path, key).write_text('{"key": ' + DEEP + "}")
    assert diskcache.read_entry(tmp_path, key, "value") is None
    assert "discarded" in capsys.readouterr().err and not diskcache.entry_path(tmp_path, key).exists()


# --- text that a spreadsheet would run ----------------------------------------------------------------------------
FORMULAS = ["=HYPERLINK(\"http://example.com\", \"x\")", "+cmd|' /C calc'!A0", "-2+3+cmd|' /C calc'!A0", "@SUM(A1:A9)"]


def _cells(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return [cell for row in csv.reader(fh) for cell in row]


def _runs_as_formula(cell):
    if not cell.startswith(FORMULA_STARTS):
        return False
    try:
        float(cell)
        return False
    except ValueError:
        return True


def test_exported_csvs_hold_no_cell_a_spreadsheet_runs(copy, capsys):  # noqa: F811
    grid_file, folder = copy
    frame = pd.read_csv(folder / "runs.csv", dtype=str, keep_default_na=False)
    for i, formula in enumerate(FORMULAS):
        frame.loc[frame.index[i::len(FORMULAS)], "message"] = formula
    frame.loc[frame["algorithm"] == "erm", "dataset"] = FORMULAS[0]
    frame.to_csv(folder / "runs.csv", index=False)
    for name in ("export", "select"):
        one_line_or_done(*command(capsys, name, grid_file, folder))
    exported = {p: _cells(p) for p in (folder / "runs_valid.csv", folder / "selection.csv")}
    assert all(not _runs_as_formula(c) for cells in exported.values() for c in cells), exported
    assert "'" + FORMULAS[1] in exported[folder / "runs_valid.csv"]  # the text kept, marked as text


# --- numbers no run of the tool writes ----------------------------------------------------------------------------
@pytest.mark.parametrize("column", ["test_accuracy", "epsilon"])
@pytest.mark.parametrize("value", ["inf", "-inf"])
def test_an_infinite_number_in_a_received_runs_csv_is_no_point(copy, capsys, column, value):  # noqa: F811
    grid_file, folder = copy
    frame = pd.read_csv(folder / "runs.csv", dtype=str, keep_default_na=False)
    frame.loc[frame[column] != "", column] = value
    frame.to_csv(folder / "runs.csv", index=False)
    for name in READERS:
        one_line_or_done(*command(capsys, name, grid_file, folder))


# --- text that a terminal would run -------------------------------------------------------------------------------
ESCAPES = ["\x1b]0;pwned\x07", "\x1b[2K\rc: PASS", "\u202egnissap"]


@pytest.mark.parametrize("text", ESCAPES, ids=["osc", "erase-line", "bidi-override"])
def test_grid_text_that_acts_on_a_terminal_is_one_line_refused(write_grid, capsys, text):
    grid = write_grid(f"""
        grids:
          - name: t
            description: {json.dumps(text)}
            datasets: [synthetic]
            algorithms: [erm]
        """)
    with pytest.raises(UserError, match="control character|one line") as refused_grid:
        load_grid_file(grid)
    assert "\x1b" not in str(refused_grid.value) and "\u202e" not in str(refused_grid.value)


@pytest.mark.parametrize("text", ESCAPES, ids=["osc", "erase-line", "bidi-override"])
def test_received_text_reaches_the_terminal_and_report_md_inert(copy, capsys, text):  # noqa: F811
    grid_file, folder = copy
    rewrite_runs(folder, "dataset", text)
    for name in ("select", "report"):
        capsys.readouterr()
        with mock.patch.object(sys, "argv", ["dpsgd", name, str(folder)]), pytest.raises(SystemExit):
            main()
        printed = capsys.readouterr()
        assert not any(c in printed.out + printed.err for c in "\x1b\x07\u202e"), printed
    assert not any(c in (folder / "report.md").read_text() for c in "\x1b\x07\u202e")


def test_a_user_error_quoting_a_value_shows_no_control_character():
    assert str(UserError("dataset '\x1b[31mx\x07': unknown")) == "dataset '\ufffd[31mx\ufffd': unknown"


# --- the first day -------------------------------------------------------------------------------------------------
def test_the_dry_run_of_a_one_cell_audit_prints_its_table(received, capsys):  # noqa: F811
    grid_file, folder = received
    audit_grid = grid_file.with_name("one.yaml")
    audit_grid.write_text(grid_file.with_name("audit.yaml").read_text().replace("[0.5, 1, 2]", "[1]"))
    capsys.readouterr()
    with mock.patch.object(sys, "argv", ["dpsgd", "audit", str(audit_grid), "--out", str(folder.parent),
                                         "--dry-run"]), pytest.raises(SystemExit) as done:
        main()
    printed = capsys.readouterr()
    assert done.value.code == 0 and "Traceback" not in printed.err, printed.err
    assert "1 cells to audit" in printed.out


def test_api_select_turns_a_folder_in_the_way_into_one_line(copy):  # noqa: F811
    _, folder = copy
    (folder / "selection.csv").unlink(missing_ok=True)
    (folder / "selection.csv").mkdir()
    with pytest.raises(UserError, match="is a folder where dpsgd expects a file"):
        dpsgd.select(folder)


def test_the_csv_writer_keeps_numbers_and_other_text_as_they_were():
    assert [inert_cell(v) for v in ["-0.5", "+1e-3", "dp_sgd", "", "=1+1", "\t=x", 3, None]] == \
        ["-0.5", "+1e-3", "dp_sgd", "", "'=1+1", "'\t=x", 3, None]


@pytest.mark.parametrize("key, value", [
    ("algorithms", [None]), ("algorithms", [5]), ("algorithms", [{"name": ["sgd"]}]),
    ("algorithms", [{"name": "dp_sgd", "params": 5, "overrides": 1}]), ("models", [None]),
    ("models", [{"name": ["logreg"]}]), ("models", [{"name": "logreg", "options": 5}]),
    ("datasets", [{"name": "file", "path": None}]),
])
def test_a_grid_entry_of_the_wrong_shape_is_one_line(write_grid, key, value):
    grid = {"name": "t", "datasets": ["synthetic"], "algorithms": ["erm"], key: value}
    with pytest.raises(UserError, match=rf"grids\[0\]\.{key}\[0\]"):
        load_grid_file(write_grid(json.dumps({"grids": [grid]})))


def test_a_folder_where_the_processed_cache_file_goes_only_loses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path))
    spec = DatasetSpec(name="synthetic", n=60, dim=4)
    load_module.processed_path(spec).mkdir(parents=True)
    dataset = load_module.load_dataset(spec)
    assert dataset.X_train.shape[1] == 4 and load_module.processed_path(spec).is_dir()
    assert not list(load_module.processed_path(spec).parent.glob(".*.tmp"))


@pytest.mark.parametrize("column, value", [("train_objective", "inf"), ("examples", "inf"), ("examples", "-5")])
def test_a_received_traces_csv_with_numbers_no_axis_holds_is_no_point(copy, capsys, column, value):  # noqa: F811
    grid_file, folder = copy
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["grid"]["figures"] = [{"name": "tr", "kind": "traces", "metric": "train_objective"}]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    traces = pd.read_csv(folder / "traces.csv", dtype=str, keep_default_na=False)
    traces.assign(**{column: value}).to_csv(folder / "traces.csv", index=False)
    for name in ("plot", "export"):
        one_line_or_done(*command(capsys, name, grid_file, folder))
