"""Argument checks shared by the layers and the model builder."""

import math
import numbers
import os

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type.

    A TypeError, and a ValueError too, as the other checks here raise: code
    that catches either (the command line's error reporting included) sees it.
    """


def positive_int(name, value):
    """Return `value` if it is a positive int, else raise a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def non_negative_int(name, value):
    """Return `value` if it is an int >= 0, else raise a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer. Received: {name}={value!r}")
    return int(value)


SEED_LIMIT = 2**32  # NumPy's, scikit-learn's and keras.utils.set_random_seed's


def seed(name, value):
    """Return `value` if it is an int in [0, 2**32), the seeds every library takes,
    else raise a ValueError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not 0 <= value < SEED_LIMIT
    ):
        raise ValueError(
            f"`{name}` must be an integer in [0, 2**32 - 1]. Received: {name}={value!r}"
        )
    return int(value)


def as_pair(name, value):
    """Return (h, w) from a positive int or a pair of positive ints."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(_is_positive_int(side) for side in value):
            raise ValueError(
                f"`{name}` must be a positive int or a (height, width) pair of positive ints. "
                f"Received: {name}={value!r}"
            )
        return (int(value[0]), int(value[1]))
    if not _is_positive_int(value):
        raise ValueError(
            f"`{name}` must be a positive int or a (height, width) pair of positive ints. "
            f"Received: {name}={value!r}"
        )
    return (int(value), int(value))


def _is_positive_int(value):
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value > 0


def rate(name, value):
    """Return `value` if it is a float in [0, 1), else raise a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"`{name}` must be a number in [0, 1). Received: {name}={value!r}")
    return float(value)


def real(name, value, low=None, high=None, low_open=False, high_open=False):
    """Return `value` as a float if it is a finite number in the given range.

    `low` and `high` bound it (None: unbounded), inclusive unless `low_open`
    or `high_open`. Else a ValueError, or an ArgumentTypeError for what is
    not a number at all (a string, a bool, None).
    """
    expected = _range_text(low, high, low_open, high_open)
    message = f"`{name}` must be {expected}. Received: {name}={value!r}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{message} of type {type(value).__name__}")
    value = float(value)
    if (
        not math.isfinite(value)
        or (low is not None and (value <= low if low_open else value < low))
        or (high is not None and (value >= high if high_open else value > high))
    ):
        raise ValueError(message)
    return value


def _range_text(low, high, low_open, high_open):
    if low is not None and high is not None:
        return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low == 0:
        return "a positive number" if low_open else "a non-negative number"
    if low is not None:
        return f"a number {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"a number {'<' if high_open else '<='} {high:g}"
    return "a finite number"


def boolean(name, value):
    """Return `value` if it is True or False (a NumPy bool too), else raise an ArgumentTypeError.

    No truthiness: "false", "no", None, 0 or 1 are refused, not read as a flag.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ArgumentTypeError(
        f"`{name}` must be True or False. Received: {name}={value!r} of type {type(value).__name__}"
    )


def path_like(name, value):
    """Return `value` as a str if it is a file system path (str or os.PathLike)."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ArgumentTypeError(
            f"`{name}` must be a file system path (a str or os.PathLike). "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    value = os.fspath(value)
    if not isinstance(value, str):  # a PathLike of bytes
        raise ArgumentTypeError(
            f"`{name}` must be a file system path given as text. Received: {name}={value!r}"
        )
    if not value:
        raise ValueError(f"`{name}` must be a non-empty path. Received: {name}=''")
    return value


def rank_of(shape):
    """The rank of `shape`, a tuple or a TensorShape; None for an unknown rank
    (a TensorFlow function traced for inputs of several ranks)."""
    if hasattr(shape, "rank"):
        return shape.rank
    return len(shape)


def shown_shape(shape):
    """`shape` as a tuple for a message, or a note that its rank is unknown."""
    return tuple(shape) if rank_of(shape) is not None else "<unknown rank>"


def one_of(name, value, choices):
    """Return `value` if it is in `choices`, else raise a ValueError."""
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(repr(c) for c in choices)}. "
            f"Received: {name}={value!r}"
        )
    return value
