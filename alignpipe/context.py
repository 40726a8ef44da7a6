"""What a stage knows about its run: paths, resolved config, runtime (engine, launcher), scratch
and the offline environment. Ground floor: engines and launchers read it; stage.py runs it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from alignpipe import config as C
from alignpipe.artifacts import MANIFEST, dvc_hash
from alignpipe.errors import ConfigError
from alignpipe.settings import AlignpipeSettings, from_config

ENGINES = ("local", "nemo_rl")
# Profiles that run on the local engine (TRL) when runtime.engine is auto: the tiny offline
# model on CPU, and a real small instruct model on CPU or one GPU. Every other one is NeMo-RL's.
LOCAL_PROFILES = ("tiny", "small")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# The local engine's torch on CPU: OpenMP threads that wait for work sleep instead of spinning.
# Spinning workers stall each other when the cores are shared: a tiny-model training step with 2
# threads next to two busy processes took 10x longer spinning, and 0.5x of one thread's time
# sleeping (benchmarks/RESULTS.md, "Threads"). libgomp reads it once, when torch is imported.
CPU_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def set_offline_env() -> None:
    """No network at run time: models and data come from paths or the local cache."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


def lift_offline_env() -> None:
    """The one exception to ``set_offline_env``: a stage whose knob allows downloads (base's
    ``model.download``, benchmark's ``download``) lets huggingface_hub and datasets reach the Hub.
    Both read the variables once, at import, so modules already imported are told as well."""
    import sys

    for name in OFFLINE_ENV:
        if name.endswith("_OFFLINE"):
            os.environ.pop(name, None)
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = False
    datasets = sys.modules.get("datasets.config")
    if datasets is not None:
        datasets.HF_HUB_OFFLINE = datasets.HF_DATASETS_OFFLINE = False


def set_cpu_env() -> None:
    """Before torch is imported: ``CPU_ENV``, unless the user set those variables, and the
    portable CPU kernels (alignpipe/cpu_kernels.py)."""
    from alignpipe import cpu_kernels

    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    cpu_kernels.pin()


# Where system prompt files live: a DVC dep of every stage that trains, so editing one re-runs them.
PROMPTS_DIR = "prompts"


def read_system_prompt(root: Path, path: str | None) -> str | None:
    """The text of a ``data.default.system_prompt_file`` (a path under prompts/), None if unset or empty."""
    if not path:
        return None
    where = "data.default.system_prompt_file"
    relative = Path(path)
    if relative.is_absolute() or relative.parts[:1] != (PROMPTS_DIR,) or ".." in relative.parts:
        raise ConfigError(
            f"{where}: '{path}' is not under {PROMPTS_DIR}/; put the file in {PROMPTS_DIR}/ (a DVC dep of "
            "every training stage, so changing it re-runs them) and give its repo-relative path"
        )
    file = root / relative
    if not file.is_file():
        raise ConfigError(f"{where}: {file} does not exist; create it or set the key to null")
    # As NeMo-RL's TaskDataSpec: the file's whole text; an empty file means no system turn.
    return file.read_text(encoding="utf-8") or None


def runtime_settings(params: dict[str, Any], profile: str) -> dict[str, Any]:
    """params.yaml ``runtime`` with ``auto`` engine/launcher decided from the profile."""
    runtime = dict(params.get("runtime") or {})
    engine = runtime.get("engine", "auto")
    if engine == "auto":
        engine = "local" if profile in LOCAL_PROFILES else "nemo_rl"
    if engine not in ENGINES:
        raise ConfigError(f"params.yaml: runtime.engine '{engine}' is not one of auto, {', '.join(ENGINES)}")
    launcher = runtime.get("launcher", "auto")
    if launcher == "auto":
        launcher = "process" if engine == "local" else "container"
    runtime.update(engine=engine, launcher=launcher)
    return runtime


def scratch_root(params: dict[str, Any]) -> Path:
    """Where resumable checkpoints live: outside DVC outs, which DVC deletes before a run."""
    configured = os.environ.get("ALIGNPIPE_SCRATCH") or (params.get("runtime") or {}).get("scratch_dir")
    return Path(configured or Path.home() / ".cache" / "alignpipe" / "scratch").expanduser()


@dataclass(frozen=True)
class ImageNeed:
    """Why a local-engine stage must run inside runtime.image (the pipeline's NeMo-RL image):
    ``what`` asked for it ("alignpipe.heldout.backend is vllm"), the software it ``needs`` that
    the image has ("vLLM"), and the ``fix`` when no launcher reaches the image."""

    what: str
    needs: str
    fix: str


@dataclass
class StageContext:
    """Everything an engine needs to run one stage."""

    name: str
    root: Path
    params: dict[str, Any]
    profile: str
    config: dict[str, Any]
    contract: C.StageContract
    runtime: dict[str, Any] = field(default_factory=dict)
    # The item of a DVC `foreach` stage (convert@dpo -> "dpo"); fills `{source}` in stage.toml paths.
    source: str | None = None
    # When the stage began (monotonic): the outcome line reports the stage's time.
    started: float = field(default_factory=time.monotonic, compare=False)

    @property
    def engine(self) -> str:
        return self.runtime["engine"] if "nemo_rl" in self.contract.engines else "local"

    @property
    def launcher(self) -> str:
        """Where the trainer runs: the one launcher choice (local-only stages run in this process)."""
        return self.runtime["launcher"] if "nemo_rl" in self.contract.engines else "process"

    @property
    def nemo_rl_launcher(self) -> str | None:
        """The launcher NeMo-RL work (training, its converter) runs through; None on the CPU engine."""
        return self.runtime["launcher"] if self.runtime["engine"] == "nemo_rl" else None

    def launcher_for(self, need: ImageNeed | None = None, *, inner: bool = False) -> str | None:
        """The one decision of where this run goes: None runs the engine in this process, else
        the launcher that runs ``alignpipe run <stage> --inner``. ``need``: the stage's reason to
        run inside runtime.image (``needs_image`` of its engine module), if it has one."""
        if inner:  # already where the launcher put it
            if need is not None:
                raise ConfigError(
                    f"{need.what}, but {need.needs} is not installed where the launcher ran this stage: "
                    "runtime.image must be the pipeline's NeMo-RL image (docs/GPU.md §2)"
                )
            return None
        if need is not None:
            if self.nemo_rl_launcher in (None, "process"):
                raise ConfigError(
                    f"{need.what}, but {need.needs} is not installed here and runtime.engine="
                    f"{self.runtime['engine']} / runtime.launcher={self.runtime['launcher']} gives no container "
                    f"to run it in; {need.fix}"
                )
            return self.nemo_rl_launcher
        return None if self.launcher == "process" else self.launcher

    @property
    def label(self) -> str:
        """``stage`` or ``stage@source`` (a DVC foreach item): how the console and launchers name it."""
        return f"{self.name}@{self.source}" if self.source else self.name

    @property
    def seed(self) -> int:
        return int(self.params.get("seed", 42))

    def input(self, name: str) -> Path:
        return self.root / self.contract.port(name).path

    def output(self, name: str) -> Path:
        return self.root / self.contract.port(name).path

    @property
    def inputs(self) -> dict[str, Path]:
        return {p.name: self.root / p.path for p in self.contract.consumes}

    @property
    def outputs(self) -> dict[str, Path]:
        return {p.name: self.root / p.path for p in self.contract.produces}

    @functools.cached_property
    def input_hashes(self) -> dict[str, dict[str, str]]:
        """DVC-style content hashes of every present input: the lineage of what we make."""
        return {
            name: {"path": str(path.relative_to(self.root)), "hash": dvc_hash(path)}
            for name, path in self.inputs.items()
            if path.exists()
        }

    def content_hash(self, path: Path) -> str:
        """DVC hash of ``path``: the one lineage already took when it is an input (each input is
        hashed once per run), else computed."""
        for name, entry in self.input_hashes.items():
            if Path(path).resolve() == self.inputs[name].resolve():
                return entry["hash"]
        return dvc_hash(path)

    @functools.cached_property
    def source_model(self) -> dict[str, Any] | None:
        """The starting model the input checkpoints descend from (their artifact.json
        ``source_model``, first written by base): carried into what this stage makes."""
        for path in self.inputs.values():
            manifest = path / MANIFEST
            if manifest.is_file():
                found = json.loads(manifest.read_text()).get("source_model")
                if found:
                    return found
        return None

    @functools.cached_property
    def settings(self) -> AlignpipeSettings:
        """The profile's ``alignpipe:`` section, typed (checked when the config was resolved)."""
        return from_config(self.config, f"stages/{self.name}/config/{self.profile}.yaml")

    @functools.cached_property
    def system_prompt(self) -> str | None:
        """The system turn this stage puts before every prompt: the text of NeMo-RL's
        ``data.default.system_prompt_file``. None when unset or empty (as in NeMo-RL): the model's
        chat template then adds its own default, if it has one (SmolLM2's is 16 tokens)."""
        return read_system_prompt(self.root, C.get_path(self.config, "data.default.system_prompt_file"))

    @functools.cached_property
    def run_key(self) -> str:
        """Identifies this exact run: resolved config, input content and the code's sources, so a
        checkpoint left by a killed run is resumed only by the code that wrote it."""
        from alignpipe.artifacts import package_hash

        code = package_hash(Path(__file__).resolve().parent)
        return C.config_hash(
            {"config": self.config, "inputs": self.input_hashes, "engine": self.engine, "code": code}
        )[:16]

    @property
    def scratch_dir(self) -> Path:
        """Resumable checkpoints for this run; removed once the stage publishes."""
        return scratch_root(self.params) / self.root.name / self.name / self.run_key

    def resolved_config_yaml(self) -> str:
        header = (
            f"# Effective config of stage '{self.name}' (profile '{self.profile}', engine '{self.engine}').\n"
            f"# Layers: stages/{self.name}/config/{self.profile}.yaml <- params.yaml '{self.name}' knobs <- seed.\n"
        )
        return header + C.to_yaml(self.config)


def build_context(
    root: Path, stage: str, profile: str | None = None, params: dict | None = None, source: str | None = None
) -> StageContext:
    params = C.load_params(root) if params is None else params
    if (
        profile
        and profile != params.get("profile", "tiny")
        and (root / "conf" / "profile" / f"{profile}.yaml").is_file()
    ):
        # `--profile P` means what `dvc exp run -S profile=P` would run: P's knobs from conf/,
        # not the committed profile's (tiny knobs such as lr=2e-3 must not leak into a GPU config).
        params = yaml.safe_load(C.compose_params_text(root, [f"profile={profile}"]))
    profile = profile or params.get("profile", "tiny")
    contract = C.with_source(C.load_contract(root, stage), source)
    cfg = C.resolve_stage_config(root, stage, params, profile)
    return StageContext(
        name=stage,
        root=root,
        params=params,
        profile=profile,
        config=cfg,
        contract=contract,
        runtime=runtime_settings(params, profile),
        source=source,
    )


def inner_argv(ctx: StageContext) -> list[str]:
    argv = ["alignpipe", "run", ctx.name, "--inner"]
    # The inner process reads params.yaml: pass --profile when that would pick another one
    # (ctx.params may be recomposed for --profile, so it cannot tell).
    params_file = ctx.root / C.PARAMS_FILE
    committed = C.load_params(ctx.root) if params_file.is_file() else ctx.params
    if ctx.profile != committed.get("profile", "tiny"):
        argv += ["--profile", ctx.profile]
    if ctx.source:
        argv += ["--source", ctx.source]
    return argv
