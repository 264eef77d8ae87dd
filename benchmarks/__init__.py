"""Benchmarks of dpsgd against plain NumPy, Opacus and the memory-bound floor: `python -m benchmarks [--quick]`.

Every ratio is measured in the same run, both sides best-of-k (time.perf_counter, k ≥ 3: the minimum is the
figure, the median is stored too). One module per case (issue 6):

1. `case1_dpsgd`: dp_sgd on adult (logreg, B = 256, 1 epoch) at R = 1 and 16 replicas vs a straightforward
   NumPy implementation (per-example gradients, a loop over replicas) and vs Opacus (when importable, or with
   `--opacus-python`); float32 vs float64.
2. `case2_floor`: the epoch of case 1 (R = 1) as a multiple of two matrix–vector passes over adult.
3. `case3_single_example`: song2013 (b = 1, kddcup99) and bassily2014 (adult), NumPy chain vs numba kernel with
   identical results; pidp_sgd (adult): where its time goes.
4. `case4_mlp`: dp_sgd on the MLP (adult, B = 256, R = 10): time per step vs a per-example loop.
5. `case5_grid`: the `kang_lr` grid of experiments.yaml end to end with 2 jobs.
6. `case6_accountant`: calibrating σ for one (ε, δ, q, T) and for the 8-value ε axis, RDP and PLD.
"""
