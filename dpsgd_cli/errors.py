"""Errors that the CLI reports as one line with exit code 2 (no traceback)."""


class UserError(Exception):
    """Bad input from the user: the message says what is wrong, where, and how to fix it, in one line (a line
    break in a value it quotes back, e.g. a grid's text or a path, becomes a space)."""

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(str(message).splitlines()))


class DataError(UserError):
    """A dataset could not be fetched, verified or parsed."""


class ArgumentTypeError(UserError, TypeError):
    """An argument of a Python API function of the wrong type (dpsgd_cli.arguments): also a TypeError."""


class ArgumentValueError(UserError, ValueError):
    """An argument of a Python API function out of its range (dpsgd_cli.arguments): also a ValueError."""
