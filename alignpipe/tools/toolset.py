"""A toolset built from config, and calling it: every call ends as an observation, never a raise.

Config (a mapping; it will live in a profile's ``alignpipe:`` section)::

    tools:
      - calculator                     # a builtin, by name
      - {name: python, timeout_s: 5}   # a builtin with its own limit
      - name: lookup                   # a user tool: module:function, schema given here
        function: glossary:lookup      # tools/glossary.py in the repository
        description: Look a word up in the glossary.
        parameters: {type: object, properties: {word: {type: string}}, required: [word]}
        sandbox: true                  # default: a sandboxed subprocess per call; false: in-process
    timeout_s: 10                      # per call, unless a tool sets its own
    max_output_chars: 4096             # an observation longer than this is cut, with a marker
    sandbox: {memory_mb: 1024}         # resource limits of sandboxed calls (nproc, fsize_mb, nofile too)

A stage imports user tools' modules from the repository's ``tools/`` folder (``TOOLS_DIR``), a
dep of rlvr in dvc.yaml, so editing one re-runs the stage; an installed package's module is
pinned by the environment instead. Any other module file is refused: DVC would not see it change.

A user tool is called ``function(**arguments)`` and returns a string (the observation) or
anything JSON can hold (the observation is its JSON text). Sandboxed, it runs in
``alignpipe.rewards.sandbox`` as the ``code`` verifier's programs do: the interpreter imports
its module from the directory it was imported from here, so that directory must be readable by
the sandbox's unprivileged uid (build_toolset checks this once, in the sandbox). In-process, a
call that overruns its timeout gives a timeout observation but its thread runs on to the end:
use it only for tools that are fast and trusted.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from alignpipe.errors import ConfigError
from alignpipe.rewards.sandbox import SandboxLimits, SandboxResult, run_code
from alignpipe.tools.arguments import argument_problem, schema_problem
from alignpipe.tools.calculator import CALCULATOR_SCHEMA, evaluate
from alignpipe.tools.calls import ToolCall, ToolError, ToolResult

__all__ = ["BUILTIN_TOOLS", "PYTHON_SCHEMA", "Tool", "Toolset", "build_toolset"]

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program (standard library only, no network, no files outside its "
        "working directory) and return what it prints. Use print() to see a value.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}
BUILTIN_TOOLS = ("calculator", "python")
TOOLSET_KEYS = ("tools", "timeout_s", "max_output_chars", "sandbox")
TOOLS_DIR = "tools"  # the repository's folder of user tools' modules (module docstring)
TOOL_KEYS = ("name", "function", "description", "parameters", "sandbox", "timeout_s")
SANDBOX_KEYS = ("memory_mb", "nproc", "fsize_mb", "nofile")  # time and output follow the tool's own


@dataclass(frozen=True)
class _Outcome:
    """What a tool's runner reports: its output, and the error kind and message if it failed."""

    text: str
    error: str = ""
    message: str = ""


@dataclass(frozen=True)
class Tool:
    """One callable tool: its OpenAI schema parts and ``invoke(arguments) -> _Outcome``."""

    name: str
    description: str
    parameters: dict
    invoke: Callable[[dict], _Outcome]
    timeout_s: float
    sandboxed: bool
    source: str = ""  # a user tool's module file ("" for builtins)

    @property
    def schema(self) -> dict:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


class Toolset:
    """Tools by name, and the one way to call them: ``call(ToolCall) -> ToolResult``."""

    def __init__(self, tools: list[Tool], max_output_chars: int = 4096):
        self.tools = {t.name: t for t in tools}
        self.max_output_chars = max_output_chars

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict]:
        """The OpenAI tool schemas, for a chat template's ``tools=`` or a request's ``tools``."""
        return [t.schema for t in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call. Bad input, a raising, hanging or chatty tool all come back as observations."""
        t0 = time.monotonic()
        try:
            outcome = self._outcome(call)
        except Exception as e:  # a fault in a runner (or a schema it checks) must not end a rollout
            outcome = _Outcome("", "raised", f"{type(e).__name__}: {e}")
        text, truncated = self._capped(outcome.text)
        if outcome.error:
            text = (text if not text or text.endswith("\n") else text + "\n") + f"Error: {outcome.message}"
        elif not text:
            text = "(no output)"  # an empty observation reads to a model like a lost turn
        return ToolResult(call.name, text, outcome.error, time.monotonic() - t0, truncated)

    def _outcome(self, call: ToolCall) -> _Outcome:
        if call.problem:
            form = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
            return _Outcome("", "malformed", f"{call.problem}; write each call as {form}")
        tool = self.tools.get(call.name)
        if tool is None:
            return _Outcome(
                "", "unknown_tool", f"no tool named {call.name!r}; the tools are: {', '.join(self.tools)}"
            )
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as e:
            return _Outcome("", "bad_json", f"the arguments of {call.name!r} are not JSON ({e})")
        problem = argument_problem(arguments, tool.parameters)
        if problem:
            return _Outcome("", "bad_arguments", f"{problem} (tool {call.name!r})")
        return tool.invoke(arguments)

    def _capped(self, text: str) -> tuple[str, bool]:
        cap = self.max_output_chars
        if len(text) <= cap:
            return text, False
        return text[:cap] + f"\n[output truncated at {cap} characters]", True


# --------------------------------------------------------------------------- runners


def _as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _in_process(fn: Callable, timeout_s: float) -> Callable[[dict], _Outcome]:
    """Call ``fn(**arguments)`` in a daemon thread; past ``timeout_s`` report a timeout and move on."""

    def invoke(arguments: dict) -> _Outcome:
        box: dict = {}

        def target() -> None:
            try:
                box["text"] = _as_text(fn(**arguments))
            except BaseException as e:  # SystemExit too: the thread must leave a verdict
                box["error"] = str(e) if isinstance(e, ToolError) else f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=target, daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            return _Outcome(
                "", "timeout", f"the tool ran past its {timeout_s:g} s limit; its result is dropped"
            )
        if "error" in box:
            return _Outcome("", "raised", box["error"])
        return _Outcome(box["text"])

    return invoke


def _sandbox_limits(base: SandboxLimits, timeout_s: float, max_output_chars: int) -> SandboxLimits:
    # 4 bytes a character at most: reading this much keeps every character the cap could keep,
    # and one more, so the cap (not the pipe) decides what was truncated.
    return replace(
        base, timeout_s=timeout_s, cpu_s=math.ceil(timeout_s) + 1, output_bytes=4 * (max_output_chars + 1)
    )


def _sandboxed(code: str, limits: SandboxLimits, with_stderr: bool) -> _Outcome:
    """Run ``code`` in the sandbox; its stdout (and stderr) is the observation, its failure the error."""
    r: SandboxResult = run_code(code, "", limits)
    text = r.stdout + (r.stderr if with_stderr else "")
    if r.reason == "ok":
        return _Outcome(text)
    if r.reason == "timeout":
        return _Outcome(
            text, "timeout", f"the tool ran past its {limits.timeout_s:g} s limit and was stopped"
        )
    if r.reason == "error":
        return _Outcome(text, "raised", r.detail.removeprefix("solution: "))
    return _Outcome(text, "sandbox", f"stopped by the sandbox ({r.detail or r.reason})")


# The python tool's program: the policy's code under the name <code>, with a traceback of its own
# frames only (the source registered, so the lines show), to be followed by "Error: <exception>".
_PYTHON_RUNNER = """\
import linecache, sys, traceback
_src = {source!r}
linecache.cache["<code>"] = (len(_src), None, _src.splitlines(True), "<code>")
try:
    exec(compile(_src, "<code>", "exec"), {{"__name__": "__main__"}})
except SystemExit as _e:
    if _e.code not in (None, 0):
        raise
except BaseException as _e:
    sys.stdout.flush()
    _frames = [f for f in traceback.extract_tb(_e.__traceback__) if f.filename == "<code>"]
    if _frames:
        sys.stderr.write("".join(["Traceback (most recent call last):\\n", *traceback.format_list(_frames)]))
    elif isinstance(_e, SyntaxError):  # where in the code, with its caret
        sys.stderr.write("".join(traceback.format_exception_only(type(_e), _e)[:-1]))
    raise
"""


def _python_tool(limits: SandboxLimits) -> Callable[[dict], _Outcome]:
    def invoke(arguments: dict) -> _Outcome:
        return _sandboxed(_PYTHON_RUNNER.format(source=arguments["code"]), limits, with_stderr=True)

    return invoke


# A user tool's program: import the module as this process did, call it, write the result.
_USER_RUNNER = """\
import contextlib, importlib, json, sys
sys.path.insert(0, {root!r})
_fn = importlib.import_module({module!r})
for _part in {attr!r}.split("."):
    _fn = getattr(_fn, _part)
if not callable(_fn):
    raise TypeError({function!r} + " is not callable")
_args = json.loads({arguments!r})
if _args is not None:
    with contextlib.redirect_stdout(sys.stderr):  # what the function prints is not its result
        _result = _fn(**_args)
    sys.stdout.write(_result if isinstance(_result, str) else json.dumps(_result, ensure_ascii=False))
"""


def _user_program(root: str, function: str, arguments) -> str:
    module, attr = function.split(":", 1)
    return _USER_RUNNER.format(
        root=root, module=module, attr=attr, function=function, arguments=json.dumps(arguments)
    )


def _sandboxed_user_tool(root: str, function: str, limits: SandboxLimits) -> Callable[[dict], _Outcome]:
    def invoke(arguments: dict) -> _Outcome:
        return _sandboxed(_user_program(root, function, arguments), limits, with_stderr=False)

    return invoke


# --------------------------------------------------------------------------- building from config


def _refuse(where: str, tool: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{where}: tool {tool!r}: {problem} (fix: {fix})")


def _import_function(where: str, name: str, function) -> tuple[Callable, str, str]:
    """The callable ``module:function`` names, the sys.path directory its module came from and
    its file ("" for both if none)."""
    if not isinstance(function, str) or function.count(":") != 1 or not all(function.split(":")):
        raise _refuse(
            where,
            name,
            f"function must be 'module:function', got {function!r}",
            "e.g. my_tools.search:lookup",
        )
    module_name, attr = function.split(":")
    try:
        module = obj = importlib.import_module(module_name)
    except Exception as e:
        raise _refuse(
            where, name, f"cannot import module {module_name!r} ({type(e).__name__}: {e})",
            "put the module on PYTHONPATH (the repository root is) or correct the name",
        ) from e  # fmt: skip
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _refuse(
                where, name, f"module {module_name!r} has no {attr!r}", f"define {attr} in {module_name}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise _refuse(where, name, f"{function} is a {type(obj).__name__}, not a callable", "name a function")
    path = Path(getattr(module, "__file__", None) or "")
    if not path.name:  # built into the interpreter (or a namespace package): nowhere to point the sandbox
        return obj, "", ""
    source = str(path)
    if path.name == "__init__.py":
        path = path.parent
    return obj, str(path.parents[len(module_name.split(".")) - 1]), source


def _check_in_sandbox(where: str, name: str, root: str, function: str, limits: SandboxLimits) -> None:
    """Refuse now a user tool the sandbox cannot import, rather than on every call in training."""
    r = run_code(
        _user_program(root, function, None), "", replace(limits, timeout_s=max(limits.timeout_s, 10.0))
    )
    if r.reason != "ok":
        raise _refuse(
            where, name, f"{function} imports here but not in the sandbox ({r.reason}: {r.detail}; it runs as "
            f"{r.run_as} and imports from {root})",
            "make that directory and its parents readable by every user and its imports installed "
            "for the sandbox's interpreter, or set sandbox: false to call it in-process",
        )  # fmt: skip


def _number(where: str, key: str, value, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ConfigError(f"{where}: {key} must be a number >= {minimum:g}, got {value!r}")
    return value


def _build_tool(where: str, spec, timeout_s: float, sandbox: SandboxLimits, max_output_chars: int) -> Tool:
    spec = {"name": spec} if isinstance(spec, str) else spec
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ConfigError(f"{where}: each tool is a builtin's name or a mapping with 'name', got {spec!r}")
    name = spec["name"]
    unknown = sorted(set(spec) - set(TOOL_KEYS))
    if unknown:
        raise _refuse(where, name, f"unknown key {unknown[0]!r}", f"use only {', '.join(TOOL_KEYS)}")
    timeout_s = _number(f"{where}: tool {name!r}", "timeout_s", spec.get("timeout_s", timeout_s), 0.1)
    limits = _sandbox_limits(sandbox, timeout_s, max_output_chars)
    if "function" not in spec:
        if name not in BUILTIN_TOOLS:
            raise _refuse(
                where, name, f"no builtin tool is called {name!r} (builtins: {', '.join(BUILTIN_TOOLS)})",
                "name a builtin, or give a user tool's function: module:function with description and parameters",
            )  # fmt: skip
        extra = sorted(set(spec) - {"name", "timeout_s"})
        if extra:
            raise _refuse(
                where, name, f"a builtin takes only timeout_s, got {extra[0]!r}", f"remove {extra[0]}"
            )
        if name == "calculator":
            fn = CALCULATOR_SCHEMA["function"]
            return Tool(
                name, fn["description"], fn["parameters"], _in_process(evaluate, timeout_s), timeout_s, False
            )
        fn = PYTHON_SCHEMA["function"]
        return Tool(name, fn["description"], fn["parameters"], _python_tool(limits), timeout_s, True)
    for key in ("description", "parameters"):
        if key not in spec:
            raise _refuse(
                where, name, f"a user tool needs {key!r}", f"give its {key} (the policy reads the schema)"
            )
    problem = schema_problem(spec["parameters"])
    if problem:
        raise _refuse(where, name, problem, "give an OpenAI function parameters schema")
    fn, root, source = _import_function(where, name, spec["function"])
    in_sandbox = spec.get("sandbox", True)
    if not isinstance(in_sandbox, bool):
        raise _refuse(where, name, f"sandbox must be true or false, got {in_sandbox!r}", "sandbox: true")
    if in_sandbox and not root:
        raise _refuse(
            where,
            name,
            f"{spec['function']} has no module file to import in the sandbox",
            "set sandbox: false",
        )
    if in_sandbox:
        _check_in_sandbox(where, name, root, spec["function"], limits)
        invoke = _sandboxed_user_tool(root, spec["function"], limits)
    else:
        invoke = _in_process(fn, timeout_s)
    return Tool(
        name, str(spec["description"]), dict(spec["parameters"]), invoke, timeout_s, in_sandbox, source
    )


def _untracked(source: str, repo: Path) -> tuple[str, str] | None:
    """Why DVC would not see a user tool's module file change, and the fix; None if it would."""
    if not source:
        return None  # built into the interpreter
    path, repo = Path(source).resolve(), repo.resolve()
    if path.is_relative_to(repo / TOOLS_DIR):
        return None
    if path.is_relative_to(repo):
        return (
            f"its module {path} is in the repository but not in {TOOLS_DIR}/, the folder dvc.yaml tracks "
            "for rlvr: editing it would not re-run the stage",
            f"move it into {TOOLS_DIR}/ and name it by its module there (e.g. glossary:lookup)",
        )
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if any(path.is_relative_to(Path(p).resolve()) for p in installed):
        return None  # an installed package: the environment pins it
    return (
        f"its module {path} is neither in the repository's {TOOLS_DIR}/ nor an installed package: DVC "
        "cannot see it change",
        f"move it into {repo / TOOLS_DIR} or install it as a package",
    )


def build_toolset(config: Mapping, where: str = "tools config", repo: Path | None = None) -> Toolset:
    """The toolset ``config`` describes (module docstring); ConfigError naming the tool and the fix.

    Every user tool is imported here, and a sandboxed one imported once more in the sandbox, so a
    misnamed or unreadable tool stops a stage before training rather than in its first rollout.
    ``where`` prefixes every message (the profile file and key the config came from). A stage
    gives its ``repo``: user tools are imported from its ``tools/`` and must be tracked there.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where}: expected a mapping with 'tools', got {type(config).__name__}")
    unknown = sorted(set(config) - set(TOOLSET_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(TOOLSET_KEYS)})")
    specs = config.get("tools")
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"{where}: 'tools' must be a non-empty list (e.g. tools: [calculator, python])")
    timeout_s = _number(where, "timeout_s", config.get("timeout_s", 10.0), 0.1)
    max_output_chars = int(_number(where, "max_output_chars", config.get("max_output_chars", 4096), 1))
    sandbox_over = config.get("sandbox") or {}
    bad = (
        sorted(set(sandbox_over) - set(SANDBOX_KEYS))
        if isinstance(sandbox_over, Mapping)
        else ["(not a mapping)"]
    )
    if bad:
        raise ConfigError(f"{where}: sandbox: unknown key {bad[0]!r} (keys: {', '.join(SANDBOX_KEYS)})")
    for key, value in sandbox_over.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: sandbox.{key} must be a whole number >= 1, got {value!r}")
    sandbox = replace(SandboxLimits(), **dict(sandbox_over))
    modules = str(repo / TOOLS_DIR) if repo is not None else None
    if modules and modules not in sys.path:
        sys.path.append(modules)  # last: a user module never shadows an installed one
    tools = [_build_tool(where, spec, timeout_s, sandbox, max_output_chars) for spec in specs]
    if repo is not None:
        for tool in tools:
            if why := _untracked(tool.source, repo):
                raise _refuse(where, tool.name, *why)
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise _refuse(where, tool.name, "named twice", "give each tool its own name")
        seen.add(tool.name)
    return Toolset(tools, max_output_chars)
