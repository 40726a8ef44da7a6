"""Pre-flight: a stage's rendered config and launch command, checked by NeMo-RL's own code.

``alignpipe plan STAGE --check`` and every NeMo-RL launch run it before any GPU work:
the config goes through the same ``load_config`` -> Hydra overrides -> ``MasterConfig``
validation as the entry script, and the launch command through the script's own
``parse_args()``. Beyond upstream, keys its schema does not define are named with a
did-you-mean (NeMo-RL ignores them, so a typo silently keeps a default): an error in the
algorithm's own sections, a warning elsewhere; and under the Slurm launcher, the nodes and
GPUs sbatch requests must be what the stage's ``cluster`` section lays NeMo-RL out on.

Which NeMo-RL: ``$NEMO_RL_SRC`` (a v0.7.0 checkout), else ``runtime.nemo_rl_dir`` when it holds
one (inside the image). Which interpreter runs the check: ``$NEMO_RL_PYTHON``, else this one;
it needs pydantic, omegaconf and hydra-core (schema_check.py stands in for the rest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from alignpipe.config import get_path
from alignpipe.engines.nemo_rl.render import (
    RunPaths,
    dropped_training_knobs,
    entry_argv,
    entry_script,
    render,
)
from alignpipe.errors import ConfigError
from alignpipe.launch.slurm import SlurmSettings

# Run by path in NeMo-RL's interpreter (it imports nothing from alignpipe).
CHECKER_MODULE = "alignpipe.engines.nemo_rl.schema_check"
CHECKER = Path(__file__).with_name(CHECKER_MODULE.rsplit(".", 1)[1] + ".py")
TIMEOUT_S = 120


@dataclass
class Report:
    """What NeMo-RL's code said about one stage's config and launch command."""

    stage: str
    source: Path
    schema: str = ""
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def text(self) -> str:
        lines = [
            f"{self.stage}: {'valid' if self.ok else 'INVALID'} for {self.schema} (NeMo-RL at {self.source})"
        ]
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def nemo_rl_source(ctx) -> Path | None:
    """The NeMo-RL checkout to check against, or None when there is none here."""
    given = os.environ.get("NEMO_RL_SRC")
    if given:
        src = Path(given).expanduser()
        if not (src / "nemo_rl").is_dir() or not (src / "examples").is_dir():
            raise ConfigError(
                f"NEMO_RL_SRC={given} is not a NeMo-RL checkout (it needs nemo_rl/ and examples/)"
            )
        return src
    image_dir = Path(ctx.runtime.get("nemo_rl_dir") or "/opt/nemo-rl")
    return image_dir if (image_dir / "nemo_rl").is_dir() and (image_dir / "examples").is_dir() else None


def _run_checker(python: str, args: list[str]) -> dict[str, Any]:
    proc = subprocess.run([python, str(CHECKER), *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    return checker_result(python, proc)


def checker_result(python: str, proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """What schema_check.py printed last (a JSON line), or the error that says why it could not run."""
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ConfigError(
            f"the NeMo-RL pre-flight could not run with {python} ({'; '.join(tail)}); it needs pydantic, "
            "omegaconf and hydra-core there (set NEMO_RL_PYTHON to an interpreter that has them)"
        ) from None


def _where(ctx, key: str) -> str:
    """Where a user sets ``key``: their params.yaml knob if it exists, else the profile file."""
    knobs = ctx.params.get(ctx.name) or {}
    if get_path(knobs, key) is not None:
        return f"params.yaml {ctx.name}.{key}"
    return f"stages/{ctx.name}/config/{ctx.profile}.yaml {key}"


def check(ctx, cfg: dict[str, Any] | None = None, *, python: str | None = None) -> Report:
    """Validate the stage's rendered config (``cfg``, else rendered now) and launch command."""
    src = nemo_rl_source(ctx)
    if src is None:
        raise ConfigError(
            "no NeMo-RL checkout to check against: set NEMO_RL_SRC to a NeMo-RL v0.7.0 checkout "
            "(inside the image it is runtime.nemo_rl_dir, /opt/nemo-rl)"
        )
    python = python or os.environ.get("NEMO_RL_PYTHON") or sys.executable
    report = Report(ctx.name, src)
    with tempfile.TemporaryDirectory(prefix="alignpipe-preflight-") as tmp:
        paths = RunPaths(Path(tmp))
        if cfg is None:
            consumes = [p.path for p in ctx.contract.consumes]
            cfg = render(ctx.name, ctx.config, root=ctx.root, scratch=paths.scratch, consumes_paths=consumes)
        paths.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        script = entry_script(ctx.name, cfg)
        checked = _run_checker(
            python,
            ["stage", "--src", str(src), "--entry", script, "--config", str(paths.config), "--"]
            + entry_argv(ctx.name, cfg, paths.config),
        )
    config, launch = checked["config"], checked["argv"]
    report.schema = config.get("schema", "")
    for err in config.get("errors", []):
        report.errors.append(
            f"{err['key']}: {err['message']} (got {err['input']}); fix {_where(ctx, err['key'])}"
        )
    for unknown in config.get("unknown", []):
        hint = f"; did you mean '{unknown['suggestion']}'?" if unknown["suggestion"] else ""
        say = f"{unknown['key']} is not a key of {report.schema}{hint} (NeMo-RL would ignore it)"
        (report.errors if unknown["error"] else report.warnings).append(say)
    report.errors += [f"launch command: {err['message']}" for err in launch.get("errors", [])]
    report.errors += dropped_training_knobs(ctx.name, ctx.config)
    report.errors += slurm_allocation_errors(ctx, cfg)
    return report


def slurm_allocation_errors(ctx, cfg: dict[str, Any]) -> list[str]:
    """Under the Slurm launcher, what sbatch requests against what NeMo-RL will place.

    ``slurm.nodes`` is one allocation for every stage; NeMo-RL lays its workers out from the
    stage's ``cluster.num_nodes`` (plus ``env.nemo_gym.num_gpu_nodes`` for NeMo-Gym's own GPU
    servers, e.g. the GenRM judge). Too few nodes leave NeMo-RL waiting for a Ray cluster that
    never fills; too many leave nodes idle. ``slurm.gpus_per_node: 0`` requests no GPUs by
    count (the nodes' own), so only a non-zero value is compared with ``cluster.gpus_per_node``.
    """
    if ctx.nemo_rl_launcher != "slurm":
        return []
    slurm = SlurmSettings.from_params(ctx.params)
    num_nodes = get_path(cfg, "cluster.num_nodes", 1)
    gym_nodes = get_path(cfg, "env.nemo_gym.num_gpu_nodes", 0) or 0
    errors = []
    if slurm.nodes != num_nodes + gym_nodes:
        gym = f" + env.nemo_gym.num_gpu_nodes {gym_nodes}" if gym_nodes else ""
        errors.append(
            f"slurm.nodes is {slurm.nodes} but stage '{ctx.name}' needs {num_nodes + gym_nodes} node(s) "
            f"(cluster.num_nodes {num_nodes}{gym}): set params.yaml slurm.nodes to {num_nodes + gym_nodes}, "
            f"or {_where(ctx, 'cluster.num_nodes')} to {slurm.nodes - gym_nodes} (slurm.nodes is one "
            "request for every stage)"
        )
    gpus = get_path(cfg, "cluster.gpus_per_node")
    if slurm.gpus_per_node and gpus is not None and slurm.gpus_per_node != gpus:
        errors.append(
            f"slurm.gpus_per_node is {slurm.gpus_per_node} but stage '{ctx.name}' has cluster.gpus_per_node "
            f"{gpus}: set params.yaml slurm.gpus_per_node to {gpus}, or "
            f"{_where(ctx, 'cluster.gpus_per_node')} to {slurm.gpus_per_node}"
        )
    return errors


def require_valid(ctx, cfg: dict[str, Any] | None = None) -> Report:
    """``check``, raising a ConfigError that lists every problem when there is one."""
    report = check(ctx, cfg)
    if not report.ok:
        raise ConfigError("NeMo-RL pre-flight failed\n" + report.text())
    return report
