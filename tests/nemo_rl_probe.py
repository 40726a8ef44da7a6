"""NeMo-RL v0.7.0's own code on given inputs, for the equivalence suite. Runs in a subprocess.

    python -m tests.nemo_rl_probe <probe> in.pt out.pt
    python -m tests.nemo_rl_probe --worker    # the same per JSON line on stdin, in one process

with NeMo-RL's source first on PYTHONPATH and the interpreter from ``nemo_rl_runtime_python``
(tests/conftest.py): ``in.pt`` is the payload the test saved, ``out.pt`` what the probe returns.
Nothing here re-implements NeMo-RL; each probe builds NeMo-RL's objects the way its algorithm
code does (file and function named) and calls them. The test compares the result with the
local engine's own functions in its own process. A worker runs its probes one after another:
none leaves state that changes a later one's result (``register_once``, ``share_environments``,
a Ray per call).

Three adjustments, to the machine rather than to NeMo-RL's code:

* the CPU kernels the local engine's stages use (alignpipe/cpu_kernels.py), so that both sides
  round alike on any x86-64 CPU;
* on Python 3.11 pydantic refuses ``typing.TypedDict``, which NeMo-RL's config modules use (it
  needs 3.13); ``typing_extensions`` has the same class with the same semantics, so it is put
  in its place before NeMo-RL imports;
* there is no GPU: NeMo-RL's non-parallel log-prob path moves the target ids with a bare
  ``.cuda()`` (distributed/model_utils.py ``get_next_token_logprobs_from_logits``), so
  ``Tensor.cuda`` leaves a tensor where it is. Nothing else changes.
"""

from __future__ import annotations

import json
import sys
import types
import typing

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
typing.NotRequired = typing_extensions.NotRequired  # type: ignore[misc]

from alignpipe import cpu_kernels  # noqa: E402

cpu_kernels.pin()  # the stages' CPU kernels, before torch loads: the same bits as the local engine's
import torch  # noqa: E402

torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


_REGISTERED = []


def register_once() -> None:
    """alignpipe's ``register()`` as grpo_driver runs it; NeMo-RL refuses a processor name twice."""
    if not _REGISTERED:
        from alignpipe.engines.nemo_rl.environment import register

        register()
        _REGISTERED.append(True)


def advantages(payload: dict) -> list[torch.Tensor]:
    """Per case: the estimator ``grpo.py::_create_advantage_estimator`` builds from the rendered
    ``grpo``/``loss_fn`` sections, applied as grpo_train applies it (right-padded prompt ids,
    token mask), then clipped by ``_clip_grpo_advantages``."""
    from nemo_rl.algorithms.grpo import _clip_grpo_advantages, _create_advantage_estimator

    out = []
    for case in payload["cases"]:
        config = types.SimpleNamespace(grpo=case["grpo"], loss_fn=case.get("loss_fn", {}))
        estimator = _create_advantage_estimator(config)
        mask = torch.ones(case["rewards"].shape[0], 3)
        adv = estimator.compute_advantage(
            prompt_ids=case["prompt_ids"], rewards=case["rewards"].clone(), mask=mask, repeated_batch={}
        )
        out.append(_clip_grpo_advantages(adv, case["grpo"])[:, 0].clone())
    return out


def grpo_loss(payload: dict) -> list[dict]:
    """Per case: ``ClippedPGLossFn(ClippedPGLossConfig(**loss_fn))`` as grpo.py's setup builds it,
    on the given full-sequence logits, fed as its training worker feeds it: logits divided by
    the temperature, next-token log-probs by ``prepare_loss_input``, ``prev_logprobs`` from the
    same weights (on-policy), normalised by the global valid tokens and sequences. Returns the
    loss, its metrics and the gradient with respect to the logits."""
    from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn, prepare_loss_input
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.model_utils import get_next_token_logprobs_from_logits

    out = []
    for case in payload["cases"]:
        loss_fn = ClippedPGLossFn(ClippedPGLossConfig(**case["loss_fn"]))
        logits = case["logits"].clone().requires_grad_(True)
        scaled = logits / case["temperature"]
        input_ids = case["input_ids"]
        with torch.no_grad():
            lp = get_next_token_logprobs_from_logits(input_ids=input_ids, next_token_logits=scaled)
        zeros = torch.zeros_like(lp[:, :1])
        prev = torch.cat([zeros, lp], dim=1)  # NeMo-RL's get_logprobs prepends 0 for token 0
        data = BatchedDataDict(
            {
                "input_ids": input_ids,
                "token_mask": case["token_mask"],
                "sample_mask": torch.ones(input_ids.shape[0]),
                "advantages": case["advantages"][:, None].expand(input_ids.shape).clone(),
                "prev_logprobs": prev,
                "generation_logprobs": prev.clone(),
                "reference_policy_logprobs": case["reference_logprobs"],
            }
        )
        loss_input, data = prepare_loss_input(scaled, data, loss_fn)
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss, metrics = loss_fn(
            data=data,
            global_valid_seqs=data["sample_mask"].sum(),
            global_valid_toks=mask.sum(),
            **loss_input,
        )
        loss.backward()
        out.append({"loss": loss.detach(), "metrics": metrics, "grad": logits.grad.clone()})
    return out


ENVIRONMENTS: dict[tuple[str, str], object] = {}


def share_environments() -> None:
    """One environment actor per distinct (name, config) for the probe process, as one driver
    has: ``setup_response_data`` calls NeMo-RL's ``create_env`` for every config it reads, and
    each actor (and its verifier workers) is a process that imports NeMo-RL anew (~15 s here).
    The profiles' configs mostly name the same environment."""
    import nemo_rl.data.utils as data_utils

    create = data_utils.create_env
    if getattr(create, "shares", False):  # a worker's later Ray call: patched already
        return

    def shared(env_name: str, env_config: dict):
        key = (env_name, json.dumps(env_config, sort_keys=True, default=str))
        if key not in ENVIRONMENTS:
            ENVIRONMENTS[key] = create(env_name, env_config)
        return ENVIRONMENTS[key]

    shared.shares = True
    data_utils.create_env = shared


def release_environments() -> None:
    """Stop each environment actor and its workers, as NeMo-RL's drivers do at the end
    (``shutdown`` kills the workers); a dropped handle is stopped gracefully, and Ray waits 30 s
    for an actor that never exits before it force-kills it."""
    import ray

    for env in ENVIRONMENTS.values():
        ray.get(env.shutdown.remote())
        ray.kill(env)
    ENVIRONMENTS.clear()


def rlvr_rewards(payload: dict) -> dict:
    """The rendered rlvr config as examples/run_grpo.py runs it: alignpipe's ``register()`` (what
    grpo_driver does before the script), a local CPU Ray, NeMo-RL's ``get_tokenizer`` and
    ``setup_response_data`` (dataset class, processor, and the environment created by its
    ``create_env`` as a real Ray actor), then each row's prompt plus the given completion
    through ``rollouts.py::calculate_rewards``. Returns the rewards and what the processor made
    of each row."""
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.experience.rollouts import calculate_rewards

    register_once()
    cfg = payload["config"]
    tokenizer = get_tokenizer(cfg["policy"]["tokenizer"])
    train, _, task_to_env, _ = setup_response_data(tokenizer, cfg["data"], cfg["env"])
    data = [train[i] for i in range(len(train))]
    logs = [
        [*d["message_log"], {"role": "assistant", "content": completion}]
        for d, completion in zip(data, payload["completions"], strict=True)
    ]
    batch = BatchedDataDict(
        {
            "message_log": logs,
            "task_name": [d["task_name"] for d in data],
            "extra_env_info": [d["extra_env_info"] for d in data],
        }
    )
    returned = calculate_rewards(batch, task_to_env)
    return {
        "rewards": returned.rewards.tolist(),
        "prompts": [d["message_log"][-1]["content"] for d in data],
        "prompt_ids": [torch.cat([m["token_ids"] for m in d["message_log"]]).tolist() for d in data],
        "extra_env_info": [d["extra_env_info"] for d in data],
    }


def dpo_loss(payload: dict) -> list[dict]:
    """Per case: ``DPOLossFn(DPOLossConfig(**dpo))`` as run_dpo's setup builds it, on the policy
    logits of one batch of pairs interleaved [chosen, rejected, ...] as ``preference_collate_fn``
    lays them out, the reference's next-token log-probs (``add_ref_logprobs_to_data`` rolls them
    left by one), normalised by the batch's valid sequences and tokens. Returns the loss, its
    metrics and the gradient with respect to the logits."""
    from nemo_rl.algorithms.loss import DPOLossConfig, DPOLossFn, prepare_loss_input
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    out = []
    for case in payload["cases"]:
        loss_fn = DPOLossFn(DPOLossConfig(**case["dpo"]))
        logits = case["logits"].clone().requires_grad_(True)
        data = BatchedDataDict(
            {
                "input_ids": case["input_ids"],
                "token_mask": case["token_mask"],
                "sample_mask": torch.ones(case["input_ids"].shape[0]),
                "reference_policy_logprobs": case["reference_logprobs"],
            }
        )
        loss_input, data = prepare_loss_input(logits, data, loss_fn)
        loss, metrics = loss_fn(
            data=data,
            global_valid_seqs=data["sample_mask"].sum(),
            global_valid_toks=(data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum(),
            **loss_input,
        )
        loss.backward()
        out.append({"loss": loss.detach(), "metrics": metrics, "grad": logits.grad.clone()})
    return out


class ScriptedGeneration:
    """The one stand-in: there is no GPU for vLLM. It answers each rollout with the next scripted
    completion (token ids of the text), in the output layout NeMo-RL's generation workers use
    (input ids, then the generated ids; lengths; right padding)."""

    def __init__(self, tokenizer, completions: list[str]):
        self.tokenizer, self.completions, self.calls = tokenizer, list(completions), 0

    def generate(self, data, greedy: bool = False):
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        rows, gen_lengths, lengths = [], [], []
        for i in range(data["input_ids"].shape[0]):
            prompt = data["input_ids"][i, : int(data["input_lengths"][i])].tolist()
            new = self.tokenizer(self.completions[self.calls], add_special_tokens=False)["input_ids"]
            new = new + [self.tokenizer.eos_token_id]
            self.calls += 1
            rows.append(prompt + new)
            gen_lengths.append(len(new))
            lengths.append(len(prompt) + len(new))
        width = max(lengths)
        pad = self.tokenizer.pad_token_id
        return BatchedDataDict(
            {
                "output_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
                "generation_lengths": torch.tensor(gen_lengths),
                "unpadded_sequence_lengths": torch.tensor(lengths),
                "logprobs": torch.zeros(len(rows), width),
            }
        )


def _rollout_training_set(cfg: dict, generation, *, greedy: bool):
    """grpo_train's rollout of the config's whole training set: its data and environments
    (``setup_response_data``, real Ray actors from ``create_env``), ``rl_collate_fn``,
    ``repeat_interleave(num_generations_per_prompt)``, ``run_multi_turn_rollout`` with
    ``generation(tokenizer)``. Returns the final batch, the rollout metrics and the tokenizer."""
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.collate_fn import rl_collate_fn
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.experience.rollouts import run_multi_turn_rollout

    register_once()
    tokenizer = get_tokenizer(cfg["policy"]["tokenizer"])
    train, _, task_to_env, _ = setup_response_data(tokenizer, cfg["data"], cfg["env"])
    batch = rl_collate_fn([train[i] for i in range(len(train))])
    final, metrics = run_multi_turn_rollout(
        policy_generation=generation(tokenizer),
        input_batch=batch.repeat_interleave(cfg["grpo"]["num_generations_per_prompt"]),
        tokenizer=tokenizer,
        task_to_env=task_to_env,
        max_seq_len=cfg["policy"]["max_total_sequence_length"],
        max_rollout_turns=cfg["grpo"].get("max_rollout_turns", 1),
        greedy=greedy,
    )
    return final, metrics, tokenizer


def grpo_rollout(payload: dict) -> dict:
    """One GRPO step's rollout through NeMo-RL's own loop, as grpo_train runs it: the rendered
    config's data and environment (``setup_response_data``, a real Ray actor from
    ``create_env``), ``rl_collate_fn``, ``repeat_interleave(num_generations_per_prompt)``,
    ``run_multi_turn_rollout`` with :class:`ScriptedGeneration`, then the advantage estimator
    over ``extract_initial_prompt_messages``' prompt ids. Returns rewards, advantages and what
    each completion decoded to."""
    from nemo_rl.algorithms.grpo import (
        _clip_grpo_advantages,
        _create_advantage_estimator,
        extract_initial_prompt_messages,
    )
    from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message

    cfg = payload["config"]
    final, _, tokenizer = _rollout_training_set(
        cfg, lambda tokenizer: ScriptedGeneration(tokenizer, payload["completions"]), greedy=False
    )
    prompts = extract_initial_prompt_messages(final["message_log"], final["length"])
    flat, _ = batched_message_log_to_flat_message(
        prompts, pad_value_dict={"token_ids": tokenizer.pad_token_id}
    )
    rewards = final["total_reward"]
    estimator = _create_advantage_estimator(types.SimpleNamespace(grpo=cfg["grpo"], loss_fn=cfg["loss_fn"]))
    mask = torch.ones(rewards.shape[0], 2)
    adv = estimator.compute_advantage(
        prompt_ids=flat["token_ids"], rewards=rewards.clone(), mask=mask, repeated_batch=final
    )
    return {
        "rewards": rewards.tolist(),
        "advantages": _clip_grpo_advantages(adv, cfg["grpo"])[:, 0].tolist(),
        "completions": [
            next(m["content"] for m in reversed(log) if m["role"] == "assistant")
            for log in final["message_log"]
        ],
    }


class HFGeneration:
    """A real policy on CPU in NeMo-RL's ``GenerationInterface`` (there is no GPU for vLLM): a
    Hugging Face causal LM generating each row on its own, greedily when asked, in the output
    layout of NeMo-RL's generation workers (input ids, then the generated ids with their
    log-probs; lengths; right padding)."""

    def __init__(self, model_dir: str, tokenizer, max_new_tokens: int):
        from nemo_rl.models.generation.interfaces import GenerationInterface
        from transformers import AutoModelForCausalLM

        assert all(hasattr(self, m) for m in GenerationInterface.__abstractmethods__)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens

    def init_collective(self, *args, **kwargs) -> list:
        return []

    def prepare_for_generation(self, *args, **kwargs) -> bool:
        return True

    def finish_generation(self, *args, **kwargs) -> bool:
        return True

    def generate(self, data, greedy: bool = False):
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        rows, logprobs, gen_lengths, lengths = [], [], [], []
        for i in range(data["input_ids"].shape[0]):
            prompt = data["input_ids"][i, : int(data["input_lengths"][i])]
            with torch.no_grad():
                out = self.model.generate(
                    prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=not greedy,
                    max_new_tokens=self.max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
                    pad_token_id=self.tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True,
                )  # fmt: skip
            new = out.sequences[0, len(prompt) :]
            lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, new, strict=True)]
            rows.append(prompt.tolist() + new.tolist())
            logprobs.append([0.0] * len(prompt) + lp)
            gen_lengths.append(len(new))
            lengths.append(len(rows[-1]))
        width = max(lengths)
        pad = self.tokenizer.pad_token_id
        return BatchedDataDict(
            {
                "output_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
                "logprobs": torch.tensor([p + [0.0] * (width - len(p)) for p in logprobs]),
                "generation_lengths": torch.tensor(gen_lengths),
                "unpadded_sequence_lengths": torch.tensor(lengths),
            }
        )


def tool_rollout(payload: dict) -> dict:
    """A multi-turn GRPO rollout with alignpipe's tools, as grpo_train runs it: the rendered
    config's data and ``alignpipe_tools`` environment (``setup_response_data``, a real Ray actor
    from ``create_env``), ``rl_collate_fn``, ``repeat_interleave(num_generations_per_prompt)``,
    ``run_multi_turn_rollout`` with :class:`HFGeneration` (greedy) for ``grpo.max_rollout_turns``,
    then ``add_grpo_token_loss_masks_and_generation_logprobs``, which marks the tokens the loss
    trains on. Returns each sample's message log (role, content, token ids, loss mask), its
    ``total_reward`` and the rollout metrics."""
    from nemo_rl.algorithms.grpo import add_grpo_token_loss_masks_and_generation_logprobs

    final, metrics, _ = _rollout_training_set(
        payload["config"],
        lambda tokenizer: HFGeneration(payload["model"], tokenizer, payload["max_new_tokens"]),
        greedy=True,
    )
    add_grpo_token_loss_masks_and_generation_logprobs(final["message_log"])
    return {
        "logs": [
            [
                {
                    "role": m["role"],
                    "content": m["content"],
                    "token_ids": m["token_ids"].tolist(),
                    "token_loss_mask": m["token_loss_mask"].tolist(),
                }
                for m in log
            ]
            for log in final["message_log"]
        ],
        "total_reward": final["total_reward"].tolist(),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, int | float)},
    }


def sft_loss(payload: dict) -> dict:
    """``NLLLossFn`` (run_sft's loss) on one batch's logits, token mask and sample weights,
    normalised by the batch's valid tokens; returns the loss and the gradient w.r.t. the logits."""
    from nemo_rl.algorithms.loss import NLLLossFn, prepare_loss_input
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    loss_fn = NLLLossFn()
    logits = payload["logits"].clone().requires_grad_(True)
    data = BatchedDataDict(
        {
            "input_ids": payload["input_ids"],
            "token_mask": payload["token_mask"],
            "sample_mask": payload["sample_mask"],
        }
    )
    loss_input, data = prepare_loss_input(logits, data, loss_fn)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    loss, _ = loss_fn(
        data=data, global_valid_seqs=data["sample_mask"].sum(), global_valid_toks=mask.sum(), **loss_input
    )
    loss.backward()
    return {"loss": loss.detach(), "grad": logits.grad.clone()}


def rm_loss(payload: dict) -> dict:
    """``PreferenceLossFn`` (run_rm's Bradley-Terry loss) on one batch's rewards, interleaved
    [chosen, rejected, ...]; returns the loss, its metrics and the gradient w.r.t. the rewards."""
    from nemo_rl.algorithms.loss import PreferenceLossFn
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    rewards = payload["rewards"].clone().requires_grad_(True)
    data = BatchedDataDict({"sample_mask": torch.ones(rewards.shape[0])})
    loss, metrics = PreferenceLossFn()(rewards[:, None], data, data["sample_mask"].sum(), None)
    loss.backward()
    return {"loss": loss.detach(), "metrics": metrics, "grad": rewards.grad.clone()}


def sft_data(payload: dict) -> list[dict]:
    """The rendered sft config's training data as examples/run_sft.py's ``setup_data`` builds it
    (dataset class, ``sft_processor`` with the config's add_bos/add_eos/add_generation_prompt),
    masked as ``sft_train`` masks it (``add_loss_mask_to_message_log``, assistant turns)."""
    import importlib.util
    from pathlib import Path

    import nemo_rl
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.llm_message_utils import add_loss_mask_to_message_log

    script = Path(nemo_rl.__file__).parents[1] / "examples" / "run_sft.py"
    spec = importlib.util.spec_from_file_location("run_sft", script)
    run_sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_sft)
    cfg = payload["config"]
    tokenizer = get_tokenizer(cfg["policy"]["tokenizer"])
    train, _ = run_sft.setup_data(tokenizer, cfg["data"])
    out = []
    for i in range(len(train)):
        log = train[i]["message_log"]
        add_loss_mask_to_message_log(
            [log],
            roles_to_train_on=["assistant"],
            only_unmask_final=cfg["sft"].get("only_unmask_final", False),
        )
        out.append(
            {
                "input_ids": torch.cat([m["token_ids"] for m in log]).tolist(),
                "token_mask": torch.cat([m["token_loss_mask"] for m in log]).tolist(),
                "loss_multiplier": float(train[i]["loss_multiplier"]),
            }
        )
    return out


def preference_data(payload: dict) -> list[dict]:
    """The rendered dpo/rm config's training pairs as examples/run_dpo.py and run_rm.py build them
    (``setup_preference_data``: dataset class, ``preference_preprocessor``), one pair at a time
    through ``preference_collate_fn(add_loss_mask=True)``, padding stripped."""
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.collate_fn import preference_collate_fn
    from nemo_rl.data.utils import setup_preference_data

    cfg = payload["config"]
    tokenizer = get_tokenizer(cfg["policy"]["tokenizer"])
    train, _ = setup_preference_data(tokenizer, cfg["data"])
    out = []
    for i in range(len(train)):
        batch = preference_collate_fn([train[i]], tokenizer, 1, add_loss_mask=True)
        row = {"weight": float(batch["sample_mask"][0])}
        for j, side in enumerate(("chosen", "rejected")):
            n = int(batch["input_lengths"][j])
            row[f"{side}_input_ids"] = batch["input_ids"][j, :n].tolist()
            row[f"{side}_token_mask"] = batch["token_mask"][j, :n].tolist()
        out.append(row)
    return out


def rm_env_tokens(payload: dict) -> dict:
    """What NeMo-RL's reward model scores for each (prompt, completion) of the rendered rlhf
    config: ``setup_response_data`` (dataset class and processor, after alignpipe's
    ``register()``), the completion appended as the rollout appends it, ``calculate_rewards``'
    role/content view of the log, then ``RewardModelEnvironment.preprocess_data`` itself (its
    scoring needs a GPU policy worker; its tokenisation does not), with the env's own tokenizer
    and task spec."""
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.interfaces import TaskDataSpec
    from nemo_rl.data.llm_message_utils import get_keys_from_message_log
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.environments.reward_model_environment import RewardModelEnvironment

    register_once()
    cfg = payload["config"]
    train, _ = setup_response_data(get_tokenizer(cfg["policy"]["tokenizer"]), cfg["data"], None)
    logs = [
        get_keys_from_message_log(
            [*train[i]["message_log"], {"role": "assistant", "content": c}], ["role", "content"]
        )
        for i, c in enumerate(payload["completions"])
    ]
    env = types.SimpleNamespace(
        tokenizer=get_tokenizer(cfg["env"]["reward_model"]["tokenizer"]),
        task_data_spec=TaskDataSpec(task_name="reward_model_env"),
    )
    batch = RewardModelEnvironment.__ray_metadata__.modified_class.preprocess_data(env, logs)
    return {
        "env": [batch["input_ids"][i, : int(n)].tolist() for i, n in enumerate(batch["input_lengths"])],
        "prompt_ids": [
            torch.cat([m["token_ids"] for m in train[i]["message_log"]]).tolist() for i in range(len(logs))
        ],
    }


PROBES = {
    "rm_env_tokens": rm_env_tokens,
    "advantages": advantages,
    "grpo_loss": grpo_loss,
    "dpo_loss": dpo_loss,
    "sft_loss": sft_loss,
    "rm_loss": rm_loss,
    "grpo_rollout": grpo_rollout,
    "tool_rollout": tool_rollout,
    "rlvr_rewards": rlvr_rewards,
    "sft_data": sft_data,
    "preference_data": preference_data,
}


# Probes whose environments are Ray actors: one local CPU Ray for the whole call.
NEEDS_RAY = {"rlvr_rewards", "grpo_rollout", "tool_rollout"}


def run(probe: str, payload):
    """One probe on ``payload``: one input, or ``{"batch": [input, ...]}`` for one result each."""
    if isinstance(payload, dict) and "batch" in payload:
        return [PROBES[probe](item) for item in payload["batch"]]
    return PROBES[probe](payload)


def run_file(probe: str, src: str, dst: str) -> None:
    """``payload`` (``src``) is one probe input, or ``{"batch": [input, ...]}`` for one result per
    input from one Ray. Probe ``calls`` runs several probes under that one Ray:
    ``{name: [probe, payload]}`` -> ``{name: result}``. The result goes to ``dst``."""
    import contextlib
    import os

    payload = torch.load(src, weights_only=False)
    probes = {name for name, _ in payload.values()} if probe == "calls" else {probe}
    with contextlib.ExitStack() as stack:
        if probes & NEEDS_RAY:
            import ray

            os.environ.pop("RAY_ADDRESS", None)
            # A throwaway loopback cluster: without this, Ray >= 2.60 turns token auth on and
            # writes ~/.ray/auth_token, which every later `ray start --head` on the machine obeys.
            os.environ["RAY_AUTH_MODE"] = "disabled"
            # Per call, also in a worker: no Ray (nor its actors) outlives the call that needs it.
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            stack.callback(ray.shutdown)
            share_environments()
            stack.callback(release_environments)
        if probe == "calls":
            result = {name: run(*call) for name, call in payload.items()}
        else:
            result = run(probe, payload)
    torch.save(result, dst)


def main() -> None:
    run_file(*sys.argv[1:4])


# What the probes import, imported once by the worker: NeMo-RL's algorithm modules take ~15 s of
# CPU to import (wandb, transformers, torch._dynamo), more than most probes' own work.
PRELOAD = (
    "ray",
    "nemo_rl.algorithms.grpo",
    "nemo_rl.algorithms.loss",
    "nemo_rl.algorithms.utils",
    "nemo_rl.data.collate_fn",
    "nemo_rl.data.interfaces",
    "nemo_rl.data.llm_message_utils",
    "nemo_rl.data.utils",
    "nemo_rl.distributed.batched_data_dict",
    "nemo_rl.distributed.model_utils",
    "nemo_rl.environments.reward_model_environment",
    "nemo_rl.experience.rollouts",
)


def worker() -> None:
    """Run ``run_file`` per request line ``{"probe", "src", "dst"}`` on stdin, answering each
    with one line ``{"ok": true}`` or ``{"ok": false, "error": traceback}``; end at EOF."""
    import gc
    import importlib
    import os
    import traceback

    # The answers get the original stdout; fd 1 (and sys.stdout with it) becomes stderr, so
    # nothing NeMo-RL, Ray or a probe prints can land between the answers.
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    gc.disable()  # while importing: ~1.6 of 9 CPU s were full collections over what stays loaded
    for module in PRELOAD:
        importlib.import_module(module)
    gc.freeze()
    gc.enable()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            run_file(request["probe"], request["src"], request["dst"])
            answer = {"ok": True}
        except Exception:
            answer = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
