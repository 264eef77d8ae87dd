"""The Python API (`import dpsgd_cli as dpsgd`): the same functions the commands call, returning DataFrames."""

import inspect
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import dpsgd_cli as dpsgd
from dpsgd_cli.cli import app

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
    validation: 0.1
  - name: other
    datasets: [synthetic]
    algorithms: [erm]
    seeds: 1
"""


@pytest.fixture
def grid_file(write_grid):
    return write_grid(GRID)


def test_importing_the_package_loads_no_heavy_module():
    heavy = ("pandas", "numpy", "scipy", "matplotlib", "rich", "typer", "pydantic", "numba", "dp_accounting")
    code = f"import sys, dpsgd_cli; print([m for m in {heavy!r} if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_run_returns_the_runs_as_read_results_reads_them(grid_file, tmp_path, capsys):
    out = tmp_path / "results"
    frame = dpsgd.run(grid_file, only=["tiny"], out=out, set={"epochs": 1}, seeds=2, quiet=True)
    assert capsys.readouterr().out == ""  # quiet
    assert isinstance(frame, pd.DataFrame) and len(frame) == 2 * 2 and set(frame["status"]) == {"ok"}
    assert frame.attrs["failed"] == 0 and not (out / "other").exists()
    assert set(frame["epochs"].dropna()) == {1.0} and set(frame["seed"]) == {0, 1}
    read = dpsgd.read_results(out)
    pd.testing.assert_frame_equal(read, frame)
    pd.testing.assert_frame_equal(dpsgd.read_results(out / "tiny"), frame)
    again = dpsgd.run(grid_file, only="tiny", out=out, set=["epochs=1", "seeds=2"], quiet=True)  # resumed: no work
    pd.testing.assert_frame_equal(again, frame)


def test_run_shares_the_commands_implementation(grid_file, tmp_path):
    from dpsgd_cli import api

    assert dpsgd.run is api.run and dpsgd.epsilon is api.epsilon and dpsgd.plot is api.plot
    result = CliRunner().invoke(app, ["run", str(grid_file), "--only", "tiny", "--out", str(tmp_path / "cli"),
                                      "--set", "epochs=1", "--seeds", "2"])
    assert result.exit_code == 0, result.output
    by_api = dpsgd.run(grid_file, only=["tiny"], out=tmp_path / "api", set={"epochs": 1}, seeds=2, quiet=True)
    by_cli = dpsgd.read_results(tmp_path / "cli")
    assert sorted(by_cli["run_id"]) == sorted(by_api["run_id"])


def test_read_results_skips_malformed_rows_as_the_readers_do(grid_file, tmp_path, capsys):
    out = tmp_path / "results"
    dpsgd.run(grid_file, only=["tiny"], out=out, quiet=True)
    csv = out / "tiny" / "runs.csv"
    csv.write_text(csv.read_text() + "not,a,row\n")
    frame = dpsgd.read_results(out)
    assert len(frame) == 2 and "malformed" in capsys.readouterr().err
    with pytest.raises(dpsgd.UserError, match="no runs.csv"):
        dpsgd.read_results(tmp_path / "nothing")


def test_privacy_calculators_match_the_commands():
    eps = dpsgd.epsilon(sigma=1.1, sample_rate=0.01, steps=1000, delta=1e-5)
    cli = CliRunner().invoke(app, ["epsilon", "--sigma", "1.1", "--sample-rate", "0.01", "--steps", "1000",
                                   "--delta", "1e-5"])
    assert cli.exit_code == 0 and f"ε = {eps:.6g}" in cli.output
    sigmas = dpsgd.sigma(epsilon=[1.0, 2.0], sample_rate=0.01, steps=1000, delta=1e-5, accountant="rdp")
    assert sigmas[0] > sigmas[1] > 0
    assert dpsgd.sigma(epsilon=2.0, sample_rate=0.01, steps=1000, delta=1e-5) == sigmas[1]
    assert dpsgd.epsilon(sigma=sigmas[1], sample_rate=0.01, steps=1000, delta=1e-5) <= 2.0
    with pytest.raises(dpsgd.UserError, match="--accountant xyz: choose one of rdp, pld"):
        dpsgd.epsilon(sigma=1.0, sample_rate=0.01, steps=10, delta=1e-5, accountant="xyz")


def test_export_and_plot(grid_file, tmp_path, monkeypatch):
    out = tmp_path / "results"
    frame = dpsgd.run(grid_file, out=out, quiet=True)
    paths = dpsgd.export(out)
    assert paths == [out / "other" / "runs.parquet", out / "tiny" / "runs.parquet"]
    parquet = pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)
    assert sorted(parquet["run_id"]) == sorted(frame["run_id"]) and parquet["test_accuracy"].dtype == float
    assert [p.suffix for p in dpsgd.plot(out / "tiny", metric="accuracy")] == [".png", ".pdf"]
    with pytest.raises(dpsgd.UserError, match="not a numeric column of runs.csv .*did you mean 'val_accuracy'"):
        dpsgd.plot(out, metric="val_acuracy")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # not installed
    with pytest.raises(dpsgd.UserError, match=r"needs pyarrow: pip install 'dpsgd\[parquet\]'"):
        dpsgd.export(out)


def test_plot_metric_accepts_every_numeric_column_of_runs_csv():
    from dpsgd_cli.api import check_metric
    from dpsgd_cli.engine.results import NUMERIC

    for column in ("val_accuracy", "test_accuracy", "wall_time", "sigma", "accuracy"):
        assert check_metric(column) == column
    assert set(dpsgd.api.metrics()) == {"accuracy"} | NUMERIC - {"seed", "examples"}  # examples: a traces.csv column


AUDIT_GRID = """
    grids:
      - name: tiny_audit
        datasets: [{name: synthetic, n: 300, dim: 5}]
        algorithms: [dp_sgd]
        epsilon: [1]
        batch_size: [32]
        epochs: 1
        lr: 0.5
        seeds: 1
        delta: 1.0e-5
        audit: {canaries: [input], trials: 20}
    """


def test_audit_returns_the_rows_of_audit_csv(write_grid, tmp_path):
    grid = write_grid(AUDIT_GRID)
    seen = []
    frame = dpsgd.audit(grid, out=tmp_path / "res", trials=10, on_rows=seen.extend)
    on_disk = pd.read_csv(tmp_path / "res" / "tiny_audit" / "audit.csv")
    assert len(frame) == len(on_disk) == len(seen) >= 1 and (frame["trials"] == 10).all()
    from dpsgd_cli.audit.engine import COLUMNS  # the subpackage of the same name, still a module

    assert list(frame.columns) == COLUMNS and dpsgd.audit.engine.COLUMNS is COLUMNS


# --- grids from Python, typed results -----------------------------------------------------------------------------

def test_run_takes_the_grid_as_a_path_yaml_text_a_dict_or_grids(grid_file, tmp_path, monkeypatch):
    import yaml

    from dpsgd_cli.config import load_grid_file

    monkeypatch.chdir(tmp_path)
    document = yaml.safe_load(GRID)
    tiny = load_grid_file(grid_file).grids[0]
    ids = {}
    for kind, grid in [("path", grid_file), ("text", GRID), ("dict", document), ("one grid", document["grids"][0]),
                       ("Grid", tiny), ("list", [tiny, document["grids"][1]])]:
        frame = dpsgd.run(grid, only="tiny", out=tmp_path / kind, set={"epochs": 1}, quiet=True)
        assert (tmp_path / kind / "tiny" / "runs.csv").exists(), kind  # the folder is named after the grid
        ids[kind] = sorted(frame["run_id"])
    assert all(found == ids["path"] for found in ids.values()), ids
    assert document == yaml.safe_load(GRID)  # the overrides are set in a copy


def test_a_grid_given_from_python_is_checked_as_a_file_is(grid_file):
    bad = GRID.replace("epochs: 2", "epoch: 2")
    import yaml

    for grid, source in [(bad, "grid (YAML text)"), (yaml.safe_load(bad), "grid (a dict)")]:
        with pytest.raises(dpsgd.UserError) as caught:
            dpsgd.run(grid, dry_run=True, quiet=True)
        assert str(caught.value) == f"{source}: grids[0]: unknown key 'epoch' (did you mean 'epochs'?)"
    with pytest.raises(dpsgd.UserError, match=r"^grid \(YAML text\): invalid YAML at line \d+, column \d+: "):
        dpsgd.run("grids:\n  - [", dry_run=True, quiet=True)
    with pytest.raises(dpsgd.UserError, match=r"^missing.yaml: no such file"):
        dpsgd.run("missing.yaml", dry_run=True, quiet=True)  # one line, no newline, no `grids:`: a path
    with pytest.raises(TypeError, match=r"^grid \[5\]: expected .*a Grid"):
        dpsgd.run([5])


def test_read_results_gives_typed_columns_and_the_private_flag(grid_file, tmp_path):
    out = tmp_path / "results"
    frame = dpsgd.run(grid_file, only="tiny", out=out, set={"epochs": 1, "algorithms": ["erm", "sgd", "dp_sgd"]},
                      quiet=True)
    assert not {"dataset_options", "model_options", "algorithm_params", "derived"} & set(frame.columns)
    assert frame["dataset_options.n"].tolist() == [300] * len(frame)
    assert str(frame["dataset_options.n"].dtype) == "Int64"
    assert frame["private"].dtype == bool
    assert frame["private"].tolist() == [a == "dp_sgd" for a in frame["algorithm"]]
    assert frame["epsilon"].isna().tolist() == (~frame["private"]).tolist()
    assert set(frame.loc[frame["private"], "algorithm_params.accountant"]) == {"rdp"}
    assert frame.groupby(["private", "algorithm"]).size().sum() == len(frame)  # no NaN key drops a row
    for column in ("tpr_bound_fpr_1e-2", "tpr_bound_fpr_1e-3", "gdp_mu"):  # attack risk: private rows only
        assert frame[column].dtype == float and frame[column].isna().tolist() == (~frame["private"]).tolist()
    assert frame.loc[frame["private"], "tpr_bound_from"].tolist() == ["pld"] * frame["private"].sum()
    pd.testing.assert_frame_equal(dpsgd.read_results(out), frame)
    parquet = pd.read_parquet(dpsgd.export(out)[0])
    pd.testing.assert_frame_equal(parquet, frame)  # the same columns and types


def test_select_returns_the_choices_as_the_command_writes_them(grid_file, tmp_path):
    out = tmp_path / "results"
    dpsgd.run(grid_file, only="tiny", out=out, quiet=True,
              set={"epochs": 1, "lr": [0.25, 1], "select": [{"name": "tuned", "candidates": ["lr"]}]})
    chosen = dpsgd.select(out)
    on_disk = pd.read_csv(out / "tiny" / "selection.csv")
    assert list(chosen.columns) == ["grid", *on_disk.columns] and set(chosen["grid"]) == {"tiny"}
    assert chosen["chosen"].tolist() == on_disk["chosen"].tolist() and len(chosen) == 2  # erm and dp_sgd at ε=1
    with pytest.raises(dpsgd.UserError, match="no grid here has `select:`"):
        dpsgd.run(grid_file, only="other", out=tmp_path / "plain", quiet=True)
        dpsgd.select(tmp_path / "plain")


def test_typed_runs_keeps_one_kind_per_column(capsys):
    from dpsgd_cli.engine.results import typed_runs

    frame = pd.DataFrame({"algorithm": ["dp_sgd", "erm", "gone"], "epsilon": [1.0, None, 2.0],
                          "algorithm_params": ['{"a": 1, "b": true, "c": "x"}', "{}", '{"a": 2.5, "c": 3}'],
                          "derived": ["", '{"d": {"e": 1}}', "not json"]})
    typed = typed_runs(frame)
    assert typed["algorithm_params.a"].tolist()[0::2] == [1.0, 2.5] and typed["algorithm_params.a"].isna()[1]
    assert typed["algorithm_params.a"].dtype == float and str(typed["algorithm_params.b"].dtype) == "boolean"
    assert typed["algorithm_params.c"].tolist()[0::2] == ["x", "3"]  # a column mixing kinds is text
    assert typed["derived.d"].tolist()[1] == '{"e": 1}'
    assert typed["private"].tolist() == [True, False, True]  # an unknown algorithm: private where it has an ε
    assert "derived: 1 row(s) hold no JSON object" in capsys.readouterr().err


def test_audit_takes_set_and_seeds_as_run_does(write_grid, tmp_path):
    grid = write_grid(AUDIT_GRID)
    cells = dpsgd.audit(grid, dry_run=True, set={"epsilon": [0.5, 2], "audit.trials": 30}, seeds=2)
    assert sorted(cells["epsilon"]) == [0.5, 2] and set(cells["trials"]) == {30}
    result = CliRunner().invoke(app, ["audit", str(grid), "--dry-run", "--set", "epsilon=[0.5, 2]", "--seeds", "2"])
    assert result.exit_code == 0, result.output
    assert "2 cells to audit" in result.output
    with pytest.raises(dpsgd.UserError, match=r"--set epoch=1: grids\[0\]: unknown key 'epoch'"):
        dpsgd.audit(grid, dry_run=True, set=["epoch=1"])


def test_the_tutorial_of_python_api_md_runs_top_to_bottom(tmp_path, monkeypatch):
    """Every Python block of docs/python-api.md's tutorial, in order, in one namespace, as a notebook runs them."""
    tutorial = (Path(__file__).parents[1] / "docs" / "python-api.md").read_text().split("\n## Reference")[0]
    blocks = re.findall(r"```python\n(.*?)```", tutorial, flags=re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/python-api.md", "exec"), namespace)
    assert len(namespace["runs"]) == 18 and set(namespace["audited"]["algorithm"]) == {"dp_sgd"}


def test_example_script_runs(tmp_path, monkeypatch):
    """examples/notebook.py, shortened by its SMALL switch, runs from a fresh folder."""
    example = Path(__file__).parents[1] / "examples" / "notebook.py"
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "DPSGD_EXAMPLE_SMALL": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "results" / "report.html").exists()


def test_quiet_silences_the_reference_optimum_lines(grid_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DPSGD_CACHE_DIR", str(tmp_path / "cache"))
    for quiet, l2 in ((False, 1e-3), (True, 2e-3)):  # a λ of its own each: an L* this process has not computed
        dpsgd.run(grid_file, only=["tiny"], out=tmp_path / str(quiet), set={"epochs": 1, "l2": l2}, seeds=1,
                  quiet=quiet)
        out, err = capsys.readouterr()
        assert ("reference optimum" in out + err) is not quiet, (quiet, out, err)


# --- the door: every argument checked when called ------------------------------------------------------------------

def public_functions() -> dict:
    """What `import dpsgd_cli` exports and every public function of dpsgd_cli.api, as the api's functions."""
    from dpsgd_cli import api

    names = {n for n in dpsgd.__all__ if n != "UserError"}
    names |= {n for n, f in vars(api).items() if inspect.isfunction(f) and not n.startswith("_")
              and f.__module__ == api.__name__}
    return {name: getattr(api, name) for name in sorted(names)}


# a valid value of each parameter (by function where the same name takes another type), and wrong ones: of the
# wrong type, and of the right type out of range
VALID = {"only": ["tiny"], "jobs": 1, "dry_run": True, "no_resume": False, "selected": False, "caption": True,
         "scheduler": None,
         "set": {"epochs": 1}, "seeds": 1, "quiet": True, "metric": "accuracy", "format": "png", "trials": 10,
         "confidence": 0.95,
         "on_rows": print, "sigma": 1.0, "sample_rate": 0.01, "steps": 100, "delta": 1e-5, "accountant": "rdp",
         "neighbours": "add_remove", "epsilon": 1.0, "plugins": [], "plugin": "my_alg.py"}
VALID_IN = {"export": {"format": "csv"}, "calibrations": {"epsilon": [1.0]}}
NAN, INF = math.nan, math.inf
PATHS = [5, None, ["a"]]
WRONG_TYPE = {
    "grid": PATHS, "out": PATHS, "folder": PATHS, "results_dir": PATHS, "plugin": PATHS,
    "plugins": [5, [5], {"a.py": 1}, None],
    "only": [5, [1], {"tiny": 1}], "jobs": ["2", True, 2.5, None], "seeds": ["3", True, 2.5],
    "dry_run": [1, "yes", None], "no_resume": [1, "yes"], "selected": [1, "yes", None], "caption": [1, "no"],
    "quiet": [1, "no"], "scheduler": [5, ["tcp://x:1"]],
    "set": [{5: 1}, 5, [1], {"epochs": 1, 2: 3}], "metric": [3, ["accuracy"]], "format": [None, 5],
    "trials": [2.5, "10", True], "confidence": ["0.9", True, [0.9]], "on_rows": [5, "print"],
    "sigma": ["1", True, None, [1.0]], "sample_rate": ["0.1", None], "steps": ["100", 2.5, True],
    "delta": ["1e-5", None], "accountant": [5, None], "neighbours": [5, ["add_remove"]],
    "epsilon": [[1, "x"], "1", True, None, {1.0: 1}],
}
OUT_OF_RANGE = {
    "jobs": [0, -1], "trials": [1, 0], "confidence": [NAN, INF, 1.5, 0.0], "format": ["jpg"],
    "metric": ["val_acuracy"], "sigma": [NAN, INF, 0.0, -1.0], "sample_rate": [NAN, 0.0, 2.0], "steps": [0, -5],
    "delta": [NAN, 1.5, 0.0], "accountant": ["xyz"], "neighbours": ["both"], "epsilon": [NAN, -1.0, [1.0, NAN], INF],
}
OUT_OF_RANGE_IN = {"export": {"format": ["xlsx"]}, "calibrations": {"epsilon": [[NAN], [-1.0], [1.0, INF]]}}


def _calls(function, grid_file, tmp_path):
    """(parameter, wrong value, error class) for every parameter of `function`, each with valid other arguments."""
    valid = {**VALID, "grid": grid_file, "out": tmp_path / "results", "folder": tmp_path,
             "results_dir": tmp_path, **VALID_IN.get(function.__name__, {})}
    parameters = inspect.signature(function).parameters
    for name in parameters:
        assert name in valid and name in WRONG_TYPE, f"{function.__name__}({name}=...): no test values"
        out_of_range = OUT_OF_RANGE_IN.get(function.__name__, {}).get(name, OUT_OF_RANGE.get(name, []))
        for wrong, error in [*((w, TypeError) for w in WRONG_TYPE[name]), *((w, ValueError) for w in out_of_range)]:
            args = {n: valid[n] for n in parameters if parameters[n].default is inspect.Parameter.empty}
            yield name, {**args, name: wrong}, error


def test_every_argument_of_every_public_function_is_checked_at_the_door(grid_file, tmp_path):
    functions = public_functions()
    assert {"run", "read_results", "export", "plot", "report", "audit", "epsilon", "sigma", "calibrations"} <= \
        set(functions)
    for function in functions.values():
        for name, kwargs, error in _calls(function, grid_file, tmp_path):
            with pytest.raises(dpsgd.UserError) as caught:
                function(**kwargs)
            message = str(caught.value)
            where = f"{function.__name__}({name}={kwargs[name]!r})"
            assert isinstance(caught.value, error), f"{where}: {type(caught.value).__name__}: {message}"
            assert name in message or f"--{name.replace('_', '-')}" in message, f"{where}: {message}"
            assert "\n" not in message, where
    assert not (tmp_path / "results").exists()  # nothing ran


def test_the_issues_examples_are_one_line_naming_the_argument(grid_file):
    cases = [(lambda: dpsgd.audit(grid_file, trials=2.5), TypeError, "--trials 2.5: expected an integer"),
             (lambda: dpsgd.run(grid_file, jobs="2"), TypeError, "--jobs '2': expected an integer, got str"),
             (lambda: dpsgd.run(grid_file, jobs=True), TypeError, "--jobs True: expected an integer, got bool"),
             (lambda: dpsgd.run(grid_file, set={5: 1}), TypeError, "--set {5: 1}: expected a mapping with string keys"),
             (lambda: dpsgd.run(grid_file, scheduler=5), TypeError, "--scheduler 5: expected a string"),
             (lambda: dpsgd.sigma(epsilon=[1, "x"], sample_rate=0.01, steps=10, delta=1e-5), TypeError,
              "--epsilon [1, 'x']: expected a number or a list of numbers"),
             (lambda: dpsgd.epsilon(sigma=NAN, sample_rate=0.01, steps=10, delta=1e-5), ValueError,
              "--sigma nan: not a finite number"),
             (lambda: dpsgd.run(grid_file, job=2), TypeError,
              "unexpected keyword argument 'job' (did you mean 'jobs'?)")]
    for call, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()


def test_integral_numbers_and_single_names_are_accepted_as_before(grid_file, tmp_path):
    assert dpsgd.epsilon(sigma=1, sample_rate=0.01, steps=1e3, delta=1e-5) == \
        dpsgd.epsilon(sigma=1.0, sample_rate=0.01, steps=1000, delta=1e-5)
    import numpy as np

    assert dpsgd.sigma(epsilon=np.array([2.0]), sample_rate=0.01, steps=np.int64(1000), delta=1e-5) == \
        [dpsgd.sigma(epsilon=2, sample_rate=0.01, steps=1000, delta=1e-5)]
    frame = dpsgd.run(grid_file, only=(name for name in ["tiny"]), out=tmp_path / "r", set={"epochs": 1}, quiet=True)
    assert set(frame["grid"]) == {"tiny"} and len(frame) == 2
