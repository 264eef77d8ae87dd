"""Algorithms defined outside the package: loaded from a file (`--plugin`, `plugins=[...]`) or an installed entry
point, run, audited and checked as built-in ones are; their rows record the file and its SHA-256; a grid alone
never loads one."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import dpsgd_cli as dpsgd
from dpsgd_cli import plugins
from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.cli import app
from tests.test_validation import one_line_error

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "plugins" / "lr_decay.py"
BROKEN = ROOT / "tests" / "data" / "plugins" / "broken.py"
GRID = """
grids:
  - name: mine
    datasets: [{name: synthetic, n: 300, dim: 5}]
    algorithms: [sgd, {name: dp_sgd_lr_decay, decay: 2.0}]
    epsilon: [1]
    batch_size: [30]
    lr: [0.5]
    seeds: 2
    epochs: 1
    audit: {canaries: [input], trials: 20, threshold: order}
"""


@pytest.fixture
def plugin(tmp_path) -> Path:
    """The example plugin, copied outside the repository."""
    return Path(shutil.copy(EXAMPLE, tmp_path / "my_alg.py"))


@pytest.fixture
def grid(write_grid) -> Path:
    return write_grid(GRID)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_plugin_runs_in_a_grid_and_its_rows_record_its_file_and_sha256(grid, plugin, tmp_path):
    result = invoke("run", grid, "--plugin", plugin, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    runs = pd.read_csv(tmp_path / "out" / "mine" / "runs.csv")
    assert set(runs["status"]) == {"ok"} and len(runs) == 4
    mine, builtin = runs[runs["algorithm"] == "dp_sgd_lr_decay"], runs[runs["algorithm"] == "sgd"]
    assert set(mine["plugin"]) == {str(plugin.resolve())} and set(mine["plugin_sha256"]) == {_sha256(plugin)}
    assert builtin["plugin"].isna().all() and builtin["plugin_sha256"].isna().all()
    assert (mine["epsilon_achieved"] <= 1.0).all() and (mine["sigma"] > 0).all()
    manifest = json.loads((tmp_path / "out" / "mine" / "manifest.json").read_text())
    assert manifest["plugins"] == {"dp_sgd_lr_decay": {"plugin": str(plugin.resolve()),
                                                       "plugin_sha256": _sha256(plugin)}}


def test_the_api_takes_plugins_and_trains_what_dp_sgd_trains_without_decay(grid, plugin, tmp_path):
    """decay = 0 is dp_sgd exactly (same seed, same σ, same θ): the plugin changes only its schedule."""
    frame = dpsgd.run(grid, out=tmp_path / "out", plugins=str(plugin), quiet=True, set={
        "algorithms": ["dp_sgd", {"name": "dp_sgd_lr_decay", "decay": 0.0}, {"name": "dp_sgd_lr_decay", "decay": 2.0}]})
    loss = {key: part.sort_values("seed")["test_loss"].to_numpy() for key, part in
            frame.groupby([frame["algorithm"], frame["algorithm_params.decay"].fillna(-1.0)])}
    dp, flat, decayed = loss["dp_sgd", -1.0], loss["dp_sgd_lr_decay", 0.0], loss["dp_sgd_lr_decay", 2.0]
    assert (dp == flat).all() and (dp != decayed).all()


def test_a_grid_naming_an_algorithm_not_loaded_is_one_line_saying_how_to_load_it(grid, capsys, monkeypatch):
    message = one_line_error(capsys, monkeypatch, "run", grid, "--dry-run")
    assert "unknown algorithm 'dp_sgd_lr_decay'" in message
    assert "--plugin FILE.py" in message and "dpsgd.algorithms" in message
    assert plugins.LOADED == {}  # nothing imported


def test_audit_takes_the_plugin(grid, plugin, tmp_path):
    result = invoke("audit", grid, "--plugin", plugin, "--out", tmp_path / "res", "--only", "mine", "--set",
                    "algorithms=[dp_sgd_lr_decay]")
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "res" / "mine" / "audit.csv")
    assert (frame["status"] == "ok").all() and (frame["algorithm"] == "dp_sgd_lr_decay").all()
    assert set(frame["plugin_sha256"]) == {_sha256(plugin)} and frame["epsilon_lo"].notna().all()


def test_check_reports_every_check_of_the_example_as_kept(plugin):
    result = invoke("check", plugin)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert not any(line.startswith("FAIL") for line in lines)
    assert {"claim", "compiled", "fused", "refusals"} <= {line.split(": ")[1] for line in lines[:-1]}


def test_check_reports_a_broken_plugin_one_line_per_failure(tmp_path):
    result = invoke("check", shutil.copy(BROKEN, tmp_path / "broken.py"))
    assert result.exit_code == 1
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert len(failures) == 2
    claim, refusals = failures
    assert "half_noise: claim: claims ε = " in claim and "dp-accounting gives its dp_event ε" in claim
    assert "half_noise: refusals: check() accepts batch_size = 1 but training fails" in refusals


def test_resuming_with_another_version_of_the_plugin_is_refused(grid, plugin, tmp_path, capsys):
    out = tmp_path / "out"
    dpsgd.run(grid, out=out, plugins=[plugin], quiet=True)
    plugin.write_text(plugin.read_text() + "\n# edited\n")
    with pytest.raises(dpsgd.UserError, match="holds runs of dp_sgd_lr_decay made by its plugin file of SHA-256"):
        dpsgd.run(grid, out=out, plugins=[plugin], quiet=True)
    assert len(dpsgd.run(grid, out=out, plugins=[plugin], no_resume=True, quiet=True)) == 4


@pytest.mark.parametrize("source, expected", [
    ("from dpsgd_cli.algorithms.sgd import DPSGD\nclass Mine(DPSGD):\n    name = 'dp_sgd'\n",
     "the algorithm 'dp_sgd' is already defined by dpsgd (built in); give it another name"),
    ("from dpsgd_cli.algorithms import Algorithm\nclass Mine(Algorithm):\n    name = 'mine'\n",
     "class Mine: set tags = Tags(display_name=..., private=True or False"),
    ("from dpsgd_cli.algorithms import Algorithm, Tags\nclass Mine(Algorithm):\n    name = 'mine'\n"
     "    tags = Tags(display_name='mine', private=False)\n",
     "class Mine: set uses = frozenset"),
    ("class Mine:\n    name = 'mine'\n", "defines no Algorithm subclass with a name"),
    ("x = 1\nraise RuntimeError('no')\n", "importing it raised RuntimeError: no at line 2"),
    ("def broken(:\n", "importing it raised SyntaxError"),
])
def test_a_plugin_that_cannot_be_registered_is_one_line(tmp_path, source, expected):
    path = tmp_path / "bad.py"
    path.write_text(source)
    with pytest.raises(dpsgd.UserError, match="^plugin .*bad.py: ") as caught:
        plugins.load([path])
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert "mine" not in ALGORITHMS


def test_two_files_defining_one_name_are_refused_and_a_link_is_followed(plugin, tmp_path):
    link = tmp_path / "link.py"
    link.symlink_to(plugin)
    assert plugins.load([link]) == ["dp_sgd_lr_decay"]
    assert plugins.provenance("dp_sgd_lr_decay")["plugin"] == str(plugin.resolve())  # the file that ran
    assert plugins.load([plugin]) == ["dp_sgd_lr_decay"]  # the same file again: nothing new
    other = Path(shutil.copy(plugin, tmp_path / "other.py"))
    with pytest.raises(dpsgd.UserError, match=f"already defined by {plugin.resolve()}"):
        plugins.load([other])


def test_an_installed_entry_point_is_loaded_when_a_grid_names_it(grid, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "my_pkg").mkdir(parents=True)
    shutil.copy(EXAMPLE, site / "my_pkg" / "lr_decay.py")
    (site / "my_pkg" / "__init__.py").write_text("")
    info = site / "my_pkg-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-pkg\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""
        [dpsgd.algorithms]
        dp_sgd_lr_decay = my_pkg.lr_decay:DPSGDLrDecay
    """))
    monkeypatch.syspath_prepend(str(site))
    frame = dpsgd.run(grid, out=tmp_path / "out", quiet=True)
    mine = frame[frame["algorithm"] == "dp_sgd_lr_decay"]
    assert set(mine["plugin"]) == {"my-pkg 1.2"} and set(mine["plugin_sha256"]) == {_sha256(EXAMPLE)}


@pytest.mark.parametrize("platform, kwargs, option", [("linux", {"scheduler": "local:1"}, "--scheduler local:1"),
                                                      ("darwin", {"jobs": 2}, "--jobs 2")])
def test_workers_that_are_not_forked_do_not_run_plugins(grid, plugin, tmp_path, monkeypatch, platform, kwargs,
                                                        option):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.raises(dpsgd.UserError, match=f"^{option}: its worker processes do not load plugin algorithms"):
        dpsgd.run(grid, out=tmp_path / "out", plugins=[plugin], **kwargs)


def test_the_readers_take_the_plugin_to_know_the_grid_as_last_run(grid, plugin, tmp_path):
    folder = tmp_path / "out" / "mine"
    dpsgd.run(grid, out=tmp_path / "out", plugins=[plugin], quiet=True)
    for given in ([], ["--plugin", str(plugin)]):  # in a new process: the plugin is not loaded
        done = subprocess.run([sys.executable, "-m", "dpsgd_cli", "plot", str(folder), *given], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        note = "no longer validates" in done.stderr and "load their files with --plugin" in done.stderr
        assert note is not bool(given), done.stderr  # without it every row is shown, and a note says why
