"""report.html: report.md rendered, its figures embedded; inert whatever the folder holds (docs/results.md#reports)."""

from __future__ import annotations

import base64
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

from markdown_it import MarkdownIt  # rich's own dependency
from markdown_it.common.utils import escapeHtml
from markdown_it.renderer import RendererHTML
from markdown_it.rules_inline import StateInline
from markdown_it.token import Token

from dpsgd_cli.engine.folder import write_text

HTML_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dpsgd reproduction report</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<style>
body {{ font: 15px/1.5 system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem; color: #222; }}
table {{ border-collapse: collapse; margin: 1rem 0; }}
th, td {{ border: 1px solid #ccc; padding: .3rem .5rem; vertical-align: top; text-align: left; }}
th {{ background: #f3f3f3; }}
img {{ max-width: 100%; height: auto; }}
</style></head>
<body>
{body}
</body></html>
"""
_SPELLS_MARKUP = re.compile(r"(?i)(on\w+\s*)=|(?:java|vb|live)script\s*:|(?:data|file)\s*:")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LINE_BREAK = "<br>"


def write_html(markdown: Path) -> Path:
    """report.html beside report.md, its figures embedded (report.md needs the figures/ folders next to it)."""
    body = _ReportMarkdown(markdown.parent).render(markdown.read_text(encoding="utf-8"))
    out = markdown.with_suffix(".html")
    write_text(out, HTML_PAGE.format(body=body))
    return out


def _inert(text: str) -> str:
    """Text escaped for HTML, with the `=` or `:` of an event attribute or script scheme as a character reference:
    the page's source does not spell them either (for a mail filter or a scanner)."""
    return _SPELLS_MARKUP.sub(lambda m: m.group(0)[:-1] + ("&#61;" if m.group(1) else "&#58;"), escapeHtml(text))


def _line_break(state: StateInline, silent: bool) -> bool:
    """The `<br>` of a table cell (text from the data has its `<` escaped, so it never reaches here)."""
    if not state.src.startswith(LINE_BREAK, state.pos):
        return False
    if not silent:
        state.push("hardbreak", "br", 0)
    state.pos += len(LINE_BREAK)
    return True


class _InertRenderer(RendererHTML):
    """Every text and attribute through `_inert`; an image only as an embedded figure of the results folder."""

    def text(self, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
        return _inert(tokens[idx].content)

    def code_inline(self, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
        return f"<code>{_inert(tokens[idx].content)}</code>"

    def code_block(self, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
        return f"<pre><code>{_inert(tokens[idx].content)}</code></pre>\n"

    fence = code_block

    @staticmethod
    def renderAttrs(token: Token) -> str:  # noqa: N802 (markdown-it's name)
        return "".join(f' {escapeHtml(key)}="{_inert(str(value))}"' for key, value in token.attrItems())

    def image(self, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
        token = tokens[idx]
        alt = self.renderInlineAsText(token.children or [], options, env)
        figure = _figure(env["root"], str(token.attrGet("src") or ""))
        if figure is None:
            return _inert(alt)
        return f'<img src="data:image/png;base64,{base64.b64encode(figure).decode()}" alt="{_inert(alt)}">'


class _ReportMarkdown(MarkdownIt):
    """CommonMark with tables, no raw HTML, links only to http(s) or inside `root` (the folder of report.md)."""

    def __init__(self, root: Path):
        super().__init__("commonmark", {"html": False}, renderer_cls=_InertRenderer)
        self.enable("table")
        self.inline.ruler.before("autolink", "line_break", _line_break)
        self.root = root

    def render(self, src: str, env: Any = None) -> str:
        return super().render(src, {"root": self.root})

    def validateLink(self, url: str) -> bool:  # noqa: N802 (markdown-it's name)
        parts = urlsplit(url)
        if parts.scheme or parts.netloc:
            return parts.scheme in ("http", "https") and bool(parts.netloc)
        return _inside(self.root, unquote(parts.path)) is not None


def _inside(root: Path, relative: str) -> PurePosixPath | None:
    """`relative` as a path inside `root` (None if it is absolute, climbs out with `..` or is empty)."""
    path = PurePosixPath(relative)
    if path.is_absolute() or not path.parts or ".." in path.parts or "\\" in relative:
        return None
    return path


def _figure(root: Path, src: str) -> bytes | None:
    """The bytes at `src` if it is a PNG the tool drew: `[<grid>/]figures/<name>.png` inside `root`, no link on
    the way, a regular file; else None."""
    parts = urlsplit(src)
    path = None if parts.scheme or parts.netloc else _inside(root, unquote(parts.path))
    if path is None or len(path.parts) not in (2, 3) or path.parts[-2] != "figures" or path.suffix != ".png":
        return None
    file = root.joinpath(*path.parts)
    try:
        if file.resolve() != root.resolve().joinpath(*path.parts):
            return None
        descriptor = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        data = handle.read()
    return data if data.startswith(PNG_SIGNATURE) else None
