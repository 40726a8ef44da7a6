"""Where a test run's time goes: per test module, its JUnit seconds, the Python processes its
tests started and their CPU seconds; and per kind of process (a stage, `dvc`, a Ray worker).

    mkdir -p build
    PYTHONPATH=$PWD/benchmarks/suite_processes SUITE_PROCESS_LOG=$PWD/build/procs.jsonl \
        make test PYTEST_ARGS="-q --junitxml=$PWD/build/junit.xml"
    python benchmarks/suite_processes.py build/procs.jsonl --junit build/junit.xml

The log's path is absolute ($PWD): the processes it logs run in many directories.

How busy the machine was, minute by minute (what idle cores a test run leaves), from the
kernel's counters sampled beside it, whatever ran (killed runs, containers, Slurm jobs too):

    while sleep 5; do echo "$(date +%s) $(head -1 /proc/stat)"; done > build/cpu.log &
    python benchmarks/suite_processes.py build/procs.jsonl --cpu build/cpu.log

The log comes from benchmarks/suite_processes/sitecustomize.py. The shared fixtures' processes
(tests/conftest.py's ``build_once`` folders) count as "(fixture NAME)", not against the test that
happened to be running when they started; the pytest processes' own time is "(pytest)".
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

# build_once folders (tests/conftest.py) -> the fixture that builds them
FIXTURE_DIRS = {"tiny-pipeline": "tiny_pipeline", "trained-sft": "trained_sft", "prepared": "prepared_repo"}


def module_of(row: dict) -> str:
    """The fixture whose folder the process ran in, else the test module that started it
    (``tests/test_sft.py::test_y[a] (call)`` -> ``test_sft``), else ``(no test)``."""
    for folder, fixture in FIXTURE_DIRS.items():
        if f"/{folder}/" in row.get("cwd", "") + "/":
            return f"(fixture {fixture})"
    match = re.match(r"tests/(\w+)\.py", row["test"])
    return match.group(1) if match else "(no test)"


def kind_of(row: dict) -> str:
    """A short name for what a process was: ``alignpipe run rm``, ``dvc``, ``ray``..."""
    argv = row["argv"]
    if row.get("pytest"):
        return "(pytest)"
    if m := re.search(r"alignpipe (run|plan|launch) (\w+)", argv):
        return f"alignpipe {m.group(1)} {m.group(2)}"
    if "pip/__main__" in argv:
        return "pip install"
    for name in ("dvc", "ray", "lm_eval", "nemo_rl", "nemo_gym", "sandbox"):
        if name in argv:
            return name
    return argv.split(" ")[0].rsplit("/", 1)[-1][:40] or "(python -c)"


def junit_seconds(path: Path) -> dict[str, float]:
    """Setup + call + teardown seconds per test module, from a JUnit XML report."""
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        out[case.get("classname", "").rsplit(".", 1)[-1]] += float(case.get("time", 0))
    return out


def cpu_busy(path: Path, bucket_s: float = 120.0) -> list[tuple[float, float]]:
    """``(minutes since the first sample, share of all cores busy)`` per ``bucket_s``, from
    ``<epoch> cpu user nice system idle iowait irq softirq steal ...`` lines (/proc/stat)."""
    samples = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) > 6 and parts[1] == "cpu":
            ticks = [int(v) for v in parts[2:]]
            samples.append((float(parts[0]), sum(ticks), ticks[3] + ticks[4]))  # idle + iowait
    out, start = [], samples[0][0] if samples else 0.0
    first = 0
    for i in range(1, len(samples)):
        if samples[i][0] - samples[first][0] >= bucket_s or i == len(samples) - 1:
            total = samples[i][1] - samples[first][1]
            idle = samples[i][2] - samples[first][2]
            out.append(((samples[first][0] - start) / 60, 1 - idle / total if total else 0.0))
            first = i
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--junit", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cpu", type=Path, help="a /proc/stat sample log (see above)")
    args = parser.parse_args()
    if args.cpu:
        busy = cpu_busy(args.cpu)
        for minute, share in busy:
            print(f"min {minute:5.1f}  busy {share:6.1%}  " + "#" * round(share * 40))
        if busy:
            print(f"mean busy {sum(b for _, b in busy) / len(busy):.1%} over {len(busy)} buckets\n")
    rows = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    by_module: dict[str, list[dict]] = defaultdict(list)
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        kind = kind_of(row)
        by_kind[kind].append(row)
        if kind != "(pytest)":
            by_module[module_of(row)].append(row)
    junit = junit_seconds(args.junit) if args.junit else {}
    total = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} processes, {total:.0f} CPU s\n")
    print(f"{'module':34s} {'junit s':>8s} {'procs':>6s} {'cpu s':>8s}")
    modules = set(by_module) | set(junit)
    order = sorted(modules, key=lambda m: -max(junit.get(m, 0), sum(r["cpu_s"] for r in by_module[m])))
    for m in order[: args.top]:
        cpu = sum(r["cpu_s"] for r in by_module[m])
        print(f"{m:34s} {junit.get(m, 0):8.0f} {len(by_module[m]):6d} {cpu:8.0f}")
    if junit:
        print(f"{'(all modules)':34s} {sum(junit.values()):8.0f}")
    print(f"\n{'process kind':34s} {'count':>6s} {'cpu s':>8s} {'cpu s each':>11s}")
    for kind, group in sorted(by_kind.items(), key=lambda kv: -sum(r["cpu_s"] for r in kv[1]))[: args.top]:
        cpu = sum(r["cpu_s"] for r in group)
        print(f"{kind:34s} {len(group):6d} {cpu:8.0f} {cpu / len(group):11.1f}")


if __name__ == "__main__":
    main()
