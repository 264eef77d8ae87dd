# %% [markdown]
# # dpsgd from a notebook
#
# Each `# %%` block is a notebook cell (Jupyter, VS Code, or `python examples/notebook.py` top to bottom).
# Every function is what the command of the same name does (see docs/python-api.md); keyword arguments
# are named like the commands' options. Results go to ./results, datasets to $DPSGD_DATA_DIR.

# %%
import os
from pathlib import Path

import dpsgd_cli as dpsgd

GRID = Path(__file__).with_name("notebook.yaml") if "__file__" in globals() else Path("examples/notebook.yaml")
SMALL = {"epochs": 1, "seeds": 2} if os.environ.get("DPSGD_EXAMPLE_SMALL") else {}  # the test's short run

# %% Run the grid (resumable: rerunning skips the runs already in results/notebook/runs.csv).
# `set` overrides grid keys before validation, like `dpsgd run --set KEY=VALUE`: {"epochs": 1, "datasets.0.n": 500}.
runs = dpsgd.run(GRID, out="results", set=SMALL)
runs[["algorithm", "epsilon", "seed", "test_accuracy", "val_accuracy", "sigma", "status"]].head()

# %% Mean ± std over seeds, per algorithm and ε: plain pandas from here on. `epsilon` is NaN exactly where
# `private` is False (erm and sgd have no ε): the private runs by ε, the references by algorithm.
ok = runs[runs["status"] == "ok"]
print(ok[ok["private"]].groupby(["algorithm", "epsilon"])["test_accuracy"].agg(["mean", "std", "count"]))
print(ok[~ok["private"]].groupby("algorithm")["test_accuracy"].agg(["mean", "std", "count"]))

# %% Read the results again later (or another grid's folder): the same rows the summary, plots and report use.
runs = dpsgd.read_results("results/notebook")

# %% Privacy accounting: ε of a DP-SGD run, and the noise multiplier σ a target ε needs.
q = 64 / 1800  # batch size / training records (2,000 minus the 10% validation split)
steps = 5 * 1800 // 64
print("ε =", dpsgd.epsilon(sigma=1.0, sample_rate=q, steps=steps, delta=1e-5))
print("σ =", dpsgd.sigma(epsilon=[0.3, 1, 3], sample_rate=q, steps=steps, delta=1e-5, accountant="rdp"))

# %% Figures: accuracy over ε (png + pdf under results/notebook/figures/).
for path in dpsgd.plot("results/notebook"):
    print(path)

# %% The grid's claims checked, report.md and report.html (figures embedded: one file to send).
verdicts = dpsgd.report("results")
print(verdicts[["claim", "verdict", "numbers"]])
print("open", Path("results/report.html").resolve().as_uri())

# %% Parquet for pandas, polars or DuckDB (needs pyarrow: pip install 'dpsgd[parquet]').
print(dpsgd.export("results", format="parquet"))
