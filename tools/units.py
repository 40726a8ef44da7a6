"""A user tool for rlvr rollouts (alignpipe/tools/toolset.py): convert a quantity between units.

User tools' modules live in this folder, a dep of rlvr in dvc.yaml: editing one re-runs rlvr.
A stage imports them by module name from here. To offer this one to the policy::

    rlvr:
      alignpipe:
        tools:
          tools:
            - calculator
            - name: convert
              function: units:convert
              description: Convert a quantity between units of length, mass or time.
              parameters:
                type: object
                properties: {value: {type: number}, unit: {type: string}, to: {type: string}}
                required: [value, unit, to]

A call returns its observation as a string; an exception becomes an error observation the
policy reads (the rollout goes on).
"""

from __future__ import annotations

# unit -> (dimension, size in the dimension's base unit)
UNITS = {
    "mm": ("length", 0.001),
    "cm": ("length", 0.01),
    "m": ("length", 1.0),
    "km": ("length", 1000.0),
    "g": ("mass", 1.0),
    "kg": ("mass", 1000.0),
    "s": ("time", 1.0),
    "min": ("time", 60.0),
    "h": ("time", 3600.0),
}


def convert(value: float, unit: str, to: str) -> str:
    """``value`` ``unit`` in ``to``, e.g. ``convert(1500, "m", "km") == "1.5 km"``."""
    for name in (unit, to):
        if name not in UNITS:
            raise ValueError(f"unknown unit {name!r} (known: {', '.join(UNITS)})")
    (have, size), (want, target) = UNITS[unit], UNITS[to]
    if have != want:
        raise ValueError(f"cannot convert {have} ({unit}) to {want} ({to})")
    return f"{value * size / target:g} {to}"
