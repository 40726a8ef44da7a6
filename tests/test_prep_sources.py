"""prep input guarantees (issue 13, items 4-7): no held-out prompt in any train split, gold answers
the verifier can read, empty and sharded sources, UltraFeedback and HelpSteer3 preference rows."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from alignpipe.data.prepare import check_heldout_leaks, prepare
from alignpipe.data.schema import SPLITS, canonical_json, row_id, single_turn
from alignpipe.data.split import SplitSpec, normalize_prompt
from alignpipe.errors import DataError
from tests.test_prep_cli import cli
from tests.test_prep_validation import FIX, mini_repo, write_config

FIXREL = "tests/fixtures/prep"
REPO = Path(__file__).resolve().parents[1]
ALL_TRAIN = {"seed": 5, "validation_fraction": 0.0, "test_fraction": 0.0}


def run(tmp_path: Path, *sources: dict, split=ALL_TRAIN, root: Path = REPO) -> tuple[dict, dict]:
    out = tmp_path / "out"
    manifest = prepare({"split": split, "sources": list(sources)}, root, out)
    rows = {
        fam: {s: [json.loads(x) for x in (out / fam / f"{s}.jsonl").read_text().splitlines()] for s in SPLITS}
        for fam in ("sft", "preference", "rlvr", "rlhf")
    }
    return rows, manifest


def flat(rows: dict, fam: str) -> list[dict]:
    return [r for s in SPLITS for r in rows[fam][s]]


def asked(row: dict) -> str:
    """The text of a prepared row's prompt that is exactly one user turn (fails otherwise)."""
    text = single_turn(row["prompt"])
    assert text is not None, row["prompt"]
    return text


def fix(name: str, fmt: str, family: str, **kw) -> dict:
    return {"kind": "jsonl", "path": f"{FIXREL}/{name}", "format": fmt, "family": family, **kw}


# --------------------------------------------------------------------------- item 4: leaks


def test_sft_with_system_turn_splits_like_rlvr_with_the_same_prompts(tmp_path):
    split = {"seed": 3, "validation_fraction": 0.3, "test_fraction": 0.3}
    rows, _ = run(
        tmp_path,
        fix("sft_system_chats.jsonl", "messages", "sft"),
        fix("rlvr_same_prompts.jsonl", "response", "rlvr", input_key="prompt", output_key="answer"),
        split=split,
    )
    user = {s: {r["messages"][1]["content"] for r in rows["sft"][s]} for s in SPLITS}
    prompts = {s: {asked(r) for r in rows["rlvr"][s]} for s in SPLITS}
    assert all(r["messages"][0]["role"] == "system" for r in flat(rows, "sft"))
    assert len(prompts["test"]) >= 5 and len(prompts["validation"]) >= 5
    assert user == prompts  # every prompt in the same split in both families
    assert not (prompts["test"] | prompts["validation"]) & user["train"]


def test_heldout_leak_check_names_both_rows_and_the_prompt():
    # The rlvr row's own system turn does not hide the user turn it shares with the sft row.
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    row = {"id": "x", "task": "t", "prompt": prompt, "answer": "4", "verifier": "numeric"}
    sft = {"id": "y", "task": "t", "messages": [{"role": "user", "content": "what is  2+2? "}]}
    splits = {
        "rlvr": {"train": [], "validation": [], "test": [(row, "data/q.jsonl:7", 0)]},
        "sft": {"train": [(sft, "data/chats.jsonl:3", 1)], "validation": [], "test": []},
    }
    with pytest.raises(DataError) as info:
        check_heldout_leaks(splits)
    text = str(info.value)
    assert "1 held-out prompt(s) also in a train split" in text
    assert "sft/train (data/chats.jsonl:3) and rlvr/test (data/q.jsonl:7): 'what is  2+2? '" in text
    splits["sft"]["train"] = []
    check_heldout_leaks(splits)  # nothing shared: passes


# --------------------------------------------------------------------------- item 5: gold answers


def test_gsm8k_answer_format_keeps_the_final_answer(tmp_path):
    src = fix(
        "gsm8k.jsonl", "response", "rlvr", input_key="question", output_key="answer", answer_format="gsm8k"
    )
    rows, m = run(tmp_path, {**src, "verifier": "math"})
    golds = {asked(r)[:12]: r["answer"] for r in flat(rows, "rlvr")}
    assert golds == {"Natalia sold": "72", "Weng earns $": "10", "Betty needs ": "5"}
    assert m["sources"][0]["rows_kept"] == 3
    rows, _ = run(tmp_path / "sft", {**src, "family": "sft"})
    assert sorted(r["messages"][1]["content"] for r in flat(rows, "sft")) == ["10", "5", "72"]


def test_math_gold_math_verify_cannot_parse_is_an_input_error(tmp_path):
    src = fix("gsm8k.jsonl", "response", "rlvr", input_key="question", output_key="answer", verifier="math")
    with pytest.raises(DataError) as info:
        run(tmp_path, src)
    err = info.value
    assert (err.path, err.line, err.field) == (src["path"], 1, "answer")
    assert "math-verify can parse" in err.problem and "answer_format: gsm8k" in err.fix
    # on_invalid: skip drops and counts every such row
    _, m = run(tmp_path / "skip", {**src, "on_invalid": "skip"})
    assert m["rows_rejected"]["total"] == 3 and m["sources"][0]["rows_kept"] == 0


def test_gold_check_off_the_main_thread_runs_in_a_worker():
    import threading

    from alignpipe.rewards.math_verify_pool import golds_parse

    worked = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert golds_parse(["72", worked, "\\frac{1}{2}"]) == [True, False, True]  # main thread: in process
    out: list = []
    t = threading.Thread(target=lambda: out.append(golds_parse(["72", worked])))
    t.start()
    t.join()
    assert out == [[True, False]]


def test_gsm8k_row_without_marker_names_its_line(tmp_path):
    src = fix(
        "gsm8k_no_marker.jsonl",
        "response",
        "rlvr",
        input_key="question",
        output_key="answer",
        answer_format="gsm8k",
        verifier="numeric",
    )
    with pytest.raises(DataError) as info:
        run(tmp_path, src)
    assert (info.value.line, info.value.field) == (2, "answer") and "####" in info.value.problem


def _upstream_function(src_root: Path, rel: str, name: str, **names):
    """One function of NeMo-RL's own source, compiled on its own (its package imports need GPUs' deps)."""
    tree = ast.parse((src_root / rel).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    scope: dict = dict(names)
    exec(compile(ast.Module([node], []), str(src_root / rel), "exec"), scope)  # noqa: S102
    return scope[name]


def test_gsm8k_matches_nemo_rl_extraction(nemo_rl_src, tmp_path):
    extract = _upstream_function(
        nemo_rl_src, "nemo_rl/data/datasets/response_datasets/gsm8k.py", "_extract_hash_answer"
    )
    src = fix("gsm8k.jsonl", "response", "rlvr", input_key="question", output_key="answer")
    rows, _ = run(tmp_path, {**src, "answer_format": "gsm8k", "verifier": "numeric"})
    ours = {asked(r): r["answer"] for r in flat(rows, "rlvr")}
    for line in (REPO / src["path"]).read_text().splitlines():
        rec = json.loads(line)
        assert ours[rec["question"]] == extract(rec["answer"])


# --------------------------------------------------------------------------- item 6: empty, shards


def test_directory_of_shards_is_one_source_in_sorted_order(tmp_path):
    src = fix("shards", "binary_preference", "preference")
    rows, m = run(tmp_path, src)
    assert sorted(asked(r) for r in flat(rows, "preference")) == ["p1", "p2", "p3", "p4"]
    entry = m["sources"][0]
    assert entry["shards"] == ["part-00000.jsonl", "part-00001.jsonl"] and entry["md5"].endswith(".dir")
    assert entry["rows_read"] == 4 and entry["path"] == src["path"]
    # A bad record is named by its shard and line.
    shards = tmp_path / "shards"
    shutil.copytree(REPO / src["path"], shards)
    (shards / "part-00001.jsonl").write_text(
        '{"prompt": "p5", "chosen": "a", "rejected": "b"}\n{"prompt": "p6"}\n'
    )
    with pytest.raises(DataError) as info:
        run(tmp_path / "bad", {**src, "path": str(shards)})
    assert str(info.value).startswith(f"{shards}/part-00001.jsonl:2: field 'chosen' is missing")


def test_shard_directory_errors(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    (d / "b.parquet").write_bytes(b"PAR1")
    src = {"kind": "jsonl", "path": str(d), "format": "binary_preference", "family": "preference"}
    with pytest.raises(DataError, match="mixes shard formats \\(jsonl, parquet\\)"):
        run(tmp_path, src)
    (d / "b.parquet").unlink()
    (d / "a.jsonl").unlink()
    (d / "README.md").write_text("no data")
    with pytest.raises(DataError) as info:
        run(tmp_path, src)
    assert info.value.path == str(d) and "no .jsonl, .json or .parquet shards (found: README.md)" in str(
        info.value
    )
    (d / "a.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(DataError, match="holds jsonl shards but the source says kind: parquet"):
        run(tmp_path, {**src, "kind": "parquet"})
    (d / ".cache").mkdir()  # hidden files (e.g. huggingface_hub's .cache/) are not shards
    (d / ".cache" / "x.parquet").write_bytes(b"PAR1")
    _, m = run(tmp_path / "hidden", src)
    assert m["sources"][0]["shards"] == ["a.jsonl"]


# --------------------------------------------------------------------------- item 7: preference shapes


def test_ultrafeedback_rows(tmp_path):
    rows, _ = run(tmp_path, fix("ultrafeedback.jsonl", "ultrafeedback", "preference"))
    got = sorted((asked(r), r["chosen"], r["rejected"]) for r in flat(rows, "preference"))
    assert got == [("Name a primary colour.", "Red.", "Green."), ("What is 2+2?", "4", "5")]
    with pytest.raises(DataError) as info:
        run(tmp_path / "bad", fix("ultrafeedback_mismatch.jsonl", "ultrafeedback", "preference"))
    assert (info.value.line, info.value.field) == (2, "rejected") and "other turns" in info.value.problem
    # binary_preference on these rows points at the right format
    with pytest.raises(DataError, match="use format: ultrafeedback"):
        run(tmp_path / "hint", fix("ultrafeedback.jsonl", "binary_preference", "preference"))


def test_helpsteer3_preference_sign_and_ties(tmp_path):
    rows, m = run(tmp_path, fix("helpsteer3.jsonl", "helpsteer3", "preference"))
    pref = {asked(r): (r["chosen"], r["rejected"]) for r in flat(rows, "preference")}
    assert pref == {
        "Suggest a name for a cat.": ("Whiskers.", "Dog."),  # -2: response1 preferred
        "Reverse 'abc' in Python.": ("'abc'[::-1]", "'abc'[0]"),  # 3: response2
        "Spell 'cat' backwards.": ("tac", "act"),  # 1, string context
    }
    assert m["sources"][0]["ties_dropped"] == 1 and m["sources"][0]["rows_read"] == 4
    assert m["ties_dropped"] == {"total": 1, "by_family": {"sft": 0, "preference": 1, "rlvr": 0, "rlhf": 0}}
    with pytest.raises(DataError) as info:
        run(tmp_path / "bad", fix("helpsteer3_out_of_range.jsonl", "helpsteer3", "preference"))
    assert (info.value.line, info.value.field) == (2, "overall_preference") and "-3..3" in info.value.problem


def test_preference_shapes_match_nemo_rl_dataset_classes(nemo_rl_src, tmp_path):
    from absl import logging

    base = "nemo_rl/data/datasets/preference_datasets"
    for name, fmt, rel in (
        ("helpsteer3.jsonl", "helpsteer3", f"{base}/helpsteer3.py"),
        ("ultrafeedback.jsonl", "ultrafeedback", f"{base}/tulu3.py"),
    ):
        upstream = _upstream_function(nemo_rl_src, rel, "format_data", logging=logging, json=json, Any=object)
        rows, _ = run(tmp_path / fmt, fix(name, fmt, "preference"))
        # Keyed by the whole conversation: our prompt is upstream's context, message for message.
        ours = {canonical_json(r["prompt"]): (r["chosen"], r["rejected"]) for r in flat(rows, "preference")}
        for line in (FIX / name).read_text().splitlines():
            up = upstream(SimpleNamespace(task_name=fmt), json.loads(line))
            chosen, rejected = (c["completion"][0]["content"] for c in up["completions"])
            prompt = canonical_json(up["context"])
            if chosen == rejected:  # upstream keeps a tie as chosen == rejected; we drop it
                assert prompt not in ours
            else:
                assert ours[prompt] == (chosen, rejected)


def test_nemo_rl_reward_model_example_keeps_its_conversation(tmp_path):
    """NeMo-RL's RM data shape (a user, assistant, user context and two ranked completions;
    one with a system turn) prepares into the preference family with the context intact, and
    its id differs from the same last question asked alone."""
    rows, manifest = run(tmp_path, fix("nemo_rl_rm_example.jsonl", "preference", "preference"))
    records = [json.loads(x) for x in (FIX / "nemo_rl_rm_example.jsonl").read_text().splitlines()]
    ours = {canonical_json(r["prompt"]): r for r in flat(rows, "preference")}
    assert len(ours) == 2 and manifest["sources"][0]["rows_kept"] == 2
    for rec in records:
        row = ours[canonical_json(rec["context"])]  # the whole context, message for message
        (chosen,), (rejected,) = (
            c["completion"] for c in sorted(rec["completions"], key=lambda c: c["rank"])
        )
        assert (row["chosen"], row["rejected"]) == (chosen["content"], rejected["content"])
    multi = ours[canonical_json(records[0]["context"])]
    assert [m["role"] for m in multi["prompt"]] == ["user", "assistant", "user"]
    alone = {**multi, "prompt": [multi["prompt"][-1]]}
    assert multi["id"] != row_id("preference", alone)
    # a one-user-turn prompt keeps the id it had as a string
    assert row_id("preference", alone) == row_id(
        "preference", {**alone, "prompt": multi["prompt"][-1]["content"]}
    )


# --------------------------------------------------------------------------- the CLI


def test_cli_names_empty_and_unparsable_sources_and_prints_ties(tmp_path):
    root = mini_repo(tmp_path)
    sources = root / "data" / "sources"

    def prep(*srcs):
        write_config(root, *srcs)
        return cli(root, "run", "prep")

    def at(name, fmt, family, **kw):
        return {"kind": "jsonl", "path": f"data/sources/{name}", "format": fmt, "family": family, **kw}

    proc = prep(at("empty.jsonl", "binary_preference", "preference"))
    assert proc.returncode == 2 and "data/sources/empty.jsonl: holds no records" in proc.stderr, proc.stderr
    (sources / "nothing").mkdir()
    proc = prep({**at("nothing", "binary_preference", "preference")})
    assert proc.returncode == 2 and "data/sources/nothing: is a directory with no .jsonl" in proc.stderr
    gsm = at("gsm8k.jsonl", "response", "rlvr", input_key="question", output_key="answer", verifier="math")
    proc = prep(gsm)
    assert proc.returncode == 2 and "data/sources/gsm8k.jsonl:1: field 'answer' gold answer" in proc.stderr
    assert "set answer_format: gsm8k" in proc.stderr and "Traceback" not in proc.stderr
    proc = prep({**gsm, "answer_format": "gsm8k"}, at("helpsteer3.jsonl", "helpsteer3", "preference"))
    assert proc.returncode == 0, proc.stderr
    assert "1 preference tie(s) dropped" in proc.stdout
    manifest = json.loads((root / "data" / "prepared" / "manifest.json").read_text())
    assert manifest["ties_dropped"]["total"] == 1
    answers = {
        json.loads(x)["answer"]
        for s in SPLITS
        for x in (root / "data" / "prepared" / "rlvr" / f"{s}.jsonl").read_text().splitlines()
    }
    assert {"72", "10", "5"} <= answers
    assert yaml.safe_load((root / "data" / "prepared" / "resolved_config.yaml").read_text())["sources"][
        1
    ] == {
        **gsm,
        "answer_format": "gsm8k",
    }


def test_split_key_is_the_normalised_user_turns():
    spec = SplitSpec(1, 0.3, 0.3)
    from alignpipe.data.schema import prompt_of

    row = {
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": " Hi  there "}]
    }
    assert normalize_prompt(prompt_of("sft", row)) == normalize_prompt(
        prompt_of("rlvr", {"prompt": [{"role": "user", "content": "hi there"}]})
    )
    assert spec.assign(prompt_of("sft", row)) == spec.assign("hi there")
