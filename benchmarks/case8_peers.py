"""Case 8: dp_sgd against its peers, fairly: JAX (jit + scan + vmap), Opacus (hooks, ew), every side one core.

Every side is its own process under `taskset -c 0` with one thread (pinned.py), warmed up (JAX compiled: the
compile time is reported apart), and the sides are interleaved in rounds A B A B … (best of the rounds each);
the load average travels with every ratio. Unit: seconds per replica-step (one step of one model).

(a) logistic regression on adult (B = 256, 1 epoch, 118 steps), R = 1, 16, 64 replicas, float64 and float32:
    ours (`DPSGD.fit`), the JAX peer with the `vmap(grad)` clip and with the closed-form clip (jax_peer.py),
    Opacus (one model at a time: its per-replica-step time does not depend on R, measured at R = 1) with its
    documented Poisson DataLoader and with batches cut by one Bernoulli mask over the tensors (the DataLoader's
    per-example collate costs more than Opacus's training step on adult; the faster counts for the goals).
(b) the MLP (adult, h = d, tanh), 64 steps, float64 and float32 (the same dtype on both sides; `--quick`:
    float64 only): ours at R = 10 vs Opacus with hooks (both samplers) and with `grad_sample_mode="ew"`. The
    goal row: per dtype the fastest Opacus, and of the two dtypes the lower ratio.
(c) the fused grid's work: `dp_sgd`, 3 seeds × 8 ε of `kang_lr` (adult, 5 epochs = 589 steps): 24 replicas
    whose cells share 3 batch streams when the engine fuses them (`DPSGD_FUSE=0` turns the fusion off; before
    the fusion exists the variable is ignored), timed as the engine's `execute` (training, metrics, rows);
    against the JAX peer on the same steps (24 independent streams, and 3 streams × 8 models sharing each, the
    fusion done the JAX way) and Opacus's per-replica-step time. The goals compare the same work, training:
    ours as `train_together` of the 8 prepared cells (`ours_fused_fit`), the engine's execute shown beside it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Row, Skip, fmt_time, load
from benchmarks.pinned import Measured, Worker, interleave, load_text, mean_load

EPSILONS = [0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.0, 3.0]  # kang_lr's axis
GOAL_FUSED_OPACUS, GOAL_FUSED_JAX, GOAL_R1_JAX, GOAL_MLP = 100.0, 3.0, 1.0, 20.0
SAMPLERS = {"dataloader": "Opacus (DataLoader)", "tensor": "Opacus (tensor batches)"}


def per_step(m: Measured) -> float:
    return m.best / m.info["replica_steps"]


def _safe_prepare(worker: Worker, name: str, kind: str, **spec) -> dict[str, Any] | None:
    try:
        return worker.prepare(name, kind, **spec)
    except Skip:
        raise
    except Exception as exc:  # one broken variant must not sink the case
        return {"error": str(exc)[:200]}


def run(ctx) -> list[Row]:
    from dpsgd_cli.privacy.accounting import calibrate_sigma

    try:
        data = load({"name": "adult"})
    except Skip as skip:
        return [Row("8", "dp_sgd vs JAX and Opacus", note=f"skipped: {skip}")]
    n = data.n
    rounds = 2 if ctx.quick else ctx.k
    replica_counts = (1, 16) if ctx.quick else (1, 16, 64)
    dtypes = ("float64",) if ctx.quick else ("float64", "float32")
    sigma = calibrate_sigma(1.0, 1.0 / n**2, 256 / n, round(n / 256)).sigma
    with tempfile.TemporaryDirectory(prefix="dpsgd-bench-peers-") as tmp:
        path = str(Path(tmp) / "adult.npz")
        np.savez(path, X_train=data.X_train, y_train=data.y_train, X_test=data.X_test, y_test=data.y_test)
        common = dict(data=path, batch_size=256, lr=2.0, l2=1e-4, clip=1.0, sigma=sigma)
        rows = _logreg(ctx, common, rounds, replica_counts, dtypes)
        rows += _mlp(ctx, common, rounds)
        rows += _fused(ctx, common, rounds, rows)
    return rows


def _workers(ctx) -> dict[str, Worker]:
    return {"ours": Worker("ours"), "jax": Worker("jax", python=ctx.jax_python),
            "opacus": Worker("opacus", python=ctx.opacus.python if ctx.opacus.mode == "subprocess" else None)}


def _close(workers: dict[str, Worker]) -> None:
    for w in workers.values():
        w.close()


def _logreg(ctx, common, rounds, replica_counts, dtypes) -> list[Row]:
    rows: list[Row] = []
    workers = _workers(ctx)
    try:
        opacus_ok, compile_s = {}, {}
        for dtype in dtypes:
            try:
                for sampler in SAMPLERS:
                    info = workers["opacus"].prepare(f"op-{dtype}-{sampler}", "opacus", dtype=dtype, sampler=sampler,
                                                     **common)
                opacus_ok[dtype] = info
                ctx.versions.update({k: info[k] for k in ("torch", "opacus") if k in info})
            except Skip as skip:
                opacus_ok[dtype] = {"error": f"skipped: {skip}"}
        ctx.shared["opacus_logreg"] = {}
        for R in replica_counts:
            for dtype in dtypes:
                sides: dict[str, Any] = {}
                workers["ours"].prepare(f"o-{R}-{dtype}", "ours_logreg", replicas=R, dtype=dtype, data=common["data"])
                sides["ours"] = (lambda name: lambda: workers["ours"].run(name))(f"o-{R}-{dtype}")
                for clip in ("vmap", "closed"):
                    name = f"j-{R}-{dtype}-{clip}"
                    info = _safe_prepare(workers["jax"], name, "jax_logreg", replicas=R, dtype=dtype,
                                         clip_mode=clip, **common)
                    if info and "error" not in info:
                        compile_s[name] = info
                        sides[f"JAX {clip} clip"] = (lambda nm: lambda: workers["jax"].run(nm))(name)
                    else:
                        rows.append(Row("8a", f"logreg R = {R} {dtype}: JAX {clip} clip", note=f"error: {info}"))
                if replica_counts[0] == R and "error" not in opacus_ok[dtype]:
                    for sampler, label in SAMPLERS.items():
                        sides[label] = (lambda nm: lambda: workers["opacus"].run(nm))(f"op-{dtype}-{sampler}")
                measured = interleave(sides, rounds)
                ours = measured.pop("ours")
                for label in SAMPLERS.values():
                    if label in measured:
                        ctx.shared["opacus_logreg"][(dtype, label)] = measured[label]
                    elif (dtype, label) in ctx.shared["opacus_logreg"]:  # R-independent (one model at a time)
                        measured[label] = ctx.shared["opacus_logreg"][(dtype, label)]
                ctx.shared.setdefault("logreg", {})[(R, dtype)] = (ours, measured)
                jax_best = min((per_step(m), k) for k, m in measured.items() if k.startswith("JAX")) \
                    if any(k.startswith("JAX") for k in measured) else None
                for peer, m in measured.items():
                    ratio = per_step(m) / per_step(ours)
                    goal, met, goal_id = "–", None, ""
                    if peer.startswith("JAX") and R == 1 and dtype == "float64" and jax_best and peer == jax_best[1]:
                        goal, met, goal_id = f"≥ {GOAL_R1_JAX:g}× (best JAX)", ratio >= GOAL_R1_JAX, "r1_jax"
                    extra = ""
                    if peer.startswith("JAX"):
                        c = compile_s[f"j-{R}-{dtype}-{peer.split()[1]}"]
                        extra = (f"; JAX compile {c['compile_s']:.2f} s (apart), pad P = {c['pad']}, "
                                 f"overflowing steps {m.info.get('overflow_steps')}")
                    if peer.startswith("Opacus") and replica_counts[0] != R:
                        extra = "; Opacus trains one model at a time: its R = 1 per-replica-step time"
                    rows.append(Row(
                        "8a", f"dp_sgd logreg adult, R = {R}, {dtype}: ours vs {peer}",
                        ours=f"{fmt_time(per_step(ours))}/replica-step",
                        comparison=f"{fmt_time(per_step(m))}/replica-step", ratio=ratio, goal=goal, met=met,
                        goal_id=goal_id, load=mean_load(ours, m),
                        note=(f"{load_text(ours, m)}; best of {rounds} interleaved rounds; test accuracy ours "
                              f"{ours.info.get('test_accuracy', float('nan')):.4f}, {peer} "
                              f"{m.info.get('test_accuracy', float('nan')):.4f}{extra}"),
                        data={"replicas": R, "dtype": dtype, "ours": ours.json(), "peer": m.json()}))
        for dtype, info in opacus_ok.items():
            if "error" in info:
                rows.append(Row("8a", f"dp_sgd logreg adult {dtype}: ours vs Opacus", note=info["error"]))
    finally:
        _close(workers)
    return rows


def _mlp(ctx, common, rounds) -> list[Row]:
    """Per dtype (float64, and float32 unless --quick): ours R = 10 against each Opacus variant at the same dtype,
    all sides interleaved. The goal row: per dtype the best Opacus, and of the dtypes the lower ratio."""
    rows: list[Row] = []
    steps = 64  # one block of noise draws (streams.BLOCK_STEPS): fewer steps would time noise drawn and unused
    dtypes = ("float64",) if ctx.quick else ("float64", "float32")
    workers = {"ours": Worker("ours"), "opacus": _workers_opacus(ctx)}
    try:
        sides, skipped = {}, ""
        for dtype in dtypes:
            workers["ours"].prepare(f"mlp-{dtype}", "ours_mlp", replicas=10, steps=steps, data=common["data"],
                                    dtype=dtype)
            sides[("ours", dtype)] = (lambda nm: lambda: workers["ours"].run(nm))(f"mlp-{dtype}")
            for mode, sampler in (("hooks", "dataloader"), ("hooks", "tensor"), ("ew", "tensor")):
                name = f"mlp-{mode}-{sampler}-{dtype}"
                try:
                    workers["opacus"].prepare(name, "opacus", model="mlp", mode=mode, steps=steps, sampler=sampler,
                                              dtype=dtype, **common)
                    label = f"Opacus {mode}, {SAMPLERS[sampler].split('(')[1][:-1]}"
                    sides[(label, dtype)] = (lambda nm: lambda: workers["opacus"].run(nm))(name)
                except Skip as skip:
                    skipped = str(skip)
        measured = interleave(sides, rounds)
        peers = {key: m for key, m in measured.items() if key[0] != "ours"}
        if not peers:
            return [Row("8b", "dp_sgd MLP adult, R = 10: ours vs Opacus", goal=f"≥ {GOAL_MLP:g}×",
                        note=f"skipped: {skipped}")]
        best = {dtype: min((k for k in peers if k[1] == dtype), key=lambda k: per_step(peers[k]))
                for dtype in dtypes if any(k[1] == dtype for k in peers)}
        ratios = {dtype: per_step(peers[key]) / per_step(measured[("ours", dtype)]) for dtype, key in best.items()}
        goal_key = best[min(ratios, key=ratios.get)]
        for (peer, dtype), m in peers.items():
            ours = measured[("ours", dtype)]
            ratio = per_step(m) / per_step(ours)
            is_goal = (peer, dtype) == goal_key
            rows.append(Row(
                "8b", f"dp_sgd MLP adult h = d, {steps} steps, {dtype}: ours R = 10 vs {peer} (R = 1)",
                ours=f"{fmt_time(per_step(ours))}/replica-step", comparison=f"{fmt_time(per_step(m))}/replica-step",
                ratio=ratio, goal=f"≥ {GOAL_MLP:g}× (best Opacus, lower dtype)" if is_goal else "–",
                met=(ratio >= GOAL_MLP) if is_goal else None, goal_id="mlp_opacus" if is_goal else "",
                load=mean_load(ours, m),
                note=(f"{load_text(ours, m)}; best of {rounds} interleaved rounds; {dtype} on both sides, tanh, "
                      f"P = {d_params(common)}"),
                data={"ours": ours.json(), "peer": m.json(), "steps": steps, "dtype": dtype}))
    finally:
        _close(workers)
    return rows


def d_params(common) -> str:
    with np.load(common["data"]) as f:
        d = f["X_train"].shape[1]
    return f"{d * d + 2 * d + 1} parameters"


def _workers_opacus(ctx) -> Worker:
    return Worker("opacus", python=ctx.opacus.python if ctx.opacus.mode == "subprocess" else None)


def _fused(ctx, common, rounds, earlier: list[Row]) -> list[Row]:
    """24 replicas (3 seeds × 8 ε), 5 epochs: the engine fused and not, the fused training alone, the JAX peer at
    R = 24, Opacus. The goals compare the same work: training (ours: `train_together` of the 8 prepared cells; the
    peers train and nothing else); the engine's `execute` (training, final metrics of 24 runs, rows) is shown
    beside them."""
    seeds, epsilons = (3, EPSILONS) if not ctx.quick else (3, EPSILONS[:2])
    R = seeds * len(epsilons)
    with np.load(common["data"]) as f:
        n = f["X_train"].shape[0]
    steps = round(5 * n / 256)
    fused, unfused = Worker("ours-fused", env={"DPSGD_FUSE": None}), Worker("ours-unfused", env={"DPSGD_FUSE": "0"})
    jax = Worker("jax", python=ctx.jax_python)
    rows: list[Row] = []
    try:
        spec = dict(epsilons=epsilons, seeds=seeds, epochs=5)
        fused.prepare("grid", "ours_grid", **spec)
        fused.prepare("fit", "ours_fused_fit", data=common["data"], **spec)
        unfused.prepare("grid", "ours_grid", **spec)
        sides = {"ours": lambda: fused.run("grid"), "ours training": lambda: fused.run("fit"),
                 "ours DPSGD_FUSE=0": lambda: unfused.run("grid")}
        compile_info = {}
        for clip in ("vmap", "closed"):
            for streams, share in ((R, 1), (seeds, len(epsilons))):
                name = f"JAX {clip} clip, {streams} streams × {share}"
                info = _safe_prepare(jax, name, "jax_logreg", replicas=streams, share=share, dtype="float64",
                                     clip_mode=clip, steps=steps, **common)
                if info and "error" not in info:
                    compile_info[name] = info
                    sides[name] = (lambda nm: lambda: jax.run(nm))(name)
        measured = interleave(sides, rounds)
    finally:
        for w in (fused, unfused, jax):
            w.close()
    ours, trained = measured.pop("ours"), measured.pop("ours training")
    ours_step, trained_step = ours.best / (R * steps), trained.best / (R * steps)
    what = f"fused dp_sgd ({seeds} seeds × {len(epsilons)} ε, adult, {steps} steps), per replica-step"
    base = measured.pop("ours DPSGD_FUSE=0")
    rows.append(Row("8c", f"{what}: fused vs DPSGD_FUSE=0 (same engine)", ours=f"{fmt_time(ours_step)}",
                    comparison=f"{fmt_time(base.best / (R * steps))}", ratio=base.best / ours.best,
                    load=mean_load(ours, base),
                    note=(f"{load_text(ours, base)}; engine execute (training, metrics, rows) {fmt_time(ours.best)} "
                          f"vs {fmt_time(base.best)}, {ours.info.get('runs')} runs; the training alone "
                          f"{fmt_time(trained.best)} ({trained.best / ours.best:.0%} of execute)"),
                    data={"ours": ours.json(), "unfused": base.json(), "training": trained.json(), "replicas": R,
                          "steps": steps}))
    jax_rows = {k: m for k, m in measured.items() if k.startswith("JAX")}
    if jax_rows:
        best = min(jax_rows, key=lambda k: jax_rows[k].best)
        for k, m in jax_rows.items():
            is_goal = k == best
            c = compile_info[k]
            note = (f"JAX compile {c['compile_s']:.2f} s (apart), pad {c['pad']}; "
                    "'N streams × S': S models share each batch stream")
            rows.append(Row("8c", f"{what}: ours (training) vs {k}", ours=fmt_time(trained_step),
                            comparison=fmt_time(m.best / (R * steps)), ratio=m.best / trained.best,
                            goal=f"≥ {GOAL_FUSED_JAX:g}× (best JAX)" if is_goal else "–",
                            met=(m.best / trained.best >= GOAL_FUSED_JAX) if is_goal else None,
                            goal_id="fused_jax" if is_goal else "", load=mean_load(trained, m),
                            note=f"{load_text(trained, m)}; {note}; both sides train only",
                            data={"ours": trained.json(), "peer": m.json()}))
            if is_goal:
                rows.append(Row("8c", f"{what}: ours (engine execute: training, metrics, rows) vs {k}",
                                ours=fmt_time(ours_step), comparison=fmt_time(m.best / (R * steps)),
                                ratio=m.best / ours.best, load=mean_load(ours, m),
                                note=f"{load_text(ours, m)}; ours also computes 24 runs' final metrics and rows",
                                data={"ours": ours.json(), "peer": m.json()}))
    opacus_rows = [r for r in earlier if r.case == "8a" and "float64: ours vs Opacus" in r.what and r.data]
    opacus = min(opacus_rows, key=lambda r: r.data["peer"]["best_s"], default=None)  # the faster sampler
    if opacus is not None:
        o_step = opacus.data["peer"]["best_s"] / opacus.data["peer"]["info"]["replica_steps"]
        for label, step, m, goal in (("training", trained_step, trained, True),
                                     ("engine execute", ours_step, ours, False)):
            ratio = o_step / step
            rows.append(Row("8c", f"{what}: ours ({label}) vs {opacus.what.split(' vs ')[-1]} (its R = 1 time per "
                                  f"replica-step)", ours=fmt_time(step), comparison=fmt_time(o_step), ratio=ratio,
                            goal=f"≥ {GOAL_FUSED_OPACUS:g}×" if goal else "–",
                            met=(ratio >= GOAL_FUSED_OPACUS) if goal else None,
                            goal_id="fused_opacus" if goal else "", load=mean_load(m),
                            note=(f"{load_text(m)} (ours), Opacus load {opacus.load}; Opacus trains one model at a "
                                  f"time, so its per-replica-step time at R = 1 is its time on this work")))
    return rows
