"""Does lock/requirements.txt still agree with pyproject.toml? `make venv` asks before it installs.

The lock is ``uv pip compile``'s output (``make lock``): every package pinned with its hashes, one
entry per platform fork. It agrees with pyproject.toml when, on every platform the lock serves,
each requirement of the core dependencies and the locked extras is pinned at a version the
requirement admits, and every package the lock says comes from pyproject.toml still does. Prints
one line per disagreement and exits 1; exits 0 silently when they agree.

    python lock/check.py EXTRA...        (the extras the lock holds: the Makefile's LOCK_EXTRAS)
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The platforms the lock is written for, with CPython 3.11 (the Makefile's interpreter).
PLATFORMS = {
    "Linux x86-64": {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux"},
    "Linux arm64": {"sys_platform": "linux", "platform_machine": "aarch64", "platform_system": "Linux"},
    "macOS arm64": {"sys_platform": "darwin", "platform_machine": "arm64", "platform_system": "Darwin"},
}
PYTHON = {
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}
FIX = "run `make lock` and commit lock/requirements.txt"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    marker: Marker | None
    line: int
    via: tuple[str, ...]  # the lines under the pin (its hashes, uv's "# via" and what it names)

    def comes_from(self, source: str) -> bool:
        """Whether uv's "# via" names ``source`` ("(pyproject.toml)", "-r lock/gym.in")."""
        return any(source in line for line in self.via if "--hash" not in line)


def read_lock(path: Path) -> list[Pin]:
    pins: list[Pin] = []
    lines = path.read_text().splitlines()
    for number, raw in enumerate(lines, 1):
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?:\s*;\s*(.*?))?\s*\\?$", raw)
        if not match:
            continue
        via = []
        for follow in lines[number:]:
            if follow and not follow.startswith(" "):
                break
            via.append(follow)
        name, version, marker = match.groups()
        pins.append(
            Pin(
                canonicalize_name(name),
                version,
                Marker(marker) if marker else None,
                number,
                tuple(via),
            )
        )
    return pins


def requirements(pyproject: Path, extras: list[str]) -> list[tuple[Requirement, str]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    found = [(Requirement(r), "[project].dependencies") for r in project.get("dependencies", [])]
    for extra in extras:
        for r in project.get("optional-dependencies", {}).get(extra, []):
            found.append((Requirement(r), f"[project.optional-dependencies].{extra}"))
    return found


def disagreements(pyproject: Path, lock: Path, extras: list[str]) -> list[str]:
    pins = read_lock(lock)
    wanted = requirements(pyproject, extras)
    problems = []
    for platform, markers in PLATFORMS.items():
        env = {**PYTHON, **markers}
        for req, where in wanted:
            if req.marker and not req.marker.evaluate(env):
                continue
            name = canonicalize_name(req.name)
            pinned = [p for p in pins if p.name == name and (p.marker is None or p.marker.evaluate(env))]
            if not pinned:
                problems.append(
                    f"{lock}: no pin for `{req.name}` on {platform} ({pyproject} {where}: `{req}`); {FIX}"
                )
            elif not req.specifier.contains(pinned[0].version, prereleases=True):
                problems.append(
                    f"{lock}:{pinned[0].line}: {req.name}=={pinned[0].version} on {platform} "
                    f"is outside {pyproject} {where}: `{req}`; {FIX}"
                )
    direct = {canonicalize_name(req.name) for req, _ in wanted}
    for pin in pins:
        if pin.comes_from("(pyproject.toml)") and pin.name not in direct:
            problems.append(
                f"{lock}:{pin.line}: {pin.name} is locked as a requirement of {pyproject}, "
                f"which no longer asks for it; {FIX}"
            )
    return list(dict.fromkeys(problems))  # a problem on every platform is said once per platform


def main(extras: list[str]) -> int:
    problems = disagreements(Path("pyproject.toml"), Path("lock/requirements.txt"), extras)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
