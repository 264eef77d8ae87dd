"""Every registered algorithm's tags (`Algorithm.tags`) are complete and agree with what the algorithm does, as
scikit-learn's common checks test each estimator's tags: adding an algorithm file adds it here. And what the code
around the algorithms reads from the tags (legend names, the private selection's refusal) says what it said when
those facts were tables keyed by name.
"""

from __future__ import annotations

import dataclasses
import typing

import pydantic
import pytest
import yaml

from dpsgd_cli.algorithms import ALGORITHMS, Algorithm
from dpsgd_cli.algorithms.base import BatchRegime, SelectionMethod, Tags
from dpsgd_cli.config import Grid
from dpsgd_cli.plots import names
from dpsgd_cli.privacy.accounting import Neighbours

NAMES = sorted(ALGORITHMS)


def tag_problems(cls: type[Algorithm]) -> list[str]:
    """What is missing from or inconsistent in an algorithm class's tags (empty: none)."""
    tags = getattr(cls, "tags", None)
    if not isinstance(tags, Tags):
        return [f"tags is {tags!r}, not a Tags"]
    problems = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    uses = cls.uses
    need(bool(tags.display_name.strip()), "no display name")
    need(tags.batch in typing.get_args(BatchRegime), f"batch {tags.batch!r} is not a regime")
    need(tags.neighbours in typing.get_args(Neighbours), f"neighbours {tags.neighbours!r} is not a relation")
    need(tags.covers in ("final output", "every iterate"), f"covers {tags.covers!r}")
    need(tags.private == ("epsilon" in uses), "private but no epsilon axis, or the reverse")
    # the batch regime is how the engine counts steps from the axes: it must match the axes the algorithm reads
    need(("batch_size" in uses) == (tags.batch == "mini_batch"), f"batch {tags.batch} but uses {sorted(uses)}")
    need(("epochs" in uses) == (tags.batch != "none"), f"batch {tags.batch} but uses {sorted(uses)}")
    has_event = cls.dp_event is not Algorithm.dp_event
    if tags.private:
        need(has_event or bool(tags.own_analysis), "private, but neither a dp-accounting event nor an own analysis")
    else:
        need(not tags.own_analysis, "an own analysis of a non-private algorithm")
        need(not tags.noise_scalable, "noise scalable but adds no noise")
        need(not tags.selection, "a private selection for a non-private algorithm")
    need(all(m in typing.get_args(SelectionMethod) for m in tags.selection), f"selection {sorted(tags.selection)}")
    if "papernot_steinke" in tags.selection and not tags.selection_by_event:  # it accounts the cells' DP-SGD σ
        need(cls.sigma_calibration is not Algorithm.sigma_calibration, "papernot_steinke without a DP-SGD σ")
    if tags.selection_by_event:  # it accounts the algorithm's own event at the σ it calibrates
        need(has_event and cls.calibrated_sigma is not Algorithm.calibrated_sigma,
             "selection_by_event without a dp_event and a calibrated_sigma")
    if tags.selection_requires is not None:
        param, value = tags.selection_requires
        need(bool(tags.selection), "selection_requires without a selection")
        need(param in cls.Params.model_fields, f"selection_requires names {param!r}, not a parameter")
        try:
            need(getattr(cls.Params(**{param: value}), param) == value, f"selection_requires {param} = {value!r}")
        except pydantic.ValidationError:
            need(False, f"selection_requires {param} = {value!r}: not a value of the parameter")
    return problems


@pytest.mark.parametrize("name", NAMES)
def test_tags_are_complete_and_consistent(name):
    assert tag_problems(ALGORITHMS[name]) == []


def test_display_names_tell_the_algorithms_apart():
    shown = [ALGORITHMS[name].tags.display_name for name in NAMES]
    assert len(set(shown)) == len(shown)


@pytest.mark.parametrize("broken", [
    {"batch": "full_batch"},  # a mini-batch algorithm said to step over all n examples
    {"private": False},
    {"own_analysis": "", "selection": frozenset({"liu_talwar"}), "selection_requires": ("composition", "pure")},
    {"selection_requires": ("schedule", "basic")},
    {"selection_by_event": True},  # song2013 states neither a dp_event nor a calibrated σ
])
def test_the_check_catches_a_broken_tag(broken):
    cls = ALGORITHMS["song2013"]
    assert tag_problems(cls) == []
    twin = type("Broken", (cls,), {"tags": dataclasses.replace(cls.tags, **broken)})
    assert tag_problems(twin)
    assert tag_problems(type("Untagged", (Algorithm,), {"uses": frozenset()}))


# What the legends called each algorithm before the names moved onto the algorithms: unchanged.
LEGEND_NAMES = {
    "erm": "ERM (exact minimiser)",
    "sgd": "SGD (non-private)",
    "dp_sgd": "DP-SGD",
    "dp_lssgd": "DP-LSSGD",
    "pidp_sgd": "PIDP-SGD",
    "noisy_gd": "noisy GD",
    "bolt_on": "bolt-on (output perturbation of SGD)",
    "output_perturbation": "output perturbation",
    "song2013": "private SGD (Song et al.)",
    "song2013_nonprivate": "non-private SGD (Song et al.)",
    "bassily2014": "DP-SGD (Bassily et al.)",
}


@pytest.mark.parametrize("name", sorted(LEGEND_NAMES))
def test_legend_names_are_the_display_names(name):
    assert names.algorithm(name) == LEGEND_NAMES[name]
    assert names.non_private(name) == (name in ("erm", "sgd", "song2013_nonprivate"))


def test_an_unregistered_algorithm_keeps_its_name_in_a_legend():
    assert names.algorithm("my$algo") == r"my\$algo" and not names.non_private("my$algo")


GRID = """
name: tiny
datasets: [{name: synthetic, n: 600, dim: 3}]
epsilon: [1]
batch_size: [50]
lr: [0.05, 1]
epochs: 1
validation: 0.1
"""


@pytest.mark.parametrize("algorithms, privacy, refused, supported", [
    ("[dp_sgd, noisy_gd]", "papernot_steinke", "noisy_gd", "dp_adam, dp_ftrl, dp_lssgd, dp_sgd"),
    ("[{name: song2013, composition: advanced}]", "liu_talwar", "song2013",
     "song2013 with basic composition"),
    ("[dp_sgd]", "liu_talwar", "dp_sgd", "song2013 with basic composition"),
])
def test_a_private_selection_refuses_what_it_cannot_account(algorithms, privacy, refused, supported):
    grid = yaml.safe_load(GRID + f"algorithms: {algorithms}\nselect: {{candidates: [lr], privacy: {privacy}, "
                          "distribution: geometric}\n")
    with pytest.raises(ValueError) as caught:
        Grid.model_validate(grid)
    assert (f"select validation: {privacy} cannot account the selection of {refused} (supported: {supported}); "
            "use privacy: non_private or another grid") in str(caught.value)


@pytest.mark.parametrize("algorithms, privacy", [
    ("[sgd, dp_sgd, dp_lssgd, dp_ftrl]", "papernot_steinke"),
    ("[song2013_nonprivate, song2013]", "liu_talwar"),
])
def test_a_private_selection_accepts_what_it_can_account(algorithms, privacy):
    Grid.model_validate(yaml.safe_load(GRID + f"algorithms: {algorithms}\nselect: {{candidates: [lr], "
                                       f"privacy: {privacy}, distribution: geometric}}\n"))
