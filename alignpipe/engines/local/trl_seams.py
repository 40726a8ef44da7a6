"""Where the local trainers plug into TRL's private methods, checked against the installed TRL.

A local trainer subclasses a TRL trainer and overrides at most two of its private methods (the
seams); it may also call a few. Private methods change between TRL releases without notice, so
each trainer lists what it relies on and :func:`check_seams` fails loudly, naming the method,
before training starts when the installed TRL no longer matches (pyproject pins ``trl`` to the
tested range; tests/test_trl_seams.py runs the check against it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from alignpipe.errors import UnsupportedSetting


@dataclass(frozen=True)
class Seams:
    """``overrides``: method -> its exact parameters, ``self`` first (the subclass replaces it, so
    any new parameter would be silently dropped). ``calls``: method -> the parameters the
    subclass passes (they must still exist)."""

    overrides: dict[str, tuple[str, ...]]
    calls: dict[str, tuple[str, ...]]


def seam_problems(cls: type, seams: Seams) -> list[str]:
    """What no longer matches, one line per method; empty when every seam holds."""
    problems = []
    for kind, wanted, exact in (("overrides", seams.overrides, True), ("calls", seams.calls, False)):
        for name, params in wanted.items():
            method = inspect.getattr_static(cls, name, None)
            if method is None:
                problems.append(f"{cls.__name__}.{name} (alignpipe {kind} it) no longer exists")
                continue
            have = tuple(inspect.signature(method).parameters)
            if (have != params) if exact else not set(params) <= set(have):
                problems.append(
                    f"{cls.__name__}.{name}{inspect.signature(method)}: alignpipe {kind} it "
                    f"as ({', '.join(params)})"
                )
    return problems


def check_seams(cls: type, seams: Seams) -> None:
    """Raise :class:`UnsupportedSetting` naming every seam of ``cls`` the installed TRL broke."""
    problems = seam_problems(cls, seams)
    if problems:
        import trl

        raise UnsupportedSetting(
            f"TRL {trl.__version__} changed methods alignpipe's local trainers plug into:\n  - "
            + "\n  - ".join(problems)
            + "\nfix: install the TRL version pyproject.toml pins (make venv), or port the seam."
        )
