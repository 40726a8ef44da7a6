"""The typed ``alignpipe:`` settings (alignpipe/settings.py): one default per knob, every committed
profile read whole, a misspelt or mistyped key refused by ``plan`` and ``run`` naming the file
that set it, and the docs naming only settings that exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from alignpipe import config as C
from alignpipe import settings as S
from alignpipe.context import build_context
from alignpipe.errors import ConfigError
from tests.conftest import REPO, copy_repo, run_cli, set_params
from tests.test_docs_commands import expand_braces

PROFILES = sorted(REPO.glob("stages/*/config/*.yaml"))
KEYS = {key for key, _, _ in S.reference_rows()}


def leaves(node: Any, key: str) -> dict[str, Any]:
    """``{dotted key: value}`` of every value under the mapping ``node`` (a list is one value)."""
    if isinstance(node, dict):
        return {k: v for name, child in node.items() for k, v in leaves(child, f"{key}.{name}").items()}
    return {key: node}


# --------------------------------------------------------------------------- one default per knob


def test_every_default_is_written_once():
    """``AlignpipeSettings()`` is the one set of defaults: no section, an empty one, and the defaults
    written out in full all read back as it, and docs/SETTINGS.md shows them as they are."""
    defaults = S.AlignpipeSettings()
    for section in (None, {}, dataclasses.asdict(defaults)):
        assert S.from_config({"alignpipe": section}, "x.yaml") == defaults
    assert S.from_config({}, "x.yaml") == defaults
    assert (REPO / "docs" / "SETTINGS.md").read_text() == S.reference_markdown(), (
        "docs/SETTINGS.md is out of date: python -m alignpipe.settings > docs/SETTINGS.md"
    )
    assert defaults.reward_hacking.accuracy_drop == 0.02  # rlhf's warning and evaluate's flag alike


def test_the_code_reads_settings_only_through_the_dataclasses():
    """No reader of the ``alignpipe:`` section but settings.py, so none with a default of its own."""
    untyped = re.compile(r"""get_path\([^)]*["']alignpipe\.|\[["']alignpipe["']\]|\.get\(["']alignpipe["']""")
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in (REPO / "alignpipe").rglob("*.py")
        if path.name != "settings.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if untyped.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_committed_profile_reads_whole(path: Path):
    """Each profile, resolved with its ``defaults:`` chain, parses, and the typed settings carry
    every value it sets (an integer read as a float where a number is wanted is the same value)."""
    stage, profile = path.parent.parent.name, path.stem
    cfg = C.resolve_stage_config(REPO, stage, {}, profile)
    typed = leaves(dataclasses.asdict(S.from_config(cfg, str(path))), "alignpipe")
    for key, value in leaves(cfg.get("alignpipe") or {}, "alignpipe").items():
        assert key in typed and typed[key] == value, f"{path.name}: {key}"


def test_params_knobs_under_alignpipe_still_apply():
    """``<stage>.alignpipe.<key>`` in params.yaml changes the typed setting (the profile must have
    the key, as for every knob); a wrong type there names params.yaml."""
    params = C.load_params(REPO)
    params = {**params, "evaluate": {"alignpipe": {"heldout": {"seed": 7, "temperature": 0}}}}
    ctx = build_context(REPO, "evaluate", params=params)
    assert (ctx.settings.heldout.seed, ctx.settings.heldout.temperature) == (7, 0.0)
    assert build_context(REPO, "rlhf").settings.reward_clip == [-10.0, 10.0]  # the committed knob

    params["rlvr"] = {"alignpipe": {"zero_reward_batches": "five"}}
    with pytest.raises(ConfigError) as err:
        C.resolve_stage_config(REPO, "rlvr", params)
    assert str(err.value) == (
        "params.yaml 'rlvr.alignpipe.zero_reward_batches' (over stages/rlvr/config/tiny.yaml): "
        "'alignpipe.zero_reward_batches' must be an integer, found 'five' (a string)"
    )


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"heldout": {"sed": 1}}, "'alignpipe.heldout.sed' is not a setting. Did you mean 'alignpipe.heldout.seed'?"),
        ({"heldout": {"vllm": {"tp": 2}}}, "'alignpipe.heldout.vllm.tp' is not a setting. Known under"),
        ({"zero_reward_batches": 2.5}, "'alignpipe.zero_reward_batches' must be an integer, found 2.5 (a number)"),
        ({"heldout": {"enabled": "yes"}}, "'alignpipe.heldout.enabled' must be true or false, found 'yes'"),
        ({"heldout": {"seed": True}}, "'alignpipe.heldout.seed' must be an integer, found True (a boolean)"),
        ({"heldout": {"limit": "all"}}, "'alignpipe.heldout.limit' must be an integer or null, found 'all'"),
        ({"benchmark": {"tasks": "gsm8k"}}, "'alignpipe.benchmark.tasks' must be a list, found 'gsm8k'"),
        ({"reward_clip": [0.0, "1"]}, "'alignpipe.reward_clip[1]' must be a number or null, found '1'"),
        ({"reward_clip": [2.0, 1.0]}, "'alignpipe.reward_clip' has its lower bound 2.0 above the upper 1.0"),
        ({"reward_source": "oracle"}, "'alignpipe.reward_source' is 'oracle'; expected one of rm, judge"),
        ({"export": {"dtype": "fp8"}}, "'alignpipe.export.dtype' is 'fp8'; expected one of float32, bfloat16, float16, null"),
        ({"evaluate": {"policies": [{"name": "sft"}]}}, "'alignpipe.evaluate.policies[0]' lacks path"),
        ({"reward_shaping": {"length_penalty": 0.1}}, "'alignpipe.reward_shaping.length_penalty' needs target_length"),
        ({"judge": 3}, "'alignpipe.judge' must be a mapping of settings, found 3 (an integer)"),
    ],
)  # fmt: skip
def test_a_wrong_key_or_value_is_refused_by_name(section: dict, says: str):
    with pytest.raises(ConfigError) as err:
        S.from_config({"alignpipe": section}, "stages/x/config/tiny.yaml")
    assert str(err.value).startswith(f"stages/x/config/tiny.yaml: {says}")


def test_a_number_may_be_written_as_an_integer_and_lists_stay_lists():
    got = S.from_config({"alignpipe": {"heldout": {"temperature": 1}, "reward_clip": [-1, None]}}, "x")
    assert got.heldout.temperature == 1.0 and isinstance(got.heldout.temperature, float)
    assert got.reward_clip == [-1.0, None]


def misspell(root: Path, profile: str) -> None:
    """``zero_reward_batchez`` for ``zero_reward_batches`` in rlvr's profile (rlhf inherits it)."""
    path = root / "stages" / "rlvr" / "config" / f"{profile}.yaml"
    text = path.read_text()
    if profile == "tiny":
        assert "  zero_reward_batches: 5\n" in text
        path.write_text(text.replace("  zero_reward_batches: 5\n", "  zero_reward_batchez: 5\n"))
    else:  # the GPU profile sets no such key: the typo is a new one
        path.write_text(text.replace("\nalignpipe:\n", "\nalignpipe:\n  zero_reward_batchez: 5\n", 1))


@pytest.fixture(scope="module")
def misspelt(tmp_path_factory) -> Path:
    root = copy_repo(tmp_path_factory.mktemp("misspelt") / "repo")
    for profile in ("tiny", "default"):
        misspell(root, profile)
    return root


@pytest.mark.parametrize(
    ("args", "profile"),
    [
        (("plan", "rlvr"), "tiny"),  # local engine
        (("run", "rlvr"), "tiny"),
        (("plan", "rlhf"), "tiny"),  # a child profile: the error names the parent that has the typo
        (("plan", "rlvr", "--profile", "default"), "default"),  # nemo_rl engine, which drops the section
        (("run", "rlvr", "--profile", "default"), "default"),
    ],
)
def test_a_misspelt_key_in_a_profile_stops_plan_and_run(misspelt: Path, args: tuple[str, ...], profile: str):
    result = run_cli(misspelt, *args, check=False)
    assert result.returncode == 2, result.stderr
    assert (
        f"stages/rlvr/config/{profile}.yaml: 'alignpipe.zero_reward_batchez' is not a setting. "
        "Did you mean 'alignpipe.zero_reward_batches'?"
    ) in result.stderr
    assert "Traceback" not in result.stderr and not (misspelt / "results" / "rlvr").exists()


def test_a_wrong_type_from_params_stops_run(tmp_path: Path):
    root = copy_repo(tmp_path / "repo")
    set_params(root, {"evaluate": {"alignpipe": {"heldout": {"seed": "1234"}}}})
    result = run_cli(root, "run", "evaluate", check=False)
    assert result.returncode == 2
    assert "'alignpipe.heldout.seed' must be an integer, found '1234' (a string)" in result.stderr
    assert "params.yaml 'evaluate.alignpipe.heldout.seed'" in result.stderr


# --------------------------------------------------------------------------- the stage READMEs

# `alignpipe.<key>` (also `<stage>.alignpipe.<key>`, a params path) in code spans; `{a,b}` both, `.*` all.
SETTING_REF = re.compile(r"(?<![\w/-])(?:\w+\.)?alignpipe((?:\.[\w{},*]+)+)")
SECTIONS = {f.name for f in dataclasses.fields(S.AlignpipeSettings)}
READMES = sorted(REPO.glob("stages/*/README.md"))


def setting_refs(text: str) -> set[str]:
    """The settings ``text`` names in code: keys whose first part is a section (others are modules)."""
    refs = set()
    for span in re.findall(r"`([^`]+)`", text):
        for ref in SETTING_REF.findall(span):
            if ref.strip(".").split(".")[0] in SECTIONS:
                refs |= set(expand_braces("alignpipe" + ref.rstrip(".").removesuffix(".*")))
    return refs


@pytest.mark.parametrize(
    "path", [*READMES, *sorted(REPO.glob("docs/*.md")), REPO / "README.md", REPO / "DEVELOPING.md"],
    ids=lambda p: str(p.relative_to(REPO)),
)  # fmt: skip
def test_every_documented_setting_exists(path: Path):
    assert sorted(setting_refs(path.read_text()) - KEYS) == []


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_a_stage_readme_names_every_setting_its_profiles_set(readme: Path):
    """Each ``alignpipe:`` key a stage's committed profiles set is named in its README, the key or a
    section above it (``alignpipe.heldout`` covers ``heldout.seed``); docs/SETTINGS.md, generated
    from the dataclasses, gives every field its default and meaning."""
    stage = readme.parent.name
    named = setting_refs(readme.read_text())
    unnamed = set()
    for path in (REPO / "stages" / stage / "config").glob("*.yaml"):
        cfg = C.resolve_stage_config(REPO, stage, {}, path.stem)
        for key in leaves(cfg.get("alignpipe") or {}, "alignpipe"):
            if not any(key == n or key.startswith(n + ".") for n in named):
                unnamed.add(f"{key} ({path.name})")
    assert sorted(unnamed) == []


def test_the_readme_checks_catch_a_typo_and_a_missing_section():
    assert setting_refs(
        "`alignpipe.heldout.{seed,limt}`, `evaluate.alignpipe.heldout.seed`, `alignpipe.measure.x`"
    ) == {
        "alignpipe.heldout.seed",
        "alignpipe.heldout.limt",
    }
    assert setting_refs("`alignpipe.heldout.limt`") - KEYS == {"alignpipe.heldout.limt"}
