"""Opacus side of cases 6 and 8, standalone (numpy, torch and opacus only; never a dependency of dpsgd).

Case 8 runs `prepare` in a pinned worker (benchmarks.sides, possibly in another interpreter: `python -m
benchmarks --opacus-python /path/to/venv/bin/python`); case 6's calibration timings go through `run_request`,
imported when `opacus` is importable here, else run as a script by that interpreter:

    python opacus_worker.py REQUEST.json   →   JSON on stdout

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


def prepare(spec: dict[str, Any]):
    """A pinned-side task (benchmarks.sides): `replicas` trainings of `steps` steps (default one epoch) of the
    logistic regression (nn.Linear(d, 1, bias=False)) or of the MLP (Linear(d, h) → tanh → Linear(h, 1), h = d,
    as dpsgd's), with grad_sample_mode `hooks` (Opacus's default) or `ew` (expanded weights), batches from
    Opacus's Poisson DataLoader or from a Bernoulli mask over the tensors (`sampler`). One torch thread
    (torch.set_num_threads(1), as OMP_NUM_THREADS=1 in the worker's environment). Only the training loops are
    timed; model, optimizer and make_private are set up outside the clock."""
    import logging
    import warnings

    import numpy as np
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("opacus").setLevel(logging.ERROR)
    with np.load(spec["data"]) as f:
        X, y, X_test, y_test = f["X_train"], f["y_train"], f["X_test"], f["y_test"]
    dtype = spec.get("dtype", "float64")
    tdtype = torch.float64 if dtype == "float64" else torch.float32
    Xt = torch.from_numpy(np.ascontiguousarray(X, dtype=dtype))
    yt = torch.from_numpy((np.asarray(y) > 0).astype(dtype))
    Xtest = torch.from_numpy(np.ascontiguousarray(X_test, dtype=dtype))
    n, d = Xt.shape
    B, lr, l2, clip, sigma = spec["batch_size"], spec["lr"], spec["l2"], spec["clip"], spec["sigma"]
    steps = int(spec.get("steps") or round(n / B))
    replicas, mode, kind = int(spec.get("replicas", 1)), spec.get("mode", "hooks"), spec.get("model", "logreg")
    loss_fn = torch.nn.BCEWithLogitsLoss()
    # "dataloader": Opacus's documented Poisson DataLoader (its per-example __getitem__ and collate cost ~1.8 ms
    # a step on adult, more than the training); "tensor": the same Poisson sampling by one mask over the tensor
    sampler = spec.get("sampler", "dataloader")

    def tensor_batches(seed: int):
        g = torch.Generator().manual_seed(seed)
        while True:
            chosen = torch.rand(n, generator=g) < B / n
            yield Xt[chosen], yt[chosen]

    def build(seed: int):
        torch.manual_seed(seed)
        if kind == "mlp":
            model = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, 1)).to(tdtype)
        else:
            model = torch.nn.Linear(d, 1, bias=False).to(tdtype)
            with torch.no_grad():
                model.weight.zero_()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=l2)
        loader = DataLoader(TensorDataset(Xt, yt), batch_size=B)
        return PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=clip,
            poisson_sampling=True, grad_sample_mode=mode)

    def run() -> dict[str, Any]:
        total, done, accuracies = 0.0, 0, []
        for seed in range(replicas):
            model, optimizer, loader = build(seed)
            start = time.perf_counter()
            taken = 0
            while taken < steps:
                for xb, yb in (loader if sampler == "dataloader" else tensor_batches(seed)):
                    optimizer.zero_grad(set_to_none=True)
                    loss_fn(model(xb).squeeze(-1), yb).backward()
                    optimizer.step()
                    taken += 1
                    if taken == steps:
                        break
            total += time.perf_counter() - start
            done += taken
            with torch.no_grad():
                out = model._module(Xtest).squeeze(-1).numpy()  # the wrapped module (ew forbids a bare forward)
            accuracies.append(float(np.mean(np.where(out >= 0, 1.0, -1.0) == y_test)))
        return {"seconds": total, "replica_steps": done, "test_accuracy": float(np.mean(accuracies))}

    return run, {"steps": steps, **versions()}


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
    out: dict[str, Any] = {"versions": versions()}
    if "calibrate" in request:
        out["calibrate"] = [calibration_times(**job) for job in request["calibrate"]]
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        result = run_request(json.load(fh))
    sys.stdout.write(json.dumps(result))
