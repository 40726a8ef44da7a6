"""Config layering, params knobs, contracts and the plan command."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from alignpipe import config as C
from alignpipe.errors import ConfigError
from tests.conftest import REPO, run_cli, set_params


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_inheritance_merges_depth_first_and_override_replaces(tmp_path):
    write(tmp_path / "grand.yaml", "a: {x: 1, y: 1}\nb: {keep: 1, drop: 1}\nname: grand\n")
    write(tmp_path / "sub/parent.yaml", "defaults: ../grand.yaml\na: {y: 2}\nname: parent\n")
    child = write(
        tmp_path / "sub/child.yaml",
        "defaults: [parent.yaml]\na: {z: 3}\nb: {_override_: true, only: 9}\nref: ${a.y}\n",
    )
    cfg = C.load_with_defaults(child)
    resolved = yaml.safe_load(C.to_yaml(cfg))
    assert resolved["a"] == {"x": 1, "y": 2, "z": 3}  # child wins, parents merged in order
    assert resolved["b"] == {"only": 9}  # _override_ replaced the parent's section
    assert resolved["name"] == "parent"
    assert resolved["ref"] == 2  # interpolation resolves after merging


def test_a_profile_is_read_again_after_an_edit_and_each_caller_gets_its_own_copy(tmp_path):
    write(tmp_path / "parent.yaml", "a: {x: 1}\n")
    child = write(tmp_path / "child.yaml", "defaults: parent.yaml\nb: 2\n")
    first = C.load_with_defaults(child)
    first.a.x = 99  # a caller writing knobs onto its config
    assert C.load_with_defaults(child).a.x == 1
    write(tmp_path / "parent.yaml", "a: {x: 1, y: 5}\n")  # an edit to a parent, not the file asked for
    assert C.load_with_defaults(child).a == {"x": 1, "y": 5}
    write(tmp_path / "child.yaml", "defaults: parent.yaml\nb: {bad\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        C.load_with_defaults(child)


def test_defaults_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\nx: 1\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\ny: 1\n")
    with pytest.raises(ConfigError, match="cycle"):
        C.load_with_defaults(tmp_path / "a.yaml")


def test_params_knobs_and_seed_land_in_resolved_config():
    params = C.load_params(REPO)
    params = {
        **params,
        "seed": 7,
        "sft": {"sft": {"max_num_steps": 3}, "policy": {"optimizer": {"kwargs": {"lr": 0.5}}}},
    }
    cfg = C.resolve_stage_config(REPO, "sft", params)
    assert cfg["sft"]["max_num_steps"] == 3
    assert cfg["policy"]["optimizer"]["kwargs"]["lr"] == 0.5
    assert cfg["sft"]["seed"] == 7


def test_unknown_knob_names_the_key_and_the_profile():
    params = {**C.load_params(REPO), "sft": {"sft": {"max_num_stepz": 3}}}
    with pytest.raises(ConfigError) as err:
        C.resolve_stage_config(REPO, "sft", params)
    assert "sft.sft.max_num_stepz" in str(err.value)
    assert "stages/sft/config/tiny.yaml" in str(err.value)


def test_unknown_profile_lists_available_ones():
    with pytest.raises(ConfigError, match="available: .*tiny"):
        C.resolve_stage_config(REPO, "sft", C.load_params(REPO), profile="nope")


def test_params_yaml_is_composed_from_conf():
    """params.yaml must equal what `dvc exp run` would compose from conf/ (Hydra)."""
    proc = subprocess.run(["alignpipe", "params", "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_small_evidence_preset_is_the_measured_run():
    """`-S evidence=small` composes exactly the overrides of benchmarks/small_profile.md's
    evidence run: 256 held-out prompts for prep and every stage that samples them, and rlvr's
    longer run; every stage reads them."""
    from alignpipe.context import build_context

    held = [f"{s}.alignpipe.heldout.limit=256" for s in ("sft", "dpo", "rm", "rlvr", "rlhf", "evaluate")]
    measured = ["prep.builtin.counts.rlvr.test=256", *held, "rlvr.grpo.max_num_steps=30",
                "rlvr.grpo.val_period=10", "rlvr.grpo.val_at_start=false", "rlvr.checkpointing.save_period=10",
                "rlvr.policy.optimizer.kwargs.lr=2e-5"]  # fmt: skip
    measured = [f"++{override}" for override in measured]  # `++`: set the key, in the profile's knobs or not
    preset = C.compose_params_text(REPO.resolve(), ["profile=small", "evidence=small"])
    assert yaml.safe_load(preset) == yaml.safe_load(
        C.compose_params_text(REPO.resolve(), ["profile=small", *measured])
    )
    for stage in ("prep", "sft", "dpo", "rm", "rlvr", "rlhf", "evaluate"):
        ctx = build_context(REPO, stage, "small", params=yaml.safe_load(preset))
        assert ctx.settings.heldout.limit == 256 or stage == "prep"


def test_the_tools_preset_reaches_every_stage_that_needs_it():
    """`-S tools=on`: prep offers the calculator and draws calc, base builds the tool template,
    rlvr rolls out with the calculator over 4 turns (the NeMo-RL key agreeing), and every stage
    that samples held-out answers gives them room for a call, its result and the answer."""
    from alignpipe.context import build_context
    from alignpipe.engines.local.grpo import refuse_unsupported_grpo

    params = yaml.safe_load(C.compose_params_text(REPO.resolve(), ["tools=on"]))
    prep = build_context(REPO, "prep", params=params).config["builtin"]
    assert prep["tools"] == ["calculator"] and prep["tasks"]["calc"] == {
        "min_digits": 3,
        "max_digits": 3,
        "weight": 1,
    }
    assert build_context(REPO, "base", params=params).config["tokenizer"]["tools"] is True
    rlvr = build_context(REPO, "rlvr", params=params)
    assert rlvr.settings.tools.tools == ["calculator"] and rlvr.settings.tools.max_rollout_turns == 4
    refuse_unsupported_grpo(rlvr)  # the turn limits agree
    for stage in ("sft", "dpo", "rm", "rlvr", "rlhf", "evaluate"):
        assert build_context(REPO, stage, params=params).settings.heldout.max_new_tokens == 64, stage
    assert not build_context(REPO, "rlhf", params=params).settings.tools.enabled


def _dvc_stages() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _expanded_entries(stage: str) -> list[tuple[dict, dict]]:
    """(dvc.yaml entry, substitutions) per expanded stage; foreach items become {source}."""
    entry = _dvc_stages()[stage]
    if "foreach" not in entry:
        return [(entry, {})]
    out = []
    items = entry["foreach"]
    for key, item in items.items() if isinstance(items, dict) else [(i, i) for i in items]:
        text = yaml.safe_dump(entry["do"]).replace("${item}", str(item)).replace("${key}", str(key))
        out.append((yaml.safe_load(text), {"source": key, "source_dir": item}))
    return out


@pytest.mark.parametrize("stage", [s for s in C.stage_names(REPO) if s in _dvc_stages()])
def test_dvc_yaml_matches_stage_contract(stage):
    """What stage.toml says a stage produces/consumes is what dvc.yaml tracks."""
    contract = C.load_contract(REPO, stage)
    foreach = _dvc_stages()[stage].get("foreach")
    if contract.sources or isinstance(foreach, dict):  # stage.toml [sources] and the foreach dict agree
        assert contract.sources == foreach, (
            f"stages/{stage}/stage.toml [sources] != dvc.yaml {stage}: foreach"
        )
    for entry, subst in _expanded_entries(stage):
        outs = [o if isinstance(o, str) else next(iter(o)) for o in entry.get("outs", [])]
        deps = entry.get("deps", [])
        for port in contract.produces:
            assert port.path.format(**subst) in outs, (
                f"dvc.yaml stage {stage} does not declare out {port.path}"
            )
        for port in contract.consumes:
            if port.required:
                assert port.path.format(**subst) in deps, (
                    f"dvc.yaml stage {stage} does not depend on {port.path}"
                )
        assert entry["cmd"].startswith(f"alignpipe run {stage}")
        assert stage in entry.get("params", [])


def test_stage_tomls_parse():
    for stage in C.stage_names(REPO):
        with open(REPO / "stages" / stage / "stage.toml", "rb") as f:
            assert tomllib.load(f)["stage"]["name"] == stage


def test_plan_prints_resolved_config_and_launch_command(repo_copy):
    proc = run_cli(repo_copy, "plan", "sft", "--write", str(repo_copy / "plan"))
    assert "max_num_steps:" in proc.stdout
    assert "alignpipe run sft --inner" in proc.stdout or "alignpipe run sft" in proc.stdout
    written = sorted(p.name for p in (repo_copy / "plan").iterdir())
    assert any(name.endswith(".sh") for name in written)
    # Planning runs nothing: the output folders hold only the .gitignore files DVC keeps there.
    for folder in ("models", "results", "exports"):
        assert {p.name for p in (repo_copy / folder).rglob("*") if p.is_file()} == {".gitignore"}, folder


def test_local_engine_refuses_gpu_only_settings(repo_copy):
    set_params(repo_copy, {"sft": {"policy": {"megatron_cfg": {"enabled": True}}}})
    proc = run_cli(repo_copy, "run", "sft", check=False)
    assert proc.returncode == 2
    assert "policy.megatron_cfg.enabled" in proc.stderr
    assert "nemo_rl" in proc.stderr


def test_plan_shows_the_batch_script_a_slurm_launch_would_submit(repo_copy):
    set_params(repo_copy, {"runtime": {"launcher": "slurm"}, "slurm": {"partition": "gpu-long"}})
    proc = run_cli(repo_copy, "plan", "sft")
    assert "==> sft.sbatch <==" in proc.stdout
    assert "--partition=gpu-long" in proc.stdout  # sbatch options are on the launch line
    assert "alignpipe run sft --inner" in proc.stdout
