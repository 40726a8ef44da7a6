"""Write params.yaml as `dvc exp run -S OVERRIDE...` composes it, for runs made stage by stage.

    python benchmarks/compose_params.py [--evaluate POLICY,...] OVERRIDE...

``--evaluate sft,rlvr``: evaluate compares only those policies (``models/<policy>``), without a
reward model or benchmark columns, so a run that trains only sft and rlvr can be evaluated.
Run in the checkout whose params.yaml it rewrites. Used by benchmarks/seeds_small.sh and
benchmarks/tools_small.sh.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from alignpipe.config import compose_params_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluate", help="comma-separated policies evaluate compares")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    params = yaml.safe_load(compose_params_text(Path.cwd(), args.overrides))
    if args.evaluate:
        params.setdefault("evaluate", {}).setdefault("alignpipe", {})["evaluate"] = {
            "policies": [{"name": p, "path": f"models/{p}"} for p in args.evaluate.split(",")],
            "reward_model": None,
            "benchmarks": None,
        }
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


if __name__ == "__main__":
    main()
