"""Models, by the name a grid uses."""

from dpsgd_cli.models.base import Batch, Model
from dpsgd_cli.models.logreg import LogisticRegression
from dpsgd_cli.models.mlp import MLP

MODELS: dict[str, type[Model]] = {cls.name: cls for cls in (LogisticRegression, MLP)}


def make_model(name: str, d: int, l2: float, options: dict | None = None) -> Model:
    cls = MODELS[name]
    cls.Options(**(options or {}))  # validated again: a model may be built outside a grid
    return cls(d=d, l2=l2, **(options or {}))


__all__ = ["Batch", "LogisticRegression", "MLP", "Model", "MODELS", "make_model"]
