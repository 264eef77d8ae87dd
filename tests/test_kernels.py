"""The single-example backend (algorithms/backends.py, _kernels_single_numba.py): equals the NumPy chain; the one
decision of a chain's backend; the noise stream drawn the same in any block size; the CLI line.

The equality tests skip when numba is not installed (`pip install 'dpsgd[numba]'`); the selection tests run always.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from dpsgd_cli import compiled
from dpsgd_cli.algorithms import ALGORITHMS, Setting, backends
from dpsgd_cli.algorithms.chain import GradientChain
from dpsgd_cli.algorithms.ops import (
    Clip,
    Scale,
    Sgd,
    WeightDecay,
    constant,
    inverse_sqrt,
    inverse_time,
    min_inverse_time,
)
from dpsgd_cli.algorithms.sampling import poisson_batches, uniform_examples
from dpsgd_cli.algorithms.streams import ReplicaStreams, SharedStreams
from dpsgd_cli.engine import workers
from dpsgd_cli.errors import UserError
from dpsgd_cli.models import make_model

needs_numba = pytest.mark.skipif(not compiled.HAVE_NUMBA, reason="numba not installed (pip install 'dpsgd[numba]')")
SEEDS = [0, 3, 11]


def _data(n=150, d=5, seed=2, max_norm=1.6):
    """Rows up to norm 1.6: some per-example gradients exceed 1, so the clip acts."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    X *= max_norm * rng.uniform(0.1, 1.0, size=(n, 1)) / np.linalg.norm(X, axis=1, keepdims=True)
    y = np.where(X @ rng.normal(size=d) + 0.3 * rng.normal(size=n) > 0, 1.0, -1.0)
    return X, y


def _setting(X, **kw):
    n, d = X.shape
    base = dict(n=n, d=d, delta=1e-5, l2=1e-2, epsilon=2.0, batch_size=1, lr=0.5, epochs=1)
    return Setting(**{**base, **kw})


def _both(name, params, setting, X, y, seeds=SEEDS):
    model = make_model("logreg", X.shape[1], setting.l2)
    ref = ALGORITHMS[name]({**params, "backend": "numpy"}).fit(setting, model, X, y, ReplicaStreams(seeds))
    fast = ALGORITHMS[name]({**params, "backend": "numba"}).fit(setting, model, X, y, ReplicaStreams(seeds))
    return ref, fast


def _assert_same(ref, fast):
    assert ref.derived.pop("backend") == "numpy" and fast.derived.pop("backend") == "numba"
    scale = max(1.0, float(np.abs(ref.theta).max()))
    np.testing.assert_allclose(fast.theta, ref.theta, rtol=1e-12, atol=1e-13 * scale)
    assert fast.derived == ref.derived and fast.guarantee == ref.guarantee
    assert [row[0] for row in fast.trace] == [row[0] for row in ref.trace]
    for (_, obj_f, acc_f), (_, obj_r, acc_r) in zip(fast.trace, ref.trace):
        np.testing.assert_allclose(obj_f, obj_r, rtol=1e-12)
        np.testing.assert_array_equal(acc_f, acc_r)


CASES = [
    ("song2013", {}, {}),
    ("song2013", {"schedule": "inv_t"}, {"epochs": 2.5}),  # 3 passes, a fresh permutation each
    ("song2013", {"schedule": "constant", "radius": 0.3}, {"trace_every": 40, "epochs": 2}),  # projection acts
    ("song2013", {"composition": "advanced"}, {"epochs": 3, "epsilon": 0.5}),
    ("song2013_nonprivate", {}, {"epochs": 2}),  # no clip, no noise
    ("bassily2014", {}, {}),  # strongly convex schedule, closed-form σ
    ("bassily2014", {"accounting": "rdp", "schedule": "convex", "radius": 2.0}, {"trace_every": 50, "epochs": 1.5}),
    ("bassily2014", {}, {"l2": 0.0, "epsilon": 3.0}),  # λ = 0: convex schedule, default radius 10
]


@needs_numba
@pytest.mark.parametrize("name, params, kw", CASES)
def test_kernel_equals_the_numpy_chain(name, params, kw):
    X, y = _data()
    ref, fast = _both(name, params, _setting(X, **kw), X, y)
    _assert_same(ref, fast)
    assert not np.allclose(ref.theta[0], ref.theta[1])  # the replicas differ: the comparison is not trivial


@needs_numba
@pytest.mark.parametrize("name", ["song2013", "bassily2014"])
def test_kernel_in_small_chunks_with_checkpoints(monkeypatch, name):
    """Chunks of 64 steps (not dividing the pass of n = 150, nor the checkpoint period): same run."""
    X, y = _data()
    monkeypatch.setattr(backends, "SINGLE_CHUNK_ELEMENTS", 64 * len(SEEDS) * X.shape[1])
    ref, fast = _both(name, {}, _setting(X, epochs=2.2, trace_every=70), X, y)
    _assert_same(ref, fast)
    assert len(fast.trace) == 4


@needs_numba
def test_kernel_replicas_are_independent():
    X, y = _data()
    setting, model = _setting(X, epochs=2), make_model("logreg", X.shape[1], 1e-2)
    for name in ("song2013", "bassily2014"):
        algo = ALGORITHMS[name]({"backend": "numba"})
        together = algo.fit(setting, model, X, y, ReplicaStreams([0, 1, 2])).theta
        alone = algo.fit(setting, model, X, y, ReplicaStreams([2])).theta
        np.testing.assert_allclose(together[2], alone[0], rtol=1e-12)


@needs_numba
def test_kernel_float32_data_runs_and_matches_float64_closely():
    X, y = _data()
    setting, model = _setting(X), make_model("logreg", X.shape[1], 1e-2)
    algo = ALGORITHMS["song2013"]({"backend": "numba"})
    a = algo.fit(setting, model, X, y, ReplicaStreams([0])).theta
    b = algo.fit(setting, model, X.astype(np.float32), y.astype(np.float32), ReplicaStreams([0])).theta
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_schedule_values_match_step_by_step_calls():
    for schedule in (constant(0.3), inverse_sqrt(2.0), inverse_time(5.0), min_inverse_time(4.0, 0.1)):
        expected = np.array([schedule(t) for t in range(7, 300)])
        np.testing.assert_allclose(backends.schedule_values(schedule, 7, 300), expected, rtol=1e-15)


@pytest.mark.parametrize("block", [1, 7, 64, 70])
def test_the_noise_stream_is_each_generators_normals_in_step_order_in_any_block(block):
    """Every backend takes a chain's noise from one per-step stream, in blocks of its own size (`noise_blocks`):
    whatever the size, replica r's numbers are its generator's standard normals consumed step by step."""
    streams = ReplicaStreams([4, 9])
    draws = streams.normal("noise", (3,))
    taken = np.concatenate([backends.noise_blocks([draws], min(block, 70 - t))[0][0] for t in range(0, 70, block)])
    expected = [g.standard_normal((70, 3)) for g in streams.generators("noise")]
    np.testing.assert_array_equal(taken, np.stack(expected, axis=1))


def test_one_streams_noise_block_is_handed_on_as_drawn_not_copied():
    """A single-example kernel call reads m·R·P numbers (~17 MB a call on adult's MLP): `noise_blocks` hands one
    stream's block on as the stream drew it (a copy cost ~8 µs a replica-step); two streams are stacked."""
    shared = SharedStreams([4, 9])
    one, later = shared.normal("noise", (3,)), shared.normal("noise", (3,))  # `later` keeps the drawn steps
    block, slot = backends.noise_blocks([one], 10)
    assert block is not None and block.flags.c_contiguous and slot.tolist() == [0]
    assert np.shares_memory(block, one.tape.chunks[0])
    np.testing.assert_array_equal(block[0], later.take(10))
    stacked, slots = backends.noise_blocks([one, ReplicaStreams([4, 9]).normal("noise", (3,))], 10)
    assert stacked is not None and stacked.shape == (2, 10, 2, 3) and slots.tolist() == [0, 1]
    np.testing.assert_array_equal(stacked[0, :, 0], np.random.default_rng([4, 2]).standard_normal((20, 3))[10:])

def test_fixed_batches_plain_and_gathered_are_the_same_rows():
    """A round's unpadded indices give plain batches of the rows (pidp_sgd's single-example steps), equal to the
    gathered batches of the same indices; `take` hands a kernel the same indices."""
    from dpsgd_cli.algorithms.sampling import fixed_batches

    X, y = _data()
    idx = uniform_examples(X, y, ReplicaStreams([4, 9])).take(70)  # (70, 2, 1)
    plain, gathered = fixed_batches(X, y, idx), fixed_batches(X, y, idx, padded=True)
    for _ in range(70):
        a, b = next(plain), next(gathered)
        for field in ("X", "y", "weight", "x_norm"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(fixed_batches(X, y, idx).take(70), idx)


# --- backend selection (no numba needed) ---------------------------------------------------------------------------


def _chain(X, y, model, batch_size=1, backend="auto"):
    streams = ReplicaStreams([0, 1])
    setting = _setting(X, batch_size=batch_size)
    chain = ALGORITHMS["song2013_nonprivate"]({"backend": backend}).chain(setting, X, y, streams)
    return backends.plan(chain, model, np.zeros((2, model.n_params))), backend


def test_backend_selection(monkeypatch):
    X, y = _data()
    logreg, mlp = make_model("logreg", X.shape[1], 0.1), make_model("mlp", X.shape[1], 0.1)

    class Other(type(logreg)):  # a model whose gradient is not the logistic one the kernels compute
        def clipped_grad_sum(self, theta, batch, clip):
            return super().clipped_grad_sum(theta, batch, clip)

    monkeypatch.setattr(compiled, "HAVE_NUMBA", True)
    monkeypatch.setattr(backends, "_load", lambda module: None)  # "numba imports": the selection logic only
    assert backends.choose(*_chain(X, y, logreg)) is backends.SINGLE_EXAMPLE
    assert backends.choose(*_chain(X, y, mlp, backend="numba")) is backends.SINGLE_EXAMPLE
    assert backends.choose(*_chain(X, y, logreg, backend="numpy")) is backends.NUMPY
    assert backends.choose(*_chain(X, y, logreg, batch_size=2)) is backends.MINI_BATCH
    assert backends.choose(*_chain(X, y, mlp, batch_size=2)) is backends.NUMPY  # the MLP's mini-batches: NumPy
    assert backends.choose(*_chain(X, y, Other(X.shape[1], 0.1))) is backends.NUMPY
    plan, _ = _chain(X, y, logreg)
    assert backends.choose(backends.Plan(plan.regime, plan.family, np.dtype(np.float32), plan.ops),
                           "auto") is backends.NUMPY

    def broken(module):
        raise UserError("numba could not be imported (ImportError: ...)")

    monkeypatch.setattr(backends, "_load", broken)  # installed but broken: auto falls back, numba says why
    assert backends.choose(*_chain(X, y, logreg)) is backends.NUMPY
    with pytest.raises(UserError, match="could not be imported"):
        backends.choose(*_chain(X, y, logreg, backend="numba"))
    monkeypatch.setattr(compiled, "HAVE_NUMBA", False)
    assert backends.choose(*_chain(X, y, logreg)) is backends.NUMPY
    with pytest.raises(UserError, match=r"pip install 'dpsgd\[numba\]'"):
        backends.choose(*_chain(X, y, logreg, backend="numba"))
    assert compiled.backend_description().startswith("backend: numpy (pip install 'dpsgd[numba]'")


def test_an_op_no_backend_knows_runs_on_numpy(monkeypatch):
    """Backends match op classes: a chain with an op of another class (here a subclass of a known one, which may
    compute anything) runs on NumPy."""

    class Decay(WeightDecay):
        pass

    class MovingClip(Clip):  # e.g. an adaptive clip: its norms are state that its update moves
        pass

    X, y = _data()
    model = make_model("logreg", X.shape[1], 0.1)
    ops = [Clip(1.0), WeightDecay(0.1), Sgd(constant(0.1))]
    chain = lambda ops: GradientChain(uniform_examples(X, y, ReplicaStreams([0])), ops)  # noqa: E731
    monkeypatch.setattr(compiled, "HAVE_NUMBA", True)
    monkeypatch.setattr(backends, "_load", lambda module: None)
    theta = np.zeros((1, X.shape[1]))
    assert backends.choose(backends.plan(chain(ops), model, theta), "auto") is backends.SINGLE_EXAMPLE
    for other in ([ops[0], Decay(0.1), ops[2]], [MovingClip(1.0), *ops[1:]]):
        assert backends.choose(backends.plan(chain(other), model, theta), "auto") is backends.NUMPY


def test_without_numba_the_algorithms_run_numpy(monkeypatch):
    monkeypatch.setattr(compiled, "HAVE_NUMBA", False)
    X, y = _data(60, 3)
    model = make_model("logreg", 3, 1e-2)
    for name in ("song2013", "song2013_nonprivate", "bassily2014"):
        out = ALGORITHMS[name]().fit(_setting(X), model, X, y, ReplicaStreams([0]))
        assert out.derived["backend"] == "numpy" and np.isfinite(out.theta).all()
    with pytest.raises(UserError, match="numba is not installed"):
        ALGORITHMS["song2013"]({"backend": "numba"}).fit(_setting(X), model, X, y, ReplicaStreams([0]))


def test_backend_parameter_is_validated():
    for name in ("song2013", "song2013_nonprivate", "bassily2014"):
        assert ALGORITHMS[name].Params().backend == "auto"
        with pytest.raises(ValidationError):
            ALGORITHMS[name].Params(backend="gpu")


def test_backend_description_names_numba_when_installed(monkeypatch):
    monkeypatch.setattr(compiled, "HAVE_NUMBA", True)
    monkeypatch.setattr(compiled, "numba_version", lambda: "0.99.0")
    assert compiled.backend_description().startswith("backend: numba 0.99.0")


def test_cli_run_says_the_backend_once(tmp_path, monkeypatch):
    from dpsgd_cli.cli import app

    monkeypatch.setenv("DPSGD_DATA_DIR", str(tmp_path / "cache"))
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent("""
        grids:
          - name: tiny
            datasets: [{name: synthetic, n: 300}]
            algorithms: [{name: song2013, backend: numpy}]
            batch_size: [1]
            lr: [1]
            epochs: 1
            l2: 1.0e-3
            seeds: 1
    """))
    result = CliRunner().invoke(app, ["run", str(grid), "--out", str(tmp_path / "r"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.count("backend: ") == 1
    assert compiled.backend_description() in result.output


@needs_numba
@pytest.mark.parametrize("name, params", [("song2013", {}), ("bassily2014", {}), ("song2013_nonprivate", {})])
def test_the_mlp_on_the_single_example_kernel_equals_the_numpy_chain(name, params):
    X, y = _data()
    setting = _setting(X, trace_every=70, epochs=1.5)
    model = make_model("mlp", X.shape[1], setting.l2)
    ref = ALGORITHMS[name]({**params, "backend": "numpy"}).fit(setting, model, X, y, ReplicaStreams(SEEDS))
    fast = ALGORITHMS[name]({**params, "backend": "numba"}).fit(setting, model, X, y, ReplicaStreams(SEEDS))
    _assert_same(ref, fast)


@needs_numba
def test_chunks_do_not_change_a_run(monkeypatch):
    """A kernel's run is the same bit for bit whatever its chunks (the noise stream and the batches are taken in
    blocks of the chunk's size: the same numbers in any block size)."""
    X, y = _data()
    setting = _setting(X, epochs=2.2)
    model = make_model("logreg", X.shape[1], setting.l2)
    run = lambda: ALGORITHMS["bassily2014"]({"backend": "numba"}).fit(  # noqa: E731
        setting, model, X, y, ReplicaStreams(SEEDS)).theta
    whole = run()
    monkeypatch.setattr(backends, "SINGLE_CHUNK_ELEMENTS", 3 * len(SEEDS) * X.shape[1])  # 64 steps a call: the least
    np.testing.assert_array_equal(run(), whole)


@needs_numba
@pytest.mark.parametrize("name, params", [("bassily2014", {}), ("song2013", {}),
                                          ("pidp_sgd", {"rule": "coordinate", "radius": 1.0e3})])
def test_the_audits_canary_models_one_example_per_step_train_on_the_numpy_chain(name, params):
    """The single-example kernel has no rows of fixed gradient: a model with the audit's gradient canaries (audit/
    canaries.py) is not taken by it, even when asked for; its replica that includes neither canary trains as the
    plain model does on the kernel, and the canaries move the replicas that include them (the mini-batch and
    full-batch kernels add them: tests/test_audit_compiled.py)."""
    from dpsgd_cli.audit import canaries

    X, y = _data(n=60)  # each canary row drawn ~4 times per replica
    markers, marker_y = canaries.marker_rows(2, X.shape[1])
    Xw, yw = np.vstack([X, markers]), np.append(y, marker_y)
    setting = _setting(Xw, epochs=4, batch_size=1, lr=0.05)
    included = np.array([[True, False], [False, True], [False, False]])
    U = np.linalg.qr(np.random.default_rng(5).standard_normal((X.shape[1], 2)))[0].T
    model = canaries.with_gradient_canaries(make_model("logreg", X.shape[1], setting.l2), U, included, 50.0)
    fit = ALGORITHMS[name]({**params, "backend": "numba"}).fit(setting, model, Xw, yw, ReplicaStreams(SEEDS))
    assert fit.derived.get("backend", "numpy") == "numpy"
    assert canaries.gradient_scores(model, fit.theta).steps == setting.steps
    plain = ALGORITHMS[name]({**params, "backend": "numba"}).fit(
        setting, make_model("logreg", X.shape[1], setting.l2), Xw, yw, ReplicaStreams(SEEDS))
    assert plain.derived.get("backend", "numba") == "numba"
    np.testing.assert_allclose(fit.theta[2], plain.theta[2], rtol=1e-12)
    assert not np.allclose(fit.theta[0], plain.theta[0]) and not np.allclose(fit.theta[1], plain.theta[1])


@pytest.mark.parametrize("model_name", ["logreg", "mlp"])
def test_per_replica_clip_norms_are_each_replicas_own(model_name):
    """The clip norm is the `Clip` op's state, one per replica (what an adaptive clip moves): replicas with
    different norms in one chain each train as alone with theirs."""
    norms = (0.2, 0.9)

    class PerReplicaClip(Clip):
        def init(self, params):
            return np.array(norms)

    X, y = _data()
    model = make_model(model_name, X.shape[1], 0.0)
    tail = [Scale(1 / 15), Sgd(constant(0.5))]

    def run(seeds, clip):
        chain = GradientChain(poisson_batches(X, y, 0.1, ReplicaStreams(seeds)), [clip, *tail], backend="numpy")
        return chain.run(model, np.zeros((len(seeds), model.n_params)), 25)

    together = run([0, 1], PerReplicaClip(0.0))
    for r, norm in enumerate(norms):
        np.testing.assert_allclose(together[r], run([r], Clip(norm))[0], rtol=1e-12, atol=1e-15)
    assert not np.allclose(run([0], Clip(norms[1]))[0], together[0])  # the norm mattered


_FORKED_LOADS = textwrap.dedent("""
    import numpy as np

    from dpsgd_cli.algorithms import backends
    from dpsgd_cli.engine.workers import map_in_workers
    from tests.test_kernels import fit_single_example_kernels, kernel_loads

    def loads(_):
        before = kernel_loads()
        thetas = fit_single_example_kernels()
        return kernel_loads() - before, thetas

    backends.warm_up()  # what the driver does before forking its workers (`runner.preload`)
    forked = map_in_workers(loads, [0, 1], 2)
    here = fit_single_example_kernels()
    same = all(np.array_equal(a, b) for _, thetas in forked for a, b in zip(thetas, here))
    print(same, sum(n for n, _ in forked))
""")


def _single_example_kernels():
    kernels, normals = backends.SINGLE_EXAMPLE.load(), compiled.import_compiled("algorithms._normals_numba")
    return kernels.sgd1_logreg, kernels.sgd1_mlp, normals.fill_normals_pcg64


def kernel_loads() -> int:
    """The overloads of the single-example kernels and the normals this process has loaded from numba's disk
    cache or compiled (numba's dispatcher counters)."""
    return sum(sum(k.stats.cache_hits.values()) + sum(k.stats.cache_misses.values())
               for k in _single_example_kernels())


def fit_single_example_kernels() -> list[np.ndarray]:
    """θ of bassily2014 on logistic regression and on the MLP, and of pidp_sgd, through the single-example kernels."""
    X, y = _data()
    thetas = []
    for name, model_name in (("bassily2014", "logreg"), ("bassily2014", "mlp"), ("pidp_sgd", "logreg")):
        fit = ALGORITHMS[name]({"backend": "numba"}).fit(
            _setting(X), make_model(model_name, X.shape[1], 1e-2), X, y, ReplicaStreams(SEEDS))
        assert fit.derived["backend"] == "numba"
        thetas.append(fit.theta)
    return thetas


@needs_numba
@pytest.mark.skipif(not workers.can_fork(), reason="workers are forked on Linux only")
def test_forked_workers_inherit_the_drivers_loaded_kernels():
    """After `backends.warm_up` in the driver, a forked worker's first fits load no kernel again: neither from
    numba's disk cache nor by compiling (each costs a worker ~0.3 s at its first kernel call otherwise); their
    numbers are the driver's, bit for bit."""
    fit_single_example_kernels()  # here first: the overloads the workers need are in numba's disk cache
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FORKED_LOADS], capture_output=True, text=True, cwd=root, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["True", "0"], done.stdout
