"""report.html: report.md rendered, its figures embedded, one self-contained file to open in a browser or send."""

from __future__ import annotations

from pathlib import Path

from dpsgd_cli.engine.folder import write_text

HTML_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dpsgd reproduction report</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
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


def write_html(markdown: Path) -> Path:
    """report.html beside report.md: the same report, its figures embedded (base64 PNG), one self-contained file
    that a collaborator opens in any browser (report.md needs the figures/ folders next to it)."""
    import base64
    import re
    from urllib.parse import unquote

    from markdown_it import MarkdownIt  # rich's own dependency

    body = MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown.read_text())

    def embed(match: re.Match) -> str:
        image = markdown.parent / unquote(match.group(1))
        if not image.is_file():
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(image.read_bytes()).decode()}"'

    out = markdown.with_suffix(".html")
    write_text(out, HTML_PAGE.format(body=re.sub(r'src="([^"]+\.png)"', embed, body)))
    return out
