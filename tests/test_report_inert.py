"""Reports are inert: whatever text a grid file, a manifest or a CSV holds, report.md shows it as one line of
literal text (no forged line, table cell, link or image) and report.html as escaped text (no script, no event
attribute, no `javascript:` link, no file embedded from outside a grid's own figures/ folder).

Every string field of the grid schema is found by walking `config.Grid` (not listed here): each gets the hostile
strings; a refusal must be one line (the CLI's exit 2), an accepted value goes into a results folder's manifest
and the report is checked. The string columns of runs.csv and audit.csv get the same strings."""

from __future__ import annotations

import base64
import json
import re
import shutil
import types
import typing
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from pydantic import BaseModel

from dpsgd_cli import api
from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.audit.engine import COLUMNS as AUDIT_COLUMNS
from dpsgd_cli.config import Grid, load_grid_file
from dpsgd_cli.engine import execute, plan_grid
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import MODELS
from dpsgd_cli.plots import plot_results
from dpsgd_cli.report_html import write_html

PNG = b"\x89PNG\r\n\x1a\n"
HOSTILE = ("<script>alert(1)</script> <img src=x onerror=alert(1)> [x](javascript:alert(1)) ![h](/etc/hostname) "
           "![o](../../outside.png) <a href='data:text/html,x'>d</a> `tick` a | b **bold** _u_ &lt;i&gt; # - 1.")
FORGED = "text\n\n**findings: 9 PASS, 0 FAIL, 0 VACUOUS, 0 NO DATA**\n\n| forged | row |"
VALUES = {"one line": HOSTILE, "newline": FORGED}

BASE = {
    "name": "g",
    "description": "the base grid",
    "datasets": [{"name": "synthetic", "n": 300}],
    "models": [{"name": "logreg"}],
    "algorithms": [{"name": "erm"}, {"name": "dp_sgd"}],
    "epsilon": [1.0, 3.0],
    "batch_size": [32],
    "lr": [0.5],
    "epochs": 1,
    "seeds": 2,
    "validation": 0.1,
    "figures": [{"name": "acc", "title": "accuracy", "paper": "the paper's figure", "lines": ["algorithm"]}],
    "claims": [{"id": "grows", "text": "accuracy grows with epsilon", "quote": 'A: "it grows"', "reading": "r",
                "check": "monotone", "a": {"algorithm": "dp_sgd"}, "group_by": ["dataset"], "tolerance": 0.5,
                "also": [{"text": "and stays above 0", "check": "above", "value": 0.0}]}],
    "select": [{"name": "tuned", "candidates": ["lr"]}],
    "audit": {"trials": 2},
}


# --- the schema walk ----------------------------------------------------------------------------------------
def _union_args(annotation: Any) -> tuple:
    if typing.get_origin(annotation) is typing.Annotated:
        return _union_args(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for arg in typing.get_args(annotation) for a in _union_args(arg))
    return (annotation,)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field holds, alone or in a list (through Optional, unions and Annotated)."""
    found = []
    for arg in _union_args(annotation):
        if _is_model(arg):
            found.append(arg)
        elif typing.get_origin(arg) in (list, tuple):
            found += [model for inner in typing.get_args(arg) for model in _models_in(inner)]
    return found


def _holds_text(annotation: Any) -> str | None:
    """How a field holds text: 'str', 'list' (of str), 'dict' (str keys, any values), or None."""
    for arg in _union_args(annotation):
        origin, args = typing.get_origin(arg), typing.get_args(arg)
        if arg is str:
            return "str"
        if origin in (list, tuple) and args and args[0] is str:
            return "list"
        if origin is dict and args and args[0] is str and not _is_model(args[1]):
            return "dict"
    return None


def string_fields(model: type[BaseModel], raw: dict, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """(path into `raw`, how it holds text) of every string field of `model` and of the models it contains,
    located in the raw grid `raw` (a list of models: the first entry that validates as each of them)."""
    for name, field in model.model_fields.items():
        models = _models_in(field.annotation)
        if models:
            value = raw.setdefault(name, {})  # a list of models must be in the base grid
            for sub in models:
                if isinstance(value, list):
                    index = next((i for i, entry in enumerate(value) if _validates(sub, entry)), None)
                    assert index is not None, f"the base grid has no {sub.__name__} in {path + (name,)}"
                    yield from string_fields(sub, value[index], path + (name, index))
                else:
                    yield from string_fields(sub, value, path + (name,))
        elif (how := _holds_text(field.annotation)) is not None:
            yield path + (name,), how


def _validates(model: type[BaseModel], entry: Any) -> bool:
    try:
        model.model_validate(entry, context={"grid_dir": Path.cwd()})
    except (ValueError, UserError):  # pydantic's ValidationError is a ValueError
        return False
    return True


def _base(tmp_path: Path) -> dict:
    """BASE with a file dataset beside the built-in one (so that its string fields are walked too)."""
    data = tmp_path / "data.csv"
    data.write_text("x,y\n" + "".join(f"{i % 7},{i % 2}\n" for i in range(40)))
    return {**json.loads(json.dumps(BASE)),
            "datasets": [*BASE["datasets"], {"name": "file", "path": str(data), "label": "y"}]}


def _set(raw: dict, path: tuple, how: str, value: str) -> dict:
    out = json.loads(json.dumps(raw))
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = {"str": value, "list": [value], "dict": {value: value}}[how]
    return out


# --- the checks -----------------------------------------------------------------------------------------------
class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))


def _unescaped(line: str, chars: str) -> list[str]:
    """The characters of `chars` in a Markdown line that no backslash escapes."""
    return re.findall(r"(?<!\\)(?:\\\\)*([" + re.escape(chars) + "])", line)


def assert_inert(folder: Path, verdicts: pd.DataFrame, figures: set[bytes]) -> None:
    """report.md and report.html of `folder`: one honest findings line, tables intact, no markup from the data;
    the page runs nothing and embeds only the figures the tool drew."""
    markdown = (folder / "report.md").read_text()
    counts = verdicts[verdicts["kind"] == "finding"]["verdict"].value_counts()
    honest = "**findings: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("PASS", "FAIL", "VACUOUS", "NO DATA"))
    assert [line for line in markdown.splitlines() if "findings:" in line[:12]] == [
        line for line in markdown.splitlines() if line.startswith(honest)] != [], markdown
    table_width = None
    for line in markdown.splitlines():
        if line.startswith("|"):
            width = len(_unescaped(line, "|"))
            table_width = width if table_width is None else table_width
            assert width == table_width, line  # every row has its header's cells
        else:
            table_width = None
        if line.startswith("!["):  # the tool's own images, only
            assert re.fullmatch(r"!\[[^\]]*\]\((\w+/)?figures/[\w.-]+\.png\)", line), line
    for markup in ["<script", "<img", "<a ", "[x]", "![h]", "![o]", "`tick", "**bold", "_u_", "&lt;", "| forged"]:
        assert not re.search(r"(?<!\\)(?:\\\\)*" + re.escape(markup), markdown), markup  # each shown escaped
    html = (folder / "report.html").read_text()
    body = html[html.index("<body>"):]
    assert "<script" not in body.lower() and "javascript:" not in html.lower(), body
    assert not re.search(r"\bon[a-z]+\s*=", body, re.IGNORECASE), body
    parser = _Tags()
    parser.feed(body)
    for tag, attrs in parser.tags:
        assert tag in {"body", "h1", "h2", "h3", "p", "em", "strong", "br", "img", "table", "thead", "tbody", "tr",
                       "th", "td", "a", "code"}, tag
        assert not [k for k in attrs if k.startswith("on")] and set(attrs) <= {"src", "alt", "href", "style"}
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,"), attrs
            assert base64.b64decode(attrs["src"].split(",", 1)[1]) in figures  # a figure the tool drew
        if tag == "a":
            assert re.match(r"https?://", attrs["href"]), attrs
    assert body.count("<strong>findings") == 1


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A grid run and plotted once: the folder every case copies."""
    root = tmp_path_factory.mktemp("inert")
    grid = Grid.model_validate(BASE, strict=True)
    execute(plan_grid(grid, root / "results"))
    plot_results(root / "results")
    (root / "outside.png").write_bytes(PNG + b"a file outside the results folder")
    return root / "results"


def _copy(results: Path, tmp_path: Path) -> Path:
    out = tmp_path / "results"
    shutil.copytree(results, out)
    return out


def _figures(out: Path) -> set[bytes]:
    return {p.read_bytes() for p in out.glob("*/figures/*.png")}


def _report(out: Path) -> pd.DataFrame | None:
    """The report's verdicts, or None when it refused the folder in one line (the CLI's exit 2)."""
    try:
        return api.report(out)
    except UserError as exc:
        assert "\n" not in str(exc)
        return None


def test_the_schema_walk_finds_every_kind_of_string_field(tmp_path):
    found = {path for path, _ in string_fields(Grid, _base(tmp_path))}
    for path in [("description",), ("figures", 0, "title"), ("claims", 0, "quote"), ("claims", 0, "where"),
                 ("select", 0, "candidates"), ("datasets", 1, "label"), ("algorithms", 0, "name")]:
        assert path in found, path
    for kind in [*[a.Params for a in ALGORITHMS.values()], *[m.Options for m in MODELS.values()]]:
        assert not list(string_fields(kind, {})), kind  # parameters take no free text (else: walk them too)


@pytest.mark.parametrize("variant", VALUES)
def test_hostile_text_in_every_string_field_of_a_grid_is_refused_or_shown_inert(results, tmp_path, variant):
    """Each value in a grid file (refused in one line, or reported), and in a received manifest, where the grid
    file's checks never ran (the report refuses the manifest in one line, or shows the text inert)."""
    base = _base(tmp_path)
    fields = list(string_fields(Grid, json.loads(json.dumps(base))))
    assert len(fields) > 20
    accepted = received = inert = 0
    for case, (path, how) in enumerate(fields):
        raw = _set(base, path, how, VALUES[variant])
        grid_file = tmp_path / "grid.yaml"
        grid_file.write_text(yaml.safe_dump({"grids": [raw]}))
        try:
            shown = load_grid_file(grid_file).grids[0].model_dump(mode="json")
            accepted += 1
        except UserError as exc:  # refused: one line
            assert "\n" not in str(exc), (path, str(exc))
            shown = None
        out = _copy(results, tmp_path / "case" / str(case))
        manifest = json.loads((out / "g" / "manifest.json").read_text())
        if shown is not None:
            shown["datasets"] = manifest["grid"]["datasets"]  # the runs' datasets: the file one never ran
        elif path[0] != "datasets":  # the value as a manifest may hold it (the report reads no dataset entry)
            shown, received = _set(manifest["grid"], path, how, VALUES[variant]), received + 1
        else:
            continue
        (out / "g" / "manifest.json").write_text(json.dumps({**manifest, "grid": shown}))
        verdicts = _report(out)
        if verdicts is not None:
            assert_inert(out, verdicts, _figures(out))
            inert += 1
    assert accepted > 0 and received > 0 and inert > accepted  # some received text was reported, inert


@pytest.mark.parametrize("variant", VALUES)
def test_hostile_text_in_the_string_columns_of_runs_csv_is_shown_inert(results, tmp_path, variant):
    runs = pd.read_csv(results / "g" / "runs.csv")
    columns = [c for c in runs if not pd.api.types.is_numeric_dtype(runs[c])]
    assert {"dataset", "algorithm"} <= set(columns)
    rendered = 0
    for column in columns:
        case = tmp_path / column
        out = _copy(results, case)
        runs.assign(**{column: VALUES[variant]}).to_csv(out / "g" / "runs.csv", index=False)
        verdicts = _report(out)
        if verdicts is not None:
            assert_inert(out, verdicts, _figures(out))
            rendered += 1
    assert rendered > len(columns) // 2


def _audit_row() -> dict:
    row = {c: 0.5 for c in AUDIT_COLUMNS}
    row.update(grid="g", cell_id="c1", dataset="synthetic", model="logreg", algorithm="dp_sgd",
               algorithm_params='{"accountant": "rdp"}', epsilon=1.0, epsilon_claimed=1.0, epsilon_lo=2.0,
               verdict="refuted", reason="a reason", covers="yes", statistic="clopper_pearson", threshold="order",
               canary="input", threat_model="black-box, last iterate", neighbours="add_remove", guarantee="proved",
               scores_file="scores.npz", status="ok", message="", trials=2, family_size=1)
    return row


@pytest.mark.parametrize("variant", VALUES)
def test_hostile_text_in_the_string_columns_of_audit_csv_is_shown_inert(results, tmp_path, variant):
    row = _audit_row()
    columns = [c for c, v in row.items() if isinstance(v, str)]
    for column in columns:
        out = _copy(results, tmp_path / column)
        value = json.dumps({VALUES[variant]: VALUES[variant]}) if column == "algorithm_params" else VALUES[variant]
        pd.DataFrame([{**row, column: value}]).to_csv(out / "g" / "audit.csv", index=False)
        verdicts = _report(out)
        assert verdicts is not None
        assert_inert(out, verdicts, _figures(out))
        assert column == "status" or "Privacy audit" in (out / "report.md").read_text()  # not ok: not shown


def test_the_page_embeds_only_the_figures_of_a_grid_and_links_only_inside_or_to_the_web(results, tmp_path):
    out = _copy(results, tmp_path)
    figure = next((out / "g" / "figures").glob("*.png"))
    (out / "g" / "figures" / "linked.png").symlink_to(tmp_path / "outside.png")
    (tmp_path / "outside.png").write_bytes(PNG + b"outside")
    (out / "g" / "stray.png").write_bytes(PNG + b"not in figures/")
    markdown = out / "report.md"
    markdown.write_text("\n\n".join([
        f"![ok](g/figures/{figure.name})", "![abs](/etc/hostname)", f"![abs2]({tmp_path / 'outside.png'})",
        "![up](../outside.png)", "![up2](g/figures/../../../outside.png)", "![link](g/figures/linked.png)",
        "![stray](g/stray.png)", "![web](https://example.org/x.png)", "![file](file:///etc/hostname)",
        "[js](javascript:alert(1)) [js2](JAVASCRIPT:alert(1)) [data](data:text/html;base64,PHNjcmlwdD4=)",
        "[file](file:///etc/passwd) [abs](/etc/passwd) [up](../secret) [web](https://example.org/a?b=c)",
        "[own](g/runs.csv) <script>alert(1)</script> <img src=x onerror=alert(1)>"]) + "\n")
    html = write_html(markdown).read_text()
    parser = _Tags()
    parser.feed(html[html.index("<body>"):])
    images = [base64.b64decode(a["src"].split(",", 1)[1]) for t, a in parser.tags if t == "img"]
    assert images == [figure.read_bytes()]
    assert [a["href"] for t, a in parser.tags if t == "a"] == ["https://example.org/a?b=c", "g/runs.csv"]
    assert "<script" not in html and "javascript:" not in html.lower() and not re.search(r"\bonerror\s*=", html)
    assert "&lt;script&gt;" in html  # shown, as text


def test_a_line_break_in_a_grid_s_free_text_is_refused_in_one_line_naming_the_field(tmp_path):
    for path in [("description",), ("claims", 0, "text"), ("claims", 0, "quote"), ("claims", 0, "reading"),
                 ("figures", 0, "title"), ("figures", 0, "paper")]:
        grid_file = tmp_path / "grid.yaml"
        grid_file.write_text(yaml.safe_dump({"grids": [_set(BASE, path, "str", FORGED)]}))
        with pytest.raises(UserError) as refused:
            load_grid_file(grid_file)
        message = str(refused.value)
        assert "\n" not in message and path[-1] in message and "one line" in message, message


def test_a_figure_file_whose_name_is_no_figure_name_is_left_out_of_a_grid_without_figures(results, tmp_path):
    out = _copy(results, tmp_path)
    manifest = json.loads((out / "g" / "manifest.json").read_text())
    manifest["grid"]["figures"] = []  # the report shows every PNG of figures/
    (out / "g" / "manifest.json").write_text(json.dumps(manifest))
    (out / "g" / "figures" / "<img src=x onerror=alert(1)>.png").write_bytes(PNG + b"dropped in")
    verdicts = _report(out)
    assert verdicts is not None
    assert_inert(out, verdicts, _figures(out) - {PNG + b"dropped in"})
    assert "![acc](g/figures/acc.png)" in (out / "report.md").read_text()


def test_an_audit_row_naming_a_grid_outside_the_folder_shows_no_figure_from_there(results, tmp_path):
    out = _copy(results, tmp_path)
    (tmp_path / "outside" / "figures").mkdir(parents=True)
    (tmp_path / "outside" / "figures" / "audit.png").write_bytes(PNG + b"outside")
    for grid in ["../outside", str(tmp_path / "outside")]:
        pd.DataFrame([{**_audit_row(), "grid": grid}]).to_csv(out / "g" / "audit.csv", index=False)
        verdicts = _report(out)
        assert verdicts is not None
        assert "outside/figures" not in (out / "report.md").read_text()
        assert_inert(out, verdicts, _figures(out))
