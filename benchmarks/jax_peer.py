"""The JAX peer: DP-SGD for logistic regression written the way the JAX community writes it (an optional
benchmark dependency, `pip install -e '.[bench]'`; never a dependency of dpsgd).

After Subramani et al. 2021 ("Enabling fast differentially private SGD via just-in-time compilation and
vectorization"; §3: per-example gradients by `vmap(grad)`, the whole training step under `jit`) and the clipped
gradients of JAX Privacy (per-example gradients, clipped to C, summed, Gaussian noise N(0, σ²C²) added): the
whole epoch is one `jax.jit`-compiled `lax.scan` over the steps, and R replicas are a `vmap` over
(θ, PRNG key). Poisson sampling inside the scan by the Geometric(q) gaps between kept indices (P uniforms per
step, as dpsgd's sampler, instead of n Bernoulli draws: the first version drew n uniforms and took
`jnp.nonzero(size=P)`, 3–6× slower per replica-step), the kept indices padded to a fixed P with a mask; P is
trimmed to the binomial tail bound, the smallest P with P[Binomial(n, q) > P] ≤ 1e-6 / T (overflowing steps
are counted and reported: none expected). The update is dpsgd's: θ ← θ − η (Σ clip(g_i) + N(0, σ²C²)) / B − η λ θ.

Two clips: `vmap` materialises the (P, d) per-example gradients (`vmap(grad(loss))`) and clips their norms;
`closed` uses the closed form of logistic regression, g_i = ℓ'(y_i x_iᵀθ)·y_i x_i, ‖g_i‖ = |ℓ'|·‖x_i‖ with the
row norms computed once (what dpsgd's core does). `share` = S > 1: each of the R streams trains S models on
the same batches (the fused grid's work, done the JAX way: the gather is outside the inner vmap). float64
(`jax_enable_x64`) or float32. Compilation
(`.lower().compile()`) is timed apart from the runs.
"""

from __future__ import annotations

import time
from typing import Any

TAIL = 1e-6


def pad_size(n: int, q: float, steps: int) -> int:
    """The trimmed padding: the binomial quantile with an epoch overflow probability ≤ TAIL."""
    from scipy.stats import binom

    return int(binom.isf(TAIL / steps, n, q)) + 1


def prepare(spec: dict[str, Any]):
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax import lax

    with np.load(spec["data"]) as f:
        X_np, y_np, X_test, y_test = f["X_train"], f["y_train"], f["X_test"], f["y_test"]
    dt = jnp.float64 if spec.get("dtype", "float64") == "float64" else jnp.float32
    n, d = X_np.shape
    B, lr, l2, C, sigma = spec["batch_size"], spec["lr"], spec["l2"], spec["clip"], spec["sigma"]
    q = B / n
    steps = int(spec.get("steps") or round(n / B))
    R = int(spec["replicas"])  # batch streams, each shared by S models (S = 1: the usual vmap over replicas)
    S = int(spec.get("share", 1))
    P = pad_size(n, q, steps)
    X, y = jnp.asarray(X_np, dt), jnp.asarray(y_np, dt)
    x_norm = jnp.sqrt(jnp.sum(X * X, axis=1))
    clip_mode = spec.get("clip_mode", "vmap")

    def loss(theta, x, label):  # logistic loss, labels ±1
        return jnp.logaddexp(0.0, -label * jnp.dot(x, theta))

    per_example_grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))

    def clipped_sum(theta, idx, valid):
        xb, yb = X[idx], y[idx]
        if clip_mode == "vmap":
            g = per_example_grads(theta, xb, yb)  # (P, d)
            norms = jnp.sqrt(jnp.sum(g * g, axis=1))
            return (valid * jnp.minimum(1.0, C / jnp.maximum(norms, 1e-12))) @ g
        s = -yb * jax.nn.sigmoid(-yb * (xb @ theta))  # ℓ'·y: the gradient is s_i x_i
        scale = jnp.minimum(1.0, C / jnp.maximum(jnp.abs(s) * x_norm[idx], 1e-12))
        return (valid * s * scale) @ xb

    log1mq = float(np.log1p(-q))

    def step(theta, key):
        k_batch, k_noise = jax.random.split(key)
        # Poisson sampling by its Geometric(q) gaps: P uniforms per step instead of n
        u = jax.random.uniform(k_batch, (P,), dt, float(jnp.finfo(dt).tiny), 1.0)
        idx = jnp.cumsum(jnp.floor(jnp.log(u) / log1mq).astype(jnp.int32) + 1) - 1
        valid = idx < n
        safe = jnp.where(valid, idx, 0)
        # theta is (S, d): the S models sharing this batch stream (vmap leaves the unbatched gather shared)
        sums = jax.vmap(clipped_sum, in_axes=(0, None, None))(theta, safe, valid.astype(dt))
        noisy = sums + (sigma * C) * jax.random.normal(k_noise, theta.shape, dt)
        return theta - lr * (noisy / B + l2 * theta), idx[-1] < n  # overflow: the P-th kept index is still < n

    def train(theta, key):
        theta, overflow = lax.scan(step, theta, jax.random.split(key, steps))
        return theta, jnp.sum(overflow)

    epoch = jax.jit(jax.vmap(train))
    theta0 = jnp.zeros((R, S, d), dt)
    keys0 = jax.random.split(jax.random.PRNGKey(0), R)
    start = time.perf_counter()
    compiled = epoch.lower(theta0, keys0).compile()
    compile_s = time.perf_counter() - start
    trial = [0]

    def run() -> dict[str, Any]:
        trial[0] += 1
        keys = jax.random.split(jax.random.PRNGKey(trial[0]), R)
        keys.block_until_ready()
        begin = time.perf_counter()
        theta, overflow = compiled(theta0, keys)
        theta.block_until_ready()
        seconds = time.perf_counter() - begin
        w = np.asarray(theta, dtype=np.float64).reshape(R * S, d)
        acc = float(np.mean(np.where(w @ X_test.T >= 0, 1.0, -1.0) == y_test))
        return {"seconds": seconds, "replica_steps": R * S * steps, "test_accuracy": acc,
                "overflow_steps": int(np.sum(np.asarray(overflow)))}

    return run, {"compile_s": compile_s, "pad": P, "steps": steps, "jax": jax.__version__,
                 "devices": str(jax.devices())}
