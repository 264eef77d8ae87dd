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
from unittest import mock

import pandas as pd
import pytest
from typer.testing import CliRunner

from dpsgd_cli import NUMERICS
from dpsgd_cli.cli import app, main
from dpsgd_cli.config import load_grid_file
from dpsgd_cli.engine import execute, plan_grid, runner
from dpsgd_cli.engine.results import COLUMNS, ResultStore, ResultsWriteError, acquire_lock, read_results, release_lock
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
    row = {**{c: "" for c in old}, "numerics": str(NUMERICS)}  # runs of this numerics version resume
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
    store.append([{"run_id": "d", "status": "ok", "seed": 3, "test_accuracy": 0.1 + 0.2, "batch_size": 64,
                   "numerics": NUMERICS}])
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
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
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


# --- 7. a results folder received from anyone: links and unusable files ---------------------------------------
FOLDER_GRID = GRID + """    select: {name: by_test, candidates: [lr], score: test_accuracy}
    claims:
      - {id: c, text: t, own: true, check: monotone, a: {algorithm: dp_sgd}}
"""
AUDIT_GRID = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 300, dim: 5}]
    algorithms: [dp_sgd]
    epsilon: [0.5, 1, 2]
    batch_size: [32]
    epochs: 1
    lr: 0.5
    seeds: 1
    delta: 1.0e-5
    audit: {canaries: [input], trials: 4, threshold: order}
"""
COMMANDS = {
    "run": ["run", "{grid}", "--out", "{out}"],
    "audit": ["audit", "{audit_grid}", "--out", "{out}"],
    "plot": ["plot", "{folder}"],
    "report": ["report", "{folder}"],
    "select": ["select", "{folder}"],
    "export": ["export", "{folder}", "--format", "csv"],
}
AUDIT_ROW = {"grid": "tiny", "cell_id": "x", "dataset": "synthetic", "model": "logreg", "algorithm": "dp_sgd",
             "algorithm_params": "{}", "epsilon_claimed": 2.0, "delta": 1e-5, "epsilon_lo": 0.1,
             "verdict": "uninformative", "canary": "input", "threat_model": "black-box, last iterate", "trials": 2,
             "confidence": 0.95, "status": "ok"}


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    """A finished results folder (runs, traces, manifest, figures, an audit.csv) as a collaborator sends it."""
    root = tmp_path_factory.mktemp("received")
    grid_file = root / "grid.yaml"
    grid_file.write_text(FOLDER_GRID)
    grid_file.with_name("audit.yaml").write_text(AUDIT_GRID)  # the same grid name, private algorithms only
    execute(plan_grid(load_grid_file(grid_file).grids[0], root / "out"))
    folder = root / "out" / "tiny"
    pd.DataFrame([AUDIT_ROW]).to_csv(folder / "audit.csv", index=False)
    (folder / "figures").mkdir()
    return grid_file, folder


@pytest.fixture
def copy(received, tmp_path):
    """A fresh copy of the received folder; returns (grid file, the copy's grid folder)."""
    grid_file, folder = received
    shutil.copytree(folder.parent, tmp_path / "out", symlinks=True)
    return grid_file, tmp_path / "out" / "tiny"


def dpsgd(capsys, command, grid_file, folder):
    """`dpsgd COMMAND ...` on the folder, in this process (so that a test can patch what the disk does), as the
    console script runs it: the exit code and stderr."""
    args = [a.format(grid=grid_file, audit_grid=grid_file.with_name("audit.yaml"), out=folder.parent, folder=folder)
            for a in COMMANDS[command]]
    capsys.readouterr()
    with mock.patch.object(sys, "argv", ["dpsgd", *args]), pytest.raises(SystemExit) as done:
        main()
    return done.value.code, capsys.readouterr().err


def refused(code, stderr, *words):
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, (code, stderr)
    for word in words:
        assert word in stderr, stderr


# where a link is planted, what it points to (a file or a folder outside the results folder), the commands
LINKS = [
    ("runs.lock", "file", ["run", "audit"]),
    ("manifest.json.tmp", "file", ["run"]),
    ("runs.csv.tmp", "file", ["run"]),  # beside a cut runs.csv: recovery rewrites it
    ("runs.csv", "file", ["run", "plot", "report", "select", "export"]),
    ("traces.csv", "file", ["run", "export"]),
    ("audit.csv", "file", ["audit", "report"]),
    ("report.html", "file", ["report"]),
    ("selection.csv", "file", ["select"]),
    ("runs_valid.csv", "file", ["export"]),
    ("figures", "folder", ["plot", "audit"]),
    ("figures/accuracy.png", "file", ["plot"]),
    (".", "folder", ["run", "audit", "plot", "report", "select", "export"]),  # the grid's folder itself
]


@pytest.mark.parametrize("name, kind, command", [(n, k, c) for n, k, cs in LINKS for c in cs])
def test_a_link_in_a_results_folder_is_refused_and_its_target_untouched(copy, tmp_path, capsys, name, kind,
                                                                        command):
    grid_file, folder = copy
    target = tmp_path / "outside"
    if kind == "folder":
        shutil.copytree(folder, target)  # a folder that holds what the tool would write, and more
    else:
        target.write_bytes(b"someone else's file\n")
    before = {p: p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()}
    if name == "runs.csv.tmp":
        (folder / "runs.csv").write_bytes((folder / "runs.csv").read_bytes()[:-50])  # a run to recover
    link = folder / name
    if name == ".":
        shutil.rmtree(folder)
        link = folder
    elif link.exists():
        shutil.rmtree(link) if link.is_dir() else link.unlink()
    link.symlink_to(target)
    refused(*dpsgd(capsys, command, grid_file, folder), "symbolic link")
    assert {p: p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()} == before
    assert link.is_symlink()  # not replaced either: the user decides what to do with it


def test_writes_go_to_a_fresh_file_created_in_the_folder_never_through_a_link(copy, monkeypatch):
    """The check before a write is not the only guard: a link planted after it (another process) is not followed
    either (O_NOFOLLOW, temporary files created exclusively)."""
    from dpsgd_cli.engine import folder as files

    _, folder = copy
    outside = folder.parent.parent / "outside"
    outside.write_bytes(b"kept\n")
    monkeypatch.setattr(files, "refuse_link", lambda path: Path(path))  # as if the link came after the check
    for name in ("runs.csv", "runs.lock"):
        (folder / name).unlink()
        (folder / name).symlink_to(outside)
    with pytest.raises(OSError) as appending:
        ResultStore(folder).append([{"run_id": "a", "status": "ok"}])
    with pytest.raises(OSError) as locking:
        acquire_lock(folder)
    assert appending.value.errno == locking.value.errno == errno.ELOOP
    files.write_text(folder / "runs.csv", "replaced\n")  # a rename replaces the link itself
    assert outside.read_bytes() == b"kept\n" and (folder / "runs.csv").read_text() == "replaced\n"
    assert not list(folder.glob(".*.tmp"))


# an unusable folder: how it is made, the commands that use what it breaks (each exits 2 with one line)
READERS = ["plot", "report", "select", "export"]
BROKEN = {
    "figures is a file": (lambda f: (shutil.rmtree(f / "figures"), (f / "figures").write_text("x")),
                          ["plot", "audit"]),
    "runs.csv is a folder": (lambda f: ((f / "runs.csv").unlink(), (f / "runs.csv").mkdir()), ["run", *READERS]),
    "manifest.json is a folder": (lambda f: ((f / "manifest.json").unlink(), (f / "manifest.json").mkdir()),
                                  ["run", *READERS]),
    "runs.csv is empty": (lambda f: (f / "runs.csv").write_bytes(b""), READERS),
    "runs.csv lacks columns": (lambda f: (f / "runs.csv").write_text("run_id,test_accuracy\na,0.5\n"),
                               ["run", *READERS]),
    "runs.csv is not UTF-8": (lambda f: (f / "runs.csv").write_bytes(b"\xffrun_id,\xfe\n"), ["run", *READERS]),
    "runs.csv is a FIFO": (lambda f: ((f / "runs.csv").unlink(), os.mkfifo(f / "runs.csv")), ["run", *READERS]),
    "traces.csv lacks columns": (lambda f: (f / "traces.csv").write_text("run_id,loss\na,1\n"), ["run", "export"]),
    "manifest.json is not UTF-8": (lambda f: (f / "manifest.json").write_bytes(b'{"grid": "\xff"}'), READERS),
    "audit.csv is empty": (lambda f: (f / "audit.csv").write_bytes(b""), ["report"]),
    "audit.csv lacks columns": (lambda f: (f / "audit.csv").write_text("grid,epsilon_lo\ntiny,1\n"), ["report"]),
    "audit.csv is not UTF-8": (lambda f: (f / "audit.csv").write_bytes(b"grid,\xff\n"), ["report"]),
    "audit.csv has a word for a number": (
        lambda f: pd.DataFrame([{**AUDIT_ROW, "epsilon_lo": "high"}]).to_csv(f / "audit.csv", index=False),
        ["report"]),
}


@pytest.mark.parametrize("case, command", [(case, c) for case, (_, cs) in BROKEN.items() for c in cs])
def test_an_unusable_folder_is_one_line_for_every_command(copy, capsys, case, command):
    grid_file, folder = copy
    BROKEN[case][0](folder)
    refused(*dpsgd(capsys, command, grid_file, folder))


@pytest.mark.parametrize("name", ["runs.csv", "traces.csv", "runs.lock"])
def test_a_file_appended_to_with_another_hard_link_is_refused_before_any_work(copy, capsys, tmp_path, name):
    """`cp -al` (a backup of hard links) shares the files: appending to one would change the other."""
    grid_file, folder = copy
    backup = tmp_path / "backup"
    os.link(folder / name, backup)
    before = backup.read_bytes()
    grid_file = tmp_path / "more.yaml"
    grid_file.write_text(FOLDER_GRID.replace("epsilon: [0.5, 2]", "epsilon: [0.5, 2, 3]"))  # runs to append
    refused(*dpsgd(capsys, "run", grid_file, folder), "hard link")
    assert backup.read_bytes() == before and "dp_sgd" not in capsys.readouterr().out


def _failing_disk(monkeypatch, root: Path, code: int) -> None:
    """Every write under `root` fails with `code` (EROFS: a read-only filesystem; ENOSPC: a full disk; EACCES: no
    permission), as the kernel would say it. Simulated in this process: chmod does not stop root (these tests may run
    as root), and a real read-only or full filesystem needs a mount (the next test, where it can)."""
    real_open, real_mkdir, real_replace = os.open, os.mkdir, os.replace
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def fail(path):
        raise OSError(code, os.strerror(code), os.fsdecode(path))

    def open_(path, flags, *args, **kwargs):
        if flags & writing and os.fspath(path).startswith(str(root)):
            fail(path)
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if os.fspath(path).startswith(str(root)) and not os.path.isdir(path):
            fail(path)
        return real_mkdir(path, *args, **kwargs)

    def replace(source, target, *args, **kwargs):
        if os.fspath(target).startswith(str(root)):
            fail(target)
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "replace", replace)


SAYS = {errno.EROFS: "read-only", errno.ENOSPC: "no space left", errno.EACCES: "permission denied"}


@pytest.mark.parametrize("code", list(SAYS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_read_only_or_full_disk_is_one_line_for_every_command(copy, capsys, monkeypatch, command, code):
    grid_file, folder = copy
    for name in ("runs.lock", "figures", "audit.csv"):  # what each command creates first, created here
        path = folder / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    _failing_disk(monkeypatch, folder, code)
    refused(*dpsgd(capsys, command, grid_file, folder), str(folder), SAYS[code])
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before  # nothing half-written


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounts need root and unshare")
def test_a_real_read_only_and_a_real_full_filesystem(copy, tmp_path):
    """The same on real filesystems, in a private mount namespace (nothing is mounted outside the test): the
    folder bind-mounted read-only, and a copy on a 1 MiB tmpfs filled up."""
    grid_file, folder = copy
    full = tmp_path / "full"
    full.mkdir()
    script = f"""
set -e
mount --bind {folder} {folder} && mount -o remount,ro,bind {folder}
mount -t tmpfs -o size=1m tmpfs {full}
mkdir {full}/tiny && cp {folder}/runs.csv {folder}/manifest.json {full}/tiny/
head -c 2000000 /dev/zero > {full}/filler 2>/dev/null || true
for args in "plot {folder}" "report {folder}" "export {folder}" "plot {full}/tiny" "report {full}/tiny"; do
  {sys.executable} -m dpsgd_cli $args > /dev/null 2> {tmp_path}/stderr && echo "exit 0: $args" || echo "exit $?: $args"
  cat {tmp_path}/stderr
done
"""
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "mount" in proc.stderr:
        pytest.skip(f"no private mounts here: {proc.stderr.strip()}")
    out = proc.stdout.splitlines()
    exits = [line for line in out if line.startswith("exit ")]
    assert len(exits) == 5 and all(line.startswith("exit 2:") for line in exits), proc.stdout + proc.stderr
    errors = [line for line in out if line.startswith("error: ")]
    assert len(errors) == 5 and "Traceback" not in proc.stdout, proc.stdout
    assert sum("read-only" in line for line in errors) == 3 and sum("no space left" in line for line in errors) == 2


def test_a_runs_csv_saved_by_a_spreadsheet_reads_back_the_same_rows(copy, capsys):
    """A byte-order mark and CRLF line ends (Excel's "CSV UTF-8") are read as what they are: the same runs, and
    `run` resumes from them without redoing or duplicating any."""
    grid_file, folder = copy
    before = read_results(folder).runs
    csv_path = folder / "runs.csv"
    csv_path.write_bytes(b"\xef\xbb\xbf" + csv_path.read_bytes().replace(b"\n", b"\r\n"))
    after = read_results(folder)
    pd.testing.assert_frame_equal(after.runs, before)
    assert (after.malformed, after.incomplete) == (0, False)
    grid = load_grid_file(grid_file, [("epsilon", [0.5, 2, 3])]).grids[0]  # one cell more to run
    plan = plan_grid(grid, folder.parent)
    assert plan.done_before == len(before) and plan.pending_runs == 2
    execute(plan)
    runs = read_results(folder).runs
    assert len(runs) == len(before) + 2 and runs["run_id"].is_unique and (runs["status"] == "ok").all()



def test_a_second_audit_of_a_folder_is_refused_and_readers_never_see_half_a_file(write_grid, tmp_path):
    from dpsgd_cli.audit.run import read_audit_csv

    grid_file = write_grid(AUDIT_GRID)
    folder = tmp_path / "out" / "tiny"
    env = {**os.environ, "DPSGD_DATA_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "dpsgd_cli", "audit", str(grid_file), "--out", str(tmp_path / "out")]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    lock = folder / "runs.lock"
    while time.time() < deadline and not (lock.exists() and lock.read_text()):
        time.sleep(0.02)  # the first audit holds the folder
    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    reads = 0
    while first.poll() is None:  # every read while the first rewrites audit.csv: a whole file
        if (folder / "audit.csv").exists():
            assert len(read_audit_csv(folder / "audit.csv")) in (1, 2, 3)
            reads += 1
    assert first.wait() == 0, first.stderr.read()
    refused(second.returncode, second.stderr, "another dpsgd process is writing", f"pid {first.pid}", "audit")
    assert len(read_audit_csv(folder / "audit.csv")) == 3 and reads > 0
