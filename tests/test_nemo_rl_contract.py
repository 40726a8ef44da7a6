"""The GPU path against NeMo-RL v0.7.0's own code: every rendered config through the entry
script's MasterConfig validation, every launch command through the script's own parser.

NeMo-RL runs from the vendored source (``nemo_rl_src``) in a small venv with its own
uv.lock pins of pydantic/omegaconf/hydra (``schema_python``); schema_check.py stands in for
torch, ray and vLLM, which the config classes' modules import but the schema does not use.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from alignpipe.config import compose_params_text
from alignpipe.context import build_context
from alignpipe.engines.nemo_rl import convert as CV
from alignpipe.engines.nemo_rl import preflight
from tests.conftest import REPO, run_cli, set_params

STAGES = ("sft", "rm", "dpo", "rlvr", "rlhf")
PROFILES = ("default", "default_megatron", "nemo_gym")
SCHEMA = {"sft": "sft", "rm": "rm", "dpo": "dpo", "rlvr": "grpo", "rlhf": "grpo"}


@pytest.fixture(autouse=True)
def _upstream(nemo_rl_src: Path, schema_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMO_RL_SRC", str(nemo_rl_src))
    monkeypatch.setenv("NEMO_RL_PYTHON", str(schema_python))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("stage", STAGES)
def test_rendered_config_and_launch_command_pass_nemo_rl(stage: str, profile: str) -> None:
    report = preflight.check(build_context(REPO, stage, profile))
    assert report.ok, report.text()
    assert report.schema == f"nemo_rl.algorithms.{SCHEMA[stage]}.MasterConfig"


def _checker(schema_python: Path, *args: str) -> dict:
    """schema_check.py run as the pre-flight runs it."""
    return preflight._run_checker(str(schema_python), list(args))


@pytest.mark.parametrize(
    "fmt, script",
    [(CV.DCP, CV.DCP_TO_HF), (CV.MEGATRON, CV.MEGATRON_TO_HF), ("lora-adapter", CV.LORA_TO_HF),
     ("lora-merged", CV.LORA_TO_HF)],
    ids=["dcp", "megatron", "megatron-lora-adapter", "megatron-lora-merged"],
)  # fmt: skip
def test_converter_commands_pass_the_converters_own_parsers(
    fmt, script, nemo_rl_src, schema_python, tmp_path
):
    (tmp_path / "step_3" / "policy" / "weights" / "iter_0000000").mkdir(parents=True)  # as NeMo-RL writes it
    if fmt.startswith("lora"):
        argv = CV.lora_converter_argv(tmp_path / "step_3", tmp_path / "hf", base_ckpt=tmp_path / "base" / "iter_0000000",
                                      hf_model_name="org/model", adapter_only=fmt == "lora-adapter")  # fmt: skip
        assert ("--adapter-only" in argv) == (fmt == "lora-adapter")
    else:
        argv = CV.converter_argv(tmp_path / "step_3", fmt, tmp_path / "hf", hf_model_name="org/model")
    assert argv[1] == script
    result = _checker(schema_python, "argv", "--src", str(nemo_rl_src), "--", *argv)
    assert result["ok"], result


def upstream_validate_model_paths(nemo_rl_src: Path):
    """NeMo-RL v0.7.0's own ``validate_model_paths`` and ``get_megatron_checkpoint_dir``, lifted
    from its source by name: their modules import Megatron-Bridge, which cannot be installed here,
    but these functions use only os, json and hashlib."""
    import ast
    import hashlib
    from typing import Any

    namespace: dict = {"os": os, "json": json, "hashlib": hashlib, "Any": Any, "PolicyConfig": dict}
    wanted = {
        "nemo_rl/models/megatron/setup.py": ("_canonicalize_hf_config_overrides", "_get_hf_config_overrides_hash",
                                             "_resolve_iter_dir_from_root", "validate_model_paths"),
        "nemo_rl/models/policy/utils.py": ("get_megatron_checkpoint_dir",),
    }  # fmt: skip
    for path, names in wanted.items():
        tree = ast.parse((nemo_rl_src / path).read_text())
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        assert sorted(n.name for n in found) == sorted(names), f"{path} no longer defines {names}"
        exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)
    return namespace["validate_model_paths"]


def test_megatron_lora_base_is_the_checkpoint_nemo_rl_loads(nemo_rl_src, tmp_path, monkeypatch):
    """convert_lora_to_hf.py needs the base a Megatron LoRA run trained on: the path NeMo-RL's own
    validate_model_paths gives, for an HF start (its conversion cache, under every environment
    NeMo-RL reads) and for sft's Megatron checkpoint (pretrained_checkpoint, megatron_bridge)."""
    validate = upstream_validate_model_paths(nemo_rl_src)
    model = tmp_path / "repo" / "models" / "base"
    model.mkdir(parents=True)
    sft = tmp_path / "repo" / "models" / "sft" / "policy" / "weights"
    (sft / "iter_0000000").mkdir(parents=True)
    (sft / "iter_0000000" / "run_config.yaml").write_text("model: {}\n")
    (sft / "latest_checkpointed_iteration.txt").write_text("0\n")
    policies = [
        {"model_name": str(model)},
        {"model_name": "meta-llama/Llama-3.2-1B-Instruct"},
        {"model_name": str(model), "hf_config_overrides": {"rope_theta": 5e5, "max_position_embeddings": 4096}},
        {"model_name": str(model), "pretrained_checkpoint": {"path": str(sft), "format": "megatron_bridge"}},
        {"model_name": str(model), "pretrained_checkpoint": {"path": str(sft / "iter_0000000"), "format": "megatron_bridge"}},
    ]  # fmt: skip
    environments = [
        {"NRL_MEGATRON_CHECKPOINT_DIR": str(tmp_path / "nrl")},
        {"HF_HOME": str(tmp_path / "hf")},
        {},
    ]
    for env in environments:
        for name in ("NRL_MEGATRON_CHECKPOINT_DIR", "HF_HOME"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for policy in policies:
            _, pretrained_path, _ = validate(policy)
            if "pretrained_checkpoint" not in policy:
                pretrained_path = os.path.join(
                    pretrained_path, "iter_0000000"
                )  # the conversion's only iteration
            assert CV.megatron_base_checkpoint({"policy": policy}, os.environ) == Path(pretrained_path), (
                env,
                policy,
            )
    # the rendered config names it under checkpointing (NeMo-RL copies it into the policy)
    moved = {"policy": {"model_name": str(model)},
             "checkpointing": {"pretrained_checkpoint": {"path": str(sft), "format": "megatron_bridge"}}}  # fmt: skip
    assert CV.megatron_base_checkpoint(moved) == sft / "iter_0000000"


def test_megatron_converter_runs_in_the_images_megatron_venv(nemo_rl_src: Path, tmp_path: Path) -> None:
    """The image's project venv has no mcore extra (its build ends with a plain `uv sync
    --all-groups`); NeMo-RL prefetches a venv for its Megatron worker and, in the container,
    puts `python-<WorkerClass>` on PATH for it. The converter command uses that wrapper."""
    dockerfile = (nemo_rl_src / "docker" / "Dockerfile").read_text()
    syncs = re.findall(r"^\s*(?:UV_LINK_MODE=\S+ )?uv sync [^\n]*", dockerfile, flags=re.M)
    assert "--extra mcore" not in syncs[-1] and "--all-groups" in syncs[-1], syncs[-1]
    registry = (nemo_rl_src / "nemo_rl" / "distributed" / "ray_actor_environment_registry.py").read_text()
    assert re.search(r'"[\w.]+\.MegatronPolicyWorker": MCORE_EXECUTABLE', registry)
    assert 'f"python-{class_name}"' in (nemo_rl_src / "nemo_rl" / "utils" / "prefetch_venvs.py").read_text()
    assert CV.MCORE_PYTHON == "python-MegatronPolicyWorker"
    (tmp_path / "policy" / "weights" / "iter_0000000").mkdir(parents=True)
    assert CV.converter_argv(tmp_path, CV.MEGATRON, tmp_path / "hf")[0] == CV.MCORE_PYTHON


@pytest.mark.parametrize(
    "config, entry",
    [("sft.yaml", "run_sft.py"), ("dpo.yaml", "run_dpo.py"), ("rm.yaml", "run_rm.py"),
     ("grpo_math_1B.yaml", "run_grpo.py"), ("grpo_math_8B_megatron.yaml", "run_grpo.py")],
)  # fmt: skip
def test_upstreams_own_example_configs_pass_with_no_algorithm_key_flagged(
    config, entry, nemo_rl_src, schema_python
):
    """The unknown-key rule is no stricter than NeMo-RL: its own examples raise no error."""
    result = _checker(schema_python, "config", "--src", str(nemo_rl_src), "--entry",
                      f"examples/{entry}", "--config", str(nemo_rl_src / "examples" / "configs" / config))  # fmt: skip
    assert result["ok"], result


@pytest.fixture
def default_profile_repo(repo_copy: Path) -> Path:
    """A copy whose params.yaml selects the default (GPU) profile, as `dvc exp run -S profile=default`."""
    text = subprocess.run(["alignpipe", "params"], cwd=repo_copy, capture_output=True, text=True,
                          env={**os.environ, "ALIGNPIPE_ROOT": str(repo_copy)})  # fmt: skip
    assert text.returncode == 0, text.stderr
    set_params(repo_copy, {"profile": "default"})
    return repo_copy


def test_plan_check_says_the_config_is_valid(default_profile_repo: Path) -> None:
    proc = run_cli(default_profile_repo, "plan", "rlvr", "--profile", "default", "--check")
    assert "rlvr: valid for nemo_rl.algorithms.grpo.MasterConfig" in proc.stdout


def test_plan_check_names_a_wrong_type(default_profile_repo: Path) -> None:
    set_params(default_profile_repo, {"rlvr": {"grpo": {"max_num_steps": "fifty"}}})
    proc = run_cli(default_profile_repo, "plan", "rlvr", "--profile", "default", "--check", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "grpo.max_num_steps: Input should be a valid integer" in proc.stderr
    assert "fix params.yaml rlvr.grpo.max_num_steps" in proc.stderr


def test_plan_check_names_a_misspelled_optional_key_and_suggests_the_right_one(
    default_profile_repo: Path,
) -> None:
    # In params.yaml, alignpipe's own knob check already refuses it, with the suggestion.
    set_params(default_profile_repo, {"rlvr": {"grpo": {"overlong_filterng": True}}})
    proc = run_cli(default_profile_repo, "plan", "rlvr", "--profile", "default", "--check", check=False)
    assert proc.returncode == 2 and "Did you mean 'rlvr.grpo.overlong_filtering'?" in proc.stderr
    # In the profile itself, NeMo-RL would silently ignore it: the pre-flight names it.
    set_params(default_profile_repo, {"rlvr": {"grpo": {"overlong_filterng": None}}})
    params = yaml.safe_load((default_profile_repo / "params.yaml").read_text())
    del params["rlvr"]["grpo"]["overlong_filterng"]
    (default_profile_repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    profile = default_profile_repo / "stages" / "rlvr" / "config" / "default.yaml"
    profile.write_text(profile.read_text().replace("grpo:\n", "grpo:\n  overlong_filterng: true\n", 1))
    proc = run_cli(default_profile_repo, "plan", "rlvr", "--profile", "default", "--check", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "grpo.overlong_filterng is not a key of" in proc.stderr
    assert "did you mean 'overlong_filtering'?" in proc.stderr


def test_plan_check_refuses_a_slurm_allocation_that_disagrees_with_the_stages_cluster(
    repo_copy: Path,
) -> None:
    """slurm.nodes is one sbatch request for every stage; NeMo-RL places workers by the stage's
    cluster.num_nodes. A mismatch is named with both keys and the fix; a match passes."""
    overrides = ["profile=default", "runtime.launcher=slurm", "slurm.nodes=2"]  # as `dvc exp run -S` composes
    (repo_copy / "params.yaml").write_text(compose_params_text(repo_copy, overrides))
    proc = run_cli(repo_copy, "plan", "rlvr", "--check", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "slurm.nodes is 2 but stage 'rlvr' needs 1 node(s) (cluster.num_nodes 1): set params.yaml "
        "slurm.nodes to 1, or params.yaml rlvr.cluster.num_nodes to 2"
    ) in proc.stderr
    assert "slurm.gpus_per_node" not in proc.stderr  # 8 and 8 agree

    overrides += ["rlvr.cluster.num_nodes=2", "slurm.gpus_per_node=4"]
    (repo_copy / "params.yaml").write_text(compose_params_text(repo_copy, overrides))
    proc = run_cli(repo_copy, "plan", "rlvr", "--check", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "slurm.nodes" not in proc.stderr
    assert "slurm.gpus_per_node is 4 but stage 'rlvr' has cluster.gpus_per_node 8" in proc.stderr

    (repo_copy / "params.yaml").write_text(compose_params_text(repo_copy, overrides[:-1]))
    proc = run_cli(repo_copy, "plan", "rlvr", "--check")
    assert "rlvr: valid for nemo_rl.algorithms.grpo.MasterConfig" in proc.stdout


# LoRA renders (issue 25): DTensor's lora_cfg (needs the V2 worker) and Megatron's peft.
LORA_RENDERS = [
    ("sft", "default", {}),
    ("rlvr", "default", {}),
    ("rlhf", "default", {}),
    ("rlvr", "nemo_gym", {}),
    ("dpo", "default", {}),  # its profile runs V1 (as upstream's dpo.yaml) but V2 under LoRA
    ("sft", "default_megatron", "peft"),
    ("dpo", "default_megatron", "peft"),
    ("rlvr", "default_megatron", "peft"),
    ("rlhf", "default_megatron", "peft"),
]


def lora_params(stage: str, profile: str, how) -> dict:
    params = yaml.safe_load(compose_params_text(REPO.resolve(), [f"profile={profile}"]))
    policy = params.setdefault(stage, {}).setdefault("policy", {})
    if how == "peft":
        policy.setdefault("megatron_cfg", {})["peft"] = {"enabled": True, "dim": 16}
    else:
        policy.setdefault("dtensor_cfg", {}).update({"lora_cfg": {"enabled": True, "dim": 16}, **how})
    return params


@pytest.mark.parametrize(("stage", "profile", "how"), LORA_RENDERS, ids=lambda v: str(v))
def test_lora_renders_pass_nemo_rl(stage, profile, how):
    """The LoRA config each backend reads reaches NeMo-RL's MasterConfig and entry parser intact."""
    from alignpipe.engines.nemo_rl.render import render_for

    ctx = build_context(REPO, stage, profile, params=lora_params(stage, profile, how))
    cfg = render_for(ctx)
    key = "megatron_cfg.peft" if how == "peft" else "dtensor_cfg.lora_cfg"
    section = cfg["policy"]
    for part in key.split("."):
        section = section[part]
    assert section["enabled"] is True and section["dim"] == 16
    report = preflight.check(ctx, cfg)
    assert report.ok, report.text()


@pytest.mark.parametrize(
    ("stage", "profile", "how", "message"),
    [
        ("dpo", "default", {"_v2": False}, "needs policy.dtensor_cfg._v2: true"),
        (
            "sft",
            "default_megatron",
            {"megatron_peft": {"enabled": False}},
            "NeMo-RL reads LoRA from policy.megatron_cfg.peft there",
        ),
        # Megatron-Bridge adapts every linear layer, output_layer included, when target_modules is empty
        ("dpo", "default_megatron", {"megatron_peft": {"target_modules": []}}, "adapts output_layer"),
        ("rlvr", "default_megatron", {"megatron_peft": {"target_modules": ["*"]}}, "adapts output_layer"),
        (
            "rlhf",
            "default_megatron",
            {"megatron_peft": {"target_modules": ["*output_layer"]}},
            "adapts output_layer",
        ),
        # Hugging Face names match nothing in Megatron's model
        (
            "sft",
            "default_megatron",
            {"megatron_peft": {"target_modules": ["q_proj"]}},
            "names that layer linear_qkv",
        ),
        (
            "dpo",
            "default_megatron",
            {"megatron_peft": {"target_modules": ["*.down_proj"]}},
            "names that layer linear_fc2",
        ),
        ("rm", "default", {"_v2": True}, "freezes every base weight under LoRA"),
        ("sft", "default", {"tensor_parallel_size": 2}, "use_triton=true with tensor_parallel_size=2"),
        # an lm_head adapter: TRL cannot train it, and peft merges it into tied embeddings
        ("sft", "default", {"lora_cfg": {"enabled": True, "match_all_linear": True}}, "adapts the lm_head"),
        ("rlvr", "default", {"lora_cfg": {"enabled": True, "target_modules": ["*"]}}, "adapts the lm_head"),
        (
            "rlhf",
            "default",
            {"lora_cfg": {"enabled": True, "target_modules": [], "exclude_modules": ["*.mlp.*"]}},
            "adapts the lm_head",
        ),
    ],
)
def test_plan_check_refuses_lora_nemo_rl_would_ignore_or_reject(stage, profile, how, message):
    how = dict(how)
    megatron_peft = how.pop("megatron_peft", None)
    params = lora_params(stage, profile, how)
    if megatron_peft is not None:
        params[stage]["policy"].setdefault("megatron_cfg", {}).setdefault("peft", {}).update(megatron_peft)
    if stage == "rm":
        params["rm"]["policy"]["dtensor_cfg"].pop("_v2")  # rm's profile has no _v2 key: V1 as upstream
    report = preflight.check(build_context(REPO, stage, profile, params=params))
    assert not report.ok and any(message in e for e in report.errors), report.text()


@pytest.mark.parametrize("profile", PROFILES)
def test_lora_on_is_one_knob_on_every_gpu_profile(profile):
    """`dvc exp run -S profile=P -S lora=on` needs nothing else: every trainer stage trains LoRA
    on the backend it runs (DTensor V2's lora_cfg, dpo's V1 profile included; Megatron-Bridge's
    peft, which follows lora_cfg's switch and shape, on every projection, not the output layer),
    NeMo-RL accepts each, and rm stays full-weight."""
    from alignpipe.engines.nemo_rl.engine import plan
    from alignpipe.engines.nemo_rl.render import render_for

    params = yaml.safe_load(compose_params_text(REPO.resolve(), [f"profile={profile}", "lora=on"]))
    params["dpo"]["policy"].setdefault("dtensor_cfg", {}).setdefault("lora_cfg", {})["dim"] = (
        16  # the shape knob
    )
    for stage in STAGES:
        ctx = build_context(REPO, stage, profile, params=params)
        cfg = render_for(ctx)
        policy = cfg["policy"]
        if stage == "rm":
            assert not policy["dtensor_cfg"].get("lora_cfg", {}).get("enabled")
        elif policy["megatron_cfg"]["enabled"]:
            peft = policy["megatron_cfg"]["peft"]
            assert peft["enabled"] is True
            assert peft["target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
            assert (peft["dim"], peft["alpha"]) == (16 if stage == "dpo" else 8, 32)
            assert CV.LORA_TO_HF in plan(ctx)[f"{stage}.nemo_rl.yaml"]  # how the adapter is exported
        else:
            assert (
                policy["dtensor_cfg"]["_v2"] is True and policy["dtensor_cfg"]["lora_cfg"]["enabled"] is True
            )
            assert policy["dtensor_cfg"]["lora_cfg"]["dim"] == (16 if stage == "dpo" else 8)
        report = preflight.check(ctx, cfg)
        assert report.ok, report.text()
