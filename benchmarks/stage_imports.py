"""Import time of each stage process: every stage of dvc.lock run as DVC runs it, under Python's own
``-X importtime`` (``PYTHONPROFILEIMPORTTIME=1``), in a checkout whose pipeline has run; the sum of
the top-level imports' cumulative times, beside the process's wall time. ``-X importtime`` itself
adds a little to each import. Measured, never asserted; figures go to benchmarks/RESULTS.md.

Usage: ``python benchmarks/stage_imports.py REPO [--out benchmarks/results/stage_imports.json]``
(REPO: a clone after ``make repro``; its stages rewrite their outputs with the same bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

TOP_LEVEL = re.compile(
    r"^import time:\s+\d+ \|\s+(\d+) \| (\S.*)$"
)  # no indent: imported by the stage itself


def stage_commands(repo: Path) -> dict[str, str]:
    stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {name: s["cmd"] for name, s in stages.items()}


def measure(repo: Path, cmd: str) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPROFILEIMPORTTIME": "1",
        "PATH": f"{repo / '.venv' / 'bin'}:{os.environ['PATH']}",
    }
    env.pop("ALIGNPIPE_ROOT", None)
    start = time.perf_counter()
    proc = subprocess.run(shlex.split(cmd), cwd=repo, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    micros = [int(m.group(1)) for line in proc.stderr.splitlines() if (m := TOP_LEVEL.match(line))]
    return {"imports_s": round(sum(micros) / 1e6, 2), "process_wall_s": round(wall, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    rows = {name: measure(repo, cmd) for name, cmd in stage_commands(repo).items()}
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "?",
    )
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu, "stages": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| stage | imports s | process wall s |\n|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['imports_s']} | {r['process_wall_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
