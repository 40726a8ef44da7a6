"""NeMo-RL's config checker (alignpipe/engines/nemo_rl/schema_check.py) forked per check from an
interpreter that has imported NeMo-RL's config stack once.

A check in a new interpreter spends about a second of CPU importing pydantic, OmegaConf, Hydra
and NeMo-RL's algorithm modules before it reads the config, and tests/test_nemo_rl_contract.py
runs dozens. The server (per test worker, in the schema venv, ``schema_python``) does those
imports the way the checker does them (its ``_prepare``: stand-ins for torch, ray and vLLM),
then forks a child per request (tests/fork_server.py) that runs the checker's ``main`` on the
request's arguments: the same code as ``python schema_check.py ARGS``.

    python -m tests.schema_server NEMO_RL_SRC
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

CHECKER = Path(__file__).resolve().parents[1] / "alignpipe" / "engines" / "nemo_rl" / "schema_check.py"
# What the checker imports for the four MasterConfigs (sft, dpo, rm, grpo) and the overrides.
PRELOAD = (
    "nemo_rl.utils.config",
    "nemo_rl.algorithms.sft",
    "nemo_rl.algorithms.dpo",
    "nemo_rl.algorithms.rm",
    "nemo_rl.algorithms.grpo",
    "hydra.core.override_parser.overrides_parser",
)


def main() -> None:
    from tests import fork_server

    src = Path(sys.argv[1]).resolve()
    spec = importlib.util.spec_from_file_location("schema_check", CHECKER)
    checker = importlib.util.module_from_spec(spec)
    sys.modules["schema_check"] = checker
    spec.loader.exec_module(checker)
    # The path a script run gives (its own folder first), not the repository's: its hydra_plugins
    # folder would otherwise be on Hydra's plugin search path.
    sys.path[0] = str(CHECKER.parent)
    checker._prepare(src)
    for module in PRELOAD:
        importlib.import_module(module)

    def become(argv: list[str]) -> None:
        sys.argv = [str(CHECKER), *argv]
        checker.main()

    fork_server.serve(become)


if __name__ == "__main__":
    main()
