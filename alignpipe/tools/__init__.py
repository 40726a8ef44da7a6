"""Tools a policy calls during agentic RL rollouts, for both engines.

``build_toolset(config)`` makes a Toolset from config (builtins ``calculator`` and ``python``,
user ``module:function`` tools), refusing a bad one with a ConfigError before training;
``parse_tool_calls`` reads ``<tool_call>`` blocks out of a completion; ``Toolset.call`` and
``run_calls`` turn calls into observations (every failure is an observation, never a raise);
``ToolStats`` counts a batch for metrics.
"""

from alignpipe.tools.batch import MAX_WORKERS, ToolStats, run_calls
from alignpipe.tools.calls import (
    ERROR_KINDS,
    ToolCall,
    ToolError,
    ToolResult,
    parse_tool_calls,
    render_tool_calls,
)
from alignpipe.tools.toolset import BUILTIN_TOOLS, Tool, Toolset, build_toolset

__all__ = [
    "BUILTIN_TOOLS",
    "ERROR_KINDS",
    "MAX_WORKERS",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "ToolStats",
    "Toolset",
    "build_toolset",
    "parse_tool_calls",
    "render_tool_calls",
    "run_calls",
]
