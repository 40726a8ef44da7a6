"""Tools a policy calls (alignpipe/tools): every outcome through the real sandbox, no mocks.

Each sandboxed call starts an interpreter (tens of ms); the one slow test waits out a 1.5 s
timeout, with the other calls of its batch running beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from alignpipe.errors import ConfigError
from alignpipe.tools import (
    ERROR_KINDS,
    ToolCall,
    build_toolset,
    parse_tool_calls,
    render_tool_calls,
    run_calls,
)
from alignpipe.tools.calculator import CalculatorError, evaluate

HANG_TIMEOUT_S = 1.5
CAP = 1000
MARKER = f"[output truncated at {CAP} characters]"

USER_MODULE = """
import os, time

def echo(word, times=1):
    print("chatter that is not the result")
    return {"echo": [word] * times, "cwd": os.getcwd(), "sandboxed": "ALIGNPIPE_SANDBOX" in os.environ}

def shout(word):
    return word.upper()

def fails(reason):
    raise ValueError("cannot: " + reason)

def nap(seconds):
    time.sleep(seconds)
    return "woke"

def flood():
    return "y" * 3_000_000

def scribble(path):
    with open(path, "w") as f:
        f.write("escaped")
    return "written"

NOT_A_FUNCTION = 3
"""
WORD = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


@pytest.fixture(scope="module")
def user_module():
    """A module the sandbox's unprivileged uid can read (pytest's tmp dirs are 0700), on sys.path."""
    root = Path(tempfile.mkdtemp(prefix="alignpipe-tools-test-"))
    root.chmod(0o755)
    name = f"user_tools_{uuid.uuid4().hex[:8]}"
    (root / f"{name}.py").write_text(USER_MODULE)
    (root / f"{name}.py").chmod(0o644)
    sys.path.insert(0, str(root))
    yield name
    sys.path.remove(str(root))
    sys.modules.pop(name, None)
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def toolset(user_module):
    def user(name, fn, parameters=WORD, **kw):
        return {
            "name": name,
            "function": f"{user_module}:{fn}",
            "description": name,
            "parameters": parameters,
            **kw,
        }

    return build_toolset(
        {
            "tools": [
                "calculator",
                {"name": "python", "timeout_s": HANG_TIMEOUT_S},
                user("echo", "echo"),
                user("fails", "fails", {"type": "object", "properties": {"reason": {"type": "string"}}}),
                user("scribble", "scribble", {"type": "object", "properties": {"path": {"type": "string"}}}),
                user("shout", "shout", sandbox=False),
                user(
                    "nap",
                    "nap",
                    {"type": "object", "properties": {"seconds": {"type": "number"}}},
                    sandbox=False,
                    timeout_s=0.3,
                ),  # fmt: skip
                user("flood", "flood", {"type": "object"}, sandbox=False),
            ],
            "max_output_chars": CAP,
        }
    )


# --------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("-(3 - 5) * 1.5", "3.0"),
        ("10 ** 20 + 1", "100000000000000000001"),
        ("  +4 -  -4 ", "8"),
    ],
)
def test_the_calculator_computes_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, says",
    [
        ("9 ** 9 ** 9", "exceeds 4096 bits"),  # refused before it is computed
        ("2 ** 100000", "exceeds 4096 bits"),
        ("2.0 ** 100000", "overflow"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("__import__('os').system('true')", "not arithmetic"),
        ("abs(-1)", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("'a' * 3", "not arithmetic"),
        ("True + 1", "not arithmetic"),
        ("2 <<  3", "not supported"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 2000, "at most 1000"),
    ],
)
def test_the_calculator_refuses_with_a_reason(expression, says):
    with pytest.raises(CalculatorError, match=says):
        evaluate(expression)


def test_a_calculator_refusal_is_an_observation(toolset):
    ok = toolset.call(call("calculator", expression="(1 + 2) * 3"))
    refused = toolset.call(call("calculator", expression="9 ** 9 ** 9"))
    assert (ok.text, ok.error) == ("9", "")
    assert refused.error == "raised"
    assert refused.text.startswith("Error: 9 ** 387420489 exceeds 4096 bits")


# --------------------------------------------------------------------------- python tool and user tools


def test_the_python_tool_returns_what_the_program_prints(toolset):
    result = toolset.call(call("python", code="total = sum(range(10))\nprint('total', total)"))
    assert (result.text, result.error, result.truncated) == ("total 45\n", "", False)


def test_a_failing_program_shows_its_output_traceback_and_error(toolset):
    result = toolset.call(call("python", code="print('before')\nx = 0\n1 / x"))
    assert result.error == "raised"
    assert result.text.startswith("before\nTraceback (most recent call last):\n")
    assert 'File "<code>", line 3' in result.text and "1 / x" in result.text
    assert result.text.endswith("Error: ZeroDivisionError: division by zero")


def test_a_user_tool_runs_in_the_sandbox(toolset):
    result = toolset.call(call("echo", word="hi", times=2))
    assert result.error == "", result.text
    out = json.loads(result.text)  # what it printed went elsewhere: the observation is its result
    assert out["echo"] == ["hi", "hi"]
    assert out["sandboxed"] is True
    assert Path(out["cwd"]).name.startswith("alignpipe-sandbox-")


def test_an_in_process_user_tool_returns_its_string(toolset):
    assert toolset.call(call("shout", word="quiet")).text == "QUIET"


def test_a_sandboxed_tool_cannot_write_outside_its_work_dir(toolset):
    outside = Path(tempfile.mkdtemp(prefix="alignpipe-tools-outside-"))
    outside.chmod(0o777)  # file permissions would allow it: only the sandbox stands in the way
    try:
        by_python = toolset.call(call("python", code=f"open({str(outside / 'a.txt')!r}, 'w').write('x')"))
        by_user_tool = toolset.call(call("scribble", path=str(outside / "b.txt")))
        inside = toolset.call(
            call("python", code="open('c.txt', 'w').write('kept')\nprint(open('c.txt').read())")
        )
        assert (by_python.error, by_user_tool.error) == ("sandbox", "sandbox")
        assert "write to" in by_python.text and "b.txt" in by_user_tool.text
        assert os.listdir(outside) == []
        assert (inside.text, inside.error) == ("kept\n", "")
    finally:
        shutil.rmtree(outside)


# --------------------------------------------------------------------------- bad calls become observations


@pytest.mark.parametrize(
    "bad, kind, says",
    [
        (
            ToolCall("search", "{}"),
            "unknown_tool",
            "no tool named 'search'; the tools are: calculator, python",
        ),
        (ToolCall("calculator", '{"expression": 1 +}'), "bad_json", "are not JSON"),
        (ToolCall("calculator", '"2 + 2"'), "bad_arguments", "expected a JSON object, got string"),
        (ToolCall("calculator", '{"expr": "1"}'), "bad_arguments", "missing required 'expression'"),
        (call("calculator", expression="1", extra=2), "bad_arguments", "unexpected 'extra'"),
        (call("echo", word=7), "bad_arguments", "argument 'word': expected string, got integer"),
        (call("fails", reason="a test"), "raised", "ValueError: cannot: a test"),
        (ToolCall("", "{oops", problem="the <tool_call> block is not JSON"), "malformed", "is not JSON"),
    ],
)
def test_a_bad_call_is_an_observation_with_the_error(toolset, bad, kind, says):
    result = toolset.call(bad)
    assert result.error == kind and kind in ERROR_KINDS
    assert result.text.startswith("Error: ") and says in result.text, result.text


def test_a_hanging_tool_times_out_while_the_rest_of_its_batch_returns(toolset):
    calls = [
        call("python", code="import time\ntime.sleep(60)"),
        call("python", code="import time\ntime.sleep(60)"),
        call("nap", seconds=5),  # in-process: its thread is abandoned, not waited for
        call("python", code="import time\nprint(time.time())"),
        call("calculator", expression="6 * 7"),
    ]
    t0 = time.time()
    (hang, hang_too, nap, quick, calc), stats = run_calls(toolset, calls)
    elapsed = time.time() - t0
    assert (hang.error, hang_too.error, nap.error) == ("timeout", "timeout", "timeout")
    assert f"{HANG_TIMEOUT_S:g} s limit" in hang.text and "0.3 s limit" in nap.text
    assert HANG_TIMEOUT_S <= hang.seconds < 60 and 0.3 <= nap.seconds < 5
    # the hanging calls waited out their limits side by side, not one after the other, and the
    # fast calls ran beside them, their results in their own places
    assert elapsed < 2 * HANG_TIMEOUT_S
    assert float(quick.text) - t0 < HANG_TIMEOUT_S and calc.text == "42"
    assert stats.errors == {"timeout": 3} and stats.calls == 5


@pytest.mark.parametrize(
    "megabytes",
    [call("python", code="print('x' * 2_000_000)"), ToolCall("flood", "{}")],
    ids=["sandboxed", "in-process"],
)
def test_megabytes_of_output_are_cut_at_the_cap(toolset, megabytes):
    result = toolset.call(megabytes)
    assert result.error == "" and result.truncated
    body, marker = result.text.rsplit("\n", 1)
    assert marker == MARKER and len(body) == CAP and set(body) <= {"x", "y"}


def test_a_batch_keeps_its_order_and_counts_its_errors(toolset):
    _, calls, malformed = parse_tool_calls(
        render_tool_calls("", [call("calculator", expression="1 + 1"), call("nope")])
        + "<tool_call>not json</tool_call>"
    )
    calls.append(ToolCall("calculator", "{bad"))
    results, stats = run_calls(toolset, calls)
    assert [r.name for r in results] == ["calculator", "nope", "", "calculator"]
    assert [r.error for r in results] == ["", "unknown_tool", "malformed", "bad_json"]
    assert malformed == stats.malformed == 1
    assert stats.errors == {"unknown_tool": 1, "malformed": 1, "bad_json": 1}
    metrics = stats.metrics()
    assert metrics["tools/calls"] == 4.0 and metrics["tools/errors"] == 3.0
    assert metrics["tools/errors/malformed"] == 1.0 and metrics["tools/seconds"] > 0


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "tool, says",
    [
        ("search", "tool 'search': no builtin tool is called 'search'"),
        ({"name": "python", "memory_mb": 5}, "tool 'python': unknown key 'memory_mb'"),
        ({"name": "look", "function": "no_such_module_xyz:f", "description": "d", "parameters": {}},
         "tool 'look': cannot import module 'no_such_module_xyz'"),
        ({"name": "look", "function": "{mod}:missing", "description": "d", "parameters": {}},
         "tool 'look': module '{mod}' has no 'missing'"),
        ({"name": "look", "function": "{mod}:NOT_A_FUNCTION", "description": "d", "parameters": {}},
         "tool 'look': {mod}:NOT_A_FUNCTION is a int, not a callable"),
        ({"name": "look", "function": "{mod}", "description": "d", "parameters": {}},
         "tool 'look': function must be 'module:function'"),
        ({"name": "look", "function": "{mod}:echo", "parameters": {}}, "tool 'look': a user tool needs 'description'"),
        ({"name": "look", "function": "{mod}:echo", "description": "d", "parameters": {"type": "array"}},
         "tool 'look': parameters must describe an object"),
    ],
)  # fmt: skip
def test_a_bad_tool_config_is_refused_naming_the_tool(user_module, tool, says):
    if isinstance(tool, dict):
        tool = {k: v.format(mod=user_module) if isinstance(v, str) else v for k, v in tool.items()}
    with pytest.raises(ConfigError, match="fix: ") as refused:
        build_toolset({"tools": ["calculator", tool]}, where="conf/x.yaml alignpipe.tools")
    assert str(refused.value).startswith("conf/x.yaml alignpipe.tools: ")
    assert says.format(mod=user_module) in str(refused.value)


@pytest.mark.parametrize(
    "config, says",
    [
        ({"tools": []}, "'tools' must be a non-empty list"),
        ({"tools": ["calculator"], "timeout": 3}, "unknown key 'timeout'"),
        ({"tools": ["calculator"], "sandbox": {"cpu": 1}}, "sandbox: unknown key 'cpu'"),
        ({"tools": ["calculator"], "sandbox": {"memory_mb": "lots"}}, "sandbox.memory_mb must be a whole number"),
        ({"tools": ["calculator", {"name": "calculator", "timeout_s": 1}]}, "tool 'calculator': named twice"),
        ({"tools": [{"name": "python", "timeout_s": 0}]}, "timeout_s must be a number >= 0.1"),
        ({"tools": [{"name": "root", "function": "builtins:dict", "description": "d", "parameters": {}}]},
         "tool 'root': builtins:dict has no module file to import in the sandbox (fix: set sandbox: false)"),
    ],
)  # fmt: skip
def test_a_bad_toolset_config_is_refused(config, says):
    with pytest.raises(ConfigError) as refused:
        build_toolset(config)
    assert says in str(refused.value)


def test_an_interpreter_builtin_can_be_an_in_process_tool():
    spec = {
        "name": "root",
        "function": "builtins:dict",
        "description": "d",
        "parameters": {},
        "sandbox": False,
    }
    assert build_toolset({"tools": [spec]}).call(ToolCall("root", '{"x": 16}')).text == '{"x": 16}'


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox runs as the caller unless the caller is root")
def test_a_user_tool_the_sandbox_cannot_read_is_refused_before_training(tmp_path):
    """A private (0700) directory: the sandbox's own uid cannot import from it."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "private_tools.py").write_text("def f():\n    return 1\n")
    sys.path.insert(0, str(private))
    try:
        tool = {"name": "private", "function": "private_tools:f", "description": "d", "parameters": {}}
        with pytest.raises(
            ConfigError, match="tool 'private': private_tools:f imports here but not in the sandbox"
        ):
            build_toolset({"tools": [tool]})
        assert build_toolset({"tools": [{**tool, "sandbox": False}]}).call(ToolCall("private")).text == "1"
    finally:
        sys.path.remove(str(private))
        sys.modules.pop("private_tools", None)


def test_the_schemas_are_openai_function_schemas(toolset):
    schemas = {s["function"]["name"]: s for s in toolset.schemas()}
    assert list(schemas) == toolset.names
    assert schemas["calculator"]["type"] == "function"
    assert schemas["calculator"]["function"]["parameters"]["required"] == ["expression"]
    assert schemas["echo"]["function"] == {"name": "echo", "description": "echo", "parameters": WORD}


# --------------------------------------------------------------------------- parsing


def test_tool_calls_are_parsed_out_of_a_completion():
    text = textwrap.dedent("""\
        Let me compute both.
        <tool_call>
        {"name": "calculator", "arguments": {"expression": "2 + 2"}}
        </tool_call>
        <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>
        <tool_call>{"arguments": {}}</tool_call>
        <tool_call>{"name": "calculator", "arguments": {"expression": "3"}""")
    content, calls, malformed = parse_tool_calls(text)
    assert content == "Let me compute both."
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", '{"expression": "2 + 2"}'),
        ("python", '{"code": "print(1)"}'),  # a string of arguments is kept as written
    ]
    assert malformed == 2
    assert "needs {" in calls[2].problem and "without </tool_call>" in calls[3].problem
    assert parse_tool_calls("no calls here") == ("no calls here", [], 0)


@pytest.mark.parametrize("content", ["I will check.", ""])
def test_rendered_calls_parse_back_to_themselves(content):
    calls = [call("calculator", expression="1 / 3"), call("python", code="print('é')\n"), ToolCall("noop")]
    text = render_tool_calls(content, calls)
    assert text.count("<tool_call>\n{") == 3
    assert parse_tool_calls(text) == (content, calls, 0)


# --------------------------------------------------------------------------- user tools a stage can track


def test_a_stage_imports_user_tools_from_the_repositorys_tools_folder():
    from tests.conftest import REPO

    convert = {"name": "convert", "function": "units:convert", "description": "d", "sandbox": False,
               "parameters": {"type": "object", "properties": {"value": {"type": "number"}}}}  # fmt: skip
    toolset = build_toolset({"tools": [convert]}, repo=REPO)
    assert toolset.call(call("convert", value=1500, unit="m", to="km")).text == "1.5 km"
    refused = toolset.call(call("convert", value=1, unit="m", to="kg"))
    assert refused.error and "cannot convert length (m) to mass (kg)" in refused.text


def test_a_user_tool_whose_edits_dvc_cannot_see_is_refused(tmp_path):
    """A module in the repository outside tools/, or outside it and not installed: a stage
    refuses it (a library caller, giving no repository, may use it)."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "tools").mkdir(parents=True)
    (repo / "lib").mkdir()
    elsewhere.mkdir()
    tag = uuid.uuid4().hex[:8]
    inside, outside = f"repo_tool_{tag}", f"outside_tool_{tag}"
    (repo / "lib" / f"{inside}.py").write_text("def f():\n    return 'x'\n")
    (elsewhere / f"{outside}.py").write_text("def f():\n    return 'x'\n")
    sys.path[:0] = [str(repo / "lib"), str(elsewhere)]
    try:
        for module, problem in (
            (inside, "is in the repository but not in tools/"),
            (outside, "is neither in the repository's tools/ nor an installed package"),
        ):
            tool = {
                "name": "t",
                "function": f"{module}:f",
                "description": "d",
                "parameters": {},
                "sandbox": False,
            }
            with pytest.raises(ConfigError, match=f"tool 't': its module .*{module}.py {problem}"):
                build_toolset({"tools": [tool]}, repo=repo)
            assert build_toolset({"tools": [tool]}).call(ToolCall("t")).text == "x"
        installed = {
            "name": "dump",
            "function": "json:dumps",
            "description": "d",
            "parameters": {},
            "sandbox": False,
        }
        assert build_toolset({"tools": [installed]}, repo=repo).names == ["dump"]  # the environment pins it
    finally:
        del sys.path[:2]
        for module in (inside, outside):
            sys.modules.pop(module, None)
