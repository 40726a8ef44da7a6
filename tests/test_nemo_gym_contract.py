"""The NeMo-Gym path against the Gym NeMo-RL v0.7.0 really runs: nemo-gym 0.4.0 (its submodule's
tag), in its own Python >= 3.12 venv (.ci/install-gym.sh, cached in ~/.cache/alignpipe).

Both nemo_gym renders resolve with Gym's own GlobalConfigDictParser, called as NeMo-RL calls it,
and every server's config validates with its app's own config class (tests/nemo_gym_probe.py);
the local `math` verifier and Gym's math_with_judge agree on a table of answers; and one real
rollout of the rlvr environment scores right and wrong answers (tests/nemo_gym_rollout.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from alignpipe.config import get_path
from alignpipe.context import build_context
from alignpipe.engines.nemo_rl.nemo_gym_data import BOXED_INSTRUCTION, agent_ref, convert_file
from alignpipe.rewards import score_completion
from tests.conftest import REPO, run_cli

GYM_VENV = Path(os.environ.get("ALIGNPIPE_GYM_VENV", Path.home() / ".cache" / "alignpipe" / "gym-0.4.0-venv"))
PROBE = REPO / "tests" / "nemo_gym_probe.py"


@pytest.fixture(scope="session")
def gym_python() -> Path:
    """Gym 0.4.0's interpreter, exactly lock/gym.txt: installed the way CI does (at once where the
    venv already holds that lock). Fails, never skips."""
    proc = subprocess.run(["bash", str(REPO / ".ci" / "install-gym.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, f".ci/install-gym.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return GYM_VENV / "bin" / "python"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """The pipeline's own nemo_gym renders of rlvr and rlhf (`alignpipe plan --write`)."""
    out = tmp_path_factory.mktemp("gym_renders")
    for stage in ("rlvr", "rlhf"):
        run_cli(REPO, "plan", stage, "--profile", "nemo_gym", "--write", str(out))
    return {stage: out / f"{stage}.nemo_rl.yaml" for stage in ("rlvr", "rlhf")}


EXPECTED_SERVERS = {
    "rlvr": {
        "policy_model": "VLLMModelConfig",
        "math_with_judge": "LibraryJudgeMathResourcesServerConfig",
        "math_with_judge_simple_agent": "SimpleAgentConfig",
    },
    "rlhf": {
        "policy_model": "VLLMModelConfig",
        "policy_model_reasoning_off": "VLLMModelConfig",
        "genrm_model": "GenRMModelConfig",
        "genrm_compare_resources_server": "GenRMCompareConfig",
        "genrm_simple_agent": "SimpleAgentConfig",
        "genrm_simple_agent_reasoning_off": "SimpleAgentConfig",
    },
}


@pytest.mark.parametrize("stage", ["rlvr", "rlhf"])
def test_nemo_gym_config_resolves_with_gyms_own_parser(stage, gym_python, rendered):
    with rendered[stage].open() as f:
        proc = subprocess.run(
            [str(gym_python), str(PROBE)], stdin=f, capture_output=True, text=True, timeout=300
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result.get("error", "") + "\n" + result.get("trace", "") + proc.stderr[-2000:]
    assert {s["instance"]: s["config_class"] for s in result["servers"]} == EXPECTED_SERVERS[stage]


# (gold, answer, expected score). Gym's math_with_judge and the local `math` verifier wrap the gold
# in \boxed{} and run math-verify's math_metric with the same extraction configs (Gym pins
# math-verify 0.8.0, the project 0.9.x): on all of these they must give the same score.
CASES = [
    ("33", "The answer is \\boxed{33}.", 1.0),
    ("33", "\\boxed{34}", 0.0),
    ("0125", "\\boxed{125}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{2}{4}}", 1.0),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", 1.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("(1, 2)", "\\boxed{(1,2)}", 1.0),
    ("12", "so 12", 1.0),
    ("12", "I think it is 13", 0.0),
]

GYM_SCORE = """
import json, sys
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
from resources_servers.math_with_judge.app import _run_math_verify
verifier = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                       pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
print(json.dumps([_run_math_verify(verifier, gold, answer)[0] for gold, answer in json.load(sys.stdin)]))
"""


def test_local_math_verifier_agrees_with_gyms_math_with_judge(gym_python):
    pairs = [[gold, answer] for gold, answer, _ in CASES]
    proc = subprocess.run([str(gym_python), "-c", GYM_SCORE], input=json.dumps(pairs), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    gym = json.loads(proc.stdout)
    local = [score_completion({"verifier": "math", "answer": gold}, answer) for gold, answer, _ in CASES]
    expected = [score for _, _, score in CASES]
    assert gym == expected, list(zip(CASES, gym, strict=True))
    assert local == expected, list(zip(CASES, local, strict=True))


ROLLOUT = REPO / "tests" / "nemo_gym_rollout.py"


@pytest.mark.upstream  # Gym's servers, started for real: not the quick tier
def test_rlvr_rollout_through_gyms_real_servers_scores_the_answers(gym_python, rendered, tmp_path):
    """Rows converted by the engine's own code go through Gym's simple_agent -> vllm_model ->
    math_with_judge servers (real subprocesses); only vLLM is a loopback stand-in."""
    prepared = [
        {"id": "right", "prompt": "What is 30 + 3?", "answer": "33"},
        {"id": "wrong", "prompt": "What is 5 + 7?", "answer": "12"},
        {"id": "padded", "prompt": "Write 125 with four digits.", "answer": "0125"},
        {"id": "bare", "prompt": "What is 6 + 6?", "answer": "12"},
    ]
    replies = {
        "30 + 3": "30 + 3 = \\boxed{33}.",
        "5 + 7": "5 + 7 = \\boxed{13}",
        "four digits": "\\boxed{125}",
        "6 + 6": "so 12",
    }
    ctx = build_context(REPO, "rlvr", "nemo_gym")
    ref = agent_ref(get_path(ctx.config, "alignpipe.nemo_gym.default_agent_ref"))
    (tmp_path / "prepared.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prepared))
    convert_file(tmp_path / "prepared.jsonl", tmp_path / "rows.jsonl", ref)  # what the engine runs
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert all(BOXED_INSTRUCTION in row["responses_create_params"]["input"][0]["content"] for row in rows)
    (tmp_path / "replies.json").write_text(json.dumps(replies))

    proc = subprocess.Popen(
        [str(gym_python), str(ROLLOUT), str(rendered["rlvr"]), "rows.jsonl", "replies.json"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # Gym starts a local Ray; Ray >= 2.60 would write ~/.ray/auth_token for it, and every
        # later `ray start` on this machine would then demand that token.
        env={**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the servers are in its session
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith('{"rewards"')))
    # Right boxed answer 1.0, wrong 0.0; math-verify equates 125 with gold 0125; Gym 0.4.0 also
    # reads a bare final number (the boxed instruction is still what its own math data asks).
    assert result["rewards"] == [1.0, 0.0, 1.0, 1.0], result
