"""Short quotes of client-sent values for error messages.

A request may send megabytes in one field, and an error that quotes it back whole is a way to make
the server copy it (and its logs) for nothing: `brief` cuts every string, list, dict and nesting
level short.
"""

from __future__ import annotations

import reprlib

_BRIEF = reprlib.Repr()
_BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxlevel = 60, 60, 6, 6, 3


def brief(value: object) -> str:
    """A short repr of `value` for an error message."""
    return _BRIEF.repr(value)
