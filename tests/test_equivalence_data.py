"""Training data on both engines: the rendered sft, dpo and rm configs through NeMo-RL v0.7.0's
own dataset classes, processors and collators give, row for row, the token ids, the trained
tokens and the kept/weight-0 rows that the local engine trains on.

Inputs are prepared-format rows (tests/fixtures-like, written here): single-turn, multi-turn
and system-prompted conversations, and one too long for the profile's ``max_input_seq_length``; tokenizers are the tiny char tokenizer (a
template that emits BOS itself) and SmolLM2's (a template with a default system turn and no BOS).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_nemo_rl_render import rendered

SFT_ROWS = [
    [{"role": "user", "content": "sort 312"}, {"role": "assistant", "content": "123"}],
    [{"role": "user", "content": "reverse ab"}, {"role": "assistant", "content": "ba"}],
    [
        {"role": "user", "content": "add 2 3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4?"},
        {"role": "assistant", "content": "9"},
    ],
    [
        {"role": "system", "content": "Answer with digits only."},
        {"role": "user", "content": "sort 21"},
        {"role": "assistant", "content": "12"},
    ],
]


# Tool calling (OpenAI messages + ``tools``), with heterogeneous arguments across rows: trained on
# a template that renders tools (TOOLS_TEMPLATE, the tiny markers plus Qwen2.5-style tool blocks).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}


def call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}  # fmt: skip


TOOL_ROWS = [
    {
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            call("get_weather", city="Paris"),
            {"role": "tool", "content": "18C", "name": "get_weather"},
            {"role": "assistant", "content": "18 degrees."},
        ],
        "tools": [WEATHER],
    },
    {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "2+3 to 2 places"},
            call("calc", expr="2+3", precision=2),
        ],
        "tools": [WEATHER, CALC],
    },
]
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}<|end|>{% endif %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}<|end|>{% endif %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}"
    "{% for c in message.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}"
    "<|end|>{% endif %}"
    "{% if message['role'] == 'tool' %}<|user|><result>{{ message['content'] }}</result><|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PREFERENCE_ROWS = [
    {"prompt": user("sort 312"), "chosen": "123", "rejected": "321"},
    {"prompt": user("reverse ab"), "chosen": "ba", "rejected": "ab"},
    # NeMo-RL's reward-model docs' shape: a context of user, assistant, user turns.
    {
        "prompt": [
            {"role": "user", "content": "what's 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and times 3?"},
        ],
        "chosen": "12",
        "rejected": "6",
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, *user("sort 21")],
        "chosen": "12",
        "rejected": "21",
    },
]


def too_long(n: int) -> str:
    return "9" * n


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    from alignpipe.tiny import train_tokenizer
    from tests.smollm2 import build

    tiny = tmp_path_factory.mktemp("tiny-tokenizer")
    train_tokenizer(["".join(chr(c) for c in range(32, 127))], "char").save_pretrained(tiny)
    tools = tmp_path_factory.mktemp("tools-tokenizer")
    tokenizer = train_tokenizer(["".join(chr(c) for c in range(32, 127)) + "\n"], "char")
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(tools)
    return {"tiny": tiny, "small": build(), "tools": tools}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def config_profile(profile: str) -> str:
    return "tiny" if profile == "tools" else profile


def prepared(stage: str, profile: str, rows: list[dict], tmp: Path, tokenizer: Path) -> dict:
    """The rendered config reading ``rows`` as its training data, with ``tokenizer``."""
    where = tmp / f"{stage}-{profile}"
    where.mkdir(parents=True, exist_ok=True)
    cfg = rendered(stage, config_profile(profile), where)
    if profile == "tools":  # tool schemas are long in characters; the tiny profile's limit is 64
        cfg["data"]["max_input_seq_length"] = 1024
    cfg["data"]["train"]["data_path"] = str(write_jsonl(where / "train.jsonl", rows))
    cfg["data"].pop("validation", None)
    cfg["policy"]["tokenizer"]["name"] = str(tokenizer)
    return cfg


def sft_rows(cfg: dict, profile: str) -> list[dict]:
    """Prepared sft rows; with the ``tools`` tokenizer, tool-calling ones too (others: plain)."""
    limit = int(cfg["data"]["max_input_seq_length"])
    long = [{"role": "user", "content": too_long(limit)}, {"role": "assistant", "content": "1"}]
    return (
        [{"messages": m} for m in SFT_ROWS] + (TOOL_ROWS if profile == "tools" else []) + [{"messages": long}]
    )


def preference_rows(cfg: dict) -> list[dict]:
    limit = int(cfg["data"]["max_input_seq_length"])
    return [*PREFERENCE_ROWS, {"prompt": user("sort 1"), "chosen": "1", "rejected": too_long(limit)}]


CASES = [
    ("sft", "tiny"),
    ("sft", "small"),
    ("sft", "tools"),  # the tiny profile's config, a template that renders tools
    ("dpo", "tiny"),
    ("dpo", "small"),
    ("rm", "tiny"),
    ("rm", "small"),
]


@pytest.fixture(scope="module")
def upstream(tokenizers, nemo_rl_runtime, tmp_path_factory) -> dict[tuple[str, str], dict]:
    """NeMo-RL's view of every case, from one process per data path (sft, preference)."""
    tmp = tmp_path_factory.mktemp("data")
    cases = {}
    for stage, profile in CASES:
        cfg = prepared(stage, profile, [], tmp / "r", tokenizers[profile])
        rows = sft_rows(cfg, profile) if stage == "sft" else preference_rows(cfg)
        cases[(stage, profile)] = prepared(stage, profile, rows, tmp, tokenizers[profile])
    out = {}
    for probe, stages in (("sft_data", ("sft",)), ("preference_data", ("dpo", "rm"))):
        keys = [k for k in CASES if k[0] in stages]
        results = nemo_rl_runtime(probe, {"batch": [{"config": cases[k]} for k in keys]})
        out.update({k: {"config": cases[k], "rows": r} for k, r in zip(keys, results, strict=True)})
    return out


@pytest.mark.parametrize("profile", ["tiny", "small", "tools"])
def test_sft_tokens_and_masks_equal_nemo_rls(profile, tokenizers, upstream) -> None:
    from alignpipe.engines.local.nemo_rl_keys import ProfileKeys, sft_data_keys
    from alignpipe.engines.local.stages.sft import sft_examples

    cfg, theirs = upstream[("sft", profile)]["config"], upstream[("sft", profile)]["rows"]
    rows = sft_rows(cfg, profile)
    ours = sft_examples(load_tokenizer(tokenizers[profile]), rows, sft_data_keys(ProfileKeys(cfg, profile)))
    assert len(ours) == len(theirs) == len(rows)
    for i, (mine, up) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["input_ids"] == up["input_ids"], i
        want = [int(m * up["loss_multiplier"]) for m in up["token_mask"]]
        assert mine["completion_mask"] == want, i
    assert theirs[-1]["loss_multiplier"] == 0.0 and sum(ours[-1]["completion_mask"]) == 0  # kept, weight 0
    assert all(sum(o["completion_mask"]) for o in ours[:-1])
    if profile == "tools":  # the schemas and the calls are in what both engines train
        tokenizer = load_tokenizer(tokenizers[profile])
        weather = tokenizer.decode(ours[len(SFT_ROWS)]["input_ids"])
        assert '"name": "get_weather"' in weather and '<call>get_weather {"city": "Paris"}</call>' in weather
        trained = [t for t, m in zip(ours[len(SFT_ROWS) + 1]["input_ids"], ours[len(SFT_ROWS) + 1]["completion_mask"], strict=True) if m]  # fmt: skip
        assert '<call>calc {"expr": "2+3", "precision": 2}</call>' in tokenizer.decode(trained)


def test_a_template_that_cannot_render_tools_is_refused_naming_it(tokenizers) -> None:
    """Transformers' templates drop what they do not know: SmolLM2's would train the calls away."""
    from alignpipe.engines.local.nemo_rl_keys import SftDataKeys
    from alignpipe.engines.local.stages.sft import sft_examples
    from alignpipe.errors import DataError

    cfg = SftDataKeys(max_input_seq_length=512, add_bos=True, add_eos=True, add_generation_prompt=False)
    with pytest.raises(DataError) as info:
        sft_examples(load_tokenizer(tokenizers["small"]), [{"messages": SFT_ROWS[0]}, *TOOL_ROWS], cfg, where="sft/train.jsonl")  # fmt: skip
    msg = str(info.value)
    assert "sft/train.jsonl:2" in msg and str(tokenizers["small"]) in msg and "'get_weather'" in msg


def test_the_smollm2_tool_template_renders_tools_and_nothing_else_differently(tokenizers) -> None:
    """benchmarks/smollm2_tools.jinja (what benchmarks/tools_small.sh gives SmolLM2): the rows the
    model's own template refuses train their calls, and a row without tools renders as before."""
    from alignpipe.engines.local.nemo_rl_keys import SftDataKeys
    from alignpipe.engines.local.stages.sft import sft_examples
    from tests.conftest import REPO

    own = load_tokenizer(tokenizers["small"])
    tokenizer = load_tokenizer(tokenizers["small"])
    tokenizer.chat_template = (REPO / "benchmarks" / "smollm2_tools.jinja").read_text()
    for row in [*SFT_ROWS, [{"role": "system", "content": "Be brief."}, *SFT_ROWS[0]]]:
        assert tokenizer.apply_chat_template(row, tokenize=False) == own.apply_chat_template(
            row, tokenize=False
        )
    cfg = SftDataKeys(max_input_seq_length=512, add_bos=True, add_eos=True, add_generation_prompt=False)
    calc = sft_examples(tokenizer, TOOL_ROWS[1:], cfg)[0]
    trained = [t for t, m in zip(calc["input_ids"], calc["completion_mask"], strict=True) if m]
    assert (
        '<tool_call>{"name": "calc", "arguments": {"expr": "2+3", "precision": 2}}</tool_call>'
        in tokenizer.decode(trained)
    )
    assert '"name": "get_weather"' in tokenizer.decode(calc["input_ids"])  # the schemas offered


@pytest.mark.parametrize("stage", ["dpo", "rm"])
@pytest.mark.parametrize("profile", ["tiny", "small"])
def test_preference_tokens_and_masks_equal_nemo_rls(stage, profile, tokenizers, upstream) -> None:
    from alignpipe.engines.local.nemo_rl_keys import ProfileKeys, preference_data_keys
    from alignpipe.engines.local.preference_pairs import preference_examples

    cfg, theirs = upstream[(stage, profile)]["config"], upstream[(stage, profile)]["rows"]
    rows = preference_rows(cfg)
    data = preference_data_keys(ProfileKeys(cfg, profile))
    ours = preference_examples(load_tokenizer(tokenizers[profile]), rows, data)
    assert len(ours) == len(theirs) == len(rows)
    for i, (mine, up) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["weight"] == up["weight"], i
        for side in ("chosen", "rejected"):
            assert mine[f"{side}_input_ids"] == up[f"{side}_input_ids"], (i, side)
            assert mine[f"{side}_completion_mask"] == up[f"{side}_token_mask"], (i, side)
    assert [o["weight"] for o in ours] == [1.0] * len(PREFERENCE_ROWS) + [0.0]


@pytest.mark.parametrize("stage", ["sft", "dpo", "rm"])
def test_a_system_prompt_file_is_refused_on_the_nemo_rl_engine(stage: str) -> None:
    """NeMo-RL v0.7.0's sft_processor and preference_preprocessor never read
    data.default.system_prompt_file: a nemo_rl run must stop rather than train without it."""
    from alignpipe.config import load_params
    from alignpipe.context import build_context
    from alignpipe.engines.nemo_rl import engine
    from alignpipe.errors import UnsupportedSetting
    from tests.conftest import REPO

    params = load_params(REPO)
    params["runtime"] = {**params.get("runtime", {}), "engine": "nemo_rl"}
    params[stage] = {
        **(params.get(stage) or {}),
        "data": {"default": {"system_prompt_file": "prompts/brief.txt"}},
    }
    with pytest.raises(UnsupportedSetting, match=r"system_prompt_file='prompts/brief.txt'.*ignores it"):
        engine.run(build_context(REPO, stage, params=params))
