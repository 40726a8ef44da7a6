"""NeMo-RL's ``data.default.system_prompt_file`` on the local engine: the stage trains and samples
after that system turn, records it with the model, and convert/evaluate prompt the model with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignpipe.context import read_system_prompt
from alignpipe.engines.local.grpo import conversational
from alignpipe.engines.local.nemo_rl_keys import PreferenceDataKeys, SftDataKeys
from alignpipe.engines.local.preference_pairs import preference_examples
from alignpipe.engines.local.stages.sft import sft_examples
from alignpipe.errors import ConfigError
from alignpipe.measure.generation import generate
from alignpipe.measure.heldout import SAMPLES_FILE, heldout_rows, sampling_args, sampling_key
from alignpipe.measure.logprobs import load_policy
from tests.conftest import run_cli, set_params, writable_copy

SYSTEM = "Answer briefly."


def test_the_file_is_read_as_nemo_rl_does_and_must_live_under_prompts(tmp_path: Path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "brief.txt").write_text(SYSTEM)
    (tmp_path / "prompts" / "empty.txt").write_text("")
    (tmp_path / "elsewhere.txt").write_text(SYSTEM)
    assert read_system_prompt(tmp_path, "prompts/brief.txt") == SYSTEM
    # An empty file is no system turn, as NeMo-RL's `if task_data_spec.system_prompt:`.
    assert read_system_prompt(tmp_path, "prompts/empty.txt") is None
    assert read_system_prompt(tmp_path, None) is None
    with pytest.raises(
        ConfigError, match=r"data.default.system_prompt_file: 'elsewhere.txt' is not under prompts/"
    ):
        read_system_prompt(tmp_path, "elsewhere.txt")
    with pytest.raises(ConfigError, match=r"not under prompts/"):
        read_system_prompt(tmp_path, "prompts/../elsewhere.txt")
    with pytest.raises(
        ConfigError, match=r"prompts/missing.txt does not exist; create it or set the key to null"
    ):
        read_system_prompt(tmp_path, "prompts/missing.txt")


def test_every_training_format_starts_with_the_system_turn():
    from alignpipe.tiny import train_tokenizer

    tokenizer = train_tokenizer(["".join(chr(c) for c in range(32, 127))], "char")
    data = SftDataKeys(max_input_seq_length=200, add_bos=False, add_eos=True, add_generation_prompt=False)
    pair_data = PreferenceDataKeys(
        max_input_seq_length=200, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected"
    )
    qa = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    (row,) = sft_examples(tokenizer, [{"messages": qa}], data, SYSTEM)
    text = tokenizer.decode(row["input_ids"])
    assert text.index(SYSTEM) < text.index("q") < text.index("a")
    assert tokenizer.decode(
        [t for t, m in zip(row["input_ids"], row["completion_mask"], strict=True) if m]
    ).endswith("a" + tokenizer.eos_token)
    # A conversation with its own system turn keeps it.
    own = [{"role": "system", "content": "mine"}, *qa]
    assert SYSTEM not in tokenizer.decode(
        sft_examples(tokenizer, [{"messages": own}], data, SYSTEM)[0]["input_ids"]
    )
    (pair,) = preference_examples(
        tokenizer, [{"prompt": "q", "chosen": "a", "rejected": "b"}], pair_data, SYSTEM
    )
    assert tokenizer.decode(pair["rejected_input_ids"]).index(SYSTEM) < tokenizer.decode(
        pair["rejected_input_ids"]
    ).index("q")
    assert conversational([{"prompt": "q"}], SYSTEM)[0]["prompt"][0] == {"role": "system", "content": SYSTEM}
    # Without one, nothing is added: the chat template's default applies.
    assert conversational([{"prompt": "q"}])[0]["prompt"] == [{"role": "user", "content": "q"}]


@pytest.mark.slow
def test_sft_trains_samples_and_publishes_with_the_system_prompt(trained_sft: Path, tmp_path: Path):
    from alignpipe.context import build_context

    root = writable_copy(trained_sft, tmp_path / "repo")
    (root / "prompts" / "test.txt").write_text(SYSTEM)
    set_params(
        root,
        {
            "sft": {
                "sft": {"max_num_steps": 5},
                "data": {"default": {"system_prompt_file": "prompts/test.txt"}},
            }
        },
    )
    env = {"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")}
    run_cli(root, "run", "sft", env=env)
    run_cli(root, "run", "convert", "--source", "sft", env=env)

    sft = root / "models" / "sft"
    assert json.loads((sft / "artifact.json").read_text())["system_prompt"] == SYSTEM
    export = root / "exports" / "sft"
    assert json.loads((export / "artifact.json").read_text())["system_prompt"] == SYSTEM
    assert f"SYSTEM = {SYSTEM!r}" in (export / "README.md").read_text()

    # The published held-out samples were drawn after the system turn: the same seeded sampling
    # reproduces them with it, and the key says so.
    ctx = build_context(root, "sft")
    settings = ctx.settings.heldout
    rows = heldout_rows(ctx, settings)
    published = [json.loads(line) for line in (sft / SAMPLES_FILE).read_text().splitlines()]
    assert (
        {p["key"] for p in published}
        == {sampling_key(rows, settings, SYSTEM)}
        != {sampling_key(rows, settings)}
    )
    model, tok = load_policy(sft)
    kwargs = {**sampling_args(settings), "batch_size": settings.batch_size}
    prompts = [r["prompt"] for r in rows]
    with_system = generate(model, tok, prompts, system=SYSTEM, **kwargs)
    assert with_system == [p["completion"] for p in published]
    assert generate(model, tok, prompts, **kwargs) != with_system
