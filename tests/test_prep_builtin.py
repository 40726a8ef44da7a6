"""prep: the builtin tiny task generator and the content-keyed split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignpipe.data import builtin
from alignpipe.data.prepare import prepare
from alignpipe.data.schema import FAMILIES, SCHEMA, SPLITS, prompt_of, row_id, single_turn
from alignpipe.data.split import SplitSpec, normalize_prompt, split_spec
from alignpipe.errors import ConfigError

COUNTS = {
    "sft": {"train": 400, "validation": 30, "test": 30},
    "preference": {"train": 300, "validation": 20, "test": 20},
    "rlvr": {"train": 200, "validation": 20, "test": 40},
    "rlhf": {"train": 200, "validation": 15, "test": 15},
}


def config(seed: int = 7, split_seed: int = 11, counts=COUNTS, **split) -> dict:
    return {
        "split": {"seed": split_seed, "validation_fraction": 0.05, "test_fraction": 0.05, **split},
        "builtin": {"seed": seed, "counts": counts},
        "sources": [{"kind": "builtin"}],
    }


def read_all(out: Path) -> dict[str, dict[str, list[dict]]]:
    return {
        f: {
            s: [json.loads(line) for line in (out / f / f"{s}.jsonl").read_text().splitlines()]
            for s in SPLITS
        }
        for f in FAMILIES
    }


def asked(row: dict) -> str:
    """The text of a builtin row's prompt, which is always exactly one user turn."""
    text = single_turn(row["prompt"])
    assert text is not None, row["prompt"]
    return text


def file_bytes(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare(config(), Path.cwd(), out)
    return out


def test_same_seed_same_bytes_different_seed_different(prepared, tmp_path):
    again = tmp_path / "again"
    prepare(config(), Path.cwd(), again)
    assert file_bytes(again) == file_bytes(prepared)  # data files and manifest.json, byte for byte

    other = tmp_path / "other"
    prepare(config(seed=8), Path.cwd(), other)
    for fam in FAMILIES:
        assert (other / fam / "train.jsonl").read_bytes() != (prepared / fam / "train.jsonl").read_bytes()
    resplit = tmp_path / "resplit"
    prepare(config(split_seed=12), Path.cwd(), resplit)
    assert (resplit / "rlvr" / "test.jsonl").read_bytes() != (prepared / "rlvr" / "test.jsonl").read_bytes()


def test_counts_and_shapes(prepared):
    data = read_all(prepared)
    for fam in FAMILIES:
        for s in SPLITS:
            assert len(data[fam][s]) == COUNTS[fam][s], (fam, s)
            for row in data[fam][s]:
                assert list(row)[:2] == ["id", "task"]
                assert set(row) == set(SCHEMA[fam]) - {"tests", "extract", "tools"}  # optional fields
                assert row["id"] == row_id(fam, row)
                assert row["task"] in builtin.TASKS
                if "prompt" in row:  # written as messages: one user turn, nothing else
                    assert row["prompt"] == [{"role": "user", "content": asked(row)}]
    tasks = {r["task"] for r in data["sft"]["train"]}
    assert tasks == {"sort", "reverse", "add"}
    for row in data["sft"]["train"]:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert user["content"].startswith(row["task"] + ":")
        assert assistant["content"] == builtin.solve(user["content"])
    for fam in ("rlvr", "rlhf"):
        for row in data[fam]["train"] + data[fam]["test"]:
            assert row["answer"] == builtin.solve(asked(row))
            assert row["verifier"] == ("numeric" if row["task"] == "add" else "exact")


def test_boxed_style_asks_in_words_and_answers_in_a_box(tmp_path):
    """style: boxed (the small profile): worded prompts, boxed targets, rows the verifier reads boxed."""
    from alignpipe.rewards import score_completion

    cfg = config()
    cfg["builtin"]["style"] = "boxed"
    out = tmp_path / "prepared"
    prepare(cfg, Path.cwd(), out)
    data = read_all(out)
    for fam in FAMILIES:  # the requested counts hold: the split keys on the prompt as shown
        assert {s: len(data[fam][s]) for s in SPLITS} == COUNTS[fam]
    rl = data["rlvr"]["test"][0]
    assert asked(rl).endswith("Put the final answer in \\boxed{}.") and rl["extract"] == "boxed"
    assert (
        score_completion(rl, f"\\boxed{{{rl['answer']}}}") == 1.0
        and score_completion(rl, rl["answer"]) == 0.0
    )
    sft = data["sft"]["train"][0]["messages"]
    assert sft[1]["content"].startswith("\\boxed{") and "\\boxed{}" in sft[0]["content"]
    pair = data["preference"]["train"][0]
    assert pair["chosen"].startswith("\\boxed{") and pair["rejected"].startswith("\\boxed{")
    assert pair["chosen"] != pair["rejected"]
    worded = {asked(r).split(" of ")[0].split()[0] for r in data["rlvr"]["train"]}
    assert worded == {"Sort", "Write", "What"}


def test_an_unknown_style_is_named():
    with pytest.raises(ConfigError, match="builtin.style 'latex' is not one of plain, boxed"):
        builtin.builtin_spec({"kind": "builtin"}, {"style": "latex"})


def test_task_shapes_exact():
    assert builtin.solve("sort:52813") == "12358"
    assert builtin.solve("reverse:5281") == "1825"
    assert builtin.solve("add:37+48") == "85"


def test_digit_lengths_respected(prepared):
    for row in read_all(prepared)["rlvr"]["train"]:
        task, _, arg = asked(row).partition(":")
        if task in ("sort", "reverse"):
            assert arg.isdigit() and 3 <= len(arg) <= 6
        else:
            a, b = arg.split("+")
            assert 1 <= len(a) <= 3 and 1 <= len(b) <= 3 and str(int(a)) == a and str(int(b)) == b


def test_splits_disjoint_across_families(prepared):
    data = read_all(prepared)
    where: dict[str, set[str]] = {}
    for fam in FAMILIES:
        for s in SPLITS:
            for row in data[fam][s]:
                where.setdefault(normalize_prompt(prompt_of(fam, row)), set()).add(s)
    assert all(len(splits) == 1 for splits in where.values())
    heldout = {asked(r) for r in data["rlvr"]["test"]}
    for fam in FAMILIES:
        train_prompts = {prompt_of(fam, r) for r in data[fam]["train"]}
        assert not heldout & train_prompts, fam


def test_no_duplicate_prompts_within_a_family(prepared):
    data = read_all(prepared)
    for fam in FAMILIES:
        prompts = [prompt_of(fam, r) for s in SPLITS for r in data[fam][s]]
        assert len(prompts) == len(set(prompts))


def test_rejected_is_plausible_and_wrong(prepared):
    rows = [r for s in SPLITS for r in read_all(prepared)["preference"][s]]
    kinds = set()
    for row in rows:
        chosen, rejected = row["chosen"], row["rejected"]
        assert chosen == builtin.solve(asked(row))
        assert rejected != chosen and rejected.isdigit()
        assert abs(len(rejected) - len(chosen)) <= 1
        if row["task"] == "add":
            assert rejected == "0" or not rejected.startswith("0")
            assert int(rejected) != int(chosen)
        if len(rejected) != len(chosen):
            kinds.add("length")
        elif sorted(rejected) == sorted(chosen):
            kinds.add("order")
        else:
            kinds.add("digit")
    assert kinds == {"length", "order", "digit"}


@pytest.mark.parametrize("answer", ["0", "7", "111", "10", "100", "99999", "1255"])
def test_corrupt_always_differs(answer):
    import random

    rng = random.Random(0)
    for _ in range(200):
        bad = builtin.corrupt(answer, rng, numeric=True)
        assert bad != answer and abs(len(bad) - len(answer)) <= 1
        assert len(bad) == 1 or bad[0] != "0"


def test_split_is_content_keyed():
    spec = SplitSpec(seed=3, validation_fraction=0.1, test_fraction=0.1)
    assert spec.assign("sort:123") == spec.assign("  SORT:123 ")
    picks = [spec.assign(f"sort:{i}") for i in range(20000)]
    assert 0.08 < picks.count("test") / len(picks) < 0.12
    assert 0.08 < picks.count("validation") / len(picks) < 0.12


def test_manifest(prepared):
    from alignpipe.artifacts import md5_file

    m = json.loads((prepared / "manifest.json").read_text())
    assert m["counts"] == COUNTS
    assert m["split"]["seed"] == 11 and m["split"]["test_fraction"] == 0.05
    assert m["schema"]["rlvr"]["verifier"].startswith("str")
    assert m["duplicates_removed"]["total"] == 0 and m["rows_rejected"]["total"] == 0
    assert m["sources"][0]["kind"] == "builtin" and m["sources"][0]["seed"] == 7
    for rel, info in m["files"].items():
        assert info["md5"] == md5_file(prepared / rel)
        assert info["rows"] == len((prepared / rel).read_text().splitlines())


def test_config_errors():
    with pytest.raises(ConfigError, match="validation_fraction \\+ test_fraction"):
        split_spec({"seed": 1, "validation_fraction": 0.5, "test_fraction": 0.5})
    with pytest.raises(ConfigError, match="test_fraction is 0"):
        prepare(config(test_fraction=0.0), Path.cwd(), Path("/nonexistent"))
    bad = config()
    bad["builtin"]["counts"] = {"dpo": {"train": 1}}
    with pytest.raises(ConfigError, match="unknown family 'dpo'"):
        prepare(bad, Path.cwd(), Path("/nonexistent"))
    with pytest.raises(ConfigError, match="kind 'csv' is unknown"):
        prepare({"sources": [{"kind": "csv"}]}, Path.cwd(), Path("/nonexistent"))


def test_degenerate_negatives_mix_in_off_distribution_rejections(tmp_path):
    """With builtin.degenerate_negatives, some rejected answers are digit runs or prompt echoes."""
    cfg = config()
    cfg["builtin"]["degenerate_negatives"] = 0.5
    out = tmp_path / "out"
    prepare(cfg, Path.cwd(), out)
    rows = read_all(out)["preference"]["train"]
    degenerate = [
        r
        for r in rows
        if len(set(r["rejected"])) == 1
        or r["rejected"] == "".join(c for c in asked(r).split(":")[1] if c.isdigit())
    ]
    assert 0.3 < len(degenerate) / len(rows) < 0.75
    assert all(r["rejected"] != r["chosen"] for r in rows)


def test_degenerate_answer_never_equals_the_answer():
    rng = __import__("random").Random(0)
    for answer, prompt in [("111", "sort:111"), ("5", "add:2+3"), ("1234", "reverse:4321")]:
        for _ in range(200):
            assert builtin.degenerate(answer, prompt, rng) != answer


@pytest.mark.parametrize("style", ["plain", "boxed"])
def test_chat_rows_are_conversations_answered_by_their_last_question(tmp_path, style):
    """The ``chat`` task: a system turn, an earlier exchange answered correctly, then a
    question; every family carries the conversation, the answer is the last question's, and
    the split is keyed by the user turns (the system turn and the reply do not move it)."""
    cfg = config(counts={f: {"train": 40, "validation": 0, "test": 10} for f in FAMILIES})
    cfg["builtin"]["style"] = style
    cfg["builtin"]["tasks"] = {"sort": {"weight": 1}, "chat": {"weight": 1}}
    prepare(cfg, Path.cwd(), tmp_path)
    rows = read_all(tmp_path)
    chats = 0
    for fam in FAMILIES:
        for s in SPLITS:
            for row in rows[fam][s]:
                if row["task"] != "chat":
                    continue
                chats += 1
                turns = row["messages"][:-1] if fam == "sft" else row["prompt"]
                assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"], turns
                assert turns[0]["content"] == builtin.CHAT_SYSTEM[style]
                earlier, question = turns[1]["content"], turns[3]["content"]
                if style == "plain":
                    assert turns[2]["content"] == builtin.solve(earlier)  # the exchange is right
                    given = (
                        row["messages"][-1]["content"]
                        if fam == "sft"
                        else row.get("answer", row.get("chosen"))
                    )
                    assert given == builtin.solve(question)
                else:
                    assert "\\boxed{" in turns[2]["content"] and builtin.BOX_INSTRUCTION.strip() in question
                assert prompt_of(fam, row) == f"{earlier}\n{question}"
                assert row["id"] == row_id(fam, row)
    assert chats > 20


def test_calc_rows_call_the_calculator_and_every_row_offers_it(tmp_path):
    """The tools preset's data (builtin.tools, task calc): sft's calc rows call the calculator on
    the prompt's sum, read its value from a tool turn and answer it; every sft and rl row offers
    the calculator; preference rows offer nothing (they stay tool-free). The calculator's own
    value is the row's answer."""
    from alignpipe.tools import build_toolset
    from alignpipe.tools.calls import ToolCall

    cfg = config(counts={f: {"train": 30, "validation": 0, "test": 10} for f in FAMILIES})
    cfg["builtin"]["tasks"] = {"sort": {"weight": 1}, "calc": {"weight": 1}}
    cfg["builtin"]["tools"] = ["calculator"]
    prepare(cfg, Path.cwd(), tmp_path)
    rows = read_all(tmp_path)
    calculator = build_toolset({"tools": ["calculator"]})
    calcs = 0
    for fam in FAMILIES:
        for row in (r for s in SPLITS for r in rows[fam][s]):
            assert ("tools" in row) == (fam != "preference"), (fam, row)
            if row["task"] != "calc" or fam != "sft":
                continue
            calcs += 1
            user, call, tool, answer = row["messages"]
            assert [t["role"] for t in row["messages"]] == ["user", "assistant", "tool", "assistant"]
            function = call["tool_calls"][0]["function"]
            assert (
                function["name"] == "calculator"
                and user["content"] == f"calc:{json.loads(function['arguments'])['expression']}"
            )
            value = calculator.call(ToolCall("calculator", function["arguments"])).text
            assert tool["content"] == answer["content"] == value == builtin.solve(user["content"])
    assert calcs > 5


def test_calc_needs_the_calculator_and_tools_off_leaves_the_data_as_it_was(tmp_path):
    cfg = config(counts={"sft": {"train": 10, "validation": 0, "test": 0}})
    cfg["builtin"]["tasks"] = {"calc": {"weight": 1}}
    with pytest.raises(ConfigError, match=r"'calc' is solved with the calculator: set builtin.tools"):
        prepare(cfg, Path.cwd(), tmp_path / "a")
    cfg["builtin"]["tasks"] = {"sort": {"weight": 1}}
    cfg["builtin"]["tools"] = ["abacus"]
    with pytest.raises(ConfigError, match="builtin.tools names 'abacus'"):
        prepare(cfg, Path.cwd(), tmp_path / "b")
    # An empty tools list and a calc task at weight 0 are the pipeline without tools, byte for byte.
    plain = config(counts={"sft": {"train": 10, "validation": 0, "test": 0}})
    prepare(plain, Path.cwd(), tmp_path / "plain")
    plain["builtin"].update(tools=[], tasks={**{t: {} for t in builtin.TASKS}, "calc": {"weight": 0}})
    prepare(plain, Path.cwd(), tmp_path / "off")
    for path in sorted((tmp_path / "plain").rglob("*.*")):
        assert path.read_bytes() == (tmp_path / "off" / path.relative_to(tmp_path / "plain")).read_bytes(), (
            path
        )
