"""Reward shaping: format penalty, length penalty, clipping; all off by default."""

import pytest

from alignpipe.errors import ConfigError
from alignpipe.rl.shaping import format_ok, is_noop, shape_reward, shape_rewards, shaping_config
from alignpipe.settings import RewardShaping


def test_defaults_are_off():
    cfg = shaping_config({})
    assert is_noop(cfg)
    assert shaping_config(None) == RewardShaping()
    for r, c in [(1.0, "42"), (0.0, ""), (1.0, "x" * 10_000), (0.5, "\x00bad")]:
        assert shape_reward(r, c) == r
        assert (
            shape_reward(
                r, c, {"format_penalty": 0.0, "length_penalty": 0.0, "target_length": None, "clip": None}
            )
            == r
        )


def test_format_penalty():
    cfg = {"format_penalty": 0.5}
    assert shape_reward(1.0, "42", cfg) == 1.0
    assert shape_reward(1.0, "", cfg) == 0.5  # empty
    assert shape_reward(1.0, "  \n ", cfg) == 0.5  # whitespace only
    assert shape_reward(1.0, "4\x002", cfg) == 0.5  # control character
    assert shape_reward(0.0, "bad \ufffd decode", cfg) == -0.5  # replacement char
    assert shape_reward(1.0, "naïve café — ok\n\tyes", cfg) == 1.0  # ordinary unicode is fine
    assert shape_reward(1.0, None, cfg) == 0.5


def test_format_custom_allowed_chars():
    digits = {"format_penalty": 1.0, "allowed_chars": r"0-9"}
    assert shape_reward(1.0, "12358", digits) == 1.0
    assert shape_reward(1.0, "12358.", digits) == 0.0
    assert format_ok("abc", r"a-c") and not format_ok("abcd", r"a-c")
    with pytest.raises(ConfigError, match="allowed_chars"):
        shaping_config({"allowed_chars": "z-a"})  # bad range fails at config time


def test_length_penalty_chars_and_tokens():
    cfg = {"length_penalty": 0.1, "target_length": 5}
    assert shape_reward(1.0, "12345", cfg) == 1.0  # at target: no penalty
    assert shape_reward(1.0, "1234567", cfg) == pytest.approx(0.8)  # 2 chars over
    assert shape_reward(1.0, "1", cfg) == 1.0  # shorter is never rewarded or penalized
    tok = {"length_penalty": 0.01, "target_length": 100, "length_unit": "tokens"}
    assert shape_reward(1.0, "whatever", tok, num_tokens=150) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="num_tokens"):
        shape_reward(1.0, "x", tok)


def test_clip_and_order():
    cfg = {"format_penalty": 1.0, "length_penalty": 1.0, "target_length": 1, "clip": [-1.0, 1.0]}
    # 1 - 1 (control char \x00) - 3 (4 chars, target 1) = -3 -> clipped to -1
    assert shape_reward(1.0, "\x00abc", cfg) == -1.0
    assert shape_reward(5.0, "a", {"clip": [None, 2.0]}) == 2.0
    assert shape_reward(-5.0, "a", {"clip": [0.0, None]}) == 0.0


def test_batch():
    cfg = {"format_penalty": 0.5, "clip": [0.0, 1.0]}
    assert shape_rewards([1.0, 1.0, 0.0], ["ok", "", ""], cfg) == [1.0, 0.5, 0.0]
    assert shape_rewards([1, 0], ["a", "b"]) == [1.0, 0.0]
    assert shape_rewards(
        [1.0], ["abc"], {"length_penalty": 0.5, "target_length": 1, "length_unit": "tokens"}, num_tokens=[3]
    ) == [0.0]
    with pytest.raises(ValueError):
        shape_rewards([1.0], ["a", "b"])


@pytest.mark.parametrize(
    "bad",
    [
        {"format_penalty": 0.1, "typo_key": 1},
        {"length_penalty": 0.1},  # needs target_length
        {"clip": [1.0]},
        {"clip": [2.0, 1.0]},
        {"clip": "0,1"},
        {"length_unit": "words"},
        {"format_penalty": -1.0},
    ],
)
def test_invalid_configs_raise(bad):
    with pytest.raises(ConfigError):
        shaping_config(bad)
