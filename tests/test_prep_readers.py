"""prep: file and Hugging Face sources in NeMo-RL's formats (real files, real outcomes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from alignpipe.artifacts import dvc_hash, md5_file
from alignpipe.data.prepare import prepare
from alignpipe.data.schema import SPLITS, row_id, single_turn

REPO = Path(__file__).resolve().parents[1]
FIX = "tests/fixtures/prep"
SPLIT = {"seed": 5, "validation_fraction": 0.0, "test_fraction": 0.0}  # everything in train


def asked(row: dict) -> str:
    """The text of a prepared row's prompt that is exactly one user turn (fails otherwise)."""
    text = single_turn(row["prompt"])
    assert text is not None, row["prompt"]
    return text


def run(tmp_path: Path, *sources: dict, split=SPLIT, root: Path = REPO) -> tuple[dict, dict]:
    out = tmp_path / "out"
    manifest = prepare({"split": split, "sources": list(sources)}, root, out)
    rows = {
        fam: [
            json.loads(line) for s in SPLITS for line in (out / fam / f"{s}.jsonl").read_text().splitlines()
        ]
        for fam in ("sft", "preference", "rlvr", "rlhf")
    }
    return rows, manifest


def test_jsonl_binary_preference_custom_keys_and_dedupe(tmp_path):
    src = {
        "kind": "jsonl",
        "path": f"{FIX}/pairs_custom_keys.jsonl",
        "format": "binary_preference",
        "family": "preference",
        "prompt_key": "question",
        "chosen_key": "good",
        "rejected_key": "bad",
    }
    rows, m = run(tmp_path, src)
    pref = {asked(r): r for r in rows["preference"]}
    assert set(pref) == {"What is 2+2?", "Capital of France?", "Spell cat backwards"}
    assert pref["What is 2+2?"]["chosen"] == "4" and pref["What is 2+2?"]["rejected"] == "5"
    assert pref["Spell cat backwards"]["task"] == "spelling"  # the row's own task
    assert pref["Capital of France?"]["task"] == "pairs_custom_keys"  # default: the file stem
    assert all(r["id"] == row_id("preference", r) for r in rows["preference"])
    assert m["duplicates_removed"] == {
        "total": 1,
        "by_family": {"sft": 0, "preference": 1, "rlvr": 0, "rlhf": 0},
    }
    entry = m["sources"][0]
    assert entry["path"] == src["path"] and entry["md5"] == md5_file(REPO / src["path"])
    assert entry["rows_read"] == 4 and entry["rows_kept"] == 4


def test_preference_dataset_lower_rank_is_chosen(tmp_path):
    rows, _ = run(
        tmp_path,
        {"kind": "jsonl", "path": f"{FIX}/ranked.jsonl", "format": "preference", "family": "preference"},
    )
    pref = {asked(r): r for r in rows["preference"]}
    assert pref["Say hi"]["chosen"] == "hello!" and pref["Say hi"]["rejected"] == "go away"
    assert pref["Count to 3"]["chosen"] == "1 2 3" and pref["Count to 3"]["rejected"] == "1 3 2"


def test_response_dataset_rlvr_with_verifiers(tmp_path):
    src = {
        "kind": "jsonl",
        "path": f"{FIX}/math_rlvr.jsonl",
        "format": "response",
        "family": "rlvr",
        "input_key": "problem",
        "output_key": "expected",
    }
    rows, _ = run(tmp_path, src)
    by = {asked(r): r for r in rows["rlvr"]}
    assert by["add:2+3"] == {**by["add:2+3"], "answer": "5", "verifier": "numeric"}
    assert "tests" not in by["add:2+3"]
    assert by["Write f(x) returning x+1"]["tests"] == ["assert f(1) == 2"]
    # The same file feeds SFT as user/assistant messages.
    rows, _ = run(tmp_path / "sft", {**src, "family": "sft"})
    assert {"role": "assistant", "content": "5"} in [r["messages"][1] for r in rows["sft"]]


def test_json_array_openai_messages_to_sft_and_rlhf(tmp_path):
    rows, _ = run(
        tmp_path, {"kind": "json", "path": f"{FIX}/chats.json", "format": "messages", "family": "sft"}
    )
    assert len(rows["sft"]) == 3
    colour = next(r for r in rows["sft"] if r["messages"][-1]["content"] == "red")
    assert [m["role"] for m in colour["messages"]] == ["system", "user", "assistant"]
    # rlhf keeps each conversation before the reply as its prompt, the system turn included.
    rows, m = run(
        tmp_path / "rlhf",
        {
            "kind": "json",
            "path": f"{FIX}/chats.json",
            "format": "messages",
            "family": "rlhf",
            "verifier": "exact",
            "on_invalid": "skip",
        },
    )
    by_answer = {r["answer"]: r["prompt"] for r in rows["rlhf"]}
    assert by_answer == {
        "hello": [{"role": "user", "content": "hi"}],
        "red": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}],
        "see you": [{"role": "user", "content": "bye"}],
    }
    assert m["rows_rejected"]["total"] == 0


def test_parquet_with_column_mapping(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.parquet"
    pq.write_table(
        pa.table({"q": ["p1", "p2", "p3"], "chosen": ["a", "b", "c"], "worse": ["x", "y", "z"]}), path
    )
    rows, m = run(
        tmp_path,
        {
            "kind": "parquet",
            "path": str(path),
            "format": "binary_preference",
            "family": "preference",
            "columns": {"q": "prompt"},
            "rejected_key": "worse",
        },
    )
    assert sorted((asked(r), r["chosen"], r["rejected"]) for r in rows["preference"]) == [
        ("p1", "a", "x"),
        ("p2", "b", "y"),
        ("p3", "c", "z"),
    ]
    assert m["sources"][0]["md5"] == md5_file(path)


def test_hf_save_to_disk_dir_and_local_json_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"question": ["add:1+1", "add:2+2"], "solution": ["2", "4"]}),
            "test": datasets.Dataset.from_dict({"question": ["add:3+3"], "solution": ["6"]}),
        }
    )
    saved = tmp_path / "saved"
    ds.save_to_disk(str(saved))
    rows, m = run(
        tmp_path / "a",
        {
            "kind": "hf",
            "name": str(saved),
            "split": "train",
            "format": "response",
            "family": "rlvr",
            "columns": {"question": "input", "solution": "output"},
            "verifier": "numeric",
            "task": "add",
        },
    )
    assert sorted((asked(r), r["answer"], r["task"]) for r in rows["rlvr"]) == [
        ("add:1+1", "2", "add"),
        ("add:2+2", "4", "add"),
    ]
    assert m["sources"][0]["md5"] == dvc_hash(saved) and m["sources"][0]["split"] == "train"

    # A local data directory through datasets.load_dataset (no hub), relative to the repo root.
    root = tmp_path / "repo"
    (root / "hfdir").mkdir(parents=True)
    shutil.copy(REPO / FIX / "ranked.jsonl", root / "hfdir" / "train.jsonl")
    rows, _ = run(
        tmp_path / "b",
        {"kind": "hf", "name": "hfdir", "format": "preference", "family": "preference"},
        root=root,
    )
    assert {r["chosen"] for r in rows["preference"]} == {"hello!", "1 2 3"}


def test_sources_combine_and_share_the_split(tmp_path):
    split = {"seed": 5, "validation_fraction": 0.3, "test_fraction": 0.3}
    src = {
        "kind": "jsonl",
        "path": f"{FIX}/math_rlvr.jsonl",
        "format": "response",
        "input_key": "problem",
        "output_key": "expected",
    }
    rows, _ = run(tmp_path, {**src, "family": "rlvr"}, {**src, "family": "sft"}, split=split)
    out = tmp_path / "out"
    for fam, key in (("rlvr", asked), ("sft", lambda r: r["messages"][0]["content"])):
        for s in SPLITS:
            for line in (out / fam / f"{s}.jsonl").read_text().splitlines():
                r = json.loads(line)
                from alignpipe.data.split import SplitSpec

                assert SplitSpec(5, 0.3, 0.3).assign(key(r)) == s
