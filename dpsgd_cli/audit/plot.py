"""The audit's story in one figure: a row per claim (algorithm, claimed ε), a panel per threat model. On each row:
the claimed ε (a bar: beyond it, refuted), the audit's ε_lo (its verdict's marker), the ceiling of the trials, and
below them each control's ε_lo on its own line (the bound a real bug gives: filled where the audit refuted it);
beside the rows, each claim's verdict with what it would have caught, or why it is uninformative. Every marker has
its own place: nothing hides another at ε_lo = 0."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dpsgd_cli.audit import controls  # noqa: E402
from dpsgd_cli.engine.folder import save_figure  # noqa: E402
from dpsgd_cli.plots import names  # noqa: E402
from dpsgd_cli.plots.layout import MARKERS, finish  # noqa: E402

# the controls as drawn, mildest first (a line each under the claim's own ε_lo)
# (key, legend, tag beside its mark, marker: none of the algorithms' MARKERS)
CONTROLS = [("sigma_t10", "σ for T/10 steps", "T/10", "d"), ("noise_half", "noise × 0.5", "×0.5", "p"),
            ("control", "noise × control (the broken twin)", "twin", "h"), ("no_clip", "no clipping", "no clip", "8")]
ROW = 1.0 + 0.22 * len(CONTROLS)  # a claim's height: its ε_lo, then a line per control
VERDICT_TEXT = 46  # characters per line of the verdicts beside the rows


def audit_figure(frame: pd.DataFrame):
    """The laid-out figure (None when no audit row is ok with both a bound and a claim)."""
    ok = frame[(frame["status"] == "ok") & frame["epsilon_lo"].notna() & frame["epsilon_claimed"].notna()]
    if ok.empty:
        return None
    ok = ok.assign(algorithm_params=ok["algorithm_params"].fillna("{}").astype(str)
                   if "algorithm_params" in ok else "{}")
    threats = sorted(ok["threat_model"].unique())
    claims = ok[["algorithm", "algorithm_params", "epsilon_claimed"]].drop_duplicates().sort_values(
        ["algorithm", "algorithm_params", "epsilon_claimed"]).reset_index(drop=True)
    position = {tuple(c): k * ROW for k, c in enumerate(claims.itertuples(index=False))}
    algorithms = sorted(ok["algorithm"].unique())
    palette = [plt.cm.tab10(i) for i in range(10) if i != 3]  # no red: red is for a refuted claim
    styles = {a: (palette[i % len(palette)], MARKERS[i % len(MARKERS)]) for i, a in enumerate(algorithms)}
    columns = [c for c in ["epsilon_claimed", "epsilon_lo", "ceiling", *(f"{k}_epsilon_lo" for k, *_ in CONTROLS)]
               if c in ok]
    top = float(np.nanmax(ok[columns].to_numpy(dtype=float))) * 1.08
    margin = 0.04 * top
    height = len(claims) * ROW * 0.42 + 0.8
    fig, axes = plt.subplots(1, len(threats), figsize=(3.6 * len(threats) + 3.4, height), squeeze=False, dpi=130,
                             sharey=True)
    for ax, threat in zip(axes[0], threats):
        for key, group in ok[ok["threat_model"] == threat].groupby(["algorithm", "algorithm_params",
                                                                    "epsilon_claimed"]):
            _draw_claim(ax, group.iloc[0], position[key], styles[key[0]], top)
        ax.set(xlim=(-margin, top), ylim=(len(claims) * ROW - 0.5, -0.6), xlabel=r"$\varepsilon$")
        ax.set_title(names.literal(threat), fontsize=10)
        ax.grid(axis="x", color="0.92", lw=0.6)
    axes[0][0].set_yticks(list(position.values()), [_claim_label(c, claims) for c in claims.itertuples(index=False)],
                          fontsize=8)
    axes[0][0].tick_params(axis="y", length=0)
    verdicts = _verdicts(ok)
    for key, y in position.items():
        text = verdicts.get(key)
        if text:
            axes[0][-1].annotate(names.literal(text[1]), (1.03, y), xycoords=("axes fraction", "data"), va="top",
                                 fontsize=7, color=_VERDICT_COLOURS.get(text[0], "0.2"), annotation_clip=False)
    _legend(axes[0][0], ok)
    finish(fig, title="Privacy audit: the claimed ε, the audit's lower bound ε_lo, and what it would have caught",
           legend_size=8)
    fig.subplots_adjust(right=1 - 3.1 / fig.get_size_inches()[0])  # the verdicts' column beside the panels
    return fig


_VERDICT_COLOURS = {"refuted": "tab:red", "consistent": "tab:green", "uninformative": "0.35", "not covered": "0.55"}


def _draw_claim(ax, row: pd.Series, y: float, style, top: float) -> None:
    """One claim on one threat model: the claim, the refutation zone, the ceiling, ε_lo, a line per control."""
    color, marker = style
    claim, lo = float(row["epsilon_claimed"]), float(row["epsilon_lo"])
    span = (y - 0.35, y + ROW - 0.75)
    ax.fill_betweenx(span, claim, top, color="tab:red", alpha=0.06, lw=0)
    ax.plot([claim, claim], span, color="0.25", lw=1.4, zorder=3)
    ceiling = row.get("ceiling")
    if ceiling is not None and ceiling == ceiling:  # no mechanism gives a bound beyond it with these trials
        ax.plot([ceiling, ceiling], span, color="0.3", lw=1, ls=":", zorder=3)
    verdict = row.get("verdict") if isinstance(row.get("verdict"), str) else (
        "refuted" if lo > claim else "")
    if verdict == "refuted":
        ax.scatter([lo], [y], color=color, marker="X", s=110, edgecolor="red", linewidth=1.5, zorder=5)
    elif verdict == "not covered":  # no verdict on the claim: grey, a square whatever the algorithm
        ax.scatter([lo], [y], facecolors="none", edgecolors="0.55", marker="s", s=34, linewidths=1.2, zorder=5,
                   hatch="////")
    elif verdict == "uninformative":
        ax.scatter([lo], [y], facecolors="none", edgecolors=color, marker=marker, s=34, linewidths=1.3, zorder=5)
    else:
        ax.scatter([lo], [y], color=color, marker=marker, s=34, zorder=5)
    for k, (key, _, tag, shape) in enumerate(CONTROLS):
        value = row.get(f"{key}_epsilon_lo")
        if value is None or value != value:
            continue
        yk, value = y + 0.22 * (k + 1), min(float(value), top)
        caught = value > claim
        ax.plot([0, value], [yk, yk], color=color, lw=0.7, alpha=0.45, zorder=2)
        ax.scatter([value], [yk], marker=shape, s=20, zorder=4, linewidths=0.9,
                   facecolors=color if caught else "none", edgecolors=color)
        right = value < 0.8 * top  # the tag beside its mark, inside the panel
        n = row.get(f"{key}_trials")  # its trials, where they are not the row's
        own = f" ({n:,.0f})" if n is not None and n == n and n != row.get("trials") else ""
        ax.annotate(tag + own, (value, yk), xytext=(4 if right else -4, 0), textcoords="offset points", fontsize=5,
                    va="center", ha="left" if right else "right", color="0.35")


def _claim_label(claim, claims: pd.DataFrame) -> str:
    """`DP-SGD, ε = 1` (with its parameters where the algorithm appears with several)."""
    label = names.algorithm(claim.algorithm)
    if claims.loc[claims["algorithm"] == claim.algorithm, "algorithm_params"].nunique() > 1:
        label += " " + names.literal(claim.algorithm_params)
    return f"{label}, ε = {claim.epsilon_claimed:.3g}"


def _verdicts(ok: pd.DataFrame) -> dict[tuple, tuple[str, str]]:
    """Per claim: (verdict, what it says) — consistent: what it would have caught; uninformative: why; refuted."""
    out = {}
    order = ("refuted", "consistent", "uninformative", "not covered")
    for key, group in ok.groupby(["algorithm", "algorithm_params", "epsilon_claimed"]):
        verdicts = group["verdict"] if "verdict" in group else pd.Series(dtype=object)
        found = [v for v in order if (verdicts == v).any()]
        if not found:
            continue
        verdict = found[0]
        chosen = group[verdicts == verdict]
        covered = group[verdicts != "not covered"].to_dict("records")
        if verdict == "consistent":
            caught = [o.label for o in controls.outcomes(covered) if o.caught]
            text = "consistent: would have caught " + ", ".join(caught)
        elif verdict == "refuted":
            best = chosen.loc[chosen["epsilon_lo"].idxmax()]
            text = f"REFUTED: ε_lo = {best['epsilon_lo']:.3g} > ε"
        else:
            reason = chosen.iloc[0].get("reason")
            text = f"{verdict}: {reason}" if isinstance(reason, str) and reason else verdict
        absent = [label for label in controls.LABELS.values()
                  if any(isinstance(n, str) and f"{label}:" in n for n in group.get("controls_not_applicable", []))]
        lines = textwrap.wrap(text, VERDICT_TEXT)[:3] + textwrap.wrap(f"n/a: {', '.join(absent)}", VERDICT_TEXT)[
            :1 if absent else 0]
        out[key] = (verdict, "\n".join(lines))
    return out


def _legend(ax, ok: pd.DataFrame) -> None:
    """Legend entries for the marks (drawn nowhere: the layout gathers them below the panels)."""
    for algo in sorted(ok["algorithm"].unique()):
        ax.scatter([], [], color="0.3", marker=MARKERS[sorted(ok["algorithm"].unique()).index(algo) % len(MARKERS)],
                   s=30, label=names.algorithm(algo))
    ax.plot([], [], color="0.25", lw=1.4, label="claimed ε (right of it, shaded: refuted)")
    if "ceiling" in ok and ok["ceiling"].notna().any():
        ax.plot([], [], color="0.3", lw=1, ls=":", label="ceiling of the trials")
    verdicts = set(ok["verdict"].dropna()) if "verdict" in ok else set()
    if "uninformative" in verdicts:
        ax.scatter([], [], facecolors="none", edgecolors="0.3", marker="o", s=30,
                   label="hollow: uninformative (the reason beside)")
    if "not covered" in verdicts:
        ax.scatter([], [], facecolors="none", edgecolors="0.55", marker="s", s=30, hatch="////",
                   label="grey square: not covered (no verdict on the claim)")
    if "refuted" in verdicts or (ok["epsilon_lo"] > ok["epsilon_claimed"]).any():
        ax.scatter([], [], color="0.3", marker="X", s=80, edgecolor="red", linewidth=1.5, label="REFUTED")
    for key, label, tag, shape in CONTROLS:
        if f"{key}_epsilon_lo" in ok and ok[f"{key}_epsilon_lo"].notna().any():
            ax.scatter([], [], marker=shape, s=20, facecolors="0.3", edgecolors="0.3",
                       label=f"{tag}: ε_lo of {label}")
    if any(f"{key}_epsilon_lo" in ok for key, *_ in CONTROLS):
        ax.scatter([], [], marker="h", s=20, facecolors="none", edgecolors="0.3",
                   label="a control filled: refuted, the audit would have caught it; hollow: missed")


def plot_audit(frame: pd.DataFrame, folder: Path) -> list[Path]:
    fig = audit_figure(frame)
    if fig is None:
        return []
    paths = [save_figure(fig, folder / name, dpi=130) for name in ("audit.png", "audit.pdf")]
    plt.close(fig)
    return paths
