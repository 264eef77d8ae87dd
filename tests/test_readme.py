"""The README and docs as a user's machine reads them: no path of the machine they were written on, and the exit
codes the README's table gives are the ones the commands return."""

import contextlib
import re
import sys
from pathlib import Path

import pytest
import typer

from dpsgd_cli import cli

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
USER_FILES = [*DOCS, ROOT / "experiments.yaml",  # and the examples: what a user reads
              *sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".py", ".yaml", ".ipynb", ".md"))]

# where the datasets, papers and work trees of a development machine live: never a user's
MACHINE_PATHS = re.compile(r"\.\./shared\b|/work/|/home/\w|/root/|/Users/\w|[A-Za-z]:\\\\Users")


def test_no_path_of_the_development_machine_in_the_docs():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in USER_FILES
             for number, line in enumerate(path.read_text().splitlines(), 1) if MACHINE_PATHS.search(line)]
    assert not found, "\n".join(found)


def test_the_docs_fetch_from_the_canonical_urls_and_name_the_mirror_as_the_offline_option():
    readme = (ROOT / "README.md").read_text()
    assert "canonical URLs" in readme and "offline, set\n`DPSGD_DATA_MIRROR`" in readme
    for path in DOCS:  # a mirror is never what a command needs: where one is set, it is the offline option
        for line in path.read_text().splitlines():
            if line.startswith("export DPSGD_DATA_MIRROR") or line.startswith("DPSGD_DATA_MIRROR="):
                pytest.fail(f"{path.relative_to(ROOT)}: {line}: the datasets come from the canonical URLs unless "
                            f"offline")


# --- exit codes ------------------------------------------------------------------------------------------------------

def readme_exit_codes() -> dict[int, str]:
    """The README's exit-code table: code → its row's text."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Exit codes"):].split("\n## ")[0]
    rows = re.findall(r"^\| `(\d+)` \| (.*) \|$", section, flags=re.M)
    assert rows, "the README's exit-code table was not found"
    return {int(code): text for code, text in rows}


def commands() -> set[str]:
    group = typer.main.get_command(cli.app)
    return set(group.commands)  # type: ignore[attr-defined]


GRID = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 200}]
    algorithms: [dp_sgd]
    epsilon: [1]
    batch_size: [32]
    lr: [0.5]
    seeds: 1
    epochs: 1
"""
CLAIM = "    claims:\n      - {id: c, text: t, own: true, check: monotone, a: {algorithm: dp_sgd}}\n"


@pytest.fixture
def dpsgd(monkeypatch):
    """`dpsgd ARGS...` in this process, through the entry point: its exit code."""

    def call(*args) -> int:
        monkeypatch.setattr(sys, "argv", ["dpsgd", *map(str, args)])
        with pytest.raises(SystemExit) as exited:
            cli.main()
        return exited.value.code

    return call


@contextlib.contextmanager
def failing(error: BaseException, module: object = None, name: str = "prepare"):
    """Every dp_sgd training (or `module.name`) raises `error`: the engine records a failed run, or passes an
    interrupt on."""
    from dpsgd_cli.algorithms import ALGORITHMS

    def fail(*args, **kwargs):
        raise error

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ALGORITHMS["dp_sgd"] if module is None else module, name, fail)
        yield


def scenarios(dpsgd, write_grid, tmp_path) -> dict[tuple[int, str], list]:
    """(code, command, or "" for any) → calls of commands that should exit with that code, each giving its code."""
    from dpsgd_cli.privacy import accounting

    def failed_runs(command: str) -> int:  # every run of a grid with a claim failed; then `command` on it
        out = tmp_path / f"failed_{command}"
        with failing(ZeroDivisionError("no")):
            code = dpsgd("run", write_grid(GRID + CLAIM), "--out", out)
        return code if command == "run" else dpsgd(command, out / "tiny")

    def no_claims() -> int:
        out = tmp_path / "no_claims"
        dpsgd("run", write_grid(GRID), "--out", out)
        return dpsgd("report", out / "tiny")

    def interrupted_run() -> int:
        with failing(KeyboardInterrupt()):
            return dpsgd("run", write_grid(GRID), "--out", tmp_path / "interrupted")

    def interrupted_calculator() -> int:
        with failing(KeyboardInterrupt(), accounting, "dpsgd_epsilon"):
            return dpsgd(*calculator)

    calculator = ["epsilon", "--sigma", 1, "--sample-rate", 0.01, "--steps", 10, "--delta", 1e-5]
    return {
        (0, ""): [lambda: dpsgd(*calculator)],
        (0, "report"): [no_claims],
        (1, "run"): [lambda: failed_runs("run")],
        (1, "plot"): [lambda: failed_runs("plot")],
        (1, "report"): [lambda: failed_runs("report")],
        (1, "check"): [lambda: dpsgd("check", Path(__file__).parent / "data" / "plugins" / "broken.py")],
        (2, ""): [lambda: dpsgd("run", write_grid(GRID.replace("epochs:", "epoch:"))),  # unknown key
                  lambda: dpsgd(*calculator[:-1], 2.0),  # value out of range
                  lambda: dpsgd("run", tmp_path / "missing.yaml"),
                  lambda: dpsgd("plot", tmp_path / "nothing"),  # no results there
                  lambda: dpsgd("run", write_grid(GRID), "--bogus")],  # unknown option
        (130, ""): [interrupted_run, interrupted_calculator],
    }


def test_each_exit_code_of_the_readme_is_what_the_commands_return(dpsgd, write_grid, tmp_path):
    table = readme_exit_codes()
    checks = scenarios(dpsgd, write_grid, tmp_path)
    documented = set()
    for code, text in table.items():
        only = re.findall(r"`([a-z-]+)`:", text)  # `run`: ... — the code of those commands alone
        documented |= {(code, name) for name in [*only, *re.findall(r"also `([a-z-]+)`", text)]}
        documented |= set() if only else {(code, "")}
    assert {name for _, name in documented} - {""} <= commands()
    assert documented == set(checks), ("the README's exit codes and this test's checks differ: "
                                       f"{sorted(documented ^ set(checks))}")
    for (code, command), calls in sorted(checks.items()):
        for call in calls:
            assert call() == code, f"exit code {code} ({command or 'any command'}): {call}"


def test_every_exit_code_the_commands_use_is_in_the_readme():
    source = Path(cli.__file__).read_text()
    used = {int(code) for code in re.findall(r"(?:typer\.Exit|sys\.exit)\((\d+)\)", source)}
    assert used and used <= set(readme_exit_codes()), sorted(used - set(readme_exit_codes()))
