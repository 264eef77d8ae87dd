"""Differential-privacy building blocks (:mod:`.mechanisms`) and accounting (:mod:`.accounting`)."""

from typing import Literal, get_args

# Light (no NumPy): the Python API's signatures and the commands' options name them, and `import dpsgd_cli` imports
# the API.
AccountantName = Literal["rdp", "pld"]
"""How ε is computed over the steps: Rényi DP converted to (ε, δ), or privacy loss distributions."""
ACCOUNTANTS: tuple[AccountantName, ...] = get_args(AccountantName)
ACCOUNTANT_LABELS: dict[str, str] = {"rdp": "RDP", "pld": "PLD"}
"""Each accountant's name in figures, legends and tables."""
Neighbours = Literal["add_remove", "replace_one", "zero_out"]
"""Neighbouring relations a privacy claim can be stated for: add or remove one record (the library's default,
Abadi et al.'s), replace one record by another (Song et al., Bassily et al., Kang et al., Chourasia et al.), or
replace one record by a null record whose gradient is zero (Kairouz et al. 2021's zero-out, dp-accounting's
REPLACE_SPECIAL: the relation of its tree-aggregation bound)."""
