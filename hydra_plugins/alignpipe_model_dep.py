"""``${alignpipe_model_dep:${model.name}}``: the path DVC hashes for the starting model.

DVC's Hydra composition (``dvc exp run``, and ``alignpipe params``) scans ``hydra_plugins``
on its plugins path (the repo root) before it composes conf/ into params.yaml, so importing
this module registers the resolver. A local model directory becomes ``model.dep``, which
dvc.yaml lists under the base stage's deps: editing a file of it re-runs base and everything
after it. DVC cannot declare an optional dep, so the tiny model and a Hub id (pinned by
``model.revision``, a param) point it at a file base already depends on, its contract.
Pure stdlib + OmegaConf: it runs inside the dvc process.
"""

from pathlib import Path

from omegaconf import OmegaConf

NO_LOCAL_MODEL = "stages/base/stage.toml"


def model_dep(name: str | None) -> str:
    if name is None or not str(name).strip():
        return NO_LOCAL_MODEL
    path = Path(str(name)).expanduser()
    return str(path) if path.is_dir() else NO_LOCAL_MODEL


OmegaConf.register_new_resolver("alignpipe_model_dep", model_dep, replace=True)
