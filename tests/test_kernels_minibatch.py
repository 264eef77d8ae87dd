"""The compiled mini-batch backend (algorithms/backends.py, _kernels_minibatch_numba.py): equals the NumPy chain up
to summation order, fused equals alone bit for bit on it, divergence stays per replica, and it is the path
`backend: auto` takes."""

import numpy as np
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Setting, backends
from dpsgd_cli.algorithms.chain import Checkpoints, GradientChain, train_together
from dpsgd_cli.algorithms.ops import (
    Adam,
    Clip,
    LaplacianSmoothing,
    Noise,
    ProjectBall,
    Scale,
    Sgd,
    WeightDecay,
    constant,
    inverse_sqrt,
)
from dpsgd_cli.algorithms.sampling import poisson_batches, shuffled_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import make_model
from tests.test_kernels import _data as kernel_data

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed (pip install 'dpsgd[numba]')")
SEEDS = [0, 3, 11]


def _data(n=240, d=7):
    """test_kernels' data (rows up to norm 1.6, so the clip at 0.5–1 acts on some examples), a bit larger."""
    return kernel_data(n, d)


def _setting(X, **kw):
    n, d = X.shape
    return Setting(**{**dict(n=n, d=d, delta=1e-5, l2=1e-2, epsilon=2.0, batch_size=20, lr=0.5, epochs=2,
                             clip_norm=0.7), **kw})


def _train(name, params, setting, X, y, backend, seeds=SEEDS):
    """(Outcome, the backend the chain ran on)."""
    model = make_model("logreg", X.shape[1], setting.l2)
    prepared = ALGORITHMS[name]({**params, "backend": backend}).prepare(setting, model, X, y, ReplicaStreams(seeds))
    outcome = prepared.train(model)
    return outcome, prepared.chain.ran_on


def _assert_close(fast, ref):
    scale_ = max(1.0, float(np.abs(ref.theta).max()))
    np.testing.assert_allclose(fast.theta, ref.theta, rtol=1e-12, atol=1e-13 * scale_)
    assert [row[0] for row in fast.trace] == [row[0] for row in ref.trace]
    for (_, obj_f, acc_f), (_, obj_r, acc_r) in zip(fast.trace, ref.trace):
        np.testing.assert_allclose(obj_f, obj_r, rtol=1e-12)
        np.testing.assert_array_equal(acc_f, acc_r)


CASES = [
    ("dp_sgd", {}, {"trace_every": 50}),  # Poisson, clip, noise, λ, checkpoints between kernel calls
    ("dp_sgd", {"accountant": "pld"}, {"l2": 0.0, "clip_norm": 2.0, "epochs": 1}),  # λ = 0, clip rarely acts
    # adaptive clipping: the norms moved per replica from the kernel's count and the count's noise stream
    ("dp_sgd", {"clip_quantile": 0.5}, {"trace_every": 50, "clip_norm": 0.1}),
    ("dp_adam", {"clip_quantile": 0.3, "clip_lr": 0.5, "clip_count_noise": 0.2}, {"lr": 0.05, "clip_norm": 2.0}),
    ("sgd", {}, {"batch_size": 240, "epochs": 5}),  # q = 1: the full batch, no clip, no noise
    ("sgd", {}, {"batch_size": 7, "trace_every": 33, "epochs": 1.5}),  # checkpoints not aligned to steps
    ("song2013", {}, {"batch_size": 10, "epochs": 2.5}),  # shuffled (a fresh permutation per pass), Z_t, Π
    ("song2013_nonprivate", {"schedule": "constant", "radius": 0.3}, {"batch_size": 9, "trace_every": 40}),
]


@needs_numba
@pytest.mark.parametrize("name, params, kw", CASES)
def test_kernel_equals_the_numpy_chain(name, params, kw):
    X, y = _data()
    setting = _setting(X, **kw)
    ref, ref_path = _train(name, params, setting, X, y, "numpy")
    fast, fast_path = _train(name, params, setting, X, y, "auto")
    assert (ref_path, fast_path) == ("numpy", "numba")  # auto takes the kernel: the comparison is not trivial
    assert ref.derived.pop("backend", "numpy") == "numpy" and fast.derived.pop("backend", "numba") == "numba"
    if "clip_quantile" in params:  # where the norms ended: the same count, each step's exp up to rounding
        final = np.array(fast.derived.pop("clip_norm_final"))
        np.testing.assert_allclose(final, ref.derived.pop("clip_norm_final"), rtol=1e-12)
        assert len(set(final.tolist()) - {setting.clip_norm}) == len(SEEDS)  # they moved, each its own way
    assert fast.derived == ref.derived
    _assert_close(fast, ref)
    if setting.batch_size < setting.n:  # the replicas differ (full-batch GD without noise is deterministic)
        assert not np.allclose(ref.theta[0], ref.theta[1])


def _chain(X, y, streams, *, radius=0.8, batches=None, l2=0.05, std=0.3, clip=0.6, trace=None, smoothing=()):
    noise = [Noise(std, streams.normal("noise", (X.shape[1],)))] if std is not None else []
    return GradientChain(batches=batches if batches is not None else poisson_batches(X, y, 0.1, streams),
                         ops=[*([Clip(clip)] if clip is not None else []), *noise, Scale(1 / 24), WeightDecay(l2),
                              *smoothing, Sgd(inverse_sqrt(0.8)), *([ProjectBall(radius)] if radius else [])],
                         checkpoints=Checkpoints(trace, X, y) if trace else None, examples_per_step=24,
                         backend="auto")


@needs_numba
@pytest.mark.parametrize("kw", [{}, {"radius": None, "l2": 0.0, "clip": None, "trace": 70},
                                {"std": None, "radius": 0.2}, {"shuffled": True}])
def test_chain_on_the_kernel_equals_numpy(kw):
    """A chain built by hand (projection, schedule c/√t, no clip / no noise / no λ, a permutation walked once)."""
    X, y = _data()
    model = make_model("logreg", X.shape[1], 0.05)
    theta0 = np.random.default_rng(5).normal(size=(len(SEEDS), X.shape[1]))
    runs = {}
    for backend in ("numpy", "auto"):
        streams = ReplicaStreams(SEEDS)
        options = dict(kw)
        if options.pop("shuffled", False):
            options["batches"] = shuffled_batches(X, y, 24, streams, reshuffle=False)
        chain = _chain(X, y, streams, **options)
        chain.backend = backend
        runs[backend] = (chain.run(model, theta0, 37), chain)
    (ref, ref_chain), (fast, fast_chain) = runs["numpy"], runs["auto"]
    assert (ref_chain.ran_on, fast_chain.ran_on) == ("numpy", "numba")
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-14)
    if ref_chain.checkpoints:
        assert [r[0] for r in fast_chain.checkpoints.rows] == [r[0] for r in ref_chain.checkpoints.rows]


@needs_numba
def test_fused_equals_alone_bit_for_bit_on_the_kernel():
    """An ε axis of dp_sgd beside sgd and adaptive clipping's dp_sgd and dp_adam (one Poisson stream, shared noise)
    trained together on the kernel, as vector lanes: each cell is exactly its run alone on the kernel, on the pair
    path (dot products, sums and clip counts in an order independent of the other cells)."""
    X, y = _data()
    model = make_model("logreg", X.shape[1], 1e-2)
    cells = [("dp_sgd", _setting(X, epsilon=eps, trace_every=60)) for eps in (0.5, 2.0, 8.0)]
    cells += [("sgd", _setting(X, trace_every=60)), ("dp_sgd", _setting(X, lr=0.1, epochs=1))]
    params = [{}] * len(cells) + [{"clip_quantile": 0.5}, {"clip_quantile": 0.3, "clip_count_noise": 0.2}]
    cells += [("dp_sgd", _setting(X, trace_every=60)), ("dp_adam", _setting(X, lr=0.05))]
    streams = SharedStreams(SEEDS)
    prepared = [ALGORITHMS[name](p).prepare(s, model, X, y, streams) for (name, s), p in zip(cells, params)]
    streams.close()
    fused = train_together(model, prepared)
    assert all(p.chain.ran_on == "numba" for p in prepared)
    for (name, s), p, together in zip(cells, params, fused):
        alone, path = _train(name, p, s, X, y, "auto")
        assert path == "numba"
        np.testing.assert_array_equal(together.theta, alone.theta)
        assert together.derived == alone.derived
        for (n_a, obj_a, acc_a), (n_b, obj_b, acc_b) in zip(together.trace, alone.trace, strict=True):
            assert n_a == n_b
            np.testing.assert_array_equal(obj_a, obj_b)
            np.testing.assert_array_equal(acc_a, acc_b)


@needs_numba
def test_a_diverged_replica_ends_nan_without_stopping_the_others():
    X, y = _data()
    model = make_model("logreg", X.shape[1], 0.05)
    theta0 = np.zeros((len(SEEDS), X.shape[1]))
    theta0[1] = np.nan
    out = {}
    for backend in ("numpy", "auto"):
        chain = _chain(X, y, ReplicaStreams(SEEDS))
        chain.backend = backend
        out[backend] = chain.run(model, theta0, 20)
        assert chain.ran_on == ("numba" if backend == "auto" else "numpy")
    assert np.isnan(out["auto"][1]).all() and np.isfinite(out["auto"][[0, 2]]).all()
    np.testing.assert_allclose(out["auto"], out["numpy"], rtol=1e-12, atol=1e-14)  # NaN where NumPy has NaN


@needs_numba
def test_where_the_kernel_does_not_apply():
    """NumPy stays for: backend numpy, dp_lssgd's smoothing, float32, the MLP; a group mixing both runs NumPy."""
    X, y = _data()
    setting = _setting(X)
    assert _train("dp_sgd", {}, setting, X, y, "numpy")[1] == "numpy"
    model = make_model("logreg", X.shape[1], setting.l2)
    lssgd = ALGORITHMS["dp_lssgd"]().prepare(setting, model, X, y, ReplicaStreams(SEEDS))
    lssgd.train(model)
    assert lssgd.chain.ran_on == "numpy"
    X32 = X.astype(np.float32)
    f32 = ALGORITHMS["sgd"]().prepare(setting, model, X32, y.astype(np.float32), ReplicaStreams(SEEDS))
    f32.train(model)
    assert f32.chain.ran_on == "numpy"
    mlp = make_model("mlp", X.shape[1], setting.l2)
    p = ALGORITHMS["dp_sgd"]().prepare(setting, mlp, X, y, ReplicaStreams(SEEDS))
    p.train(mlp)
    assert p.chain.ran_on == "numpy"
    smoothed = _chain(X, y, ReplicaStreams(SEEDS), smoothing=(LaplacianSmoothing(1.0),))
    assert not backends.MINI_BATCH.supports(backends.plan(smoothed, model, np.zeros((3, X.shape[1]))))


def test_backend_numba_without_numba_is_a_user_error(monkeypatch):
    X, y = _data()
    monkeypatch.setattr(compiled, "HAVE_NUMBA", False)
    model = make_model("logreg", X.shape[1], 1e-2)
    with pytest.raises(UserError, match="numba is not installed"):
        _train("sgd", {}, _setting(X), X, y, "numba")
    assert _train("sgd", {}, _setting(X), X, y, "auto")[1] == "numpy"
    assert model is not None


@needs_numba
@pytest.mark.parametrize("steps", [(30, 30), (12, 45), (45, 12)])
def test_a_stream_shared_by_compiled_and_numpy_chains(steps):
    """dp_lssgd-like (smoothing: NumPy) beside a compiled chain on one Poisson stream: the NumPy chain replays the
    batches the kernel takes, also past the kernel's last step; each equals its run alone, bit for bit."""
    from dpsgd_cli.algorithms.chain import run_together

    X, y = _data()
    model = make_model("logreg", X.shape[1], 0.05)
    theta0 = np.zeros((len(SEEDS), X.shape[1]))

    def chains(streams):
        fast, slow = _chain(X, y, streams), _chain(X, y, streams, std=0.1, smoothing=(LaplacianSmoothing(0.5),))
        fast.stream = slow.stream = ("poisson", 0.1)
        return fast, slow

    streams = SharedStreams(SEEDS)
    fast, slow = chains(streams)
    streams.close()
    together = run_together(model, [fast, slow], [theta0, theta0], list(steps))
    assert (fast.ran_on, slow.ran_on) == ("numba", "numpy")
    for k in range(2):
        alone = chains(ReplicaStreams(SEEDS))[k]
        np.testing.assert_array_equal(together[k], alone.run(model, theta0, steps[k]))


def _cells_args(C, R, d, steps, rng):
    """The kernel's per-cell arguments for C cells that differ in everything a cell sets (clip or not and its norm
    per replica, noise or not and its slot, its std, scale, λ, learning rates, Adam or SGD, projection, an adaptive
    clip and its count's slot and fields), the last one inactive when C > 2."""
    active = np.ones(C, dtype=bool)
    if C > 2:
        active[-1] = False
    slot = rng.integers(-1, 2, size=C)
    do_clip = rng.random(C) < 0.7
    count_slot = np.where((slot >= 0) & do_clip & (rng.random(C) < 0.5), rng.integers(0, 2, size=C), -1)
    adapt = np.stack([rng.uniform(0.5, 2.0, C), rng.uniform(0.2, 0.8, C), rng.uniform(0.1, 0.5, C),
                      rng.uniform(0.5, 3.0, C), np.full(C, 8.0)], axis=1)  # (σ_Δ, γ, η_C, σ_b, B)
    adam = rng.random(C) < 0.3
    ops = [[*([Noise(rng.uniform(0.1, 2.0), iter(()))] if slot[c] >= 0 and count_slot[c] < 0 else []),
            Scale(rng.uniform(0.02, 0.1)),
            WeightDecay(0.0 if rng.random() < 0.3 else rng.uniform(0, 0.1)),
            Adam(constant(1.0), 0.9, 0.99, 1e-6) if adam[c] else Sgd(constant(1.0)),
            *([ProjectBall(rng.uniform(0.5, 3.0))] if rng.random() < 0.5 else [])] for c in range(C)]
    codes, vals = backends._programs([GradientChain(iter(()), o) for o in ops])
    steps_values = np.ones((C, steps, 3))  # (η_t, 1 − β₁ᵗ, 1 − β₂ᵗ)
    steps_values[:, :, 0] = rng.uniform(0.1, 2.0, (C, steps)) * np.where(adam, 0.05, 1.0)[:, None]
    t = np.arange(1, steps + 1)
    steps_values[adam, :, 1], steps_values[adam, :, 2] = 1 - 0.9**t, 1 - 0.99**t
    return dict(active=active, slot=slot, clip=rng.uniform(0.2, 1.5, (C, R)), do_clip=do_clip,
                codes=codes, vals=vals, lrs=steps_values, count_slot=count_slot, adapt=adapt)


def _call(kernel, TH, X, P, y, x_norm, idx, noise, counts, args, lanes):
    """The kernel on TH in place; the clip norms where it left them."""
    clip = args["clip"].copy()  # moved in place by the adaptive clips
    kernel(TH, args["active"], X, P, y, x_norm, idx, noise, args["slot"], clip, args["do_clip"],
           args["codes"], args["vals"], args["lrs"], lanes, np.zeros(TH.shape), np.zeros(TH.shape), counts,
           args["count_slot"], args["adapt"], backends.fixed_arguments(None, None, TH.shape[1], *TH.shape))
    return clip


@needs_numba
@pytest.mark.parametrize("d, density", [(21, 1.0), (16, 1.0), (5, 1.0), (21, 0.2), (16, 0.3), (5, 0.4)])
def test_each_cell_is_the_same_whatever_shares_its_call(d, density):
    """The kernel itself: a cell's θ is bit for bit the same alone (pair path or one lane) and among C = 3, 5, 8,
    9, 17 cells, whichever of them are vector lanes (all: remainder lanes, several blocks of 8; what
    `mini_batch_steps` takes; a few; none), with an odd number of rows in some steps (the lanes take rows two at a
    time) and a NaN replica; d with whole blocks of 8 and a tail, whole blocks only, the tail only; rows read
    densely and by their nonzeros (`RowNonzeros`; sparse X with an all-zero and an all-nonzero row), each layout
    with its own order: bit for bit within a layout, to 1e-12 between them (the same NaN replica)."""
    from dpsgd_cli.models.rows import RowNonzeros, row_norms

    kernel = backends.MINI_BATCH.load().mb_logreg
    rng = np.random.default_rng(7)
    n, R, steps = 60, 3, 9
    X = rng.normal(size=(n, d)) * rng.uniform(0.1, 1.0, size=(n, 1))
    if density < 1:
        X *= rng.random((n, d)) < density
        X[0], X[1] = 0.0, rng.normal(size=d)  # a row with no nonzero, one with every column
    layouts = {"dense": np.zeros((0, 0), dtype=np.uint64), "sparse": RowNonzeros.of(X, max_density=2.0).packed}
    y = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    x_norm = row_norms(X)
    idx = np.full((steps, R, 13), -1, dtype=np.int64)
    for t in range(steps):
        for r in range(R):
            k = rng.integers(4, 14)  # odd and even batch sizes
            idx[t, r, :k] = rng.choice(n, size=k, replace=False)
    noise, counts = rng.normal(size=(2, steps, R, d)), rng.normal(size=(2, steps, R))
    for C in (3, 5, 8, 9, 17):
        args = _cells_args(C, R, d, steps, rng)
        TH0 = rng.normal(size=(C, R, d)) * 0.3
        TH0[1, 2] = np.nan  # one diverged replica of one cell
        runs, norms = {}, {}
        for lanes in sorted({C, backends.lane_cells(C), 3, 0}):
            for layout, P in layouts.items():
                TH = TH0.copy()
                norms[lanes, layout] = _call(kernel, TH, X, P, y, x_norm, idx, noise, counts, args, lanes)
                runs[lanes, layout] = TH
        for lanes, layout in runs:
            np.testing.assert_array_equal(runs[lanes, layout], runs[0, layout])
            np.testing.assert_array_equal(norms[lanes, layout], norms[0, layout])
        np.testing.assert_allclose(runs[0, "sparse"], runs[0, "dense"], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(norms[0, "sparse"], norms[0, "dense"], rtol=1e-12)
        moved = (args["count_slot"] >= 0) & args["active"]
        assert np.all(norms[0, "dense"][moved] != args["clip"][moved])
        np.testing.assert_array_equal(norms[0, "dense"][~moved], args["clip"][~moved])
        for layout in layouts:
            assert np.isnan(runs[0, layout][1, 2]).all()
            assert np.isfinite(np.delete(runs[0, layout][1], 2, axis=0)).all()
            assert not np.array_equal(runs[0, layout][0], TH0[0])
            assert np.array_equal(runs[0, layout][-1], TH0[-1])
        for c, lanes in zip(range(C), [0, 1] * C):
            one = {k: v[c:c + 1] for k, v in args.items()}
            for layout, P in layouts.items():
                TH = TH0[c:c + 1].copy()
                clip = _call(kernel, TH, X, P, y, x_norm, idx, noise, counts, one, lanes)
                np.testing.assert_array_equal(TH[0], runs[0, layout][c])
                np.testing.assert_array_equal(clip[0], norms[0, layout][c])


@needs_numba
def test_exp_fixed_is_within_one_ulp_of_libm():
    """The kernel's exp (arithmetic only, so it runs in vector lanes): ≤ 1 ulp from np.exp on [−708, 709], NaN
    stays NaN, and the clamp outside (σ's 1/(1 + eˣ) moves by < 1e−307 there)."""
    import numba

    from dpsgd_cli.algorithms._kernels_minibatch_numba import exp_fixed

    @numba.njit
    def many(x, out):
        for k in range(x.shape[0]):
            out[k] = exp_fixed(x[k])

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-40, 40, 200_000), rng.uniform(-708, 709, 20_000), [0.0, -0.0, 1e-300, 709.0,
                                                                                        -708.0, np.log(2.0)]])
    out = np.empty_like(x)
    many(x, out)
    ref = np.exp(x)
    ulps = np.abs(out - ref) / np.spacing(ref)
    assert ulps.max() <= 1.0 and (ulps == 0).mean() > 0.8
    edge = np.array([np.nan, 710.0, np.inf, -709.0, -np.inf])
    out = np.empty_like(edge)
    many(edge, out)
    assert np.isnan(out[0]) and out[1] == out[2] == exp_fixed(709.0) and out[3] == out[4] == exp_fixed(-708.0)
    assert 1.0 / (1.0 + out[1]) < 1e-307 and 1.0 / (1.0 + out[3]) == 1.0
