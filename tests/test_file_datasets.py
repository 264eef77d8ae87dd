"""File datasets (`{name: file, path: ...}`): formats, label mapping, encoding, train-only statistics,
run ids that follow the file's content, and one-line errors for bad files."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import dump_svmlight_file

from dpsgd_cli.cli import main
from dpsgd_cli.config import expand, load_grid_file
from dpsgd_cli.data import load_dataset
from dpsgd_cli.data.files import file_dataset_info, file_spec, load_file_dataset, sha256_of
from dpsgd_cli.errors import DataError

RAW = {"standardize": False, "unit_ball": "none"}  # features exactly as in the file
EXAMPLES = Path(__file__).parents[1] / "examples"


def load(path: Path, **options):
    return load_file_dataset(file_spec({"path": str(path), **options}))


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_csv_tsv_parquet_libsvm_npz_give_the_same_arrays(tmp_path):
    rng = np.random.default_rng(7)
    X = np.round(rng.uniform(0.5, 3.0, size=(40, 3)), 3)  # no zeros: LIBSVM's sparse rows keep every column
    y = (X[:, 0] + rng.normal(0, 0.3, 40) > 1.7).astype(int)
    frame = pd.DataFrame(X, columns=["x0", "x1", "x2"]).assign(y=y)
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_csv(tmp_path / "d.tsv", index=False, sep="\t")
    frame.to_parquet(tmp_path / "d.parquet", index=False)
    dump_svmlight_file(X, y, str(tmp_path / "d.libsvm"), zero_based=False)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    names = ["d.npz", "d.csv", "d.tsv", "d.parquet", "d.libsvm"]
    for options in (RAW, {}):  # the file's values, and the default preprocessing
        loaded = [load(tmp_path / n, **options, **({"label": "y"} if n[2:] in ("csv", "tsv", "parquet") else {}))
                  for n in names]
        for name, data in zip(names, loaded):
            for part in ("X_train", "y_train", "X_test", "y_test"):
                np.testing.assert_array_equal(getattr(data, part), getattr(loaded[0], part), err_msg=name)
    raw = load(tmp_path / "d.npz", **RAW)
    assert raw.X_train.shape == (32, 3) and raw.X_test.shape == (8, 3)  # seeded 80/20 split
    index_of = {tuple(row): i for i, row in enumerate(X)}  # rows are distinct
    order = [index_of[tuple(r)] for r in np.vstack([raw.X_train, raw.X_test])]
    assert sorted(order) == list(range(40)) and order[:32] == sorted(order[:32])  # file order kept
    np.testing.assert_array_equal(np.r_[raw.y_train, raw.y_test], np.where(y[order] == 1, 1.0, -1.0))


def test_label_mapping(tmp_path):
    path = write(tmp_path / "t.csv", """
        x,status
        1,a
        2,b
        3,c
        4,b
        5,a
    """)
    data = load(path, label="status", positive="b", test_path=str(path), **RAW)
    np.testing.assert_array_equal(data.y_train, [-1, 1, -1, 1, -1])  # one-vs-rest: b is +1
    yes_no = write(tmp_path / "yn.csv", "x,default\n1,no\n2,yes\n3,no\n")
    assert list(load(yes_no, label="default", test_path=str(yes_no), **RAW).y_train) == [-1, 1, -1]
    zero_one = write(tmp_path / "01.csv", "x,y\n1,1\n2,0\n3,1\n")  # the larger of two values is +1
    assert list(load(zero_one, label="y", test_path=str(zero_one), **RAW).y_train) == [1, -1, 1]
    # a number given as text (as `datasets info --positive 0` passes it) matches a numeric label
    assert list(load(zero_one, label="y", positive="0", test_path=str(zero_one), **RAW).y_train) == [-1, 1, -1]


def test_categorical_encoding_uses_the_training_vocabulary(tmp_path):
    train = write(tmp_path / "train.csv", """
        size,colour,y
        1,red,1
        2,blue,0
        3,green,1
        4,red,0
    """)
    test = write(tmp_path / "test.csv", "size,colour,y\n5,purple,1\n6,blue,0\n")
    data = load(train, label="y", test_path=str(test), **RAW)
    # [size | blue green red]: categories sorted, from the training file; purple unseen -> all zeros
    np.testing.assert_array_equal(data.X_train, [[1, 0, 0, 1], [2, 1, 0, 0], [3, 0, 1, 0], [4, 0, 0, 1]])
    np.testing.assert_array_equal(data.X_test, [[5, 0, 0, 0], [6, 1, 0, 0]])
    assert data.train_statistics == ("category vocabulary",)
    # an integer column made categorical by `categorical:` (then every categorical column must be listed)
    coded = load(train, label="y", categorical=["size", "colour"], test_path=str(train), **RAW)
    assert coded.X_train.shape == (4, 4 + 3)
    codes = load(train, label="y", one_hot=False, test_path=str(test), **RAW)
    np.testing.assert_array_equal(codes.X_test, [[5, -1], [6, 0]])  # integer codes; unseen -> -1


def test_standardisation_uses_training_statistics_only(tmp_path):
    train = write(tmp_path / "train.csv", "x,c,y\n1,7,0\n2,7,1\n3,7,1\n")
    test = write(tmp_path / "test.csv", "x,c,y\n5,9,0\n")
    data = load(train, label="y", test_path=str(test), unit_ball="none")
    std = np.sqrt(2 / 3)  # population std of 1, 2, 3
    np.testing.assert_allclose(data.X_train[:, 0], [-1 / std, 0, 1 / std])
    np.testing.assert_allclose(data.X_test[:, 0], [(5 - 2) / std])  # the test value does not move the mean
    np.testing.assert_array_equal(data.X_test[:, 1], [9])  # constant in train: left as is
    assert data.train_statistics == ("standardisation",)


def test_missing_values_dropped_or_imputed_with_training_means(tmp_path):
    train = write(tmp_path / "train.csv", "x,colour,y\n1,red,0\n,red,1\n3,,1\n5,blue,\n2,blue,1\n")
    test = write(tmp_path / "test.csv", "x,colour,y\n,blue,0\n")
    dropped = file_dataset_info(file_spec({"path": str(train), "label": "y", "test_path": str(train), **RAW}))
    assert dropped["rows_dropped"] == [3, 3] and dropped["rows_missing_label"] == [1, 1]
    assert dropped["rows_missing_values"] == [2, 2] and dropped["n_train"] == 2
    spec = file_spec({"path": str(train), "label": "y", "test_path": str(test), "missing": "impute", **RAW})
    data, info = load_file_dataset(spec), file_dataset_info(spec)
    # rows without a label are always dropped; x's training mean is (1 + 3 + 2) / 3 = 2; a missing
    # category is an all-zero block; columns [x | blue red]
    np.testing.assert_array_equal(data.X_train, [[1, 0, 1], [2, 0, 1], [3, 0, 0], [2, 1, 0]])
    np.testing.assert_array_equal(data.X_test, [[2, 1, 0]])
    assert info["rows_dropped"] == [1, 0] and info["training_values_imputed"] == 1
    assert "imputation means" in data.train_statistics and "imputed" in data.summary


def _grid(folder: Path, data_path: str, **extra) -> Path:
    options = ", ".join(f"{k}: {v}" for k, v in {"path": data_path, "label": "y", **extra}.items())
    grid = folder / "grid.yaml"
    grid.write_text(textwrap.dedent(f"""
        name: g
        datasets:
          - {{name: file, {options}}}
        algorithms: [sgd]
        batch_size: 8
        seeds: 1
    """))
    return grid


def test_run_id_follows_the_file_content_not_its_place(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "data").mkdir(parents=True)
    write(a / "data" / "d.csv", "x,y\n1,0\n2,1\n3,1\n4,0\n")
    monkeypatch.chdir(tmp_path)  # relative paths are relative to the grid file's folder, not the cwd

    def run_id(folder: Path, **extra) -> str:
        cell = expand(load_grid_file(_grid(folder, "data/d.csv", **extra)).grids[0])[0]
        assert cell.dataset.path == str(folder / "data" / "d.csv") and cell.dataset.id == "d"
        return cell.run_id(0)

    first = run_id(a)
    shutil.copytree(a / "data", b / "data")
    assert run_id(b) == first  # same bytes elsewhere: same runs
    spec = load_grid_file(_grid(b, "data/d.csv")).grids[0].datasets[0]
    write(b / "data" / "d.csv", "x,y\n1,0\n2,1\n3,1\n5,0\n")
    assert run_id(b) != first  # edited: new runs
    with pytest.raises(DataError, match="changed since the grid was read"):  # edited while a grid runs
        load_file_dataset(spec)
    assert run_id(a, sha256=sha256_of(a / "data" / "d.csv")) == first  # a pinned hash is checked, same id


def test_run_records_path_hash_and_statistics_and_prints_the_caveat_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    pd.DataFrame({"a": X[:, 0], "b": X[:, 1], "kind": rng.choice(["u", "v"], 60),
                  "y": np.where(X[:, 0] > 0, "yes", "no")}).to_csv(tmp_path / "d.csv", index=False)
    grid = _grid(tmp_path, "d.csv", positive='"yes"', id="mine")
    code = _main(monkeypatch, "run", str(grid), "--out", str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert code == 0 and out.count("not covered by the accountant") == 1
    assert "mine: d.csv (csv, sha256 " in out and "60 rows read, 0 dropped" in out
    assert "dataset=mine" in out  # the summary table finds the runs again from the manifest (its spec is trusted)
    rows = pd.read_csv(tmp_path / "out" / "g" / "runs.csv")
    options = json.loads(rows["dataset_options"][0])
    assert list(rows["dataset"]) == ["mine"] and rows["status"][0] == "ok"
    assert options["path"] == str(tmp_path / "d.csv") and options["sha256"] == sha256_of(tmp_path / "d.csv")
    assert json.loads(rows["derived"][0])["train_statistics"] == "standardisation, category vocabulary"


def test_load_dataset_dispatches_file_specs(tmp_path):
    path = write(tmp_path / "d.csv", "x,y\n1,0\n2,1\n3,1\n4,0\n5,1\n")
    spec = file_spec({"path": str(path), "label": "y"})
    assert load_dataset(spec).name == "d"


def test_datasets_info_previews_a_file(tmp_path, monkeypatch, capsys):
    path = write(tmp_path / "d.csv", "x,city,label\n1,Paris,yes\n2,Rome,no\n,Oslo,yes\n4,Rome,no\n5,Oslo,yes\n")
    code = _main(monkeypatch, "datasets", "info", "--path", str(path), "--label", "label",
                 "--set", "test_fraction=0.25")
    out = capsys.readouterr().out
    assert code == 0
    for line in ("rows_dropped: 1\n", "rows_missing_values: 1\n", "n_train: 3", "n_test: 1", "positive: yes",
                 "train_statistics: standardisation, category vocabulary"):
        assert line in out, (line, out)


def _main(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["dpsgd", *args])
    with pytest.raises(SystemExit) as stop:
        main()
    return stop.value.code


@pytest.mark.parametrize("case,args,expected", [
    ("missing file", ["--path", "nope.csv", "--label", "y"], "no such file"),
    ("missing file in a grid", ["run", "GRID:nope.csv"], "nope.csv: no such file (a relative path is relative "
                                                        "to the grid file's folder)"),
    ("unknown extension", ["--path", "d.dat", "--label", "y"], "add format:"),
    ("unreadable parquet", ["--path", "bad.parquet", "--label", "y"], "cannot read as parquet"),
    ("unreadable libsvm", ["--path", "bad.libsvm"], "cannot read as libsvm"),
    ("npz without X", ["--path", "bad.npz"], "needs arrays X and y"),
    ("label absent", ["--path", "d.csv", "--label", "labl"], "did you mean 'label'?"),
    ("no label given", ["--path", "d.csv"], "give label:"),
    ("single class", ["--path", "one.csv", "--label", "label"], "single class"),
    ("positive absent", ["--path", "d.csv", "--label", "label", "--positive", "maybe"], "does not occur"),
    ("many classes", ["--path", "three.csv", "--label", "label"], "give positive:"),
    ("text column not encoded", ["--path", "d.csv", "--label", "label", "--set", "categorical=[]"],
     "column 'city' is not numeric (e.g. 'Paris')"),
    ("unknown drop column", ["--path", "d.csv", "--label", "label", "--drop", "cty"], "did you mean 'city'?"),
    ("label on libsvm", ["--path", "ok.libsvm", "--label", "y"], "only for csv, tsv and parquet"),
    ("identifier column", ["--path", "ids.csv", "--label", "label"],
     "column 'name' has a different value in every row"),
    ("infinite value", ["--path", "inf.csv", "--label", "label"], "column 'x' holds infinite values"),
    ("unknown option", ["--path", "d.csv", "--label", "label", "--set", "unit_bal=row"], "did you mean 'unit_ball'?"),
])
def test_bad_files_are_one_line_with_exit_code_2(tmp_path, monkeypatch, capsys, case, args, expected):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "d.csv", "x,city,label\n1,Paris,yes\n2,Rome,no\n3,Oslo,yes\n")
    write(tmp_path / "d.dat", "x,label\n1,1\n")
    write(tmp_path / "one.csv", "x,label\n1,yes\n2,yes\n")
    write(tmp_path / "inf.csv", "x,label\n1,yes\ninf,no\n")
    write(tmp_path / "ids.csv", "name,label\n" + "".join(f"n{i},{i % 2}\n" for i in range(30)))
    write(tmp_path / "three.csv", "x,label\n1,a\n2,b\n3,c\n")
    write(tmp_path / "bad.parquet", "not parquet\n")
    write(tmp_path / "bad.libsvm", "1 qid:x 3:abc\n")
    write(tmp_path / "ok.libsvm", "1 1:0.5\n-1 2:0.5\n")
    np.savez(tmp_path / "bad.npz", features=np.ones((2, 2)))
    if args[0] == "run":
        args = ["run", str(_grid(tmp_path, args[1].split(":")[1]))]
    else:
        args = ["datasets", "info", *args]
    code = _main(monkeypatch, *args)
    err = capsys.readouterr().err
    assert code == 2, (case, err)
    assert expected in err and len(err.strip().splitlines()) == 1, (case, err)


def test_readme_examples_run_from_a_fresh_clone(tmp_path, monkeypatch, capsys):
    """docs/datasets.md, "Your own data": the script writes the three files, the grid runs on them."""
    folder = tmp_path / "examples"
    folder.mkdir()
    shutil.copy(EXAMPLES / "own_data.yaml", folder)
    monkeypatch.setattr(sys, "argv", ["make_own_data.py", str(folder / "data")])
    runpy.run_path(str(EXAMPLES / "make_own_data.py"), run_name="__main__")
    grid = load_grid_file(folder / "own_data.yaml").grids[0]
    ids = [d.id for d in grid.datasets]
    assert ids == ["credit", "a9a", "records"]
    infos = {d.id: file_dataset_info(d) for d in grid.datasets}
    assert infos["credit"]["rows_dropped"] == [12] and infos["credit"]["positive"] == "yes"
    assert infos["a9a"]["features"] == 123 and infos["a9a"]["n_test"] == 200
    assert "patient_id" not in infos["records"]["numeric_columns"] + list(infos["records"]["categorical_columns"])
    smaller = grid.model_copy(update={"algorithms": grid.algorithms[:1], "seeds": 1})  # erm only: seconds
    from dpsgd_cli.engine import execute, plan_grid

    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    execute(plan_grid(smaller, tmp_path / "out"))
    rows = pd.read_csv(tmp_path / "out" / "own_data" / "runs.csv")
    assert sorted(rows["dataset"]) == ["a9a", "credit", "records"] and (rows["status"] == "ok").all()
    assert (rows["test_accuracy"] > 0.7).all()


# --- data that cannot be learned from, and files that are not data -----------------------------------------------
def _refused(tmp_path, monkeypatch, capsys, path: Path, *extra: str) -> str:
    monkeypatch.chdir(tmp_path)
    code = _main(monkeypatch, "datasets", "info", "--path", str(path), *extra)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("rows, expected", [
    (["1e300,{b},{y}"] * 3, "column 'a' holds values too large"),  # squares overflow: standardised to 0 or NaN
    (["1.7e308,{b},{y}", "-1.7e308,{b},{y}"], "column 'a' holds values too large"),
    (["1e999,{b},{y}", "1,{b},{y}"], "column 'a' holds infinite values"),  # beyond float64: parsed as inf
    (["1,,{y}"], "column 'b' is missing in"),  # an all-empty column: not "the label has a single class ()"
])
def test_values_that_cannot_be_learned_from_name_the_file_and_column(tmp_path, monkeypatch, capsys, rows, expected):
    lines = [row.format(b=i % 7, y=i % 2) for i in range(40) for row in rows[i % len(rows):][:1]]
    path = write(tmp_path / "bad.csv", "a,b,y\n" + "\n".join(lines) + "\n")
    err = _refused(tmp_path, monkeypatch, capsys, path, "--label", "y")
    assert expected in err and "bad" in err


def test_a_file_with_a_label_and_no_feature_is_refused(tmp_path, monkeypatch, capsys):
    path = write(tmp_path / "only.csv", "y,id\n" + "".join(f"{i % 2},{i}\n" for i in range(30)))
    err = _refused(tmp_path, monkeypatch, capsys, path, "--label", "y", "--drop", "id")
    assert "no feature column" in err and "only" in err


def test_inf_in_an_array_file_is_refused(tmp_path, monkeypatch, capsys):
    X = np.ones((20, 2))
    X[3, 1] = np.inf
    np.savez(tmp_path / "a.npz", X=X, y=np.arange(20) % 2)
    assert "column 'x1' holds infinite values" in _refused(tmp_path, monkeypatch, capsys, tmp_path / "a.npz")


def test_a_folder_or_a_fifo_is_not_called_a_missing_file(tmp_path, monkeypatch, capsys):
    import os

    (tmp_path / "folder.csv").mkdir()
    os.mkfifo(tmp_path / "pipe.csv")
    assert "is a folder" in _refused(tmp_path, monkeypatch, capsys, tmp_path / "folder.csv", "--label", "y")
    assert "not a regular file" in _refused(tmp_path, monkeypatch, capsys, tmp_path / "pipe.csv", "--label", "y")


def test_a_data_file_too_large_is_refused_before_it_is_hashed(tmp_path, monkeypatch, capsys):
    from dpsgd_cli.data import files

    path = write(tmp_path / "d.csv", "a,y\n" + "".join(f"{i},{i % 2}\n" for i in range(30)))
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 100)
    monkeypatch.setattr(files, "sha256_of", lambda p: pytest.fail("hashed before the size check"))
    err = _refused(tmp_path, monkeypatch, capsys, path, "--label", "y")
    assert "GiB a data file may have" in err
