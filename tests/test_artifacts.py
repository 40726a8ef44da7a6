"""Content hashes match DVC's; publishing is all-or-nothing."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from alignpipe.artifacts import dvc_hash, md5_file, read_manifest, staged_dir, write_manifest


def test_dvc_hash_equals_what_dvc_records(tmp_path):
    repo = tmp_path / "r"
    (repo / "data" / "sub").mkdir(parents=True)
    (repo / "data" / "a.txt").write_text("alpha\r\n")  # CRLF: DVC 3 hashes raw bytes
    (repo / "data" / "sub" / "b.bin").write_bytes(bytes(range(256)))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["dvc", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["dvc", "add", "-q", "data"], cwd=repo, check=True)
    recorded = yaml.safe_load((repo / "data.dvc").read_text())["outs"][0]["md5"]
    assert dvc_hash(repo / "data") == recorded
    assert dvc_hash(repo / "data" / "a.txt") == md5_file(repo / "data" / "a.txt")


def test_staged_dir_publishes_whole_directory(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with staged_dir(final) as tmp:
        (tmp / "new.txt").write_text("new")
        assert not (final / "new.txt").exists()  # invisible until done
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_staged_dir_failure_leaves_previous_output_untouched(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "good.txt").write_text("good")
    with pytest.raises(RuntimeError):
        with staged_dir(final) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("trainer crashed")
    assert sorted(p.name for p in final.iterdir()) == ["good.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_manifest_records_lineage_and_rejects_unknown_types(tmp_path):
    write_manifest(
        tmp_path,
        type="checkpoint_hf",
        format="hf",
        stage="sft",
        engine="local",
        inputs={"data": {"path": "data/prepared", "hash": "abc.dir"}},
        metrics={"heldout/accuracy": 0.5},
    )
    manifest = read_manifest(tmp_path)
    assert manifest["inputs"]["data"]["hash"] == "abc.dir"
    assert manifest["metrics"]["heldout/accuracy"] == 0.5
    json.loads((tmp_path / "artifact.json").read_text())
    with pytest.raises(ValueError, match="unknown artifact type"):
        write_manifest(tmp_path, type="zip", format="x", stage="s", engine="local")


def test_published_outputs_follow_the_umask_not_tempfile_modes(tmp_path):
    """A shared cache or a teammate must be able to read what a stage publishes."""
    import os

    old = os.umask(0o022)
    try:
        final = tmp_path / "out"
        with staged_dir(final) as tmp:
            write_manifest(tmp, type="checkpoint_hf", format="hf", stage="sft", engine="local")
    finally:
        os.umask(old)
    assert final.stat().st_mode & 0o777 == 0o755
    assert (final / "artifact.json").stat().st_mode & 0o777 == 0o644
