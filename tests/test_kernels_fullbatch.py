"""The compiled full-batch backend (algorithms/backends.py, _kernels_fullbatch_numba.py): `noisy_gd` on it equals
the NumPy chain up to summation order, a replica's run is bit for bit the same whatever shares the call (other
seeds, other cells), the backend setting is respected, and run ids do not see it."""

import numpy as np
import pytest

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Setting, backends
from dpsgd_cli.algorithms.chain import GradientChain, train_together
from dpsgd_cli.algorithms.ops import Clip, Noise, ProjectBall, ProjectBox, Scale, Sgd, WeightDecay, constant
from dpsgd_cli.algorithms.sampling import full_batches, poisson_batches
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import make_model
from tests.test_kernels import _data as kernel_data

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed (pip install 'dpsgd[numba]')")
SEEDS = [0, 3, 11]


def _data(n=203, d=11):
    """test_kernels' data: rows up to norm 1.6, so a clip at C < 1.6 acts on some examples; n not a multiple of
    the kernel's row block."""
    return kernel_data(n, d)


def _setting(X, **kw):
    n, d = X.shape
    return Setting(**{**dict(n=n, d=d, delta=1e-5, l2=0.05, epsilon=1.0, lr=1.5, epochs=25, clip_norm=0.8), **kw})


def _fit(params, setting, X, y, backend, seeds=SEEDS):
    model = make_model("logreg", X.shape[1], setting.l2)
    return ALGORITHMS["noisy_gd"]({**params, "backend": backend}).fit(setting, model, X, y, ReplicaStreams(seeds))


def _assert_close(fast, ref):
    np.testing.assert_allclose(fast.theta, ref.theta, rtol=1e-12, atol=1e-14)
    assert [row[0] for row in fast.trace] == [row[0] for row in ref.trace]
    for (_, obj_f, acc_f), (_, obj_r, acc_r) in zip(fast.trace, ref.trace):
        np.testing.assert_allclose(obj_f, obj_r, rtol=1e-12)
        np.testing.assert_array_equal(acc_f, acc_r)


CASES = [
    ({}, {}),  # dynamics accountant, clip active on some rows (C = 0.8 < ‖x‖ up to 1.6), λθ, noise
    ({"accountant": "composition", "radius": 0.3}, {"clip_norm": 5.0}),  # the projection binds; clip inactive
    ({"accountant": "minimum"}, {"trace_every": 406, "epochs": 7}),  # checkpoints every second step
    ({"accountant": "composition"}, {"l2": 0.0, "epochs": 3}),  # λ = 0: no λθ term
]


@needs_numba
@pytest.mark.parametrize("params, kw", CASES)
def test_kernel_equals_the_numpy_chain(params, kw):
    X, y = _data()
    setting = _setting(X, **kw)
    fast, ref = _fit(params, setting, X, y, "auto"), _fit(params, setting, X, y, "numpy")
    assert (fast.derived["backend"], ref.derived["backend"]) == ("numba", "numpy")
    assert not np.array_equal(fast.theta, ref.theta) or kw.get("epochs") == 3  # really another path (rounding)
    _assert_close(fast, ref)
    assert {k: v for k, v in fast.derived.items() if k != "backend"} == \
        {k: v for k, v in ref.derived.items() if k != "backend"}  # σ, ε, guarantee inputs: the same accounting
    assert fast.guarantee == ref.guarantee


@needs_numba
def test_a_replica_does_not_depend_on_what_shares_the_call():
    """Seed 11's run, alone and beside 1 to 36 other seeds (different positions among the kernel's vector lanes,
    padding and column counts), and fused with cells of other ε and accountants and dp_sgd with adaptive clipping
    at q = 1: the same bits."""
    X, y = _data()
    setting = _setting(X, trace_every=203 * 4)
    alone = _fit({}, setting, X, y, "numba", seeds=[11])
    # 1–8 columns pad to 8, 13 to 16, 37 to 40: LLVM's vector body, its unrolled body and the tail all take part
    for seeds in ([0, 11], [11, 4, 5], [1, 2, 3, 4, 11], [11, 1, 2, 3, 4, 5, 6, 7], [*range(12), 20],
                  [*range(12, 30), 11, *range(30, 48)]):
        other = _fit({}, setting, X, y, "numba", seeds=seeds)
        np.testing.assert_array_equal(other.theta[seeds.index(11)], alone.theta[0])
        for (_, obj_a, _), (_, obj_o, _) in zip(alone.trace, other.trace):
            assert obj_o[seeds.index(11)] == obj_a[0]
    model = make_model("logreg", X.shape[1], setting.l2)
    streams = SharedStreams(SEEDS)
    cells = [({"accountant": acc}, eps) for acc in ("dynamics", "composition") for eps in (0.5, 1.0, 4.0)]
    prepared = [ALGORITHMS["noisy_gd"]({**params, "backend": "numba"}).prepare(
        _setting(X, epsilon=eps, trace_every=203 * 4), model, X, y, streams) for params, eps in cells]
    adaptive = ALGORITHMS["dp_sgd"]({"clip_quantile": 0.5, "clip_count_noise": 0.2, "backend": "numba"})
    prepared.append(adaptive.prepare(_setting(X, batch_size=203, epochs=5), model, X, y, streams))  # q = 1
    streams.close()
    fused = train_together(model, prepared)
    assert prepared[-1].chain.ran_on == "numba"
    adaptive_alone = adaptive.fit(_setting(X, batch_size=203, epochs=5), model, X, y, ReplicaStreams(SEEDS))
    np.testing.assert_array_equal(fused[-1].theta, adaptive_alone.theta)
    assert fused[-1].derived == adaptive_alone.derived  # the clip norms where each replica's ended, too
    for (params, eps), outcome in zip(cells, fused):
        own = _fit(params, _setting(X, epsilon=eps, trace_every=203 * 4), X, y, "numba")
        np.testing.assert_array_equal(outcome.theta, own.theta)
        for (_, obj_f, _), (_, obj_o, _) in zip(outcome.trace, own.trace):
            np.testing.assert_array_equal(obj_f, obj_o)
    assert not np.array_equal(fused[0].theta, fused[1].theta)


@needs_numba
@pytest.mark.parametrize("sampler", ["full", "poisson"])
@pytest.mark.parametrize("project", [ProjectBall, ProjectBox])
def test_any_op_order_on_the_shared_tail(sampler, project):
    """The ops in dp_sgd's order (noise → scale → λθ), in noisy_gd's and in a third, with either projection: on
    the full-batch and the mini-batch backend (one tail program), each chain equals its NumPy chain."""
    X, y = _data()
    model = make_model("logreg", X.shape[1], 0.1)
    n = X.shape[0]

    def chain(streams, order, backend):
        parts = {"noise": Noise(0.3, streams.normal("noise", (X.shape[1],))), "scale": Scale(1.0 / n),
                 "l2": WeightDecay(0.1)}
        batches = full_batches(X, y, streams.replicas) if sampler == "full" else poisson_batches(X, y, 0.2, streams)
        return GradientChain(batches=batches, ops=[Clip(0.7), *(parts[k] for k in order), Sgd(constant(2.0)),
                                                   project(0.2)], backend=backend)

    theta0 = np.random.default_rng(5).normal(size=(3, X.shape[1]))
    expected = backends.FULL_BATCH if sampler == "full" else backends.MINI_BATCH
    for order in (("noise", "scale", "l2"), ("scale", "l2", "noise"), ("l2", "noise", "scale")):
        fast = chain(ReplicaStreams(SEEDS), order, "numba")
        assert backends.choose(backends.plan(fast, model, theta0), "numba") is expected
        got = fast.run(model, theta0, 9)
        ref = chain(ReplicaStreams(SEEDS), order, "numpy").run(model, theta0, 9)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)


def test_backend_is_respected(monkeypatch):
    X, y = _data()
    setting = _setting(X, epochs=2)
    assert _fit({}, setting, X, y, "numpy").derived["backend"] == "numpy"
    monkeypatch.setattr(compiled, "HAVE_NUMBA", False)
    with pytest.raises(UserError, match="numba is not installed"):
        _fit({}, setting, X, y, "numba")
    assert _fit({}, setting, X, y, "auto").derived["backend"] == "numpy"


def test_mlp_and_float32_stay_on_numpy():
    X, y = _data()
    setting = _setting(X, epochs=2)
    mlp = make_model("mlp", X.shape[1], setting.l2, {"hidden": 3})
    outcome = ALGORITHMS["noisy_gd"]({"accountant": "composition"}).fit(setting, mlp, X, y, ReplicaStreams([0]))
    assert outcome.derived["backend"] == "numpy"
    model = make_model("logreg", X.shape[1], setting.l2)
    X32 = X.astype(np.float32)
    p = ALGORITHMS["noisy_gd"]().prepare(setting, model, X32, y.astype(np.float32), ReplicaStreams([0]))
    assert backends.choose(backends.plan(p.chain, model, p.theta.astype(np.float32)), "auto") is backends.NUMPY


def test_backend_is_not_in_the_run_id(tmp_path):
    """The id of a noisy_gd run is the one it had before the backend existed (computed by that code: 6a4ba49…)."""
    from dpsgd_cli.config import expand, load_grid_file

    ids = set()
    for backend in ("", ", backend: numpy", ", backend: numba", ", backend: auto"):
        path = tmp_path / "g.yaml"
        path.write_text(f"""grids:
  - name: g
    datasets: [synthetic]
    models: [logreg]
    algorithms: [{{name: noisy_gd, accountant: minimum{backend}}}]
    epsilon: [1]
    lr: [0.5]
    seeds: 1
    epochs: 5
    l2: 0.01
    clip_norm: 1.0
    delta: 1/n^2
""")
        ids.update(c.run_id(0) for c in expand(load_grid_file(path).grids[0]))
    assert ids == {"6a4ba499ee328246"}
