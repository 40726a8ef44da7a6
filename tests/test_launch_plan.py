"""`alignpipe plan` prints the launch `alignpipe run` makes: one LaunchPlan, printed, then run
through real launchers (a process, podman, Slurm).

Where the launch lands, `alignpipe` is a recorder first on PATH: it writes the argv and the
environment it was started with, then execs the real `alignpipe`, so the stage runs and publishes
as it would. Each test compares that record, and what the launcher itself shows of the host
command, with the printed plan.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from alignpipe import cli
from alignpipe.context import build_context
from alignpipe.stage import launch_plan, run_stage
from tests.conftest import copy_repo, run_cli, set_params
from tests.test_container import PODMAN_HOST_ARGS, host_python_args
from tests.test_container import test_image as test_image  # noqa: F401  (the podman image fixture)

pytest_plugins = ["tests.clusters"]
pytestmark = pytest.mark.timeout(900)

SECRET = "hf_not_a_real_token_4c1d"
VENV_BIN = Path(sys.executable).parent
# The trainer's smallest run: the launch is the point, not the model.
TWO_STEPS = {"sft": {"sft": {"max_num_steps": 2}}}


@dataclass
class Printed:
    command: list[str]  # the launch line
    pinned: dict[str, str]  # `export NAME=value`
    forwarded: list[str]  # names, with " (secret)" where the plan marks one
    files: dict[str, str]  # every file `plan` printed, by name
    stdout: str


def printed_plan(root: Path, stage: str, capfd) -> Printed:
    """`alignpipe plan <stage>` as a person runs it, parsed."""
    capfd.readouterr()
    assert cli.main(["plan", stage]) == 0
    stdout = capfd.readouterr().out
    files = {}
    for block in stdout.split("==> ")[1:]:
        name, _, text = block.partition(" <==\n")
        files[name] = text.rstrip("\n") + "\n"
    lines = files[f"{stage}.launch.sh"].splitlines()
    (names,) = [line for line in lines if line.startswith("# Forwarded by name from this shell: ")]
    forwarded = names.split(": ", 1)[1].rstrip(".").split(", ")
    pinned = dict(shlex.split(line)[1].split("=", 1) for line in lines if line.startswith("export "))
    return Printed(shlex.split(lines[-1]), pinned, [] if forwarded == ["none"] else forwarded, files, stdout)


def recorder(where: Path) -> Path:
    """A directory holding an `alignpipe` that records its launch into $ALIGNPIPE_ROOT/launched.json."""
    where.mkdir(parents=True, exist_ok=True)
    shim = where / "alignpipe"
    shim.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "with open(os.path.join(os.environ['ALIGNPIPE_ROOT'], 'launched.json'), 'w') as f:\n"
        "    json.dump({'argv': ['alignpipe', *sys.argv[1:]], 'env': dict(os.environ)}, f)\n"
        f"os.execv({str(VENV_BIN / 'alignpipe')!r}, [{str(VENV_BIN / 'alignpipe')!r}, *sys.argv[1:]])\n"
    )
    shim.chmod(0o755)
    return where


def assert_env_as_printed(printed: Printed, launched_env: dict[str, str]) -> None:
    """The launched stage got every variable the plan names: alignpipe's values as printed, the
    forwarded ones with this shell's values; a secret's value was launched, never printed."""
    for name, value in printed.pinned.items():
        assert launched_env[name] == value, name
    names = [n.removesuffix(" (secret)") for n in printed.forwarded]
    for name in names:
        assert launched_env[name] == os.environ[name], name
    assert "HF_TOKEN (secret)" in printed.forwarded and launched_env["HF_TOKEN"] == SECRET
    assert SECRET not in printed.stdout


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    ws = copy_repo(tmp_path / "ws")
    monkeypatch.setenv("ALIGNPIPE_ROOT", str(ws))
    monkeypatch.setenv("ALIGNPIPE_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("HF_TOKEN", SECRET)  # forwarded by name, a secret
    monkeypatch.chdir(ws)
    return ws


def test_process_launch_is_the_printed_plan(workspace: Path, capfd, monkeypatch) -> None:
    """The process launcher runs the printed command with the printed environment."""
    printed = printed_plan(workspace, "prep", capfd)
    assert printed.command == ["alignpipe", "run", "prep", "--inner"]
    monkeypatch.setenv("PATH", f"{recorder(workspace.parent / 'bin')}:{os.environ['PATH']}")

    plan = launch_plan(build_context(workspace, "prep"))
    assert plan.launcher.name == "process" and plan.files() == {
        k: v for k, v in printed.files.items() if k.endswith(".launch.sh")
    }
    assert plan.run() == 0  # a real child process; outputs checked
    launched = json.loads((workspace / "launched.json").read_text())
    assert launched["argv"] == printed.command
    assert_env_as_printed(printed, launched["env"])
    assert (workspace / "data" / "prepared" / "manifest.json").is_file()


def trainer_inputs(ws: Path) -> None:
    """What sft consumes, made by the real stages in this process (prep, then base)."""
    for stage in ("prep", "base"):
        run_cli(ws, "run", stage)


@pytest.mark.container
def test_container_launch_is_the_printed_plan(workspace: Path, test_image: str, capfd) -> None:  # noqa: F811
    """`alignpipe run sft` on the container launcher runs, under real podman, the printed host
    command; inside, the stage gets the printed argv and environment, and trains."""
    trainer_inputs(workspace)
    shim = recorder(workspace.parent / "bin")
    mounts = host_python_args(workspace)[:-2]  # its `-e PATH=...` is replaced below
    set_params(workspace, {
        **TWO_STEPS,
        "runtime": {"launcher": "container", "image": test_image, "container_runtime": "podman", "gpus": "none",
                    "container_ulimits": {"memlock": None},
                    "container_args": [*PODMAN_HOST_ARGS, *mounts, "-v", f"{shim}:{shim}:ro",
                                       "-e", f"PATH={shim}:{VENV_BIN}:/usr/bin:/bin"]},
    })  # fmt: skip
    printed = printed_plan(workspace, "sft", capfd)
    assert printed.command[:2] == ["podman", "run"] and "-e" in printed.command

    capfd.readouterr()
    assert run_stage(workspace, "sft") == 0, capfd.readouterr()
    err = capfd.readouterr().err
    (shown,) = [line for line in err.splitlines() if line.startswith("alignpipe: podman run ")]
    assert shlex.split(shown.removeprefix("alignpipe: ")) == printed.command  # the host command, as run
    launched = json.loads((workspace / "launched.json").read_text())
    image_at = printed.command.index(test_image)
    assert launched["argv"] == printed.command[image_at + 1 :]  # the inner command, inside
    assert_env_as_printed(printed, launched["env"])
    # Each variable the plan names is on the command line: by name (or, for the scratch path
    # the launcher mounts, with its value).
    passed = {printed.command[i + 1].partition("=")[0] for i, a in enumerate(printed.command) if a == "-e"}
    assert {n.removesuffix(" (secret)") for n in printed.forwarded} | set(printed.pinned) <= passed
    assert json.loads((workspace / "models" / "sft" / "artifact.json").read_text())["stage"] == "sft"


@pytest.mark.slurm
def test_slurm_launch_is_the_printed_plan(workspace: Path, slurm, capfd) -> None:
    """`alignpipe run sft` on the Slurm launcher submits the printed batch script; the job runs
    the printed argv with the printed environment, and trains."""
    trainer_inputs(workspace)
    shim = recorder(workspace.parent / "bin")
    set_params(workspace, {
        **TWO_STEPS,
        "runtime": {"launcher": "slurm"},
        "slurm": {"gpus_per_node": 0, "time": "00:10:00", "setup": [f'export PATH={shim}:{VENV_BIN}:"$PATH"']},
    })  # fmt: skip
    printed = printed_plan(workspace, "sft", capfd)
    assert printed.command[:3] == ["sbatch", "--wait", "--parsable"]

    capfd.readouterr()
    assert run_stage(workspace, "sft") == 0, capfd.readouterr()
    script = workspace / "logs" / "slurm" / "sft.sbatch"
    assert printed.command[-1] == str(script) and script.read_text() == printed.files["sft.sbatch"]
    (record,) = (workspace / "logs" / "slurm").glob("sft-*.json")
    assert json.loads(record.read_text())["state"] == "COMPLETED"
    launched = json.loads((workspace / "launched.json").read_text())
    assert launched["argv"] == shlex.split(printed.files["sft.sbatch"].splitlines()[-1])[1:]  # exec ...
    assert_env_as_printed(printed, launched["env"])
    assert json.loads((workspace / "models" / "sft" / "artifact.json").read_text())["stage"] == "sft"


def test_a_stage_run_in_process_leaves_the_callers_environment_as_it_was(
    workspace: Path, monkeypatch
) -> None:
    """On the process launcher the stage's job is the calling process: it runs under the plan's
    environment (ALIGNPIPE_ROOT pinned to its checkout), and the caller gets its own back, so a
    later stage run from elsewhere (a test's dvc, a notebook's next call) is not sent here."""
    from alignpipe.stage import run_stage

    monkeypatch.delenv("ALIGNPIPE_ROOT")  # the caller's shell names no checkout
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the plan pins 1 for the run only
    before = dict(os.environ)
    plan = launch_plan(build_context(workspace, "prep"))
    assert plan.env["ALIGNPIPE_ROOT"] == str(workspace) and plan.env["HF_HUB_OFFLINE"] == "1"
    assert run_stage(workspace, "prep") == 0
    assert (workspace / "data" / "prepared" / "manifest.json").is_file()
    assert "ALIGNPIPE_ROOT" not in os.environ and os.environ["HF_HUB_OFFLINE"] == "0"
    assert {k: os.environ.get(k) for k in plan.env} == {k: before.get(k) for k in plan.env}
