"""report.html opened in a real browser (headless Chromium, tests/browser.py): the page renders (a screenshot that
is not blank), every embedded figure decodes, nothing is written to the console and nothing is requested but the
page itself and its embedded images. Skipped with the reason where no Chromium is installed (.ci/run installs
Debian's `chromium` when it can)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from browser import PageVisit, find_chromium, open_page

from dpsgd_cli import api

pytestmark = pytest.mark.skipif(find_chromium() is None, reason="no Chromium installed (apt install chromium)")

GRID = {
    "name": "tiny",
    "datasets": [{"name": "synthetic", "n": 300}],
    "models": [{"name": "logreg"}],
    "algorithms": [{"name": "sgd"}, {"name": "dp_sgd"}],
    "epsilon": [1.0, 4.0],
    "batch_size": [32],
    "lr": [0.5],
    "epochs": 1,
    "seeds": 2,
    "figures": [{"name": "acc", "title": "accuracy over ε", "lines": ["algorithm"]}],
    "claims": [{"id": "grows", "text": "accuracy grows with ε", "own": True, "check": "monotone",
                "a": {"algorithm": "dp_sgd"}, "tolerance": 0.5}],
}
PROBES = {
    "images": "[...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight])",
    "text": "document.body.innerText.length",
}


def check_visit(visit: PageVisit, page: Path, figures: int) -> list[str]:
    """What is wrong with a visit of `page` that embeds `figures` images (empty: nothing)."""
    problems = [f"console: {line}" for line in visit.console]
    problems += [f"request: {url[:80]}" for url in visit.requests
                 if url != page.resolve().as_uri() and not url.startswith("data:image/png;base64,")]
    images = visit.values["images"] or []
    if len(images) != figures:
        problems.append(f"{len(images)} images on the page, {figures} figures in the report")
    problems += [f"image {k} not decoded" for k, (done, width, height) in enumerate(images)
                 if not (done and width > 0 and height > 0)]
    pixels = matplotlib.image.imread(io.BytesIO(visit.screenshot), format="png")
    if pixels.shape[0] < 200 or float(np.std(pixels[..., :3])) < 0.02:
        problems.append(f"blank screenshot ({pixels.shape}, std {float(np.std(pixels[..., :3])):.3g})")
    return problems


@pytest.fixture(scope="module")
def report_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("browser") / "results"
    api.run(GRID, out=out, quiet=True)
    api.plot(out)
    html = api.report(out).attrs["path"].with_suffix(".html")
    figures = len(re.findall(r"!\[", html.with_suffix(".md").read_text(encoding="utf-8")))
    assert figures >= 1
    return html, figures


def test_report_renders_in_a_browser(report_page: tuple[Path, int]) -> None:
    page, figures = report_page
    visit = open_page(page, PROBES)
    assert check_visit(visit, page, figures) == []
    assert visit.values["text"] > 200


def test_the_browser_check_sees_a_broken_figure_and_a_request(report_page: tuple[Path, int],
                                                               tmp_path: Path) -> None:
    """The same checks on a page with one figure's bytes corrupted and an outside image added: both found (the
    outside image is refused by the page's Content-Security-Policy, which the console reports)."""
    page, figures = report_page
    html = page.read_text(encoding="utf-8")
    start = html.index("data:image/png;base64,") + len("data:image/png;base64,")
    broken = html[:start] + "AAAA" + html[start + 4:]
    broken = broken.replace("</body>", '<img src="http://127.0.0.1:9/outside.png"></body>')
    bad = tmp_path / "report.html"
    bad.write_text(broken, encoding="utf-8")
    problems = check_visit(open_page(bad, PROBES), bad, figures)
    assert any(p.startswith("image 0 not decoded") for p in problems), problems
    assert any(p.startswith("console:") for p in problems), problems
    assert any("images on the page" in p for p in problems), problems
