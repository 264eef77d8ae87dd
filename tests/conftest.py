"""Shared pytest fixtures.

Data fixtures: the local dataset mirror (`../shared/datasets`, or $DPSGD_SHARED_DATASETS) is
served over HTTP on 127.0.0.1, and a session-wide download cache points at it, so each real
file is downloaded once per test session and no test touches the internet.

`run_grid`: run a one-grid YAML text through the engine and get its runs.csv.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil

# Hermetic on-disk caches (calibrated sigmas): never a developer's cache, a fresh folder per session.
import tempfile as _tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpsgd_cli import plugins
from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.config import load_grid_file

os.environ["DPSGD_CACHE_DIR"] = _tempfile.mkdtemp(prefix="dpsgd-test-cache-")
from dpsgd_cli.engine import execute, plan_grid

# Tests that took more than 10 s in `python -m pytest --durations=30` on 2 cores (per test function, any
# parameters): marked `slow`, so `python -m pytest -m "not slow"` is the quick subset.
SLOW_TESTS = frozenset({
    "test_api.py::test_example_script_runs",
    "test_audit_power.py::test_false_refutations_of_exactly_tight_mechanisms_stay_below_alpha",
    "test_bassily.py::test_end_to_end_through_the_engine",
    "test_bassily.py::test_replicas_are_independent",
    "test_benchmarks.py::test_case10_worker_times_the_calibration_a_run_does",
    "test_figures.py::test_each_figure_of_experiments_yaml_is_fit_to_print",
    "test_mlp_rows.py::test_float32_row_sparse_gradient_is_close_to_float64",
    "test_pidp_sgd.py::test_noisy_step_noise_has_the_calibrated_std",
    "test_preflight.py::test_every_shipped_grid_passes_the_checks_before_work",
    "test_privacy.py::test_calibrate_sigma_hits_the_window_checked_by_fresh_accountant",
    "test_privacy.py::test_pld_calibration_needs_less_noise_than_rdp",
    "test_privacy.py::test_sigma_of_a_target_does_not_depend_on_the_other_targets",
    "test_rdp.py::test_calibrated_sigma_is_the_reference_lattice_point_bit_for_bit",
    "test_rdp.py::test_dpsgd_epsilon_and_order_equals_library_walk_bit_for_bit",
    "test_replica_independence.py::test_numpy_path_seed_alone_equals_seed_among_others_bit_for_bit",
    "test_report.py::test_figures_and_report_end_to_end",
    "test_robustness.py::test_a_row_cut_at_every_byte_offset_resumes_to_the_identical_result",
    "test_robustness.py::test_a_second_writer_exits_2_naming_the_holder_and_the_lock_dies_with_it",
    "test_robustness.py::test_two_concurrent_runs_never_duplicate",
    "test_row_integrity.py::test_no_key_of_a_cache_entry_reaches_a_row",
    "test_robustness.py::test_a_real_read_only_and_a_real_full_filesystem",
    "test_robustness.py::test_a_second_audit_of_a_folder_is_refused_and_readers_never_see_half_a_file",
})
# The fixtures that serve the real datasets: a test using one (directly or through another fixture) is `data`.
DATA_FIXTURES = frozenset({"data_env", "dataset_mirror", "shared_datasets_dir"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the data tests (by the fixtures they use) and the slow ones (SLOW_TESTS)."""
    for item in items:
        if DATA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.data)
        if f"{item.path.name}::{item.originalname if isinstance(item, pytest.Function) else item.name}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _builtin_algorithms_only() -> Iterator[None]:
    """Every test leaves the algorithm registry as it found it: a plugin one loads is gone for the next."""
    algorithms, loaded = dict(ALGORITHMS), dict(plugins.LOADED)
    yield
    ALGORITHMS.clear(), plugins.LOADED.clear()
    ALGORITHMS.update(algorithms), plugins.LOADED.update(loaded)


def shared_datasets_path() -> Path:
    """The read-only mirror of the raw dataset files used by the data tests."""
    env = os.environ.get("DPSGD_SHARED_DATASETS")
    return Path(env) if env else Path(__file__).parents[1].parent / "shared" / "datasets"


@dataclass
class DataServer:
    """A quiet HTTP server for a folder; `requests` lists the paths requested so far."""

    url: str
    requests: list[str] = field(default_factory=list)
    _server: http.server.ThreadingHTTPServer | None = None

    def close(self) -> None:
        """Stop serving and free the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def serve_folder(directory: Path) -> DataServer:
    """Serve `directory` on 127.0.0.1 (free port) from a daemon thread, counting requests."""
    server_info = DataServer(url="")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def send_head(self):  # called by GET and HEAD
            server_info.requests.append(self.path)
            return super().send_head()

        def log_message(self, format, *args):  # noqa: A002 - silence the access log
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(directory))
    )
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    server_info.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    server_info._server = httpd
    return server_info


@pytest.fixture(scope="session")
def shared_datasets_dir() -> Path:
    """The shared mirror folder; skips the data tests when it is absent."""
    path = shared_datasets_path()
    if not (path / "SHA256SUMS").is_file():
        pytest.skip(f"dataset mirror not found at {path} (set DPSGD_SHARED_DATASETS to its location)")
    return path


@pytest.fixture(scope="session")
def dataset_mirror(shared_datasets_dir: Path) -> Iterator[DataServer]:
    """The shared mirror folder served over HTTP on loopback for the whole session."""
    server = serve_folder(shared_datasets_dir)
    yield server
    server.close()


@pytest.fixture(scope="session")
def data_env(tmp_path_factory: pytest.TempPathFactory, dataset_mirror: DataServer) -> Iterator[Path]:
    """DPSGD_DATA_DIR = a session temp cache, DPSGD_DATA_MIRROR = the loopback mirror; yields the cache."""
    cache = tmp_path_factory.mktemp("dpsgd-data-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("DPSGD_DATA_DIR", str(cache))
    patch.setenv("DPSGD_DATA_MIRROR", dataset_mirror.url)
    yield cache
    patch.undo()
    shutil.rmtree(cache, ignore_errors=True)  # processed arrays take hundreds of MB


@pytest.fixture
def serve_data_folder() -> Iterator[Callable[[Path], DataServer]]:
    """Factory: serve any folder (e.g. a fake mirror) over loopback; servers close after the test."""
    servers: list[DataServer] = []

    def start(directory: Path) -> DataServer:
        servers.append(serve_folder(directory))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def run_grid(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Factory `run(yaml_text, out=None) -> runs.csv as a DataFrame`.

    Dedents `yaml_text` into tmp_path/grid.yaml, executes its single grid into `out` (default
    tmp_path/"out") and reads runs.csv; afterwards `run.folder` is that grid's results folder
    (traces.csv, ...). DPSGD_DATA_DIR is tmp_path/"cache", unless the test uses `data_env`.
    """
    if "data_env" not in request.fixturenames:
        monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))

    def run(yaml_text: str, out: Path | None = None) -> pd.DataFrame:
        path = tmp_path / "grid.yaml"
        path.write_text(textwrap.dedent(yaml_text))
        grid = load_grid_file(path).grids[0]
        out = tmp_path / "out" if out is None else out
        execute(plan_grid(grid, out))
        run.folder = out / grid.name
        return pd.read_csv(run.folder / "runs.csv")

    return run


@pytest.fixture(scope="session")
def make_logistic_data():
    """make(seed, n, weights, noise) → (X, y): Gaussian rows scaled into the unit ball, labels
    sign(X·w + noise·N(0, 1)) in {−1, +1} — the small separable-ish problem the algorithm tests train on."""

    def make(seed: int, n: int, weights: list, noise: float):
        rng = np.random.default_rng(seed)
        X = rng.normal(size=(n, len(weights)))
        X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
        y = np.where(X @ np.asarray(weights) + noise * rng.normal(size=n) > 0, 1.0, -1.0)
        return X, y

    return make


@pytest.fixture
def write_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """Factory `write_grid(yaml_text) -> path`: dedents the text into tmp_path/grid.yaml, with DPSGD_DATA_DIR
    set to tmp_path/"cache" (CLI tests that run a grid file)."""
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))

    def write(yaml_text: str) -> Path:
        path = tmp_path / "grid.yaml"
        path.write_text(textwrap.dedent(yaml_text))
        return path

    return write
