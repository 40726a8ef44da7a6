"""prep: sources mixed by weight -- a family's train split drawn in the proportions the weights
ask for, deterministically from the split seed; validation and test kept whole; the manifest
says what each source gave."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from alignpipe.data.mixture import shares
from alignpipe.data.prepare import prepare
from alignpipe.data.schema import SPLITS
from alignpipe.errors import ConfigError

SPLIT = {"seed": 5, "validation_fraction": 0.1, "test_fraction": 0.1}


def source_file(tmp_path: Path, name: str, n: int) -> dict:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"input": f"{name} {k}", "output": str(k)}) + "\n" for k in range(n)))
    return {"kind": "jsonl", "path": str(path), "format": "response", "family": "rlvr", "verifier": "exact"}


def prep(tmp_path: Path, *sources: dict, mix: dict | None = None, out: str = "out") -> tuple[dict, dict]:
    cfg = {"split": SPLIT, "sources": list(sources), **({"mix": mix} if mix else {})}
    manifest = prepare(cfg, tmp_path, tmp_path / out)
    rows = {
        s: [json.loads(x) for x in (tmp_path / out / "rlvr" / f"{s}.jsonl").read_text().splitlines()]
        for s in SPLITS
    }
    return rows, manifest


def by_source(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        name = r["prompt"][-1]["content"].split()[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_weights_set_the_train_proportions_and_the_manifest_records_them(tmp_path):
    big, small = source_file(tmp_path, "big", 400), source_file(tmp_path, "small", 100)
    plain, _ = prep(tmp_path, big, small, out="plain")
    available = by_source(plain["train"])  # what each source has in train without weights
    rows, manifest = prep(tmp_path, {**big, "weight": 1}, {**small, "weight": 3})
    # 1:3 -- the small source is the limit: all its train rows, a third as many from big
    got = by_source(rows["train"])
    assert got["small"] == available["small"] and got["big"] == round(available["small"] / 3)
    assert (
        sum(got.values()) == manifest["mixtures"]["rlvr"]["train_rows"] == manifest["counts"]["rlvr"]["train"]
    )
    for s in ("validation", "test"):  # measured on, never reweighted
        assert by_source(rows[s]) == by_source(plain[s])
    entries = manifest["sources"]
    assert [e["splits"]["rlvr"]["train"] for e in entries] == [got["big"], got["small"]]
    assert [e["rows_read"] for e in entries] == [400, 100] and [e["rows_kept"] for e in entries] == [400, 100]
    mixed = manifest["mixtures"]["rlvr"]["sources"]
    assert [m["weight"] for m in mixed.values()] == [1.0, 3.0]
    assert [m["drawn"] for m in mixed.values()] == [got["big"], got["small"]]


def test_a_set_size_is_shared_exactly_and_the_draw_is_seeded(tmp_path):
    a, b = source_file(tmp_path, "a", 300), source_file(tmp_path, "b", 300)
    rows, _ = prep(tmp_path, {**a, "weight": 2}, {**b, "weight": 1}, mix={"rlvr": {"train_rows": 150}})
    assert by_source(rows["train"]) == {"a": 100, "b": 50}
    again, _ = prep(
        tmp_path, {**a, "weight": 2}, {**b, "weight": 1}, mix={"rlvr": {"train_rows": 150}}, out="again"
    )
    assert again == rows  # same config, same rows
    other, _ = prep(
        tmp_path, {**a, "weight": 1}, {**b, "weight": 1}, mix={"rlvr": {"train_rows": 150}}, out="other"
    )
    assert by_source(other["train"]) == {"a": 75, "b": 75}


def test_shares_sum_to_the_size_by_largest_remainder():
    assert shares(10, {0: 1.0, 1: 1.0, 2: 1.0}) == {0: 4, 1: 3, 2: 3}
    assert sum(shares(133, {0: 1.0, 1: 3.0}).values()) == 133


@pytest.mark.parametrize(
    "weights,mix,words",
    [
        ((0, 1), None, "sources[0].weight is 0; it must be a positive number"),
        ((-2, 1), None, "sources[0].weight is -2"),
        (("x", 1), None, "sources[0].weight is 'x'"),
        ((1, None), None, "feeds rlvr without a weight, beside weighted sources[0]"),
        ((1, 1), {"rlvr": {"train_rows": 10_000}}, "at most"),
        ((None, None), {"rlvr": {"train_rows": 10}}, "no source feeding rlvr has a weight"),
    ],
)
def test_bad_mixtures_are_named(tmp_path, weights, mix, words):
    a, b = source_file(tmp_path, "a", 50), source_file(tmp_path, "b", 50)
    sources = [{**s, "weight": w} if w is not None else s for s, w in zip((a, b), weights, strict=True)]
    with pytest.raises(ConfigError) as info:
        prep(tmp_path, *sources, mix=mix)
    assert words in str(info.value)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_experiment_that_changes_one_weight_reruns_prep_with_the_new_proportions(tmp_path):
    """`dvc exp run -S prep.sources.1.weight=3`: DVC's Hydra composition reaches one source of a
    list by its index, and prep (whose params are the whole `prep` section) re-runs on it."""
    from tests.conftest import OFFLINE, commit_all, copy_repo

    root = copy_repo(tmp_path / "repo")
    (root / "data" / "sources").mkdir(parents=True)
    sources = [
        {
            **source_file(root / "data" / "sources", name, 200),
            "path": f"data/sources/{name}.jsonl",
            "weight": 1,
        }
        for name in ("a", "b")
    ]
    profile = root / "conf" / "profile" / "tiny.yaml"
    conf = yaml.safe_load(profile.read_text())
    conf["prep"]["sources"] = sources
    profile.write_text("# @package _global_\n" + yaml.safe_dump(conf, sort_keys=False))
    (root / "dvc.lock").unlink()  # its other outputs are not in this copy's cache
    commit_all(root)  # experiments run from a commit
    env = {**os.environ, **OFFLINE}

    def exp_run(*overrides: str) -> list[dict]:
        args = [a for o in overrides for a in ("-S", o)]
        proc = subprocess.run(
            ["dvc", "exp", "run", *args, "prep"], cwd=root, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        manifest = json.loads((root / "data" / "prepared" / "manifest.json").read_text())
        return list(manifest["mixtures"]["rlvr"]["sources"].values())

    a, b = exp_run()
    assert a["drawn"] == b["drawn"] == min(a["available"], b["available"])  # 1:1
    a, b = exp_run("prep.sources.1.weight=3")
    assert (a["weight"], b["weight"]) == (1, 3)
    assert b["drawn"] == b["available"] and a["drawn"] == round(b["available"] / 3)  # b is the limit now
