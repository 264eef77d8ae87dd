"""Grid files: YAML → validated grids → run cells (a cell is one resolved spec; its seeds train together).

Data flows one way: this module only parses and expands; it never loads data or trains.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dpsgd_cli.algorithms import ALGORITHMS, AXES
from dpsgd_cli.data.spec import DatasetSpec
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import MODELS

DELTA_RULE = "1/n^2"
Number = Union[int, float]


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


def _closest(word: str, candidates: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelEntry(_Strict):
    """A model of the grid: `logreg`, or `{name: mlp, ...}` with the model's own options."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split(cls, raw: Any) -> Any:
        raw = {"name": raw} if isinstance(raw, str) else dict(raw)
        if set(raw) == {"name", "options"}:  # as dumped in a manifest
            raw = {"name": raw["name"], **raw["options"]}
        name = raw.pop("name", None)
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}{_closest(str(name), MODELS)}; known: {', '.join(MODELS)}")
        return {"name": name, "options": MODELS[name].Options(**raw).model_dump()}


class AlgorithmEntry(_Strict):
    """An algorithm of the grid: `dp_sgd`, or `{name: dp_sgd, accountant: pld, lr: [0.1]}`.

    Keys named like a grid axis override that axis for this algorithm; the others are its parameters.
    """

    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    overrides: dict[str, list[Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split(cls, raw: Any) -> Any:
        raw = {"name": raw} if isinstance(raw, str) else dict(raw)
        if set(raw) == {"name", "params", "overrides"}:  # as dumped in a manifest
            raw = {"name": raw["name"], **raw["params"], **raw["overrides"]}
        name = raw.pop("name", None)
        if name not in ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {name!r}{_closest(str(name), ALGORITHMS)}; known: {', '.join(ALGORITHMS)}"
            )
        overrides = {k: _as_list(raw.pop(k)) for k in list(raw) if k in AXES}
        check_axes(overrides)
        for key in raw:
            if key not in ALGORITHMS[name].Params.model_fields:
                valid = [*ALGORITHMS[name].Params.model_fields, *AXES]
                raise ValueError(f"unknown key {key!r} for algorithm {name}{_closest(key, valid)}")
        return {"name": name, "params": ALGORITHMS[name].Params(**raw).model_dump(), "overrides": overrides}


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
    def _listify(cls, value: Any) -> Any:
        return _as_list(value)

    @field_validator(*AXES, mode="after")
    @classmethod
    def _in_range(cls, values: list[Any], info: Any) -> list[Any]:
        check_axes({info.field_name: values})
        return values


_AXIS_RULES = {
    "epsilon": (lambda v: v > 0, "must be > 0"),
    "batch_size": (lambda v: v >= 1, "must be an integer ≥ 1"),
    "lr": (lambda v: v > 0, "must be > 0"),
    "epochs": (lambda v: v > 0, "must be > 0"),
    "l2": (lambda v: v >= 0, "must be ≥ 0"),
    "clip_norm": (lambda v: v > 0, "must be > 0"),
}
assert set(_AXIS_RULES) == set(AXES) == set(Axes.model_fields)


def check_axes(values: dict[str, list[Any]]) -> None:
    """Raise ValueError naming the first axis value outside its allowed range."""
    for axis, items in values.items():
        ok, rule = _AXIS_RULES[axis]
        for item in items:
            if not isinstance(item, (int, float)) or isinstance(item, bool) or not ok(item):
                shown = f"{item:g}" if isinstance(item, (int, float)) and not isinstance(item, bool) else repr(item)
                raise ValueError(f"{axis} = {shown} {rule}")


Selection = dict[str, Any]  # column → value, list of values, or a comparison string like ">=1"


class FigureSpec(_Strict):
    """How a paper lays out one figure drawn from a grid's results (`dpsgd plot`).

    kind `sweep`: a metric over a grid axis (x), a line per `lines` value, mean ± 1 std over seeds, the
    non-private runs (no ε) as dashed references; `traces`: a metric over examples processed (traces.csv);
    `privacy_curve`, `noise_scale`: analytic tables computed by `dpsgd run` (see engine/analytic.py).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="file name of the figure")
    kind: Literal["sweep", "traces", "privacy_curve", "noise_scale"] = "sweep"
    title: str = ""
    paper: str = Field("", description="what the paper's figure shows, in one line (for the report)")
    x: str = "epsilon"
    metric: str = "test_accuracy"
    rows: Optional[str] = Field(None, description="column whose values make the panel rows")
    cols: Optional[str] = Field("dataset", description="column whose values make the panel columns")
    lines: list[str] = Field(["label"], description="columns whose values make one line")
    where: Selection = Field(default_factory=dict, description="keep only these runs")
    log_x: bool = True
    log_y: bool = False
    params: dict[str, Any] = Field(default_factory=dict, description="parameters of an analytic figure")


class ClaimSpec(_Strict):
    """A source's stated finding (its sentence in `quote`), or the project's own check (`own: true`),
    checked against the numbers just computed (`dpsgd report`).

    check `monotone`: the mean of `metric` over `over` moves in `direction` (each step ≥ −tolerance);
    `better`: selection `a` beats `b` (by more than `tolerance` and twice the standard error of the
    difference over seeds) at every value of `over`; `within`: |a − b| ≤ tolerance (relative to |b| if
    `relative`) at every value of `over`; `saturates`: an analytic curve reaches (1 − tolerance) of its limit.
    """

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    text: str = Field(description="what is checked, in one line")
    quote: str = Field("", description="the source sentence the claim tests, verbatim, with its place "
                       "(e.g. 'Kang et al. §5.2: \"...\"'); required unless `own`")
    own: bool = Field(False, description="the project's own check, not a statement of a source")
    check: Literal["monotone", "better", "within", "saturates"]
    metric: str = "test_accuracy"
    source: str = Field("runs", description="runs, traces, or the name of an analytic figure")
    where: Selection = Field(default_factory=dict)
    a: Selection = Field(default_factory=dict)
    b: Selection = Field(default_factory=dict)
    over: Optional[str] = "epsilon"
    group_by: list[str] = Field(default_factory=list, description="check each group separately")
    quantifier: Literal["all", "most", "some"] = Field(
        "all", description="how many groups must hold: all; most (more than half of the decided groups); some (≥ 1)")
    direction: Literal["increasing", "decreasing"] = "increasing"
    higher_is_better: bool = True
    tolerance: float = Field(0.0, ge=0)
    relative: bool = False

    @model_validator(mode="after")
    def _sourced(self) -> "ClaimSpec":
        if not self.own and not self.quote.strip():
            raise ValueError(f"claim {self.id}: give `quote:` (the source sentence it tests) or mark it `own: true`")
        return self


class AuditSpec(_Strict):
    """How `dpsgd audit` attacks the grid's cells (see dpsgd_cli/audit)."""

    canaries: list[Literal["input", "gradient"]] = Field(
        ["input"], min_length=1, description="input: a record, black box (last iterate); gradient: a record whose "
        "gradient is a fixed vector, white box (last iterate and all iterates)")
    trials: int = Field(500, ge=2, description="trainings with the canary (and as many without)")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="probability that ε_lo is a lower bound")
    statistic: Literal["clopper_pearson", "one_run"] = Field(
        "clopper_pearson", description="Clopper–Pearson on FPR/FNR over trials, or Steinke et al.'s one-run bound")
    threshold: Literal["bonferroni", "split"] = Field("bonferroni", description="how the attack's threshold is chosen")
    m_canaries: int = Field(1000, ge=2, description="one_run: canaries per training, each in with probability 1/2")
    direction: Literal["unused", "against_data"] = Field(
        "unused", description="gradient canary: the data's least-used direction (random for the MLP), or against "
        "the data's gradient at θ₀ (the worst case for clipping a batch's sum)")
    raw_norm: Optional[float] = Field(None, gt=0, description="gradient canary's norm before clipping (default "
                                      "2(n+1)·max(C, 1) + C: it dominates any batch sum)")
    chunk: int = Field(32, ge=1, description="replicas per vectorised fit (32: fastest per replica-step on adult; "
                       "larger chunks pay in memory traffic)")
    seed: int = Field(0, ge=0, description="seed of the canary directions and one-run inclusion coins")

    @field_validator("canaries", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        return _as_list(value)


class Grid(Axes):
    """One named grid: datasets × models × algorithms × axes × seeds."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="also the results folder name")
    datasets: list[DatasetSpec] = Field(min_length=1)
    models: list[ModelEntry] = Field([ModelEntry(name="logreg")], min_length=1)
    algorithms: list[AlgorithmEntry] = Field(min_length=1)
    seeds: int = Field(3, ge=1, le=1000, description="runs per cell, seeds 0..seeds-1")
    delta: Union[Literal["1/n^2"], float] = Field(DELTA_RULE, description="δ, a number in (0, 1) or 1/n^2")
    trace_every: Optional[int] = Field(None, ge=1, description="record the objective every k examples (traces.csv)")
    dtype: Literal["float64", "float32"] = Field(
        "float64", description="training precision; float32 applies to sgd, dp_sgd, dp_lssgd with logreg (the "
        "accounting does not depend on it), the others train in float64; the CSV's dtype column says which")
    description: str = ""
    figures: list[FigureSpec] = Field(default_factory=list, description="the paper's figures drawn from this grid")
    claims: list[ClaimSpec] = Field(default_factory=list, description="the paper's findings, checked by the report")
    audit: Optional[AuditSpec] = Field(None, description="canaries and statistics of `dpsgd audit` for this grid")

    @field_validator("datasets", mode="before")
    @classmethod
    def _dataset_names(cls, value: Any) -> Any:
        return [{"name": v} if isinstance(v, str) else v for v in _as_list(value)]

    @field_validator("models", "algorithms", mode="before")
    @classmethod
    def _listify_entries(cls, value: Any) -> Any:
        return _as_list(value)

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
    def _unique_names(self) -> "GridFile":
        names = [g.name for g in self.grids]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"grid names must be unique; repeated: {', '.join(dupes)}")
        return self


class Cell(_Strict):
    """One resolved configuration; its seeds are the replicas that train together."""

    grid: str
    dataset: DatasetSpec
    model: ModelEntry
    algorithm: AlgorithmEntry
    epsilon: Optional[float]
    delta: Union[Literal["1/n^2"], float]
    batch_size: Optional[int]
    lr: Optional[float]
    epochs: Optional[float]
    l2: float
    clip_norm: Optional[float]
    seeds: tuple[int, ...]
    trace_every: Optional[int] = None
    dtype: Literal["float64", "float32"] = "float64"

    def key(self) -> dict[str, Any]:
        """Everything that determines a run except its seed (and the grid's name and what it records)."""
        data = self.model_dump(mode="json", exclude={"grid", "seeds", "trace_every"})
        data["algorithm"].pop("overrides")
        for name in ALGORITHMS[self.algorithm.name].execution_params:
            data["algorithm"]["params"].pop(name, None)
        if data["dtype"] == "float64":  # the default keeps the run ids results had before dtype existed
            data.pop("dtype")
        return data

    @property
    def cell_id(self) -> str:
        return _digest(self.key())

    def run_id(self, seed: int) -> str:
        return _digest({**self.key(), "seed": seed})


def _digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def expand(grid: Grid) -> list[Cell]:
    """The Cartesian product of the grid; axes an algorithm does not use are set to None and merged."""
    cells: dict[str, Cell] = {}
    for dataset, model, algo in itertools.product(grid.datasets, grid.models, grid.algorithms):
        uses = ALGORITHMS[algo.name].uses
        axes = {
            axis: (algo.overrides.get(axis, getattr(grid, axis)) if axis in uses or axis == "l2" else [None])
            for axis in AXES
        }
        for values in itertools.product(*axes.values()):
            # like an unused axis, dtype applies where it is supported (float32 chains with logreg)
            float32 = ALGORITHMS[algo.name].supports_float32 and model.name == "logreg"
            cell = Cell(grid=grid.name, dataset=dataset, model=model, algorithm=algo, delta=grid.delta,
                        seeds=tuple(range(grid.seeds)), trace_every=grid.trace_every,
                        dtype=grid.dtype if float32 else "float64", **dict(zip(axes, values)))
            cells.setdefault(cell.cell_id, cell)
    return list(cells.values())


def load_grid_file(path: Path) -> GridFile:
    """Parse and validate a grid file; every problem becomes one UserError line naming the path."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; pass the path of a grid YAML file (e.g. experiments.yaml)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if isinstance(raw, dict) and "grids" not in raw and "name" in raw:
        raw = {"grids": [raw]}  # a file holding a single grid
    try:
        return GridFile.model_validate(raw)
    except ValidationError as exc:
        raise UserError(f"{path}: {describe_validation_error(exc, raw)}") from None


def select(grid_file: GridFile, only: Optional[list[str]]) -> list[Grid]:
    if not only:
        return list(grid_file.grids)
    names = [g.name for g in grid_file.grids]
    for name in only:
        if name not in names:
            raise UserError(f"--only {name}: no such grid{_closest(name, names)}; grids in the file: {', '.join(names)}")
    return [g for g in grid_file.grids if g.name in only]


def describe_validation_error(exc: ValidationError, raw: Any) -> str:
    """The first pydantic error as `grids[0].algorithms[1]: message`, with a suggestion for unknown keys."""
    errors = exc.errors()
    err = errors[0]
    loc = [part for part in err["loc"] if not (isinstance(part, str) and part.startswith("function-"))]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "top level"
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        valid = _fields_at(GridFile, loc[:-1])
        message = f"unknown key {key!r}{_closest(key, valid)}"
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[:-1]).lstrip(".") or "top level"
    elif err["type"] == "missing":
        message = f"required key {loc[-1]!r} is missing"
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[:-1]).lstrip(".") or "top level"
    else:
        message = err["msg"].removeprefix("Value error, ")
        if "input" in err and err["type"] not in ("value_error", "assertion_error") and not isinstance(err["input"], (dict, list)):
            message += f" (got {err['input']!r})"
    more = f" (and {len(errors) - 1} more problem{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
    return f"{path}: {message}{more}"


def _fields_at(model: Any, loc: list[Any]) -> list[str]:
    """Field names of the pydantic model found by following `loc` from `model` (for suggestions)."""
    for part in loc:
        if isinstance(part, int):
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
