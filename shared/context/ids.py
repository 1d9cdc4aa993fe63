"""Motion labels and the ids users name prototypes by, with no numerical dependency: the API reads and writes them.

Users name motions in ``GET /v1/jobs?motion=``: a label (``pan_left``), a global prototype ``m{version}.{index}``
(``m3.17``) or a variant ``m{version}.{label}.{index}`` (``m3.pan_left.2``); the version is the prototype set's.
``parse_motion_filter`` reads those strictly: canonical decimal numbers only (no sign, no leading zeros, at most
``MAX_NUMBER``, Postgres's integer), known labels only, nothing around them."""

from __future__ import annotations

import operator
import re
from typing import Literal

LABELS = (
    "static",
    "pan_left",
    "pan_right",
    "tilt_up",
    "tilt_down",
    "zoom_in",
    "zoom_out",
    "rotate_cw",
    "rotate_ccw",
    "mixed",
)
MAX_NUMBER = 2**31 - 1  # versions and indexes fit Postgres's integer


def prototype_id(version: int, index: int) -> str:
    """A global prototype's id as users see it: ``m3.17``."""
    return f"m{_number(version, 'version')}.{_number(index, 'index')}"


def variant_id(version: int, label: str, index: int) -> str:
    """A variant's id as users see it: ``m3.pan_left.2``."""
    if label not in LABELS:
        raise ValueError(f"unknown label {label!r}; labels are {', '.join(LABELS)}")
    return f"m{_number(version, 'version')}.{label}.{_number(index, 'index')}"


MotionFilter = (
    tuple[Literal["label"], str] | tuple[Literal["prototype"], int, int] | tuple[Literal["variant"], int, str, int]
)

_NUMBER = r"(0|[1-9][0-9]{0,9})"  # canonical: no sign, no leading zeros; range checked after
_PROTOTYPE = re.compile(rf"m{_NUMBER}\.{_NUMBER}", re.ASCII)
_VARIANT = re.compile(rf"m{_NUMBER}\.([a-z_]+)\.{_NUMBER}", re.ASCII)
_MAX_FILTER = 64  # characters: more than any label or id


def parse_motion_filter(text: str) -> MotionFilter:
    """``("label", label)``, ``("prototype", version, index)`` or ``("variant", version, label, index)`` from the
    ``motion`` query parameter; ValueError for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"motion filter must be a string, got {type(text).__name__}")
    expected = (
        f"a motion filter is a label ({', '.join(LABELS)}), a prototype id like m3.17 "
        "or a variant id like m3.pan_left.2"
    )
    shown = repr(text) if len(text) <= _MAX_FILTER else repr(text[:_MAX_FILTER]) + "…"
    if text in LABELS:
        return ("label", text)
    if len(text) > _MAX_FILTER:
        raise ValueError(f"{expected}; got {shown}")
    match = _PROTOTYPE.fullmatch(text)
    if match:
        version, index = (_parsed(group, shown) for group in match.groups())
        return ("prototype", version, index)
    match = _VARIANT.fullmatch(text)
    if match:
        name = match.group(2)
        if name not in LABELS:
            raise ValueError(f"unknown label {name!r} in {shown}; labels are {', '.join(LABELS)}")
        return ("variant", _parsed(match.group(1), shown), name, _parsed(match.group(3), shown))
    raise ValueError(f"{expected}; got {shown}")


def _parsed(digits: str, shown: str) -> int:
    value = int(digits)
    if value > MAX_NUMBER:
        raise ValueError(f"{shown}: {digits} is over {MAX_NUMBER}")
    return value


def _number(value: int, name: str) -> int:
    try:
        number = operator.index(value)  # ints and numpy's integers; not floats, strings, or bools (below)
    except TypeError:
        number = -1
    if isinstance(value, bool) or not 0 <= number <= MAX_NUMBER:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_NUMBER}, got {value!r}")
    return number
