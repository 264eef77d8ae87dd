"""The on-disk cache of the reference optimum L*: same numbers bit for bit, keyed by what L* depends on, robust."""

import json

import numpy as np
import pytest

from dpsgd_cli import diskcache
from dpsgd_cli.algorithms import erm
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import runner
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy import accounting

from test_fusion import run_grid, table

GRID = """
grids:
  - name: lstar
    datasets: [{name: synthetic, n: 300, dim: 5}]
    models: [logreg, {name: mlp, hidden: 3}]
    algorithms: [erm, dp_sgd]
    epsilon: [1]
    batch_size: [30]
    lr: [0.5]
    seeds: 2
    epochs: 1
"""


def forget_in_process():
    """What a new process would not have: the in-process caches of L* and σ."""
    erm._REFERENCE_CACHE.clear()
    runner.reference_optimum.cache_clear()
    accounting.calibrate_sigma.cache_clear()


def no_lbfgs(*args, **kwargs):
    raise AssertionError("L* recomputed although the disk cache holds it")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    forget_in_process()
    yield tmp_path / "cache" / "reference"
    forget_in_process()


def problem(l2=1e-3):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 4)) / 3
    y = np.where(X @ np.ones(4) + rng.normal(size=200) > 0, 1.0, -1.0)
    return make_model("logreg", 4, l2, {}), X, y


def test_cold_and_warm_runs_give_identical_rows(cache, write_grid, tmp_path, monkeypatch):
    grid = load_grid_file(write_grid(GRID)).grids[0]
    run_grid(grid, tmp_path / "cold", True, monkeypatch)
    assert len(list(cache.glob("*.json"))) == 2  # logreg and the MLP (best of 3 starts)
    forget_in_process()
    monkeypatch.setattr(erm, "_compute_reference", no_lbfgs)
    run_grid(grid, tmp_path / "warm", True, monkeypatch)
    cold, warm = table(tmp_path / "cold" / "lstar"), table(tmp_path / "warm" / "lstar")
    assert len(cold) == 8 and cold.equals(warm)  # L*, gaps, erm's θ and derived info: bit for bit


def test_entry_is_exact_and_keyed_by_what_lstar_depends_on(cache, monkeypatch):
    model, X, y = problem()
    theta, objective, info = erm.reference_minimum(model, X, y)
    forget_in_process()
    monkeypatch.setattr(erm, "_compute_reference", no_lbfgs)
    theta2, objective2, info2 = erm.reference_minimum(model, X, y)
    assert np.array_equal(theta, theta2) and objective == objective2 and info == info2
    calls = []
    monkeypatch.setattr(erm, "_compute_reference", lambda *args: calls.append(args) or (theta, objective, info))
    erm.reference_minimum(make_model("logreg", 4, 2e-3, {}), X, y)  # another λ
    X2 = X.copy()
    X2[0, 0] = np.nextafter(X2[0, 0], 1.0)  # one ulp of one feature
    erm.reference_minimum(model, X2, y)
    assert len(calls) == 2 and len(list(cache.glob("*.json"))) == 3


def test_read_only_training_data_is_hashed_once_writeable_data_every_time(monkeypatch):
    _, X, y = problem()
    digest = erm._data_digest(X, y)
    hashed = []
    real = erm.hashlib.sha1
    monkeypatch.setattr(erm.hashlib, "sha1", lambda: hashed.append(1) or real())
    X[0, 0] = np.nextafter(X[0, 0], 1.0)  # writeable: an edit is seen
    assert erm._data_digest(X, y) != digest and len(hashed) == 1
    X.flags.writeable = y.flags.writeable = False  # the runner's datasets
    first = erm._data_digest(X, y)
    assert erm._data_digest(X, y) == first and len(hashed) == 2  # the second call is the memo
    other = X.copy()
    other.flags.writeable = False
    assert erm._data_digest(other, y) == first and len(hashed) == 3  # another array: hashed


def test_digest_memo_forgets_freed_arrays():
    import gc

    _, X, y = problem()
    for _ in range(5):  # datasets loaded and freed one after another (e.g. a long-lived process)
        Xi = X.copy()
        Xi.flags.writeable = y.flags.writeable = False
        erm._data_digest(Xi, y)
        del Xi
        gc.collect()
    alive = [key for key, (rx, ry, _) in erm._DIGESTS.items() if rx() is not None and ry() is not None]
    assert len(erm._DIGESTS) - len(alive) <= 1  # at most the last one freed, pruned at the next insertion


def test_corrupt_or_foreign_entries_are_recomputed(cache, monkeypatch):
    model, X, y = problem()
    theta, objective, _ = erm.reference_minimum(model, X, y)
    (path,) = cache.glob("*.json")
    for text in ("{not json", json.dumps({"key": {"other": 1}, "reference": {}}),
                 path.read_text().replace('"theta": [', '"theta": [1e999, ')):
        path.write_text(text)
        forget_in_process()
        again, objective2, _ = erm.reference_minimum(model, X, y)
        assert np.array_equal(again, theta) and objective2 == objective
        assert json.loads(path.read_text())["reference"]["objective"] == objective  # rewritten


def test_off_disables_the_disk_cache(cache, monkeypatch):
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, "off")
    model, X, y = problem()
    erm.reference_minimum(model, X, y)
    assert diskcache.cache_folder("reference") is None and not cache.exists()


def test_bassily_calibration_is_kept_on_disk_exactly(cache, monkeypatch):
    from dpsgd_cli.algorithms import bassily

    args = (1.0, 1e-5, 500, 500, 1.0, "rdp")
    cold = bassily.calibrate_bassily(*args)
    eps = bassily._cached_rdp_epsilon(cold.sigma / 2.0, 500, 500, 1e-5)
    bassily.calibrate_bassily.cache_clear()
    bassily._cached_rdp_epsilon.cache_clear()
    monkeypatch.setattr(bassily, "calibrate", no_lbfgs)  # a warm call must not calibrate again
    monkeypatch.setattr(bassily, "rdp_epsilon", no_lbfgs)
    assert bassily.calibrate_bassily(*args, formula="lecture") == cold  # same key with the default spelled out
    assert bassily._cached_rdp_epsilon(cold.sigma / 2.0, 500, 500, 1e-5) == eps
    (cache.parent / "bassily2014").joinpath("junk.json").write_text("{")  # a stray file is ignored
    assert len(list((cache.parent / "bassily2014").glob("*.json"))) == 3
    bassily.calibrate_bassily.cache_clear()
    bassily._cached_rdp_epsilon.cache_clear()


def test_deferred_writes_wait_for_the_block_and_are_read_meanwhile(tmp_path):
    folder, key, other = tmp_path / "c", {"k": 1}, {"k": 2}
    with diskcache.deferred_writes():
        diskcache.write_entry(folder, key, "value", [0.1, 1 / 3])
        with diskcache.deferred_writes():  # nested: the outermost block writes
            diskcache.write_entry(folder, other, "value", 2.5)
        assert not folder.exists()
        assert diskcache.read_entry(folder, key, "value") == [0.1, 1 / 3]
        assert diskcache.read_entry(folder, key, "other field") is None
    assert diskcache.read_entry(folder, key, "value") == [0.1, 1 / 3] and len(list(folder.glob("*.json"))) == 2
    assert diskcache.read_entry(folder, other, "value") == 2.5 and not list(folder.glob("*.tmp"))


@pytest.mark.parametrize("fuse", [False, True])
def test_a_task_writes_its_calibrated_sigma_after_its_clock_stops(cache, write_grid, tmp_path, monkeypatch, fuse):
    """A task's rows are built (their wall_time taken) before the σ it calibrated reaches the disk cache."""
    events = []

    def write_now(folder, *args, _write=diskcache._write_now):
        events.append(folder.name)
        _write(folder, *args)

    def result(task, cell, *args, _result=runner._result, **kwargs):
        events.append(cell.algorithm.name)
        return _result(task, cell, *args, **kwargs)

    monkeypatch.setattr(runner, "_result", result)
    monkeypatch.setattr(diskcache, "_write_now", write_now)
    grid = load_grid_file(write_grid(GRID.replace("[logreg, {name: mlp, hidden: 3}]", "[logreg]")
                                     .replace("[erm, dp_sgd]", "[sgd, dp_sgd]"))).grids[0]
    run_grid(grid, tmp_path / "out", fuse, monkeypatch)
    assert len(list((cache.parent / "calibration").glob("*.json"))) == 1
    assert events.count("calibration") == 1 and events.index("calibration") > events.index("dp_sgd")
