"""alignpipe's verifier environment for NeMo-RL: the pure parts on a host without nemo_rl/ray,
and the registration through NeMo-RL's own registries (vendored source). The environment as a
real Ray actor inside NeMo-RL's data and reward path: tests/test_equivalence_rewards.py.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

from alignpipe.engines.nemo_rl import environment as E
from alignpipe.engines.nemo_rl.nemo_gym_data import BOXED_INSTRUCTION, agent_ref, convert_file
from alignpipe.errors import ConfigError


def test_module_imports_without_nemo_rl() -> None:
    assert "nemo_rl" not in sys.modules
    mod = importlib.reload(E)
    assert mod.HAVE_NEMO_RL is False
    # The FQN NeMo-RL's create_env resolves with hydra.utils.get_object must exist.
    module, _, name = mod.ACTOR_FQN.rpartition(".")
    assert getattr(importlib.import_module(module), name) is mod.VerifierEnvironment
    module, _, name = mod.DATASET_FQN.rpartition(".")
    assert getattr(importlib.import_module(module), name) is mod.VerifiedResponseDataset
    with pytest.raises(ImportError):
        mod.register()  # needs NeMo-RL: fails loudly rather than pretending


def conversation(prompt: str, completion: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def test_scores_with_each_rows_verifier() -> None:
    logs = [
        conversation("sort 312", "123"),
        conversation("sort 312", "321"),
        conversation("add 2 3", " 5.0 "),
        conversation("add 2 3", "6"),
    ]
    metadata = [
        {"ground_truth": "123", "verifier": "exact"},
        {"ground_truth": "123", "verifier": "exact"},
        {"ground_truth": "5", "verifier": "numeric"},
        {"ground_truth": "5", "verifier": "numeric"},
    ]
    assert E.score_batch(logs, metadata) == [1.0, 0.0, 1.0, 0.0]


def test_env_info_round_trip_keeps_code_tests() -> None:
    data = {
        "prompt": "f(x)=?",
        "answer": "ok",
        "verifier": "code",
        "tests": [{"input": "1", "output": "2"}],
        "task": "code",
    }
    row = E.format_row(data, "prompt", "answer", "rlvr-train")
    assert row["messages"][0] == {"role": "user", "content": "f(x)=?"}
    assert row["messages"][1] == {"role": "assistant", "content": "ok"}
    assert isinstance(row["tests"], str)  # Arrow-safe across rows of different shapes
    info = {"ground_truth": "ok", "verifier": row["verifier"], "tests": row["tests"], "task": row["task"]}
    assert E.row_from_env_info(info) == {
        "answer": "ok",
        "verifier": "code",
        "tests": data["tests"],
        "task": "code",
    }
    plain = E.format_row({"prompt": "p", "answer": 3}, "prompt", "answer", "t")
    assert plain["verifier"] == "exact" and plain["tests"] == ""
    assert E.row_from_env_info({"ground_truth": "3", "verifier": "exact", "tests": ""}) == {
        "answer": "3",
        "verifier": "exact",
    }


def test_last_assistant_turn_is_scored() -> None:
    log = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a1"},
        {"role": "environment", "content": "x"},
        {"role": "assistant", "content": "a2"},
    ]
    assert E.last_assistant_text(log) == "a2"
    assert E.last_assistant_text([{"role": "user", "content": "q"}]) == ""
    with pytest.raises(ValueError, match="2 conversations but 1 metadata"):
        E.score_batch([log, log], [{}])


def test_nemo_gym_rows(tmp_path: Path) -> None:
    src = tmp_path / "train.jsonl"
    src.write_text(
        json.dumps({"id": "a", "task": "sort", "prompt": "sort 21", "answer": "12", "verifier": "exact"})
        + "\n\n"
    )
    ref = agent_ref("responses_api_agents/math_with_judge_simple_agent")
    assert convert_file(src, tmp_path / "gym" / "train.jsonl", ref) == 1
    row = json.loads((tmp_path / "gym" / "train.jsonl").read_text())
    # math_with_judge scores \boxed{} answers: the prompt asks for one, as Gym's own math data does.
    content = row["responses_create_params"]["input"][0]["content"]
    assert content == BOXED_INSTRUCTION + "sort 21" and "\\boxed{}" in content
    assert row["question"] == "sort 21"
    assert row["agent_ref"] == {"type": "responses_api_agents", "name": "math_with_judge_simple_agent"}
    assert row["expected_answer"] == "12" and row["id"] == "a" and row["verifier"] == "exact"
    with pytest.raises(ConfigError, match="must look like '<type>/<name>'"):
        agent_ref("math_agent")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1: not valid JSON"):
        convert_file(bad, tmp_path / "out.jsonl", ref)


def test_grpo_driver_registers_then_runs_the_entry_script(tmp_path: Path, nemo_rl_src: Path) -> None:
    """The driver registers the env the two ways NeMo-RL v0.7.0 needs (nemo-rl.md §7) plus both
    processors, in NeMo-RL's own registries (the vendored source), then runs the entry script
    as __main__ with its own argv. The entry script here only reports what it sees."""
    import subprocess
    import textwrap

    from tests.conftest import REPO, nemo_rl_runtime_python

    checkout = tmp_path / "nemo-rl"
    (checkout / "examples").mkdir(parents=True)
    (checkout / "examples" / "run_grpo.py").write_text(
        textwrap.dedent(
            """
            import json, sys
            from nemo_rl.data.processors import PROCESSOR_REGISTRY
            from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
            from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES
            from nemo_rl.environments.utils import ENV_REGISTRY, get_actor_python_env
            if __name__ == "__main__":
                print(json.dumps({"argv": sys.argv, "env": ENV_REGISTRY, "system": PY_EXECUTABLES.SYSTEM,
                                  "actors": ACTOR_ENVIRONMENT_REGISTRY, "processors": sorted(PROCESSOR_REGISTRY),
                                  "python": get_actor_python_env(ENV_REGISTRY["alignpipe_verifier"]["actor_class_fqn"])}))
            """
        )
    )
    python = nemo_rl_runtime_python()
    proc = subprocess.run(
        [str(python), "-m", "alignpipe.engines.nemo_rl.grpo_driver", "--entry", "examples/run_grpo.py",
         "--config", "/scratch/c.yaml", "grpo.max_num_steps=3"],
        cwd=checkout, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{nemo_rl_src}:{REPO}"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["argv"] == ["examples/run_grpo.py", "--config", "/scratch/c.yaml", "grpo.max_num_steps=3"]
    assert seen["env"][E.ENV_NAME] == {"actor_class_fqn": E.ACTOR_FQN}
    assert "math" in seen["env"]  # NeMo-RL's own registry, not a stand-in
    assert seen["actors"][E.ACTOR_FQN] == seen["system"] == seen["python"]
    assert {E.PROCESSOR_NAME, E.RM_PROCESSOR_NAME, "math_hf_data_processor"} <= set(seen["processors"])
