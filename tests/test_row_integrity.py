"""A row's columns have one source: the cell for what was asked, the run's verified calibration for its privacy
label, the metrics for its numbers. A disk-cache entry (L*, DP-SGD's σ, the single-example Gaussian's σ) holds
exactly the fields its check reads or recomputes; one with any other field is discarded with one line and
recomputed, even when its checksum is valid (anyone can recompute a checksum), so no key of an entry can become a
column of runs.csv."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from test_caches import forget_in_process
from test_fusion import run_grid, table

from dpsgd_cli import diskcache
from dpsgd_cli.algorithms import erm
from dpsgd_cli.algorithms.base import Outcome
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import runner
from dpsgd_cli.engine.results import COLUMNS, NUMERIC
from dpsgd_cli.models import make_model
from dpsgd_cli.privacy import accounting
from dpsgd_cli.privacy import single_example_gaussian as single

GRID = """
grids:
  - name: rows
    datasets: [{name: synthetic, n: 120, dim: 4}]
    models: [logreg]
    algorithms: [erm, dp_sgd, {name: bassily2014, accounting: rdp},
                 {name: bassily2014, accounting: advanced_composition}, {name: bassily2014, accounting: closed_form},
                 output_perturbation]
    epsilon: [1]
    batch_size: [20]
    lr: [0.5]
    seeds: 2
    epochs: 1
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(diskcache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    forget_in_process()
    yield tmp_path / "cache"
    forget_in_process()


def forged(column: str):
    """A value a forger would put under `column`: a number for a numeric column, else a label."""
    return 0.0123 if column in NUMERIC else "forged"


def with_key(value, column, where):
    """(`value`, an entry's stored value, with `column` set in the value itself ("value") or in every dict nested in
    it ("nested": a calibration's details, L*'s info and its per-start results); whether a field was added)."""
    if where == "value":
        return {**value, column: forged(column)}, column not in value
    added = []

    def nest(node, depth):
        if isinstance(node, dict):
            node = {k: nest(v, depth + 1) for k, v in node.items()}
            if depth:
                added.append(column not in node)
                return {**node, column: forged(column)}
        return node

    return nest(value, 0), any(added)


def tamper(path, column, where):
    """Store the entry with `column` added at `where` and a checksum recomputed by the documented scheme; whether a
    field was added (else one that the entry has took the forged value, or nothing changed)."""
    entry = json.loads(path.read_text())
    field = next(k for k in entry if k not in ("key", "sha256"))
    added = True
    if where == "entry":  # beside the key, the value and the checksum
        entry[column] = forged(column)
    else:
        entry[field], added = with_key(entry[field], column, where)
    entry["sha256"] = diskcache._checksum(entry["key"], field, entry[field])
    path.write_text(json.dumps(entry))
    return added


@pytest.mark.parametrize("where", ["entry", "value", "nested"])
def test_no_key_of_a_cache_entry_reaches_a_row(where, cache, write_grid, tmp_path, monkeypatch, capsys):
    # a discarded calibration is recomputed as the first time (the same numbers): once per test (RDP's ~3 s)
    monkeypatch.setattr(single, "_calibrate_bassily", functools.lru_cache(maxsize=None)(single._calibrate_bassily))
    grid = load_grid_file(write_grid(GRID)).grids[0]
    run_grid(grid, tmp_path / "honest", True, monkeypatch)
    honest = table(tmp_path / "honest" / "rows")
    assert set(honest["status"]) == {"ok"}
    entries = {path: path.read_text() for path in cache.glob("*/*.json")}
    values = [next(v for k, v in json.loads(text).items() if k not in ("key", "sha256")) for text in entries.values()]
    assert sum("theta" in v for v in values) == 1  # L*
    assert sum("sample_rate" in v for v in values) == 1  # DP-SGD's σ
    assert sum("details" in v for v in values) == 3  # the single-example Gaussian's σ, by three accountings
    for column in COLUMNS:
        added = {}
        for path, text in entries.items():
            path.write_text(text)
            added[path] = tamper(path, column, where)
        forget_in_process()
        capsys.readouterr()
        run_grid(grid, tmp_path / column, True, monkeypatch)
        again = table(tmp_path / column / "rows")
        changed = [c for c in honest if again[c].astype(str).tolist() != honest[c].astype(str).tolist()]
        assert not changed, f"a cache entry with the key {column!r} ({where}) changed the rows' {changed}"
        err = capsys.readouterr().err
        for path in entries:  # an entry with a field its check does not read: discarded in one line, rewritten
            if added[path]:
                assert f"discarded the cache entry {path}" in err, (column, where, path.name)
                assert path.read_text() == entries[path]
        assert all(line.startswith("note: discarded the cache entry") for line in err.splitlines()
                   if "cache entry" in line)


def test_a_derived_value_named_like_a_column_never_reaches_the_row(cache, write_grid, tmp_path, monkeypatch):
    """An algorithm whose derived values name a column the cell or the metrics own, or a privacy column while it
    is not private (a programming error), records failed runs naming the key; no column takes the value."""
    grid = load_grid_file(write_grid(GRID)).grids[0]
    grid = grid.model_copy(update={"algorithms": grid.algorithms[:2]})
    assert [c.algorithm.name for c in runner.expand(grid)] == ["erm", "dp_sgd"]
    run_grid(grid, tmp_path / "honest", True, monkeypatch)
    honest = table(tmp_path / "honest" / "rows")
    fit = erm.ERM.fit
    for column in [c for c in COLUMNS if c not in runner.REPORTED_COLUMNS or c in runner.PRIVACY_COLUMNS]:
        monkeypatch.setattr(erm.ERM, "fit", lambda self, *args, _c=column: Outcome(
            fit(self, *args).theta, {_c: forged(_c)}, guarantee="non-private"))
        plan = run_grid(grid, tmp_path / column, True, monkeypatch)
        rows = table(tmp_path / column / "rows")
        erm_rows = rows[rows["algorithm"] == "erm"]
        assert len(erm_rows) == 2 and len(plan.failures) == 2, column
        assert set(erm_rows["status"]) == {"failed"} and all(f"'{column}'" in m for m in erm_rows["message"])
        assert column not in rows or str(forged(column)) not in set(rows[column].astype(str)), column
        dp_sgd = [rows[rows["algorithm"] == "dp_sgd"].astype(str).to_dict("records") for rows in (rows, honest)]
        assert dp_sgd[0] == dp_sgd[1]


@pytest.mark.parametrize("derived, wrong", [({"sigma": "1.7"}, "sigma"), ({"accountant": 3}, "accountant"),
                                            ({"steps": 2.5}, "steps"), ({"epsilon_achieved": True}, "epsilon_achieved"),
                                            ({"noiseless_fraction": [0.1]}, "noiseless_fraction")])
def test_a_reported_value_of_the_wrong_type_is_refused(derived, wrong):
    with pytest.raises(ValueError, match=f"'{wrong}'"):
        runner.reported_columns(derived, replicas=2, private=True)


def test_the_reported_columns_are_columns():
    assert set(runner.REPORTED_COLUMNS) <= set(COLUMNS)
    assert {"sigma", "epsilon_achieved", "accountant"} <= set(runner.REPORTED_COLUMNS)


def without(value, path):
    """`value` without the field at `path` (a tuple of keys into nested dicts)."""
    if len(path) == 1:
        return {k: v for k, v in value.items() if k != path[0]}
    return {**value, path[0]: without(value[path[0]], path[1:])}


def fields(value, prefix=()):
    """The paths of every field of `value`, nested ones included."""
    for key, item in value.items():
        yield (*prefix, key)
        if isinstance(item, dict):
            yield from fields(item, (*prefix, key))


def exact(value) -> str:
    """A calibration or a reference minimum as text, every float by repr."""
    return json.dumps(value, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else vars(o))


@pytest.mark.parametrize("kind", ["dp_sgd", "bassily_advanced_composition", "reference"])
def test_a_cache_entry_without_a_field_is_discarded_in_one_line(kind, cache, capsys):
    model = make_model("logreg", 3, 1e-2, {})
    X = np.random.default_rng(0).normal(size=(60, 3)) / 3
    y = np.where(X[:, 0] > 0, 1.0, -1.0)
    compute = {"dp_sgd": lambda: accounting.calibrate_sigma.__wrapped__(1.0, 1e-5, 0.05, 40, "rdp"),
               "bassily_advanced_composition": lambda: single.calibrate_bassily.__wrapped__(
                   1.0, 1e-5, 60, 60, 1.0, "advanced_composition"),
               "reference": lambda: erm.reference_minimum(model, X, y)}[kind]
    honest = compute()
    (path,) = cache.glob("*/*.json")
    text = path.read_text()
    entry = json.loads(text)
    field = next(k for k in entry if k not in ("key", "sha256"))
    for missing in fields(entry[field]):
        entry[field] = without(json.loads(text)[field], missing)
        entry["sha256"] = diskcache._checksum(entry["key"], field, entry[field])
        path.write_text(json.dumps(entry))
        forget_in_process()
        capsys.readouterr()
        again = compute()
        assert exact(again) == exact(honest), missing
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"discarded the cache entry {path}" in err, missing
        assert path.read_text() == text
