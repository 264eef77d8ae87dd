"""examples/quickstart.ipynb, executed top to bottom by a Jupyter kernel of this test's own Python (nbclient), as a
user opening it would run it."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the `test` extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs the `test` extra: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="the notebook test needs the `test` extra: pip install -e '.[test]'")

NOTEBOOK = Path(__file__).parents[1] / "examples" / "quickstart.ipynb"
KERNEL = "dpsgd-tests"


@pytest.fixture
def kernel(tmp_path, monkeypatch) -> str:
    """A kernelspec running ipykernel in this Python (sys.executable), found first on JUPYTER_PATH: a `python3`
    kernelspec elsewhere (the user's, another venv's) may start another interpreter."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dpsgd tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return KERNEL


def test_the_committed_notebook_has_no_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


def test_the_quickstart_notebook_runs_top_to_bottom(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    work = tmp_path / "work"
    work.mkdir()
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable, end='')"))
    start = time.perf_counter()
    nbclient.NotebookClient(notebook, kernel_name=kernel, timeout=600,
                            resources={"metadata": {"path": str(work)}}).execute()
    seconds = time.perf_counter() - start
    assert notebook.cells[-1].outputs[0]["text"] == sys.executable  # the kernel is this test's Python
    if os.environ.get("DPSGD_KEEP_NOTEBOOK"):  # to look at the outputs: the executed notebook, there
        nbformat.write(notebook, os.environ["DPSGD_KEEP_NOTEBOOK"])
    outputs = [output for cell in notebook.cells[:-1] if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    kinds = [kind for o in outputs for kind in o.get("data", {})]
    assert kinds.count("text/html") >= 5  # the runs, the ε table, the selection, both audits as DataFrames
    assert "image/png" in kinds  # the figure
    shown = "\n".join(o["data"].get("text/plain", "") for o in outputs if "data" in o)
    assert "algorithm_params.accountant" in shown and "epsilon_lo" in shown and "chosen" in shown
    assert (work / "results" / "quickstart" / "runs.csv").exists()
    assert (work / "results" / "quickstart" / "selection.csv").exists()
    assert (work / "results" / "quickstart_audit" / "audit.csv").exists()
    assert (work / "results" / "quickstart" / "audit.csv").exists()  # the audit of what select chose
    print(f"quickstart.ipynb ran in {seconds:.0f} s")
