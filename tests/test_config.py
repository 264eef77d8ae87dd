"""Grid files: expansion and every validation error (one line naming the path and the fix)."""

import textwrap

import pytest

from dpsgd_cli.config import expand, load_grid_file, select
from dpsgd_cli.errors import UserError

BASE = """
grids:
  - name: g
    datasets: [synthetic]
    models: [logreg]
    algorithms: [erm, sgd, dp_sgd]
    epsilon: [0.1, 1, 3]
    batch_size: [64, 128]
    lr: [0.5]
    seeds: 3
    epochs: 5
    delta: 1/n^2
"""


def write(tmp_path, text):
    path = tmp_path / "grid.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def grid_of(tmp_path, text=BASE):
    return load_grid_file(write(tmp_path, text)).grids[0]


def error_of(tmp_path, text):
    with pytest.raises(UserError) as info:
        load_grid_file(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_expansion_counts_and_unused_axes(tmp_path):
    cells = expand(grid_of(tmp_path))
    by_algo = {}
    for c in cells:
        by_algo.setdefault(c.algorithm.name, []).append(c)
    assert len(by_algo["erm"]) == 1  # uses no swept axis
    assert len(by_algo["sgd"]) == 2  # batch sizes only
    assert len(by_algo["dp_sgd"]) == 3 * 2
    assert all(c.epsilon is None and c.batch_size is None for c in by_algo["erm"])
    assert all(c.seeds == (0, 1, 2) for c in cells)
    assert len({c.cell_id for c in cells}) == len(cells)


def test_run_ids_are_stable_and_distinct(tmp_path):
    a, b = expand(grid_of(tmp_path)), expand(grid_of(tmp_path))
    assert [c.run_id(0) for c in a] == [c.run_id(0) for c in b]
    ids = {c.run_id(s) for c in a for s in c.seeds}
    assert len(ids) == sum(len(c.seeds) for c in a)


def test_algorithm_overrides_and_params(tmp_path):
    text = BASE.replace("algorithms: [erm, sgd, dp_sgd]",
                        "algorithms: [{name: dp_sgd, accountant: pld, lr: [0.1, 0.2], batch_size: 32}]")
    cells = expand(grid_of(tmp_path, text))
    assert {c.lr for c in cells} == {0.1, 0.2} and {c.batch_size for c in cells} == {32}
    assert all(c.algorithm.params == {"accountant": "pld", "backend": "auto"} for c in cells)
    assert all("backend" not in c.key()["algorithm"]["params"] for c in cells)  # an execution setting: not in run ids


def test_dataset_options_and_scalars(tmp_path):
    text = BASE.replace("datasets: [synthetic]", "datasets: [{name: kddcup99, subsample: 70000}]").replace(
        "lr: [0.5]", "lr: 0.5")
    grid = grid_of(tmp_path, text)
    assert grid.datasets[0].subsample == 70000 and grid.lr == [0.5]


def test_delta_number(tmp_path):
    assert grid_of(tmp_path, BASE.replace("delta: 1/n^2", "delta: 1e-5")).delta == 1e-5


@pytest.mark.parametrize("old,new,expected", [
    ("epochs: 5", "epoch: 5", "grids[0]: unknown key 'epoch' (did you mean 'epochs'?)"),
    ("algorithms: [erm, sgd, dp_sgd]", "algorithms: [{name: dp_sgd, acountant: pld}]",
     "unknown key 'acountant' for algorithm dp_sgd (did you mean 'accountant'?)"),
    ("algorithms: [erm, sgd, dp_sgd]", "algorithms: [dp_sdg]", "unknown algorithm 'dp_sdg' (did you mean 'dp_sgd'?)"),
    ("datasets: [synthetic]", "datasets: [{name: kddcup99, subsampel: 5}]",
     "grids[0].datasets[0]: unknown key 'subsampel' (did you mean 'subsample'?)"),
    ("datasets: [synthetic]", "datasets: [adlut]", "grids[0].datasets[0].name"),
    ("models: [logreg]", "models: [logreg2]", "unknown model 'logreg2' (did you mean 'logreg'?)"),
    ("epsilon: [0.1, 1, 3]", "epsilon: [0, 1]", "epsilon = 0 must be in [0.001, 1000]"),
    ("epsilon: [0.1, 1, 3]", "epsilon: [-1]", "epsilon = -1 must be in [0.001, 1000]"),
    ("lr: [0.5]", "lr: [0]", "lr = 0 must be in (0, "),
    ("batch_size: [64, 128]", "batch_size: [0]", "batch_size = 0 must be an integer ≥ 1"),
    ("delta: 1/n^2", "delta: 1.5", "delta = 1.5 must be in (0, 1)"),
    ("delta: 1/n^2", "delta: 0", "delta = 0 must be in (0, 1)"),
    ("delta: 1/n^2", "delta: 1/n", "delta = '1/n' must be a number in (0, 1) or '1/n^2'"),
    ("seeds: 3", "seeds: 0", "grids[0].seeds"),
    ("algorithms: [erm, sgd, dp_sgd]", "algorithms: [{name: dp_sgd, lr: -1}]", "lr = -1 must be in (0, "),
    ("algorithms: [erm, sgd, dp_sgd]", "algorithms: [{name: dp_sgd, accountant: xyz}]", "accountant"),
])
def test_validation_errors(tmp_path, old, new, expected):
    assert old in BASE
    message = error_of(tmp_path, BASE.replace(old, new))
    assert expected in message, message
    assert message.startswith(str(tmp_path / "grid.yaml"))


def test_missing_required_key(tmp_path):
    assert "required key 'datasets' is missing" in error_of(tmp_path, BASE.replace("datasets: [synthetic]", ""))


def test_yaml_syntax_error_names_line(tmp_path):
    assert "invalid YAML at line" in error_of(tmp_path, "grids:\n  - name: [unclosed\n")


def test_yaml_control_character_is_one_line(tmp_path):
    message = error_of(tmp_path, "grids:\n  - name: a\x07b\n")
    assert "invalid YAML" in message and "\n" not in message, message


@pytest.mark.parametrize("text", ["grids:\n  - name:\tx\n", "grids:\n  - name: x\t\n", "grids: [{name:\tx}]\n"])
def test_a_tab_libyaml_would_take_is_refused_as_without_libyaml(tmp_path, text):
    """Tabs as separators: libyaml reads them, PyYAML's scanner does not; a grid file's validity must not depend
    on which build is installed, so both refuse (one line, naming the place)."""
    import yaml

    from dpsgd_cli.config import GridLoader

    with pytest.raises(yaml.YAMLError):
        list(yaml.scan(text, Loader=GridLoader))
    message = error_of(tmp_path, text)
    assert "invalid YAML at line 2" in message or "invalid YAML at line 1" in message, message
    assert "\n" not in message


def test_tabs_inside_quoted_strings_are_still_read(tmp_path):
    from dpsgd_cli.config import read_yaml

    path = tmp_path / "g.yaml"
    path.write_text('grids:\n  - name: "a\tb"\n')
    assert read_yaml(path) == {"grids": [{"name": "a\tb"}]}


def test_fast_loader_reads_what_the_python_loader_reads(tmp_path):
    """libyaml's parser (what read_yaml uses) gives the pure-Python loader's document, `1e-3` a float included."""
    from pathlib import Path

    from dpsgd_cli.config import GridLoader, read_yaml

    text = (Path(__file__).resolve().parents[1] / "experiments.yaml").read_text()
    text += "extra: {lr: 1e-3, n: 7, s: '1e-3'}\n"
    loader = GridLoader(text)
    try:
        expected = loader.construct_document(loader.get_single_node())
    finally:
        loader.dispose()
    got = read_yaml(write(tmp_path, text))
    assert got == expected and got["extra"] == {"lr": 1e-3, "n": 7, "s": "1e-3"}


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_grid_file(tmp_path / "absent.yaml")


def test_duplicate_grid_names(tmp_path):
    text = BASE + BASE.replace("grids:\n", "")
    assert "repeated: g" in error_of(tmp_path, text)


def test_select_unknown_grid(tmp_path):
    grid_file = load_grid_file(write(tmp_path, BASE))
    with pytest.raises(UserError, match=r"--only h: no such grid"):
        select(grid_file, ["h"])
    assert [g.name for g in select(grid_file, ["g"])] == ["g"]


def test_manifest_round_trip_keeps_run_ids(tmp_path):
    text = BASE.replace("algorithms: [erm, sgd, dp_sgd]", "algorithms: [erm, {name: dp_sgd, accountant: pld, lr: 0.2}]")
    grid = grid_of(tmp_path, text)
    from dpsgd_cli.config import Grid

    again = Grid.model_validate(grid.model_dump(mode="json"))
    assert [c.run_id(0) for c in expand(again)] == [c.run_id(0) for c in expand(grid)]


def test_execution_parameters_do_not_change_run_ids(tmp_path):
    ids = []
    for backend in ("auto", "numpy"):
        text = BASE.replace("algorithms: [erm, sgd, dp_sgd]", f"algorithms: [{{name: song2013, backend: {backend}}}]")
        ids.append([c.run_id(0) for c in expand(grid_of(tmp_path, text))])
    assert ids[0] == ids[1]
    text = BASE.replace("algorithms: [erm, sgd, dp_sgd]", "algorithms: [{name: song2013, schedule: inv_t}]")
    assert [c.run_id(0) for c in expand(grid_of(tmp_path, text))] != ids[0]


def test_float32_reaches_the_mlp_and_gives_it_new_run_ids(tmp_path):
    text = BASE.replace("models: [logreg]", "models: [logreg, mlp]")
    wide = {(c.model.name, c.algorithm.name, c.epsilon, c.batch_size): c for c in expand(grid_of(tmp_path, text))}
    cells = expand(grid_of(tmp_path, text.replace("delta: 1/n^2", "delta: 1/n^2\n    dtype: float32")))
    assert {(c.model.name, c.algorithm.name, c.dtype) for c in cells} == {
        (m, a, "float32" if a != "erm" else "float64") for m in ("logreg", "mlp") for a in ("erm", "sgd", "dp_sgd")}
    for c in cells:  # a float32 cell is another run; float64 cells keep the ids they had
        same = c.run_id(0) == wide[(c.model.name, c.algorithm.name, c.epsilon, c.batch_size)].run_id(0)
        assert same == (c.dtype == "float64")
