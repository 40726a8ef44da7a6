"""alignpipe's verifier environment for NeMo-RL: the pure parts, on a host without nemo_rl/ray.

The NeMo-RL glue (Ray actor, register_env, ACTOR_ENVIRONMENT_REGISTRY, register_processor)
only runs inside the NeMo-RL image; the scoring it delegates to is exercised here.
"""

from __future__ import annotations

import importlib
import json
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


def test_environment_step_contract_without_ray() -> None:
    """step() returns one reward per conversation (via the pure path; torch builds the tensors)."""
    torch = pytest.importorskip("torch")
    env_cls = E._VerifierEnvironment
    E.torch, E.EnvironmentReturn = torch, _EnvReturn
    try:
        env = env_cls({"num_generations_per_prompt": 2})
        out = env.step(
            [conversation("sort 21", "12"), conversation("sort 21", "21")],
            [{"ground_truth": "12", "verifier": "exact"}] * 2,
        )
    finally:
        E.torch, E.EnvironmentReturn = None, None
    assert out.rewards.tolist() == [1.0, 0.0]
    assert out.terminateds.tolist() == [True, True]
    assert out.answers == ["12", "21"]
    assert [o["content"] for o in out.observations] == ["Environment: correct", "Environment: incorrect"]
    batch, metrics = env.global_post_process_and_metrics({"rewards": [1.0, 0.0, 0.0, 0.0]})
    assert metrics == {"accuracy": 0.25, "num_samples": 4.0, "pass@2": 0.5}


class _EnvReturn(dict):
    """Stand-in for NeMo-RL's EnvironmentReturn NamedTuple: same field names, attribute access."""

    def __getattr__(self, name):
        return self[name]


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


def test_batch_metrics_pass_at_group() -> None:
    assert E.batch_metrics([1, 0, 0, 0, 1, 1], 3) == {"accuracy": 0.5, "num_samples": 6.0, "pass@3": 1.0}
    assert "pass@4" not in E.batch_metrics([1, 0, 0], 4)  # incomplete groups: no pass@k


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


def test_grpo_driver_registers_then_runs_the_entry_script(tmp_path: Path) -> None:
    """The driver registers the env the two ways NeMo-RL v0.7.0 needs (nemo-rl.md §7) plus the
    processor, then runs examples/run_grpo.py as __main__ with its own argv. NeMo-RL's registry
    modules are stood in by minimal ones with the reference's names and signatures."""
    import subprocess
    import textwrap

    from tests.conftest import REPO

    fake = tmp_path / "site"
    modules = {
        "nemo_rl/__init__.py": "",
        "nemo_rl/data/__init__.py": "",
        "nemo_rl/data/processors.py": "PROCESSORS = {}\ndef register_processor(name, fn):\n    PROCESSORS[name] = fn\n",
        "nemo_rl/distributed/__init__.py": "",
        "nemo_rl/distributed/ray_actor_environment_registry.py": "ACTOR_ENVIRONMENT_REGISTRY = {}\n",
        "nemo_rl/distributed/virtual_cluster.py": "class PY_EXECUTABLES:\n    SYSTEM = 'SYSTEM-PYTHON'\n",
        "nemo_rl/environments/__init__.py": "",
        "nemo_rl/environments/utils.py": "ENV_REGISTRY = {}\ndef register_env(name, fqn):\n"
        "    ENV_REGISTRY[name] = {'actor_class_fqn': fqn}\n",
    }
    for rel, text in modules.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    checkout = tmp_path / "nemo-rl"
    (checkout / "examples").mkdir(parents=True)
    (checkout / "examples" / "run_grpo.py").write_text(
        textwrap.dedent(
            """
            import json, sys
            from nemo_rl.data.processors import PROCESSORS
            from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
            from nemo_rl.environments.utils import ENV_REGISTRY
            if __name__ == "__main__":
                print(json.dumps({"argv": sys.argv, "env": ENV_REGISTRY, "actors": ACTOR_ENVIRONMENT_REGISTRY,
                                  "processors": sorted(PROCESSORS)}))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "alignpipe.engines.nemo_rl.grpo_driver", "--entry", "examples/run_grpo.py",
         "--config", "/scratch/c.yaml", "grpo.max_num_steps=3"],
        cwd=checkout, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": f"{fake}:{REPO}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["argv"] == ["examples/run_grpo.py", "--config", "/scratch/c.yaml", "grpo.max_num_steps=3"]
    assert seen["env"] == {E.ENV_NAME: {"actor_class_fqn": E.ACTOR_FQN}}
    assert seen["actors"] == {E.ACTOR_FQN: "SYSTEM-PYTHON"}
    assert seen["processors"] == [E.PROCESSOR_NAME]
