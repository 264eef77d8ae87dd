"""Tests of dpsgd_cli.data: registry, download cache, parsers and preprocessing.

Real-data tests read the shared mirror through a loopback HTTP server (fixtures in conftest.py);
each real file is downloaded once per session into a temporary cache.
"""

from __future__ import annotations

import hashlib
import http.server
import socket
import threading
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dpsgd_cli.data import (
    REGISTRY,
    Dataset,
    DatasetSpec,
    dataset_info,
    fetch,
    fetch_file,
    list_datasets,
    load_dataset,
    make_synthetic,
    processed_path,
    read_adult,
    read_bank,
    read_kddcup99,
    read_mnist,
    resolve_spec,
)
from dpsgd_cli.data import load as load_module
from dpsgd_cli.data import preprocess as pp
from dpsgd_cli.errors import DataError, UserError

TOL = 1e-12
ARRAYS = ("X_train", "y_train", "X_test", "y_test")


def row_norms(X: np.ndarray) -> np.ndarray:
    return np.linalg.norm(X, axis=1)


def assert_well_formed(ds: Dataset) -> None:
    """float64 features, labels in {-1, +1}, same columns in train and test."""
    assert ds.X_train.dtype == np.float64 and ds.X_test.dtype == np.float64
    assert ds.y_train.dtype == np.float64 and ds.y_test.dtype == np.float64
    assert ds.X_train.shape[1] == ds.X_test.shape[1]
    assert ds.X_train.shape[0] == ds.y_train.shape[0] and ds.X_test.shape[0] == ds.y_test.shape[0]
    assert set(np.unique(ds.y_train)) == {-1.0, 1.0}
    assert set(np.unique(ds.y_test)) <= {-1.0, 1.0}
    assert np.isfinite(ds.X_train).all() and np.isfinite(ds.X_test).all()


def assert_in_unit_ball(ds: Dataset) -> None:
    assert row_norms(ds.X_train).max() <= 1 + TOL
    assert row_norms(ds.X_test).max() <= 1 + TOL


def assert_same_arrays(a: Dataset, b: Dataset) -> None:
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh, empty DPSGD_DATA_DIR for this test only."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DPSGD_DATA_DIR", str(cache))
    return cache


# ---------------------------------------------------------------- registry and info


def test_registry_lists_all_datasets_with_checksums():
    assert set(REGISTRY) == {"adult", "bank", "kddcup99", "mnist", "synthetic"}
    for entry in REGISTRY.values():
        assert entry.licence and entry.source and entry.description
        for f in entry.files:
            assert len(f.sha256) == 64 and f.url.startswith("http")


def test_registry_checksums_match_the_mirror_sha256sums(shared_datasets_dir):
    sums = {}
    for line in (shared_datasets_dir / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.lstrip("*").removeprefix("./")] = digest
    for entry in REGISTRY.values():
        for f in entry.files:
            assert sums[f"{entry.name}/{f.name}"] == f.sha256


def _load_by_name(name: str) -> Dataset:
    return load_dataset(DatasetSpec.model_construct(name=name))  # bypasses the Literal check


@pytest.mark.parametrize("call", [dataset_info, fetch, _load_by_name])
def test_unknown_dataset_names_the_closest_valid_one(call):
    with pytest.raises(DataError) as err:
        call("adlt")
    assert "'adult'" in one_line(err)
    assert isinstance(err.value, UserError)


def test_list_datasets_on_empty_cache(empty_cache):
    rows = {row["name"]: row for row in list_datasets()}
    assert set(rows) == set(REGISTRY)
    assert rows["adult"]["records"] == 45222 and not rows["adult"]["cached"]
    assert rows["adult"]["size_bytes"] == 0
    assert rows["synthetic"]["cached"] and rows["synthetic"]["files"] == []
    for row in rows.values():
        assert {"description", "files", "source", "license"} <= set(row)


def test_dataset_info_gives_defaults_and_file_details(empty_cache):
    info = dataset_info("mnist")
    assert info["defaults"]["split"] == "official" and info["defaults"]["positive_digit"] == 1
    assert [d["name"] for d in info["file_details"]] == info["files"]
    assert all(not d["cached"] and not d["verified"] for d in info["file_details"])
    assert dataset_info("synthetic")["defaults"]["n"] == 10000
    assert dataset_info("kddcup99")["defaults"]["split"] == "random"


def test_fetch_synthetic_needs_no_files():
    assert fetch("synthetic") == []


# ---------------------------------------------------------------- downloads


def test_download_over_loopback_then_cache_hit_without_http(dataset_mirror, empty_cache, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_MIRROR", dataset_mirror.url + "/")  # trailing slash tolerated
    before = len(dataset_mirror.requests)
    (path,) = fetch("bank")
    assert dataset_mirror.requests[before:] == ["/bank/bank-additional.zip"]
    assert path == empty_cache / "bank" / "bank-additional.zip"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == REGISTRY["bank"].files[0].sha256
    assert sorted(p.name for p in path.parent.iterdir()) == ["bank-additional.zip"]  # no temp files

    assert fetch("bank") == [path]
    assert len(dataset_mirror.requests) == before + 1  # second fetch: no HTTP request
    assert dataset_info("bank")["file_details"][0]["verified"]


def test_corrupt_download_is_rejected_and_leaves_nothing(
    tmp_path, empty_cache, monkeypatch, serve_data_folder
):
    fake = tmp_path / "bad-mirror"
    (fake / "adult").mkdir(parents=True)
    (fake / "adult" / "adult.test").write_bytes(b"not the UCI file\n")
    server = serve_data_folder(fake)
    monkeypatch.setenv("DPSGD_DATA_MIRROR", server.url)
    with pytest.raises(DataError) as err:
        fetch_file("adult", "adult.test")
    message = one_line(err)
    dest = empty_cache / "adult" / "adult.test"
    assert "sha256" in message and f"{server.url}/adult/adult.test" in message
    assert "DPSGD_DATA_MIRROR" in message and str(dest) in message
    assert server.requests == ["/adult/adult.test"]
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []


class _TruncatingHandler(http.server.BaseHTTPRequestHandler):
    """Announces 1 MB, sends 10 bytes, then drops the connection."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        self.wfile.write(b"0123456789")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format, *args):  # noqa: A002
        pass


def test_truncated_download_leaves_nothing(empty_cache, monkeypatch):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TruncatingHandler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        monkeypatch.setenv("DPSGD_DATA_MIRROR", f"http://127.0.0.1:{httpd.server_address[1]}")
        with pytest.raises(DataError) as err:
            fetch_file("mnist", "t10k-labels-idx1-ubyte.gz")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "t10k-labels-idx1-ubyte.gz" in one_line(err)
    assert list((empty_cache / "mnist").iterdir()) == []


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_mirror_raises_with_the_fix(empty_cache, monkeypatch):
    url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("DPSGD_DATA_MIRROR", url)
    with pytest.raises(DataError) as err:
        fetch("adult")
    message = one_line(err)
    assert f"{url}/adult/adult.data" in message and "connection failed" in message
    assert "set DPSGD_DATA_MIRROR" in message
    assert f"place the file manually at {empty_cache / 'adult' / 'adult.data'}" in message
    assert not (empty_cache / "adult").exists() or list((empty_cache / "adult").iterdir()) == []


def test_file_missing_on_mirror_reports_http_404(dataset_mirror, tmp_path, empty_cache, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_MIRROR", dataset_mirror.url + "/no-such-folder")
    with pytest.raises(DataError) as err:
        fetch_file("mnist", "t10k-labels-idx1-ubyte.gz")
    assert "HTTP 404" in one_line(err)


def test_stale_cached_file_is_replaced_by_a_verified_download(dataset_mirror, empty_cache, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_MIRROR", dataset_mirror.url)
    dest = empty_cache / "mnist" / "t10k-labels-idx1-ubyte.gz"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"stale")
    assert fetch_file("mnist", dest.name) == dest
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == REGISTRY["mnist"].file(dest.name).sha256


def test_stale_cached_file_is_reported_when_the_download_fails(empty_cache, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_MIRROR", f"http://127.0.0.1:{_closed_port()}")
    dest = empty_cache / "mnist" / "t10k-labels-idx1-ubyte.gz"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"stale")
    with pytest.raises(DataError) as err:
        fetch_file("mnist", dest.name)
    assert f"the existing {dest} has a wrong sha256" in one_line(err)


def test_local_folder_mirror_is_copied_and_verified(shared_datasets_dir, empty_cache, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_MIRROR", str(shared_datasets_dir))
    path = fetch_file("mnist", "t10k-labels-idx1-ubyte.gz")
    assert path.read_bytes() == (shared_datasets_dir / "mnist" / path.name).read_bytes()
    monkeypatch.setenv("DPSGD_DATA_MIRROR", (shared_datasets_dir / "nowhere").as_uri())
    with pytest.raises(DataError) as err:
        fetch_file("mnist", "t10k-images-idx3-ubyte.gz")
    assert "no such file" in one_line(err)


# ---------------------------------------------------------------- raw parsers (real files)


@pytest.fixture(scope="session")
def raw_files(data_env) -> dict[str, dict]:
    """Verified cached paths of every real file, fetched once per session."""
    return {name: {p.name: p for p in fetch(name)} for name in REGISTRY}


def test_read_adult_counts(raw_files):
    train, test = read_adult(raw_files["adult"]["adult.data"], raw_files["adult"]["adult.test"])
    assert (len(train), len(test)) == (30162, 15060)
    assert set(test["income"].unique()) == {"<=50K", ">50K"}
    assert ((train["income"] == ">50K").sum(), (test["income"] == ">50K").sum()) == (7508, 3700)


def test_read_bank_counts(raw_files):
    frame = read_bank(raw_files["bank"]["bank-additional.zip"])
    assert frame.shape == (41188, 21)
    assert (frame["y"] == "yes").sum() == 4640


def test_read_kddcup99_counts(raw_files):
    train = read_kddcup99(raw_files["kddcup99"]["kddcup.data_10_percent.gz"])
    test = read_kddcup99(raw_files["kddcup99"]["corrected.gz"])
    assert train.shape == (494021, 42) and len(test) == 311029
    assert (train["label"] == "normal.").sum() == 97278
    assert (test["label"] == "normal.").sum() == 60593


def test_read_mnist_counts(raw_files):
    files = raw_files["mnist"]
    images, labels = read_mnist(files["train-images-idx3-ubyte.gz"], files["train-labels-idx1-ubyte.gz"])
    assert images.shape == (60000, 784) and images.dtype == np.uint8
    assert (labels == 1).sum() == 6742
    images, labels = read_mnist(files["t10k-images-idx3-ubyte.gz"], files["t10k-labels-idx1-ubyte.gz"])
    assert images.shape == (10000, 784) and labels.shape == (10000,)


# ---------------------------------------------------------------- load_dataset (real files)


def test_adult_default(data_env):
    ds = load_dataset(DatasetSpec(name="adult"))
    assert (ds.X_train.shape, ds.X_test.shape) == ((30162, 104), (15060, 104))
    assert ((ds.y_train == 1).sum(), (ds.y_test == 1).sum()) == (7508, 3700)
    assert_well_formed(ds)
    assert_in_unit_ball(ds)
    assert ds.spec == DatasetSpec(name="adult")
    # one-hot block (after the 6 numeric columns): exactly one 1 per categorical attribute
    raw = load_dataset(DatasetSpec(name="adult", unit_ball="none", standardize=False), cache=False)
    assert np.array_equal(raw.X_train[:, 6:].sum(axis=1), np.full(30162, 8.0))
    assert np.array_equal(raw.X_test[:, 6:].sum(axis=1), np.full(15060, 8.0))


def test_adult_random_split_uses_both_files(data_env):
    ds = load_dataset(DatasetSpec(name="adult", split="random", test_fraction=0.25), cache=False)
    assert ds.n + len(ds.y_test) == 45222 and len(ds.y_test) == round(45222 * 0.25)


def test_bank_default(data_env):
    ds = load_dataset(DatasetSpec(name="bank"))
    assert ds.n + len(ds.y_test) == 41188 and len(ds.y_test) == round(41188 * 0.2)
    assert (ds.y_train == 1).sum() + (ds.y_test == 1).sum() == 4640
    assert_well_formed(ds)
    assert_in_unit_ball(ds)


def test_bank_has_no_official_split():
    with pytest.raises(DataError) as err:
        load_dataset(DatasetSpec(name="bank", split="official"))
    assert "no official" in one_line(err) and "split: random" in one_line(err)


def test_kddcup99_subsample_random_split(data_env):
    ds = load_dataset(DatasetSpec(name="kddcup99", subsample=70000))
    assert ds.n + len(ds.y_test) == 70000 and len(ds.y_test) == 14000
    assert_well_formed(ds)
    assert_in_unit_ball(ds)


def test_kddcup99_official_split_uses_corrected(data_env):
    ds = load_dataset(DatasetSpec(name="kddcup99", split="official", subsample=50000), cache=False)
    assert ds.n == 50000 and len(ds.y_test) == 311029
    assert (ds.y_test == -1).sum() == 60593
    assert_well_formed(ds)
    assert_in_unit_ball(ds)


def test_mnist_default(data_env):
    ds = load_dataset(DatasetSpec(name="mnist"), cache=False)  # 440 MB of float64: keep out of the cache
    assert (ds.X_train.shape, ds.X_test.shape) == ((60000, 784), (10000, 784))
    assert (ds.y_train == 1).sum() == 6742
    assert_well_formed(ds)
    assert_in_unit_ball(ds)


def test_mnist_pixels_without_standardisation(data_env):
    spec = DatasetSpec(name="mnist", positive_digit=0, standardize=False, unit_ball="none")
    ds = load_dataset(spec, cache=False)
    assert ds.X_train.min() == 0.0 and ds.X_train.max() == 1.0
    assert (ds.y_train == 1).sum() == 5923


def test_synthetic_default():
    ds = load_dataset(DatasetSpec(name="synthetic"), cache=False)
    assert (ds.n, len(ds.y_test), ds.d) == (8000, 2000, 5)
    assert_well_formed(ds)
    norms = np.concatenate([row_norms(ds.X_train), row_norms(ds.X_test)])
    assert np.abs(norms - 1).max() < TOL


def test_make_synthetic_margin_and_labels():
    X, y, w = make_synthetic(n=10000, dim=5, seed=3)
    assert X.shape == (10000, 5) and np.abs(row_norms(X) - 1).max() < TOL
    assert abs(np.linalg.norm(w) - 1) < TOL
    assert np.abs(X @ w).min() >= 1e-3
    assert np.array_equal(y, np.sign(X @ w)) and set(np.unique(y)) == {-1.0, 1.0}
    X2, _, _ = make_synthetic(n=10000, dim=5, seed=3)
    assert np.array_equal(X, X2)


def test_synthetic_options():
    ds = load_dataset(DatasetSpec(name="synthetic", n=300, dim=12, seed=1, test_fraction=0.5), cache=False)
    assert (ds.n, len(ds.y_test), ds.d) == (150, 150, 12)


# ---------------------------------------------------------------- preprocessing on real data


def test_projection_gives_k_columns(data_env):
    ds = load_dataset(DatasetSpec(name="adult", projection=20), cache=False)
    assert ds.X_train.shape == (30162, 20) and ds.X_test.shape == (15060, 20)
    assert_in_unit_ball(ds)


def test_unit_ball_max(data_env):
    ds = load_dataset(DatasetSpec(name="bank", unit_ball="max"), cache=False)
    assert abs(row_norms(ds.X_train).max() - 1) < TOL
    assert_in_unit_ball(ds)


def test_unit_ball_none_keeps_standardised_scale(data_env):
    ds = load_dataset(DatasetSpec(name="bank", unit_ball="none", one_hot=False), cache=False)
    assert ds.d == 20  # 10 numeric + 10 integer-coded categorical
    np.testing.assert_allclose(ds.X_train.mean(axis=0), 0, atol=1e-9)
    assert row_norms(ds.X_train).max() > 1


def test_same_spec_gives_identical_arrays_and_seed_matters(data_env):
    spec = DatasetSpec(name="bank", seed=7, projection=10)
    assert_same_arrays(load_dataset(spec, cache=False), load_dataset(spec, cache=False))
    other = load_dataset(spec.model_copy(update={"seed": 8}), cache=False)
    assert not np.array_equal(other.y_test, load_dataset(spec, cache=False).y_test)


def test_processed_cache_hit_returns_equal_arrays(data_env, monkeypatch):
    spec = DatasetSpec(name="adult", unit_ball="max")
    path = processed_path(spec)
    path.unlink(missing_ok=True)
    first = load_dataset(spec)
    assert path.is_file() and path.parent == data_env / "processed"
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"]

    def fail(_spec):
        raise AssertionError("cache miss")

    monkeypatch.setattr(load_module, "build_dataset", fail)
    assert_same_arrays(first, load_dataset(spec))
    # a split left at None and the explicit default share one cache file
    assert processed_path(DatasetSpec(name="adult", split="official", unit_ball="max")) == path


def test_corrupt_processed_cache_file_is_rebuilt(data_env):
    spec = DatasetSpec(name="synthetic", n=500, seed=5)
    good = load_dataset(spec)
    processed_path(spec).write_bytes(b"garbage")
    assert_same_arrays(good, load_dataset(spec))


def test_processed_file_is_rehashed_on_every_read(data_env, monkeypatch, capsys):
    """No trust by stat: every read recomputes the checksum, so a file tampered in place (same size) is caught."""
    spec = DatasetSpec(name="synthetic", n=300, seed=11)
    good = load_dataset(spec)
    path = processed_path(spec)
    hashed = []
    real = load_module.arrays_sha256
    monkeypatch.setattr(load_module, "arrays_sha256", lambda arrays: hashed.append(1) or real(arrays))
    assert_same_arrays(good, load_dataset(spec))
    assert_same_arrays(good, load_dataset(spec))
    assert len(hashed) == 2
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["X_train"] = arrays["X_train"] + 1e-3  # tampered: same key, same stored checksum, same size
    with open(path, "r+b") as fh:  # in place: same inode
        np.savez(fh, **arrays)
    capsys.readouterr()
    assert_same_arrays(good, load_dataset(spec))
    assert "does not match its checksum" in capsys.readouterr().err


def test_stored_arrays_are_read_as_numpy_reads_them(tmp_path):
    arrays = {"X_train": np.arange(12.0).reshape(4, 3), "y_train": np.array([1.0, -1.0, 1.0, 1.0]),
              "X_test": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "y_test": np.zeros(0)}

    def read(path):
        with open(path, "rb") as fh:
            return load_module._read_stored_arrays(fh)

    np.savez(tmp_path / "a.npz", key=np.array("k"), **arrays)
    got = read(tmp_path / "a.npz")
    with np.load(tmp_path / "a.npz") as npz:
        for name in arrays:
            assert got[name].dtype == npz[name].dtype and np.array_equal(got[name], npz[name])
    np.savez_compressed(tmp_path / "b.npz", **arrays)
    with pytest.raises(ValueError, match="compressed"):
        read(tmp_path / "b.npz")
    (tmp_path / "c.npz").write_bytes((tmp_path / "a.npz").read_bytes()[:-200])
    with pytest.raises((ValueError, OSError, zipfile.BadZipFile)):
        read(tmp_path / "c.npz")


def test_processed_cache_is_read_through_one_open(tmp_path, monkeypatch):
    """The key, checksum and arrays come from one open file: a file replaced between two opens (another process
    writing the same cache entry) could otherwise pair one file's checksum with another's arrays."""
    arrays = {"X_train": np.arange(12.0).reshape(4, 3), "y_train": np.array([1.0, -1.0, 1.0, 1.0]),
              "X_test": np.arange(6.0).reshape(2, 3), "y_test": np.ones(2)}
    np.savez(tmp_path / "a.npz", key=np.array("k"), sha256=np.array(load_module.arrays_sha256(arrays)), **arrays)
    opened = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    got, why = load_module._read_processed(tmp_path / "a.npz", "k", DatasetSpec(name="synthetic", unit_ball="none"))
    assert why == "" and all(np.array_equal(got[k], arrays[k]) for k in arrays)
    assert opened == [str(tmp_path / "a.npz")]


def test_cache_key_depends_on_version_and_spec(monkeypatch):
    spec = DatasetSpec(name="bank")
    path = processed_path(spec)
    assert path.name.startswith("bank-") and len(path.stem) == len("bank-") + 16
    assert processed_path(DatasetSpec(name="bank", seed=1)) != path
    monkeypatch.setattr(load_module, "PREPROCESSING_VERSION", "test-bump")
    assert processed_path(spec) != path


# ---------------------------------------------------------------- spec validation


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (DatasetSpec(name="synthetic", split="official"), "no official"),
        (DatasetSpec(name="adult", positive_digit=3), "only to mnist"),
        (DatasetSpec(name="bank", n=100), "only to synthetic"),
        (DatasetSpec(name="synthetic", n=100, subsample=200), "subsample=200 exceeds"),
    ],
)
def test_invalid_specs_raise_one_line_data_errors(spec, fragment):
    with pytest.raises(DataError) as err:
        load_dataset(spec, cache=False)
    assert fragment in one_line(err)


def test_resolve_spec_fills_defaults():
    assert resolve_spec(DatasetSpec(name="mnist")).positive_digit == 1
    assert resolve_spec(DatasetSpec(name="adult")).split == "official"
    assert resolve_spec(DatasetSpec(name="kddcup99")).split == "random"
    resolved = resolve_spec(DatasetSpec(name="synthetic"))
    assert (resolved.n, resolved.dim, resolved.split) == (10000, 5, "random")


# ---------------------------------------------------------------- preprocessing properties


finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
matrices = st.integers(1, 6).flatmap(
    lambda d: st.tuples(
        hnp.arrays(np.float64, st.tuples(st.integers(1, 25), st.just(d)), elements=finite),
        hnp.arrays(np.float64, st.tuples(st.integers(1, 25), st.just(d)), elements=finite),
    )
)


@settings(max_examples=150, deadline=None)
@given(matrices, st.sampled_from(["row", "max"]))
def test_unit_ball_bounds_every_row(pair, mode):
    train, test = (a.copy() for a in pair)
    train, test = pp.to_unit_ball(train, test, mode)
    assert row_norms(train).max() <= 1 + TOL
    assert row_norms(test).max() <= 1 + TOL


@settings(max_examples=50, deadline=None)
@given(matrices)
def test_unit_ball_row_leaves_short_rows_alone(pair):
    train = pair[0]
    out, _ = pp.to_unit_ball(train.copy(), pair[1].copy(), "row")
    short = row_norms(train) <= 1
    np.testing.assert_array_equal(out[short], train[short])


@settings(max_examples=50, deadline=None)
@given(matrices, st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_projection_shape_and_determinism(pair, k, seed):
    train, test = pair
    k = min(k, train.shape[1])  # k > d is refused (tests/test_validation.py)
    a = pp.project(train, test, k, seed)
    b = pp.project(train, test, k, seed)
    assert a[0].shape == (train.shape[0], k) and a[1].shape == (test.shape[0], k)
    np.testing.assert_array_equal(a[0], b[0])


@settings(max_examples=50, deadline=None)
@given(matrices)
def test_standardize_uses_train_statistics(pair):
    train, test = (a.copy() for a in pair)
    mean, std = train.mean(axis=0), train.std(axis=0)
    out_train, out_test = pp.standardize(train, test)
    varying = std > 1e-6 * (np.abs(mean) + 1)
    np.testing.assert_allclose(out_train[:, varying].mean(axis=0), 0, atol=1e-6)
    constant = pair[0].max(axis=0) == pair[0].min(axis=0)
    np.testing.assert_array_equal(out_test[:, constant], pair[1][:, constant])


def test_projection_matrix_variance():
    matrix = pp.projection_matrix(400, 50, seed=0)
    assert matrix.shape == (400, 50)
    assert abs(matrix.var() * 50 - 1) < 0.05


def test_one_hot_and_random_split():
    codes = np.array([[0, 2], [1, 0], [0, 1], [-1, 1]], dtype=np.int32)
    vocab = (("a", "b"), ("x", "y", "z"))
    onehot = pp.one_hot(codes, vocab)
    assert onehot.tolist()[0] == [1, 0, 0, 0, 1] and onehot.sum(axis=1).tolist() == [2, 2, 2, 1]
    table = pp.array_table(np.arange(20.0).reshape(10, 2), np.ones(10))
    train, test = pp.random_split(table, 0.3, seed=0, where="test")
    assert (len(train), len(test)) == (7, 3)
    assert sorted(np.concatenate([train.numeric[:, 0], test.numeric[:, 0]]).tolist()) == list(range(0, 20, 2))


# ---------------------------------------------------------------- Song et al. 2013's setup


def test_split_none_trains_on_every_record():
    ds = load_dataset(DatasetSpec(name="synthetic", split="none"), cache=False)
    assert (ds.n, len(ds.y_test), ds.X_test.shape) == (10000, 0, (0, 5))  # "n = 10,000 samples"
    all_points, _, _ = make_synthetic(n=10000, dim=5, seed=0)
    np.testing.assert_allclose(ds.X_train, all_points, rtol=1e-12)  # all of them, in order (x/max(1, ‖x‖) rounds)


def test_split_none_goes_through_the_processed_cache(tmp_path, monkeypatch):
    """An empty test set is written to and read back from the checksummed cache (it once crashed the digest)."""
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path))
    spec = DatasetSpec(name="synthetic", split="none", n=500)
    written, read = load_dataset(spec), load_dataset(spec)
    assert read.X_test.shape == (0, 5) and list((tmp_path / "processed").glob("*.npz"))
    np.testing.assert_array_equal(written.X_train, read.X_train)


def test_order_ball_then_project_lets_rows_leave_the_ball():
    """Song et al. §IV-A: unit ball first, then the random projection; rows may leave the ball (and the
    default order keeps them inside). The projection is the same seeded N(0, 1/k) matrix either way."""
    from dpsgd_cli.data.preprocess import projection_matrix

    base = dict(name="synthetic", dim=40, n=2000, projection=5, split="none")
    paper = load_dataset(DatasetSpec(**base, order="ball_then_project"), cache=False)
    default = load_dataset(DatasetSpec(**base), cache=False)
    points, _, _ = make_synthetic(n=2000, dim=40, seed=0)
    np.testing.assert_allclose(paper.X_train, points @ projection_matrix(40, 5, 0), rtol=1e-12)
    assert row_norms(paper.X_train).max() > 1.2 and row_norms(default.X_train).max() <= 1 + TOL


def test_default_order_is_left_out_of_dumps_so_run_ids_stay():
    spec = DatasetSpec(name="kddcup99", subsample=50000, projection=9)
    assert "order" not in spec.model_dump() and "order" not in spec.model_dump_json()
    assert DatasetSpec(name="kddcup99", order="ball_then_project").model_dump()["order"] == "ball_then_project"
