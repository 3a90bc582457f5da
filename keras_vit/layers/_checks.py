"""Argument checks shared by the layers and the model builder."""

import numbers


def positive_int(name, value):
    """Return `value` if it is a positive int, else raise a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def as_pair(name, value):
    """Return (h, w) from an int or a pair of positive ints."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(
                f"`{name}` must be an int or a (height, width) pair. Received: {name}={value!r}"
            )
        return (positive_int(name, value[0]), positive_int(name, value[1]))
    value = positive_int(name, value)
    return (value, value)


def rate(name, value):
    """Return `value` if it is a float in [0, 1), else raise a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"`{name}` must be a number in [0, 1). Received: {name}={value!r}")
    return float(value)


def one_of(name, value, choices):
    """Return `value` if it is in `choices`, else raise a ValueError."""
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(repr(c) for c in choices)}. "
            f"Received: {name}={value!r}"
        )
    return value
