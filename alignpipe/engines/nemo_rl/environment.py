"""alignpipe's verifiers as a NeMo-RL v0.7.0 environment (nemo-rl.md §6-7).

Three pieces, each plugged in where NeMo-RL looks for it:

* ``VerifiedResponseDataset`` (``data.default.dataset_name`` as a dotted path, rlvr and rlhf):
  NeMo-RL's ``ResponseDataset`` (``input_key: prompt``, ``output_key: answer``) that reads the
  prompt as the conversation it is (ResponseDataset makes its input one user turn) and keeps
  each row's verifier fields (``ROW_FIELDS``), which ResponseDataset's ``format_data`` drops.
* ``verifier_data_processor`` (registered as ``alignpipe_verifier_processor``): NeMo-RL's
  ``math_hf_data_processor`` (chat template, ``extra_env_info.ground_truth``), for a prompt
  conversation too (``prompt_data_processor``), plus the row's verifier fields in ``extra_env_info``.
* ``reward_model_data_processor`` (registered as ``alignpipe_rm_processor``, rlhf): the prompt
  as raw turns, so NeMo-RL's reward-model environment templates it once, as rm trained on it.
* ``VerifierEnvironment`` (``data.default.env_name: alignpipe_verifier``): a Ray actor whose
  ``step`` scores the last assistant turn with
  ``alignpipe.rewards.score_completion(s)`` (1.0 correct, 0.0 wrong).
* ``ToolEnvironment`` (``alignpipe_tools``, what rendering routes rlvr to when
  ``alignpipe.tools`` names tools): a Ray actor for multi-turn rollouts whose ``step`` answers
  each last assistant turn with ``alignpipe.tools.episode.respond``: the tool turns to append
  (reward 0, not done), or, for a turn without calls or the last allowed one, the verifier's
  score of its answer less ``malformed_penalty`` per unreadable call of the rollout (done).

``register()`` makes NeMo-RL find them: ``register_env`` (ENV_REGISTRY) **and** the actor
environment registry (``ACTOR_ENVIRONMENT_REGISTRY[fqn] = PY_EXECUTABLES.SYSTEM``; without
it ``get_actor_python_env`` raises), plus ``register_processor``. It must run in the driver
before ``setup_response_data`` -- ``grpo_driver`` does that, then runs run_grpo.py.

nemo_rl, ray and torch exist only inside the NeMo-RL image; this module imports without
them (the pure scoring below is unit-tested on CPU hosts).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignpipe.data.schema import as_conversation
from alignpipe.rewards.verifiers import ROW_FIELDS
from alignpipe.tools import ToolStats
from alignpipe.tools.episode import Turn, respond

ENV_NAME = "alignpipe_verifier"
TOOLS_ENV_NAME = "alignpipe_tools"
TOOLS_ACTOR_FQN = "alignpipe.engines.nemo_rl.environment.ToolEnvironment"
# A rollout's counters, carried from turn to turn in the metadata (extra_env_info) it returns.
TURNS_KEY, MALFORMED_KEY = "alignpipe_tool_turns", "alignpipe_tool_malformed"
PROCESSOR_NAME = "alignpipe_verifier_processor"
RM_PROCESSOR_NAME = "alignpipe_rm_processor"
ACTOR_FQN = "alignpipe.engines.nemo_rl.environment.VerifierEnvironment"
DATASET_FQN = "alignpipe.engines.nemo_rl.environment.VerifiedResponseDataset"
# Fields whose shape or null-ness differs between rows travel as JSON text ("" = absent), so
# the Arrow dataset NeMo-RL builds keeps one schema.
JSON_FIELDS = ("tests", "sandbox", "abs_tol", "rel_tol")

try:  # inside the NeMo-RL image
    import ray
    import torch
    from nemo_rl.data.datasets.response_datasets.response_dataset import ResponseDataset
    from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn

    HAVE_NEMO_RL = True
except ImportError:  # CPU dev hosts and CI: keep the pure logic importable
    ray = None
    torch = None
    HAVE_NEMO_RL = False
    ResponseDataset = object  # type: ignore[assignment,misc]
    EnvironmentInterface = object  # type: ignore[assignment,misc]
    EnvironmentReturn = None


# ----------------------------------------------------------------------------- pure logic


def last_assistant_text(message_log: Sequence[dict[str, Any]]) -> str:
    """The completion to score: the last assistant turn (single-turn GRPO has one)."""
    for message in reversed(message_log):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def row_from_env_info(info: dict[str, Any] | None) -> dict[str, Any]:
    """Rebuild the prepared-data row ``score_completion`` expects from ``extra_env_info``."""
    info = dict(info or {})
    row: dict[str, Any] = {"answer": info.get("ground_truth", info.get("answer", ""))}
    for key in ROW_FIELDS:
        value = info.get(key)
        if key in JSON_FIELDS and isinstance(value, str):
            value = json.loads(value) if value else None
        if value not in (None, ""):
            row[key] = value
    return row


def score_batch(
    message_logs: Sequence[Sequence[dict[str, Any]]], metadata: Sequence[dict[str, Any] | None]
) -> list[float]:
    """One reward per conversation, from the row's own verifier."""
    from alignpipe.rewards import score_completions

    if len(message_logs) != len(metadata):
        raise ValueError(f"{len(message_logs)} conversations but {len(metadata)} metadata entries")
    # Batched: math/code verifiers go to their worker pools in one call per group.
    rows = [row_from_env_info(info) for info in metadata]
    return [float(s) for s in score_completions(rows, [last_assistant_text(log) for log in message_logs])]


@dataclass(frozen=True)
class ToolStep:
    """The tool environment's answer to one batch of assistant turns (``tool_step``)."""

    observations: list[dict[str, str]]
    metadata: list[dict[str, Any]]
    rewards: list[float]
    done: list[bool]
    answers: list[str | None]
    turns: list[Turn]  # what respond said, with each call and result


def tool_step(
    tokenizer,
    toolset,
    message_logs: Sequence[Sequence[dict[str, Any]]],
    metadata: Sequence[dict[str, Any] | None],
    *,
    max_rollout_turns: int,
    malformed_penalty: float = 0.0,
) -> ToolStep:
    """One turn of a batch of tool-using rollouts, as NeMo-RL's ``run_multi_turn_rollout`` asks
    for it: each rollout's last assistant turn answered by ``respond``.

    A rollout that goes on gets its tool turns as a ``tool`` observation (the text NeMo-RL
    tokenises as it is, ``observation_text``), reward 0. One that ends (no call, or its
    ``max_rollout_turns``-th turn, whose calls are not run) gets the verifier's score of the
    answer minus ``malformed_penalty`` per unreadable call of the whole rollout, and an empty
    observation (nothing appended after its answer). The turn count and malformed calls so far
    travel in the returned metadata, which NeMo-RL hands back on the next turn.
    """
    from alignpipe.rewards import score_completions

    if len(message_logs) != len(metadata):
        raise ValueError(f"{len(message_logs)} conversations but {len(metadata)} metadata entries")
    infos = [dict(info or {}) for info in metadata]
    texts = [last_assistant_text(log) for log in message_logs]
    turns: list[Turn | None] = [None] * len(texts)
    for last in (False, True):  # rollouts on their last allowed turn: their calls are not run
        idx = [i for i, info in enumerate(infos) if (info.get(TURNS_KEY, 0) + 1 >= max_rollout_turns) == last]
        if idx:
            answered, _ = respond(tokenizer, toolset, [texts[i] for i in idx], last_turn=last)
            for i, turn in zip(idx, answered, strict=True):
                turns[i] = turn
    for info, turn in zip(infos, turns, strict=True):
        info[TURNS_KEY] = info.get(TURNS_KEY, 0) + 1
        info[MALFORMED_KEY] = info.get(MALFORMED_KEY, 0) + turn.malformed
    done = [i for i, turn in enumerate(turns) if turn.done]
    scores = score_completions([row_from_env_info(infos[i]) for i in done], [turns[i].answer for i in done])
    rewards = [0.0] * len(turns)
    for i, score in zip(done, scores, strict=True):
        rewards[i] = float(score) - malformed_penalty * infos[i][MALFORMED_KEY]
    return ToolStep(
        observations=[
            {"role": "environment", "content": ""} if t.done else {"role": "tool", "content": t.observation}
            for t in turns
        ],
        metadata=infos,
        rewards=rewards,
        done=[t.done for t in turns],
        answers=[t.answer for t in turns],
        turns=turns,
    )


def format_row(data: dict[str, Any], input_key: str, output_key: str, task_name: str) -> dict[str, Any]:
    """ResponseDataset's row format (the prompt's turns, then the answer as the assistant turn)
    plus the fields the verifier needs (Arrow-safe types)."""
    row = {
        "messages": [
            *({"role": m["role"], "content": m["content"]} for m in as_conversation(data[input_key])),
            {"role": "assistant", "content": str(data[output_key])},
        ],
        "task_name": task_name,
    }
    for key in ROW_FIELDS:
        value = data.get(key)
        if key in JSON_FIELDS:
            row[key] = json.dumps(value) if value is not None else ""
        else:
            row[key] = str(value or "")
    row["verifier"] = row["verifier"] or "exact"
    return row


# ----------------------------------------------------------------------------- NeMo-RL glue


class VerifiedResponseDataset(ResponseDataset):  # type: ignore[misc,valid-type]
    """ResponseDataset whose messages are the prompt's turns and the answer, with the row's
    ``ROW_FIELDS`` next to them."""

    def format_data(self, data: dict[str, Any]) -> dict[str, Any]:
        return format_row(data, self.input_key, self.output_key, self.task_name)


def prompt_turns(datum_dict: dict[str, Any], task_data_spec) -> list[dict[str, str]]:
    """The conversation before the answer (``format_row``'s messages but the last), after the
    task's system prompt unless it has its own, with the task's prompt template applied to the
    first user turn (as NeMo-RL's ``get_formatted_message_log`` does)."""
    turns = [dict(m) for m in datum_dict["messages"][:-1]]
    if task_data_spec.prompt:
        first = next(i for i, m in enumerate(turns) if m["role"] == "user")
        turns[first]["content"] = task_data_spec.prompt.format(turns[first]["content"])
    if task_data_spec.system_prompt and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": task_data_spec.system_prompt})
    return turns


def prompt_data_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx):
    """NeMo-RL's ``math_hf_data_processor`` for any prompt conversation.

    A single user turn goes through ``math_hf_data_processor`` itself. A conversation (a system
    turn of its own, earlier turns) is rendered the same way -- the whole prompt templated with
    the generation prompt as one message, ``ground_truth`` the answer -- since that processor
    reads only ``messages[0]`` as the problem and ``messages[1]`` as the answer.
    """
    from nemo_rl.data.processors import math_hf_data_processor

    messages = datum_dict["messages"]
    if len(messages) == 2 and messages[0]["role"] == "user":
        return math_hf_data_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx)
    text = tokenizer.apply_chat_template(
        prompt_turns(datum_dict, task_data_spec),
        tokenize=False,
        add_generation_prompt=True,
        add_special_tokens=False,
    )
    token_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    message_log = [{"role": "user", "content": text, "token_ids": token_ids}]
    length, loss_multiplier = len(token_ids), 1.0
    if length >= max_seq_length:  # as math_hf_data_processor: cut, and train nothing on it
        message_log[0]["token_ids"] = token_ids[: min(4, max_seq_length)]
        loss_multiplier = 0.0
    return {
        "message_log": message_log,
        "length": length,
        "extra_env_info": {"ground_truth": messages[-1]["content"]},
        "loss_multiplier": loss_multiplier,
        "idx": idx,
        "task_name": datum_dict["task_name"],
    }


def verifier_data_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx):
    """``prompt_data_processor`` plus the row's verifier fields in ``extra_env_info``."""
    spec = prompt_data_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx)
    info = dict(spec.get("extra_env_info") or {})
    for key in ROW_FIELDS:
        if datum_dict.get(key) not in (None, ""):
            info[key] = datum_dict[key]
    spec["extra_env_info"] = info
    return spec


def reward_model_data_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx):
    """``prompt_data_processor``'s prompt tokens, with the prompt kept as raw turns.

    NeMo-RL's reward-model environment renders the message log's *contents* with the chat
    template (``get_formatted_message_log``); ``math_hf_data_processor`` stores the already
    templated prompt there, so the reward model would score a conversation templated twice,
    not what the rm stage trained on. Here every turn (the task's system turn when the
    conversation has none of its own, earlier turns, the last user turn) keeps its raw text; all
    the prompt's token ids, which generation reads, stay on the last turn (the others' are
    empty), so what is generated does not change.
    """
    spec = prompt_data_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx)
    (prompt,) = spec["message_log"]
    turns = prompt_turns(datum_dict, task_data_spec)
    spec["message_log"] = [
        {**t, "token_ids": prompt["token_ids"] if i == len(turns) - 1 else prompt["token_ids"][:0]}
        for i, t in enumerate(turns)
    ]
    return spec


class _VerifierEnvironment(EnvironmentInterface):  # type: ignore[misc,valid-type]
    """Scores rollouts with alignpipe's verifiers; one turn, then done."""

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.cfg = dict(cfg or {})

    def step(self, message_log_batch, metadata):
        rewards = score_batch(message_log_batch, metadata)
        observations = [
            {
                "role": "environment",
                "content": "Environment: correct" if r >= 1.0 else "Environment: incorrect",
            }
            for r in rewards
        ]
        return EnvironmentReturn(
            observations=observations,
            metadata=list(metadata),
            next_stop_strings=[None] * len(rewards),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(len(rewards), dtype=torch.bool),
            answers=[last_assistant_text(log) for log in message_log_batch],
        )

    def global_post_process_and_metrics(self, batch):
        # Required by EnvironmentInterface, but NeMo-RL v0.7.0's GRPO loop never calls it: with
        # 0/1 rewards the accuracy is its own train/reward (imported as train/reward_mean).
        return batch, {}

    def shutdown(self) -> None:
        return None


class _ToolEnvironment(EnvironmentInterface):  # type: ignore[misc,valid-type]
    """Multi-turn rollouts with alignpipe's tools (``tool_step``); config: ``tokenizer`` (the
    policy's ``policy.tokenizer`` section, so tool turns are templated as the prompt was),
    ``toolset`` (``build_toolset``'s config), ``max_rollout_turns``, ``malformed_penalty``."""

    def __init__(self, cfg: dict[str, Any]):
        from nemo_rl.algorithms.utils import get_tokenizer

        from alignpipe.tools import build_toolset
        from alignpipe.tools.episode import observation_text

        self.cfg = dict(cfg)
        self.tokenizer = get_tokenizer(self.cfg["tokenizer"])
        self.toolset = build_toolset(
            self.cfg["toolset"], where=f"env.{TOOLS_ENV_NAME}.toolset", repo=Path(self.cfg["repo"])
        )
        self.max_rollout_turns = int(self.cfg["max_rollout_turns"])
        self.malformed_penalty = float(self.cfg.get("malformed_penalty", 0.0))
        self.stats = ToolStats()
        observation_text(self.tokenizer, [{"role": "tool", "content": "x"}])  # refuses a template now

    def step(self, message_log_batch, metadata):
        out = tool_step(
            self.tokenizer,
            self.toolset,
            message_log_batch,
            metadata,
            max_rollout_turns=self.max_rollout_turns,
            malformed_penalty=self.malformed_penalty,
        )
        for turn in out.turns:
            for result in turn.results:
                self.stats.add(result)
        return EnvironmentReturn(
            observations=out.observations,
            metadata=out.metadata,
            next_stop_strings=[None] * len(out.rewards),
            rewards=torch.tensor(out.rewards, dtype=torch.float32),
            terminateds=torch.tensor(out.done, dtype=torch.bool),
            answers=out.answers,
        )

    def global_post_process_and_metrics(self, batch):
        # Never called by v0.7.0's GRPO loop (see _VerifierEnvironment); the counters are here for it.
        return batch, self.stats.metrics()

    def shutdown(self) -> None:
        return None


if HAVE_NEMO_RL:
    # Same actor options as NeMo-RL's MathEnvironment (restart on failure, concurrent steps).
    VerifierEnvironment = ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=1000)(
        _VerifierEnvironment
    )
    ToolEnvironment = ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=1000)(_ToolEnvironment)
else:
    VerifierEnvironment = _VerifierEnvironment
    ToolEnvironment = _ToolEnvironment


def register() -> None:
    """Make NeMo-RL's driver find the env, its Python, and the processor (call before setup)."""
    from nemo_rl.data.processors import register_processor
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES
    from nemo_rl.environments.utils import register_env

    register_env(ENV_NAME, ACTOR_FQN)
    register_env(TOOLS_ENV_NAME, TOOLS_ACTOR_FQN)
    # The env actors run with the driver's interpreter, where alignpipe is installed.
    ACTOR_ENVIRONMENT_REGISTRY[ACTOR_FQN] = PY_EXECUTABLES.SYSTEM
    ACTOR_ENVIRONMENT_REGISTRY[TOOLS_ACTOR_FQN] = PY_EXECUTABLES.SYSTEM
    register_processor(PROCESSOR_NAME, verifier_data_processor)
    register_processor(RM_PROCESSOR_NAME, reward_model_data_processor)
