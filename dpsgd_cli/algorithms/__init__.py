"""Training algorithms, by the name a grid uses. Each is a small class; iterative ones are gradient chains."""

# The grid axes an algorithm may use (or override); defined before the algorithms import it.
AXES = ("epsilon", "batch_size", "lr", "epochs", "l2", "clip_norm")

from dpsgd_cli.algorithms.base import Algorithm, Outcome, Setting  # noqa: E402
from dpsgd_cli.algorithms.erm import ERM  # noqa: E402
from dpsgd_cli.algorithms.sgd import DPSGD, SGD  # noqa: E402

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (ERM, SGD, DPSGD)}

__all__ = ["AXES", "ALGORITHMS", "Algorithm", "Outcome", "Setting"]
