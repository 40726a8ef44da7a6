"""Agentic rlvr against NeMo-RL (issue 56): alignpipe's tools as a NeMo-RL environment.

* ``tool_step``, the environment's step: which rollouts go on with which observation, the
  reward of those that end (the verifier's, less the malformed-call penalty), the counters it
  carries in the metadata;
* rendering with ``alignpipe.tools`` on: ``grpo.max_rollout_turns``, the task routed to
  ``alignpipe_tools``, a bad tool refused before anything runs, NeMo-RL's own validation;
* NeMo-RL v0.7.0's own ``run_multi_turn_rollout`` on CPU with a real policy (a tiny causal LM
  overfit here to call the calculator) and the tool environment as its Ray actor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignpipe.errors import ConfigError
from alignpipe.tiny import ASSISTANT, EOS, TOOL, train_tokenizer
from alignpipe.tools import build_toolset
from alignpipe.tools.calculator import CALCULATOR_SCHEMA
from alignpipe.tools.episode import observation_text
from tests.test_nemo_rl_render import composed_params

# The tools every prompt offers, as the rendered config passes them (chat_template_kwargs.tools).
TOOLS = [CALCULATOR_SCHEMA]
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
    """The tiny tokenizer with tool turns (alignpipe.tiny.TOOL_CHAT_TEMPLATE), every printable
    character known (error observations quote what they read)."""
    printable = "".join(chr(c) for c in range(32, 127))
    return train_tokenizer([*texts, printable], "words", tools=True)


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
    assert expected == f"{TOOL}42{EOS}{ASSISTANT}"
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
    nemo_rl_src: Path, schema_python: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What `alignpipe plan rlvr --profile default --check` runs, with tools on."""
    from alignpipe.context import build_context
    from alignpipe.engines.nemo_rl import preflight
    from tests.conftest import REPO

    monkeypatch.setenv("NEMO_RL_SRC", str(nemo_rl_src))
    monkeypatch.setenv("NEMO_RL_PYTHON", str(schema_python))
    params = composed_params("default", tmp_path, TOOLS_ON)
    report = preflight.check(build_context(REPO, "rlvr", "default", params=params))
    assert report.ok, report.text()
    assert not [w for w in report.warnings if "alignpipe_tools" in w or "chat_template_kwargs" in w]


# --------------------------------------------------------------------------- NeMo-RL's own rollout loop


def overfit_policy(tokenizer, conversations: list[list[dict]], out: Path, steps: int = 150) -> Path:
    """A tiny causal LM trained on ``conversations`` (every token, as NeMo-RL tokenises each
    piece: no BOS) until greedy decoding replays them: a policy that calls the calculator. The
    loss cannot go below the first user word's (which prompt it is), ~0.02: stop near it."""
    import torch

    from alignpipe.tiny import build_causal_lm

    model_cfg = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    model = build_causal_lm(tokenizer, model_cfg, seed=0)
    ids = [tokenizer(tokenizer.apply_chat_template(c, tokenize=False, tools=TOOLS), add_special_tokens=False).input_ids
           for c in conversations]  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few ms a step: more threads only wait on each other
    try:
        for _ in range(steps):
            loss = sum(model(input_ids=torch.tensor([x]), labels=torch.tensor([x])).loss for x in ids) / len(
                ids
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 0.03:
                break
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_policy(tmp_path_factory) -> Path:
    texts = [json.dumps(c) for c in CONVERSATIONS]
    tokenizer = tool_tokenizer(texts)
    return overfit_policy(tokenizer, CONVERSATIONS, tmp_path_factory.mktemp("tool-policy"))


def test_the_overfit_policy_calls_the_calculator(tool_policy: Path) -> None:
    """The premise of the rollout test: greedy decoding after the sum's prompt writes the call."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_policy, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tool_policy, local_files_only=True)
    prompt = tokenizer(tokenizer.apply_chat_template(ROWS[0]["prompt"], tokenize=False, add_generation_prompt=True, tools=TOOLS),
                       add_special_tokens=False, return_tensors="pt").input_ids  # fmt: skip
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=64, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True) == CALL


@pytest.fixture(scope="module")
def nemo_rl_tool_rollout(nemo_rl_runtime, tool_policy: Path, tmp_path_factory) -> dict:
    """The rendered default rlvr config with tools on, reading ROWS with the overfit policy's
    tokenizer, through the ``tool_rollout`` probe (NeMo-RL's process, a local CPU Ray)."""
    tmp = tmp_path_factory.mktemp("tool-rollout")
    cfg = rendered_with(
        tmp, ("+rlvr.alignpipe.tools.tools=[calculator]", "+rlvr.alignpipe.tools.max_rollout_turns=3")
    )
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg["data"]["train"]["data_path"] = str(tmp / "train.jsonl")
    cfg["data"].pop("validation", None)
    cfg["data"]["shuffle"] = False
    cfg["grpo"]["num_generations_per_prompt"] = 2
    for section in (cfg["policy"]["tokenizer"], cfg["env"]["alignpipe_tools"]["tokenizer"]):
        section["name"] = str(tool_policy)
    result = nemo_rl_runtime("tool_rollout", {"config": cfg, "model": str(tool_policy), "max_new_tokens": 64})
    return {**result, "config": cfg}


def test_nemo_rls_multi_turn_rollout_runs_the_tools_and_scores_the_final_answer(
    nemo_rl_tool_rollout: dict, tool_policy: Path
) -> None:
    """run_multi_turn_rollout (nemo_rl/experience/rollouts.py) with a real policy and
    ``alignpipe_tools`` as its Ray actor: the sum's rollouts call the calculator, read its result
    as the tokens of ``observation_text`` and answer; the echo's answer at once. The loss trains
    on the assistant's tokens only, and each rollout's reward is the verifier's on its answer."""
    from transformers import AutoTokenizer

    from alignpipe.rewards import score_completion

    tokenizer = AutoTokenizer.from_pretrained(tool_policy, local_files_only=True)
    logs, rewards = nemo_rl_tool_rollout["logs"], nemo_rl_tool_rollout["total_reward"]
    group = nemo_rl_tool_rollout["config"]["grpo"]["num_generations_per_prompt"]
    assert len(logs) == len(ROWS) * group
    observation = observation_text(tokenizer, [{"role": "tool", "name": "calculator", "content": "42"}])

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    for k, (row, log) in enumerate(zip([r for r in ROWS for _ in range(group)], logs, strict=True)):
        prompt = tokenizer.apply_chat_template(
            row["prompt"], tokenize=False, add_generation_prompt=True, tools=TOOLS
        )
        assert log[0]["token_ids"] == ids(prompt) and set(log[0]["token_loss_mask"]) == {0}
        if row is ROWS[0]:  # call, tool result, answer, and nothing after the answer
            assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant", "environment"]
            assert log[1]["content"] == CALL and log[1]["token_ids"] == ids(CALL) + [tokenizer.eos_token_id]
            assert log[2]["content"] == observation
            assert log[2]["token_ids"] == ids(observation)
            answer = log[3]
        else:
            assert [m["role"] for m in log] == ["user", "assistant", "environment"]
            answer = log[1]
        assert answer["token_ids"] == ids(row["answer"]) + [tokenizer.eos_token_id]
        assert log[-1]["token_ids"] == []
        for m in log:  # the loss trains on what the policy wrote, never on the prompt or a tool's result
            assert m["token_loss_mask"] == [int(m["role"] == "assistant" and m is not log[0])] * len(
                m["token_ids"]
            )
        assert rewards[k] == score_completion(row, answer["content"]) == 1.0
    assert nemo_rl_tool_rollout["metrics"]["max_turns_per_sample"] == 2


def test_the_local_engine_rolls_out_what_nemo_rl_rolls_out(
    nemo_rl_tool_rollout: dict, tool_policy: Path
) -> None:
    """Both engines, one objective: the local engine's multi-turn rollout (measure/tool_generation.py,
    GRPO's rollout_func) of the same prompts with the same policy and tools gives, per rollout, the
    token ids NeMo-RL's message log holds, the same loss mask (1 on the policy's tokens, 0 on the
    prompt and on every tool token) and the same reward; from equal rewards and prompts both
    engines compute the same advantages (tests/test_equivalence_grpo.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignpipe.measure.tool_generation import tool_rollouts
    from alignpipe.rewards import score_completion

    tokenizer = AutoTokenizer.from_pretrained(tool_policy, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tool_policy, local_files_only=True)
    cfg = nemo_rl_tool_rollout["config"]
    group = cfg["grpo"]["num_generations_per_prompt"]
    rows = [r for r in ROWS for _ in range(group)]
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False, tools=TOOLS)
        for r in rows
    ]
    rollouts, _ = tool_rollouts(
        model, tokenizer, prompts, build_toolset({"tools": ["calculator"]}),
        max_turns=cfg["grpo"]["max_rollout_turns"], max_new_tokens=64,
        max_seq_len=cfg["policy"]["max_total_sequence_length"], sampling={"do_sample": False},
    )  # fmt: skip
    local_rewards = []
    for row, mine, log in zip(rows, rollouts, nemo_rl_tool_rollout["logs"], strict=True):
        theirs_ids = [t for m in log for t in m["token_ids"]]
        theirs_mask = [t for m in log for t in m["token_loss_mask"]]
        assert mine.prompt_ids + mine.completion_ids == theirs_ids, [m["role"] for m in log]
        assert [0] * len(mine.prompt_ids) + mine.env_mask == theirs_mask
        local_rewards.append(score_completion(row, mine.answer))
    assert local_rewards == nemo_rl_tool_rollout["total_reward"]
