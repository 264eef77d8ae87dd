"""Errors that the CLI reports as one line with exit code 2 (no traceback)."""


class UserError(Exception):
    """Bad input from the user: the message says what is wrong, where, and how to fix it."""


class DataError(UserError):
    """A dataset could not be fetched, verified or parsed."""


class ArgumentTypeError(UserError, TypeError):
    """An argument of a Python API function of the wrong type (dpsgd_cli.arguments): also a TypeError."""


class ArgumentValueError(UserError, ValueError):
    """An argument of a Python API function out of its range (dpsgd_cli.arguments): also a ValueError."""
