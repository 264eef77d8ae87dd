"""The on-disk cache of the reference optimum L*: same numbers bit for bit, keyed by what L* depends on, robust."""

import json
import struct

import numpy as np
import pytest
from test_fusion import run_grid, table

from dpsgd_cli import diskcache
from dpsgd_cli.algorithms import erm
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import runner
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy import accounting
from dpsgd_cli.privacy import single_example_gaussian as single

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
    single.calibrate_bassily.cache_clear()


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
    real = erm._compute_reference
    theta, objective, info = erm.reference_minimum(model, X, y)
    forget_in_process()
    monkeypatch.setattr(erm, "_compute_reference", no_lbfgs)
    theta2, objective2, info2 = erm.reference_minimum(model, X, y)
    assert np.array_equal(theta, theta2) and objective == objective2 and info == info2
    calls = []
    monkeypatch.setattr(erm, "_compute_reference", lambda *args: calls.append(args) or real(*args))
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
    from dpsgd_cli.privacy import single_example_gaussian as single

    args = (1.0, 1e-5, 500, 500, 1.0, "rdp")
    cold = single.calibrate_bassily(*args)
    eps = single.cached_rdp_epsilon(cold.sigma / 2.0, 500, 500, 1e-5)
    single.calibrate_bassily.cache_clear()
    single.cached_rdp_epsilon.cache_clear()
    monkeypatch.setattr(single, "calibrate", no_lbfgs)  # a warm call must not calibrate again ...
    evaluations = []
    real = single.rdp_epsilon
    monkeypatch.setattr(single, "rdp_epsilon", lambda *a: evaluations.append(a) or real(*a))
    assert single.calibrate_bassily(*args, formula="lecture") == cold  # same key with the default spelled out
    assert len(evaluations) == 1  # ... but checks its σ by one evaluation
    assert single.cached_rdp_epsilon(cold.sigma / 2.0, 500, 500, 1e-5) == eps  # in the process only
    folder = cache.parent / "calibration"  # one folder for every calibration
    folder.joinpath("junk.json").write_text("{")  # a stray file is ignored
    assert len(list(folder.glob("*.json"))) == 2
    single.calibrate_bassily.cache_clear()
    single.cached_rdp_epsilon.cache_clear()


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


# --- values a privacy label or a figure rests on are checked when read back -----------------------------------


def rewrite(path, edit):
    """Edit an entry's value and store it with a matching checksum: a deliberate change, not corruption."""
    entry = json.loads(path.read_text())
    field = next(k for k in entry if k not in ("key", "sha256"))
    entry[field] = edit(entry[field])
    entry["sha256"] = diskcache._checksum(entry["key"], field, entry[field])
    path.write_text(json.dumps(entry))


def flip_text_bit(path, needle):
    """Flip the lowest bit of the first character of `needle` in the file (e.g. "1.04" -> "0.04")."""
    data = bytearray(path.read_bytes())
    at = data.index(needle.encode())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def flip_float_bit(x, bit):
    (bits,) = struct.unpack("<Q", struct.pack("<d", x))
    return struct.unpack("<d", struct.pack("<Q", bits ^ (1 << bit)))[0]


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_a_changed_or_corrupt_sigma_entry_is_discarded_and_recomputed(accountant, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, str(tmp_path))
    args = (1.0, 1e-5, 0.02, 300, accountant)
    honest = accounting.calibrate_sigma.__wrapped__(*args)
    (path,) = (tmp_path / "calibration").glob("*.json")
    tampered = [
        lambda cal: {**cal, "sigma": 0.1},  # under-noised: ε(0.1) is far above the target
        lambda cal: {**cal, "sigma": cal["sigma"] * 1.5},  # over-noised: ε below the window
        lambda cal: {**cal, "sigma": flip_float_bit(cal["sigma"], 0)},  # one ulp: off the lattice
        lambda cal: {**cal, "sigma": flip_float_bit(cal["sigma"], 62)},  # the exponent's top bit
    ]
    for edit in tampered:
        rewrite(path, edit)
        capsys.readouterr()
        assert accounting.calibrate_sigma.__wrapped__(*args) == honest
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "discarded the cache entry" in err and "sigma" in err
        assert json.loads(path.read_text())["calibration"]["sigma"] == honest.sigma  # rewritten
    for needle in (repr(honest.sigma)[:3], '"key"'):  # a flipped bit in the file: its checksum fails
        flip_text_bit(path, needle)
        capsys.readouterr()
        assert accounting.calibrate_sigma.__wrapped__(*args) == honest
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "corrupt" in err
    # a claimed ε (or order) is never copied from the cache: the run records the accountant's value at σ
    rewrite(path, lambda cal: {**cal, "epsilon": 0.5, "rdp_order": 2.5, "value_discretization_interval": 1.0})
    assert accounting.calibrate_sigma.__wrapped__(*args) == honest and not capsys.readouterr().err


def test_honest_entries_pass_the_check_at_every_target(tmp_path, monkeypatch):
    """No false alarm: every σ the calibration returns is accepted by the check (a cold search and a warm read
    give the same Calibration), on an ε axis through the RDP floor's neighbourhood and large ε."""
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, str(tmp_path))
    for q, steps, delta in ((256 / 30162, 589, 1 / 30162**2), (0.05, 40, 1e-5), (1.0, 3, 1e-3)):
        for target in (0.05, 0.3, 1.0, 3.0, 8.0, 30.0):
            try:
                cold = accounting.calibrate_sigma.__wrapped__(target, delta, q, steps, "rdp")
            except Exception:  # noqa: BLE001 - unreachable targets are refused elsewhere
                continue
            assert accounting._verified(cold, target, delta, q, steps, "rdp") == cold
            assert accounting.calibrate_sigma.__wrapped__(target, delta, q, steps, "rdp") == cold


def test_a_run_never_trains_at_a_tampered_sigma(cache, write_grid, tmp_path, monkeypatch, capsys):
    grid = load_grid_file(write_grid(GRID)).grids[0]
    run_grid(grid, tmp_path / "honest", True, monkeypatch)
    for path in (cache.parent / "calibration").glob("*.json"):
        rewrite(path, lambda cal: {**cal, "sigma": 0.1, "epsilon": cal["epsilon"]})
    forget_in_process()
    run_grid(grid, tmp_path / "tampered", True, monkeypatch)
    honest, again = table(tmp_path / "honest" / "lstar"), table(tmp_path / "tampered" / "lstar")
    assert again.equals(honest)  # σ, ε achieved, every number: as computed honestly
    assert "discarded the cache entry" in capsys.readouterr().err


@pytest.mark.parametrize("model_name", ["logreg", "mlp"])
def test_a_changed_or_corrupt_reference_optimum_is_discarded_and_recomputed(model_name, cache, capsys):
    _, X, y = problem()
    model = make_model(model_name, 4, 1e-3, {"hidden": 3} if model_name == "mlp" else {})
    theta, objective, info = erm.reference_minimum(model, X, y)
    (path,) = cache.glob("*.json")

    def zeros(ref):  # θ* set to zeros, its objective and gradient norm made to match
        model_zero = np.zeros((1, model.n_params))
        value, grad = model.objective_and_gradient(model_zero, X, y)
        return {**ref, "theta": [0.0] * model.n_params, "objective": float(value[0]),
                "info": {**ref["info"], "grad_norm": float(np.linalg.norm(grad[0]))}}

    tampered = [lambda ref: {**ref, "theta": [0.0] * model.n_params},  # θ* set to zeros
                lambda ref: {**ref, "theta": [t * 1.01 for t in ref["theta"]]},  # recorded F no longer matches
                lambda ref: {**ref, "objective": ref["objective"] - 0.1},  # a better L* than θ* gives
                lambda ref: {**ref, "info": {**ref["info"], "start_results": {  # a plateau the rule would not stop at
                    **ref["info"]["start_results"], "0": {**ref["info"]["start_results"]["0"], "stop": "plateau",
                                                          "converged": False, "plateau_decrease": 1.0}}}}]
    for edit in tampered:
        rewrite(path, edit)
        forget_in_process()
        capsys.readouterr()
        again, objective2, _ = erm.reference_minimum(model, X, y)
        assert np.array_equal(again, theta) and objective2 == objective
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "discarded the cache entry" in err
    if model.convex:  # zeros with a matching F and ‖∇F‖: not a minimiser (a non-convex θ* is only checked to lie
        rewrite(path, zeros)  # below its starts: θ = 0 is a stationary point of the MLP, below them on this data)
        forget_in_process()
        assert np.array_equal(erm.reference_minimum(model, X, y)[0], theta)
        assert "not a minimiser" in capsys.readouterr().err
    flip_text_bit(path, '"objective"')
    forget_in_process()
    assert np.array_equal(erm.reference_minimum(model, X, y)[0], theta)
    assert "corrupt" in capsys.readouterr().err


def test_a_tampered_bassily_calibration_is_discarded(cache, monkeypatch, capsys):
    from dpsgd_cli.privacy import single_example_gaussian as single

    args = (1.0, 1e-5, 500, 500, 1.0, "rdp")
    honest = single.calibrate_bassily(*args)
    (path,) = (cache.parent / "calibration").glob("*.json")
    for edit in (lambda p: {**p, "sigma": p["sigma"] / 4, "details": {**p["details"],
                                                                       "noise_multiplier": p["sigma"] / 8}},
                 lambda p: {**p, "epsilon": 0.1}):
        rewrite(path, edit)
        single.calibrate_bassily.cache_clear()
        assert single.calibrate_bassily(*args) == honest
    assert capsys.readouterr().err.count("discarded the cache entry") == 1  # ε is recomputed, not discarded
    single.calibrate_bassily.cache_clear()


# where Brent's method on log σ stopped for these arguments (1.0, 1e-5, 500, 500, 1.0, "rdp"): private, ε in the
# window [0.999, 1] (0.99905), but not a point of the calibration lattice
_BRENT_SIGMA = 1.8451008268666866


def test_a_bassily_sigma_of_another_search_is_not_served(cache, capsys):
    """A σ in the window that another search found (Brent's, before the lattice) is discarded, not served as the
    lattice's σ: the check wants exactly a lattice point."""
    from dpsgd_cli.privacy import single_example_gaussian as single

    args = (1.0, 1e-5, 500, 500, 1.0, "rdp")
    honest = single.calibrate_bassily(*args)
    (path,) = (cache.parent / "calibration").glob("*.json")
    rewrite(path, lambda p: {**p, "sigma": _BRENT_SIGMA,
                             "details": {**p["details"], "noise_multiplier": _BRENT_SIGMA / 2.0}})
    assert 0.999 <= single.cached_rdp_epsilon(_BRENT_SIGMA / 2.0, 500, 500, 1e-5) <= 1.0
    single.calibrate_bassily.cache_clear()
    assert single.calibrate_bassily(*args) == honest
    err = capsys.readouterr().err
    assert err.count("discarded the cache entry") == 1 and "not a point of the calibration lattice" in err
    single.calibrate_bassily.cache_clear()
