"""Errors meant for people: what was expected, what was found, where, and how to fix it."""

from __future__ import annotations


class AlignpipeError(Exception):
    """Base class; the CLI prints these without a traceback and exits 2."""


class ConfigError(AlignpipeError):
    """A stage config, profile or params.yaml entry is wrong."""


class DataError(AlignpipeError):
    """An input data row is malformed. Carries file, line and field."""

    def __init__(self, path, line: int | None, field: str | None, problem: str, fix: str = ""):
        self.path, self.line, self.field, self.problem, self.fix = path, line, field, problem, fix
        where = f"{path}" + (f":{line}" if line is not None else "")
        what = f" field '{field}'" if field else ""
        msg = f"{where}:{what} {problem}"
        if fix:
            msg += f" (fix: {fix})"
        super().__init__(msg)


class UnsupportedSetting(AlignpipeError):
    """A setting the chosen engine cannot honour was turned on."""


class NoLearningSignal(AlignpipeError):
    """An RL stage's reward carried no signal (identically zero), so training would teach nothing."""
