"""The benchmark's cases import, and the hooks they time exist (a refactor must not silently break them)."""

import importlib
import pkgutil

import numpy as np

import benchmarks
from dpsgd_cli.algorithms import ALGORITHMS, Setting
from dpsgd_cli.algorithms import pidp_sgd as pidp_module
from dpsgd_cli.algorithms.streams import ReplicaStreams
from dpsgd_cli.models import make_model


def test_every_case_module_imports_and_has_run():
    names = [m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("case")]
    assert len(names) == 7
    for name in names:
        assert callable(importlib.import_module(f"benchmarks.{name}").run)


def test_case3_times_the_influence_test_that_pidp_calls(monkeypatch):
    calls = []
    real = pidp_module.round_influence
    assert callable(pidp_module.round_eligible)  # case 3 times both
    monkeypatch.setattr(pidp_module, "round_influence", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 4))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    y = np.where(X[:, 0] > 0, 1.0, -1.0)
    setting = Setting(n=200, d=4, delta=1e-5, l2=1e-3, epsilon=1.0, batch_size=20, lr=0.5, epochs=2, clip_norm=1.0)
    ALGORITHMS["pidp_sgd"]({"sampling": "poisson"}).fit(setting, make_model("logreg", 4, 1e-3), X, y,
                                                        ReplicaStreams([0]))
    assert len(calls) == 2  # once per round
