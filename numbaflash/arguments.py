"""Checks of the arguments that `numbaflash`'s functions and `sim` share, so a mistake reads the same everywhere.

Each check returns the normalized value or raises TypeError (wrong kind of value) or ValueError (right
kind, outside what is accepted), naming the argument and what it accepts.
"""

import numbers

import numpy as np


def flag(value, name):
    """``True`` or ``False`` (NumPy booleans too); anything else, "yes" and 1 included, is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def positive_int(value, name, least=1):
    """An integer >= ``least`` (Python or NumPy; not a bool, not a float even if whole)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {least}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def window(window_size):
    """``(left, right)``: a pair of ints, each >= 0 or -1 for unbounded."""
    ok = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(w, numbers.Integral) and not isinstance(w, (bool, np.bool_)) for w in window_size))
    if not ok:
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}")
    if min(window_size) < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {tuple(window_size)}")
    return int(window_size[0]), int(window_size[1])


def choice(value, name, options):
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {', '.join(repr(o) for o in options)}; got {value!r}")
    return value
