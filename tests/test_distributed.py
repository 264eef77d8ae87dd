"""`dpsgd run --scheduler`: the grid on a Dask cluster (loopback only) gives the runs of one process, each once,
whether a worker dies mid-task or the driver is interrupted and resumed; a bad scheduler is a one-line error."""

import os
import signal
import socket
import sys
import textwrap
import threading
import time

import pandas as pd
import pytest
from typer.testing import CliRunner

distributed = pytest.importorskip("distributed")

from dpsgd_cli.cli import app, main  # noqa: E402
from dpsgd_cli.config import load_grid_file  # noqa: E402
from dpsgd_cli.engine import execute, plan_grid  # noqa: E402
from dpsgd_cli.engine.distributed import SchedulerLost, dask_backend, local_cluster, parse_scheduler  # noqa: E402
from dpsgd_cli.errors import UserError  # noqa: E402
from tests import test_cli  # noqa: E402
from tests.test_cli import GRID  # noqa: E402

grid_file = test_cli.grid_file  # the CLI tests' grid (4 cells × 2 seeds), a fixture

# tasks of ~0.3 s (n = 2000, 20 epochs): a worker killed as soon as it holds one is mid-task; with traces
SLOW = GRID.replace("n: 600", "n: 2000").replace("epochs: 2", "epochs: 20") + "    trace_every: 4000\n"


def _frame(path):
    frame = pd.read_csv(path).drop(columns="wall_time", errors="ignore")
    return frame.sort_values([c for c in ("run_id", "examples") if c in frame]).reset_index(drop=True)


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes on 127.0.0.1 (each restarted by its nanny if killed), shared by the tests."""
    with local_cluster(2) as local:  # what `--scheduler local:2` starts
        yield local


def test_cluster_gives_the_runs_of_one_process(cluster, grid_file, tmp_path):
    one = CliRunner().invoke(app, ["run", str(grid_file), "--out", str(tmp_path / "one"), "--jobs", "1"])
    dask = CliRunner().invoke(app, ["run", str(grid_file), "--out", str(tmp_path / "dask"),
                                    "--scheduler", cluster.scheduler_address])
    assert one.exit_code == 0 and dask.exit_code == 0, dask.output
    assert "2 workers" in dask.output and "mean ± std" in dask.output
    # same run ids, identical numbers (wall time aside)
    pd.testing.assert_frame_equal(_frame(tmp_path / "one" / "tiny" / "runs.csv"),
                                  _frame(tmp_path / "dask" / "tiny" / "runs.csv"))


def test_a_worker_killed_mid_task_loses_nothing_and_duplicates_nothing(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    path = tmp_path / "grid.yaml"
    path.write_text(textwrap.dedent(SLOW))
    grid = load_grid_file(path).grids[0]
    execute(plan_grid(grid, tmp_path / "one"))
    killed = []
    with distributed.Client(cluster.scheduler_address, set_as_default=False) as spy:
        pids = spy.run(os.getpid)

        def kill_the_first_busy_worker():
            while not killed:
                busy = [(w, keys[0]) for w, keys in spy.processing().items() if keys]
                if busy:
                    os.kill(pids[busy[0][0]], signal.SIGKILL)
                    killed.append(busy[0][1])
                time.sleep(0.01)

        killer = threading.Thread(target=kill_the_first_busy_worker, daemon=True)
        killer.start()
        with dask_backend(cluster.scheduler_address) as backend:
            execute(plan_grid(grid, tmp_path / "dask"), backend=backend)
        killer.join(timeout=10)
    # the task in flight on the killed worker was run again (the scheduler's log of that key)
    assert killed and [t[2] for t in cluster.scheduler.story(killed[0])].count("processing") >= 2
    runs = _frame(tmp_path / "dask" / "tiny" / "runs.csv")
    assert len(runs) == 8 and runs["run_id"].is_unique and set(runs["status"]) == {"ok"}
    pd.testing.assert_frame_equal(_frame(tmp_path / "one" / "tiny" / "runs.csv"), runs)
    traces = _frame(tmp_path / "dask" / "tiny" / "traces.csv")  # checkpoints of the killed attempt: none
    assert len(traces) and not traces.duplicated(["run_id", "examples"]).any()
    pd.testing.assert_frame_equal(_frame(tmp_path / "one" / "tiny" / "traces.csv"), traces)


def test_resume_after_an_interrupted_distributed_run_runs_only_what_is_missing(cluster, grid_file, tmp_path):
    grid = load_grid_file(grid_file).grids[0]
    out = tmp_path / "results"

    def interrupt(rows):
        raise KeyboardInterrupt  # Ctrl-C right after the first task's rows were written

    with dask_backend(cluster.scheduler_address) as backend:
        with pytest.raises(KeyboardInterrupt):
            execute(plan_grid(grid, out), backend=backend, on_rows=interrupt)
        saved = pd.read_csv(out / "tiny" / "runs.csv")
        resumed = plan_grid(grid, out)
        assert 0 < len(saved) < 8 and resumed.done_before == len(saved) and resumed.pending_runs == 8 - len(saved)
        ran = []
        execute(resumed, backend=backend, on_rows=lambda rows: ran.extend(r["run_id"] for r in rows))
    final = pd.read_csv(out / "tiny" / "runs.csv", dtype={"run_id": str})
    assert len(final) == 8 and final["run_id"].is_unique
    assert sorted(ran) == sorted(set(final["run_id"]) - set(saved["run_id"].astype(str)))


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


def test_unreachable_scheduler_is_one_line_and_exit_code_2(grid_file, tmp_path, monkeypatch, capfd):
    address = f"tcp://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("DPSGD_SCHEDULER", address)  # the variable does what the flag does
    monkeypatch.setenv("DPSGD_SCHEDULER_TIMEOUT", "1")
    monkeypatch.setattr(sys, "argv", ["dpsgd", "run", str(grid_file), "--out", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as exit_:
        main()
    stderr = capfd.readouterr().err  # file-descriptor level: Dask's own log handlers included
    lines = stderr.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and address in lines[0] and "cannot reach" in lines[0]
    assert not (tmp_path / "r").exists()  # nothing touched


@pytest.mark.parametrize("value", ["local:0", "local:two", "local", " "])
def test_malformed_scheduler_is_a_user_error(value):
    with pytest.raises(UserError, match="local:N"):
        parse_scheduler(value)


def test_scheduler_values():
    assert parse_scheduler("local:3") == ("local", 3)
    assert parse_scheduler("localhost:8786") == ("localhost:8786", None)  # an address, not local:N
    assert parse_scheduler(" tcp://10.0.0.5:8786 ") == ("tcp://10.0.0.5:8786", None)


def test_without_distributed_the_flag_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` raises ImportError
    with pytest.raises(UserError, match=r"pip install .*\[dask\]"), dask_backend("local:1"):
        pass


def test_a_lost_scheduler_stops_the_driver_and_keeps_what_was_received(grid_file, tmp_path):
    grid = load_grid_file(grid_file).grids[0]
    out = tmp_path / "results"
    local = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp",
                                     host="127.0.0.1", dashboard_address="127.0.0.1:0", silence_logs=40)
    received = []

    def stop_scheduler(rows):
        received.extend(rows)
        if len(received) == len(rows):
            local.close()

    try:
        with dask_backend(local.scheduler_address) as backend, \
                pytest.raises(SchedulerLost, match="run the same command again"):
            execute(plan_grid(grid, out), backend=backend, on_rows=stop_scheduler)
    finally:
        local.close()
    saved = pd.read_csv(out / "tiny" / "runs.csv", dtype={"run_id": str})
    assert set(saved["run_id"]) == {r["run_id"] for r in received} and len(saved) < 8


def test_jobs_and_scheduler_exclude_each_other(grid_file, tmp_path):
    result = CliRunner().invoke(app, ["run", str(grid_file), "--out", str(tmp_path / "r"), "--jobs", "2",
                                      "--scheduler", "local:2"])
    assert isinstance(result.exception, UserError) and "choose one" in str(result.exception)
    assert not (tmp_path / "r").exists()
