"""prep: every validation failure names file, line and field, and publishes nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from alignpipe.artifacts import dvc_hash
from alignpipe.errors import DataError
from alignpipe.stage import run_stage

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "prep"
SMALL = {"sft": {"train": 20, "validation": 3, "test": 3}, "rlvr": {"train": 20, "validation": 3, "test": 3}}


def mini_repo(tmp_path: Path) -> Path:
    """A repo laid out like this one, with just what the prep stage reads."""
    root = tmp_path / "repo"
    (root / "stages" / "prep" / "config").mkdir(parents=True)
    shutil.copy(REPO / "stages" / "prep" / "stage.toml", root / "stages" / "prep" / "stage.toml")
    shutil.copytree(FIX, root / "data" / "sources")
    (root / "dvc.yaml").write_text("stages: {}\n")
    (root / "params.yaml").write_text("profile: tiny\nseed: 42\n")
    return root


def write_config(root: Path, *sources: dict) -> None:
    cfg = {
        "split": {"seed": 1, "validation_fraction": 0.1, "test_fraction": 0.1},
        "builtin": {"seed": 1, "counts": SMALL},
        "sources": [{"kind": "builtin"}, *sources],
    }
    (root / "stages" / "prep" / "config" / "tiny.yaml").write_text(yaml.safe_dump(cfg))


@pytest.fixture
def repo(tmp_path) -> Path:
    root = mini_repo(tmp_path)
    write_config(root)
    run_stage(root, "prep")  # a good, previously published data/prepared
    return root


def src(
    name: str, fmt: str = "binary_preference", family: str = "preference", kind: str = "jsonl", **kw
) -> dict:
    return {"kind": kind, "path": f"data/sources/{name}", "format": fmt, "family": family, **kw}


CASES = [
    # (source, line, field, words in the message)
    (src("bad_json.jsonl"), 3, None, "invalid JSON"),
    (src("bad_utf8.jsonl"), 2, None, "invalid UTF-8"),
    (src("pairs_missing_field.jsonl"), 4, "rejected", "is missing"),
    (src("pairs_same.jsonl"), 3, "rejected", "identical to the chosen"),
    (src("pairs_wrong_type.json", kind="json"), 3, "chosen", "must be a string"),
    (src("ranked_tie.jsonl", fmt="preference"), 1, "completions[1].rank", "ties rank"),
    (
        src("rlvr_unknown_verifier.jsonl", fmt="response", family="rlvr"),
        2,
        "verifier",
        "unknown verifier 'fuzzy'",
    ),
    (src("rlvr_code_no_tests.jsonl", fmt="response", family="rlvr"), 2, "tests", "needs tests"),
    (src("math_rlvr.jsonl", fmt="response", family="rlhf"), 1, "input", "is missing"),
    # A prompt is the conversation before the reply: a system turn only first, a user turn last.
    (
        src("chats_late_system.jsonl", fmt="messages", family="rlvr", verifier="exact"),
        2,
        "messages[1].role",
        "a system turn can only be the first message",
    ),
    (
        src("pairs_context_ends_with_reply.jsonl"),
        2,
        "prompt[1].role",
        "the prompt must end with a user turn, found 'assistant'",
    ),
    (
        src(
            "pairs_custom_keys.jsonl", fmt="response", family="rlvr", input_key="question", output_key="good"
        ),
        1,
        "verifier",
        "need a verifier",
    ),
    (
        src(
            "pairs_custom_keys.jsonl",
            fmt="response",
            family="rlvr",
            input_key="question",
            output_key="bad",
            verifier="numeric",
        ),
        2,
        "bad",
        "not a number",
    ),
]


@pytest.mark.parametrize(
    "source,line,field,words", CASES, ids=[c[0]["path"].split("/")[-1] + f":{c[1]}" for c in CASES]
)
def test_error_names_file_line_field_and_leaves_prepared_untouched(repo, source, line, field, words):
    before = dvc_hash(repo / "data" / "prepared")
    write_config(repo, source)
    with pytest.raises(DataError) as info:
        run_stage(repo, "prep")
    err = info.value
    assert err.path == source["path"] and err.line == line and err.field == field, str(err)
    assert words in err.problem and err.fix
    text = str(err)
    assert text.startswith(f"{source['path']}:{line}:") and "fix:" in text
    assert dvc_hash(repo / "data" / "prepared") == before
    assert sorted(p.name for p in (repo / "data").iterdir()) == ["prepared", "sources"]  # no staging left


def test_skip_mode_counts_rejected_rows(repo):
    write_config(
        repo, src("pairs_missing_field.jsonl", on_invalid="skip"), src("bad_json.jsonl", on_invalid="skip")
    )
    run_stage(repo, "prep")
    import json

    m = json.loads((repo / "data" / "prepared" / "manifest.json").read_text())
    assert m["rows_rejected"]["total"] == 2 and m["rows_rejected"]["by_family"]["preference"] == 2
    assert any("pairs_missing_field.jsonl:4: field 'rejected'" in e for e in m["rows_rejected"]["examples"])
    # a, b, c from the first file; a, b of bad_json.jsonl are the same pairs (other task label): duplicates.
    assert sum(m["counts"]["preference"].values()) == 3
    assert m["duplicates_removed"]["by_family"]["preference"] == 2
