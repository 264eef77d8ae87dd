"""The Python API's door: each argument of a public function is checked when it is called, before any work
(`@checked(jobs=at_least(1))`): the type its annotation names, then the rule's range (docs/python-api.md#exceptions).
"""

from __future__ import annotations

import collections.abc
import difflib
import functools
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, Union, cast

from dpsgd_cli.errors import ArgumentTypeError, ArgumentValueError, UserError

F = TypeVar("F", bound=Callable[..., Any])
Rule = Callable[[str, Any], Any]  # (the argument's label, its value) -> the value; raises UserError when out of range


def checked(**rules: Rule) -> Callable[[F], F]:
    """The decorated function's arguments checked at each call: first the type its annotation names (values
    converted: an integral float to int, any iterable of names to a list), then `rules[name]`."""

    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        unknown = set(rules) - set(signature.parameters)
        if unknown:
            raise TypeError(f"{function.__name__}: rules for no parameter: {sorted(unknown)}")
        hints: dict[str, Any] = {}

        @functools.wraps(function)
        def door(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise ArgumentTypeError(f"{function.__name__}(): {exc}{_suggestion(kwargs, signature)}") from None
            if not hints:  # the annotations are text (postponed): evaluated once, in the function's module
                hints.update(_hints(function, signature))
            for name, value in bound.arguments.items():
                label = _label(signature.parameters[name])
                value = _conform(label, value, hints[name])
                if name in rules and value is not None:
                    try:
                        value = rules[name](label, value)
                    except ArgumentValueError:
                        raise
                    except UserError as exc:  # a shared range check (privacy.validate): the same line
                        raise ArgumentValueError(str(exc)) from None
                bound.arguments[name] = value
            return function(*bound.args, **bound.kwargs)

        return cast(F, door)

    return decorate


def _hints(function: Callable[..., Any], signature: inspect.Signature) -> dict[str, Any]:
    """The parameters' annotations as types (the return annotation may name what only a type checker imports)."""
    holder = types.SimpleNamespace(__annotations__={name: p.annotation for name, p in signature.parameters.items()})
    return typing.get_type_hints(holder, getattr(function, "__globals__", None), include_extras=True)


def _suggestion(given: dict[str, Any], signature: inspect.Signature) -> str:
    for name in given:
        if name not in signature.parameters:
            match = difflib.get_close_matches(name, list(signature.parameters), n=1)
            return f" (did you mean '{match[0]}'?)" if match else f"; its arguments: {', '.join(signature.parameters)}"
    return ""


def _label(parameter: inspect.Parameter) -> str:
    """The argument as the command names it: a keyword argument is its option, a positional one its name."""
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
        return "--" + parameter.name.replace("_", "-")
    return parameter.name


def shown(value: Any) -> str:
    """`value` in a one-line message (long values cut)."""
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Mismatch(Exception):
    """The value is not of the annotated type (the door says what was expected, for the whole argument)."""


def _conform(label: str, value: Any, hint: Any) -> Any:
    """`value` as `hint` says (converted), or ArgumentTypeError / ArgumentValueError naming `label`."""
    try:
        return _as(value, hint, label)
    except _Mismatch:
        raise ArgumentTypeError(f"{label} {shown(value)}: expected {_describe(hint)}, got "
                                f"{type(value).__name__}") from None


def _as(value: Any, hint: Any, label: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Annotated:  # Annotated[type, "what it is, in a message"]
        return _as(value, args[0], label)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _as(value, option, label)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        if not isinstance(value, str) or not all(isinstance(a, str) for a in args):
            raise _Mismatch
        if value not in args:
            raise ArgumentValueError(f"{label} {value}: choose one of {', '.join(args)}")
        return args[args.index(value)]  # the plain string (a str Enum member compares equal)
    if hint is int:
        return _integer(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _Mismatch
        if not math.isfinite(float(value)):
            raise ArgumentValueError(f"{label} {shown(value)}: not a finite number")
        return float(value)
    if origin is collections.abc.Mapping:
        if not isinstance(value, collections.abc.Mapping):
            raise _Mismatch
        key, item = args or (Any, Any)
        return {_as(k, key, label): _as(v, item, label) for k, v in value.items()}
    if origin in (collections.abc.Sequence, collections.abc.Iterable, list):
        if isinstance(value, (str, bytes, collections.abc.Mapping)) or not isinstance(value, collections.abc.Iterable):
            raise _Mismatch
        item = args[0] if args else Any
        return [_as(v, item, label) for v in value]
    if origin is collections.abc.Callable:
        if not callable(value):
            raise _Mismatch
        return value
    if isinstance(hint, type):  # bool, str, a path (any path-like object is one), any other class: an instance
        if not isinstance(value, os.PathLike if issubclass(hint, os.PathLike) else hint):
            raise _Mismatch
        return value
    raise TypeError(f"{label}: the door has no check for the annotation {hint!r}")  # a new kind of parameter


def _integer(value: Any) -> int:
    """An integral number as int: 10000, 1e4 or a NumPy integer; not True, 2.5 or '2'."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Mismatch
    if isinstance(value, numbers.Integral):
        return int(value)
    number = float(value)
    if not (math.isfinite(number) and number.is_integer()):
        raise _Mismatch
    return int(number)


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return str(args[1])
    if origin in (Union, types.UnionType):
        options = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(dict.fromkeys(options)) + (" (or None)" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is collections.abc.Mapping:
        return f"a mapping with {_noun(_describe(args[0]))} keys" if args else "a mapping"
    if origin in (collections.abc.Sequence, collections.abc.Iterable, list):
        return f"a list of {_noun(_describe(args[0]))}s" if args else "a list"
    if origin is collections.abc.Callable:
        return "a function"
    if isinstance(hint, type) and issubclass(hint, os.PathLike):
        return "a path"
    return {bool: "True or False", int: "an integer", float: "a number", str: "a string"}.get(hint, repr(hint))


def _noun(described: str) -> str:
    """'a string' -> 'string'."""
    return described.split(" ", 1)[1] if described.startswith(("a ", "an ")) else described


# --- rules -------------------------------------------------------------------------------------------------------
def at_least(minimum: int) -> Rule:
    """A count of at least `minimum`."""

    def rule(label: str, value: Any) -> Any:
        if value < minimum:
            raise ArgumentValueError(f"{label} {shown(value)}: must be ≥ {minimum}")
        return value

    return rule


def between(low: float, high: float, example: str) -> Rule:
    """A number in the open interval (low, high)."""

    def rule(label: str, value: Any) -> Any:
        if not low < value < high:
            raise ArgumentValueError(f"{label} {shown(value)}: must be in ({low:g}, {high:g}), e.g. {example}")
        return value

    return rule


def each(check: Rule) -> Rule:
    """`check` on a number or on each number of a list."""

    def rule(label: str, value: Any) -> Any:
        return [check(label, v) for v in value] if isinstance(value, list) else check(label, value)

    return rule
