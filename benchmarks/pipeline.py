"""Whole tiny pipeline: `dvc repro --force` wall time, per-stage times, start-up overhead, no-op repro.

Runs in a fresh git copy of the working tree (never in the shared checkout):

1. ``dvc repro --force`` with ``ALIGNPIPE_TIMING`` set. Every output line is timestamped, so a
   stage's wall time runs from its "Running stage" line to the next one, including DVC's
   hashing and caching. Each stage process also records:
   * the time from process start to the first training step (trainers; start-up overhead);
   * its own wall and CPU time at the end.
   CPU seconds barely change with machine load, while wall seconds do.
2. ``dvc repro`` three times with nothing to do (the no-op cost: hashing deps, lock checks).

Usage: ``python benchmarks/pipeline.py [--workdir DIR] [--out benchmarks/results/pipeline.json]``
(``--workdir`` defaults to ``alignpipe-bench/pipeline`` under the system's temporary directory).
Measured, never asserted; figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNING = re.compile(r"^Running stage '([^']+)'")


def conditions() -> dict:
    load = os.getloadavg()
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
    }


def fresh_copy(workdir: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.conftest import copy_repo

    shutil.rmtree(workdir, ignore_errors=True)
    return copy_repo(workdir / "repo", git=True)


def env_for(workdir: Path, timing: Path | None) -> dict[str, str]:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "ALIGNPIPE_SCRATCH": str(workdir / "scratch"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",  # DVC's "Running stage" lines arrive when printed, for timestamps
    }
    env.pop("ALIGNPIPE_ROOT", None)
    if timing:
        env["ALIGNPIPE_TIMING"] = str(timing)
    return env


def timed_repro(
    root: Path, env: dict[str, str], log: Path, *args: str
) -> tuple[float, list[tuple[float, str]], int]:
    """Run `dvc repro ARGS`, returning total wall, (timestamp, stage) for each stage start, exit code."""
    starts: list[tuple[float, str]] = []
    t0 = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["dvc", "repro", *args],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.time()
            out.write(f"{now - t0:9.2f} {line}")
            if m := RUNNING.match(line):
                starts.append((now, m.group(1)))
        code = proc.wait()
    return time.time() - t0, starts, code


def per_stage(starts: list[tuple[float, str]], end: float, timing: Path) -> list[dict]:
    events: dict[str, dict[str, dict]] = {}
    heldout: dict[str, float] = {}  # seconds of held-out evaluation per stage (sampling, scoring, KL)
    if timing.is_file():
        for line in timing.read_text().splitlines():
            e = json.loads(line)
            events.setdefault(e["stage"], {})[e["event"]] = e
            if e["event"] == "heldout":
                heldout[e["stage"]] = heldout.get(e["stage"], 0.0) + e["seconds"]
    rows = []
    for i, (t, stage) in enumerate(starts):
        t_next = starts[i + 1][0] if i + 1 < len(starts) else end
        ev = events.get(stage, {})
        rows.append(
            {
                "stage": stage,
                "wall_s": round(t_next - t, 1),
                "process_wall_s": ev.get("end", {}).get("since_process_start_s"),
                "process_cpu_s": ev.get("end", {}).get("cpu_s"),
                "peak_rss_mb": ev.get("end", {}).get("peak_rss_mb"),
                "startup_to_first_step_s": ev.get("first_step", {}).get("since_process_start_s"),
                "startup_cpu_s": ev.get("first_step", {}).get("cpu_s"),
                "heldout_s": heldout.get(stage),
            }
        )
    return rows


def share(row: dict) -> str:
    if not row.get("heldout_s") or not row.get("process_wall_s"):
        return ""
    return f"{row['heldout_s']} ({row['heldout_s'] / row['process_wall_s']:.0%})"


def markdown(result: dict) -> str:
    lines = [
        f"conditions: {result['conditions_start']} -> {result['conditions_end']}",
        "",
        f"`dvc repro --force`: **{result['repro_force_wall_s']:.0f} s** wall (exit {result['exit_code']}); "
        f"no-op `dvc repro`: {result['noop_repro_wall_s']} s (median {result['noop_repro_median_s']:.1f} s)",
        "",
        "| stage | wall s (DVC) | process wall s | process CPU s | peak RSS MB | start -> first step s (CPU s) | held-out s (share) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["stages"]:
        first = (
            ""
            if r["startup_to_first_step_s"] is None
            else f"{r['startup_to_first_step_s']} ({r['startup_cpu_s']})"
        )
        lines.append(
            f"| {r['stage']} | {r['wall_s']} | {r['process_wall_s'] or ''} | {r['process_cpu_s'] or ''} "
            f"| {r.get('peak_rss_mb') or ''} | {first} | {share(r)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "alignpipe-bench" / "pipeline"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pipeline.json")
    parser.add_argument("--targets", nargs="*", default=[], help="stages to reproduce (default: all)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="compose params.yaml with this override, as `dvc exp run -S` does (repeatable)",
    )
    args = parser.parse_args()

    root = fresh_copy(args.workdir)
    if args.set:  # e.g. --set profile=small --set model.name=/path/to/model
        from alignpipe.config import compose_params_text

        (root / "params.yaml").write_text(compose_params_text(root, args.set))
        subprocess.run(["git", "commit", "-qam", "params: " + " ".join(args.set)], cwd=root, check=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
                            "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"})  # fmt: skip
    timing = args.workdir / "timing.jsonl"
    env = env_for(args.workdir, timing)
    result: dict = {"conditions_start": conditions(), "targets": args.targets or "all", "overrides": args.set}
    total, starts, code = timed_repro(root, env, args.workdir / "repro_force.log", "--force", *args.targets)
    result.update(
        repro_force_wall_s=round(total, 1),
        exit_code=code,
        stages=per_stage(starts, starts[0][0] + total if starts else time.time(), timing),
    )
    if code != 0:
        print(
            f"dvc repro --force failed (exit {code}); log: {args.workdir / 'repro_force.log'}",
            file=sys.stderr,
        )
    noop = []
    for i in range(3):
        wall, started, _ = timed_repro(
            root, env_for(args.workdir, None), args.workdir / f"repro_noop{i}.log", *args.targets
        )
        noop.append(round(wall, 2))
        if started:
            print(f"warning: the no-op repro ran {', '.join(s for _, s in started)}", file=sys.stderr)
    result.update(
        noop_repro_wall_s=noop, noop_repro_median_s=statistics.median(noop), conditions_end=conditions()
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
