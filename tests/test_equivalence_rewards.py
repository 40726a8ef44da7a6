"""RLVR rewards on both engines: the rendered config through NeMo-RL v0.7.0's own data setup
and reward path (``setup_response_data``, its ``create_env`` Ray actor on a local CPU Ray,
``calculate_rewards``) gives each completion the reward the local engine gives it.

Rows cover every verifier kind and every row field a verifier reads (``extract: boxed``, a code
row's tests and sandbox limits, numeric tolerances), each with a right and a wrong completion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignpipe.engines.local.grpo import RewardFn
from alignpipe.engines.local.stages.rlvr import verifier_score
from tests.conftest import REPO
from tests.test_nemo_rl_render import rendered


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
ROWS = [  # (row, completion): the local engine's reward is computed, not written here
    ({"prompt": user("sort 312"), "answer": "123", "verifier": "exact"}, "123"),
    ({"prompt": user("sort 312"), "answer": "123", "verifier": "exact"}, "321"),
    # the whole completion is not the answer; its last box is
    ({"prompt": user("sort 312"), "answer": "123", "verifier": "exact", "extract": "boxed"}, "so \\boxed{9} no \\boxed{123}"),
    ({"prompt": user("sort 312"), "answer": "123", "verifier": "exact", "extract": "boxed"}, "123"),
    ({"prompt": user("add 2 3"), "answer": "5", "verifier": "numeric"}, " 5.0 "),
    ({"prompt": user("add 2 3"), "answer": "5", "verifier": "numeric", "abs_tol": 0.5}, "5.3"),
    ({"prompt": user("add 2 3"), "answer": "5", "verifier": "numeric", "extract": "boxed"}, "it is \\boxed{5}"),
    ({"prompt": user("half of 1"), "answer": "\\frac{1}{2}", "verifier": "math"}, "The answer is $\\boxed{0.5}$"),
    ({"prompt": user("half of 1"), "answer": "\\frac{1}{2}", "verifier": "math"}, "The answer is $\\boxed{2}$"),
    ({"prompt": user("write add"), "answer": "", "verifier": "code", "tests": ADD_TESTS,
      "sandbox": {"timeout_s": 30.0, "cpu_s": 2, "memory_mb": 256, "nproc": 16}},
     "def add(a, b):\n    return a + b\n"),
    ({"prompt": user("write add"), "answer": "", "verifier": "code", "tests": ADD_TESTS,
      "sandbox": {"timeout_s": 30.0, "cpu_s": 2, "memory_mb": 256, "nproc": 16}},
     "def add(a, b):\n    return a - b\n"),
    # a conversation: the prompt's system turn and an earlier exchange travel with it
    ({"prompt": [{"role": "system", "content": "Digits only."}, *user("sort 312")], "answer": "123",
      "verifier": "exact"}, "123"),
    ({"prompt": [*user("sort 21"), {"role": "assistant", "content": "12"}, *user("now sort 312")],
      "answer": "123", "verifier": "exact"}, "312"),
]  # fmt: skip


PROFILES = ("tiny", "small", "default")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    """The tiny profile's kind of tokenizer (char-level) and the small profile's (SmolLM2's);
    the default profile's 1B model is not here, so it is checked with SmolLM2's."""
    from alignpipe.tiny import train_tokenizer
    from tests.smollm2 import build

    tiny = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(["".join(chr(c) for c in range(32, 127))], "char").save_pretrained(tiny)
    return {"tiny": tiny, "small": build(), "default": build()}


def config_with_data(stage: str, profile: str, rows: list[dict], tmp: Path, tokenizer: Path) -> dict:
    """The rendered config reading ``rows`` as its training data, in order, with ``tokenizer``."""
    where = tmp / f"{stage}-{profile}"
    where.mkdir(parents=True, exist_ok=True)
    cfg = rendered(stage, profile, where)
    (where / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg["data"]["train"]["data_path"] = str(where / "train.jsonl")
    cfg["data"].pop("validation", None)
    cfg["data"]["shuffle"] = False
    cfg["policy"]["tokenizer"]["name"] = str(tokenizer)
    if "reward_model" in cfg.get("env", {}):
        cfg["env"]["reward_model"]["tokenizer"]["name"] = str(tokenizer)
    return cfg


def trl_prompt_ids(tokenizer_dir: Path, prompts: list[list[dict]]) -> list[list[int]]:
    """The prompt ids the local GRPO trainer generates from: TRL's ``_tokenize_prompts`` renders
    the conversational prompt with the generation prompt and tokenises it in one call."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    out = tokenizer.apply_chat_template(
        prompts,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    return [list(ids) for ids in out["input_ids"]]


def local_rewards(profile: str, rows: list[dict], completions: list[str], tmp: Path) -> list[float]:
    """The local rlvr stage's reward function (verifier, then the profile's shaping) on TRL's
    conversational rollouts, as GRPOTrainer calls it."""
    from alignpipe.config import load_params
    from alignpipe.context import build_context

    ctx = build_context(REPO, "rlvr", profile, params=load_params(REPO))
    shaping = (ctx.config.get("alignpipe") or {}).get("reward_shaping") or {}
    fn = RewardFn(verifier_score(shaping), scaling=(ctx.config.get("grpo") or {}).get("reward_scaling"))
    columns = {c: [r.get(c) for r in rows] for c in RewardFn.columns}
    prompts = [r["prompt"] for r in rows]  # no stage system turn on these profiles: TRL's prompt is the row's
    completions = [[{"role": "assistant", "content": c}] for c in completions]
    return fn(prompts, completions, [[0]] * len(rows), conversation=prompts, **columns)


@pytest.fixture(scope="module")
def upstream(nemo_rl_runtime, tokenizers, tmp_path_factory) -> dict[str, object]:
    """Every probe of this module from one NeMo-RL process (its imports and one Ray, once):
    rewards (``rlvr``), the RM environment's tokens (``rm``), one GRPO rollout (``rollout``)."""
    tmp = tmp_path_factory.mktemp("upstream")
    rows, completions = [row for row, _ in ROWS], [c for _, c in ROWS]
    rlvr = [
        {"config": config_with_data("rlvr", p, rows, tmp / "rlvr", tokenizers[p]), "completions": completions}
        for p in PROFILES
    ]
    rm = [
        {
            "config": config_with_data("rlhf", p, RM_ROWS, tmp / "rlhf", tokenizers[p]),
            "completions": RM_COMPLETIONS,
        }
        for p in PROFILES
    ]
    rollout = []
    for p in ROLLOUT_PROFILES:
        cfg = config_with_data("rlvr", p, ROLLOUT_ROWS, tmp / "rollout", tokenizers[p])
        group = int(cfg["grpo"]["num_generations_per_prompt"])
        rollout.append({"config": cfg, "completions": scripted_completions(group)})
    calls = {
        "rlvr": ["rlvr_rewards", {"batch": rlvr}],
        "rm": ["rm_env_tokens", {"batch": rm}],
        "rollout": ["grpo_rollout", {"batch": rollout}],
    }
    return {"batches": {"rlvr": rlvr, "rm": rm, "rollout": rollout}, **nemo_rl_runtime("calls", calls)}


@pytest.fixture(scope="module")
def rlvr_upstream(upstream) -> dict[str, dict]:
    """Every profile's rewards through NeMo-RL's data path and environment."""
    return dict(zip(PROFILES, upstream["rlvr"], strict=True))


@pytest.mark.parametrize("profile", PROFILES)
def test_rlvr_rewards_equal_through_nemo_rls_data_and_environment(
    profile, rlvr_upstream, tmp_path: Path
) -> None:
    rows, completions = [row for row, _ in ROWS], [c for _, c in ROWS]
    theirs = rlvr_upstream[profile]
    ours = local_rewards(profile, rows, completions, tmp_path)
    assert theirs["rewards"] == pytest.approx(ours, abs=1e-6), list(
        zip(completions, theirs["rewards"], ours, strict=True)
    )
    assert sorted(set(theirs["rewards"])) == [0.0, 1.0]  # right and wrong completions both present
    assert [info["ground_truth"] for info in theirs["extra_env_info"]] == [r["answer"] for r in rows]


@pytest.mark.parametrize("stage", ["rlvr", "rlhf"])
@pytest.mark.parametrize("profile", PROFILES)
def test_grpo_prompt_tokens_equal_nemo_rls(stage, profile, rlvr_upstream, rm_upstream, tokenizers) -> None:
    """The prompt token ids generation starts from: NeMo-RL's processor (verifier for rlvr,
    alignpipe_rm_processor for rlhf) against TRL's tokenisation in the local trainer."""
    if stage == "rlvr":
        rows, theirs = [r for r, _ in ROWS], rlvr_upstream[profile]
    else:
        rows, theirs = RM_ROWS, rm_upstream[profile]
    assert theirs["prompt_ids"] == trl_prompt_ids(tokenizers[profile], [r["prompt"] for r in rows])


def test_local_only_reward_shaping_is_refused_on_the_nemo_rl_engine() -> None:
    """NeMo-RL never sees the alignpipe: section: a shaping that changes local rewards must stop
    a nemo_rl run (and plan --check) with NeMo-RL's equivalent named, not train unshaped."""
    from alignpipe.config import load_params
    from alignpipe.context import build_context
    from alignpipe.engines.nemo_rl import engine
    from alignpipe.errors import UnsupportedSetting

    params = load_params(REPO)
    params["runtime"] = {**params.get("runtime", {}), "engine": "nemo_rl"}
    assert engine.dropped_training_knobs("rlvr", build_context(REPO, "rlvr", params=params).config) == []
    params["rlvr"] = {
        **(params.get("rlvr") or {}),
        "alignpipe": {"reward_shaping": {"length_penalty": 0.1, "target_length": 8}},
    }
    ctx = build_context(REPO, "rlvr", params=params)
    with pytest.raises(UnsupportedSetting, match=r"length_penalty.*grpo.reward_shaping.*grpo.reward_scaling"):
        engine.run(ctx)
    # the local engine honours it: the same config trains there
    assert local_rewards("tiny", [ROWS[0][0]], ["123"], REPO) == [1.0]


RM_ROWS = [
    {"prompt": user("sort 312"), "answer": "123"},
    {"prompt": user("add 2 3"), "answer": "5"},
    {"prompt": [{"role": "system", "content": "Be brief."}, *user("add 1 1")], "answer": "2"},
    {"prompt": [*user("add 1 1"), {"role": "assistant", "content": "2"}, *user("plus 3?")], "answer": "5"},
]
RM_COMPLETIONS = ["The answer is \\boxed{123}.", "5", "2", "5"]


@pytest.fixture(scope="module")
def rm_upstream(upstream) -> dict[str, list]:
    return dict(zip(PROFILES, upstream["rm"], strict=True))


@pytest.mark.parametrize("profile", PROFILES)
def test_rlhf_reward_model_scores_what_rm_trained_on(profile, rm_upstream, tokenizers) -> None:
    """NeMo-RL's reward-model environment, fed by the rendered rlhf config's data path, tokenises
    each (prompt, completion) exactly as the local scorer does and as the rm stage trained on it
    (chosen side of a pair): one chat template, BOS and EOS, the same ids. Same ids into the same
    reward model give the same score."""
    from transformers import AutoTokenizer

    from alignpipe.engines.local.nemo_rl_keys import PreferenceDataKeys
    from alignpipe.engines.local.preference_pairs import preference_examples
    from alignpipe.measure.reward_model import conversation_token_ids

    theirs = rm_upstream[profile]["env"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[profile], local_files_only=True)
    prompts = [r["prompt"] for r in RM_ROWS]
    assert conversation_token_ids(tokenizer, prompts, RM_COMPLETIONS) == theirs
    pairs = [
        {"prompt": p, "chosen": c, "rejected": "x"} for p, c in zip(prompts, RM_COMPLETIONS, strict=True)
    ]
    data = PreferenceDataKeys(
        max_input_seq_length=4096, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected"
    )
    trained = preference_examples(tokenizer, pairs, data)
    assert [p["chosen_input_ids"] for p in trained] == theirs
    text = tokenizer.decode(theirs[0])
    assert text.count("sort 312") == 1 and "\\boxed{123}" in text  # templated once
    # a conversation's system turn and earlier exchange are scored too, each once
    assert tokenizer.decode(theirs[2]).count("Be brief.") == 1
    assert [tokenizer.decode(theirs[3]).count(t) for t in ("add 1 1", "plus 3?")] == [1, 1]


# The same prompt twice in one step: NeMo-RL's estimator makes it one group of 2G.
ROLLOUT_ROWS = [
    {"prompt": user("sort 312"), "answer": "123", "verifier": "exact", "extract": "boxed"},
    {
        "prompt": [{"role": "system", "content": "Digits only."}, *user("add 2 3")],
        "answer": "5",
        "verifier": "numeric",
    },
    {"prompt": user("sort 312"), "answer": "123", "verifier": "exact", "extract": "boxed"},
]
ANSWERS = {  # completions the scripted policy cycles through, right and wrong
    "sort 312": ["so \\boxed{123}", "\\boxed{321}", "123", "\\boxed{1} then \\boxed{123}"],
    "add 2 3": ["5", "5.0", "6", "five"],
}


ROLLOUT_PROFILES = ("tiny", "small")


def scripted_completions(group: int) -> list[str]:
    return [
        ANSWERS[r["prompt"][-1]["content"]][(i + k) % 4]
        for k, r in enumerate(ROLLOUT_ROWS)
        for i in range(group)
    ]


@pytest.fixture(scope="module")
def rollout_upstream(upstream) -> dict[str, dict]:
    batch = upstream["batches"]["rollout"]
    return {
        p: {**r, "config": b["config"]}
        for p, r, b in zip(ROLLOUT_PROFILES, upstream["rollout"], batch, strict=True)
    }


@pytest.mark.parametrize("profile", ROLLOUT_PROFILES)
def test_one_grpo_rollout_through_nemo_rls_loop_gives_the_local_rewards_and_advantages(
    profile, rollout_upstream, tokenizers, tmp_path: Path
) -> None:
    """run_multi_turn_rollout (nemo_rl/experience/rollouts.py) with a scripted generation (no GPU
    for vLLM) and alignpipe's environment as a Ray actor: per completion the reward the local
    engine's reward function gives, and per sample the advantage its trainer computes."""
    import torch
    from transformers import AutoTokenizer

    from alignpipe.engines.local.nemo_rl_keys import advantage_settings
    from alignpipe.rl.advantages import step_advantages

    theirs = rollout_upstream[profile]
    cfg = theirs["config"]
    group = int(cfg["grpo"]["num_generations_per_prompt"])
    rows = [r for r in ROLLOUT_ROWS for _ in range(group)]
    completions = scripted_completions(group)
    assert theirs["completions"] == completions  # what the environment read is what was generated

    ours = local_rewards(profile, rows, completions, tmp_path)
    assert theirs["rewards"] == pytest.approx(ours, abs=1e-6)
    assert 0.0 < sum(ours) < len(ours)  # right and wrong answers in the step

    tokenizer = AutoTokenizer.from_pretrained(tokenizers[profile], local_files_only=True)
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True) for r in rows]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    width = max(len(p) for p in prompts)
    left = torch.tensor([[-1] * (width - len(p)) + list(p) for p in prompts])  # TRL's left padding, masked
    local = step_advantages(torch.tensor(ours), left, **advantage_settings({"grpo": cfg["grpo"]}))
    assert theirs["advantages"] == pytest.approx(local.tolist(), abs=1e-5)


def test_a_second_ray_call_in_the_probe_worker_rolls_out_the_same(upstream, nemo_rl_runtime) -> None:
    """The probe worker runs every call in one process: a Ray started and shut down by an
    earlier call (``upstream``'s) leaves nothing that changes the next one's rollout."""
    first = upstream["batches"]["rollout"][0]
    assert nemo_rl_runtime("grpo_rollout", first) == upstream["rollout"][0]


def test_rlhf_reward_clip_is_refused_on_the_nemo_rl_engine() -> None:
    from alignpipe.config import load_params
    from alignpipe.context import build_context
    from alignpipe.engines.nemo_rl import engine

    params = load_params(REPO)
    problems = engine.dropped_training_knobs("rlhf", build_context(REPO, "rlhf", params=params).config)
    assert any("alignpipe.reward_clip=[-10.0, 10.0]" in p and "grpo.reward_scaling" in p for p in problems)
    default = build_context(REPO, "rlhf", "default", params=params).config
    assert engine.dropped_training_knobs("rlhf", default) == []  # the GPU profile sets nothing local-only
