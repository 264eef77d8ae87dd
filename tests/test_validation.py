"""Everything is checked before any work: each class of bad spec, name, path or workload is
one line on stderr and exit code 2, in-process through the CLI entry point (as a user sees it), before any data
is loaded or memory allocated."""

import os
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpsgd_cli import cli
from dpsgd_cli.analytic_params import PrivacyCurveParams, bounds
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import checks
from dpsgd_cli.engine.results import COLUMNS
from dpsgd_cli.engine.selection import frame_columns, results_frame

BASE = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 300}]
    algorithms: [erm, dp_sgd]
    epsilon: [1]
    batch_size: [32]
    lr: [0.5]
    seeds: 1
    epochs: 1
"""


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "400")  # help text on one line per option


def dpsgd(capsys, monkeypatch, *args):
    """(exit code, stdout, stderr) of `dpsgd ARGS` through `cli.main`, the console entry point."""
    monkeypatch.setattr(sys, "argv", ["dpsgd", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def one_line_error(capsys, monkeypatch, *args) -> str:
    code, _, err = dpsgd(capsys, monkeypatch, *args)
    assert code == 2, err
    assert err.startswith("error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err


def grid_with(tmp_path, extra: str = "", replace: tuple[str, str] = ("", "")) -> str:
    text = textwrap.dedent(BASE).replace(*replace) if replace[0] else textwrap.dedent(BASE)
    path = tmp_path / "grid.yaml"
    path.write_text(text + textwrap.indent(textwrap.dedent(extra), "    "))
    return str(path)


def no_data_loaded(monkeypatch):
    """Fail the test if anything loads a dataset (checks must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a dataset was loaded before the checks refused the grid")
    monkeypatch.setattr("dpsgd_cli.engine.runner.load_dataset", refuse)


# --- figures and claims name columns the grid will produce ---------------------------------------------------
@pytest.mark.parametrize("extra, expected", [
    ("figures: [{name: f, metric: test_acuracy}]", "did you mean 'test_accuracy'"),
    ("figures: [{name: f, x: epsilom}]", "did you mean 'epsilon'"),
    ("figures: [{name: f, rows: modle}]", "did you mean 'model'"),
    ("figures: [{name: f, cols: datset}]", "did you mean 'dataset'"),
    ("figures: [{name: f, lines: [label, acountant]}]", "did you mean 'accountant'"),
    ("figures: [{name: f, where: {algoritm: dp_sgd}}]", "did you mean 'algorithm'"),
    ("figures: [{name: f, where: {algorithm: dp_sgdd}}]", "did you mean 'dp_sgd'"),
    ("figures: [{name: f, kind: traces, metric: test_objective}]", "did you mean"),
    ("figures: [{name: f, metric: algorithm}]", "text column"),
    ("figures: [{name: f, kind: privacy_curve, params: {alpha: 1}}]", "params.alpha"),
    ("figures: [{name: f, kind: privacy_curve, params: {sigmaa: 1}}]", "did you mean 'sigma'"),
    ("figures: [{name: f, kind: noise_scale, params: {n: 100000000}}]", "params.n"),
    ("figures: [{name: f, kind: noise_scale, params: {skip: [RDP (dp-acounting)]}}]",
     "did you mean 'RDP (dp-accounting)'"),
    ("figures: [{name: f, kind: sweep, params: {alpha: 2}}]", "only to analytic figures"),
    ("claims: [{id: c, text: t, own: true, check: monotone, metric: tst_accuracy}]", "did you mean 'test_accuracy'"),
    ("claims: [{id: c, text: t, own: true, check: monotone, over: epsilom}]", "did you mean 'epsilon'"),
    ("claims: [{id: c, text: t, own: true, check: monotone, group_by: [dataset, modle]}]", "did you mean 'model'"),
    ("claims: [{id: c, text: t, own: true, check: better, a: {acountant: pld}}]", "did you mean 'accountant'"),
    ("claims: [{id: c, text: t, own: true, check: better, b: {epsilon: '>=one'}}]", "not a number"),
    ("claims: [{id: c, text: t, own: true, check: within, where: {model: mlpp}}]", "not among the grid's models"),
    ("claims: [{id: c, text: t, own: true, check: better, a: {epsilon: one}}]", "epsilon holds numbers"),
    ("figures: [{name: f, where: {batch_size: [32, big]}}]", "batch_size holds numbers"),
    ("claims: [{id: c, text: t, own: true, check: monotone, source: figure1}]", "neither runs, traces"),
    ("claims: [{id: c, text: t, own: true, check: saturates}]", "privacy_curve"),
    ("claims: [{id: c, text: t, own: true, check: widens, over: null}]", "compares values along `over`"),
])
def test_figures_and_claims_name_real_columns(tmp_path, capsys, monkeypatch, extra, expected):
    no_data_loaded(monkeypatch)
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path, extra), "--out", tmp_path / "out")
    assert expected in err
    assert not (tmp_path / "out").exists()


def test_valid_figures_and_claims_pass(tmp_path):
    """Column names of algorithm parameters (accountant), traces and analytic tables are accepted."""
    grid = load_grid_file(grid_with(tmp_path, """
        figures:
          - {name: a, x: batch_size, metric: optimality_gap, rows: model, lines: [label, accountant]}
          - {name: b, kind: traces, metric: train_objective, where: {algorithm: [dp_sgd], epsilon: ">=1"}}
          - {name: pc, kind: privacy_curve, params: {k_max: 100, points: 10}}
        claims:
          - {id: c1, text: t, own: true, check: better, over: epsilon, a: {accountant: rdp}, b: {algorithm: erm}}
          - {id: c3, text: t, own: true, check: better, over: epsilon, a: {neighbours: zero_out},
             b: {neighbours: add_remove, tuning: ""}}
          - {id: c2, text: t, own: true, check: saturates, source: pc, metric: rdp_epsilon, over: K,
             a: {bound: dynamics}}
        """)).grids[0]
    assert len(checks.check_grid(grid)) == 2


def test_checked_columns_are_the_columns_the_readers_see(tmp_path):
    """`frame_columns` (what the checks accept) is exactly what `results_frame` gives after a run; the rows the
    runner builds carry only runs.csv columns."""
    from dpsgd_cli.engine import execute, plan_grid
    from dpsgd_cli.engine.runner import _base_row, dataset, setting_of

    grid = load_grid_file(grid_with(tmp_path, "trace_every: 100\n")).grids[0]
    execute(plan_grid(grid, tmp_path / "out"))
    folder = tmp_path / "out" / "tiny"
    assert list(results_frame(folder).columns) == frame_columns(grid)
    assert set(results_frame(folder, traces=True).columns) == set(frame_columns(grid, traces=True))
    cell = checks.expand(grid)[0]
    data = dataset(cell.dataset)
    assert set(_base_row(cell, data, setting_of(cell, data), 0.0)) <= set(COLUMNS)


# --- values that pass a type check but cannot run ---------------------------------------------------------------
@pytest.mark.parametrize("replace, expected", [
    (("epsilon: [1]", "epsilon: [.inf]"), "epsilon = inf"),
    (("epsilon: [1]", "epsilon: [1e308]"), "epsilon = 1e+308"),
    (("epsilon: [1]", "epsilon: [1e-300]"), "epsilon = 1e-300"),
    (("epsilon: [1]", "epsilon: []"), "empty list"),
    (("lr: [0.5]", "lr: [.nan]"), "lr = nan"),
    (("batch_size: [32]", "batch_size: true"), "batch_size = True"),
    (("batch_size: [32]", "batch_size: ['32']"), "batch_size = '32'"),
    (("seeds: 1", "seeds: true"), "seeds"),
    (("{name: synthetic, n: 300}", "{name: synthetic, n: 300, projection: true}"), "projection"),
    (("{name: synthetic, n: 300}", "{name: synthetic, n: 300, one_hot: 1}"), "one_hot"),
    (("algorithms: [erm, dp_sgd]", "algorithms: [erm, {name: dp_sgd, lr: []}]"), "empty list"),
    (("seeds: 1", "seeds: 1\n    seeds: 2"), "duplicate key 'seeds'"),
    (("{name: synthetic, n: 300}", "{name: synthetic, n: 300, n: 400}"), "duplicate key 'n'"),
    (("{name: synthetic, n: 300}", "{name: synthetic, n: 300, projection: 6}"), "projection = 6 is larger"),
])
def test_values_that_cannot_run_fail_validation(tmp_path, capsys, monkeypatch, replace, expected):
    no_data_loaded(monkeypatch)
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path, replace=replace), "--dry-run")
    assert expected in err


def test_yaml_1e_notation_is_a_number(tmp_path):
    grid = load_grid_file(grid_with(tmp_path, replace=("lr: [0.5]", "lr: [5e-1]"))).grids[0]
    assert grid.lr == [0.5]


def test_projection_larger_than_the_loaded_dimension_is_refused():
    """The data layer itself refuses (one_hot: false makes d smaller than the registry's upper bound)."""
    from dpsgd_cli.data import preprocess
    from dpsgd_cli.errors import DataError

    with pytest.raises(DataError, match="projection = 5 is larger than the d = 4"):
        preprocess.project(np.zeros((3, 4)), np.zeros((2, 4)), 5, 0)


# --- names and paths ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", ".", "a" * 300, "a/b", "../x", ".hidden", "-rf", "a\\\\b", "''"])
def test_grid_names_are_single_safe_path_components(tmp_path, capsys, monkeypatch, name):
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path, replace=("name: tiny", f"name: {name}")),
                         "--out", tmp_path / "out")
    assert "grids[0].name" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs.csv").exists()


@pytest.mark.parametrize("field", ["figures: [{name: ..}]",
                                   "claims: [{id: ../x, text: t, own: true, check: monotone}]"])
def test_figure_and_claim_names_are_safe(tmp_path, capsys, monkeypatch, field):
    assert "must be 1–100 letters" in one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path, field),
                                                     "--dry-run")


@pytest.mark.parametrize("out, expected", [("", "--out is empty"), (" ", "--out is empty"),
                                           ("afile", "is a file"), ("afile/sub", "is a file")])
def test_out_that_cannot_hold_results(tmp_path, capsys, monkeypatch, out, expected):
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert expected in one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path), "--out", out)


def test_out_read_only(tmp_path, capsys, monkeypatch):
    """Read-only (simulated: the tests may run as root, who may write anywhere)."""
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).endswith("ro") else real(p, mode))
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path), "--out", tmp_path / "ro" / "new")
    assert "not writable" in err


@pytest.mark.parametrize("content, expected", [(None, "is a folder"), (b"\x7fELF\x00\x01", "binary"),
                                               (b"grids: [{name: caf\xe9}]", "not UTF-8"),
                                               (b"x" * (2 << 20), "larger than")])
def test_grid_path_that_is_not_a_grid_text(tmp_path, capsys, monkeypatch, content, expected):
    path = tmp_path / "grid"
    path.mkdir() if content is None else path.write_bytes(content)
    assert expected in one_line_error(capsys, monkeypatch, "run", path)


# --- bounded work and memory ---------------------------------------------------------------------------------------
BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] +
                 [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)])


@pytest.mark.parametrize("where", ["top", "params", "recursive"])
def test_yaml_alias_bombs_are_refused_without_expanding(tmp_path, capsys, monkeypatch, where):
    grid = textwrap.dedent(BASE)
    if where == "top":
        text = BOMB + "\n" + grid
    elif where == "params":
        text = BOMB + "\n" + grid + "    figures: [{name: f, kind: privacy_curve, params: {n: 5, x: *a8}}]\n"
    else:
        text = "r: &r [*r]\n" + grid
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    tracemalloc.start()
    err = one_line_error(capsys, monkeypatch, "run", path, "--dry-run")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "expands to more than" in err and peak < 50e6


def test_a_grid_of_millions_of_runs_is_refused_at_once(tmp_path, capsys, monkeypatch):
    values = ", ".join(f"{0.001 * (i + 1):.3f}" for i in range(1000))
    path = grid_with(tmp_path, replace=("lr: [0.5]", f"lr: [{values}]\n    clip_norm: [{values}]"))
    start = time.perf_counter()
    err = one_line_error(capsys, monkeypatch, "run", path, "--dry-run")
    assert "exceed the limit of 100,000" in err and time.perf_counter() - start < 5


@pytest.mark.parametrize("replace, key", [
    (("epochs: 1", "epochs: 1e9"), "epochs = 1e+09"),
    (("{name: synthetic, n: 300}", "{name: synthetic, n: 100000000000}"), "dataset synthetic"),
    (("{name: synthetic, n: 300}", "{name: synthetic, n: 300, dim: 10000000000}"), "dataset synthetic"),
    (("datasets: [{name: synthetic, n: 300}]", "datasets: [{name: mnist, projection: 700, subsample: 100}]\n    "
      "models: [{name: mlp, hidden: 100000000000}]"), "models[].hidden = 100,000,000,000"),
    (("{name: synthetic, n: 300}", "{name: synthetic, n: 300, projection: 5000000000, dim: 10000000000}"),
     "memory"),
])
def test_work_beyond_the_limits_is_refused_before_allocating(tmp_path, capsys, monkeypatch, replace, key):
    no_data_loaded(monkeypatch)
    tracemalloc.start()
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path, replace=replace), "--out", tmp_path / "o")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert key in err and ("limit" in err or "available" in err)
    assert peak < 50e6 and not (tmp_path / "o").exists()


def test_memory_estimate_names_the_largest_array(monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda: 1 << 30)  # 1 GiB
    grid = load_grid_file_text("datasets: [{name: mnist, projection: 700}]\nmodels: [{name: mlp, hidden: 200000}]")
    with pytest.raises(checks.UserError, match=r"models\[\]\.hidden = 200,000 of mlp needs about"):
        checks.check_grid(grid)
    ok = load_grid_file_text("datasets: [{name: adult}]\nmodels: [logreg]")
    checks.check_grid(ok)  # adult with logistic regression: ~0.2 GiB


def load_grid_file_text(lines: str):
    from dpsgd_cli.config import GridFile

    body = "name: g\nalgorithms: [dp_sgd]\nseeds: 3\n" + lines
    import yaml
    return GridFile.model_validate({"grids": [yaml.safe_load(body)]}).grids[0]


@pytest.mark.parametrize("args, expected", [
    (["epsilon", "--sigma", "1e300", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"], "sigma must be in"),
    (["epsilon", "--sigma", "1e-300", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
     "sigma must be in"),
    (["epsilon", "--sigma", "1", "--sample-rate", "0.01", "--steps", str(10**12), "--delta", "1e-5",
      "--accountant", "pld"], "PLD accountant's limit"),
    (["epsilon", "--sigma", "1e-3", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5",
      "--accountant", "pld"], "PLD accountant's limit"),
    (["sigma", "--epsilon", "1", "--sample-rate", "0.01", "--steps", str(10**12), "--delta", "1e-5",
      "--accountant", "pld"], "PLD accountant's limit"),
    (["epsilon", "--sigma", "1", "--sample-rate", "0.01", "--steps", str(10**15), "--delta", "1e-5"], "at most"),
    (["privacy-curve", "--points", str(10**8)], "--points = 100000000 must be ≥ 2 and ≤ 100000"),
    (["privacy-curve", "--alpha", "1"], "--alpha = 1.0 must be > 1"),
    (["privacy-curve", "--out", ""], "--out is empty"),
])
def test_calculators_refuse_absurd_inputs_quickly(capsys, monkeypatch, args, expected):
    start = time.perf_counter()
    assert expected in one_line_error(capsys, monkeypatch, *args)
    assert time.perf_counter() - start < 5


def test_jobs_above_the_cores_are_capped(tmp_path, capsys, monkeypatch):
    code, _, err = dpsgd(capsys, monkeypatch, "run", grid_with(tmp_path), "--dry-run", "--jobs", "512")
    assert code == 0 and "--jobs 512: capped at" in err


# --- help, datasets, cache -----------------------------------------------------------------------------------
def test_help_shows_flags_without_a_type_and_explains_run(capsys, monkeypatch):
    code, out, _ = dpsgd(capsys, monkeypatch, "run", "--help")
    assert code == 0
    for text in ("<bool>", "list[str]"):
        assert text not in out
    flat = " ".join(out.split())
    for text in ("resume", "DPSGD_DATA_DIR", "DPSGD_DATA_MIRROR", "--dry-run", "NAME"):
        assert text in flat
    code, out, _ = dpsgd(capsys, monkeypatch, "epsilon", "--help")
    flat = " ".join(out.split())
    assert "Rényi DP" in flat and "privacy loss distributions" in flat and "δ ≪ 1/n" in flat


@pytest.mark.parametrize("field", ["alpha", "sigma", "eta", "lam", "n", "k_max", "points"])
def test_privacy_curve_help_ranges_are_what_it_accepts(capsys, monkeypatch, field):
    """Each bound shown in the help is where acceptance flips."""
    code, out, _ = dpsgd(capsys, monkeypatch, "privacy-curve", "--help")
    assert bounds(PrivacyCurveParams, field) in " ".join(out.split())
    meta = {type(m).__name__: m for m in PrivacyCurveParams.model_fields[field].metadata}
    integer = PrivacyCurveParams.model_fields[field].annotation is int
    step = 1 if integer else 1e-9
    for name, inside, outside in (("Gt", 1, 0), ("Ge", 0, -1), ("Le", 0, 1)):
        if name in meta:
            edge = getattr(meta[name], name.lower())
            good, bad = edge + inside * step * max(1, abs(edge)), edge + outside * step * max(1, abs(edge))
            PrivacyCurveParams(**{field: int(good) if integer else good})
            with pytest.raises(ValueError):
                PrivacyCurveParams(**{field: int(bad) if integer else bad})


def test_datasets_list_says_partial(tmp_path, capsys, monkeypatch):
    from dpsgd_cli.data import list_datasets
    from dpsgd_cli.data.registry import get_entry

    entry = get_entry("adult")
    (tmp_path / "cache" / "adult").mkdir(parents=True)
    (tmp_path / "cache" / "adult" / entry.files[0].name).write_bytes(b"x" * entry.files[0].size)
    states = {d["name"]: d["cache_state"] for d in list_datasets()}
    assert states["adult"] == "partial" and states["bank"] == "no" and states["synthetic"] == "generated"
    code, out, _ = dpsgd(capsys, monkeypatch, "datasets", "list")
    assert code == 0 and "partial" in out


def test_datasets_info_is_formatted(capsys, monkeypatch):
    code, out, _ = dpsgd(capsys, monkeypatch, "datasets", "info", "adult")
    assert code == 0 and "{'" not in out and "[{" not in out
    assert "sha256 5b00264637dbfec36bdeaab5676b0b309ff9eb788d63554ca0a249491c86603d" in out


def test_data_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "file"))
    err = one_line_error(capsys, monkeypatch, "datasets", "fetch", "adult")
    assert "is a file, not a folder; set DPSGD_DATA_DIR to a folder" in err


def test_tampered_processed_cache_is_rebuilt(tmp_path, capsys):
    from dpsgd_cli.data import DatasetSpec, load_dataset, processed_path

    spec = DatasetSpec(name="synthetic", n=200)
    first = load_dataset(spec)
    path = processed_path(spec)
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["X_train"] = arrays["X_train"] + 1e-3  # tampered, same key and stored checksum
    np.savez(path, **arrays)
    capsys.readouterr()
    again = load_dataset(spec)
    assert "does not match its checksum" in capsys.readouterr().err
    np.testing.assert_array_equal(again.X_train, first.X_train)
    load_dataset(spec)  # rebuilt file verifies: silent
    assert capsys.readouterr().err == ""


# --- text printed literally -------------------------------------------------------------------------------------------
def test_report_prints_markup_like_text_literally(tmp_path, capsys, monkeypatch):
    from dpsgd_cli.engine import execute, plan_grid

    grid = load_grid_file(grid_with(tmp_path, """
        figures: [{name: f, title: "cost $\\\\frac{1 [/] $x", metric: test_accuracy}]
        claims:
          - {id: c, text: "accuracy [/] rises [bold]", own: true, check: monotone, over: epsilon,
             group_by: [model, dataset], a: {algorithm: dp_sgd}}
        """, replace=("epsilon: [1]", "epsilon: [1, 3]"))).grids[0]
    execute(plan_grid(grid, tmp_path / "out"))
    code, out, err = dpsgd(capsys, monkeypatch, "report", tmp_path / "out")
    assert code == 0, err
    flat = " ".join(out.split())
    assert "[/] rises [bold]" in flat  # the claim's line; its numbers (groups such as [logreg, synthetic]) in report.md
    assert "[logreg, synthetic]" in (tmp_path / "out" / "report.md").read_text(encoding="utf-8").replace("\\", "")
    code, _, err = dpsgd(capsys, monkeypatch, "plot", tmp_path / "out" / "tiny")
    assert code == 0, err
    assert (tmp_path / "out" / "tiny" / "figures" / "f.png").exists()


def test_quick_start_scripts_and_ci():
    """The README's two commands exist, are executable, and .ci/run runs the test one (in a fresh venv)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for script in ("scripts/smoke", "scripts/test", ".ci/run"):
        assert os.access(root / script, os.X_OK), script
    assert "scripts/test" in (root / ".ci/run").read_text()
    readme = (root / "README.md").read_text()
    quick = readme[readme.index("## Install, run, test"):readme.index("## Commands")]
    block = quick[quick.index("```bash") + 7:quick.index("```", quick.index("```bash") + 7)]
    assert [line.split()[0] for line in block.strip().splitlines()] == ["scripts/smoke", "scripts/test"]


# --- every multiplier of work bounded, every reader's input checked by `run` ------------------------------------
@pytest.mark.parametrize("extra, replace, named", [
    ("trace_every: 1\n", ("epochs: 1", "epochs: 2000"), "trace_every"),
    ("select: [{candidates: [lr], group_by: [dataset, model, algorithm, epsilon, no_such_column]}]\n"
     "validation: 0.1\n", ("", ""), "no_such_column"),
    ("select: [{candidates: [lr], privacy: papernot_steinke, mean: 1e7, searches: 10}]\nvalidation: 0.1\n",
     ("algorithms: [erm, dp_sgd]", "algorithms: [dp_sgd]"), "searches × mean"),
    ("select: [{candidates: [lr], privacy: papernot_steinke, distribution: truncated_negative_binomial, "
     "mean: 5000, eta: -0.9, searches: 1}]\nvalidation: 0.1\n",
     ("algorithms: [erm, dp_sgd]", "algorithms: [dp_sgd]"), "simulated"),
])
def test_run_refuses_unbounded_work_and_what_readers_cannot_compute(tmp_path, capsys, monkeypatch, extra, replace,
                                                                   named):
    no_data_loaded(monkeypatch)
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path, extra, replace), "--dry-run",
                         "--out", tmp_path / "out")
    assert named in err


def test_audit_trials_are_bounded_before_any_training(tmp_path, capsys, monkeypatch):
    no_data_loaded(monkeypatch)
    private = ("[erm, dp_sgd]", "[dp_sgd]")  # an audit grid lists private algorithms only
    grid = grid_with(tmp_path, "audit: {trials: 100000000}\n", private)
    err = one_line_error(capsys, monkeypatch, "audit", grid, "--out", tmp_path / "out")
    assert "audit.trials" in err and "limit" in err
    grid = grid_with(tmp_path, "", ("epochs: 1", "epochs: 1000000"))
    Path(grid).write_text(Path(grid).read_text().replace(*private))
    err = one_line_error(capsys, monkeypatch, "audit", grid, "--trials", "5000", "--out", tmp_path / "out")
    assert "--trials" in err and "examples" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheduler, env, named", [
    ("local:100000", {}, "cores"),
    ("foo://127.0.0.1:8786", {}, "scheme"),
    ("tcp://127.0.0.1:1", {"DPSGD_SCHEDULER_TIMEOUT": "ten"}, "DPSGD_SCHEDULER_TIMEOUT"),
    ("tcp://127.0.0.1:1", {"DPSGD_SCHEDULER_TIMEOUT": "-1"}, "DPSGD_SCHEDULER_TIMEOUT"),
])
def test_scheduler_and_its_environment_are_refused_at_once(tmp_path, capsys, monkeypatch, scheduler, env, named):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    start = time.monotonic()
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path), "--scheduler", scheduler,
                         "--out", tmp_path / "out")
    assert named in err and time.monotonic() - start < 5


def test_an_over_long_folder_name_in_out_is_one_line(tmp_path, capsys, monkeypatch):
    err = one_line_error(capsys, monkeypatch, "run", grid_with(tmp_path), "--dry-run",
                         "--out", tmp_path / ("x" * 300) / "results")
    assert "--out" in err and "shorter" in err


def test_a_grid_file_that_is_a_fifo_is_refused_without_blocking(tmp_path, capsys, monkeypatch):
    fifo = tmp_path / "grid.yaml"
    os.mkfifo(fifo)
    err = one_line_error(capsys, monkeypatch, "run", fifo, "--dry-run")
    assert "not a regular file" in err


def test_invalid_yaml_in_datasets_info_set_is_one_line(tmp_path, capsys, monkeypatch):
    data = tmp_path / "d.csv"
    data.write_text("a,y\n1,0\n2,1\n")
    err = one_line_error(capsys, monkeypatch, "datasets", "info", "--path", data, "--label", "y",
                         "--set", "sep=[unclosed")
    assert "--set" in err and "YAML" in err


def test_a_validation_fraction_leaving_no_row_is_one_line(tmp_path, capsys, monkeypatch):
    grid = grid_with(tmp_path, "validation: 0.01\n", ("n: 300", "n: 3"))
    err = one_line_error(capsys, monkeypatch, "run", grid, "--out", tmp_path / "out")
    assert "validation = 0.01 leaves no row" in err


@pytest.mark.parametrize("grid_part, named", [
    ({"select": [{"candidates": 5}]}, "select[0]"),
    ({"figures": ["not an object"]}, "figures[0]"),
    ({"claims": {"id": "c"}}, "claims"),
])
def test_readers_refuse_a_manifest_of_the_wrong_shape(tmp_path, capsys, monkeypatch, grid_part, named):
    import json

    from dpsgd_cli.engine import execute, plan_grid

    grid = load_grid_file(grid_with(tmp_path)).grids[0]
    execute(plan_grid(grid, tmp_path / "out"))
    capsys.readouterr()  # the run's own lines (L*) are not the readers' error
    manifest = tmp_path / "out" / "tiny" / "manifest.json"
    content = json.loads(manifest.read_text())
    content["grid"].update(grid_part)
    manifest.write_text(json.dumps(content))
    for command in ("plot", "select", "report"):
        err = one_line_error(capsys, monkeypatch, command, tmp_path / "out" / "tiny")
        assert "manifest" in err and named in err, command


def test_pld_memory_is_estimated_and_refused_before_the_library_allocates(monkeypatch):
    from dpsgd_cli.errors import UserError
    from dpsgd_cli.privacy import validate
    from dpsgd_cli.privacy.accounting import dpsgd_event

    with pytest.raises(UserError, match="GiB of memory"):
        validate.pld_memory(dpsgd_event(0.05, 1.0, 10**6), 1e-2)
    validate.pld_memory(dpsgd_event(1.0, 0.01, 10**4), 5e-5)  # a paper-sized one fits (~0.3 GiB)
    monkeypatch.setattr(validate, "available_memory", lambda: 64 << 20)
    with pytest.raises(UserError, match="accountant rdp"):
        validate.pld_memory(dpsgd_event(1.0, 0.01, 10**4), 5e-5)


def test_pld_accountant_beyond_memory_is_one_line_at_once(capsys, monkeypatch):
    start = time.monotonic()
    err = one_line_error(capsys, monkeypatch, "epsilon", "--accountant", "pld", "--sigma", "0.05", "--sample-rate",
                         "1", "--steps", "1000000", "--delta", "1e-5")
    assert "PLD accountant" in err and "GiB" in err and time.monotonic() - start < 10


def test_a_run_never_resumes_into_runs_of_another_numerics_version(tmp_path, capsys, monkeypatch):
    """runs.csv and the manifest record the numerics version; `run` (and its dry run) refuses to resume into rows of
    another version (or of none: written before it was recorded) in one line, and --no-resume starts over."""
    import dpsgd_cli
    from dpsgd_cli.engine.results import read_manifest

    grid, out = grid_with(tmp_path), tmp_path / "out"
    assert dpsgd(capsys, monkeypatch, "run", grid, "--out", out)[0] == 0
    runs = pd.read_csv(out / "tiny" / "runs.csv")
    assert (runs["numerics"] == dpsgd_cli.NUMERICS).all()
    assert read_manifest(out / "tiny")["numerics"] == dpsgd_cli.NUMERICS
    assert dpsgd(capsys, monkeypatch, "run", grid, "--out", out)[0] == 0  # same version: resumes, nothing to run
    for older in (dpsgd_cli.NUMERICS - 1, None):
        runs.assign(numerics=older).to_csv(out / "tiny" / "runs.csv", index=False)
        before = (out / "tiny" / "runs.csv").read_bytes()
        for extra in ((), ("--dry-run",)):
            err = one_line_error(capsys, monkeypatch, "run", grid, "--out", out, *extra)
            assert f"numerics version {older or 1}" in err and "--no-resume" in err, err
        assert (out / "tiny" / "runs.csv").read_bytes() == before
    assert dpsgd(capsys, monkeypatch, "run", grid, "--out", out, "--no-resume")[0] == 0
    assert (pd.read_csv(out / "tiny" / "runs.csv")["numerics"] == dpsgd_cli.NUMERICS).all()
