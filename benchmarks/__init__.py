"""Benchmarks of dpsgd against plain NumPy, JAX, Opacus and the memory-bound floor: `python -m benchmarks [--quick]`.

Every ratio is measured in the same run, both sides best-of-k (time.perf_counter, k ≥ 3: the minimum is the
figure, the median is stored too); cases 8 and 9 run each side in its own process pinned to one core
(pinned.py), interleaved in rounds, with the load average beside each ratio. One module per case:

1. `case1_dpsgd`: dp_sgd on adult (logreg, B = 256, 1 epoch) at R = 1 and 16 replicas vs a straightforward
   NumPy implementation (per-example gradients, a loop over replicas); float32 vs float64.
2. `case2_floor`: the epoch of case 1 (R = 1) as a multiple of two matrix–vector passes over adult.
3. `case3_single_example`: song2013 (b = 1, kddcup99) and bassily2014 (adult), NumPy chain vs numba kernel with
   identical results; pidp_sgd (adult): where its time goes.
4. `case4_mlp`: dp_sgd on the MLP (adult, B = 256, R = 10): time per step vs a per-example loop.
5. `case5_grid`: the `kang_lr` grid of experiments.yaml end to end with 2 jobs.
6. `case6_accountant`: calibrating σ for one (ε, δ, q, T) and for the 8-value ε axis, RDP and PLD.
7. `case7_audit`: `dpsgd audit` of dp_sgd.
8. `case8_peers`: dp_sgd vs the JAX peer (jax_peer.py) and Opacus (opacus_worker.py), pinned and interleaved:
   logreg R = 1/16/64 float64/float32, the MLP vs Opacus hooks/ew, the fused grid's work per replica-step.
9. `case9_fused_grid`: `kang_lr` and the figure set end to end, fused vs `DPSGD_FUSE=0`.
10. `case10_calibration_share`: σ calibration's share of a one-seed run's time.
11. `case11_end_to_end`: every grid of experiments.yaml with `dpsgd run --jobs 2`, then `dpsgd plot` and
    `dpsgd report`, caches cold: wall and CPU time per grid (also `scripts/time_grids.py`).

The performance goals are printed as their own table (`__main__.GOALS`).
"""
