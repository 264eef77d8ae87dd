"""What figures call things: readable names of parameters and result columns, in one place (an algorithm's is
its `tags.display_name`).

Text is of two kinds. The project's own (axis labels, legend names, tick labels) is written with mathtext
(`$\\varepsilon$`, `$\\eta = 1/\\sqrt{t}$`) and rendered as math. Text that comes from the user — grid names,
dataset names and file ids, figure titles, selection names, free parameter values — goes through `literal`,
which escapes `$`, so that it prints as written (and an unbalanced `$` cannot make savefig raise).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable
from typing import Any

from dpsgd_cli.algorithms import ALGORITHMS
from dpsgd_cli.engine.results import option_text
from dpsgd_cli.privacy import ACCOUNTANT_LABELS

# a parameter's name in a legend or title (None: the value alone says it) and the names of its values
PARAMETERS: dict[str, tuple[str | None, dict[str, str]]] = {
    "schedule": (None, {"inv_sqrt": r"$\eta = 1/\sqrt{t}$", "inv_t": r"$\eta = 1/(\lambda t)$",
                        "constant": r"constant $\eta$", "convex": "convex schedule",
                        "strongly_convex": "strongly convex schedule", "auto": "automatic schedule"}),
    "accountant": ("accountant", {"dynamics": "privacy dynamics", "composition": "composition",
                                  "minimum": "min(dynamics, composition)", **ACCOUNTANT_LABELS,
                                  "auto": "automatic"}),
    "accounting": ("accounting", {"closed_form": "closed form", "advanced_composition": "advanced composition",
                                  **ACCOUNTANT_LABELS}),
    "composition": ("composition", {"basic": "basic", "advanced": "advanced"}),
    "amplification": ("amplification", {"tight": "tight", "approx": "approximate"}),
    "formula": ("formula", {"paper": "the paper's", "lecture": "the lecture's"}),
    "rule": ("rule", {"coordinate": "per coordinate", "l2_radius": r"$\ell_2$ radius"}),
    "sampling": ("sampling", {"single": "single example", "poisson": "Poisson"}),
    "influence": ("influence", {"full": "all layers", "output_layer": "output layer", "auto": "automatic"}),
    "radius": (r"$r$", {}),
    "zeta": (r"$\zeta$", {}),
    "epsilon": (r"$\varepsilon$", {}),
    "delta": (r"$\delta$", {}),
    "batch_size": (r"$b$", {}),
    "lr": (r"$\eta_0$", {}),
    "epochs": ("epochs", {}),
    "l2": (r"$\lambda$", {}),
    "clip_norm": (r"$C$", {}),
    "clip_quantile": ("clip quantile", {"None": "fixed clip"}),
    "beta1": (r"$\beta_1$", {}),
    "beta2": (r"$\beta_2$", {}),
    "n_train": (r"$n$", {}),
    "d": (r"$p$", {}),
}

COLUMNS = {  # axis labels of result columns
    "epsilon": r"privacy budget $\varepsilon$",
    "batch_size": r"batch size $b$",
    "examples": "examples processed",
    "lr": r"learning rate $\eta_0$",
    "epochs": "epochs",
    "l2": r"regularisation $\lambda$",
    "radius": r"radius $r$",
    "n_train": r"training records $n$",
    "d": r"dimension $p$",
    "test_accuracy": "test accuracy",
    "train_accuracy": "train accuracy",
    "val_accuracy": "validation accuracy",
    "optimality_gap": r"optimality gap $F(\theta) - L^*$",
    "test_loss": "test loss (mean logistic loss)",
    "train_objective": r"train objective $F(\theta)$",
    "noiseless_fraction": "fraction of noiseless steps",
    "delta_certified": r"certified $\delta$",
    "sigma": r"noise $\sigma$",
}


def literal(text: Any) -> str:
    """User text as it is written: `$` escaped so that matplotlib does not read it as mathtext."""
    return str(text).replace("$", r"\$")


def number(value: Any) -> str:
    """A number for a title or a tick: `0.01`, `1000`, and `$10^{8}$` / `$3\\times10^{9}$` beyond 6 digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return literal(value)
    if value == int(value) and abs(value) < 1e6:
        return f"{int(value)}"
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-4):
        exponent = math.floor(math.log10(abs(value)))
        mantissa = value / 10 ** exponent
        if abs(mantissa - round(mantissa)) < 1e-9:
            mantissa = round(mantissa)
            return f"$10^{{{exponent}}}$" if mantissa == 1 else f"${mantissa}\\times10^{{{exponent}}}$"
        return f"${mantissa:.3g}\\times10^{{{exponent}}}$"
    return f"{value:g}"


def algorithm(name: Any) -> str:
    """An algorithm's legend name (its `tags.display_name`); a name no algorithm is registered under, as written."""
    cls = ALGORITHMS.get(str(name))
    return cls.tags.display_name if cls else literal(name)


def non_private(name: Any) -> bool:
    """Whether `name` is a registered non-private algorithm: its lines are references without saying so."""
    cls = ALGORITHMS.get(str(name))
    return cls is not None and not cls.tags.private


def column(name: str) -> str:
    """An axis label for a result column."""
    return COLUMNS.get(name, literal(name))


def parameter(name: str, value: Any) -> str:
    """`η = 1/√t`, `accountant: RDP`, `λ = 0.01`: one parameter's value, named."""
    label, values = PARAMETERS.get(name, (literal(name), {}))
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value) if value not in ("None", "nan") else value
    if value == option_text(None):  # a line label's spelling of an unset parameter
        value = "None"
    shown = values.get(str(value)) if isinstance(value, str) else None
    if shown is not None:
        return shown if label is None else f"{label}: {shown}"
    text = number(value) if isinstance(value, (int, float)) else literal(value)
    if label is None:
        return f"{literal(name)} = {text}"
    return f"{label}: {text}" if not label.startswith("$") else f"{label} = {text}"


_PARAM = re.compile(r" ([A-Za-z_][A-Za-z0-9_]*)=")


def label(text: Any, drop: Iterable[str] = ()) -> str:
    """A line label of the results (`song2013 schedule=inv_t`, `dp_sgd lr=0.1 [for tag]`) in readable names
    (`private SGD (Song et al.), η = 1/(λt)`); one label string gives one name, so lines stay apart as before,
    except for the parameters in `drop` (those the panels or the x axis show)."""
    text = str(text)
    tag = ""
    if text.endswith("]") and " [for " in text:
        text, tag = text.split(" [for ", 1)
        tag = f" [tuning for {literal(tag[:-1])}]"
    parts = _PARAM.split(text)
    head, pairs = parts[0], [(k, v.strip()) for k, v in zip(parts[1::2], parts[2::2])]
    name = algorithm(head.strip())
    return ", ".join([name, *(parameter(k, v) for k, v in pairs if k not in drop and _acts(head.strip(), k, pairs))]) \
        + tag


def _acts(algorithm_name: str, key: str, pairs: list[tuple[str, str]]) -> bool:
    """Whether a parameter of the label acts on its line (see `Algorithm.acts_when`): not when the parameter it
    depends on is shown with another value."""
    cls = ALGORITHMS.get(algorithm_name)
    other, value = cls.acts_when.get(key, (None, None)) if cls else (None, None)
    return other is None or dict(pairs).get(other, value) == value


def line_name(columns: list[str], values: tuple, drop: Iterable[str] = ()) -> str:
    """The legend name of a line keyed by `columns` (a figure's `lines`) with these values."""
    names = []
    for col, value in zip(columns, values):
        if col == "label":
            names.append(label(value, drop))
        elif col == "algorithm":
            names.append(algorithm(value))
        elif col in ("selection", "dataset", "model", "grid"):
            names.append(literal(value))
        else:
            names.append(parameter(col, value))
    return ", ".join(names)
