"""``${alignpipe_engine_dep:${runtime.engine},${profile},PATH}``: PATH when the stage runs on
NeMo-RL, else a file every trainer stage already depends on.

A trainer stage (sft, rm, dpo, rlvr, rlhf) runs NeMo-RL's renderer and the launchers only on the
nemo_rl engine. dvc.yaml lists these derived params among its deps, so editing that code re-runs
a GPU pipeline and leaves the tiny CPU one alone. DVC cannot declare an optional dep: on the
local engine the path is alignpipe/context.py, which decides the engine and which every stage
already depends on. ``auto`` is decided as alignpipe.context.runtime_settings decides it (a test
holds the two together). Loaded like alignpipe_model_dep.py; pure stdlib + OmegaConf.
"""

from omegaconf import OmegaConf

# alignpipe.context.LOCAL_PROFILES: the profiles `runtime.engine: auto` runs on the local engine.
LOCAL_PROFILES = ("tiny", "small")
ON_THE_LOCAL_ENGINE = "alignpipe/context.py"


def engine_dep(engine: str, profile: str, path: str) -> str:
    if engine == "auto":
        engine = "local" if profile in LOCAL_PROFILES else "nemo_rl"
    return path if engine == "nemo_rl" else ON_THE_LOCAL_ENGINE


OmegaConf.register_new_resolver("alignpipe_engine_dep", engine_dep, replace=True)
