"""DVC's own floor for a no-op `dvc repro`: a throwaway git + DVC repository with as many stages
as the tiny pipeline, each `echo` with one file dependency and one output, reproduced once, then
`dvc repro` with nothing to do, three times (median). Measured, never asserted; it says how much
of the project's no-op (benchmarks/pipeline.py) is DVC's and how much is the pipeline's.

Usage: ``python benchmarks/dvc_floor.py [--stages 16]`` (the `dvc` on PATH).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=16)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dvc-floor-") as tmp:
        root = Path(tmp)
        subprocess.run(["git", "init", "-q"], cwd=root, check=True)
        subprocess.run(["dvc", "init", "-q"], cwd=root, check=True)
        stages = {}
        for i in range(args.stages):
            (root / f"in{i}.txt").write_text(f"{i}\n")
            stages[f"s{i}"] = {
                "cmd": f"echo {i} > out{i}.txt",
                "deps": [f"in{i}.txt"],
                "outs": [f"out{i}.txt"],
            }
        (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
        subprocess.run(["dvc", "repro", "-q"], cwd=root, check=True, capture_output=True)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(["dvc", "repro"], cwd=root, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
    print(f"{args.stages} trivial stages, no-op dvc repro: median {statistics.median(times):.2f} s "
          f"({', '.join(f'{t:.2f}' for t in times)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
