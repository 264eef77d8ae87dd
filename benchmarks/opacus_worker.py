"""Opacus side of cases 1 and 6, standalone (numpy, torch and opacus only; never a dependency of dpsgd).

Imported by the benchmark when `opacus` is importable in its own interpreter; otherwise run as a script by
another interpreter that has it (`python -m benchmarks --opacus-python /path/to/venv/bin/python`):

    python opacus_worker.py REQUEST.json   →   JSON on stdout

The request names an .npz (X_train, y_train, X_test, y_test) and the settings; see `run_request`.

DP-SGD with Opacus as its documentation shows it: nn.Linear(d, 1, bias=False) from zero, BCE-with-logits loss
(mean), torch.optim.SGD(lr, weight_decay=λ), PrivacyEngine.make_private(noise_multiplier=σ, max_grad_norm=C,
poisson_sampling=True) over a DataLoader(batch_size=B): per-example gradients, clip to C, add N(0, σ²C²),
divide by the expected batch size, then the λθ of weight decay and the step — the same update as dpsgd's
dp_sgd. Opacus trains one model at a time: R replicas are R runs one after another. Only the training loop is
timed (model, optimizer and make_private set up outside the clock).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def versions() -> dict[str, str]:
    import opacus
    import torch

    return {"torch": torch.__version__, "opacus": opacus.__version__, "torch_threads": str(torch.get_num_threads())}


def train_epochs(X, y, X_test, y_test, *, batch_size: int, lr: float, clip: float, sigma: float, l2: float,
                 replicas: int, k: int, dtype: str = "float64") -> dict[str, Any]:
    """k trials of `replicas` one-epoch trainings; the seconds of each trial's training loops, the steps done and
    the test accuracy of every trained model (of the last trial)."""
    import logging
    import warnings

    import numpy as np
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    logging.getLogger("opacus").setLevel(logging.ERROR)
    tdtype = torch.float64 if dtype == "float64" else torch.float32
    Xt = torch.from_numpy(np.ascontiguousarray(X, dtype=dtype))
    yt = torch.from_numpy((np.asarray(y) > 0).astype(dtype))
    d = Xt.shape[1]
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def setup(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(d, 1, bias=False).to(tdtype)
        with torch.no_grad():
            model.weight.zero_()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=l2)
        loader = DataLoader(TensorDataset(Xt, yt), batch_size=batch_size)
        engine = PrivacyEngine(accountant="rdp")
        return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
                                   max_grad_norm=clip, poisson_sampling=True)

    trials, steps, accuracies = [], 0, []
    for _ in range(k):
        total, steps, accuracies = 0.0, 0, []
        for seed in range(replicas):
            model, optimizer, loader = setup(seed)
            start = time.perf_counter()
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = loss_fn(model(xb).squeeze(-1), yb)
                loss.backward()
                optimizer.step()
                steps += 1
            total += time.perf_counter() - start
            w = model._module.weight.detach().cpu().numpy().reshape(-1)
            accuracies.append(float(np.mean(np.where(X_test @ w >= 0, 1.0, -1.0) == y_test)))
        trials.append(total)
    return {"times_s": trials, "steps": steps, "test_accuracy": accuracies, "dtype": dtype, "replicas": replicas}


def calibration_times(epsilons: list[float], delta: float, sample_rate: float, steps: int, k: int,
                      accountant: str) -> dict[str, Any]:
    """Seconds of Opacus's get_noise_multiplier for each ε (k trials; the best trial per ε), σ or the error."""
    from opacus.accountants.utils import get_noise_multiplier

    seconds, sigmas = [], []
    for eps in epsilons:
        best, sigma = float("inf"), None
        for _ in range(k):
            start = time.perf_counter()
            try:
                sigma = float(get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=sample_rate,
                                                   steps=steps, accountant=accountant))
            except Exception as exc:  # e.g. "The privacy budget is too low." for small ε with RDP
                sigma = f"{type(exc).__name__}: {exc}"
            best = min(best, time.perf_counter() - start)
        seconds.append(best)
        sigmas.append(sigma)
    return {"epsilons": epsilons, "seconds": seconds, "sigmas": sigmas, "accountant": accountant}


def run_request(request: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {"versions": versions()}
    if "train" in request:
        data = np.load(request["data"])
        out["train"] = [train_epochs(data["X_train"], data["y_train"], data["X_test"], data["y_test"], **job)
                        for job in request["train"]]
    if "calibrate" in request:
        out["calibrate"] = [calibration_times(**job) for job in request["calibrate"]]
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        result = run_request(json.load(fh))
    sys.stdout.write(json.dumps(result))
