"""DPO moves the SFT policy towards chosen answers, measures itself the way TRL does,
reloads, records lineage, maps NeMo-RL's loss keys honestly, and resumes after a kill."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from alignpipe.artifacts import dvc_hash, md5_file, read_manifest
from alignpipe.context import build_context
from alignpipe.engines.local import training
from alignpipe.errors import UnsupportedSetting
from alignpipe.jsonl import read_jsonl
from tests.conftest import OFFLINE, REPO, copy_repo, run_cli, set_params, writable_copy

# Short run, same code path as the committed profile: validation at steps 0, 20 and 40.
FAST_DPO = {"dpo": {"dpo": {"max_num_steps": 40, "val_period": 20}}}


def tsv(path: Path) -> list[tuple[int, float]]:
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:]]
    return [(int(r[0]), float(r[-1])) for r in rows]


@pytest.fixture(scope="module")
def dpo_run(trained_sft: Path, tmp_path_factory) -> Path:
    root = writable_copy(trained_sft, tmp_path_factory.mktemp("dpo") / "repo")
    set_params(root, FAST_DPO)
    run_cli(root, "run", "dpo", env={"ALIGNPIPE_SCRATCH": str(tmp_path_factory.mktemp("dpo-scratch"))})
    return root


@pytest.mark.slow
def test_dpo_raises_preference_accuracy_and_margin(dpo_run: Path):
    plots = dpo_run / "results" / "dpo" / "plots" / "metrics" / "val"
    accuracy, margin, kl = (tsv(plots / f"{m}.tsv") for m in ("preference_accuracy", "reward_margin",
                                                             "kl_to_reference"))
    # At step 0 the policy is the reference: every implicit reward is exactly 0.
    assert accuracy[0] == (0, 0.0) and margin[0][1] == pytest.approx(0.0, abs=1e-6)
    assert kl[0][1] == pytest.approx(0.0, abs=1e-6)
    # From a 40-step SFT policy, 40 DPO steps reach ~0.64 (measured); the full profile gets 0.87.
    assert accuracy[-1][1] >= 0.6, f"val preference accuracy only reached {accuracy[-1][1]}"
    assert margin[-1][1] > margin[1][1] > 0.0, f"margin did not grow: {margin}"
    assert kl[-1][1] > 0.0

    metrics = json.loads((dpo_run / "results" / "dpo" / "metrics.json").read_text())
    val = metrics["val"]
    assert val["reward_margin"] == pytest.approx(val["chosen_reward"] - val["rejected_reward"], abs=1e-5)
    assert 0.0 <= metrics["heldout"]["accuracy"] <= 1.0 and metrics["heldout"]["mean_length"] > 0
    assert "preference_accuracy" in metrics["train"]


@pytest.mark.slow
def test_dpo_policy_reloads_has_moved_and_records_lineage(dpo_run: Path):
    from transformers import AutoModelForCausalLM

    out = dpo_run / "models" / "dpo"
    AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    sft = load_file(dpo_run / "models" / "sft" / "model.safetensors")
    dpo = load_file(out / "model.safetensors")
    assert sft.keys() == dpo.keys()
    assert all(not (sft[k] == dpo[k]).all() for k in sft), "every parameter tensor should have moved"

    manifest = read_manifest(out)
    assert manifest["type"] == "checkpoint_hf" and manifest["stage"] == "dpo"
    assert manifest["inputs"]["policy"]["hash"] == dvc_hash(dpo_run / "models" / "sft")
    assert manifest["metrics"]["val/preference_accuracy"] > 0
    assert "reference_policy_kl_penalty" in (out / "resolved_config.yaml").read_text()


@pytest.mark.slow
def test_validation_rewards_match_trls_own(dpo_run: Path, tmp_path: Path):
    """Our implicit reward is TRL's: same margins and accuracy on the same pairs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from alignpipe.engines.local.dpo import preference_metrics

    policy = AutoModelForCausalLM.from_pretrained(dpo_run / "models" / "dpo", local_files_only=True).eval()
    reference = AutoModelForCausalLM.from_pretrained(dpo_run / "models" / "sft", local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(dpo_run / "models" / "dpo", local_files_only=True)
    rows = read_jsonl(dpo_run / "data/prepared/preference/validation.jsonl")[:32]
    pairs = training.preference_pairs(rows)
    ours = preference_metrics(policy, reference, tokenizer, pairs, beta=0.1, average_log_probs=False)

    args = DPOConfig(output_dir=str(tmp_path), beta=0.1, per_device_eval_batch_size=32, use_cpu=True, bf16=False,
                     gradient_checkpointing=False, report_to=[], disable_tqdm=True, max_length=64)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(pairs),
                         eval_dataset=Dataset.from_list(pairs), processing_class=tokenizer)
    theirs = trainer.evaluate()
    assert ours["val_reward_margin"] == pytest.approx(theirs["eval_rewards/margins"], rel=1e-3, abs=1e-4)
    assert ours["val_chosen_reward"] == pytest.approx(theirs["eval_rewards/chosen"], rel=1e-3, abs=1e-4)
    assert ours["val_preference_accuracy"] == pytest.approx(theirs["eval_rewards/accuracies"])


def loss_config(**dpo_knobs) -> dict:
    from alignpipe import config as C
    from alignpipe.engines.local.dpo import loss_settings

    params = {**C.load_params(REPO), "dpo": {"dpo": dpo_knobs}}
    return loss_settings(build_context(REPO, "dpo", params=params))


def test_nemo_rl_loss_keys_map_to_trl_loss_types():
    plain = loss_config(reference_policy_kl_penalty=0.2, sft_loss_weight=0, preference_loss_weight=1)
    assert plain == {"beta": 0.2, "loss_type": ["sigmoid"], "loss_weights": [1.0]}
    averaged = loss_config(preference_average_log_probs=True, sft_loss_weight=0)
    assert averaged["loss_type"] == ["sigmoid_norm"]
    mixed = loss_config(sft_loss_weight=0.3, sft_average_log_probs=True, preference_loss_weight=0.7)
    assert mixed["loss_type"] == ["sigmoid", "sft"] and mixed["loss_weights"] == [0.7, 0.3]


def test_summed_sft_loss_is_refused_not_approximated():
    with pytest.raises(UnsupportedSetting, match="sft_average_log_probs"):
        loss_config(sft_loss_weight=0.5, sft_average_log_probs=False)


def _copy_trained(src: Path, dst: Path) -> Path:
    root = copy_repo(dst)
    for rel in ("data/prepared", "models/base", "models/sft"):
        writable_copy(src / rel, root / rel)
    shutil.copy2(src / "params.yaml", root / "params.yaml")
    cfg = root / "stages" / "dpo" / "config" / "tiny.yaml"
    # checkpoint every 10 steps so an interruption has something to resume from
    cfg.write_text(cfg.read_text().replace("save_period: 25", "save_period: 10"))
    set_params(root, {"dpo": {"dpo": {"max_num_steps": 30, "val_period": 10}}})
    return root


@pytest.mark.slow
def test_killed_dpo_resumes_to_the_same_weights_and_curves(trained_sft: Path, tmp_path: Path):
    """Kill DPO after a checkpoint; the re-run resumes and ends bit-identical to a straight run."""
    straight = _copy_trained(trained_sft, tmp_path / "straight" / "repo")
    run_cli(straight, "run", "dpo", env={"ALIGNPIPE_SCRATCH": str(tmp_path / "straight" / "scratch")})

    root = _copy_trained(trained_sft, tmp_path / "killed" / "repo")
    scratch = tmp_path / "killed" / "scratch"
    env = {"ALIGNPIPE_SCRATCH": str(scratch)}
    proc = subprocess.Popen(
        ["alignpipe", "run", "dpo"], cwd=root, env={**os.environ, **OFFLINE, "ALIGNPIPE_ROOT": str(root), **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 900
    while not list(scratch.glob("repo/dpo/*/checkpoint-20/trainer_state.json")):
        assert proc.poll() is None, "dpo finished before it could be interrupted"
        assert time.monotonic() < deadline, "no checkpoint-20 appeared"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (root / "models" / "dpo").exists(), "a killed run must not publish"

    resumed = run_cli(root, "run", "dpo", env=env)
    assert "resuming from" in resumed.stdout
    assert md5_file(root / "models/dpo/model.safetensors") == md5_file(straight / "models/dpo/model.safetensors")
    # Validation curves from before the kill are replayed, so the resumed run's are whole.
    curve = root / "results/dpo/plots/metrics/val/preference_accuracy.tsv"
    assert tsv(curve) == tsv(straight / "results/dpo/plots/metrics/val/preference_accuracy.tsv")
    assert not list(scratch.glob("repo/dpo/*")), "scratch checkpoints are removed after publishing"
