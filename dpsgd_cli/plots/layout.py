"""Layout shared by every figure: one legend below the panels, a title and a caption that fit the canvas (each
part measured as rendered), a distinct style per line, tick labels that do not overlap."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import matplotlib
import matplotlib.ticker

from dpsgd_cli.plots.names import literal

COLORS = list(matplotlib.color_sequences["tab10"])
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*"]
LINESTYLES = ["-", "--", "-.", ":"]
REFERENCE_STYLES = [("black", "--"), ("dimgray", ":"), ("gray", "-."), ("darkgray", (0, (5, 2, 1, 2)))]
Style = dict[str, Any]  # a line's matplotlib keyword arguments
PAD = 0.08  # inches between the parts and around the edge
SLACK = 0.95  # text is measured at the figure's dpi; at a lower one (a thumbnail) it is relatively wider


class Styles:
    """A style per line name, the same in every panel: colour, marker and dash all differ between consecutive
    lines, so that lines with the same data stay visible, one through the other (markers are hollow)."""

    def __init__(self, names: Iterable[str], references: Iterable[str] = ()):
        self.lines: dict[str, Style] = {
            name: {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)],
                   "ls": LINESTYLES[i % len(LINESTYLES)], "mfc": "none", "mew": 1.2}
            for i, name in enumerate(dict.fromkeys(names))}
        self.references: dict[str, Style] = {
            name: dict(zip(("color", "ls"), REFERENCE_STYLES[i % len(REFERENCE_STYLES)]))
            for i, name in enumerate(dict.fromkeys(references))}


def wrap_phrases(fig, phrases: list[str], width: float, fontsize: float, sep: str = "; ") -> str:
    """The phrases joined with `sep` into lines no wider than `width` inches as rendered, broken between phrases."""
    renderer = fig.canvas.get_renderer()
    probe = fig.text(0, 0, "", fontsize=fontsize)

    def fits(text: str) -> bool:
        probe.set_text(text)
        return probe.get_window_extent(renderer).width / fig.dpi <= width * SLACK

    lines: list[str] = []
    for phrase in phrases:
        if lines and fits(lines[-1] + sep + phrase):
            lines[-1] += sep + phrase
        elif fits(phrase):
            lines.append(phrase)
        else:
            line = ""
            for word in phrase.split(" "):
                if not line or fits(f"{line} {word}"):
                    line = f"{line} {word}" if line else word
                else:
                    lines.append(line)
                    line = word
            lines.append(line)
    probe.remove()
    return "\n".join(lines)


def finish(fig, title: str = "", caption: list[str] | tuple = (), legend: bool = True, caption_size: float = 8,
           legend_size: float = 8, title_literal: bool = True) -> None:
    """Lay the figure out: `title` (user text: printed literally) above the panels, one legend of every
    distinct line below them, then the caption phrases; the figure grows by the height they need."""
    fig.canvas.draw()
    _relabel_repeats(fig)  # before the layout: the labels it writes take their own width
    axes = [ax for ax in fig.axes if ax.get_visible()]
    width, panels = fig.get_size_inches()
    renderer = fig.canvas.get_renderer()
    handles: dict[str, object] = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()

    def height(artist) -> float:
        return artist.get_window_extent(renderer).height / fig.dpi if artist is not None else 0.0

    top = None
    if title:
        text = title if not title_literal else literal(title)
        phrases = re.split(r"(?<=[,;:]) (?![^()]*\))|(?<= —) ", text)  # wrapped between phrases, not inside one
        top = fig.text(0.5, 1, wrap_phrases(fig, phrases, width - 2 * PAD, 12, sep=" "), fontsize=12,
                       ha="center", va="top")  # not suptitle: tight_layout would make room for it twice
    box = None
    if legend and handles:
        shared = shared_phrase(list(handles))
        labels = [name[len(shared):] if shared and name.startswith(shared) else name for name in handles]
        for ncol in range(min(len(handles), 4), 0, -1):
            if box is not None:
                box.remove()
            box = fig.legend(list(handles.values()), labels, loc="lower center", ncol=ncol, fontsize=legend_size,
                             frameon=False, handlelength=2.6, columnspacing=1.5,
                             title=shared.rstrip(",: ") or None, title_fontsize=legend_size)
            if box.get_window_extent(renderer).width / fig.dpi <= (width - 2 * PAD) * SLACK:
                break
    note = None
    if caption:
        note = fig.text(PAD / width, 0, wrap_phrases(fig, list(caption), width - 2 * PAD, caption_size),
                        fontsize=caption_size, ha="left", va="bottom")
    h_title, h_legend, h_caption = height(top), height(box), height(note)
    total = panels + sum(h + PAD for h in (h_title, h_legend, h_caption) if h) + PAD
    fig.set_size_inches(width, total)
    y = PAD
    if note is not None:
        note.set_y(y / total)
        y += h_caption + PAD
    if box is not None:
        box.set_bbox_to_anchor((0.5, y / total), transform=fig.transFigure)
        y += h_legend + PAD
    upper = 1 - (h_title + 2 * PAD) / total if top is not None else 1
    if top is not None:
        top.set_y(1 - PAD / total)
    fig.tight_layout(rect=(0, y / total, 1, upper), pad=0.6)
    plain_log_ticks(fig)
    thin_ticks(fig)


def plain_log_ticks(fig) -> None:
    """A log axis over less than two decades (between 10⁻³ and 10⁶) labelled by plain numbers at round values
    (0.2, 0.5, 1, 2, 4), not by powers of ten at matplotlib's minor ticks (2.17×10⁻¹)."""
    for ax in fig.axes:
        for axis, lims in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(lims)
            if axis.get_scale() != "log" or lo < 1e-3 or hi > 1e6 or hi / lo >= 100:
                continue
            if _is_fixed(axis):  # the swept values themselves (a log x over ≤ 12 values): already plain
                continue
            for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 7), tuple(range(1, 10))):
                values = [m * 10.0**k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                          for m in mantissas if lo <= m * 10.0**k <= hi]
                if len(values) >= 3:
                    break
            axis.set_ticks(values, [f"{v:.6g}" for v in values])
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            (ax.set_xlim if axis is ax.xaxis else ax.set_ylim)(*lims)


def _is_fixed(axis) -> bool:
    return isinstance(axis.get_major_locator(), matplotlib.ticker.FixedLocator)


def caption_text(phrases: list[str] | tuple) -> str:
    """A caption's phrases as one paragraph (for a LaTeX caption: its math is already LaTeX)."""
    return "; ".join(phrases) + ".\n" if phrases else ""


def shared_phrase(names: list[str]) -> str:
    """The leading phrase (through a ', ' or ': ') that three or more legend entries, and at least all but two (a
    reference line or two, e.g. ERM, may differ), start with: said once as the legend's title ('' when none)."""
    best = ""
    for first in names:
        for cut in (m for m in range(len(first)) if first.startswith((", ", ": "), m)):
            prefix = first[:cut + 2]
            sharing = sum(name.startswith(prefix) and len(name) > len(prefix) for name in names)
            if sharing >= max(3, len(names) - 2) and len(prefix) > len(best):
                best = prefix
    return best


def distinct_labels(locs: list[float]) -> list[str]:
    """Labels for tick positions with the fewest significant digits that tell them apart."""
    def fmt(v: float, digits: int) -> str:
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.{digits}g}"
        exponent = math.floor(math.log10(abs(v)))
        return f"${v / 10**exponent:.{digits}g}\\times10^{{{exponent}}}$"
    for digits in range(2, 10):
        labels = [fmt(v, digits) for v in locs]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def _relabel_repeats(fig) -> None:
    """Where one label text stands at several tick positions of an axis, label its visible ticks apart; a log axis
    spanning less than its labels can show (a rise of 1e-10 across the panel) is widened to a decade instead."""
    for ax in fig.axes:
        for axis, lims in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(lims)
            if axis.get_scale() == "log" and lo > 0 and hi / lo < 1.001:
                middle = math.sqrt(lo * hi)
                (ax.set_xlim if axis is ax.xaxis else ax.set_ylim)(middle / 10**0.5, middle * 10**0.5)
                continue
            ticks = [(t.get_loc(), t.label1.get_text()) for t in [*axis.get_major_ticks(), *axis.get_minor_ticks()]
                     if t.label1.get_visible() and t.label1.get_text() and lo <= t.get_loc() <= hi]
            texts = [text for _, text in ticks]
            if len(set(texts)) == len(texts):
                continue
            locs = sorted({loc for loc, _ in ticks})
            axis.set_ticks(locs, distinct_labels(locs))
            axis.set_ticks([], minor=True)
            (ax.set_xlim if axis is ax.xaxis else ax.set_ylim)(*lims)


def thin_ticks(fig) -> None:
    """Drop tick labels that would overlap a neighbour on their axis (majors kept first); the ticks become fixed."""
    fig.canvas.draw()
    _relabel_repeats(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for axis, horizontal in ((ax.xaxis, True), (ax.yaxis, False)):
            lo, hi = sorted(ax.get_xlim() if horizontal else ax.get_ylim())
            ticks: dict[bool, list[tuple]] = {}  # minor → (location, text, box) of each visible label
            for minor in (False, True):
                for tick in axis.get_minor_ticks() if minor else axis.get_major_ticks():
                    loc, label = tick.get_loc(), tick.label1
                    if label.get_visible() and label.get_text() and lo <= loc <= hi:
                        box = label.get_window_extent(renderer)
                        ticks.setdefault(minor, []).append((loc, label.get_text(), box))
            kept: list = []
            changed = False
            for minor in (False, True):
                for loc, text, box in sorted(ticks.get(minor, []), key=lambda t: t[0]):
                    if any(_overlap(box, other, horizontal) for _, _, other, _ in kept):
                        changed = True
                        continue
                    kept.append((loc, text, box, minor))
            if not changed:
                continue
            for minor in (False, True):
                locs = [t.get_loc() for t in (axis.get_minor_ticks() if minor else axis.get_major_ticks())
                        if lo <= t.get_loc() <= hi]
                shown = {loc: text for loc, text, _, m in kept if m == minor}
                axis.set_ticks(locs, [shown.get(loc, "") for loc in locs], minor=minor)
            (ax.set_xlim if horizontal else ax.set_ylim)(*(ax.get_xlim() if horizontal else ax.get_ylim()))


def _overlap(a, b, horizontal: bool, pad: float = 3.0) -> bool:
    if horizontal:
        return a.x0 < b.x1 + pad and b.x0 < a.x1 + pad
    return a.y0 < b.y1 + pad and b.y0 < a.y1 + pad

