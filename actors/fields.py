"""Typed checks for fields decoded from msgpack, shared by both wire protocols.

Each check takes the value and its field path and returns the value to store
(converted where the wire form differs, int -> float), or raises
`ProtocolError` naming the path, the expected type and what came instead.
`type(x) is int` is used throughout because msgpack's bool is not an int here.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from cadence.statemachine.errors import ProtocolError

TYPE_NAMES = {
    type(None): "nil", bool: "bool", int: "int", float: "float", str: "str",
    bytes: "bin", list: "array", dict: "map",
}


def kind(value: object) -> str:
    """The msgpack name of a value's type."""
    return TYPE_NAMES.get(type(value), type(value).__name__)


def wrong(path: str, expected: str, value: object) -> ProtocolError:
    """The error for a field of the wrong type."""
    return ProtocolError(f"{path}: expected {expected}, got {kind(value)}")


def check_int(value: object, path: str, minimum: int | None = 0, maximum: int | None = None) -> int:
    if type(value) is not int:
        raise wrong(path, "int", value)
    if minimum is not None and value < minimum:
        raise ProtocolError(f"{path}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ProtocolError(f"{path}: must be <= {maximum}, got {value}")
    return value


def check_float(value: object, path: str, finite: bool = False) -> float:
    if type(value) is float:
        if finite and not math.isfinite(value):
            raise ProtocolError(f"{path}: must be finite, got {value}")
        return value  # type: ignore[return-value]
    if type(value) is int:
        try:
            return float(value)  # type: ignore[arg-type]
        except OverflowError:  # JSON spells integers of any size
            raise ProtocolError(f"{path}: must be a finite number, got an integer of "
                                f"{len(str(abs(value)))} digits") from None  # type: ignore[arg-type]
    raise wrong(path, "float", value)


def check_finite_float(value: object, path: str) -> float:
    return check_float(value, path, finite=True)


def check_bool(value: object, path: str) -> bool:
    if type(value) is not bool:
        raise wrong(path, "bool", value)
    return value  # type: ignore[return-value]


def check_str(value: object, path: str, max_chars: int | None = None) -> str:
    if type(value) is not str:
        raise wrong(path, "str", value)
    if max_chars is not None and len(value) > max_chars:  # type: ignore[arg-type]
        raise ProtocolError(f"{path}: at most {max_chars} characters, got {len(value)}")  # type: ignore[arg-type]
    return value  # type: ignore[return-value]


def check_list(value: object, path: str) -> list:
    if type(value) is not list:
        raise wrong(path, "array", value)
    return value  # type: ignore[return-value]


def check_dict(value: object, path: str) -> dict:
    if type(value) is not dict:
        raise wrong(path, "map", value)
    return value  # type: ignore[return-value]


def check_ids(value: object, path: str) -> list[int]:
    """An array of non-negative ints (token ids, block ids), checked in one pass;
    the failing element's path is built only on failure."""
    items = check_list(value, path)
    for item in items:
        if type(item) is not int or item < 0:
            find_bad_id(items, path)
    return items


def find_bad_id(items: list, path: str) -> None:
    """Raise for the first element of `items` that is not a non-negative int."""
    for index, item in enumerate(items):
        check_int(item, f"{path}[{index}]")


def check_strs(value: object, path: str) -> list[str]:
    items = check_list(value, path)
    for item in items:
        if type(item) is not str:
            for index, each in enumerate(items):
                check_str(each, f"{path}[{index}]")
    return items


def optional(check: Callable, value: object, path: str, *args) -> Any:
    """None stays None; anything else goes through `check`."""
    return None if value is None else check(value, path, *args)


def check_token_logprobs(value: object, path: str) -> list[list[tuple[int, float]]]:
    """Log-probabilities per generated token: for each, [token id, logprob] pairs
    (the sampled token first, then the top alternatives). -inf is allowed."""
    return [check_alternatives(alternatives, f"{path}[{i}]")
            for i, alternatives in enumerate(check_list(value, path))]


def check_alternatives(value: object, path: str) -> list[tuple[int, float]]:
    """One token's [token id, logprob] pairs."""
    pairs = []
    for j, pair in enumerate(check_list(value, path)):
        pair_path = f"{path}[{j}]"
        if type(pair) is not list or len(pair) != 2:
            raise wrong(pair_path, "[token id, logprob] pair", pair)
        pairs.append((check_int(pair[0], f"{pair_path}[0]"), check_float(pair[1], f"{pair_path}[1]")))
    return pairs
