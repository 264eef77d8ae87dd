"""numba code of `rows.RowNonzeros.of` (imported on first use: numba is optional; NumPy builds the same arrays).
Branch-free (a nonzero test per entry mispredicts often at ~1/8 density)."""

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def count_nonzeros(X):
    n, d = X.shape
    counts = np.zeros(n, dtype=np.int64)
    for i in range(n):
        c = 0
        for j in range(d):
            c += X[i, j] != 0
        counts[i] = c
    return counts


@numba.njit(cache=True, nogil=True)
def fill_nonzeros(X, cols, vals):
    """Each row's nonzeros, in column order, into cols/vals (n, K) (zeroed beforehand)."""
    n, d = X.shape
    c_row = np.zeros(d + 1, dtype=cols.dtype)
    v_row = np.zeros(d + 1, dtype=vals.dtype)
    for i in range(n):
        s = 0
        for j in range(d):  # every entry written at the next slot, which advances past nonzeros only
            x = X[i, j]
            c_row[s] = j
            v_row[s] = x
            s += x != 0
        for k in range(s):
            cols[i, k] = c_row[k]
            vals[i, k] = v_row[k]
