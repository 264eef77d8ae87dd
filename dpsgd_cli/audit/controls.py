"""The audit's positive controls: mutations of a cell's own mechanism, each a bug people really make, whose true ε
the cell's accountant gives (docs/audit.md#the-ladder-of-controls).

- the broken twin, its noise × `control` (0.1: a breach of 10–25× in ε, what makes a verdict `consistent`);
- `noise_half`: its noise × 0.5;
- `sigma_t10`: σ calibrated for a tenth of its steps, run for all of them;
- `no_clip`: its per-example clipping dropped (true ε ∞: one record moves the update without bound).

Each is the cell's algorithm with its prepared chain changed (the Noise ops' σ scaled, through the algorithm's own
noise-scale hook, so that its accountant computes the true ε; the Clip op removed), so a control trains wherever
and however the cell trains. A control applies where the cell has what it mutates; elsewhere it is recorded with
the reason it does not apply."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpsgd_cli.algorithms.base import Algorithm, Prepared, Setting
from dpsgd_cli.algorithms.ops import Clip, MaskedNoise, Noise
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.config import Cell
from dpsgd_cli.data import Dataset
from dpsgd_cli.engine.runner import setting_of
from dpsgd_cli.models import Model, make_model

# The canaries' raw gradient norm, in units of the clip norm: a sound mechanism clips it to C (nothing changes),
# one that does not clip lets it through this many times larger, as if its noise were divided by as much.
CLIP_PROBE = 10.0
# the ladder beside the twin, mildest breach first for a typical DP-SGD cell (true ε 1.6, 4.5, ∞ at a claim of 1)
LADDER = ("sigma_t10", "noise_half", "no_clip")
LABELS = {"sigma_t10": "σ for T/10 steps", "noise_half": "noise × 0.5", "no_clip": "no clipping"}


@dataclass(frozen=True)
class Control:
    """One control of a cell: `key` prefixes its audit.csv columns (`<key>_epsilon`, `<key>_epsilon_lo`,
    `<key>_row_confidence`); `algorithm` is None where it does not apply (`why_not` says why)."""

    key: str
    label: str
    algorithm: Algorithm | None
    why_not: str = ""

    def epsilon(self, derived: dict[str, Any]) -> float | None:
        """The true ε of the mechanism the control ran, from what its run derived (the accountant at the σ it
        added, through the noise-scale hook), or ∞ without clipping."""
        if self.key == "no_clip":
            return float("inf")
        value = derived.get("epsilon_noise_scaled")
        return None if value is None else float(value)


def ladder(cell: Cell, data: Dataset, algorithm: Algorithm, twin: float | None,
           keys: Sequence[str] = LADDER) -> list[Control]:
    """The cell's controls: the twin (noise × `twin`; none when `twin` is None, and then no ladder either: a grid's
    `audit.control: null` turns the controls off), then the ladder's `keys`."""
    if twin is None:
        return []
    scalable = algorithm.tags.noise_scalable
    no_hook = f"{algorithm.name} has no noise-scale hook"
    controls = [Control("control", f"noise × {twin:g}", algorithm.with_noise_scale(twin) if scalable else None,
                        "" if scalable else no_hook)]
    for key in keys:
        label = LABELS[key]
        if key == "noise_half":
            controls.append(Control(key, label, algorithm.with_noise_scale(0.5) if scalable else None,
                                    "" if scalable else no_hook))
        elif key == "sigma_t10":
            factor, why_not = short_calibration(cell, data, algorithm)
            controls.append(Control(key, label, None if factor is None else algorithm.with_noise_scale(factor),
                                    why_not))
        else:
            refused = clipping_bounds_the_claim(cell, data, algorithm)
            controls.append(Control(key, label, None if refused else unclipped(algorithm), refused or ""))
    return controls


def short_calibration(cell: Cell, data: Dataset, algorithm: Algorithm) -> tuple[float | None, str]:
    """(σ calibrated for T/10 steps over the cell's σ, "") — the factor its noise-scale hook applies, so its own
    accountant gives the true ε at T steps — or (None, why it does not apply)."""
    if not algorithm.tags.noise_scalable:
        return None, f"{algorithm.name} has no noise-scale hook"
    setting, model = _probe_setting(cell, data)
    full = _prepare(algorithm, setting, model, data.X_train, data.y_train)
    std = _noise_std(full)
    if full is None or std is None:
        return None, f"{algorithm.name} adds no noise at each step (no Noise op in a gradient chain)"
    try:  # a tenth of the epochs may be no setting the algorithm runs (noisy_gd: K = round(epochs) ≥ 1)
        short = _prepare(algorithm, dataclasses.replace(setting, epochs=setting.required.epochs / 10), model,
                         data.X_train, data.y_train)
    except Exception as exc:
        return None, f"{algorithm.name} does not run for a tenth of its epochs ({exc})"
    short_std = _noise_std(short)
    if short is None or short_std is None or short.steps >= full.steps:
        return None, f"T = {full.steps}: a tenth of the steps is not fewer"
    if short_std >= std:
        return None, (f"the noise {algorithm.name} calibrates for {short.steps} of its {full.steps} steps is its "
                      "noise (its σ does not depend on the steps here)")
    return short_std / std, ""


def clipping_bounds_the_claim(cell: Cell, data: Dataset, algorithm: Algorithm) -> str | None:
    """None when the cell's claim rests on its per-example Clip op (dropping it is a bug of unbounded ε, and a
    canary whose raw gradient is larger than C tests it); else why the no-clipping control does not apply. The
    test: the cell trains by one chain with a Clip op, and its guarantee is the same with a record far outside
    the unit ball (a claim that assumes ‖x‖ ≤ 1 holds its clip at the Lipschitz bound, no part of its argument)."""
    if type(algorithm).fit is not Algorithm.fit:
        return f"{algorithm.name} does not train by one gradient chain"
    setting, model = _probe_setting(cell, data)
    X, y = data.X_train, data.y_train
    prepared = _prepare(algorithm, setting, model, X, y)
    if prepared is None:
        return f"{algorithm.name} does not train by one gradient chain"
    clips = [op for op in prepared.chain.ops if isinstance(op, Clip)]
    if not clips:
        return f"{algorithm.name} does not clip per-example gradients"
    if any(type(op) is not Clip for op in clips):
        return f"{algorithm.name} clips adaptively (one op clips and adds noise)"
    far = np.zeros((1, X.shape[1]), dtype=X.dtype)
    far[0, 0] = CLIP_PROBE * max(op.norm for op in clips)
    try:
        outside = _prepare(algorithm, setting, model, np.vstack([X, far]), np.append(y, 1.0))
    except Exception as exc:  # refused: the claim holds for records in its domain only
        return f"{algorithm.name} refuses a record outside the unit ball ({exc})"
    inside_guarantee, outside_guarantee = (p.finish(p.theta).guarantee for p in (prepared, outside) if p is not None)
    if outside_guarantee != inside_guarantee:
        return (f"{algorithm.name}'s claim assumes records in the unit ball (with one outside: "
                f"{outside_guarantee!r}); its clip is not what bounds a record's influence")
    return None


class _Unclipped(Algorithm):
    """Mixed into the cell's algorithm class: its chain as prepared, without its Clip op."""

    def prepare(self, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray,
                streams: ReplicaStreams) -> Prepared | None:
        prepared = super().prepare(setting, model, X, y, streams)
        if prepared is None:
            return None
        ops = [op for op in prepared.chain.ops if not isinstance(op, Clip)]
        return dataclasses.replace(prepared, chain=dataclasses.replace(prepared.chain, ops=ops))


def unclipped(algorithm: Algorithm) -> Algorithm:
    """A copy of `algorithm` whose chain has no per-example clipping (every other op, its calibration and its
    claimed ε unchanged)."""
    cls: type[_Unclipped] = type(f"Unclipped{type(algorithm).__name__}", (_Unclipped, type(algorithm)), {})
    mutant = cls.__new__(cls)
    mutant.__dict__.update(algorithm.__dict__)
    return mutant


def _probe_setting(cell: Cell, data: Dataset) -> tuple[Setting, Model]:
    return setting_of(cell, data), make_model(cell.model.name, data.d, cell.l2, cell.model.options)


def _prepare(algorithm: Algorithm, setting: Setting, model: Model, X: np.ndarray, y: np.ndarray) -> Prepared | None:
    return algorithm.prepare(setting, model, X, y, ReplicaStreams(range(1)))


def _noise_std(prepared: Prepared | None) -> float | None:
    """The std of the noise the chain adds at a step (the Noise ops' together); None without one."""
    if prepared is None:
        return None
    stds = [op.std for op in prepared.chain.ops if isinstance(op, (Noise, MaskedNoise))]
    return float(np.hypot.reduce(stds)) if stds and any(stds) else None


KEYS = ("control", *LADDER)  # the twin's columns are control_epsilon, control_epsilon_lo, ...


@dataclass(frozen=True)
class Outcome:
    """A broken control (true ε above the claim) on an audit's rows: its best bound over them, and whether that
    refutes it."""

    label: str
    epsilon: float
    epsilon_lo: float | None
    caught: bool
    trials: int | None = None  # its trials per world, where they are not its rows'

    def __str__(self) -> str:
        lo = "?" if self.epsilon_lo is None else f"{self.epsilon_lo:.3g}"
        own = "" if self.trials is None else f", {self.trials:,} trials"
        return f"{self.label} (ε = {'∞' if np.isinf(self.epsilon) else f'{self.epsilon:.3g}'}, ε_lo = {lo}{own})"


def outcomes(rows: list[dict[str, Any]]) -> list[Outcome]:
    """The controls that ran on `rows` (one row, or a cell's covered rows: one claim) and are broken, mildest first
    (the smallest true ε; the ladder's order among equals), each with its largest ε_lo over the rows. A control as
    mild as the claim (true ε ≤ ε) is no test of the audit and is left out."""
    found = []
    for key in KEYS:
        broken = [r for r in rows if _value(r, f"{key}_epsilon") is not None
                  and _value(r, f"{key}_epsilon") > r["epsilon_claimed"]]
        if not broken:
            continue
        los = [(lo, r) for r in broken if (lo := _value(r, f"{key}_epsilon_lo")) is not None]
        best, row = max(los, key=lambda pair: pair[0]) if los else (None, broken[0])
        factor = _value(broken[0], "control")
        label = LABELS[key] if key != "control" else "the broken twin" if factor is None else f"noise × {factor:g}"
        trials = _value(row, f"{key}_trials")
        own = int(trials) if trials is not None and trials != _value(row, "trials") else None
        found.append(Outcome(label, float(broken[0][f"{key}_epsilon"]), best,
                             best is not None and best > broken[0]["epsilon_claimed"], own))
    return sorted(found, key=lambda o: o.epsilon)


def caught_and_missed(rows: list[dict[str, Any]]) -> str:
    """`would have caught: …; missed: …` (the controls refuted on `rows`, and those not); "" without controls."""
    found = outcomes(rows)
    if not found:
        return ""
    caught, missed = [o for o in found if o.caught], [o for o in found if not o.caught]
    return ("would have caught: " + (", ".join(map(str, caught)) or "none")
            + (f"; missed: {', '.join(map(str, missed))}" if missed else ""))


def _value(row: dict[str, Any], column: str) -> float | None:
    """A number of the row (None where it is missing: absent, None or NaN, as pandas reads an empty cell)."""
    value = row.get(column)
    return None if value is None or value != value or isinstance(value, str) else float(value)
