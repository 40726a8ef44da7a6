"""Rendered NeMo-RL v0.7.0 configs for every trainer stage and GPU profile.

Golden files (tests/golden/<stage>.<profile>.nemo_rl.yaml) hold the exact config each
entry script would receive, rendered with params composed by DVC's Hydra support for
``dvc exp run -S profile=<profile>`` and fixed paths (/repo, /scratch/run). Regenerate
after an intended change with:

    ALIGNPIPE_REGEN_GOLDEN=1 .venv/bin/pytest tests/test_nemo_rl_render.py -q

and review the diff. The other tests check, independently of the goldens, what NeMo-RL
requires of each config (sections, types, paths, entry script, warm starts).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from alignpipe import config as C
from alignpipe.engines.nemo_rl.render import (
    REQUIRED_SECTIONS,
    RUN_GRPO,
    RUN_GRPO_NEMO_GYM,
    entry_argv,
    render,
)
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden"
ROOT = Path("/repo")
SCRATCH = Path("/scratch/run")
TRAINERS = ("sft", "rm", "dpo", "rlvr", "rlhf")
CASES = [(s, p) for p in ("default", "default_megatron", "nemo_gym") for s in TRAINERS]


_COMPOSED: dict[tuple[str, tuple[str, ...]], str] = {}


def composed_params(profile: str, tmp_path: Path, overrides: tuple[str, ...] = ()) -> dict:
    """params.yaml exactly as `dvc exp run -S profile=<profile> [-S ...]` composes it."""
    from dvc.utils.hydra import compose_and_dump

    key = (profile, overrides)
    if key not in _COMPOSED:  # Hydra composition takes ~1 s; compose each variant once
        out = tmp_path / f"params-{profile}.yaml"
        compose_and_dump(
            out, str(REPO / "conf"), None, "config", str(REPO), [f"profile={profile}", *overrides]
        )
        _COMPOSED[key] = out.read_text()
    return yaml.safe_load(_COMPOSED[key])


def rendered(stage: str, profile: str, tmp_path: Path, overrides: tuple[str, ...] = ()) -> dict:
    params = composed_params(profile, tmp_path, overrides)
    cfg = C.resolve_stage_config(REPO, stage, params, profile)
    contract = C.load_contract(REPO, stage)
    return render(stage, cfg, root=ROOT, scratch=SCRATCH, consumes_paths=[p.path for p in contract.consumes])


@pytest.mark.parametrize(("stage", "profile"), CASES)
def test_rendered_config_matches_golden(stage: str, profile: str, tmp_path: Path) -> None:
    text = yaml.safe_dump(rendered(stage, profile, tmp_path), sort_keys=False, default_flow_style=False)
    golden = GOLDEN / f"{stage}.{profile}.nemo_rl.yaml"
    if os.environ.get("ALIGNPIPE_REGEN_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing; regenerate with ALIGNPIPE_REGEN_GOLDEN=1"
    assert text == golden.read_text(), f"{golden.name} differs from the render; review and regenerate"


@pytest.mark.parametrize(("stage", "profile"), CASES)
def test_schema_essentials(stage: str, profile: str, tmp_path: Path) -> None:
    cfg = rendered(stage, profile, tmp_path)
    for section in REQUIRED_SECTIONS[stage]:
        assert isinstance(cfg[section], dict), f"{stage}/{profile}: section {section} missing"
    assert "alignpipe" not in cfg
    assert cfg["checkpointing"]["checkpoint_dir"] == "/scratch/run/checkpoints"
    assert cfg["checkpointing"]["enabled"] is True
    assert cfg["checkpointing"]["metric_name"].startswith(("val:", "train:"))
    assert cfg["logger"]["log_dir"] == "/scratch/run/logs"
    assert cfg["logger"]["tensorboard_enabled"] is True
    assert cfg["logger"]["wandb_enabled"] is False and cfg["logger"]["mlflow_enabled"] is False
    assert cfg["cluster"] == {**cfg["cluster"], "gpus_per_node": 8, "num_nodes": 1}
    # Nothing unresolved reaches NeMo-RL (run_dpo.py/run_rm.py have no ${mul:...} resolver).
    assert "${" not in yaml.safe_dump(cfg)
    algo = C.load_contract(REPO, stage).algorithm
    assert cfg[algo]["seed"] == 42
    data = cfg["data"]
    for split in ("train", "validation"):
        assert isinstance(data[split], dict), "DPO/RM need data.train as a dict; GRPO/SFT accept it too"
        path = data[split]["data_path"]
        assert path.startswith("/"), path
    policy = cfg["policy"]
    assert isinstance(policy["train_global_batch_size"], int)
    assert isinstance(policy["max_total_sequence_length"], int)
    assert policy["precision"] == "bfloat16"
    megatron = policy["megatron_cfg"]["enabled"]
    assert megatron is not policy["dtensor_cfg"]["enabled"], "exactly one training backend"


@pytest.mark.parametrize("stage", TRAINERS)
def test_data_sections_point_at_prepared_families(stage: str, tmp_path: Path) -> None:
    cfg = rendered(stage, "default", tmp_path)
    family = {"sft": "sft", "rm": "preference", "dpo": "preference", "rlvr": "rlvr", "rlhf": "rlhf"}[stage]
    assert cfg["data"]["train"]["data_path"] == f"/repo/data/prepared/{family}/train.jsonl"
    assert cfg["data"]["validation"]["data_path"] == f"/repo/data/prepared/{family}/validation.jsonl"
    default = cfg["data"]["default"]
    if family == "preference":
        assert default["dataset_name"] == "BinaryPreferenceDataset"
        assert (default["prompt_key"], default["chosen_key"], default["rejected_key"]) == (
            "prompt",
            "chosen",
            "rejected",
        )
    elif family == "sft":
        assert default["dataset_name"] == "openai_format" and default["processor"] == "sft_processor"
        assert default["use_preserving_dataset"] is True  # rows as written (tool calls' arguments)
    else:
        assert (default["input_key"], default["output_key"]) == ("prompt", "answer")


def test_entry_scripts(tmp_path: Path) -> None:
    cfg_path = Path("/scratch/run/nemo_rl_config.yaml")
    driver = [
        "python",
        "-m",
        "alignpipe.engines.nemo_rl.grpo_driver",
        "--entry",
        RUN_GRPO,
        "--config",
        str(cfg_path),
    ]
    expect = {
        ("sft", "default"): ["python", "examples/run_sft.py", "--config", str(cfg_path)],
        ("rm", "default"): ["python", "examples/run_rm.py", "--config", str(cfg_path)],
        ("dpo", "default"): ["python", "examples/run_dpo.py", "--config", str(cfg_path)],
        # alignpipe's verifier env (rlvr) and its RM processor (rlhf: raw prompt turns) must be
        # registered in the driver, which then runs run_grpo.py unchanged.
        ("rlvr", "default"): driver,
        ("rlhf", "default"): driver,
        ("rlvr", "nemo_gym"): ["python", RUN_GRPO_NEMO_GYM, "--config", str(cfg_path)],
        ("rlhf", "nemo_gym"): ["python", RUN_GRPO_NEMO_GYM, "--config", str(cfg_path)],
    }
    for (stage, profile), argv in expect.items():
        assert entry_argv(stage, rendered(stage, profile, tmp_path), cfg_path) == argv, (stage, profile)


def test_knobs_from_params_reach_the_render(tmp_path: Path) -> None:
    cfg = rendered(
        "rlvr",
        "default",
        tmp_path,
        ("rlvr.grpo.num_generations_per_prompt=16", "rlvr.policy.optimizer.kwargs.lr=3e-7", "seed=7"),
    )
    assert cfg["grpo"]["num_generations_per_prompt"] == 16
    assert cfg["policy"]["optimizer"]["kwargs"]["lr"] == pytest.approx(3e-7)
    assert cfg["grpo"]["seed"] == 7
    # Interpolations resolve after knobs, as in NeMo-RL.
    assert cfg["grpo"]["adv_estimator"]["normalize_rewards"] is cfg["grpo"]["normalize_rewards"]


def test_warm_start_hf_vs_megatron(tmp_path: Path) -> None:
    hf = rendered("dpo", "default", tmp_path)
    assert hf["policy"]["model_name"] == "/repo/models/sft"
    assert hf["policy"]["tokenizer"]["name"] == "/repo/models/sft"
    assert "pretrained_checkpoint" not in hf["checkpointing"]

    for stage in ("dpo", "rlvr", "rlhf"):
        mg = rendered(stage, "default_megatron", tmp_path)
        assert mg["policy"]["megatron_cfg"]["enabled"] is True
        assert mg["checkpointing"]["pretrained_checkpoint"] == {
            "path": "/repo/models/sft/policy/weights",
            "format": "megatron_bridge",
        }
        # The HF architecture is the starting model's (models/base); the tokenizer the sft artifact's.
        assert mg["policy"]["model_name"] == "/repo/models/base"
        assert mg["policy"]["tokenizer"]["name"] == "/repo/models/sft/policy/tokenizer"
        assert (
            mg["policy"]["make_sequence_length_divisible_by"]
            == mg["policy"]["megatron_cfg"]["tensor_model_parallel_size"]
        )
    # The first stage starts from the starting model base materialised (model.name, content-hashed
    # by DVC), never from a Hub id; rm stays DTensor (NeMo-RL RMs are DTensor-only).
    sft = rendered("sft", "default", tmp_path)["policy"]
    assert sft["model_name"] == sft["tokenizer"]["name"] == "/repo/models/base"
    rm = rendered("rm", "default_megatron", tmp_path)
    assert (
        rm["policy"]["dtensor_cfg"]["enabled"] is True and rm["policy"]["reward_model_cfg"]["enabled"] is True
    )


def test_rlhf_uses_the_rm_stage_export(tmp_path: Path) -> None:
    cfg = rendered("rlhf", "default", tmp_path)
    assert cfg["data"]["default"]["env_name"] == "reward_model"
    rm_env = cfg["env"]["reward_model"]
    assert rm_env["model_name"] == "/repo/models/rm"
    assert rm_env["tokenizer"]["name"] == "/repo/models/rm"
    assert rm_env["reward_model_cfg"] == {"enabled": True, "reward_model_type": "bradley_terry"}
    # RM env asserts (nemo-rl.md §2.3).
    assert rm_env["dynamic_batching"]["enabled"] is False and rm_env["sequence_packing"]["enabled"] is False
    assert rm_env["max_grad_norm"] is None
    assert set(cfg["env"]) == {"reward_model"}
    # The policy gets gpus_per_node - RM GPUs; its global batch must split evenly over them.
    dp = cfg["cluster"]["gpus_per_node"] - rm_env["resources"]["gpus_per_node"]
    assert cfg["policy"]["train_global_batch_size"] % dp == 0
    rollouts = cfg["grpo"]["num_prompts_per_step"] * cfg["grpo"]["num_generations_per_prompt"]
    assert rollouts % cfg["policy"]["train_global_batch_size"] == 0


@pytest.mark.parametrize("stage", ["rlvr", "rlhf"])
def test_nemo_gym_profiles(stage: str, tmp_path: Path) -> None:
    cfg = rendered(stage, "nemo_gym", tmp_path)
    assert cfg["env"]["should_use_nemo_gym"] is True
    gym = cfg["env"]["nemo_gym"]
    assert gym["config_paths"][0].endswith("_for_training.yaml")
    assert cfg["policy"]["generation"]["vllm_cfg"]["async_engine"] is True
    assert cfg["policy"]["generation"]["vllm_cfg"]["expose_http_server"] is True
    assert cfg["grpo"]["max_val_samples"] is None and cfg["grpo"]["val_batch_size"] is None
    assert cfg["grpo"]["num_generations_per_prompt"] == 8
    assert cfg["grpo"]["normalize_rewards"] is True and cfg["grpo"]["use_leave_one_out_baseline"] is True
    assert cfg["data"]["default"] == {
        "dataset_name": "NemoGymDataset",
        "processor": "nemo_gym_data_processor",
        "env_name": "nemo_gym",
        "prompt_file": None,
        "system_prompt_file": None,
    }
    # The engine writes Gym-format copies of the prepared rows into the run's scratch dir.
    assert cfg["data"]["train"]["data_path"] == "/scratch/run/nemo_gym_data/train.jsonl"
    assert set(cfg["env"]) == {"should_use_nemo_gym", "should_log_nemo_gym_responses", "nemo_gym"}
    if stage == "rlhf":
        judge = gym["genrm_compare_resources_server"]["resources_servers"]["genrm_compare"]
        assert judge["num_rollouts_per_prompt"] == cfg["grpo"]["num_generations_per_prompt"]
        assert gym["num_gpu_nodes"] == 1
        model = gym["genrm_model"]["responses_api_models"]["genrm_model"]["model"]
        assert model == "nvidia/Qwen3-Nemotron-235B-A22B-GenRM-2603"


def test_genrm_judge_is_a_params_knob(tmp_path: Path) -> None:
    knob = "rlhf.env.nemo_gym.genrm_model.responses_api_models.genrm_model.model=/models/judge"
    cfg = rendered("rlhf", "nemo_gym", tmp_path, (knob,))
    assert (
        cfg["env"]["nemo_gym"]["genrm_model"]["responses_api_models"]["genrm_model"]["model"]
        == "/models/judge"
    )


def test_every_profile_resolves_for_every_stage(tmp_path: Path) -> None:
    """`dvc exp run -S profile=X` must not break any stage of the DAG, prep and base included."""
    for profile in ("default", "default_megatron", "nemo_gym"):
        params = composed_params(profile, tmp_path)
        assert params["profile"] == profile
        for stage in C.stage_names(REPO):
            if not (REPO / "stages" / stage / "config" / "tiny.yaml").is_file():
                continue  # stages still being built have no profiles yet
            C.resolve_stage_config(REPO, stage, params, profile)
