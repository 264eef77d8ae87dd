"""A plugin that breaks the contract: it adds half the noise it calibrates while claiming the calibrated ε (its
`dp_event`, the noise as run, gives a larger ε), and refuses a batch of one only once training has begun."""

from dpsgd_cli.algorithms.sgd import DPSGD
from dpsgd_cli.errors import UserError


class HalfNoise(DPSGD):
    name = "half_noise"

    def __init__(self, params=None, neighbours=None):
        super().__init__(params, neighbours)
        self.noise_scale = 0.5

    def prepare(self, setting, model, X, y, streams):
        if setting.batch_size == 1:
            raise UserError("half_noise trains on batches of two or more")
        return super().prepare(setting, model, X, y, streams)
