"""The starting model (``model.name``): base materialises it into models/base, later stages and
exports carry its lineage, its generation config and its tokenizer (pad falling back to EOS)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from alignpipe.artifacts import dvc_hash, md5_file
from tests.conftest import OFFLINE, copy_repo, run_cli, set_model, set_params, writable_copy


@pytest.fixture
def own_model(trained_sft: Path, tmp_path: Path) -> Path:
    """A user's Hugging Face directory: a small causal LM whose tokenizer has no pad token and
    whose generation_config.json has its own settings, plus files base must leave behind."""
    src = tmp_path / "my-model"
    shutil.copytree(trained_sft / "models" / "base", src)
    for name in ("artifact.json", "resolved_config.yaml"):
        (src / name).unlink()
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg.pop("pad_token", None)
    (src / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    gen = json.loads((src / "generation_config.json").read_text())
    gen.update(repetition_penalty=1.3, pad_token_id=None)
    (src / "generation_config.json").write_text(json.dumps(gen))
    (src / "optimizer.pt").write_bytes(b"training state")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return src


@pytest.mark.slow
def test_a_local_model_becomes_models_base_and_its_lineage_reaches_the_export(
    trained_sft: Path, own_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = writable_copy(trained_sft, tmp_path / "repo")
    set_model(root, str(own_model))
    set_params(root, {"sft": {"sft": {"max_num_steps": 3}}})
    env = {"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")}

    out = run_cli(root, "run", "base", env=env).stdout
    base = root / "models" / "base"
    assert str(own_model) in out
    assert md5_file(base / "model.safetensors") == md5_file(own_model / "model.safetensors")
    assert not (base / "optimizer.pt").exists() and not (base / ".git").exists()
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert tokenizer.pad_token == tokenizer.eos_token  # fell back to EOS, once, in base
    manifest = json.loads((base / "artifact.json").read_text())
    assert manifest["source_model"]["name"] == str(own_model.resolve())
    assert manifest["source_model"]["hash"] == dvc_hash(own_model)
    assert manifest["source_model"]["pad_token"].startswith("eos")

    # A stage trains from it (batches pad with EOS) and carries the lineage on.
    run_cli(root, "run", "sft", env=env)
    sft_manifest = json.loads((root / "models" / "sft" / "artifact.json").read_text())
    assert sft_manifest["source_model"] == manifest["source_model"]

    # The export keeps the model's own generation config and names the starting model.
    run_cli(root, "run", "convert", "--source", "sft", env=env)
    export = root / "exports" / "sft"
    gen = json.loads((export / "generation_config.json").read_text())
    assert gen["repetition_penalty"] == 1.3 and gen["pad_token_id"] == tokenizer.pad_token_id
    card = (export / "README.md").read_text()
    assert f"| starting model | `{own_model.resolve()}` DVC md5 `{dvc_hash(own_model)}` |" in card
    assert AutoModelForCausalLM.from_pretrained(export) is not None
    assert len(AutoTokenizer.from_pretrained(export)) == len(tokenizer)


HUB_ID = "acme/tiny-instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache_with(model_dir: Path, cache: Path, repo_id: str, commit: str) -> None:
    """Lay ``model_dir`` out in ``cache`` exactly as ``hf download`` does, with huggingface_hub's
    own cache functions: content-addressed blobs, a snapshot of links and ``refs/main``."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    for item in sorted(model_dir.iterdir()):
        blob = storage / "blobs" / hashlib.sha256(item.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(item, blob)
        (storage / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(storage / "snapshots" / commit / item.name), new_blob=False)
    _cache_commit_hash_for_specific_revision(str(storage), "main", commit)


@pytest.fixture
def tiny_instruct(tmp_path: Path) -> Path:
    """A small instruct model as a Hub repository holds it: weights, tokenizer, chat template,
    plus a .bin copy of the weights that base must not take."""
    from alignpipe import tiny

    tokenizer = tiny.train_tokenizer(["What is 2+2? 4. The answer is \\boxed{4}."], "char")
    cfg = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = tiny.build_causal_lm(tokenizer, cfg, seed=0)
    out = tmp_path / "upstream"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pytorch_model.bin").write_bytes(b"legacy weights")
    return out


def test_the_tiny_profile_refuses_a_pretrained_sized_model_naming_the_profile_to_use(
    repo_copy: Path, tmp_path: Path
) -> None:
    """Its learning rates would wreck a pretrained model: base stops, publishing nothing."""
    from alignpipe import tiny

    tokenizer = tiny.train_tokenizer(["What is 2+2? 4."], "char")
    cfg = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4}
    big = tmp_path / "big"
    tiny.build_causal_lm(tokenizer, cfg, seed=0).save_pretrained(big)  # 5.3M parameters
    tokenizer.save_pretrained(big)
    set_model(repo_copy, str(big))
    result = run_cli(repo_copy, "run", "base", check=False)
    assert result.returncode == 2 and not (repo_copy / "models" / "base").exists()
    assert "profile tiny is tuned for its own tiny model" in result.stderr, result.stderr
    assert f"dvc exp run -S profile=small -S model.name={big}" in result.stderr


def test_a_hub_id_resolves_offline_from_the_hugging_face_cache(
    repo_copy: Path, tiny_instruct: Path, tmp_path: Path
) -> None:
    """What docs/GPU.md and gpu.yml do: weights in $HF_HOME, every stage offline."""
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "hf" / "hub"
    hub_cache_with(tiny_instruct, cache, HUB_ID, COMMIT)
    assert [r.repo_id for r in scan_cache_dir(cache).repos] == [HUB_ID]  # huggingface_hub reads it back

    set_model(repo_copy, HUB_ID)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}  # no Hub to reach
    run_cli(repo_copy, "run", "base", env=env, process=True)  # HF_HOME: read at import
    base = repo_copy / "models" / "base"
    assert md5_file(base / "model.safetensors") == md5_file(tiny_instruct / "model.safetensors")
    assert not (base / "pytorch_model.bin").exists()
    source = json.loads((base / "artifact.json").read_text())["source_model"]
    assert source["kind"] == "hub" and source["commit"] == COMMIT and source["name"] == f"{HUB_ID}@{COMMIT}"

    # A pinned revision the cache lacks is named with the cache and both fixes, and nothing is published.
    shutil.rmtree(base)
    set_model(repo_copy, HUB_ID, revision="v2")
    result = run_cli(repo_copy, "run", "base", env=env, check=False, process=True)
    assert result.returncode == 2 and not base.exists()
    assert f"{cache} holds no snapshot of it at revision v2" in result.stderr
    assert (
        "hf download acme/tiny-instruct --revision v2" in result.stderr
        and "model.download=true" in result.stderr
    )


def test_model_download_lifts_offline_mode_for_base_alone(repo_copy: Path, tmp_path: Path) -> None:
    """With model.download=true base reaches for the Hub even though the caller (the Makefile,
    gpu.yml) exported HF_HUB_OFFLINE=1: here a closed port, so the error is a connection error."""
    set_model(repo_copy, HUB_ID, download=True)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2"}
    result = run_cli(repo_copy, "run", "base", env=env, check=False, process=True)
    assert result.returncode == 2 and not (repo_copy / "models" / "base").exists()
    assert "offline mode lifted for this stage" in result.stdout
    assert "could not be fetched from the Hugging Face Hub" in result.stderr
    assert "offline" not in result.stderr.lower(), result.stderr
    assert "connect" in result.stderr.lower(), result.stderr


def test_a_hub_id_is_fetched_only_when_allowed(repo_copy: Path, tmp_path: Path) -> None:
    set_model(repo_copy, "HuggingFaceTB/SmolLM2-135M-Instruct")
    result = run_cli(repo_copy, "run", "base", env={"HF_HOME": str(tmp_path / "empty")}, check=False,
                     process=True)  # fmt: skip
    assert result.returncode == 2
    assert "model.download=true" in result.stderr and "HuggingFaceTB/SmolLM2-135M-Instruct" in result.stderr
    assert not (repo_copy / "models" / "base").exists()


def test_a_directory_that_is_no_model_is_named(repo_copy: Path, tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    set_model(repo_copy, str(tmp_path / "weights"))
    result = run_cli(repo_copy, "run", "base", check=False)
    assert result.returncode == 2
    assert "holds no config.json" in result.stderr and str(tmp_path / "weights") in result.stderr
    assert not (repo_copy / "models" / "base").exists()


def test_gpu_profiles_start_from_models_base(repo_copy: Path, tmp_path: Path) -> None:
    """`plan sft --profile default` with model.name set: NeMo-RL loads models/base."""
    set_params(repo_copy, {"model": {"name": str(tmp_path / "my-model")}})
    plan = run_cli(repo_copy, "plan", "sft", "--profile", "default").stdout
    assert f"model_name: {repo_copy / 'models' / 'base'}" in plan
    assert str(tmp_path / "my-model") not in plan.split("==>")[0]


def test_a_hand_edited_model_name_without_its_dep_is_refused(repo_copy: Path, tmp_path: Path) -> None:
    """params.yaml edited by hand: DVC would not hash the directory, so base says how to set it."""
    (tmp_path / "my-model").mkdir()
    set_params(repo_copy, {"model": {"name": str(tmp_path / "my-model")}})
    result = run_cli(repo_copy, "run", "base", check=False)
    assert result.returncode == 2
    assert (
        "model.dep" in result.stderr and f"dvc exp run -S model.name={tmp_path / 'my-model'}" in result.stderr
    )


@pytest.mark.slow
def test_editing_a_file_of_a_local_model_reruns_base_and_what_follows(tmp_path: Path) -> None:
    """`dvc exp run -S model.name=DIR` (DVC's own Hydra composition) makes DIR a dep of base."""
    import yaml

    root = copy_repo(tmp_path / "repo", git=True)
    env = {**os.environ, **OFFLINE, "ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")}

    def dvc(*argv: str) -> str:
        proc = subprocess.run(["dvc", *argv], cwd=root, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"dvc {' '.join(argv)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    # An experiment commits every locked output; this copy has none cached, so it starts unlocked.
    subprocess.run(["git", "rm", "-q", "dvc.lock"], cwd=root, env=env, check=True)
    subprocess.run(["git", "commit", "-qm", "unlocked"], cwd=root, env=env, check=True)
    dvc("repro", "base")  # the tiny base, saved as a user's model directory
    src = shutil.copytree(root / "models" / "base", tmp_path / "my-model")
    for name in ("artifact.json", "resolved_config.yaml"):
        (src / name).unlink()

    dvc("exp", "run", "base", "-S", f"model.name={src}")
    assert yaml.safe_load((root / "params.yaml").read_text())["model"]["dep"] == str(src)
    manifest = json.loads((root / "models" / "base" / "artifact.json").read_text())
    assert manifest["source_model"]["name"] == str(src.resolve())
    assert "Running stage 'base'" not in dvc("repro", "--dry", "base")

    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": 1.1}))
    assert str(src) in dvc("status", "base")
    dry = dvc("repro", "--dry", "sft")  # sft: the first trainer after base (later ones need its outputs)
    assert "Running stage 'base'" in dry and "Running stage 'sft'" in dry
