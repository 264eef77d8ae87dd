"""docs/papers: every number a run produced is written by scripts/paper_numbers.py from a results folder, so a
rerun restates the pages and a stale number fails `--check`; no result-looking number stands outside its blocks."""

import ast
import importlib.util
import re
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).parents[1]
PAGES = sorted((ROOT / "docs" / "papers").glob("*.md"))

_spec = importlib.util.spec_from_file_location("paper_numbers", ROOT / "scripts" / "paper_numbers.py")
paper_numbers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paper_numbers)

GRID = """
grids:
  - name: tiny
    datasets: [{name: synthetic, n: 400}]
    algorithms: [erm, dp_sgd]
    epsilon: [0.5, 3]
    batch_size: [50]
    lr: [0.5]
    epochs: 1
    seeds: 2
    claims:
      - {id: tiny-learns, text: DP-SGD at epsilon = 3 is more accurate than a coin, own: true, check: above,
         a: {algorithm: dp_sgd, epsilon: 3}, over: null, value: 0.5}
"""

PAGE = """# A page

Setup: n = 400 (an input).

<!-- numbers: grid=tiny
DP-SGD at ε = 3: {{ mean("test_accuracy", algorithm="dp_sgd", epsilon=3) | .1% }} ± {{
std("test_accuracy", algorithm="dp_sgd", epsilon=3) | .1% }} over {{ runs(algorithm="dp_sgd", epsilon=3) }} seeds;
tiny-learns {{ verdict("tiny-learns") }}.
-->
(not yet filled)
<!-- /numbers -->

<!-- numbers: grid=absent
{{ mean("test_accuracy") }}
-->
left as it is
<!-- /numbers -->
"""


def test_blocks_are_written_from_the_runs_and_a_stale_number_fails_the_check(tmp_path, run_grid):
    runs = run_grid(GRID)
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "a.md").write_text(PAGE)
    results = str(tmp_path / "out")
    check = [results, "--pages", str(pages), "--check", "--partial"]  # `absent` is not in the results
    assert paper_numbers.main(check) == 1  # never filled: stale
    assert paper_numbers.main([results, "--pages", str(pages)]) == 0
    assert paper_numbers.main(check) == 0
    assert paper_numbers.main(check[:-1]) == 1  # a block whose grid was not run is no pass without --partial
    text = (pages / "a.md").read_text()
    accuracy = runs[(runs["algorithm"] == "dp_sgd") & (runs["epsilon"] == 3)]["test_accuracy"]
    assert f"DP-SGD at ε = 3: {accuracy.mean():.1%} ± {accuracy.std():.1%} over 2 seeds;\ntiny-learns PASS." in text
    assert "left as it is" in text and "{{ mean(" in text  # no results for `absent`: the block stays
    (pages / "a.md").write_text(text.replace(f"{accuracy.mean():.1%} ±", "99.9% ±"))  # a hand-edited number
    assert paper_numbers.main(check) == 1
    run_grid(GRID.replace("seeds: 2", "seeds: 3"))  # a rerun with more seeds restates the page
    assert paper_numbers.main(check) == 1
    assert paper_numbers.main([results, "--pages", str(pages)]) == 0
    assert "over 3 seeds" in (pages / "a.md").read_text()


def test_a_bad_template_is_one_line_naming_the_block(tmp_path, run_grid, capsys):
    run_grid(GRID)
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "a.md").write_text(PAGE.replace('algorithm="dp_sgd", epsilon=3) | .1% }} ±',
                                             'algorithm="nope") | .1% }} ±'))
    assert paper_numbers.main([str(tmp_path / "out"), "--pages", str(pages)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: block grid=tiny: {{mean(\"test_accuracy\", algorithm=\"nope\")") and "nope" in err
    assert len(err.strip().splitlines()) == 1


def _calls(template: str) -> set[str]:
    """The names a template's expressions call."""
    names = set()
    for expression in paper_numbers.PLACEHOLDER.findall(template):
        expression = expression.rpartition("|")[0] if "|" in expression else expression
        tree = ast.parse(expression.strip(), mode="eval")
        found = [n for n in ast.walk(tree) if isinstance(n, ast.Name)]
        names |= {n.id for n in found} - {n.id for n in found if isinstance(n.ctx, ast.Store)}  # not loop names
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_of_the_pages_names_a_grid_and_known_functions(page):
    known = {"mean", "std", "lo", "hi", "runs", "table", "verdict", "numbers", "held", "verdicts", "summary",
             "unselected", "analytic", "derived", "spread", "abs", "min", "max", "round", "len", "sqrt"}
    grids = {*paper_numbers.claim_grids(), "*"} | {
        g.name for g in paper_numbers.load_grid_file(ROOT / "experiments.yaml").grids}
    text = page.read_text()
    assert text.count("<!-- numbers:") == len(paper_numbers.BLOCK.findall(text)) == text.count("<!-- /numbers -->")
    for match in paper_numbers.BLOCK.finditer(text):
        attrs = dict(part.split("=", 1) for part in match.group("attrs").split())
        assert attrs.get("grid") in grids, match.group("attrs")
        assert _calls(match.group("template")) <= known


# Result-looking: a percentage, a ±, a multiple (2.9×), or a decimal with two significant digits or more.
RESULT_LOOKING = re.compile(r"\d+(?:\.\d+)?\s?%|±|\d(?:\.\d+)?×|(?<![\w.])(?:0\.0*[1-9]\d+|[1-9]\d*\.\d+)(?![\w.])")
EXEMPT = [
    re.compile(r"<!-- numbers:.*?<!-- /numbers -->", re.DOTALL),  # generated from the runs
    # marked, with why
    re.compile(r"<!-- given: (?:paper|input|timing|test|previous) -->.*?<!-- /given -->", re.DOTALL),
    re.compile(r"```.*?```", re.DOTALL),  # commands
    re.compile(r"`[^`\n]*`"),
    re.compile(r"\]\([^)]*\)"),  # link targets
]


def result_looking(text: str) -> list[str]:
    """The result-looking numbers of a page outside its generated blocks and marked spans (with context)."""
    for pattern in EXEMPT:
        text = pattern.sub(" ", text)
    return [text[max(0, m.start() - 30):m.end() + 10].replace("\n", " ") for m in RESULT_LOOKING.finditer(text)]


def test_the_lint_sees_result_looking_numbers():
    assert result_looking("accuracy 84.6% at ε = 1, σ 0.651 ± 0.3, 2.9× smaller") != []
    assert len(result_looking("84.6%")) == len(result_looking("0.651")) == len(result_looking("1.69×")) == 1
    assert result_looking("λ = 1e-4, ε = 0.3, lr 0.001, n = 30,162, Figures 1–3, §IV-C, `0.651`") == []
    assert result_looking("<!-- given: input -->ζ = 0.01 and lr 3.99<!-- /given -->") == []
    assert result_looking("<!-- given -->lr 3.99<!-- /given -->") != []  # a mark says why


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_hold_no_result_looking_number_outside_generated_blocks(page):
    assert result_looking(page.read_text()) == []


def test_runs_csv_of_the_fixture_is_read_as_the_report_reads_it(tmp_path, run_grid):
    run_grid(GRID)
    runs = paper_numbers.Runs(tmp_path / "out" / "tiny")
    frame = pd.read_csv(tmp_path / "out" / "tiny" / "runs.csv")
    assert runs.runs(algorithm="dp_sgd") == len(frame[frame["algorithm"] == "dp_sgd"]) == 4
    with pytest.raises(LookupError, match="no run of tiny"):
        runs.mean("test_accuracy", algorithm="nope")
