"""Agentic rlvr on the NeMo-RL engine (issue 56): alignpipe's tools as a NeMo-RL environment.

* ``tool_step``, the environment's step: which rollouts go on with which observation, the
  reward of those that end (the verifier's, less the malformed-call penalty), the counters it
  carries in the metadata;
* rendering with ``alignpipe.tools`` on: ``grpo.max_rollout_turns``, the task routed to
  ``alignpipe_tools``, a bad tool refused before anything runs, NeMo-RL's own validation;
* NeMo-RL v0.7.0's own ``run_multi_turn_rollout`` on CPU with a real policy (a tiny causal LM
  overfit here to call the calculator) and the tool environment as its Ray actor.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from alignpipe.errors import ConfigError
from alignpipe.tiny import ASSISTANT, EOS, SYSTEM, USER, train_tokenizer
from alignpipe.tools import build_toolset
from alignpipe.tools.episode import observation_text
from tests.test_nemo_rl_render import composed_params

# A prefix-preserving chat template with tool turns (Qwen's shape: a tool result is a user turn
# wrapping it in <tool_response>), FOR THESE TESTS ONLY until alignpipe.tiny's tool-aware
# template (train_tokenizer(..., tools=True)) is on main: switch to that then.
TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + SYSTEM + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}" + EOS + "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    + USER
    + "<tool_response>{{ message['content'] }}</tool_response>"
    + EOS
    + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>'
BAD_CALL = "<tool_call>not json</tool_call>"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# The policy the rollout test trains: it calls the calculator for a sum, answers an echo directly.
CONVERSATIONS = [
    [*user("add 17 25"), {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
     {"role": "assistant", "content": "42"}],
    [*user("say 7"), {"role": "assistant", "content": "7"}],
]  # fmt: skip
ROWS = [
    {"prompt": user("add 17 25"), "answer": "42", "verifier": "numeric"},
    {"prompt": user("say 7"), "answer": "7", "verifier": "exact"},
]


def tool_tokenizer(texts: list[str]):
    printable = "".join(chr(c) for c in range(32, 127))
    tokenizer = train_tokenizer([*texts, printable], "words")
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tool_tokenizer([CALL, "add sort say calculator expression arguments name tool response call"])


@pytest.fixture(scope="module")
def calculator():
    return build_toolset({"tools": ["calculator"]})


def step(tokenizer, toolset, texts, infos, **kw):
    from alignpipe.engines.nemo_rl.environment import tool_step

    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in texts]
    return tool_step(tokenizer, toolset, logs, infos, **{"max_rollout_turns": 3, **kw})


# --------------------------------------------------------------------------- the environment's step


def test_tool_step_runs_calls_and_scores_answers(tokenizer, calculator) -> None:
    from alignpipe.engines.nemo_rl.environment import MALFORMED_KEY, TURNS_KEY

    info = {"ground_truth": "42", "verifier": "numeric"}
    out = step(tokenizer, calculator, [CALL, "42", "41"], [dict(info), dict(info), dict(info)])
    assert out.done == [False, True, True]
    assert out.rewards == [0.0, 1.0, 0.0]
    expected = observation_text(tokenizer, [{"role": "tool", "name": "calculator", "content": "42"}])
    assert out.observations[0] == {"role": "tool", "content": expected}
    assert expected == f"{USER}<tool_response>42</tool_response>{EOS}{ASSISTANT}"
    assert out.observations[1:] == [{"role": "environment", "content": ""}] * 2  # nothing after an answer
    assert [m[TURNS_KEY] for m in out.metadata] == [1, 1, 1]
    assert [m[MALFORMED_KEY] for m in out.metadata] == [0, 0, 0]
    assert out.metadata[0]["ground_truth"] == "42"  # the row's fields travel on
    assert out.answers == [None, "42", "41"]


def test_tool_step_penalises_malformed_calls_over_the_whole_rollout(tokenizer, calculator) -> None:
    from alignpipe.engines.nemo_rl.environment import MALFORMED_KEY, TURNS_KEY

    info = {"ground_truth": "42", "verifier": "numeric"}
    first = step(tokenizer, calculator, [BAD_CALL], [info], malformed_penalty=0.25)
    assert first.done == [False] and first.rewards == [0.0]
    assert "Error:" in first.observations[0]["content"]  # the policy reads why
    assert first.metadata[0][MALFORMED_KEY] == 1
    # NeMo-RL hands the returned metadata back with the next turn: the penalty counts turn one's call
    second = step(tokenizer, calculator, [f"{BAD_CALL} 42"], first.metadata, malformed_penalty=0.25)
    assert second.done == [False]
    third = step(tokenizer, calculator, ["42"], second.metadata, malformed_penalty=0.25)
    assert third.metadata[0][TURNS_KEY] == 3
    assert third.done == [True] and third.rewards == [pytest.approx(1.0 - 2 * 0.25)]


def test_tool_step_ends_every_rollout_on_its_last_turn_without_running_its_calls(
    tokenizer, calculator
) -> None:
    from alignpipe.engines.nemo_rl.environment import TURNS_KEY

    info = {"ground_truth": "42", "verifier": "numeric"}
    out = step(tokenizer, calculator, [f"{CALL} 42", CALL], [{**info, TURNS_KEY: 2}, {**info, TURNS_KEY: 0}])
    assert out.done == [True, False]  # the first is on its third and last turn
    assert out.rewards == [1.0, 0.0]  # scored on the answer without its call block
    assert out.turns[0].results == () and len(out.turns[1].results) == 1


# --------------------------------------------------------------------------- rendering


TOOLS_ON = ("+rlvr.alignpipe.tools.tools=[calculator,python]", "+rlvr.alignpipe.tools.max_rollout_turns=3")


def rendered_with(tmp_path: Path, overrides: tuple[str, ...], stage: str = "rlvr", profile: str = "default"):
    from tests.test_nemo_rl_render import rendered

    return rendered(stage, profile, tmp_path, overrides)


def test_rendering_with_tools_routes_rlvr_to_the_tool_environment(tmp_path: Path) -> None:
    off = rendered_with(tmp_path, ())
    assert (
        off["grpo"]["max_rollout_turns"] == 1 and off["data"]["default"]["env_name"] == "alignpipe_verifier"
    )

    cfg = rendered_with(tmp_path, (*TOOLS_ON, "+rlvr.alignpipe.tools.malformed_penalty=0.1"))
    assert cfg["grpo"]["max_rollout_turns"] == 3
    assert cfg["data"]["default"]["env_name"] == "alignpipe_tools"
    assert "alignpipe_verifier" not in cfg["env"]
    env = cfg["env"]["alignpipe_tools"]
    assert env["toolset"] == {"tools": ["calculator", "python"], "timeout_s": 10.0, "max_output_chars": 4096}
    assert env["max_rollout_turns"] == 3 and env["malformed_penalty"] == 0.1
    assert env["num_workers"] == off["env"]["alignpipe_verifier"]["num_workers"]
    # the prompt lists the tools, and the environment templates tool turns with the same tokenizer
    names = [t["function"]["name"] for t in cfg["policy"]["tokenizer"]["chat_template_kwargs"]["tools"]]
    assert names == ["calculator", "python"]
    assert env["tokenizer"] == cfg["policy"]["tokenizer"]
    from alignpipe.engines.nemo_rl.render import entry_argv

    assert "alignpipe.engines.nemo_rl.grpo_driver" in entry_argv("rlvr", cfg, Path("c.yaml"))  # registers it


def test_rendering_refuses_a_bad_tool_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no builtin tool is called 'calculater'"):
        rendered_with(tmp_path, ("+rlvr.alignpipe.tools.tools=[calculater]",))
    user_tool = '{name:lookup,function:"no_such_module:fn",description:d,parameters:{type:object}}'
    with pytest.raises(ConfigError, match=r"tool 'lookup': cannot import module 'no_such_module'"):
        rendered_with(tmp_path, (f"+rlvr.alignpipe.tools.tools=[{user_tool}]",))
    with pytest.raises(
        ConfigError, match=r"grpo.max_rollout_turns is 2 but alignpipe.tools.max_rollout_turns is 3"
    ):
        rendered_with(tmp_path, (*TOOLS_ON, "+rlvr.grpo.max_rollout_turns=2"))


def test_preflight_passes_nemo_rls_validation_with_tools_on(
    nemo_rl_src: Path, schema_python: Path, schema_checker, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What `alignpipe plan rlvr --profile default --check` runs, with tools on."""
    from alignpipe.context import build_context
    from alignpipe.engines.nemo_rl import preflight
    from tests.conftest import REPO

    monkeypatch.setenv("NEMO_RL_SRC", str(nemo_rl_src))
    monkeypatch.setenv("NEMO_RL_PYTHON", str(schema_python))
    monkeypatch.setattr(preflight, "_run_checker", schema_checker)
    params = composed_params("default", tmp_path, TOOLS_ON)
    report = preflight.check(build_context(REPO, "rlvr", "default", params=params))
    assert report.ok, report.text()
    assert not [w for w in report.warnings if "alignpipe_tools" in w or "chat_template_kwargs" in w]
