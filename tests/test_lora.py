"""LoRA (issue 25, first part): NeMo-RL's lora_cfg means on the local engine what it means in
NeMo Automodel, an sft adapter is published as checkpoint_lora, and stages after it start from the
chain merged.

Automodel's own code runs here: nemo-automodel 0.7.0 from PyPI (pure Python; its LoRA layer and
module matcher need only torch), installed without dependencies into a cached folder.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignpipe.adapters import adapter_chain, merge_chain
from alignpipe.artifacts import dvc_hash, read_manifest
from alignpipe.config import compose_params_text
from alignpipe.context import build_context
from alignpipe.engines.local import lora
from alignpipe.errors import UnsupportedSetting
from tests.conftest import FAST_SFT, ONE_THREAD, REPO, merged, run_cli, set_params, writable_copy

AUTOMODEL = "nemo-automodel==0.7.0"


@pytest.fixture(scope="session")
def automodel() -> Path:
    """A folder holding Automodel 0.7.0's sources (PyPI wheel), on sys.path for this session."""
    target = Path.home() / ".cache" / "alignpipe" / "automodel-0.7.0"
    if not (target / "nemo_automodel" / "components" / "_peft" / "lora.py").is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), AUTOMODEL],
            check=True,
        )
    sys.path.insert(0, str(target))
    return target


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config).eval()


def settings(**over) -> lora.LoraSettings:
    base = dict(
        target_modules=("*_proj",), exclude_modules=(), match_all_linear=False, dim=4, alpha=16.0,
        dropout=0.0, dropout_position="post", lora_A_init="xavier",
    )  # fmt: skip
    return lora.LoraSettings(**{**base, **over})


def automodel_lora(model, s: lora.LoraSettings) -> tuple[set[str], object]:
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules

    model = copy.deepcopy(model)
    cfg = PeftConfig.from_dict(
        {
            "target_modules": list(s.target_modules), "exclude_modules": list(s.exclude_modules),
            "match_all_linear": s.match_all_linear, "dim": s.dim, "alpha": s.alpha, "dropout": s.dropout,
            "dropout_position": s.dropout_position, "lora_A_init": s.lora_A_init, "use_triton": False,
        }
    )  # fmt: skip
    apply_lora_to_linear_modules(model, cfg)
    adapted = {name for name, m in model.named_modules() if hasattr(m, "lora_A")}
    return adapted, model


@pytest.mark.parametrize(
    "over",
    [
        {},  # the profiles' default: every projection
        {"target_modules": ("*.self_attn.q_proj", "*.mlp.down_proj")},
        {"target_modules": (), "exclude_modules": ("lm_head",)},
        {"target_modules": ("*.layers.0.*",)},
        {"target_modules": ()},  # nothing named: Automodel's '*_proj'
    ],
)
def test_same_layers_and_same_function_as_automodel(automodel, over):
    """Our peft adapter goes on exactly the layers Automodel adapts, and with the same weights
    computes the same logits (alpha/dim scale, A then B)."""
    from peft import get_peft_model

    s = settings(**over)
    base = tiny_model()
    theirs, their_model = automodel_lora(base, s)
    ours = lora.target_modules(base, s)
    assert set(ours) == theirs and ours

    peft_model = get_peft_model(copy.deepcopy(base), lora.peft_config(base, s))
    lora.init_adapter(peft_model, s, seed=3)
    # Give B non-zero weights (a trained adapter), then copy ours into Automodel's layers.
    torch.manual_seed(1)
    modules = dict(their_model.named_modules())
    for name, module in peft_model.base_model.model.named_modules():
        if name in theirs:
            module.lora_B["default"].weight.data.normal_()
            modules[name].lora_A.weight.data.copy_(module.lora_A["default"].weight.data)
            modules[name].lora_B.weight.data.copy_(module.lora_B["default"].weight.data)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        expected = their_model(input_ids=ids).logits
        got = peft_model(input_ids=ids).logits
        plain = base(input_ids=ids).logits
    assert not torch.allclose(expected, plain, atol=1e-3)  # the adapter does something
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_initial_adapter_is_automodels(automodel):
    """lora_A's draw (xavier-normal, or kaiming-uniform for 'uniform') and lora_B = 0, as
    Automodel's LinearLoRA initialises them: same spread, and the policy starts as its base."""
    from peft import get_peft_model

    base = tiny_model()
    for init in ("xavier", "uniform"):
        s = settings(lora_A_init=init)
        _, theirs = automodel_lora(base, s)
        ours = get_peft_model(copy.deepcopy(base), lora.peft_config(base, s))
        lora.init_adapter(ours, s, seed=0)
        ours_a = torch.cat([p.flatten() for n, p in ours.named_parameters() if ".lora_A." in n])
        their_a = torch.cat(
            [p.flatten() for n, p in theirs.named_parameters() if n.endswith("lora_A.weight")]
        )
        assert ours_a.numel() == their_a.numel()
        assert abs(ours_a.std() - their_a.std()) < 0.15 * their_a.std(), (init, ours_a.std(), their_a.std())
        assert all((p == 0).all() for n, p in ours.named_parameters() if ".lora_B." in n)
        ids = torch.tensor([[3, 4, 5]])
        with torch.no_grad():
            assert torch.equal(ours(input_ids=ids).logits, base(input_ids=ids).logits)


def test_selection_that_matches_nothing_lists_the_layers(automodel):
    """A bare 'q_proj' matches no full name in Automodel 0.7.0 (it would adapt nothing and train
    nothing); here it is an error that lists the model's linear layers."""
    base = tiny_model()
    theirs, _ = automodel_lora(base, settings(target_modules=("q_proj",)))
    assert theirs == set()
    with pytest.raises(UnsupportedSetting) as err:
        lora.target_modules(base, settings(target_modules=("q_proj",)))
    assert "model.layers.*.self_attn.q_proj" in str(err.value) and "lm_head" in str(err.value)


def test_lm_head_adapter_is_refused():
    """match_all_linear adapts the lm_head in Automodel; TRL would never train that adapter."""
    with pytest.raises(UnsupportedSetting, match="lm_head"):
        lora.peft_config(tiny_model(), settings(target_modules=(), match_all_linear=True))


def lora_context(root: Path, stage: str, **lora_cfg):
    params = json.loads(json.dumps(__import__("yaml").safe_load(compose_params_text(root.resolve()))))
    params.setdefault(stage, {}).setdefault("policy", {})["dtensor_cfg"] = {
        "lora_cfg": {"enabled": True, **lora_cfg}
    }
    return build_context(root, stage, params=params)


@pytest.mark.parametrize(
    ("stage", "lora_cfg", "message"),
    [
        ("rm", {}, "score head"),
        ("sft", {"dropout": 0.1}, "dropout_position='post' with dropout > 0"),
        ("sft", {"exclude_modules": ["lm_head"]}, "target_modules and exclude_modules are exclusive"),
        ("sft", {"lora_A_init": "gaussian"}, "lora_A_init must be"),
        ("sft", {"dim": 0}, "dim must be a positive rank"),
    ],
)
def test_settings_the_local_engine_cannot_honour_are_refused(stage, lora_cfg, message):
    with pytest.raises(UnsupportedSetting, match=message):
        lora.lora_settings(lora_context(REPO, stage, **lora_cfg))


def test_lora_on_is_one_knob():
    """`dvc exp run -S lora=on` (DVC's Hydra composition) turns the adapter on for every stage
    that trains a policy, and leaves rm on full weights."""
    import yaml

    params = yaml.safe_load(compose_params_text(REPO.resolve(), ["lora=on"]))
    for stage in lora.LORA_STAGES:
        assert lora.lora_settings(build_context(REPO, stage, params=params)) is not None, stage
    assert lora.lora_settings(build_context(REPO, "rm", params=params)) is None
    assert lora.lora_settings(build_context(REPO, "sft")) is None  # committed params: off


def test_the_small_preset_is_the_measured_run():
    """`-S lora=small` composes exactly the overrides benchmarks/lora.md's small run used: LoRA on,
    and its learning rates, on top of the small profile."""
    import yaml

    measured = ["lora=on", "sft.policy.optimizer.kwargs.lr=5e-4", "dpo.policy.optimizer.kwargs.lr=5e-5",
                "rlvr.policy.optimizer.kwargs.lr=5e-5", "rlhf.policy.optimizer.kwargs.lr=5e-5"]  # fmt: skip
    preset = yaml.safe_load(compose_params_text(REPO.resolve(), ["profile=small", "lora=small"]))
    assert preset == yaml.safe_load(compose_params_text(REPO.resolve(), ["profile=small", *measured]))
    assert preset["sft"]["policy"]["optimizer"]["kwargs"]["lr"] == 5e-4


GRPO = {
    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4, "max_num_steps": 4},
    "policy": {"train_global_batch_size": 32, "train_micro_batch_size": 32},
}


@pytest.fixture(scope="module")
def lora_pipeline(trained_sft, tmp_path_factory) -> Path:
    """sft and dpo with -S lora=on (short runs), then convert@dpo, in one repo copy. The base is
    stored in bfloat16, as a real model's often is (SmolLM2's), while the stages train in float32."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("lora")
    root = writable_copy(trained_sft, tmp / "repo")
    base = root / "models" / "base"
    AutoModelForCausalLM.from_pretrained(base, dtype="bfloat16").save_pretrained(base)
    env = {"ALIGNPIPE_SCRATCH": str(tmp / "scratch")}
    (root / "params.yaml").write_text(compose_params_text(root.resolve(), ["lora=on"]))
    # The composition dropped trained_sft's one thread per stage: set it again.
    set_params(root, merged(FAST_SFT, ONE_THREAD, {"dpo": {"dpo": {"max_num_steps": 20}}}))
    for stage in ("sft", "dpo"):
        run_cli(root, "run", stage, env=env)
    run_cli(root, "run", "convert", "--source", "dpo", env=env)
    return root


@pytest.mark.slow
def test_sft_adapter_is_published_small_and_loads(lora_pipeline):
    """sft publishes the adapter alone, naming models/base by path and hash; it loads with
    PeftModel, trained; the merged chain equals base + adapter unmerged to 1e-5."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = lora_pipeline
    adapter = root / "models" / "sft"
    manifest = read_manifest(adapter)
    assert manifest["type"] == "checkpoint_lora" and manifest["format"] == "peft"
    assert manifest["adapter"]["applies_to"] == {
        "path": "models/base",
        "hash": dvc_hash(root / "models" / "base"),
    }
    assert not (adapter / "model.safetensors").exists()
    size = (adapter / "adapter_model.safetensors").stat().st_size
    assert size < (root / "models" / "base" / "model.safetensors").stat().st_size / 4
    assert (
        json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "models/base"
    )

    base = AutoModelForCausalLM.from_pretrained(
        root / "models" / "base", local_files_only=True, dtype="float32"
    )
    unmerged = PeftModel.from_pretrained(base, adapter).eval()
    assert any((p != 0).any() for n, p in unmerged.named_parameters() if "lora_B" in n)  # it trained
    chain = adapter_chain(adapter, root)
    assert chain == [(root / "models" / "base").resolve(), adapter.resolve()]
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 3]])
    with torch.no_grad():
        diff = merge_chain(chain, "float32").eval()(input_ids=ids).logits - unmerged(input_ids=ids).logits
    assert diff.abs().max() < 1e-5, diff.abs().max()


@pytest.mark.slow
def test_dpo_adapter_on_the_sft_adapter_learns_against_the_disabled_adapter(lora_pipeline):
    """dpo trains a second adapter on the merged sft; its reference is the same model with the
    adapter off, and TRL's implicit rewards move (they were all 0 while a hook of ours handed the
    reference pass the policy's output)."""
    root = lora_pipeline
    manifest = read_manifest(root / "models" / "dpo")
    assert manifest["type"] == "checkpoint_lora"
    assert manifest["adapter"]["applies_to"]["path"] == "models/sft"
    train = json.loads((root / "results" / "dpo" / "metrics.json").read_text())["train"]
    assert train["reward_margin"] > 0 and train["preference_accuracy"] > 0.6, train
    assert (
        len(list((root.parent / "scratch" / "merged").iterdir())) == 1
    )  # the sft chain, merged once for dpo and rlvr


@pytest.mark.slow
def test_rlvr_adapter_learns_against_the_disabled_adapter_and_exports_alone(trained_sft, tmp_path):
    """GRPO with a LoRA adapter on the (full-weight) sft policy: TRL's reference is the policy with
    the adapter off, and the adapter moves the policy away from it (held-out KL > 0). Its base is a
    full checkpoint, so convert@rlvr exports the adapter alone beside the merged weights: on
    models/sft it loads with PeftModel and gives the merged export's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = writable_copy(trained_sft, tmp_path / "repo")
    set_params(
        root, {"rlvr": {**GRPO, "policy": {**GRPO["policy"], "dtensor_cfg": {"lora_cfg": {"enabled": True}}}}}
    )
    env = {"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")}
    run_cli(root, "run", "rlvr", env=env)
    manifest = read_manifest(root / "models" / "rlvr")
    assert manifest["type"] == "checkpoint_lora" and manifest["adapter"]["applies_to"]["path"] == "models/sft"
    metrics = json.loads((root / "results" / "rlvr" / "metrics.json").read_text())
    assert metrics["heldout"]["kl_to_reference"] > 0, metrics

    run_cli(root, "run", "convert", "--source", "rlvr", env=env)
    export = root / "exports" / "rlvr"
    assert read_manifest(export)["adapter"] == {"path": "adapter", "applies_to": "models/sft"}
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (export / "adapter" / name).read_bytes() == (root / "models" / "rlvr" / name).read_bytes()
    assert "--enable-lora --lora-modules rlvr=exports/rlvr/adapter" in (export / "README.md").read_text()
    sft = AutoModelForCausalLM.from_pretrained(root / "models" / "sft", local_files_only=True)
    served = PeftModel.from_pretrained(sft, export / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 3]])
    with torch.no_grad():
        assert (served(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() < 1e-5


@pytest.mark.slow
def test_convert_merges_the_whole_chain(lora_pipeline):
    """convert@dpo merges base + sft adapter + dpo adapter into full weights, verified against the
    unmerged dpo adapter on the merged sft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = lora_pipeline
    export = root / "exports" / "dpo"
    exported = read_manifest(export)
    assert exported["merged"] == ["models/base", "models/sft", "models/dpo"]
    # its adapter applies to the sft chain, which exists only merged: nothing to serve it on
    assert exported["adapter"] is None and not (export / "adapter").exists()
    assert exported["verification"]["max_abs_logit_diff"] <= 1e-5
    chain = adapter_chain(root / "models" / "dpo", root)
    unmerged = PeftModel.from_pretrained(merge_chain(chain[:-1], "float32"), chain[-1]).eval()
    loaded = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    assert loaded.dtype == torch.float32  # merged in the dtype the adapters trained against
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 3]])
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - unmerged(input_ids=ids).logits).abs().max() < 1e-5


@pytest.mark.slow
def test_measuring_stages_read_an_adapter_as_its_merged_chain(lora_pipeline, tmp_path):
    """benchmark@sft reads models/sft itself (there is no convert@sft): with LoRA that is an
    adapter, which load_policy reads as its chain merged."""
    from alignpipe.measure.logprobs import load_policy

    root = lora_pipeline
    model, _ = load_policy(root / "models" / "sft")
    merged = merge_chain(adapter_chain(root / "models" / "sft", root), "float32")
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, merged(input_ids=ids).logits)
    run_cli(root, "run", "benchmark", "--source", "sft", env={"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")})
    scores = json.loads((root / "results" / "benchmark" / "sft" / "metrics.json").read_text())
    assert scores["path"] == "models/sft" and scores["tasks"]["heldout_exact"]["samples"] == 64


@pytest.mark.slow
def test_merged_chains_unused_for_a_week_are_pruned(lora_pipeline, tmp_path):
    """Each merged chain is a full float32 copy of the model: merging a new one deletes those
    unused for MERGED_KEEP_DAYS (and interrupted merges); a chain in use is kept and refreshed."""
    import os
    import time

    from alignpipe.adapters import MERGED_KEEP_DAYS, merged_dir

    cache = tmp_path / "merged"
    day = 86400
    entries = {"stale": MERGED_KEEP_DAYS + 1, "recent": MERGED_KEEP_DAYS - 1, ".tmp-interrupted": 30}
    for name, age in entries.items():
        (cache / name).mkdir(parents=True)
        (cache / name / "model.safetensors").write_bytes(b"\0" * 64)
        os.utime(cache / name, (time.time() - age * day,) * 2)
    out = merged_dir(lora_pipeline / "models" / "sft", lora_pipeline, cache, "float32")
    assert sorted(p.name for p in cache.iterdir()) == sorted(["recent", out.name])
    os.utime(out, (time.time() - 30 * day,) * 2)
    assert merged_dir(lora_pipeline / "models" / "sft", lora_pipeline, cache, "float32") == out
    assert time.time() - out.stat().st_mtime < day  # used again: not stale


# ----------------------------------------------------------------------------- nemo_rl engine


def test_megatron_stages_name_their_hf_start_by_content(trained_sft, tmp_path, monkeypatch):
    """NeMo-RL caches its HF->Megatron conversion by path and reuses it whatever the directory
    holds later. A new starting model at models/base must not train on the old one's cached
    conversion: the stage names its weights through a link keyed by their content."""
    from alignpipe.engines.nemo_rl import convert as CV
    from alignpipe.engines.nemo_rl.inputs import prepare
    from alignpipe.engines.nemo_rl.render import RunPaths

    root = megatron_lora_repo(trained_sft, tmp_path, monkeypatch)

    def nemo_rl_cache_dir() -> Path:
        ctx = build_context(root, "sft", "default_megatron")
        cfg = prepare(ctx, RunPaths(ctx.scratch_dir), None, Path("/opt/nemo-rl"))
        assert Path(cfg["policy"]["model_name"]).resolve() == (root / "models" / "base").resolve()
        return CV.megatron_base_checkpoint(cfg)

    first = nemo_rl_cache_dir()
    assert nemo_rl_cache_dir() == first  # the same weights: converted once
    (root / "models" / "base" / "model.safetensors").write_bytes(b"another model")
    assert nemo_rl_cache_dir() != first


def nemo_rl_lora_step(automodel, ctx, cfg, step_dir: Path):
    """A NeMo-RL DTensor V2 LoRA checkpoint as v0.7.0 writes it: the run's policy (the rendered
    policy.model_name) with Automodel's LoRA on it, trained (B non-zero), saved by Automodel's own
    Checkpointer with is_peft (the worker's save path; synchronous, as there is no GPU here).
    Returns the Automodel model, whose logits the published adapter must reproduce."""
    import shutil

    import yaml
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer, CheckpointingConfig
    from transformers import AutoModelForCausalLM

    policy = cfg["policy"]["model_name"]
    model = AutoModelForCausalLM.from_pretrained(policy, local_files_only=True, dtype="float32")
    lora_cfg = {
        **cfg["policy"]["dtensor_cfg"]["lora_cfg"],
        "use_triton": False,
        "lora_dtype": "torch.float32",
    }
    peft = PeftConfig.from_dict(lora_cfg)
    apply_lora_to_linear_modules(model, peft)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    step_dir.mkdir(parents=True)
    (step_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (step_dir / "training_info.json").write_text(json.dumps({"step": 4}))
    saving = CheckpointingConfig(enabled=True, checkpoint_dir=str(step_dir), model_save_format="safetensors",
                                 model_repo_id=policy, save_consolidated=True, is_peft=True, is_async=False)  # fmt: skip
    Checkpointer(saving, dp_rank=0, tp_rank=0, pp_rank=0).save_model(
        model, weights_path=str(step_dir / "policy" / "weights"), peft_config=peft
    )
    shutil.copytree(policy, step_dir / "policy" / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors"))
    return model.eval()


@pytest.mark.slow
def test_nemo_rl_lora_checkpoint_is_published_as_the_same_adapter(
    automodel, trained_sft, tmp_path, monkeypatch
):
    """The nemo_rl engine publishes a DTensor V2 LoRA run as the local engine does: the adapter
    alone (checkpoint_lora, peft), naming models/sft by path and hash. Read back as its chain
    merged, it gives Automodel's LoRA model's logits; held-out accuracy is measured on it; and
    a next NeMo-RL stage that starts from it gets the chain merged (NeMo-RL loads full weights)."""
    from alignpipe.engines.nemo_rl import convert as CV
    from alignpipe.engines.nemo_rl.inputs import merge_adapter_inputs
    from alignpipe.engines.nemo_rl.publish import publish
    from alignpipe.engines.nemo_rl.render import RunPaths, dropped_training_knobs, render_for
    from alignpipe.measure.logprobs import load_policy
    from tests.test_nemo_rl_publish import compose_into

    root = writable_copy(trained_sft, tmp_path / "repo")
    monkeypatch.setenv("ALIGNPIPE_SCRATCH", str(tmp_path / "scratch"))
    compose_into(root, "default")
    heldout = {"limit": 4, "max_new_tokens": 4, "batch_size": 4}
    lora_on = {"dtensor_cfg": {"lora_cfg": {"enabled": True}}}
    set_params(root, {"rlvr": {"alignpipe": {"heldout": heldout}, "policy": lora_on}})
    ctx = build_context(root, "rlvr", "default")
    paths = RunPaths(ctx.scratch_dir)
    cfg = render_for(ctx, paths.scratch)
    assert dropped_training_knobs("rlvr", ctx.config) == []
    trained = nemo_rl_lora_step(automodel, ctx, cfg, paths.checkpoints / "step_4")
    assert CV.checkpoint_format(paths.checkpoints / "step_4") == CV.PEFT

    def no_commands(argv, cwd):
        raise AssertionError(f"a LoRA checkpoint needs no converter, got {argv}")

    manifest = publish(ctx, cfg, paths, runner=no_commands)
    out = root / "models" / "rlvr"
    assert manifest["type"] == "checkpoint_lora" and manifest["format"] == "peft"
    assert manifest["adapter"]["applies_to"] == {
        "path": "models/sft",
        "hash": dvc_hash(root / "models" / "sft"),
    }
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "models/sft"
    assert not (out / "model.safetensors").exists() and (out / "tokenizer_config.json").is_file()
    assert 0.0 <= manifest["metrics"]["heldout"]["accuracy"] <= 1.0
    model, _ = load_policy(out)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 3]])
    with torch.no_grad():
        assert (model(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max() < 1e-5

    # dpo (or any NeMo-RL stage) on this adapter: NeMo-RL gets the chain merged
    nxt = {"policy": {"model_name": str(out)}}
    merge_adapter_inputs(ctx, nxt, RunPaths(tmp_path / "next"))
    merged = Path(nxt["policy"]["model_name"])
    assert merged.parent == tmp_path / "next" / "converted" / "merged" and (merged / "config.json").is_file()
    reloaded, _ = load_policy(merged)
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max() < 1e-5


class BridgeExport:
    """Stands in for NeMo-RL's convert_lora_to_hf.py, which needs Megatron-Bridge (not installable
    here). It reads its argv with the script's own parser, then writes what Megatron-Bridge's
    ``save_hf_adapter`` writes for a Llama: an HF PEFT adapter on every projection in float32,
    with one lora_A shared by q/k/v and by gate/up (Megatron's fused linear_qkv and linear_fc1
    have one input projection), B trained (non-zero); without --adapter-only, that model merged.
    ``model`` is the base-plus-adapter model the published artifact must reproduce."""

    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, nemo_rl_src: Path):
        import importlib.util

        path = nemo_rl_src / "examples" / "converters" / "convert_lora_to_hf.py"
        spec = importlib.util.spec_from_file_location("convert_lora_to_hf", path)
        self.script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.script)
        self.calls: list = []

    def __call__(self, argv, cwd) -> int:
        import yaml
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from alignpipe.engines.nemo_rl import convert as CV

        assert argv[:2] == [CV.MCORE_PYTHON, CV.LORA_TO_HF] and (Path(cwd) / argv[1]).is_file()
        saved = sys.argv
        sys.argv = argv[1:]
        try:
            args = self.script.parse_args()
        finally:
            sys.argv = saved
        self.calls.append(args)
        peft = yaml.safe_load((Path(args.adapter_ckpt) / "run_config.yaml").read_text())["peft"]
        base = AutoModelForCausalLM.from_pretrained(
            args.hf_model_name, local_files_only=True, dtype=torch.float32
        )
        config = LoraConfig(r=peft["dim"], lora_alpha=peft["alpha"], target_modules=list(self.PROJECTIONS))
        model = get_peft_model(base, config)
        torch.manual_seed(len(self.calls))
        with torch.no_grad():
            for layer in model.base_model.model.model.layers:
                for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                    owner = layer.self_attn if fused[0] == "q_proj" else layer.mlp
                    shared = getattr(owner, fused[0]).lora_A["default"].weight
                    for name in fused[1:]:
                        getattr(owner, name).lora_A["default"].weight.copy_(shared)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        self.model = model.eval()
        if args.adapter_only:
            model.save_pretrained(args.hf_ckpt_path)
        else:
            model.merge_and_unload().save_pretrained(args.hf_ckpt_path)
        return 0


def megatron_lora_step(cfg: dict, step_dir: Path) -> None:
    """The layout NeMo-RL v0.7.0 writes for a Megatron LoRA step: Megatron-Bridge's save with its
    adapter filter (policy/weights/iter_0000000: torch_dist shards of the adapter keys and
    run_config.yaml with the peft section), and policy/tokenizer. The shards are placeholders:
    only Megatron-Bridge reads them."""
    import shutil

    import yaml

    weights = step_dir / "policy" / "weights"
    (weights / "iter_0000000").mkdir(parents=True)
    (step_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (step_dir / "training_info.json").write_text(json.dumps({"step": 4}))
    peft = cfg["policy"]["megatron_cfg"]["peft"]
    (weights / "iter_0000000" / "run_config.yaml").write_text(yaml.safe_dump({"peft": peft}))
    (weights / "iter_0000000" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (weights / "latest_checkpointed_iteration.txt").write_text("0\n")
    tokenizer = cfg["policy"]["tokenizer"]["name"]
    shutil.copytree(
        tokenizer,
        step_dir / "policy" / "tokenizer",
        ignore=shutil.ignore_patterns("*.safetensors", "*.json.dvc"),
    )


def megatron_lora_repo(trained_sft: Path, tmp_path: Path, monkeypatch) -> Path:
    from dvc.utils.hydra import compose_and_dump

    root = writable_copy(trained_sft, tmp_path / "repo")
    monkeypatch.setenv("ALIGNPIPE_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("NRL_MEGATRON_CHECKPOINT_DIR", str(tmp_path / "nrl"))  # NeMo-RL's HF->Megatron cache
    overrides = ["profile=default_megatron", "lora=on"]
    compose_and_dump(root / "params.yaml", str(REPO / "conf"), None, "config", str(REPO), overrides)
    heldout = {"alignpipe": {"heldout": {"limit": 4, "max_new_tokens": 4, "batch_size": 4}}}
    set_params(root, {"sft": heldout, "dpo": heldout})
    return root


def same_logits(a, b) -> float:
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 3]])
    with torch.no_grad():
        return float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max())


@pytest.mark.slow
def test_megatron_lora_runs_are_published_as_adapters_and_chain(
    nemo_rl_src, trained_sft, tmp_path, monkeypatch
):
    """`-S profile=default_megatron -S lora=on`: sft's Megatron LoRA run is exported by
    convert_lora_to_hf.py --adapter-only over the base NeMo-RL trained it on (its conversion of
    models/base) and published as the local engine publishes adapters. dpo, whose profile starts
    it from sft's Megatron checkpoint, starts from that adapter's chain merged instead, and its own
    adapter names models/sft; read back, each gives its base-plus-adapter model's logits."""
    from alignpipe.engines.nemo_rl import convert as CV
    from alignpipe.engines.nemo_rl.inputs import prepare
    from alignpipe.engines.nemo_rl.publish import publish
    from alignpipe.engines.nemo_rl.render import RunPaths
    from alignpipe.measure.logprobs import load_policy

    root = megatron_lora_repo(trained_sft, tmp_path, monkeypatch)
    bridge = BridgeExport(nemo_rl_src)

    ctx = build_context(root, "sft", "default_megatron")
    paths = RunPaths(ctx.scratch_dir)
    cfg = prepare(ctx, paths, bridge, nemo_rl_src)
    assert cfg["policy"]["megatron_cfg"]["peft"]["enabled"] is True
    base = (root / "models" / "base").resolve()
    link = Path(cfg["policy"]["model_name"])  # NeMo-RL converts it once per content, not per path
    assert link.resolve() == base and link.name == f"base-{dvc_hash(base)[:16]}"
    megatron_lora_step(cfg, paths.checkpoints / "step_4")
    assert CV.checkpoint_format(paths.checkpoints / "step_4") == CV.MEGATRON_LORA
    manifest = publish(ctx, cfg, paths, runner=bridge, workdir=nemo_rl_src)
    call = bridge.calls[-1]
    assert call.adapter_only and call.hf_model_name == str(link)
    assert Path(call.base_ckpt) == tmp_path / "nrl" / f"model_{str(link).replace('/', '_')}" / "iter_0000000"
    sft = root / "models" / "sft"
    assert manifest["type"] == "checkpoint_lora" and manifest["format"] == "peft"
    assert manifest["nemo_rl"]["checkpoint_format"] == CV.MEGATRON_LORA
    assert manifest["adapter"]["applies_to"] == {
        "path": "models/base",
        "hash": dvc_hash(root / "models" / "base"),
    }
    assert json.loads((sft / "adapter_config.json").read_text())["base_model_name_or_path"] == "models/base"
    assert not (sft / "model.safetensors").exists() and (sft / "tokenizer_config.json").is_file()
    assert 0.0 <= manifest["metrics"]["heldout"]["accuracy"] <= 1.0
    assert same_logits(load_policy(sft)[0], bridge.model) < 1e-5

    ctx = build_context(root, "dpo", "default_megatron")
    paths = RunPaths(ctx.scratch_dir)
    cfg = prepare(ctx, paths, bridge, nemo_rl_src)
    merged = Path(cfg["policy"]["model_name"])
    assert "pretrained_checkpoint" not in cfg["checkpointing"]  # sft has no Megatron checkpoint now
    assert (
        merged.resolve().parent == paths.converted / "merged"
        and merged.name == f"merged-{merged.resolve().name}"
    )
    assert cfg["policy"]["tokenizer"]["name"] == str(sft.resolve())
    megatron_lora_step(cfg, paths.checkpoints / "step_4")
    manifest = publish(ctx, cfg, paths, runner=bridge, workdir=nemo_rl_src)
    call = bridge.calls[-1]
    assert call.adapter_only and call.hf_model_name == str(merged)
    assert (
        Path(call.base_ckpt) == tmp_path / "nrl" / f"model_{str(merged).replace('/', '_')}" / "iter_0000000"
    )
    assert manifest["adapter"]["applies_to"] == {"path": "models/sft", "hash": dvc_hash(sft)}
    dpo = root / "models" / "dpo"
    assert adapter_chain(dpo, root) == [base, sft.resolve(), dpo.resolve()]
    assert same_logits(load_policy(dpo)[0], bridge.model) < 1e-5


@pytest.mark.slow
def test_megatron_lora_over_a_megatron_checkpoint_is_published_merged(
    nemo_rl_src, trained_sft, tmp_path, monkeypatch
):
    """Full-weight sft on Megatron, LoRA dpo: the adapter's base is sft's Megatron checkpoint,
    which peft cannot load, so convert_lora_to_hf.py merges the adapter into it and the stage
    publishes the full HF model (checkpoint_hf), measured like any other."""
    import shutil

    import yaml
    from transformers import AutoModelForCausalLM

    from alignpipe.engines.nemo_rl.inputs import prepare
    from alignpipe.engines.nemo_rl.publish import publish
    from alignpipe.engines.nemo_rl.render import RunPaths

    root = megatron_lora_repo(trained_sft, tmp_path, monkeypatch)
    sft = root / "models" / "sft"
    weights = sft / "policy" / "weights"
    (weights / "iter_0000000").mkdir(parents=True)  # a published checkpoint_megatron, as the engine copies it
    (weights / "iter_0000000" / "run_config.yaml").write_text("model: {}\n")
    (weights / "latest_checkpointed_iteration.txt").write_text("0\n")
    shutil.copytree(
        root / "models" / "base", sft / "policy" / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors")
    )
    manifest = json.loads((sft / "artifact.json").read_text())
    (sft / "artifact.json").write_text(
        json.dumps({**manifest, "type": "checkpoint_megatron", "format": "megatron_bridge"})
    )
    set_params(root, {"dpo": {"policy": {"megatron_cfg": {"peft": {"enabled": True}}}}})
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["dpo"]["policy"]["dtensor_cfg"]["lora_cfg"]["enabled"] = False  # LoRA on dpo only
    (root / "params.yaml").write_text(yaml.safe_dump(params))

    bridge = BridgeExport(nemo_rl_src)
    ctx = build_context(root, "dpo", "default_megatron")
    paths = RunPaths(ctx.scratch_dir)
    cfg = prepare(ctx, paths, bridge, nemo_rl_src)
    assert cfg["checkpointing"]["pretrained_checkpoint"]["path"] == str(weights.resolve())
    megatron_lora_step(cfg, paths.checkpoints / "step_4")
    manifest = publish(ctx, cfg, paths, runner=bridge, workdir=nemo_rl_src)
    call = bridge.calls[-1]
    assert not call.adapter_only and Path(call.base_ckpt) == weights.resolve() / "iter_0000000"
    assert manifest["type"] == "checkpoint_hf" and manifest["format"] == "hf" and "adapter" not in manifest
    dpo = root / "models" / "dpo"
    exported = AutoModelForCausalLM.from_pretrained(dpo, local_files_only=True, dtype=torch.float32)
    assert same_logits(exported, bridge.model) < 1e-5
    assert 0.0 <= manifest["metrics"]["heldout"]["accuracy"] <= 1.0
