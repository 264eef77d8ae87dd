"""Errors that the CLI reports as one line with exit code 2 (no traceback)."""


class UserError(Exception):
    """Bad input from the user: the message says what is wrong, where, and how to fix it."""


class DataError(UserError):
    """A dataset could not be fetched, verified or parsed."""
