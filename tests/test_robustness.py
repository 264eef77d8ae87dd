"""Results a researcher can trust after anything: crash-cut rows, concurrent writers, failed runs, killed
parents."""

import csv
import errno
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from dpsgd_cli.cli import app
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import execute, plan_grid, runner
from dpsgd_cli.engine.results import COLUMNS, ResultStore, ResultsWriteError, acquire_lock, release_lock
from dpsgd_cli.engine.results import read_results
from dpsgd_cli.engine.selection import results_frame
from dpsgd_cli.engine.summary import summary_frame
from dpsgd_cli.errors import UserError

GRID = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 300}]
    algorithms: [erm, dp_sgd]
    epsilon: [0.5, 2]
    batch_size: [32]
    lr: [0.5]
    seeds: 2
    epochs: 1
    trace_every: 120
"""


@pytest.fixture
def grid_file(write_grid):
    return write_grid(GRID)


def cli(*args, cwd=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "dpsgd_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, **kwargs)


def lines(path):
    return path.read_bytes().splitlines(keepends=True)


# --- 1. a cut last row -------------------------------------------------------------------------------------
def test_a_row_cut_at_every_byte_offset_resumes_to_the_identical_result(grid_file, tmp_path, monkeypatch, request):
    grid = load_grid_file(grid_file).grids[0]
    computed = {}  # run id → (row, its checkpoints): each run trained once, replayed at every offset
    real_run_task = runner.run_task

    def remember(task, single_thread=False):
        result = real_run_task(task, single_thread)
        for row in result.rows:
            computed[row["run_id"]] = (row, [t for t in result.traces if t["run_id"] == row["run_id"]])
        return result

    monkeypatch.setattr(runner, "run_task", remember)
    reference = tmp_path / "reference"
    planned = plan_grid(grid, reference)
    last_runs = planned.tasks[-1].runs  # the two dp_sgd cells (ε axis) fused: one task, one write of 4 rows
    execute(planned)
    runs, traces = (reference / "tiny" / name for name in ("runs.csv", "traces.csv"))
    runs_ref, traces_ref = runs.read_bytes(), traces.read_bytes()

    def replay(task, single_thread=False):
        picked = [computed[cell.run_id(s)] for cell in task.cells for s in task.seeds]
        return runner.TaskResult([row for row, _ in picked], [t for _, ts in picked for t in ts])

    monkeypatch.setattr(runner, "run_task", replay)
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what this loop tests: keep it fast
    last_write = b"".join(lines(runs)[-last_runs:])  # the last task: one write of its rows
    assert last_write.count(b"\n") == last_runs and len(last_write) > 500
    memory = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else str(tmp_path)  # fast renames
    request.addfinalizer(lambda: shutil.rmtree(memory, ignore_errors=True))
    folder = Path(memory) / "cut" / "tiny"
    for offset in range(len(last_write)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "runs.csv.rejected").unlink(missing_ok=True)
        (folder / "runs.csv").write_bytes(runs_ref[: len(runs_ref) - len(last_write) + offset])
        (folder / "traces.csv").write_bytes(traces_ref)
        plan = plan_grid(grid, folder.parent)  # recovery: the cut row is set aside, its run is redone
        whole = last_write[:offset].count(b"\n")
        assert plan.pending_runs == last_runs - whole, offset
        if offset % 64 == 0 or last_write[offset - 1: offset] == b"\n":
            assert (folder / "runs.csv").read_bytes() == runs_ref[: len(runs_ref) - len(last_write)] + \
                b"".join(last_write.splitlines(keepends=True)[:whole])
            at_row_end = offset == 0 or last_write[offset - 1: offset] == b"\n"
            assert at_row_end or (folder / "runs.csv.rejected").exists()
        execute(plan)
        assert sorted(lines(folder / "runs.csv")) == sorted(lines(runs)), offset  # the same rows, byte for byte
        assert sorted(lines(folder / "traces.csv")) == sorted(lines(traces)), offset


def test_a_cut_traces_row_and_a_real_retrain_give_the_same_numbers(grid_file, tmp_path):
    grid = load_grid_file(grid_file).grids[0]
    execute(plan_grid(grid, tmp_path / "a"))
    folder = tmp_path / "a" / "tiny"
    reference = pd.read_csv(folder / "runs.csv").drop(columns="wall_time").sort_values("run_id", ignore_index=True)
    runs, traces = folder / "runs.csv", folder / "traces.csv"
    runs.write_bytes(runs.read_bytes()[:-300])  # inside the last seed's row
    traces.write_bytes(traces.read_bytes()[:-17])  # inside a checkpoint row
    execute(plan_grid(grid, tmp_path / "a"))  # retrains for real what was cut
    resumed = pd.read_csv(runs).drop(columns="wall_time").sort_values("run_id", ignore_index=True)
    pd.testing.assert_frame_equal(resumed, reference)
    assert traces.read_bytes().endswith(b"\n") and pd.read_csv(traces)[["run_id", "examples"]].duplicated().sum() == 0
    assert (folder / "runs.csv.rejected").exists() and (folder / "traces.csv.rejected").exists()


def test_rewrites_keep_every_value_dtype_and_user_column_exactly(tmp_path):
    store = ResultStore(tmp_path)
    old = [c for c in COLUMNS if c != "dtype"] + ["note"]  # an older version's file, plus a user's column
    row = {c: "" for c in old}
    rows = [
        {**row, "run_id": "a", "status": "ok", "seed": "0", "batch_size": "64", "test_accuracy": "0.8123456789012345",
         "sigma": "1.2345678901234567e-05", "note": 'kept, "quoted"'},
        {**row, "run_id": "b", "status": "failed", "seed": "1", "message": "ValueError: x"},
        {**row, "run_id": "c", "status": "ok", "seed": "2", "test_accuracy": "0.1", "note": "second"},
    ]
    with open(store.csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, old, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    assert store.start(resume=True) == {"a", "c"}  # the failed run is dropped (tried again)
    after = pd.read_csv(store.csv, dtype=str, keep_default_na=False)
    assert list(after.columns) == COLUMNS + ["note"]
    assert after["run_id"].tolist() == ["a", "c"] and after["note"].tolist() == ['kept, "quoted"', "second"]
    assert after.loc[0, "test_accuracy"] == "0.8123456789012345" and after.loc[0, "sigma"] == "1.2345678901234567e-05"
    assert after.loc[0, "batch_size"] == "64" and after.loc[1, "batch_size"] == ""  # ints stay ints
    before = store.csv.read_bytes()
    store.append([{"run_id": "d", "status": "ok", "seed": 3, "test_accuracy": 0.1 + 0.2, "batch_size": 64}])
    assert store.csv.read_bytes().startswith(before)  # appending never rewrites
    frame = store.read()
    assert frame["test_accuracy"].tolist()[-1] == 0.1 + 0.2 and frame["note"].isna().tolist()[-1]
    assert frame.loc[0, "test_accuracy"] == 0.8123456789012345 and frame["seed"].dtype.kind == "i"
    store.start(resume=True)  # nothing to recover: the file is left as it is
    assert store.csv.read_bytes().startswith(before)


def test_a_write_failure_says_what_was_saved_and_loses_no_row(grid_file, tmp_path, monkeypatch):
    from dpsgd_cli.engine import results

    grid = load_grid_file(grid_file).grids[0]
    plan = plan_grid(grid, tmp_path)
    real_write, calls = os.write, []

    def disk_full_at_the_second_runs_write(fd, data):  # erm's task, then the two dp_sgd cells' (fused) task
        if b"dp_sgd" in bytes(data[:2000]) or b"erm" in bytes(data[:2000]):
            calls.append(len(data))
            if len(calls) == 2:
                real_write(fd, bytes(data[:100]))  # half a row reached the disk before the error
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(results.os, "write", disk_full_at_the_second_runs_write)
    with pytest.raises(ResultsWriteError) as error:
        execute(plan)
    message = str(error.value)
    assert "No space left on device" in message and "2 of the grid's 6 runs are saved" in message
    assert "the 4 run(s) being written were not saved" in message and "\n" not in message
    saved = ResultStore(tmp_path / "tiny").csv.read_bytes()
    assert saved.endswith(b"\n") and len(pd.read_csv(tmp_path / "tiny" / "runs.csv")) == 2  # no half row
    monkeypatch.setattr(results.os, "write", real_write)
    execute(plan_grid(grid, tmp_path))
    assert len(pd.read_csv(tmp_path / "tiny" / "runs.csv")) == 6


def test_a_write_failure_is_one_line_with_exit_code_2(grid_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tiny").write_text("")  # the grid's results folder cannot be created
    proc = cli("run", grid_file, "--out", out, env={**os.environ, "DPSGD_DATA_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "nothing was run" in proc.stderr


# --- 2. one writer per folder -------------------------------------------------------------------------------
HOLD = """
import sys, time
from dpsgd_cli.engine.results import acquire_lock
acquire_lock(sys.argv[1]); print("locked", flush=True); time.sleep(600)
"""


def test_a_second_writer_exits_2_naming_the_holder_and_the_lock_dies_with_it(grid_file, tmp_path):
    folder = tmp_path / "out" / "tiny"
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        env = {**os.environ, "DPSGD_DATA_DIR": str(tmp_path / "cache")}
        proc = cli("run", grid_file, "--out", tmp_path / "out", env=env)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert f"pid {holder.pid} on host" in proc.stderr and "since" in proc.stderr
        assert not (folder / "runs.csv").exists()
    finally:
        holder.kill()  # kill -9: the OS releases the lock, no stale marker
        holder.wait()
    acquire_lock(folder)  # free again
    release_lock(folder)


def test_two_concurrent_runs_never_duplicate(grid_file, tmp_path):
    grid_file.write_text(grid_file.read_text().replace("epsilon: [0.5, 2]", "epsilon: [0.5, 1, 2, 3, 4]")
                         .replace("epochs: 1", "epochs: 20"))
    env = {**os.environ, "DPSGD_DATA_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "dpsgd_cli", "run", str(grid_file), "--out", str(tmp_path / "out")]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in outcomes)[0] == 0, outcomes
    for code, stderr in outcomes:
        assert code == 0 or (code == 2 and "another dpsgd process is writing" in stderr), stderr
    execute(plan_grid(load_grid_file(grid_file).grids[0], tmp_path / "out"))  # what a refused one would have run
    runs = pd.read_csv(tmp_path / "out" / "tiny" / "runs.csv")
    assert len(runs) == (1 + 5) * 2 and runs["run_id"].is_unique


def test_readers_count_a_run_once_and_ignore_rows_of_another_grid(run_grid, tmp_path):
    runs = run_grid(GRID)
    folder = run_grid.folder
    csv = folder / "runs.csv"
    body = lines(csv)
    other = runs.iloc[:2].assign(run_id=["x1", "x2"], grid="other")  # rows that belong to another grid
    csv.write_bytes(b"".join(body + body[1:3]) + other.to_csv(header=False, index=False).encode())
    reading = read_results(folder)
    assert (reading.duplicates, reading.foreign) == (2, 2)
    assert len(reading.runs) == len(runs) and reading.runs["run_id"].is_unique
    assert results_frame(folder)["run_id"].is_unique
    assert summary_frame(folder)["runs"].max() == 2  # 2 seeds, not 4
    notes = " ".join(reading.notes())
    assert "2 duplicate row(s)" in notes and "ignored 2 row(s) not in the grid as last run" in notes


# --- 6. failures are visible --------------------------------------------------------------------------------
def test_failed_runs_exit_1_with_their_messages_grouped(grid_file, tmp_path, monkeypatch):
    from dpsgd_cli.algorithms import ALGORITHMS

    real_prepare = ALGORITHMS["dp_sgd"].prepare  # what `fit` and a fused task both call

    def prepare(self, setting, *args):
        if setting.epsilon == 2:
            raise FloatingPointError("the noise overflowed")
        return real_prepare(self, setting, *args)

    monkeypatch.setattr(ALGORITHMS["dp_sgd"], "prepare", prepare)
    result = CliRunner().invoke(app, ["run", str(grid_file), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert "2 run(s) failed" in result.output and "2× FloatingPointError: the noise overflowed" in result.output
    assert "tiny: dp_sgd on synthetic ε=2" in result.output
    monkeypatch.setattr(ALGORITHMS["dp_sgd"], "prepare", real_prepare)
    result = CliRunner().invoke(app, ["run", str(grid_file), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0 and "run(s) failed" not in result.output  # rerun: the failed runs are redone


def test_plot_and_report_say_why_they_drew_or_checked_nothing(grid_file, tmp_path, monkeypatch):
    from dpsgd_cli.algorithms import ALGORITHMS

    monkeypatch.setenv("COLUMNS", "400")  # rich wraps table cells to the terminal width

    grid_file.write_text(grid_file.read_text().replace("algorithms: [erm, dp_sgd]", "algorithms: [dp_sgd]")
                         + "    claims:\n"
                         "      - {id: c, text: t, own: true, check: monotone, a: {algorithm: dp_sgd}}\n")
    monkeypatch.setattr(ALGORITHMS["dp_sgd"], "prepare", lambda *a: 1 / 0)
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["run", str(grid_file), "--out", str(out)]).exit_code == 1
    folder = out / "tiny"
    for command in ("plot", "report"):
        result = CliRunner().invoke(app, [command, str(folder)])
        assert result.exit_code == 1 and "every run failed or diverged (4 failed)" in result.output, result.output
        assert "ZeroDivisionError" in result.output
    (folder / "runs.csv").write_text(",".join(COLUMNS) + "\n")  # header only
    result = CliRunner().invoke(app, ["plot", str(folder)])
    assert result.exit_code == 1 and "header only" in result.output


def test_report_skips_malformed_rows_and_a_corrupt_manifest_is_one_line(run_grid, tmp_path):
    grid = GRID + "    claims:\n      - {id: c, text: t, own: true, check: monotone, a: {algorithm: dp_sgd}}\n"
    run_grid(grid)
    folder = run_grid.folder
    body = lines(folder / "runs.csv")
    body[1] = body[1].replace(b",ok,", b",ok,extra,")  # a field too many
    fields = next(csv.reader([body[2].decode()]))
    fields[COLUMNS.index("test_accuracy")] = "0.8x"  # not a number
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(fields)
    body[2] = buffer.getvalue().encode()
    (folder / "runs.csv").write_bytes(b"".join(body))
    result = CliRunner().invoke(app, ["report", str(folder)])
    assert result.exit_code == 0 and "skipped 2 malformed row(s)" in result.output, result.output
    assert "1 PASS" in result.output or "1 FAIL" in result.output
    (folder / "manifest.json").write_text('{"grid": {"name": ')
    proc = cli("report", folder)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "corrupt manifest" in proc.stderr
    plotted = CliRunner().invoke(app, ["plot", str(folder)])  # a UserError: main() prints it as one line
    assert isinstance(plotted.exception, UserError) and "corrupt manifest" in str(plotted.exception)


def test_summary_shows_the_axes_that_vary_and_a_deterministic_cell_once(grid_file, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    grid_file.write_text(grid_file.read_text().replace("epochs: 1", "epochs: [1, 2]").replace("epsilon: [0.5, 2]",
                                                                                             "epsilon: [1]"))
    result = CliRunner().invoke(app, ["run", str(grid_file), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("mean ± std"):]
    title, header = table.splitlines()[0], table.splitlines()[2]
    assert "epochs" in header and "epochs" not in title and "B=32, lr=0.5" in title
    dp_rows = [line for line in table.splitlines() if "dp_sgd" in line]
    assert len(dp_rows) == 2 and {row.split()[1] for row in dp_rows} == {"1", "2"}
    erm = next(line for line in table.splitlines() if line.startswith("erm"))
    assert "±" not in erm and "runs=2/2" in title and "every seed gave the same result" in table


def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie is dead (its new parent may not reap it at once)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_a_parallel_run_leaves_no_worker_alive(grid_file, tmp_path):
    grid_file.write_text(grid_file.read_text()
                         .replace("epsilon: [0.5, 2]", f"epsilon: {[0.1 * k for k in range(1, 31)]}")
                         .replace("epochs: 1", "epochs: 40"))
    # one task per cell (fused, the 30 cells would be one task finishing all at once)
    env = {**os.environ, "DPSGD_DATA_DIR": str(tmp_path / "cache"), "DPSGD_FUSE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "dpsgd_cli", "run", str(grid_file), "--out", str(tmp_path / "out"),
                             "--jobs", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    csv = tmp_path / "out" / "tiny" / "runs.csv"
    deadline = time.time() + 180
    while time.time() < deadline and (not csv.exists() or len(csv.read_bytes().splitlines()) < 4):
        time.sleep(0.05)  # workers have started and finished tasks: they are mid-grid
    workers = _children(proc.pid)
    assert proc.poll() is None and len(workers) >= 2, "the grid finished before it could be killed"
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(map(_alive, workers)):
        time.sleep(0.1)
    assert not [pid for pid in workers if _alive(pid)]


# --- a download stops at the registry's size ----------------------------------------------------------------
def test_a_mirror_streaming_forever_is_stopped_at_the_registry_size(tmp_path, monkeypatch):
    import http.server
    import threading

    from dpsgd_cli.data.download import fetch_file
    from dpsgd_cli.errors import DataError

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"\0" * 65536)
            except OSError:  # the client hung up, as it should
                pass

        def log_message(self, *args):
            pass

    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        monkeypatch.setenv("DPSGD_DATA_MIRROR", f"http://127.0.0.1:{httpd.server_address[1]}")
        start = time.monotonic()
        with pytest.raises(DataError, match="more than the registry's"):
            fetch_file("mnist", "t10k-labels-idx1-ubyte.gz")
        assert time.monotonic() - start < 10
        folder = tmp_path / "mirror" / "mnist"  # a local mirror's oversized file too
        folder.mkdir(parents=True)
        (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\0" * (1 << 20))
        monkeypatch.setenv("DPSGD_DATA_MIRROR", str(tmp_path / "mirror"))
        with pytest.raises(DataError, match="more than the registry's"):
            fetch_file("mnist", "t10k-labels-idx1-ubyte.gz")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert list((tmp_path / "cache" / "mnist").iterdir()) == []
