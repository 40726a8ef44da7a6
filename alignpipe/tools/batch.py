"""Running a batch of tool calls at once, and the counters a trainer logs for it.

A rollout step asks for many calls at a time (every sample of every group, each turn). They
run in a thread pool, one thread per call up to MAX_WORKERS: the threads mostly wait on sandbox
subprocesses, so one slow tool costs the batch its own timeout, not the sum of everyone's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from alignpipe.tools.calls import ToolCall, ToolResult
from alignpipe.tools.toolset import Toolset

__all__ = ["MAX_WORKERS", "ToolStats", "run_calls"]

MAX_WORKERS = 32  # past this many calls in one batch, calls queue for a thread


@dataclass
class ToolStats:
    """Counters over a batch of calls (and, with ``add``, over several batches)."""

    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # ERROR_KINDS -> count
    truncated: int = 0
    seconds: float = 0.0  # summed over calls: time spent in tools, not wall time

    @property
    def malformed(self) -> int:
        """Calls whose ``<tool_call>`` block could not be read."""
        return self.errors.get("malformed", 0)

    def add(self, result: ToolResult) -> None:
        self.calls += 1
        if result.error:
            self.errors[result.error] = self.errors.get(result.error, 0) + 1
        self.truncated += result.truncated
        self.seconds += result.seconds

    def metrics(self, prefix: str = "tools/") -> dict[str, float]:
        """Flat metric names (``tools/calls``, ``tools/errors/timeout``, ...) for DVCLive."""
        out = {
            f"{prefix}calls": float(self.calls),
            f"{prefix}errors": float(sum(self.errors.values())),
            f"{prefix}malformed": float(self.malformed),
            f"{prefix}truncated": float(self.truncated),
            f"{prefix}seconds": self.seconds,
        }
        out.update({f"{prefix}errors/{kind}": float(n) for kind, n in sorted(self.errors.items())})
        return out


def run_calls(
    toolset: Toolset, calls: list[ToolCall], max_workers: int = MAX_WORKERS
) -> tuple[list[ToolResult], ToolStats]:
    """Run ``calls`` concurrently: results in the order of ``calls``, and the batch's counters."""
    stats = ToolStats()
    if not calls:
        return [], stats
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(calls)))) as pool:
        results = list(pool.map(toolset.call, calls))
    for result in results:
        stats.add(result)
    return results, stats
