"""Grid files: YAML → validated grids → run cells (a cell is one resolved spec; its seeds train together). This
module only parses and expands; it never loads data or trains."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import re
import stat
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from dpsgd_cli.algorithms import ALGORITHMS, AXES
from dpsgd_cli.analytic_params import EPSILON_RANGE, NoiseScaleParams, PrivacyCurveParams
from dpsgd_cli.data.files import FileDatasetSpec
from dpsgd_cli.data.spec import DatasetSpec
from dpsgd_cli.errors import UserError, printable
from dpsgd_cli.models import MODELS
from dpsgd_cli.plugins import HOW_TO_LOAD, from_entry_point
from dpsgd_cli.privacy.accounting import Neighbours
from dpsgd_cli.privacy.tuning import Trials

DELTA_RULE: Literal["1/n^2"] = "1/n^2"
Number = int | float


def _dataset_kind(value: Any) -> str:
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    return "file" if name == "file" else "builtin"


# a grid's dataset: a built-in one (`kddcup99`, `{name: adult, ...}`) or a local file (`{name: file, path: ...}`)
AnyDatasetSpec = typing.Annotated[
    typing.Annotated[DatasetSpec, Tag("builtin")] | typing.Annotated[FileDatasetSpec, Tag("file")],
    Discriminator(_dataset_kind),
]
_DATASET_KINDS = {"builtin": DatasetSpec, "file": FileDatasetSpec}


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


AsList = BeforeValidator(_as_list)  # a list key also takes one value


# names other libraries use for a key, too unlike ours for difflib to find
_SYNONYMS = {"learning_rate": "lr", "step_size": "lr", "eta": "lr", "eps": "epsilon", "lambda": "l2",
             "weight_decay": "l2", "batch": "batch_size", "clip": "clip_norm", "max_grad_norm": "clip_norm",
             "epoch": "epochs", "seed": "seeds", "noise_multiplier": "sigma"}


def closest(word: str, candidates: typing.Iterable[str]) -> str:
    candidates = list(candidates)
    if _SYNONYMS.get(word) in candidates:
        return f" (did you mean '{_SYNONYMS[word]}'?)"
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _entry(raw: Any, what: str) -> dict[str, Any]:
    """A grid's entry given by its name (`dp_sgd`) or as a mapping with `name`, as a new dict; else a ValueError."""
    if isinstance(raw, str):
        return {"name": raw}
    if not isinstance(raw, dict):
        raise ValueError(f"an entry of {what}s is a name or a mapping with `name: ...`, not {type(raw).__name__} "
                         f"{raw!r}")
    return dict(raw)


class ModelEntry(_Strict):
    """A model of the grid: `logreg`, or `{name: mlp, ...}` with the model's own options."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split(cls, raw: Any) -> Any:
        raw = _entry(raw, "model")
        if set(raw) == {"name", "options"} and isinstance(raw["options"], dict):  # as dumped in a manifest
            raw = {"name": raw["name"], **raw["options"]}
        name = raw.pop("name", None)
        if not isinstance(name, str) or name not in MODELS:
            raise ValueError(f"unknown model {name!r}{closest(str(name), MODELS)}; known: {', '.join(MODELS)}")
        return {"name": name, "options": MODELS[name].Options.model_validate(raw, strict=True).model_dump()}


class AlgorithmEntry(_Strict):
    """An algorithm of the grid: `dp_sgd`, or `{name: dp_sgd, accountant: pld, lr: [0.1]}`; keys named like a grid
    axis override that axis for this algorithm, the others are its parameters."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    overrides: dict[str, list[Any]] = Field(default_factory=dict)
    neighbours: Neighbours | None = None  # the grid's relation, overridden for this algorithm

    @model_validator(mode="before")
    @classmethod
    def _split(cls, raw: Any) -> Any:
        raw = _entry(raw, "algorithm")
        if ({"name", "params", "overrides"} <= set(raw) <= {"name", "params", "overrides", "neighbours"}  # dumped
                and isinstance(raw["params"], dict) and isinstance(raw["overrides"], dict)):
            raw = {"name": raw["name"], **raw["params"], **raw["overrides"],
                   **({"neighbours": raw["neighbours"]} if raw.get("neighbours") else {})}
        neighbours = raw.pop("neighbours", None)
        name = raw.pop("name", None)
        if not isinstance(name, str) or (name not in ALGORITHMS and not from_entry_point(name)):
            raise ValueError(f"unknown algorithm {name!r}{closest(str(name), ALGORITHMS)}; known: "
                             f"{', '.join(ALGORITHMS)}; {HOW_TO_LOAD}")
        overrides = {k: _as_list(raw.pop(k)) for k in list(raw) if k in AXES}
        check_axes(overrides)
        for key in raw:
            if key not in ALGORITHMS[name].Params.model_fields:
                valid = [*ALGORITHMS[name].Params.model_fields, *AXES]
                raise ValueError(f"unknown key {key!r} for algorithm {name}{closest(key, valid)}")
        params = ALGORITHMS[name].Params.model_validate(raw, strict=True).model_dump()
        return {"name": name, "params": params, "overrides": overrides, "neighbours": neighbours}


class Axes(_Strict):
    """The swept values; each accepts a number or a list."""

    epsilon: list[float] = Field([1.0], description="target ε of the private algorithms (> 0)")
    batch_size: list[int] = Field([256], description="(expected) batch size, 1 ≤ B ≤ n")
    lr: list[float] = Field([0.1], description="learning rate (> 0)")
    epochs: list[float] = Field([5], description="passes over the training set (> 0)")
    l2: list[float] = Field([1e-4], description="L2 regularisation λ of the objective (≥ 0)")
    clip_norm: list[float] = Field([1.0], description="per-example gradient clipping norm C (> 0)")

    @field_validator(*AXES, mode="before")
    @classmethod
    def _listify(cls, value: Any, info: Any) -> Any:
        values = _as_list(value)
        check_axes({info.field_name: values})
        return values


STEP_SIZE_MAX = 1e6  # lr, clip_norm, l2 beyond this overflow float64 within a few steps


def _finite_in(low: float, high: float, low_open: bool = False) -> Any:
    return lambda v: math.isfinite(v) and (v > low if low_open else v >= low) and v <= high


_AXIS_RULES = {
    "epsilon": (_finite_in(*EPSILON_RANGE), f"must be in [{EPSILON_RANGE[0]:g}, {EPSILON_RANGE[1]:g}]"),
    "batch_size": (lambda v: v >= 1 and float(v).is_integer(), "must be an integer ≥ 1"),
    "lr": (_finite_in(0, STEP_SIZE_MAX, low_open=True), f"must be in (0, {STEP_SIZE_MAX:g}]"),
    "epochs": (_finite_in(0, 1e9, low_open=True), "must be > 0 and finite"),
    "l2": (_finite_in(0, STEP_SIZE_MAX), f"must be in [0, {STEP_SIZE_MAX:g}]"),
    "clip_norm": (_finite_in(0, STEP_SIZE_MAX, low_open=True), f"must be in (0, {STEP_SIZE_MAX:g}]"),
}
assert set(_AXIS_RULES) == set(AXES) == set(Axes.model_fields)


def check_axes(values: dict[str, list[Any]]) -> None:
    """Raise ValueError naming the first axis value that is not a number in its range, or an empty axis."""
    for axis, items in values.items():
        ok, rule = _AXIS_RULES[axis]
        if not items:
            raise ValueError(f"{axis} is an empty list (the grid would have no runs); give at least one value")
        for item in items:
            if not isinstance(item, (int, float)) or isinstance(item, bool) or not _holds(ok, item):
                shown = f"{item:g}" if isinstance(item, (int, float)) and not isinstance(item, bool) else repr(item)
                raise ValueError(f"{axis} = {shown} {rule}")


def _holds(rule: Any, value: Any) -> bool:
    try:
        return bool(rule(value))
    except OverflowError:  # an integer too large for a float
        return False


NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def _safe_name(value: str) -> str:
    """A name that is also a file or folder name: one path component, never `.` or `..`, at most 100 chars."""
    if not NAME_PATTERN.fullmatch(value):
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise ValueError(f"name {shown!r} must be 1–100 letters, digits, '_', '.' or '-', not starting with '.' "
                         f"or '-' (it names a file or folder)")
    return value


SafeName = Annotated[str, AfterValidator(_safe_name)]


def _one_line(value: str) -> str:
    """Free text the report prints: one line, without characters that act on a terminal (docs/results.md#reports)."""
    if "".join(value.splitlines()) != value:
        raise ValueError("must be one line: replace its line breaks by spaces (in YAML, `>-` folds the lines)")
    if printable(value) != value:
        raise ValueError("holds a control character (an escape sequence, a bidirectional override); remove it")
    return value


OneLine = Annotated[str, AfterValidator(_one_line)]
Selection = dict[str, Any]  # column → value, list of values, or a comparison string like ">=1"


ANALYTIC_PARAMS: dict[str, type[BaseModel]] = {"privacy_curve": PrivacyCurveParams, "noise_scale": NoiseScaleParams}


class FigureSpec(_Strict):
    """How a paper lays out one figure drawn from a grid's results (`dpsgd plot`): a `sweep` over a grid axis,
    `traces` over examples processed, or an analytic table (`privacy_curve`, `noise_scale`)."""

    name: SafeName = Field(description="file name of the figure")
    kind: Literal["sweep", "traces", "privacy_curve", "noise_scale"] = "sweep"
    title: OneLine = ""
    paper: OneLine = Field("", description="what the paper's figure shows, in one line (for the report)")
    x: str = "epsilon"
    metric: str = "test_accuracy"
    rows: str | None = Field(None, description="column whose values make the panel rows")
    cols: str | None = Field("dataset", description="column whose values make the panel columns")
    lines: list[str] = Field(["label"], description="columns whose values make one line")
    where: Selection = Field(default_factory=dict, description="keep only these runs")
    log_x: bool = True
    log_y: bool = False
    params: dict[str, Any] = Field(default_factory=dict, description="parameters of an analytic figure")

    @model_validator(mode="after")
    def _analytic_params(self) -> FigureSpec:
        """An analytic figure's params are checked now (by `dpsgd run`), not when its table is computed."""
        model = ANALYTIC_PARAMS.get(self.kind)
        if model is None and self.params:
            raise ValueError(f"figure {self.name}: params apply only to analytic figures (kind privacy_curve or "
                             f"noise_scale), not to kind {self.kind}")
        if model is not None:
            try:
                model.model_validate(self.params, strict=True)
            except ValidationError as exc:
                err = exc.errors()[0]
                key = ".".join(str(p) for p in err["loc"])
                hint = closest(key, model.model_fields) if err["type"] == "extra_forbidden" else ""
                got = f" (got {err['input']!r})" if err["type"] != "extra_forbidden" else ""
                raise ValueError(f"figure {self.name}: params.{key}: {err['msg']}{hint}{got}") from None
        return self


CheckKind = Literal["monotone", "better", "within", "not_worse", "above", "below", "saturates", "spread",
                    "fluctuates", "widens"]


class ClaimCondition(_Strict):
    """One more condition of a claim's sentence (`also:`): its text and check; a key it leaves out is the claim's."""

    text: OneLine = Field(description="the condition, in the words of the claim's text")
    check: CheckKind
    metric: str | None = None
    where: Selection | None = None
    a: Selection | None = None
    b: Selection | None = None
    over: str | None = None
    direction: Literal["increasing", "decreasing"] | None = None
    higher_is_better: bool | None = None
    tolerance: float | None = Field(None, ge=0)
    relative: bool | None = None
    confidence: float | None = Field(None, gt=0.5, lt=1)
    value: float | None = None


class ClaimSpec(_Strict):
    """A source's stated finding (its sentence in `quote`), or the project's own check (`own: true`), checked
    against the numbers just computed (`dpsgd report`); the checks and verdicts: docs/results.md#claims."""

    id: SafeName
    text: OneLine = Field(description="what is checked, in one line")
    quote: OneLine = Field("", description="the source sentence the claim tests, verbatim, with its place "
                       "(e.g. 'Kang et al. §5.2: \"...\"'); required unless `own`")
    own: bool = Field(False, description="the project's own check, not a statement of a source")
    reading: OneLine = Field("", description="how the quote was encoded where that is a choice, and why (one or two "
                         "sentences, shown in the report)")
    kind: Literal["finding", "formula_check"] = Field(
        "finding", description="formula_check: the numbers are the project's evaluation of a source's formula (an "
        "analytic figure's table, or a noise scale calibrated from the run's sizes), computed without data or "
        "randomness; the verdict checks that implementation, not an experimental finding")
    check: CheckKind
    metric: str = "test_accuracy"
    source: str = Field("runs", description="runs, traces, or the name of an analytic figure")
    where: Selection = Field(default_factory=dict)
    a: Selection = Field(default_factory=dict)
    b: Selection = Field(default_factory=dict)
    over: str | None = "epsilon"
    group_by: list[str] = Field(default_factory=list, description="check each group separately")
    quantifier: Literal["all", "most", "some"] = Field(
        "all", description="how many groups must hold: all; most (more than half of the decided groups); some (≥ 1)")
    direction: Literal["increasing", "decreasing"] = "increasing"
    higher_is_better: bool = True
    tolerance: float = Field(0.0, ge=0)
    relative: bool = False
    confidence: float = Field(0.95, gt=0.5, lt=1, description="spread: confidence of the lower bound on s_a/s_b")
    value: float = Field(0.0, description="above / below: the level the mean is compared with")
    also: list[ClaimCondition] = Field(default_factory=list, description="the sentence's further conditions, "
                                       "each checked on the same groups: the claim holds where all hold")
    unselected: Literal["show", "some", "all"] = Field(
        "show", description="with a grid's select: show the verdict at each fixed candidate value beside the "
        "claim's; some / all: the claim must also hold on the unselected runs at some / every fixed value")

    @model_validator(mode="after")
    def _sourced(self) -> ClaimSpec:
        if not self.own and not self.quote.strip():
            raise ValueError(f"claim {self.id}: give `quote:` (the source sentence it tests) or mark it `own: true`")
        return self

    def conditions(self) -> list[ClaimSpec]:
        """The claim's own check, then each of `also:` as a claim of its own (keys it does not give inherited)."""
        given = [{k: v for k, v in c.model_dump().items() if v is not None} for c in self.also]
        return [self] + [self.model_copy(update={**keys, "also": []}) for keys in given]


SELECT_GROUPS = ["dataset", "model", "algorithm", "epsilon"]


def selectable_by(privacy: str) -> str:
    """The algorithms whose base mechanism the private selection `privacy` can account (their `tags.selection`), with
    the parameter value each needs: `song2013 with basic composition`."""
    names = []
    for name, algorithm in ALGORITHMS.items():
        if privacy in algorithm.tags.selection:
            required = algorithm.tags.selection_requires
            names.append(name if required is None else f"{name} with {required[1]} {required[0]}")
    return ", ".join(sorted(names))


class SelectSpec(_Strict):
    """How hyperparameters are chosen after the runs (`dpsgd select`, and the runs `plot`/`report` use): per group,
    the candidate with the best `score`, privately or not (docs/hyperparameters.md)."""

    name: str = Field("validation", pattern=r"^[A-Za-z0-9_.-]+$", description="the selection's name (a line label)")
    candidates: Annotated[list[str], AsList] = Field(min_length=1, description="columns whose values are the "
                                                     "candidates (lr, epochs, ...)")
    score: Literal["val_accuracy", "val_objective", "test_accuracy"] = Field(
        "val_accuracy", description="val_accuracy (higher is better), val_objective (lower), or test_accuracy "
        "(optimistic: tuned on the test set; non_private only, labelled so)")
    group_by: Annotated[list[str], AsList] = Field(SELECT_GROUPS, description="the best is taken within each group")
    privacy: Literal["non_private", "papernot_steinke", "liu_talwar"] = "non_private"
    distribution: Literal["poisson", "geometric", "logarithmic", "truncated_negative_binomial"] = "poisson"
    mean: float = Field(10.0, gt=0, description="E[K], the expected number of trials")
    eta: float = Field(1.0, gt=-1, description="shape η of the truncated negative binomial (Papernot & Steinke)")
    calibrate: bool = Field(True, description="private: train the candidates so that tuning + training meets ε")
    searches: int = Field(200, ge=1, le=100_000, description="simulated private searches (their spread is plotted)")

    @model_validator(mode="after")
    def _consistent(self) -> SelectSpec:
        if self.score == "test_accuracy" and self.privacy != "non_private":
            raise ValueError(f"select {self.name}: score test_accuracy (tuning on the test set) is only a "
                             "non_private, optimistic reference; use val_accuracy or val_objective")
        if self.privacy != "non_private" and self.score != "val_accuracy":
            raise ValueError(f"select {self.name}: a private selection scores by val_accuracy (a noisy count of "
                             "correct predictions, sensitivity 1); the objective's sensitivity is unbounded")
        if self.privacy == "liu_talwar" and self.distribution != "geometric":
            raise ValueError(f"select {self.name}: liu_talwar is geometric stopping; set distribution: geometric")
        if set(self.candidates) & set(self.group_by):
            raise ValueError(f"select {self.name}: {sorted(set(self.candidates) & set(self.group_by))} cannot be "
                             "both candidates and group_by")
        return self

    def tuning_tag(self) -> str:
        """What the candidates of a calibrated private selection are trained for (runs.csv's `tuning` column);
        not the name, so that renaming a selection keeps its runs."""
        return f"{self.privacy} {self.distribution} mean={self.mean:g} eta={self.trials().eta:g}"

    def trials(self) -> Trials:
        """The distribution of the number of trials (privacy/tuning.py)."""
        eta = {"geometric": 1.0, "logarithmic": 0.0}.get(self.distribution, self.eta)
        return Trials(self.distribution, self.mean, eta)


class AuditSpec(_Strict):
    """How `dpsgd audit` attacks the grid's cells (see dpsgd_cli/audit)."""

    canaries: Annotated[list[Literal["input", "gradient", "dirac"]], AsList] = Field(
        ["input", "dirac"], min_length=1, description="input: a record, black box (last iterate); gradient: a record "
        "whose gradient is a fixed vector, white box (last iterate and all iterates); dirac: a gradient on an input "
        "coordinate no record uses, white box (last iterate, and all iterates by a per-step likelihood ratio)")
    trials: int | None = Field(None, ge=1, description="trainings with the canary (and as many without); one_run: "
                               "the trainings pooled (1: one training); default: per cell and control, three "
                               "times what an optimal attack needs to refute it (the cell: the noise × 0.5 "
                               "control's), within the time budget")
    budget: float = Field(10.0, gt=0, description="seconds of training per cell (estimated) that the trials chosen "
                          "per cell may take (three times as many where that affords refuting the noise × 0.5 "
                          "control)")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="probability that ε_lo is a lower bound")
    statistic: Literal["clopper_pearson", "one_run"] = Field(
        "clopper_pearson", description="Clopper–Pearson on FPR/FNR over trials, or one run (ε_lo: Mahloujifar et "
        "al.'s f-DP test with the (ε, δ) curve, valid for any claim; beside it Steinke et al.'s bound and the μ-GDP "
        "curve's, valid for a Gaussian mechanism only)")
    threshold: Literal["bonferroni", "split", "order"] = Field(
        "order", description="how the attack's threshold is chosen: at out-score ranks fixed from the claimed ε "
        "before any score is seen, each by an exact test (order), the best of all (bonferroni), or on half the "
        "trials (split)")
    m_canaries: int = Field(1000, ge=2, description="one_run: canaries per training, each in with probability 1/2")
    direction: Literal["unused", "against_data"] = Field(
        "unused", description="gradient canary: the data's least-used direction (random for the MLP), or against "
        "the data's gradient at θ₀ (the worst case for clipping a batch's sum)")
    raw_norm: float | None = Field(None, gt=0, description="gradient canary's norm before clipping (default "
                                   "2(n+1)·max(C, 1) + C: it dominates any batch sum)")
    chunk: int = Field(32, ge=1, description="replicas per vectorised fit (32: fastest per replica-step on adult; "
                       "larger chunks pay in memory traffic)")
    seed: int = Field(0, ge=0, description="seed of the canary directions and one-run inclusion coins")
    control: float | None = Field(0.1, ge=0, lt=1, description="positive control: the same audit of each cell's "
                                  "broken twin, its noise multiplied by this factor (null: none; then no verdict "
                                  "is better than uninformative)")
    ladder: Annotated[list[Literal["sigma_t10", "noise_half", "no_clip"]], AsList] = Field(
        ["sigma_t10", "noise_half", "no_clip"], description="realistic controls audited beside the twin (with "
        "control: null, none): sigma_t10 — σ calibrated for T/10 steps, run for T; noise_half — the noise × 0.5; "
        "no_clip — the per-example clipping dropped (each where the cell has what it mutates)")

    @model_validator(mode="after")
    def _enough_trials(self) -> AuditSpec:
        if self.trials is not None and self.trials < 2 and self.statistic != "one_run":
            raise ValueError(f"audit.trials = {self.trials}: a two-world audit needs at least 2 trials per world "
                             "(only statistic: one_run can audit a single training)")
        return self


class Grid(Axes):
    """One named grid: datasets × models × algorithms × axes × seeds."""

    name: SafeName = Field(description="also the results folder name")
    datasets: list[AnyDatasetSpec] = Field(min_length=1)
    models: Annotated[list[ModelEntry], AsList] = Field([ModelEntry(name="logreg")], min_length=1)
    algorithms: Annotated[list[AlgorithmEntry], AsList] = Field(min_length=1)
    seeds: int = Field(3, ge=1, le=1000, description="runs per cell, seeds 0..seeds-1")
    delta: Literal["1/n^2"] | float = Field(DELTA_RULE, description="δ, a number in (0, 1) or 1/n^2")
    neighbours: Neighbours | None = Field(
        None, description="the neighbouring relation every private algorithm's ε is calibrated under (add_remove | "
        "replace_one | zero_out; an algorithm entry may override it); unset: each algorithm's own")
    trace_every: int | None = Field(None, ge=1, description="record the objective every k examples (traces.csv)")
    dtype: Literal["float64", "float32"] = Field(
        "float64", description="training precision; float32 applies to sgd, dp_sgd, dp_lssgd with logreg or mlp (the "
        "accounting does not depend on it), the others train in float64; the CSV's dtype column says which")
    validation: float | None = Field(
        None, gt=0, lt=0.5, description="share of the training set held out (seeded) for validation metrics; "
        "the test set is never used for selection")
    select: Annotated[list[SelectSpec], AsList] = Field(default_factory=list,
                                                         description="hyperparameter selection (post-processing)")
    description: OneLine = ""
    figures: list[FigureSpec] = Field(default_factory=list, description="the paper's figures drawn from this grid")
    claims: list[ClaimSpec] = Field(default_factory=list, description="the paper's findings, checked by the report")
    audit: AuditSpec | None = Field(None, description="canaries and statistics of `dpsgd audit` for this grid")

    @field_validator("datasets", mode="before")
    @classmethod
    def _dataset_names(cls, value: Any) -> Any:
        return [{"name": v} if isinstance(v, str) else v for v in _as_list(value)]

    @model_validator(mode="after")
    def _neighbours_supported(self) -> Grid:
        for algo in self.algorithms:
            asked = algo.neighbours or self.neighbours
            reason = asked and ALGORITHMS[algo.name](algo.params).refuses_neighbours(asked)
            if reason:
                raise ValueError(f"neighbours: {asked}: {reason}")
        return self

    @model_validator(mode="after")
    def _selectable(self) -> Grid:
        names = [s.name for s in self.select]
        if len(set(names)) < len(names):
            raise ValueError(f"select: names must be unique, got {names}; give each a `name:`")
        params = {k for a in self.algorithms for k in a.params}
        for spec in self.select:
            for column in spec.candidates:
                if column not in AXES and column not in params:
                    raise ValueError(f"select {spec.name}: candidate {column!r} is neither an axis nor a parameter of "
                                     f"the grid's algorithms{closest(column, [*AXES, *params])}")
            for axis in AXES:
                if len(getattr(self, axis)) > 1 and axis not in spec.candidates + spec.group_by:
                    raise ValueError(f"select {spec.name}: axis {axis} varies but is neither a candidate nor in "
                                     f"group_by; add it to one of them")
            if spec.score.startswith("val_") and not self.validation:
                raise ValueError(f"select {spec.name}: score {spec.score} needs a validation split; add "
                                 "`validation: 0.1` to the grid")
            if spec.privacy != "non_private":
                spec.trials()  # validates mean and eta
                for algo in self.algorithms:
                    algorithm = ALGORITHMS[algo.name](algo.params)
                    if algorithm.tags.private and not algorithm.selectable(spec.privacy):
                        raise ValueError(
                            f"select {spec.name}: {spec.privacy} cannot account the selection of {algo.name} "
                            f"(supported: {selectable_by(spec.privacy)}); use privacy: non_private or another grid")
        return self

    @field_validator("delta", mode="before")
    @classmethod
    def _delta(cls, value: Any) -> Any:
        if isinstance(value, str) and value.replace(" ", "") in ("1/n^2", "1/n**2"):
            return DELTA_RULE
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"delta = {value!r} must be a number in (0, 1) or '1/n^2'") from None
        if isinstance(value, (int, float)) and not 0 < value < 1:
            raise ValueError(f"delta = {value!r} must be in (0, 1) (exclusive), or '1/n^2'")
        return value


class GridFile(_Strict):
    grids: list[Grid] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> GridFile:
        names = [g.name for g in self.grids]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"grid names must be unique; repeated: {', '.join(dupes)}")
        return self


class Cell(_Strict):
    """One resolved configuration; its seeds are the replicas that train together."""

    grid: str
    dataset: AnyDatasetSpec
    model: ModelEntry
    algorithm: AlgorithmEntry
    epsilon: float | None
    delta: Literal["1/n^2"] | float
    batch_size: int | None
    lr: float | None
    epochs: float | None
    l2: float
    clip_norm: float | None
    seeds: tuple[int, ...]
    trace_every: int | None = None
    dtype: Literal["float64", "float32"] = "float64"
    validation: float | None = None  # held-out share of the training set (the model trains on the rest)
    tuning: dict[str, Any] | None = None  # private selection this cell is calibrated for (see tuning_cells)
    neighbours: Neighbours | None = None  # the relation asked of its ε where it is not the algorithm's own

    def make_algorithm(self) -> Any:
        """The algorithm of this cell, configured (parameters, neighbouring relation)."""
        return ALGORITHMS[self.algorithm.name](self.algorithm.params, self.neighbours)

    def key(self) -> dict[str, Any]:
        """Everything that determines a run except its seed (and the grid's name and what it records)."""
        data = self.model_dump(mode="json", exclude={"grid", "seeds", "trace_every"})
        if isinstance(self.dataset, FileDatasetSpec):  # the file's sha256, not its path
            data["dataset"] = self.dataset.identity()
        data["algorithm"].pop("overrides")
        data["algorithm"].pop("neighbours")
        for name in ALGORITHMS[self.algorithm.name].execution_params:
            data["algorithm"]["params"].pop(name, None)
        for name, default in (("dtype", "float64"), ("validation", None), ("tuning", None), ("neighbours", None)):
            if data[name] == default:  # a key at its default is left out: run ids do not depend on it
                data.pop(name)
        return data

    @property
    def cell_id(self) -> str:
        return _digest(self.key())

    def run_id(self, seed: int) -> str:
        return _digest({**self.key(), "seed": seed})


def _digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def axis_values(grid: Grid, algo: AlgorithmEntry) -> dict[str, list[Any]]:
    """The values of each axis for one algorithm: its override, else the grid's; [None] for an unused axis."""
    uses = ALGORITHMS[algo.name].uses
    return {axis: (algo.overrides.get(axis, getattr(grid, axis)) if axis in uses or axis == "l2" else [None])
            for axis in AXES}


FLOAT32_MODELS = frozenset({"logreg", "mlp"})  # models whose training keeps float32 (dtype-preserving NumPy)


def asked_neighbours(grid: Grid, algo: AlgorithmEntry) -> str | None:
    """The relation a grid asks of an algorithm's ε where it differs from the algorithm's own (None: its own, so
    a grid that names the relation an algorithm already has keeps its run ids)."""
    asked = algo.neighbours or grid.neighbours
    algorithm = ALGORITHMS[algo.name](algo.params)
    return asked if asked and algorithm.tags.private and asked != algorithm.native_neighbours() else None


def expand(grid: Grid) -> list[Cell]:
    """The Cartesian product of the grid; axes an algorithm does not use are set to None and merged."""
    cells: dict[str, Cell] = {}
    for dataset, model, algo in itertools.product(grid.datasets, grid.models, grid.algorithms):
        axes = axis_values(grid, algo)
        for values in itertools.product(*axes.values()):
            # like an unused axis, dtype applies where it is supported (float32 chains with logreg or mlp)
            float32 = ALGORITHMS[algo.name].tags.float32 and model.name in FLOAT32_MODELS
            cell = Cell(grid=grid.name, dataset=dataset, model=model, algorithm=algo, delta=grid.delta,
                        seeds=tuple(range(grid.seeds)), trace_every=grid.trace_every,
                        dtype=grid.dtype if float32 else "float64", validation=grid.validation,
                        neighbours=asked_neighbours(grid, algo), **dict(zip(axes, values)))
            cells.setdefault(cell.cell_id, cell)
    plain = list(cells.values())
    for spec in grid.select:
        for cell in tuning_cells(spec, plain):
            cells.setdefault(cell.cell_id, cell)
    return list(cells.values())


def cell_value(cell: Cell, column: str) -> Any:
    """The value a results column takes for this cell (dataset and model by name, algorithm parameters too)."""
    if column in ("dataset", "model", "algorithm"):
        return getattr(cell, column).name
    if column in cell.algorithm.params:
        return cell.algorithm.params[column]
    return getattr(cell, column, None)


def tuning_cells(spec: SelectSpec, cells: list[Cell]) -> list[Cell]:
    """The candidates of a calibrated private selection: each private cell again, marked with the selection's
    privacy and its group's privacy-relevant candidates, so that σ is calibrated for tuning + training."""
    if spec.privacy == "non_private" or not spec.calibrate:
        return []
    private = [c for c in cells if ALGORITHMS[c.algorithm.name].tags.private]
    groups: dict[str, list[Cell]] = {}
    for cell in private:
        groups.setdefault(json.dumps([str(cell_value(cell, g)) for g in spec.group_by]), []).append(cell)
    out = []
    for members in groups.values():
        candidates = sorted({(c.batch_size, c.epochs, c.algorithm.params.get("accountant", "rdp"))
                             # a mechanism other than DP-SGD's is priced by its algorithm (its own event)
                             + ((c.algorithm.name,) if ALGORITHMS[c.algorithm.name].tags.selection_by_event else ())
                             for c in members}, key=str)
        tuning = {"tag": spec.tuning_tag(), "privacy": spec.privacy, "distribution": spec.distribution,
                  "mean": spec.mean, "eta": spec.trials().eta, "candidates": [list(c) for c in candidates]}
        out += [c.model_copy(update={"tuning": tuning}) for c in members]
    return out


MAX_GRID_FILE_BYTES = 1 << 20  # grid files are hand-written: 1 MiB is far more than any paper needs
MAX_YAML_NODES = 100_000  # nodes of the document with every alias expanded (an alias bomb has billions)


class _GridConstructor(yaml.constructor.SafeConstructor):
    """SafeConstructor that rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]}); keep one of them",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class _GridResolver(yaml.resolver.Resolver):
    """Reads `1e-3` as a number (YAML 1.1 wants `1.0e-3`; users write the former)."""


_GridResolver.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


class GridLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer,
                 _GridConstructor, _GridResolver):
    """SafeLoader that rejects duplicate keys and reads `1e-3` as a number (`FastGridLoader`: on libyaml's parser)."""

    def __init__(self, stream: Any) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _GridConstructor.__init__(self)
        _GridResolver.__init__(self)


FastGridLoader: type = GridLoader  # PyYAML built without libyaml
if getattr(yaml, "__with_libyaml__", False):
    class LibyamlGridLoader(yaml.cyaml.CParser, _GridConstructor, _GridResolver):
        """GridLoader on libyaml's parser (faster; the same constructor and resolver)."""

        def __init__(self, stream: Any) -> None:
            yaml.cyaml.CParser.__init__(self, stream)
            _GridConstructor.__init__(self)
            _GridResolver.__init__(self)

    FastGridLoader = LibyamlGridLoader


def _expanded_nodes(root: yaml.Node) -> int:
    """Nodes of the document with every alias expanded, counted without expanding (memoised per node)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # nodes whose children are being counted: an alias to one is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in children), 1 << 62)
        elif id(node) in open_nodes:
            return 1 << 62  # a recursive structure expands forever
        elif id(node) not in sizes:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children)
    return sizes[id(root)]


def read_yaml(path: Path) -> Any:
    """The YAML document of a grid file, or one UserError line (docs/results.md#checked-before-any-work)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise UserError(f"{path}: is a folder; pass the path of a grid YAML file (e.g. experiments.yaml)")
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read forever, a device never end
            raise UserError(f"{path}: not a regular file (a pipe, socket or device); pass the path of a grid YAML "
                            f"file (e.g. experiments.yaml)")
        size = info.st_size
        if size > MAX_GRID_FILE_BYTES:
            raise UserError(f"{path}: {size:,} bytes is larger than the {MAX_GRID_FILE_BYTES:,} bytes a grid file "
                            f"may have; is it really a grid YAML file?")
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; pass the path of a grid YAML file (e.g. experiments.yaml)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc}); pass a readable grid YAML file") from None
    if b"\0" in data:
        raise UserError(f"{path}: binary file (NUL bytes); pass a grid YAML file (text)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}, line {line}); save the file as UTF-8") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, where: str) -> Any:
    """The YAML document in `text` (a grid file's, or a grid given as text), or one UserError line from `where`."""
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_GRID_FILE_BYTES:
        raise UserError(f"{where}: larger than the {MAX_GRID_FILE_BYTES:,} bytes a grid may have; is it really a "
                        f"grid?")
    loader = None
    try:
        if "\t" in text and FastGridLoader is not GridLoader:
            # libyaml takes a tab as a separator where PyYAML refuses it ("a:<TAB>1"): refused whichever is installed
            for _ in yaml.scan(text, Loader=GridLoader):
                pass
        loader = FastGridLoader(text)  # the pure-Python reader checks the characters here
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = _expanded_nodes(node)
        if nodes > MAX_YAML_NODES:
            raise UserError(f"{where}: the YAML document expands to more than {MAX_YAML_NODES:,} nodes (an alias "
                            f"bomb or a recursive alias?); write the grid without nested aliases")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]  # a reader error has no mark
        raise UserError(f"{where}: invalid YAML{at}: {problem}") from None
    except RecursionError:
        raise UserError(f"{where}: the YAML document is nested too deeply; flatten it") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_grid_file(path: Path, overrides: typing.Sequence[tuple[str, Any]] = (),
                   only: typing.Collection[str] | None = None) -> GridFile:
    """Parse and validate a grid file strictly; every problem becomes one UserError line naming the path.
    `overrides` ((dotted key, value) pairs, e.g. ("datasets.0.n", 500)) are set in every grid (with `only`, in
    the grids it names) before validation, so that they are checked as the file's own values are."""
    return validate_grids(read_yaml(path), str(path), Path(path).resolve().parent, overrides, only)


def validate_grids(raw: Any, source: str, grid_dir: Path, overrides: typing.Sequence[tuple[str, Any]] = (),
                   only: typing.Collection[str] | None = None) -> GridFile:
    """A parsed grid document validated as `load_grid_file` does, each problem one UserError line naming `source`;
    relative paths are resolved against `grid_dir`. `raw` is changed by the overrides: pass a copy."""
    if isinstance(raw, dict) and "grids" not in raw and "name" in raw:
        raw = {"grids": [raw]}  # a file holding a single grid
    where = source + "".join(f" --set {key}={value!r}" for key, value in overrides)
    if overrides and isinstance(raw, dict) and isinstance(raw.get("grids"), list):
        for grid in raw["grids"]:
            if only and not (isinstance(grid, dict) and grid.get("name") in only):
                continue
            for key, value in overrides:
                set_dotted(grid, key, value)
    try:
        return GridFile.model_validate(raw, strict=True, context={"grid_dir": grid_dir})
    except ValidationError as exc:
        raise UserError(f"{where}: {describe_validation_error(exc, raw)}") from None


def set_dotted(grid: Any, key: str, value: Any) -> None:
    """Set `key` (`epochs`, `audit.trials`, `datasets.0.n`: a list index is a number) of one parsed grid; an
    entry given by its name alone (`datasets: [adult]`) becomes `{name: adult}` when a key is set inside it."""
    parts = key.split(".")
    if not isinstance(grid, dict) or not all(parts):
        raise UserError(f"--set {key}: expected KEY=VALUE with a dotted KEY (e.g. --set epochs=1, --set "
                        f"datasets.0.n=500)")
    node: dict | list = grid
    for i, part in enumerate(parts[:-1]):
        inside = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(f"--set {key}: {inside}: no such entry; the list has {len(node)} (numbered from 0)")
            if isinstance(node[int(part)], str):
                node[int(part)] = {"name": node[int(part)]}
            child = node[int(part)]
        elif isinstance(node, dict):
            child = node.setdefault(part, {})
            if isinstance(child, str) and part in ("datasets", "models", "algorithms"):
                child = node[part] = [child]
        else:
            child = None
        if not isinstance(child, (dict, list)):
            raise UserError(f"--set {key}: {inside} holds a single value ({child!r}), not keys to set")
        node = child
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise UserError(f"--set {key}: no such entry; the list has {len(node)} (numbered from 0)")
        node[int(last)] = value
    else:
        node[last] = value


def parse_overrides(items: typing.Iterable[str]) -> list[tuple[str, Any]]:
    """`KEY=VALUE` strings of `--set` as (key, value) pairs; each value is read as YAML, as in a grid file."""
    pairs = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item}: expected KEY=VALUE (e.g. --set epochs=1)")
        try:
            value = yaml.load(text, Loader=GridLoader) if text.strip() else None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise UserError(f"--set {item}: the value is not valid YAML ({problem}); quote it or fix it") from None
        pairs.append((key.strip(), value))
    return pairs


def select(grid_file: GridFile, only: list[str] | None) -> list[Grid]:
    if not only:
        return list(grid_file.grids)
    names = [g.name for g in grid_file.grids]
    for name in only:
        if name not in names:
            raise UserError(f"--only {name}: no such grid{closest(name, names)}; "
                            f"grids in the file: {', '.join(names)}")
    return [g for g in grid_file.grids if g.name in only]


def describe_validation_error(exc: ValidationError, raw: Any) -> str:
    """The first pydantic error as `grids[0].algorithms[1]: message`, with a suggestion for unknown keys."""
    errors = exc.errors()
    err = errors[0]
    tagged = [part for part in err["loc"] if not (isinstance(part, str) and part.startswith("function-"))]
    loc = [part for part in tagged if part not in _DATASET_KINDS]  # a dataset's kind is not a key
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "top level"
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        valid = _fields_at(GridFile, tagged[:-1])
        message = f"unknown key {key!r}{closest(key, valid)}"
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[:-1]).lstrip(".") or "top level"
    elif err["type"] == "missing":
        message = f"required key {loc[-1]!r} is missing"
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[:-1]).lstrip(".") or "top level"
    elif err["type"] == "literal_error" and len(loc) > 1 and loc[-1] == "name" and "datasets" in loc:
        known = [*typing.get_args(DatasetSpec.model_fields["name"].annotation), "file"]
        name = str(err["input"])
        message = (f"unknown dataset {name!r}{closest(name, known)}; known: {', '.join(known)} "
                   f"(file: a data file of your own, {{name: file, path: ...}})")
    else:
        message = err["msg"].removeprefix("Value error, ")
        if ("input" in err and err["type"] not in ("value_error", "assertion_error")
                and not isinstance(err["input"], (dict, list))):
            message += f" (got {err['input']!r})"
    more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
    return f"{path}: {message}{more}"


def _fields_at(model: Any, loc: list[Any]) -> list[str]:
    """Field names of the pydantic model found by following `loc` from `model` (for suggestions)."""
    for part in loc:
        if isinstance(part, int):
            continue
        if part in _DATASET_KINDS:
            model = _DATASET_KINDS[part]
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = _model_in(field.annotation)
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
