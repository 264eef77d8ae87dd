"""`dpsgd audit`: empirical lower bounds ε_lo on the privacy of each algorithm as run (see docs/audit.md)."""
