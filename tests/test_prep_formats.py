"""prep: the community formats (ShareGPT, Alpaca, Anthropic HH-RLHF) read into their families
as whole conversations, and what is malformed in them is named by file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignpipe.data.prepare import prepare
from alignpipe.data.schema import SPLITS
from alignpipe.errors import DataError

REPO = Path(__file__).resolve().parents[1]
FIXREL = "tests/fixtures/prep"
ALL_TRAIN = {"seed": 1, "validation_fraction": 0.0, "test_fraction": 0.0}


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


def S(text: str) -> dict:
    return {"role": "system", "content": text}


def rows_of(tmp_path: Path, family: str, **source) -> list[dict]:
    out = tmp_path / "out"
    path = source["path"] if Path(source["path"]).is_absolute() else f"{FIXREL}/{source['path']}"
    src = {"kind": "jsonl", "family": family, **source, "path": path}
    prepare({"split": ALL_TRAIN, "sources": [src]}, REPO, out)
    rows = [json.loads(x) for s in SPLITS for x in (out / family / f"{s}.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: json.dumps(r.get("messages") or r["prompt"]))


def error_of(tmp_path: Path, family: str, **source) -> DataError:
    with pytest.raises(DataError) as info:
        rows_of(tmp_path, family, **source)
    return info.value


def test_sharegpt_conversations_to_sft(tmp_path):
    rows = rows_of(tmp_path, "sft", path="sharegpt.jsonl", format="sharegpt")
    assert [r["messages"] for r in rows] == sorted(
        [
            [U("Who are you?"), A("A small assistant.")],
            [S("Reply in French."), U("Say hello."), A("Bonjour."), U("Now say thanks."), A("Merci.")],
            [S("Be terse."), U("Capital of Italy?"), A("Rome.")],  # the `system` column, `user`/`model` roles
        ],
        key=json.dumps,
    )


def test_sharegpt_to_rlvr_keeps_the_conversation_and_answers_with_the_last_reply(tmp_path):
    rows = rows_of(tmp_path, "rlvr", path="sharegpt_rl.jsonl", format="sharegpt")
    got = {json.dumps(r["prompt"]): r["answer"] for r in rows}
    assert got == {
        json.dumps([S("Digits only."), U("sort:312")]): "123",
        json.dumps([U("sort:21"), A("12"), U("reverse:905")]): "509",
    }


def test_sharegpt_preference_with_chosen_and_rejected_turns(tmp_path):
    (row,) = rows_of(tmp_path, "preference", path="sharegpt_pairs.jsonl", format="sharegpt")
    assert row["prompt"] == [U("Name a fruit."), A("Apple."), U("A red one?")]
    assert (row["chosen"], row["rejected"]) == ("Cherry.", "Banana.")


def test_sharegpt_custom_keys(tmp_path):
    path = tmp_path / "oai.jsonl"
    path.write_text(
        json.dumps({"chat": [{"who": "human", "text": "Hi"}, {"who": "gpt", "text": "Hello"}]}) + "\n"
    )
    (row,) = rows_of(
        tmp_path,
        "sft",
        path=str(path),
        format="sharegpt",
        messages_key="chat",
        role_key="who",
        content_key="text",
    )
    assert row["messages"] == [U("Hi"), A("Hello")]


def test_alpaca_joins_instruction_and_input_with_a_newline(tmp_path):
    rows = rows_of(tmp_path, "sft", path="alpaca.jsonl", format="alpaca")
    assert [r["messages"] for r in rows] == sorted(
        [
            [U("Classify the items.\nApples, carrots"), A("Fruit: apples. Vegetable: carrots.")],
            [U("Name a primary colour."), A("Red.")],  # an empty input adds nothing
            # `system` and `history` (earlier [instruction, response] pairs) as LLaMA-Factory reads them
            [
                S("You are a translator."),
                U("Translate to German: dog"),
                A("Hund"),
                U("Translate to German.\ncat"),
                A("Katze"),
            ],
        ],
        key=json.dumps,
    )


def test_alpaca_to_rlvr_and_preference(tmp_path):
    rl = rows_of(tmp_path, "rlvr", path="alpaca_rl.jsonl", format="alpaca")
    assert {json.dumps(r["prompt"]): (r["answer"], r["verifier"]) for r in rl} == {
        json.dumps([U("Sort the digits.\n312")]): ("123", "exact"),
        json.dumps([U("What is 2 + 3?")]): ("5", "numeric"),
    }
    (pair,) = rows_of(tmp_path / "p", "preference", path="alpaca_pairs.jsonl", format="alpaca")
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == (
        [U("Name a primary colour.")],
        "Red.",
        "Purple.",
    )


def test_hh_rlhf_transcripts_become_the_shared_turns_and_two_replies(tmp_path):
    rows = rows_of(tmp_path, "preference", path="hh_rlhf.jsonl", format="hh_rlhf")
    got = {json.dumps(r["prompt"]): (r["chosen"], r["rejected"]) for r in rows}
    assert got == {
        json.dumps([U("What sound does a cat make?")]): ("A cat meows.", "Cats bark."),
        json.dumps([U("Recommend a book."), A("Try a mystery novel."), U("Something shorter?")]): (
            "A short story collection.",
            "No.",
        ),
    }


def test_tool_calling_conversations_go_to_sft_in_the_shape_templates_read(tmp_path):
    """OpenAI messages with tool calls: ``arguments`` JSON strings become objects (what
    transformers' templates render), a ``tools`` JSON string becomes its list, ids are kept."""
    rows = {
        r["messages"][0]["content"]: r
        for r in rows_of(tmp_path, "sft", path="tool_calls.jsonl", format="messages")
    }
    weather = rows["Weather in Paris?"]
    assert weather["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                "id": "call_1",
            }
        ],
    }
    assert weather["messages"][2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    assert weather["tools"][0]["function"]["name"] == "get_weather"
    calc = rows["What is 2+3?"]  # a conversation may end with the call the model learns to make
    assert calc["messages"][-1]["tool_calls"][0]["function"]["arguments"] == {"expr": "2+3", "precision": 2}
    assert calc["tools"] == [{"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}]  # fmt: skip
    assert "tools" not in rows["Hi"]


def test_glaive_function_calls_become_openai_tool_turns_for_sft(tmp_path):
    """ShareGPT with ``function_call``/``observation`` turns and a ``tools`` JSON string (glaive,
    LLaMA-Factory, Axolotl): calls become assistant ``tool_calls`` with object arguments, results
    ``tool`` turns, the tools their list."""
    rows = {
        next(m for m in r["messages"] if m["role"] == "user")["content"]: r
        for r in rows_of(tmp_path, "sft", path="glaive.jsonl", format="sharegpt")
    }
    weather = rows["Weather in Paris?"]["messages"]
    assert weather == [
        S("You can call functions."),
        U("Weather in Paris?"),
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp_c": 18}'},
        A("It is 18 degrees in Paris."),
    ]  # fmt: skip
    assert [t["name"] for t in rows["Weather in Paris?"]["tools"]] == ["get_weather", "calc"]
    parallel = rows["What are 2+3 and 4*5?"]["messages"][-1]  # ends with the calls the model learns
    assert [c["function"]["arguments"] for c in parallel["tool_calls"]] == [{"expr": "2+3"}, {"expr": "4*5"}]
    assert "tools" not in rows["Hi"]


def test_glaive_rows_tokenise_for_the_sft_stage_with_a_template_that_renders_tools(tmp_path):
    from alignpipe.engines.local.nemo_rl_keys import SftDataKeys
    from alignpipe.engines.local.stages.sft import sft_examples
    from alignpipe.tiny import train_tokenizer
    from tests.test_equivalence_data import TOOLS_TEMPLATE

    rows = rows_of(tmp_path, "sft", path="glaive.jsonl", format="sharegpt")
    tokenizer = train_tokenizer(["".join(chr(c) for c in range(32, 127))], "char")
    tokenizer.chat_template = TOOLS_TEMPLATE
    data = SftDataKeys(max_input_seq_length=4096, add_bos=False, add_eos=True, add_generation_prompt=False)
    examples = sft_examples(tokenizer, rows, data, where="glaive.jsonl")
    call = next(e for r, e in zip(rows, examples, strict=True) if "4*5" in json.dumps(r["messages"]))
    trained = tokenizer.decode(
        [t for t, m in zip(call["input_ids"], call["completion_mask"], strict=True) if m]
    )
    assert '<call>calc {"expr": "2+3"}</call>' in trained and "Tools:" not in trained


@pytest.mark.parametrize(
    "family,source,line,field,words",
    [
        ("sft", {"path": "sharegpt_bad.jsonl", "format": "sharegpt"}, 2, "conversations[1].from",
         "unknown role 'narrator'"),
        ("sft", {"path": "sharegpt_missing.jsonl", "format": "sharegpt"}, 2, "conversations", "is missing"),
        ("preference", {"path": "hh_rlhf_bad.jsonl", "format": "hh_rlhf"}, 2, "chosen",
         "no '\\n\\nAssistant:' turn"),
        ("sft", {"path": "alpaca_rl.jsonl", "format": "alpaca", "instruction_key": "task"}, 1, "task",
         "is missing"),
        ("sft", {"path": "tool_calls_bad.jsonl", "format": "messages"}, 2,
         "messages[1].tool_calls[0].function.arguments", "is not JSON"),
        ("rlvr", {"path": "tool_calls.jsonl", "format": "messages", "verifier": "exact"}, 1, "messages[1]",
         "tool-call conversations feed the sft family only"),
        ("sft", {"path": "glaive_bad.jsonl", "format": "sharegpt"}, 2, "conversations[1].value",
         "a function_call must be JSON {name, arguments}"),
        ("rlvr", {"path": "glaive.jsonl", "format": "sharegpt", "verifier": "exact"}, 1,
         "conversations[1].from", "tool-call conversations feed the sft family only"),
    ],
)  # fmt: skip
def test_malformed_records_are_named(tmp_path, family, source, line, field, words):
    err = error_of(tmp_path, family, **source)
    assert (err.line, err.field) == (line, field), str(err)
    assert words in err.problem and err.fix
